"""Per-token cost of the learned router against the entropy heuristic, side by side in one run.

Collects real (hidden, logits, proposed) triples by letting the edge model answer
a few prompts, then times each part many times and prints medians in microseconds:
logit features alone (one pass over the 49k-entry logits), the MLP alone, the
full learned `score`, and the entropy heuristic's `score`.

    python scripts/bench_router.py [--router models/routers/....npz] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from models.registry import DEFAULT_EDGE_MODEL, model_info
from models.train.cli import DEFAULT_ROUTER
from shared.learned_router import LogitFeaturizer, load_router
from shared.llama_backend import LlamaContext, LlamaModel
from shared.prompting import DEFAULT_SYSTEM_PROMPT
from shared.router import HeuristicRouter

PROMPTS = ["what's the weather like tomorrow", "set a timer for ten minutes", "how do I say thank you in french"]


def collect(model: LlamaModel, n_tokens: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    out = []
    ctx = LlamaContext(model, n_ctx=1024, embeddings=True, threads=1)
    for p in PROMPTS:
        ctx.clear(0)
        toks = model.chat_tokens([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": p}])
        for i, t in ctx.greedy(toks, n_tokens):
            out.append((ctx.hidden(i).copy(), ctx.logits(i).copy(), t))
    ctx.close()
    return out


def interleaved_medians(rows, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Median microseconds per function, the functions timed in turn so background load hits all alike."""
    times = np.empty((len(rows), repeat))
    for k in range(repeat):
        for j, (_, fn, data) in enumerate(rows):
            a, b, c = data[k % len(data)]
            t0 = time.perf_counter()
            fn(a, b, c)
            times[j, k] = time.perf_counter() - t0
    return [float(np.median(t) * 1e6) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--router", type=Path, default=DEFAULT_ROUTER)
    ap.add_argument("--edge-model", default=DEFAULT_EDGE_MODEL)
    ap.add_argument("--repeat", type=int, default=3000)
    args = ap.parse_args()
    info = model_info(args.edge_model)
    model = LlamaModel(info)
    samples = collect(model, 40)
    router = load_router(args.router, info)
    heuristic = HeuristicRouter("entropy", model.n_vocab)
    feat = LogitFeaturizer(model.n_vocab)
    feats = [(h, feat(lg, t).copy(), t) for h, lg, t in samples]
    rows = [
        ("logit features only", lambda h, lg, t: feat(lg, t), samples),
        ("MLP only (precomputed features)", lambda h, f, t: router.score_features(h, f, t), feats),
        ("learned router score (total)", lambda h, lg, t: router.score(h, lg, t), samples),
        ("entropy heuristic score", lambda h, lg, t: heuristic.score(h, lg, t), samples),
    ]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {load:.2f}; numpy {np.__version__}"
    )
    print(f"{len(samples)} real positions from {info.name}, {args.repeat} timed calls each (interleaved), medians:")
    interleaved_medians(rows, 200)  # warm up
    for (name, _, _), us in zip(rows, interleaved_medians(rows, args.repeat)):
        print(f"  {name:34s} {us:8.1f} us")
    model.close()


if __name__ == "__main__":
    main()
