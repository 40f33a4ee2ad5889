"""`tokenrouter-edge`: ask a question with token routing (and, with the voice extra, talk).

    tokenrouter-edge ask "TEXT" [--cloud URL|local|none] [--policy edge|cloud|router]
                     [--threshold T | --cloud-fraction F] [--max-tokens N] [--seed N] [--json]
    tokenrouter-edge models          list the registered models and their fingerprints
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from edge_client.answer import Answer
from edge_client.cloud_link import CloudRejected
from edge_client.generator import CHECK_MODES, DEFAULT_CHECK, DEFAULT_SYSTEM_PROMPT, GeneratorOptions, open_generator
from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, ModelNotFoundError, available_models


def add_generation_options(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that generates (ask, and the voice commands)."""
    p.add_argument("--cloud", default="local", help="ws:// URL of a cloud server, 'local' (start one on loopback) or 'none'")
    p.add_argument("--api-key", default="", help="API key for a remote cloud (default $TOKENROUTER_API_KEY)")
    p.add_argument("--edge-model", default=DEFAULT_EDGE_MODEL, help="registered name or .gguf path")
    p.add_argument("--cloud-model", default=DEFAULT_CLOUD_MODEL, help="model of the local cloud server")
    p.add_argument("--policy", choices=["edge", "cloud", "router"], default="router")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--threshold", type=float, default=None, help="route when the router score >= T")
    g.add_argument("--cloud-fraction", type=float, default=None, help="target fraction of cloud tokens, calibrated online (default 0.3)")
    p.add_argument("--router", default="auto", help="auto (the shipped learned router for the model pair, else entropy), entropy, top1, margin, or a router file")
    p.add_argument("--router-on-mismatch", choices=["error", "heuristic"], default="error", help="a router file trained for another device model: refuse, or warn and use entropy")
    p.add_argument("--warmup", type=int, default=0, help="first N tokens of each answer stay on the device")
    p.add_argument("--hysteresis", type=float, default=0.0, help="keep routing until the score drops below T - H")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=4, help="send device tokens to the cloud after N (0 = only with hard tokens)")
    p.add_argument("--cloud-timeout", type=float, default=2.0, help="seconds to wait for a hard token before finishing on the device")
    p.add_argument("--no-lookahead", action="store_true", help="do not use the cloud's guess for the token after each cloud token")
    p.add_argument("--lookahead-nats", type=float, default=1.0,
                   help="take the cloud's guess where it finds the device's token this many nats less likely (0: wherever they differ)")
    p.add_argument("--check", nargs="?", const="all", default=DEFAULT_CHECK, choices=CHECK_MODES,
                   help="the cloud's check: draft to each clause end, the cloud checks the clause in one round trip and "
                        "overrules a device token over --check-nats worse than its own choice (better answers, a round trip per clause). "
                        "Default 'after-first-clause': the first clause goes out at once (no first-audio delay); --check alone means "
                        "'all'; 'off': router and lookahead only")
    p.add_argument("--check-nats", type=float, default=1.0, help="with --check: how much less likely than the cloud's choice a device token may be")
    p.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT)


def options_from_args(args: argparse.Namespace) -> GeneratorOptions:
    return GeneratorOptions(
        edge_model=args.edge_model,
        cloud_model=args.cloud_model,
        cloud=args.cloud,
        api_key=args.api_key,
        policy=args.policy,
        threshold=0.5 if args.threshold is None else args.threshold,
        cloud_fraction=None if args.threshold is not None else (0.3 if args.cloud_fraction is None else args.cloud_fraction),
        warmup=args.warmup,
        hysteresis=args.hysteresis,
        router=args.router,
        router_on_mismatch=args.router_on_mismatch,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        sync_every=args.sync_every,
        cloud_timeout_s=args.cloud_timeout,
        lookahead=not args.no_lookahead,
        lookahead_nats=args.lookahead_nats,
        check=args.check,
        check_nats=args.check_nats,
        system_prompt=args.system_prompt,
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenrouter-edge", description="TokenRouter on-device assistant")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    ask = sub.add_parser("ask", help="answer one text question with token routing")
    ask.add_argument("text")
    ask.add_argument("--json", action="store_true", help="print one JSON object (see README)")
    ask.add_argument("--routing-log", metavar="FILE", help="write the binary routing log here (.jsonl: auditor export)")
    add_generation_options(ask)
    sub.add_parser("models", help="list registered models")
    try:
        from edge_client.voice.cli import add_subcommands  # the voice extra
    except ImportError:
        pass
    else:
        add_subcommands(sub)
    return ap


def render_human(answer: Answer, color: bool) -> str:
    """The answer with cloud-written tokens marked: [bold] in a terminal, «…» otherwise."""
    out: list[str] = []
    for text, route in zip(answer.pieces, answer.routes):
        if route == "cloud":
            out.append(f"\x1b[1;36m{text}\x1b[0m" if color else f"«{text}»")
        else:
            out.append(text)
    lat = answer.latency
    summary = (
        f"\n\n[{answer.policy}] {answer.n_tokens} tokens, {answer.n_cloud_tokens} from the cloud"
        f" ({100 * answer.n_cloud_tokens / max(answer.n_tokens, 1):.0f}%), first token {lat.first_token:.0f} ms,"
        f" {lat.per_token_p50:.1f} ms/token p50, total {lat.total:.0f} ms,"
        f" up {answer.bytes_up} B / down {answer.bytes_down} B"
    )
    if answer.degraded:
        summary += "\n(degraded: the cloud was unavailable, the device answered alone)"
    return "".join(out) + summary


def cmd_ask(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    messages = [{"role": "system", "content": opts.system_prompt}, {"role": "user", "content": args.text}]
    with open_generator(opts) as gen:
        answer = gen.generate(messages, max_tokens=opts.max_tokens)
    if args.routing_log:
        write_routing_log(answer, args.routing_log)
    if args.json:
        obj = answer.to_json()
        obj["edge_model_name"], obj["cloud_model_name"] = opts.edge_model, (opts.cloud_model if opts.cloud == "local" else opts.cloud)
        print(json.dumps(obj))
    else:
        print(render_human(answer, color=sys.stdout.isatty()))
    return 0


def write_routing_log(answer: Answer, path: str) -> None:
    from shared import routing_log

    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            f.write(routing_log.to_jsonl(answer.routing_log))
    else:
        with open(path, "wb") as f:
            f.write(answer.routing_log)


def cmd_models(args: argparse.Namespace) -> int:
    for name, desc in available_models().items():
        print(f"{name:24s} {desc}")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    handlers = {"ask": cmd_ask, "models": cmd_models}
    handler = handlers.get(args.command) or getattr(args, "handler", None)
    try:
        sys.exit(handler(args))
    except ModelNotFoundError as exc:
        sys.exit(f"tokenrouter-edge: {exc}")
    except CloudRejected as exc:
        sys.exit(f"tokenrouter-edge: {exc}")
    except ValueError as exc:
        sys.exit(f"tokenrouter-edge: {exc}")


if __name__ == "__main__":
    main()
