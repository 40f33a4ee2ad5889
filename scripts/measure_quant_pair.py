"""Measure how far a requantized edge model is from the cloud model (greedy disagreement).

For each CLINC150 val query, the cloud model answers greedily; the edge model
reads that answer (teacher forcing) and we count positions where its argmax
differs. Prints one line per quantization type.

    python scripts/measure_quant_pair.py --types Q3_K_S Q4_0 Q2_K --limit 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from models.registry import cache_dir, model_info, requantize, resolve_path
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel

CLINC = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "clinc150" / "data_full.json"
SYSTEM = "You are a helpful voice assistant. Answer in one or two short sentences."


def greedy(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    ctx = LlamaContext(model, n_ctx=1024, embeddings=False)
    toks = [t for _, t in ctx.greedy(prompt, n)]
    ctx.close()
    return toks


def forced_argmax(model: LlamaModel, prompt: list[int], answer: list[int]) -> list[int]:
    ctx = LlamaContext(model, n_ctx=1024, embeddings=False)
    ctx.decode([DecodeItem(0, 0, prompt)])
    preds = [int(np.argmax(ctx.logits(len(prompt) - 1)))]
    for i, t in enumerate(answer[:-1]):
        ctx.decode_one(0, len(prompt) + i, t)
        preds.append(int(np.argmax(ctx.logits(0))))
    ctx.close()
    return preds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q3_K_S", "Q4_0"])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    queries = [q for q, _ in json.loads(CLINC.read_text())["val"][:: 3000 // args.limit][: args.limit]]
    cloud = LlamaModel(model_info("smollm2-135m-q4_1"))
    prompts = [
        cloud.chat_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in queries
    ]
    answers = [greedy(cloud, p, args.max_tokens) for p in prompts]
    for ftype in args.types:
        path = cache_dir() / f"SmolLM2-135M-Instruct.{ftype}.gguf"
        if not path.is_file():
            requantize(resolve_path("smollm2-135m-q4_1"), path, ftype)
        edge = LlamaModel(model_info(path))
        agree = total = 0
        for p, a in zip(prompts, answers):
            preds = forced_argmax(edge, p, a)
            agree += sum(int(x == y) for x, y in zip(preds, a))
            total += len(a)
        size = path.stat().st_size / 1e6
        print(f"{ftype}: {size:.1f} MB, disagrees on {100 * (1 - agree / total):.1f}% of {total} greedy positions")
        edge.close()


if __name__ == "__main__":
    main()
