"""`tokenrouter-edge`: ask a question with token routing (and, with the voice extra, talk).

tokenrouter-edge ask "TEXT" [--cloud URL|local|none] [--policy edge|cloud|router]
                 [--threshold T | --cloud-fraction F] [--max-tokens N] [--seed N] [--json]
tokenrouter-edge models          list the registered models and their fingerprints
tokenrouter-edge app             the desktop assistant: a local page in the browser (docs/app.md)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from edge_client.answer import Answer
from edge_client.cloud_link import CloudRejected
from edge_client.generator import open_generator
from edge_client.options_cli import add_generation_options, options_from_args
from edge_client.voice.cli import add_subcommands
from edge_client.webapp.cli import add_app_subcommand
from models.registry import ModelNotFoundError, available_models
from shared import routing_log


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
    add_subcommands(sub)  # devices, listen, file (edge_client/voice/cli.py)
    add_app_subcommand(sub)  # app: the desktop assistant in the browser (edge_client/webapp/cli.py)
    return ap


def marked_text(answer: Answer, start: str = "«", end: str = "»") -> str:
    """The answer's text with each run of cloud-written tokens between `start` and `end`."""
    out: list[str] = []
    inside = False
    for text, route in zip(answer.pieces, answer.routes):
        if (route == "cloud") != inside:
            out.append(end if inside else start)
            inside = not inside
        out.append(text)
    return "".join(out) + (end if inside else "")


def render_human(answer: Answer, color: bool) -> str:
    """The answer with cloud-written tokens marked: [bold] in a terminal, «…» otherwise."""
    marked = marked_text(answer, "\x1b[1;36m", "\x1b[0m") if color else marked_text(answer)
    lat = answer.latency
    summary = (
        f"\n\n[{answer.policy}] {answer.n_tokens} tokens, {answer.n_cloud_tokens} from the cloud"
        f" ({100 * answer.n_cloud_tokens / max(answer.n_tokens, 1):.0f}%), first token {lat.first_token:.0f} ms,"
        f" {lat.per_token_p50:.1f} ms/token p50, total {lat.total:.0f} ms,"
        f" up {answer.bytes_up} B / down {answer.bytes_down} B"
    )
    if answer.cloud_mode not in ("", "none"):
        summary += f"\ncloud mode {answer.cloud_mode}"
        if answer.cloud_capabilities is not None:
            summary += f" (the server can: {', '.join(answer.cloud_capabilities)})"
        if answer.cloud_mode != answer.cloud_mode_asked:
            summary += f"; asked for {answer.cloud_mode_asked}, which this server cannot do"
        w = answer.traffic.work
        summary += (
            f"\ncloud work: {w.passes} forward passes, {w.tokens} tokens processed"
            f" (prefill {w.prefill_tokens}, generate {w.generate_tokens}, verify {w.verify_tokens},"
            f" guess {w.guess_tokens}), {w.engine_requests} engine requests"
        )
    if answer.degraded:
        summary += f"\n(degraded: the cloud was unavailable ({answer.degraded_reason}), the device answered alone)"
    return marked + summary


def cmd_ask(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    messages = [{"role": "system", "content": opts.system_prompt}, {"role": "user", "content": args.text}]
    with open_generator(opts) as gen:
        answer = gen.generate(messages, max_tokens=opts.max_tokens)
    for note in answer.warnings:
        print(f"tokenrouter-edge: warning: {note}", file=sys.stderr)
    if args.routing_log:
        write_routing_log(answer, args.routing_log)
    if args.json:
        obj = answer.to_json()
        obj["edge_model_name"], obj["cloud_model_name"] = (
            opts.edge_model,
            (opts.cloud_model if opts.cloud == "local" else opts.cloud),
        )
        print(json.dumps(obj))
    else:
        print(render_human(answer, color=sys.stdout.isatty()))
    return 0


def write_routing_log(answer: Answer, path: str) -> None:
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            f.write(routing_log.to_jsonl(answer.routing_log))
    else:
        with open(path, "wb") as f:
            f.write(answer.routing_log)


def cmd_models(args: argparse.Namespace) -> int:
    for name, desc in available_models().items():  # base models say so
        print(f"{name:24s} {desc}")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
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
