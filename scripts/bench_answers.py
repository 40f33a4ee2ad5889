"""Answers a person would accept, per configuration: the question set's right answers, side by side.

    python scripts/bench_answers.py --split tune                      # device, cloud, default, check-all
    python scripts/bench_answers.py --split tune --configs default --set check=all --set lookahead=false
    python scripts/bench_answers.py --split test --out build/answers/test   # report once, at the end

Each question of models/train/answers (models/train/answer_set.py) is asked as `tokenrouter-edge ask`
asks it (a fresh generator, greedy, the `ask` system prompt) with the device model and a loopback
cloud server, under each configuration:

- `device`: the device alone (`--policy edge --cloud none`);
- `cloud`: the cloud alone (`--policy cloud`, streamed);
- `default`: every default (router, lookahead, the check after the first clause);
- `check-all`: the default with `--check all`.

`--set KEY=VALUE` changes a GeneratorOptions field in the routed configurations (`default`,
`check-all`). The multi-turn sessions are asked through the voice app's dialogue (its system
prompt and memory policy, `--memory`), one generator a session, as the app asks them.

Reported per configuration: right answers (the needed words and no first-glance failure) by kind,
each first-glance check's count, the share of the cloud alone's right answers it keeps, cloud
tokens, degraded answers; for the sessions, follow-ups right and unrelated answers that carry an
earlier answer's words. `OUT.md` lays every answer side by side (cloud tokens in «»), for reading:
a figure reported from this goes with answers read and graded (docs/router.md, "Read side by side").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cloud_server.local import LocalCloudServer  # noqa: E402
from edge_client.answer import Answer  # noqa: E402
from edge_client.cli import marked_text  # noqa: E402
from edge_client.cloud_link import CloudLink  # noqa: E402
from edge_client.generator import RoutedGenerator  # noqa: E402
from edge_client.options import GeneratorOptions  # noqa: E402
from edge_client.voice.dialogue import Dialogue, DialogueOptions  # noqa: E402
from models.registry import model_info  # noqa: E402
from models.train.answer_set import KINDS, Question, first_glance, has_words, load_questions, load_sessions  # noqa: E402
from models.train.person_check import carries_earlier_answer  # noqa: E402
from shared.llama_backend import LlamaModel  # noqa: E402
from shared.prompting import DEFAULT_SYSTEM_PROMPT  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "device": {"policy": "edge", "cloud": "none"},
    "cloud": {"policy": "cloud"},
    "default": {},
    "check-all": {"check": "all"},
}
ROUTED = ("default", "check-all")


def parse_set(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as GeneratorOptions fields, each VALUE read as its field's type."""
    fields = {f.name: f for f in dataclasses.fields(GeneratorOptions)}
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise SystemExit(f"--set {item!r}: use KEY=VALUE with KEY a GeneratorOptions field")
        default = getattr(GeneratorOptions(), key)
        if isinstance(default, bool):
            out[key] = value.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            out[key] = type(default)(value)
        elif default is None:
            out[key] = None if value.lower() == "none" else float(value)
        else:
            out[key] = value
    return out


def options(name: str, max_tokens: int, extra: dict[str, Any]) -> GeneratorOptions:
    fields = {**CONFIGS[name], **(extra if name in ROUTED else {})}
    return dataclasses.replace(GeneratorOptions(max_tokens=max_tokens, seed=0, cloud_timeout_s=10.0), **fields)


def ask(edge: LlamaModel, opts: GeneratorOptions, server: LocalCloudServer, messages: list[dict]) -> Answer:
    """One answer from a fresh generator (what `ask` does)."""
    gen = fresh(edge, opts, server)
    try:
        return gen.generate(messages)
    finally:
        gen.close()


def fresh(edge: LlamaModel, opts: GeneratorOptions, server: LocalCloudServer) -> RoutedGenerator:
    connect = None if opts.cloud == "none" else (lambda: CloudLink(server.url, server.api_key, timeout_s=10.0))
    return RoutedGenerator(edge, opts, connect)


def row(q: Question, a: Answer, instructions: str) -> dict[str, Any]:
    failed = first_glance(q.question, a.text, instructions)
    words = has_words(a.text, q.need)
    return {
        "question": q.question,
        "kind": q.kind,
        "text": a.text,
        "marked": marked_text(a),
        "words": words,
        "right": words and not failed,
        "failed": failed,
        "n_tokens": a.n_tokens,
        "n_cloud_tokens": a.n_cloud_tokens,
        "degraded": a.degraded,
        "degraded_reason": a.degraded_reason,
    }


def summary(rows: list[dict], cloud_right: set[str] | None) -> dict[str, Any]:
    right = {r["question"] for r in rows if r["right"]}
    checks = ("loops", "says_question_back", "recites_instructions", "speaks_as_user", "continues_transcript")
    out: dict[str, Any] = {
        "answers": len(rows),
        "right": len(right),
        "right_by_kind": {k: sum(r["right"] for r in rows if r["kind"] == k) for k in KINDS},
        **{c: sum(c in r["failed"] for r in rows) for c in checks},
        "cloud_token_share": round(
            sum(r["n_cloud_tokens"] for r in rows) / max(sum(r["n_tokens"] for r in rows), 1), 3
        ),
        "degraded": sum(r["degraded"] for r in rows),
    }
    if cloud_right:
        out["keeps_cloud_right"] = round(len(right & cloud_right) / len(cloud_right), 3)
    return out


