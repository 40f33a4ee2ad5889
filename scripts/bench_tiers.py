"""A pool of three tiers, and what prefetching the top tier saves.

    python scripts/bench_tiers.py --n 20 [--above 0.15] [--json]

Three real models on loopback: the device (SmolLM2-135M Q3_K_S), the cloud
(SmolLM2-135M Q4_1, tokens) and a tier above it (Gemma-3-270M, another
vocabulary: text mode), each server on one thread. The entropy router is
calibrated to send `--fraction` (0.3) of positions up (no lookahead, no check)
and the built-in `escalate` engine sends those scoring at least `--above` to the
top tier, the rest of them to the cloud. Each CLINC150
val question is answered three times, in rotating order: with the top tier kept
in step while it is in use (`--prefetch-window 8`, the default), also while its
own router expects it (`--prefetch forecast`), and without (`0`: it is brought
up to date when asked).

Reported side by side: the top tier's requests, its wait per request (p50 and
mean: the round trip, including its prefill of what it lacked), the device
bytes sent to it, its GPU-seconds per answer (its reported work priced as the
production 70B: what keeping it in step costs), and the answer's whole time; for each prefetch, the
paired median difference of the top tier's wait per request against none.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cloud_server.local import LocalCloudServer  # noqa: E402
from edge_client.cloud_link import CloudLink  # noqa: E402
from edge_client.generator import RoutedGenerator  # noqa: E402
from edge_client.options import GeneratorOptions  # noqa: E402
from edge_client.replay.sessions import clinc_sessions  # noqa: E402
from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, model_info  # noqa: E402
from shared.gpu_cost import PRODUCTION_CLOUD  # noqa: E402
from shared.llama_backend import LlamaModel  # noqa: E402

TOP = "gemma3-270m"
TOP_COST = PRODUCTION_CLOUD  # the top tier priced as the production 70B (shared/gpu_cost.py)
CONFIGS = {"recent": (8, "recent"), "forecast": (8, "forecast"), "none": (0, "recent")}  # window, --prefetch


def run_one(gen: RoutedGenerator, question: str, max_tokens: int) -> dict:
    top = gen.tiers[0]
    before, t0 = top.traffic(), time.perf_counter()
    answer = gen.generate([{"role": "user", "content": question}], max_tokens=max_tokens)
    spent = top.traffic() - before
    return {
        "answer_ms": (time.perf_counter() - t0) * 1000.0,
        "top_requests": spent.round_trips,
        "top_wait_ms": spent.wait_ms,
        "top_bytes_up": spent.bytes_up,
        "top_gpu_s": TOP_COST.gpu_seconds(spent.work.passes, spent.work.tokens),
        "top_tokens": sum(1 for t in answer.tiers if t == 2),
        "n_tokens": answer.n_tokens,
        "degraded": answer.degraded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20, help="CLINC150 val questions")
    ap.add_argument("--fraction", type=float, default=0.3, help="the cloud share the router is calibrated to")
    ap.add_argument("--above", type=float, default=0.3, help="escalate: scores at least this go to the top tier")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    questions = [s.turns[0].text for s in clinc_sessions("val", args.n, seed=1)]
    edge = LlamaModel(model_info(DEFAULT_EDGE_MODEL))
    rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    threads = ["--threads", "1"]
    with (
        LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=threads) as cloud,
        LocalCloudServer(model=TOP, extra_args=threads) as top,
    ):
        base = GeneratorOptions(
            router="entropy",
            cloud_fraction=args.fraction,
            lookahead=False,
            check="off",
            decision_engine=f"escalate:above={args.above}",
            allow_base_model=True,  # the top tier stand-in is Gemma-3-270M, a base model
            max_tokens=args.max_tokens,
            tiers=(f"local:{TOP}",),  # names the top tier's own router (the forecast reads it)
        )
        gens = {
            name: RoutedGenerator(
                edge,
                replace(base, prefetch_window=window, prefetch=mode),
                lambda: CloudLink(cloud.url, cloud.api_key, timeout_s=10.0),
                tier_connects=[lambda: CloudLink(top.url, top.api_key, timeout_s=10.0)],
            )
            for name, (window, mode) in CONFIGS.items()
        }
        try:
            for i, q in enumerate(questions):
                order = list(CONFIGS)[i % len(CONFIGS) :] + list(CONFIGS)[: i % len(CONFIGS)]  # rotate
                for name in order:
                    rows[name].append(run_one(gens[name], q, args.max_tokens))
        finally:
            for g in gens.values():
                g.close()
    edge.close()
    report = summarise(rows, args)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)


def per_request(r: dict) -> float | None:
    return r["top_wait_ms"] / r["top_requests"] if r["top_requests"] else None


def summarise(rows: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    out: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "n": args.n,
        "fraction": args.fraction,
        "above": args.above,
        "configs": {},
    }
    for name, rs in rows.items():
        waits = [w for r in rs if (w := per_request(r)) is not None]
        out["configs"][name] = {
            "prefetch_window": CONFIGS[name][0],
            "prefetch": CONFIGS[name][1],
            "degraded": sum(r["degraded"] for r in rs),
            "top_requests": sum(r["top_requests"] for r in rs),
            "top_tokens_share": round(sum(r["top_tokens"] for r in rs) / max(sum(r["n_tokens"] for r in rs), 1), 3),
            "top_wait_per_request_p50_ms": round(statistics.median(waits), 1) if waits else None,
            "top_wait_per_request_mean_ms": round(statistics.fmean(waits), 1) if waits else None,
            "top_bytes_up": sum(r["top_bytes_up"] for r in rs),
            "top_gpu_s_per_answer": round(statistics.fmean(r["top_gpu_s"] for r in rs), 3),
            "answer_ms_p50": round(statistics.median(r["answer_ms"] for r in rs), 1),
        }
    for name in ("recent", "forecast"):  # paired against no prefetch, question by question
        pairs = [
            (a, b)
            for a, b in zip(map(per_request, rows[name]), map(per_request, rows["none"]))
            if a is not None and b is not None
        ]
        out["configs"][name]["paired_wait_vs_none_median_ms"] = (
            round(statistics.median(a - b for a, b in pairs), 1) if pairs else None
        )
        out["configs"][name]["paired_answers"] = len(pairs)
    return out


def print_table(report: dict) -> None:
    keys = list(report["configs"]["recent"])
    print(f"{'':34s}" + "".join(f"{name:>12s}" for name in report["configs"]))
    for k in keys:
        print(f"{k:34s}" + "".join(f"{str(c.get(k, '-')):>12s}" for c in report["configs"].values()))


if __name__ == "__main__":
    main()
