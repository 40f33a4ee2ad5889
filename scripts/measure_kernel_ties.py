"""How far two llama.cpp kernels disagree on one history: the size of the noise tests must bear.

Why: the device decodes one token at a time, the cloud reads the same history in batches (a
sync, a verify), machines differ in thread counts and CPUs (AVX2, AVX-512, VNNI, AMX), and
llama.cpp's kernels are not bitwise equal between any of them. The rule's tie tolerance
(shared/decision.py, TIE_NATS) and the tests' noise (shared/kernel_noise.py) must cover it.

For each prompt the model writes a greedy answer one token at a time (the reference). Then every
answer position is read again by another path, and compared with the reference:
  - `batched`: the same history decoded in one batch (same thread count);
  - `threads`: one token at a time again, on another thread count.
For each it prints the change of the top-2 margin (nats; what flips an argmax or a tie), the
largest change in the regret of the reference's top 5 tokens, the argmax flips, and the change of
the hidden state's elements. Run it on each machine and build and compare; docs/architecture.md
("Kernels and ties") has the figures.

    .venv/bin/python scripts/measure_kernel_ties.py [--model NAME ...] [--n 10] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import llama_cpp as lc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, model_info  # noqa: E402
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


def one_token_reads(model: LlamaModel, prompt: list[int], max_tokens: int, threads: int, follow: list[int] | None):
    """(logits, hidden) at each answer position decoding one token at a time; the answer is the
    greedy one, or `follow` (teacher forcing) when given. Returns (reads, answer)."""
    ctx = LlamaContext(model, n_ctx=2048, threads=threads)
    ctx.decode([DecodeItem(0, 0, prompt[:-1])])
    ctx.decode_one(0, len(prompt) - 1, prompt[-1])
    reads, answer = [], []
    for k in range(len(follow) if follow is not None else max_tokens):
        reads.append((ctx.logits(0).copy(), ctx.hidden(0).copy()))
        token = follow[k] if follow is not None else int(np.argmax(reads[-1][0]))
        answer.append(token)
        if model.is_eog(token):
            break
        ctx.decode_one(0, len(prompt) + k, token)
    ctx.close()
    return reads, answer


def batched_reads(model: LlamaModel, prompt: list[int], answer: list[int], threads: int):
    """(logits, hidden) at each answer position, each history decoded in one batch."""
    ctx = LlamaContext(model, n_ctx=2048, threads=threads)
    out = []
    for k in range(len(answer)):
        ctx.clear(0)
        i = ctx.decode([DecodeItem(0, 0, prompt + answer[:k])])[0]
        out.append((ctx.logits(i).copy(), ctx.hidden(i).copy()))
    ctx.close()
    return out


def compare(ref: list, other: list) -> dict:
    """The top-2 margin's change decides argmax flips and ties (KERNEL_NOISE_NATS bounds it);
    the regrets of the reference's top 5 tokens move further where they are far from the best."""
    margins, regrets5, hidden, flips = [], [], [], 0
    for (la, ha), (lb, hb) in zip(ref, other):
        top = np.argsort(-la)[:5]
        change = np.abs(regrets(la, top) - regrets(lb, top))
        margins.append(float(change[1]))
        regrets5.append(float(change.max()))
        hidden.append(np.abs(ha - hb))
        flips += int(np.argmax(la) != np.argmax(lb))
    h = np.concatenate(hidden)
    return {
        "positions": len(margins),
        "argmax_flips": flips,
        "top2_margin_difference_nats": {
            "max": round(max(margins), 4),
            "p99": round(float(np.percentile(margins, 99)), 4),
            "median": round(float(np.median(margins)), 4),
        },
        "top5_regret_difference_nats_max": round(max(regrets5), 4),
        "hidden_difference": {
            "max": round(float(h.max()), 4),
            "p99": round(float(np.percentile(h, 99)), 4),
            "median": round(float(np.median(h)), 4),
        },
    }


def measure(name: str, n: int, max_tokens: int, threads: int, other_threads: int) -> dict:
    model = LlamaModel(model_info(name))
    ref_all, batched_all, threads_all = [], [], []
    for q in QUESTIONS[:n]:
        prompt = model.chat_tokens(
            [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": q}]
        )
        ref, answer = one_token_reads(model, prompt, max_tokens, threads, None)
        ref_all += ref
        batched_all += batched_reads(model, prompt, answer, threads)
        threads_all += one_token_reads(model, prompt, max_tokens, other_threads, answer)[0]
    model.close()
    return {
        "batched": compare(ref_all, batched_all),
        f"threads {threads} vs {other_threads}": compare(ref_all, threads_all),
    }


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "f16c", "fma"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=[DEFAULT_EDGE_MODEL, DEFAULT_CLOUD_MODEL])
    ap.add_argument("--n", type=int, default=10, help="prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="the reference's thread count")
    ap.add_argument("--other-threads", type=int, default=1)
    args = ap.parse_args()
    out = {
        "machine": platform.processor() or platform.machine(),
        "cpu_flags": cpu_flags(),
        "llama_cpp": lc.llama_print_system_info().decode(errors="replace").strip(),
        "models": {m: measure(m, args.n, args.max_tokens, args.threads, args.other_threads) for m in args.model},
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
