"""How far llama.cpp's batched and one-token decodes disagree near the top of the distribution.

Why: the device decodes one token at a time, the cloud reads the same history in batches
(a sync, a verify), and llama.cpp's kernels are not bitwise equal between the two. The rule's
tie tolerance (shared/decision.py, TIE_NATS) must cover the difference, on any CPU.

For each prompt the model writes a greedy answer one token at a time; then, for every answer
position, the same history is decoded again in one batch and the regrets (nats below the best)
of the top tokens are compared. Prints the largest difference and how many positions have a
near-tie that flips between the two paths.

    .venv/bin/python scripts/measure_kernel_ties.py [--model NAME] [--n 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.registry import DEFAULT_EDGE_MODEL, model_info  # noqa: E402
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel  # noqa: E402
from shared.prompting import DEFAULT_SYSTEM_PROMPT  # noqa: E402

QUESTIONS = [
    "how do you say hello in japanese",
    "what is the capital of france",
    "set a timer for ten minutes",
    "what's the weather like in boston tomorrow",
    "tell me a fun fact about octopuses",
    "how do i reset my wifi router",
    "what is a good recipe for pancakes",
    "remind me to call my mother at six",
    "explain how vaccines work",
    "what should i pack for a beach holiday",
]


def regrets(logits: np.ndarray, top: np.ndarray) -> np.ndarray:
    return float(logits.max()) - logits[top].astype(np.float64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_EDGE_MODEL)
    ap.add_argument("--n", type=int, default=8, help="prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    model = LlamaModel(model_info(args.model))
    worst, flips, positions = 0.0, 0, 0
    for q in QUESTIONS[: args.n]:
        prompt = model.chat_tokens(
            [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": q}]
        )
        one = LlamaContext(model, n_ctx=2048, embeddings=False)
        one.decode([DecodeItem(0, 0, prompt[:-1])])
        one.decode_one(0, len(prompt) - 1, prompt[-1])
        history, singles = list(prompt), []
        for _ in range(args.max_tokens):
            logits = one.logits(0).copy()
            singles.append(logits)
            token = int(np.argmax(logits))
            if model.is_eog(token):
                break
            one.decode_one(0, len(history), token)
            history.append(token)
        one.close()
        batched = LlamaContext(model, n_ctx=2048, embeddings=False)
        for k, single in enumerate(singles):
            batched.clear(0)
            out = batched.decode([DecodeItem(0, 0, history[: len(prompt) + k])])[0]
            other = batched.logits(out)
            top = np.argsort(-single)[:5]
            worst = max(worst, float(np.max(np.abs(regrets(single, top) - regrets(other, top)))))
            flips += int(np.argmax(single) != np.argmax(other))
            positions += 1
        batched.close()
    model.close()
    print(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "model": args.model,
                "positions": positions,
                "max_regret_difference_nats": round(worst, 4),
                "argmax_flips": flips,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