def run_questions(
    edge: LlamaModel, server: LocalCloudServer, questions: list[Question], names: list[str], args, extra
) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for name in names:
        opts = options(name, args.max_tokens, extra)
        rows[name] = []
        for q in questions:
            msgs = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": q.question}]
            rows[name].append(row(q, ask(edge, opts, server, msgs), DEFAULT_SYSTEM_PROMPT))
        print(f"{name}: {sum(r['right'] for r in rows[name])}/{len(questions)} right", file=sys.stderr)
    return rows


def run_sessions(edge: LlamaModel, server: LocalCloudServer, split: str, names: list[str], args, extra) -> dict:
    """Each session through the voice app's dialogue, one generator a session."""
    out: dict[str, Any] = {}
    for name in names:
        opts = options(name, args.max_tokens, extra)
        turns: list[dict] = []
        for session in load_sessions(split):
            dialogue = Dialogue(DialogueOptions(memory=args.memory))
            gen = fresh(edge, opts, server)
            earlier: list[str] = []
            try:
                for q in session.turns:
                    a = gen.generate(dialogue.messages(q.question))
                    r = row(q, a, dialogue.opts.system_prompt) | {"session": session.index, "follow_up": q.follow_up}
                    r["carries"] = not q.follow_up and carries_earlier_answer(q.question, a.text, earlier)
                    turns.append(r)
                    earlier.append(a.text)
                    dialogue.add_exchange(q.question, a.text)
            finally:
                gen.close()
        follow = [t for t in turns if t["follow_up"]]
        out[name] = {
            "turns": turns,
            "follow_ups_right": sum(t["right"] for t in follow),
            "follow_ups": len(follow),
            "unrelated_carrying_earlier_words": sum(t["carries"] for t in turns),
            "unrelated": len(turns) - len(follow),
            "right": sum(t["right"] for t in turns),
        }
        print(f"{name} sessions: {out[name]['right']}/{len(turns)} right", file=sys.stderr)
    return out


def side_by_side(rows: dict[str, list[dict]], sessions: dict[str, Any]) -> str:
    """Every answer under its question, one line a configuration (✓ right, ✗ not; the failed checks)."""
    names = list(rows)
    lines = [
        "# Answers side by side",
        "",
        "«»: tokens the cloud wrote. ✓: needed words and no first-glance failure.",
        "",
    ]
    for i, first in enumerate(rows[names[0]]):
        lines.append(f"## {i + 1}. {first['question']} ({first['kind']})")
        for name in names:
            r = rows[name][i]
            mark = "✓" if r["right"] else "✗"
            why = f" [{', '.join(r['failed'])}]" if r["failed"] else ""
            lines.append(f"- **{name}** {mark}{why}: {r['marked'].strip()!r}")
        lines.append("")
    for name, s in sessions.items():
        lines += [f"## Sessions: {name}", ""]
        for t in s["turns"]:
            tag = "follow-up" if t["follow_up"] else ("CARRIES" if t["carries"] else "unrelated")
            lines.append(
                f"- s{t['session']} {t['question']!r} ({tag}) {'✓' if t['right'] else '✗'}: {t['marked'].strip()!r}"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=("tune", "test"), default="tune", help="tune on tune; report test once")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a routed configs' option")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n", type=int, default=0, help="the first N questions only (0: all)")
    ap.add_argument("--memory", default=DialogueOptions().memory, help="the sessions' dialogue memory policy")
    ap.add_argument("--no-sessions", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md (default build/answers/SPLIT)")
    args = ap.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config {', '.join(unknown)}: choose from {', '.join(CONFIGS)}")
    extra = parse_set(args.set)
    questions = load_questions(args.split)[: args.n or None]
    out = args.out or ROOT / "build" / "answers" / args.split
    t0 = time.perf_counter()
    edge = LlamaModel(model_info(GeneratorOptions().edge_model))
    try:
        with LocalCloudServer(model=GeneratorOptions().cloud_model) as server:
            rows = run_questions(edge, server, questions, names, args, extra)
            sessions = {} if args.no_sessions else run_sessions(edge, server, args.split, names, args, extra)
    finally:
        edge.close()
    cloud_right = {r["question"] for r in rows.get("cloud", []) if r["right"]} or None
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "split": args.split,
        "max_tokens": args.max_tokens,
        "set": extra,
        "memory": args.memory,
        "points": {n: summary(rows[n], cloud_right) for n in names},
        "sessions": {n: {k: v for k, v in s.items() if k != "turns"} for n, s in sessions.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report | {"answers": rows, "session_turns": sessions}, indent=1))
    out.with_suffix(".md").write_text(side_by_side(rows, sessions))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
