"""`tokenrouter-cloud serve`: run the cloud server."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from cloud_server.auth import load_keys
from cloud_server.config import ServerConfig
from models.registry import DEFAULT_CLOUD_MODEL, ModelNotFoundError

READY_LINE = "TOKENROUTER_CLOUD_READY"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenrouter-cloud", description="TokenRouter cloud server")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the routing WebSocket and health/info routes")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed on the ready line)")
    s.add_argument("--model", default=DEFAULT_CLOUD_MODEL, help="registered model name or .gguf path")
    s.add_argument("--api-keys", metavar="FILE", help="file of API keys (one per line); also $TOKENROUTER_API_KEYS")
    s.add_argument("--insecure", action="store_true", help="accept any API key (local use only)")
    s.add_argument("--n-ctx", type=int, default=8192, help="KV cells shared by all sessions")
    s.add_argument("--max-sessions", type=int, default=16)
    s.add_argument("--max-message-bytes", type=int, default=1 << 20)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--log-level", default="warning")
    s.add_argument("--ssl-certfile", help="serve wss:// with this certificate (uvicorn's TLS)")
    s.add_argument("--ssl-keyfile")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        model=args.model,
        api_keys=load_keys(args.api_keys),
        insecure=args.insecure,
        n_ctx=args.n_ctx,
        max_sessions=args.max_sessions,
        max_message_bytes=args.max_message_bytes,
        threads=args.threads,
    )
    import uvicorn

    from cloud_server.app import create_app

    try:
        app = create_app(config)
    except (ModelNotFoundError, ValueError) as exc:
        sys.exit(f"tokenrouter-cloud: {exc}")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(2048)  # listening before the ready line: early connections queue instead of failing
    except OSError as exc:
        sys.exit(f"tokenrouter-cloud: cannot listen on {args.host}:{args.port}: {exc.strerror}")
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            ws_max_size=config.max_message_bytes + 4096,  # our own check answers with a clear error first
            ws_ping_interval=20,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
        )
    )
    scheme = "wss" if args.ssl_certfile else "ws"
    print(f"{READY_LINE} url={scheme}://{args.host}:{port}/v1/route port={port}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
