"""Decode and prefill speed of the installed llama.cpp build: to compare builds on one machine.

Why: llama-cpp-python is built for the machine it is installed on (GGML_NATIVE). A portable
build (x86-64-v3: AVX2, FMA, F16C, BMI2) gives the same figures on every x86 CPU; this measures
what it costs. Run it once with each build's Python, on an idle machine, and compare the ratios:

    .venv/bin/python scripts/bench_kernels.py --json build/kernels_native.json
    OTHER_VENV/bin/python scripts/bench_kernels.py --json build/kernels_portable.json

Each model: one-token decodes with logits and the hidden state read each step (the device's
loop), and a batched prefill of a 256-token history (the cloud's sync), median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp as lc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, model_info  # noqa: E402
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel, amx_compiled  # noqa: E402


def bench(name: str, n_decode: int, n_prefill: int, repeats: int) -> dict:
    model = LlamaModel(model_info(name))
    ctx = LlamaContext(model, n_ctx=1024)
    history = [int(t) for t in np.random.default_rng(0).integers(100, 10000, n_prefill)]
    decode, prefill = [], []
    for _ in range(repeats):
        ctx.clear(0)
        t0 = time.perf_counter()
        ctx.decode([DecodeItem(0, 0, history)])
        prefill.append(n_prefill / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        token = history[-1]
        for pos in range(n_prefill, n_prefill + n_decode):
            ctx.decode_one(0, pos, token)
            token = int(np.argmax(ctx.logits(0)))
            ctx.hidden(0)
        decode.append(n_decode / (time.perf_counter() - t0))
    ctx.close()
    model.close()
    return {"decode_tok_s": round(statistics.median(decode), 1), "prefill_tok_s": round(statistics.median(prefill), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=[DEFAULT_EDGE_MODEL, DEFAULT_CLOUD_MODEL])
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()
    out = {
        "llama_cpp": lc.llama_print_system_info().decode(errors="replace").strip(),
        "amx_compiled": amx_compiled(),
        "models": {m: bench(m, args.decode, args.prefill, args.repeats) for m in args.model},
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
