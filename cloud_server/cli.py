"""`tokenrouter-cloud serve`: run the cloud server."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from fastapi import FastAPI

from cloud_server.app import create_app
from cloud_server.auth import digest, load_keys
from cloud_server.config import READY_LINE, ServerConfig
from cloud_server.drain import DrainingServer
from cloud_server.logs import setup_logging
from cloud_server.remote_engine import VERIFY_MODES
from models.registry import DEFAULT_CLOUD_MODEL, ModelNotFoundError
from shared.cpus import pin_to_cpus


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
    s.add_argument(
        "--cpus",
        metavar="LIST",
        help="run on these CPUs only, as taskset -c names them (0,2-3; Linux): e.g. a loopback server kept off "
        "the cores a device benchmark uses",
    )
    s.add_argument("--log-level", default="warning")
    s.add_argument(
        "--record-dir",
        metavar="DIR",
        help="flywheel (off by default, a privacy choice): record live hard tokens as training shards in DIR",
    )
    s.add_argument("--ssl-certfile", help="serve wss:// with this certificate (uvicorn's TLS)")
    s.add_argument("--ssl-keyfile")
    s.add_argument("--api-docs", action="store_true", help="serve FastAPI's /docs, /redoc and /openapi.json")
    _add_production_flags(s)
    h = sub.add_parser("hash-key", help="print the sha256 digest of an API key, for a key file that holds no secrets")
    h.add_argument("key")
    return ap


def _add_production_flags(s: argparse.ArgumentParser) -> None:
    """Scheduling, KV budget, limits, quotas, audit and remote-engine options (docs/server.md)."""
    d = ServerConfig()
    _add_scheduling_flags(s.add_argument_group("scheduling and KV budget"), d)
    limits = s.add_argument_group("limits and quotas")
    _add_connection_limits(limits, d)
    _add_key_quotas(limits, d)
    # tests: small kernel buffers show backpressure (hidden from --help)
    limits.add_argument("--socket-sndbuf", type=int, default=0, help=argparse.SUPPRESS)
    _add_audit_flags(s.add_argument_group("audit log"), d)
    _add_flywheel_flags(s.add_argument_group("flywheel (with --record-dir)"), d)
    remote = s.add_argument_group("remote engine (OpenAI-compatible completions: vLLM, SGLang, llama.cpp server)")
    _add_remote_engine_flags(remote, d)
    # the log format is listed in this group by --help, as it always was
    remote.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="json: one structured object per line"
    )


def _add_scheduling_flags(g: argparse._ArgumentGroup, d: ServerConfig) -> None:
    """How sessions share the engine: KV slots and eviction, batch sizes, GPU offload."""
    g.add_argument(
        "--kv-slots", type=int, default=None, help="sessions holding KV cells at once (default: --max-sessions)"
    )
    g.add_argument(
        "--evict-mode",
        choices=("recompute", "save"),
        default=d.evict_mode,
        help="what happens to an evicted idle session's KV",
    )
    g.add_argument(
        "--max-saved-mib",
        type=int,
        default=d.max_saved_bytes >> 20,
        help="host memory for saved KV states (evict-mode save)",
    )
    g.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens, help="tokens per batched decode")
    g.add_argument(
        "--max-session-step-tokens",
        type=int,
        default=d.max_session_step_tokens,
        help="tokens one session takes of one decode: a long prefill or verify is cut into chunks this size, "
        "interleaved with other sessions' work (larger: fewer passes for long prompts; smaller: shorter waits)",
    )
    g.add_argument(
        "--n-gpu-layers", type=int, default=0, help="offload this many layers to the GPU (CUDA build; -1 = all)"
    )
    g.add_argument(
        "--kv-layout",
        choices=("unified", "split"),
        default=d.kv_layout,
        help="split: each slot holds n_ctx/kv_slots cells, attention per session only (recommended for many sessions)",
    )


def _add_connection_limits(g: argparse._ArgumentGroup, d: ServerConfig) -> None:
    """What one connection may ask and how long it may idle or leave replies unread."""
    g.add_argument("--max-tokens-per-request", type=int, default=d.max_tokens_per_request)
    g.add_argument(
        "--max-prompt-messages",
        type=int,
        default=d.max_prompt_messages,
        help="messages a hello's prompt may hold (more: reject bad_field, before the template runs)",
    )
    g.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=d.max_prompt_bytes,
        help="bytes of text a hello's prompt may hold (more: reject bad_field, before it is tokenized)",
    )
    g.add_argument(
        "--max-messages-per-s", type=float, default=d.max_messages_per_s, help="per connection (bursts of 2x)"
    )
    g.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s)
    g.add_argument(
        "--drain-timeout-s",
        type=float,
        default=d.drain_timeout_s,
        help="on SIGTERM, how long sessions may finish their request before they are closed (0: stop at once); "
        "the process exits within this + 1 s, whatever its clients do",
    )
    g.add_argument(
        "--hello-timeout-s",
        type=float,
        default=d.hello_timeout_s,
        help="close a connection that has not said hello this long after connecting",
    )
    g.add_argument(
        "--max-pre-hello",
        type=int,
        default=d.max_pre_hello,
        help="connections waiting for their hello at once; one more is closed at once (1013)",
    )
    g.add_argument(
        "--max-pre-hello-per-address",
        type=int,
        default=d.max_pre_hello_per_address,
        help="... from one client address (behind a proxy, every client has the proxy's: set it to --max-pre-hello)",
    )
    g.add_argument(
        "--send-timeout-s",
        type=float,
        default=d.send_timeout_s,
        help="disconnect a device whose oldest unread reply is this old (or whose send blocks this long)",
    )
    g.add_argument(
        "--max-send-queue-bytes",
        type=int,
        default=d.max_send_queue_bytes,
        help="disconnect a device that leaves more than this many bytes of replies unread",
    )


def _add_key_quotas(g: argparse._ArgumentGroup, d: ServerConfig) -> None:
    """Each key's defaults (sessions, tokens, cloud share, KV churn, exploration) and the routing watch's alarms."""
    g.add_argument("--key-max-sessions", type=int, default=None, help="default per-key concurrent sessions")
    g.add_argument("--key-tokens-per-minute", type=int, default=None, help="default per-key cloud tokens per minute")
    g.add_argument(
        "--key-max-cloud-fraction",
        type=float,
        default=None,
        help="default abuse cap on a session's cloud-token fraction",
    )
    g.add_argument(
        "--key-kv-churn-per-minute",
        type=int,
        default=d.key_kv_churn_per_minute,
        help="default per-key KV cells per minute its sessions may make others recompute by evicting them "
        "(evict-mode recompute); past it, requests that would evict are refused with busy. 0: no evictions",
    )
    g.add_argument(
        "--key-explore-per-minute",
        type=int,
        default=d.key_explore_per_minute,
        help="default per-key exploration requests per minute (devices' --explore); past it they are declined "
        "(explore_limited) and the device writes the position. 0: none",
    )
    g.add_argument(
        "--key-engine-seconds-per-minute",
        type=float,
        default=d.key_engine_seconds_per_minute,
        help="default per-key engine seconds per minute its sessions may use (prefills of hellos and syncs, hard "
        "tokens, verifies); past it they wait until the budget refills (embedded engine). Default: no limit",
    )
    g.add_argument(
        "--alarm-quantile",
        type=float,
        default=d.alarm_quantile,
        help="routing watch: a session whose routed share, check overrule rate or explored disagreement falls "
        "outside all but this share of the fleet's sessions on either side raises an alarm (metric, log, audit)",
    )
    g.add_argument(
        "--alarm-min-sessions",
        type=int,
        default=d.alarm_min_sessions,
        help="routing watch: sessions seen before its band is trusted",
    )
    g.add_argument(
        "--alarm-min-keys",
        type=int,
        default=d.alarm_min_keys,
        help="routing watch: keys other than a session's own whose sessions form the band before it is judged "
        "(each key weighs as one device); 0: a fleet behind one key, whose sessions judge each other",
    )
    g.add_argument(
        "--abuse-warmup-tokens",
        type=int,
        default=d.abuse_warmup_tokens,
        help="tokens before the cloud-fraction cap applies",
    )


def _add_flywheel_flags(g: argparse._ArgumentGroup, d: ServerConfig) -> None:
    """What the flywheel records and how much of it (cloud_server/flywheel.py)."""
    g.add_argument(
        "--record-edge-model",
        action="append",
        default=[],
        metavar="NAME_OR_GGUF",
        help="also record rows of this edge model (repeatable); the shipped routers' edge models and the cloud's "
        "own are known, rows of other models or of another hidden-state width are dropped",
    )
    g.add_argument(
        "--record-queue-mib",
        type=int,
        default=d.record_queue_bytes >> 20,
        help="hidden states waiting for the flywheel's writer thread; past it, rows are dropped (counted)",
    )
    g.add_argument(
        "--record-max-mib",
        type=int,
        default=d.record_max_bytes >> 20,
        help="shards the record dir may hold; past it, rows are dropped (counted)",
    )


def _add_audit_flags(g: argparse._ArgumentGroup, d: ServerConfig) -> None:
    g.add_argument("--audit-dir", help="keep per-session routing logs here")
    g.add_argument("--audit-sample-rate", type=float, default=d.audit_sample_rate)
    g.add_argument("--audit-retention-days", type=float, default=d.audit_retention_days)
    g.add_argument("--audit-token-ids", action="store_true", help="also store token ids (off: privacy)")


def _add_remote_engine_flags(g: argparse._ArgumentGroup, d: ServerConfig) -> None:
    g.add_argument(
        "--remote-url", help="e.g. http://vllm:8000/v1; --model then names a GGUF of the same model for its tokenizer"
    )
    g.add_argument("--remote-model", default="", help="model name the remote server serves")
    g.add_argument(
        "--remote-api-key", default="", help="bearer token for the remote server (or $TOKENROUTER_REMOTE_API_KEY)"
    )
    g.add_argument("--remote-prompt-format", choices=("ids", "text"), default=d.remote_prompt_format)
    g.add_argument(
        "--remote-verify",
        choices=VERIFY_MODES,
        default=d.remote_verify,
        help="how the engine judges drafts: vLLM's prompt_logprobs, echo + logprobs, its own greedy continuation, "
        "or off; auto: the first the engine answers (docs/server.md)",
    )
    g.add_argument(
        "--remote-timeout", type=float, default=d.remote_timeout_s, help="seconds one engine request may take"
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "hash-key":
        print(digest(args.key))
        return
    setup_logging(args.log_level, args.log_format)
    if args.cpus:
        try:
            pin_to_cpus(args.cpus)
        except ValueError as exc:
            sys.exit(f"tokenrouter-cloud: --cpus: {exc}")
    config = config_from_args(args)
    try:
        app = create_app(config)
    except (ModelNotFoundError, ValueError) as exc:
        sys.exit(f"tokenrouter-cloud: {exc}")
    sock = _listen(args.host, args.port, args.socket_sndbuf)
    port = sock.getsockname()[1]
    server = _draining_server(app, config, args)
    scheme = "wss" if args.ssl_certfile else "ws"
    print(f"{READY_LINE} url={scheme}://{args.host}:{port}/v1/route port={port}", flush=True)
    server.run(sockets=[sock])
    _exit_now()


def _exit_now() -> None:
    """Exit once the server has shut down (sessions closed, engine stopped, the log written): the
    interpreter's own teardown (freeing the model and every module, 0.6 s on the 2-core VM) would
    otherwise spend most of the second a drain promises past its deadline (cloud_server/drain.py)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's configuration from `serve`'s flags (an API key file is read here)."""
    return ServerConfig(
        model=args.model,
        api_keys=load_keys(args.api_keys),
        insecure=args.insecure,
        n_ctx=args.n_ctx,
        max_sessions=args.max_sessions,
        max_message_bytes=args.max_message_bytes,
        threads=args.threads,
        record_dir=args.record_dir,
        record_edge_models=args.record_edge_model,
        record_queue_bytes=args.record_queue_mib << 20,
        record_max_bytes=args.record_max_mib << 20,
        kv_slots=args.kv_slots,
        evict_mode=args.evict_mode,
        max_saved_bytes=args.max_saved_mib << 20,
        max_batch_tokens=args.max_batch_tokens,
        max_session_step_tokens=args.max_session_step_tokens,
        kv_layout=args.kv_layout,
        n_gpu_layers=args.n_gpu_layers,
        max_tokens_per_request=args.max_tokens_per_request,
        max_prompt_messages=args.max_prompt_messages,
        max_prompt_bytes=args.max_prompt_bytes,
        max_messages_per_s=args.max_messages_per_s,
        idle_timeout_s=args.idle_timeout_s,
        send_timeout_s=args.send_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        hello_timeout_s=args.hello_timeout_s,
        max_pre_hello=args.max_pre_hello,
        max_pre_hello_per_address=args.max_pre_hello_per_address,
        api_docs=args.api_docs,
        max_send_queue_bytes=args.max_send_queue_bytes,
        key_max_sessions=args.key_max_sessions,
        key_tokens_per_minute=args.key_tokens_per_minute,
        key_max_cloud_fraction=args.key_max_cloud_fraction,
        key_kv_churn_per_minute=args.key_kv_churn_per_minute,
        key_explore_per_minute=args.key_explore_per_minute,
        key_engine_seconds_per_minute=args.key_engine_seconds_per_minute,
        alarm_quantile=args.alarm_quantile,
        alarm_min_sessions=args.alarm_min_sessions,
        alarm_min_keys=args.alarm_min_keys,
        abuse_warmup_tokens=args.abuse_warmup_tokens,
        audit_dir=args.audit_dir,
        audit_sample_rate=args.audit_sample_rate,
        audit_retention_days=args.audit_retention_days,
        audit_token_ids=args.audit_token_ids,
        remote_url=args.remote_url,
        remote_model=args.remote_model,
        remote_api_key=args.remote_api_key or os.environ.get("TOKENROUTER_REMOTE_API_KEY", ""),
        remote_prompt_format=args.remote_prompt_format,
        remote_verify=args.remote_verify,
        remote_timeout_s=args.remote_timeout,
    )


def _listen(host: str, port: int, sndbuf: int) -> socket.socket:
    """The listening socket, bound before the ready line: early connections queue instead of failing."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf:  # accepted sockets inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # listening before the ready line: early connections queue instead of failing
    except OSError as exc:
        sys.exit(f"tokenrouter-cloud: cannot listen on {host}:{port}: {exc.strerror}")
    return sock


def _draining_server(app: FastAPI, config: ServerConfig, args: argparse.Namespace) -> DrainingServer:
    """uvicorn serving `app`, which on SIGTERM drains its sessions first (cloud_server/drain.py)."""
    import uvicorn

    return DrainingServer(
        app.state.drain,
        config.drain_timeout_s,
        uvicorn.Config(
            app,
            log_level=args.log_level,
            log_config=None,  # uvicorn's loggers go through our handler: one format, no query strings
            ws_max_size=config.max_message_bytes + 4096,  # our own check answers with a clear error first
            ws_per_message_deflate=False,  # replies are small; a client's deflate would cost CPU and blur the send budget
            ws_ping_interval=20,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
        ),
    )


if __name__ == "__main__":
    main()
