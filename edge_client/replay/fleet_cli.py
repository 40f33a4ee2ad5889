"""`tokenrouter-replay simulate`: how many GPUs N streams need, per policy, from recorded traces.

    tokenrouter-replay simulate --traces build/replay --fleet 12000 --cost h100-70b-tp4 --think-ms 8000
    tokenrouter-replay simulate --workload loadtest --streams 1,8,32 --cost build/fleet/cpu_fit.json --rtt-ms 0

`--fleet N` sizes a fleet for N streams (one replica simulated with its share; docs/replay.md,
"Fleet simulator"); `--streams` simulates one replica with each number of streams and prints what
they saw (the validation against scripts/loadtest.py uses this with loadtest's own workload).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from edge_client.replay.fleet import (
    PRESETS,
    SimOptions,
    Targets,
    by_policy,
    gpus_needed,
    load_cost_model,
    simulate,
    streams_per_replica,
)
from edge_client.replay.traces import TurnTrace, loadtest_turn, read_traces, traces_from_rows, write_traces


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenrouter-replay simulate", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", type=Path, help="a replay's --out directory (traces.jsonl) or a traces file")
    src.add_argument("--workload", choices=["loadtest"], help="scripts/loadtest.py's synthetic device instead")
    p.add_argument("--policies", help="comma-separated subset of the traces' policies")
    p.add_argument("--cost", default="h100-70b-tp4", help=f"a preset ({', '.join(PRESETS)}) or a JSON file")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--fleet", type=int, metavar="N", help="size a fleet for N concurrent streams")
    what.add_argument("--streams", help="one replica with each of these stream counts (1,8,32)")
    p.add_argument("--rtt-ms", type=float, default=2.0, help="network round trip per request (default 2: lan)")
    p.add_argument("--think-ms", type=float, default=0.0, help="pause between a stream's turns")
    p.add_argument("--device-jitter", type=float, default=0.0, help="device segments x U(1-j, 1+j)")
    p.add_argument("--context-tokens", type=int, default=512, help="KV a stream holds during a turn")
    p.add_argument("--duration", type=float, default=60.0, help="simulated seconds measured")
    p.add_argument("--warmup", type=float, default=10.0, help="simulated seconds before measuring")
    p.add_argument("--p99-token-ms", type=float, default=150.0, help="target: p99 gap between released tokens")
    p.add_argument("--p99-first-clause-ms", type=float, default=1500.0, help="target: p99 time to the first clause")
    p.add_argument(
        "--min-within-150ms", type=float, default=0.0, help="target: least share of replies starting within 150 ms"
    )
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("--workload loadtest (scripts/loadtest.py's options)")
    g.add_argument("--edge-tokens", type=int, default=3)
    g.add_argument("--device-think-ms", type=float, default=7.7, help="loadtest's --think-ms: device time a token")
    g.add_argument("--max-history", type=int, default=160)
    p.add_argument("--json", action="store_true")
    return p


def load(args: argparse.Namespace) -> list[TurnTrace]:
    """The traces: loadtest's workload, a traces file, or a replay directory (traces.jsonl, else its results)."""
    if args.workload:
        return [loadtest_turn(args.edge_tokens, args.device_think_ms, args.max_history)]
    path: Path = args.traces
    if path.is_dir():
        if not (path / "traces.jsonl").exists() and (path / "results.jsonl").exists():
            rows = [r for line in (path / "results.jsonl").read_text().splitlines() if line.strip()
                    for r in json.loads(line)["rows"]]  # fmt: skip
            write_traces(path / "traces.jsonl", traces_from_rows(rows))
        path = path / "traces.jsonl"
    if not path.exists():
        raise ValueError(f"no traces at {path}: run tokenrouter-replay with --out first")
    traces = [t for t in read_traces(path) if t.n_tokens > 0]
    if args.policies:
        wanted = set(args.policies.split(","))
        traces = [t for t in traces if t.policy in wanted]
    if not traces:
        raise ValueError("no traces left to simulate (check --policies)")
    return traces


def run(args: argparse.Namespace) -> dict[str, Any]:
    cost = load_cost_model(args.cost)
    traces = load(args)
    opts = SimOptions(
        streams=1,
        duration_s=args.duration,
        warmup_s=args.warmup,
        rtt_ms=args.rtt_ms,
        think_ms=args.think_ms,
        device_jitter=args.device_jitter,
        context_tokens=args.context_tokens,
        seed=args.seed,
    )
    out: dict[str, Any] = {"cost_model": cost.to_json(), "options": vars(args) | {"traces": str(args.traces)}}
    policies: dict[str, Any] = {}
    for policy, group in by_policy(traces):
        if args.streams:
            counts = [int(s) for s in args.streams.split(",")]
            policies[policy] = {
                str(n): simulate(cost, group, replace(opts, streams=n)).summary(cost.tp) for n in counts
            }
            continue
        targets = Targets(args.p99_token_ms, args.p99_first_clause_ms, args.min_within_150ms)
        per, summary = streams_per_replica(cost, group, opts, targets)
        policies[policy] = {
            "turns_in_traces": len(group),
            "cloud_token_share": round(sum(t.n_cloud for t in group) / max(sum(t.n_tokens for t in group), 1), 4),
            "streams_per_replica": per,
            "gpus_needed": gpus_needed(args.fleet, per, cost.tp),
            "at_capacity": summary,
        }
    out["policies"] = policies
    return out


def markdown(out: dict[str, Any]) -> str:
    cost, opts = out["cost_model"], out["options"]
    lines = [f"cost model `{cost['name']}` ({cost['gpu']}, {cost['model']}), RTT {opts['rtt_ms']} ms", ""]
    if opts.get("streams"):
        lines += [
            "| policy | streams | hard tok/s | request p50 | request p95 | mean batch |",
            "|---|---|---|---|---|---|",
        ]
        for policy, per_n in out["policies"].items():
            for n, s in per_n.items():
                lines.append(
                    f"| {policy} | {n} | {s['hard_tokens_per_s']} | {s['request_ms_p50']} | {s['request_ms_p95']} | {s['mean_batch']} |"
                )
        return "\n".join(lines)
    lines += [
        f"{opts['fleet']} streams; targets: p99 per-token <= {opts['p99_token_ms']} ms, "
        f"p99 first clause <= {opts['p99_first_clause_ms']} ms"
        + (f", >= {opts['min_within_150ms']:.1%} of replies within 150 ms" if opts.get("min_within_150ms") else ""),
        "",
        "| policy | cloud tokens | streams / replica | GPUs | GPU-s / M answer tokens | busy GPU-s / M | "
        "within 150 ms | p99 per-token | p99 first clause | mean batch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, p in out["policies"].items():
        s = p["at_capacity"] or {}
        lines.append(
            f"| {policy} | {p['cloud_token_share']:.2f} | {p['streams_per_replica']} | {p['gpus_needed'] or 'not met'} | "
            f"{s.get('gpu_s_per_m_tokens')} | {s.get('busy_gpu_s_per_m_tokens')} | {s.get('within_150ms')} | "
            f"{s.get('per_token_ms_p99')} | {s.get('first_clause_ms_p99')} | {s.get('mean_batch')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except ValueError as exc:
        print(f"tokenrouter-replay simulate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2) if args.json else markdown(out))
    return 0
