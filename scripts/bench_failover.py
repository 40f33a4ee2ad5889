"""Failover trials: answers whose cloud replica dies, drains or is scaled in mid-answer, behind HAProxy.

    python scripts/bench_failover.py --trials 30 [--policy hard|default] [--json]

A fleet of `--replicas` real `tokenrouter-cloud` processes on loopback behind
Debian's HAProxy (cloud_server/local_fleet.py, the configuration docs/server.md
shows). Each trial asks one CLINC150 val question (rotating; the device runs
the cloud's own model, greedy, so every answer has one right text: the
undisturbed answer, computed once per question), and at a random moment
(uniform in 0.05-0.5 s after the session opens) kills (SIGKILL), drains
(SIGTERM) or scales in (out of the balancer, then SIGTERM) the replica holding
the session: the three cases in turn. The victim is then replaced (a new
process on its port) before the next trial.

`--policy hard` (the default) routes every token to the cloud, so a request is
nearly always in flight when the replica goes: the harshest case, and the one
where "time from the replica's death to the next cloud token" measures the
failover itself. `--policy default` uses the generator's defaults (the router
at a 30 % share, lookahead, the check).

Reported per case and in all: answers degraded, answers that differ from the
undisturbed one (a lost or duplicated token shows as a difference), failovers
per answer, the failover's time (loss noticed -> session rebuilt), the time the
answer lost (that, plus the wait for a request asked again, the new replica's
prefill of the history included) and the time from the disturbance to the next
cloud token (p50, p95, max).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cloud_server.local_fleet import LocalFleet  # noqa: E402
from edge_client.generator import open_generator  # noqa: E402
from edge_client.options import GeneratorOptions  # noqa: E402
from edge_client.replay.sessions import clinc_sessions  # noqa: E402
from models.registry import DEFAULT_CLOUD_MODEL  # noqa: E402
from shared.prompting import DEFAULT_SYSTEM_PROMPT  # noqa: E402

CASES = ("kill", "drain", "scale_in")


def _options(fleet: LocalFleet, policy: str, max_tokens: int) -> GeneratorOptions:
    opts = GeneratorOptions(edge_model=DEFAULT_CLOUD_MODEL, cloud=fleet.url, api_key=fleet.api_key)
    opts.max_tokens = max_tokens
    if policy == "hard":
        opts.threshold, opts.cloud_fraction, opts.lookahead, opts.check = 0.0, None, False, "off"
    return opts


def _trial(fleet: LocalFleet, opts: GeneratorOptions, messages: list[dict], case: str, rng: random.Random) -> dict:
    """One answer with `case` applied to its replica at a random moment; the victim is replaced after."""
    delay = rng.uniform(0.05, 0.5)
    seen: dict[str, float | int] = {}

    def disturb() -> None:
        while not any(fleet.sessions(i) for i in range(len(fleet.replicas))):
            time.sleep(0.005)
        time.sleep(delay)
        seen["victim"] = fleet.holder()
        seen["t"] = time.perf_counter()
        getattr(fleet, case)(int(seen["victim"]))

    def on_token(ev) -> None:
        if "t" in seen and "next_cloud_s" not in seen and ev.route == "cloud":
            seen["next_cloud_s"] = time.perf_counter() - seen["t"]

    thread = threading.Thread(target=disturb, daemon=True)
    with open_generator(opts) as gen:
        thread.start()
        a = gen.generate(messages, on_token=on_token)
    thread.join(timeout=10)
    victim = int(seen.get("victim", -1))
    if victim >= 0:
        fleet.revive(victim)
    return {
        "case": case,
        "delay_s": round(delay, 3),
        "disturbed": "t" in seen and seen["t"] > 0,
        "tokens": a.tokens,
        "degraded": a.degraded,
        "reason": a.degraded_reason,
        "reconnects": a.traffic.reconnects,
        "failover_ms": round(a.traffic.failover_ms, 1),
        "resume_ms": round(a.traffic.resume_ms, 1),
        "lost_ms": round(a.traffic.failover_lost_ms, 1),
        "resume_prefill_ms": round(a.traffic.resume_prefill_ms, 1),
        "next_cloud_ms": round(1000 * seen["next_cloud_s"], 1) if "next_cloud_s" in seen else None,
    }


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def summarize(rows: list[dict]) -> dict:
    fo = [r["failover_ms"] for r in rows if r["reconnects"]]
    lost = [r["lost_ms"] for r in rows if r["reconnects"]]
    nc = [r["next_cloud_ms"] for r in rows if r["next_cloud_ms"] is not None]
    return {
        "trials": len(rows),
        "disturbed_mid_answer": sum(r["disturbed"] and r["reconnects"] > 0 for r in rows),
        "degraded": sum(r["degraded"] for r in rows),
        "differ_from_undisturbed": sum(not r["same"] for r in rows),
        "failovers": sum(r["reconnects"] for r in rows),
        "failover_ms_p50": _pct(fo, 0.5),
        "failover_ms_p95": _pct(fo, 0.95),
        "failover_ms_max": max(fo) if fo else None,
        "time_lost_ms_p50": _pct(lost, 0.5),
        "time_lost_ms_p95": _pct(lost, 0.95),
        "resume_prefill_ms_p50": _pct([r["resume_prefill_ms"] for r in rows if r["resume_ms"]], 0.5),
        "death_to_next_cloud_token_ms_p50": statistics.median(nc) if nc else None,
        "death_to_next_cloud_token_ms_p95": _pct(nc, 0.95),
        "death_to_next_cloud_token_ms_max": max(nc) if nc else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policy", choices=("hard", "default"), default="hard")
    ap.add_argument("--questions", type=int, default=10, help="CLINC150 val questions, rotated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    questions = [s.turns[0].text for s in clinc_sessions("val", limit=args.questions, seed=args.seed)]
    chats = [[{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in questions]
    rows: list[dict] = []
    t0 = time.perf_counter()
    with LocalFleet(args.replicas, model=DEFAULT_CLOUD_MODEL) as fleet:
        opts = _options(fleet, args.policy, args.max_tokens)
        reference = []
        for messages in chats:
            with open_generator(opts) as gen:
                reference.append(gen.generate(messages).tokens)
        for i in range(args.trials):
            case, k = CASES[i % len(CASES)], i % len(chats)
            row = _trial(fleet, opts, chats[k], case, rng)
            row["same"] = row.pop("tokens") == reference[k]
            row["question"] = questions[k]
            rows.append(row)
            if not args.json:
                print(
                    f"{i + 1:2d} {case:8s} failovers {row['reconnects']} {row['failover_ms']:6.1f} ms"
                    f"  next cloud token {row['next_cloud_ms']} ms  degraded {row['degraded']}  same {row['same']}",
                    flush=True,
                )
    report = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.platform()}",
        "policy": args.policy,
        "replicas": args.replicas,
        "wall_s": round(time.perf_counter() - t0, 1),
        "all": summarize(rows),
        **{case: summarize([r for r in rows if r["case"] == case]) for case in CASES},
        "rows": rows,
    }
    out = ROOT / "build" / f"failover_{args.policy}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
    else:
        for k in ("all", *CASES):
            print(k, json.dumps(report[k]))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
