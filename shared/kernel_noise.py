"""Seeded noise on what llama.cpp returns, so that tests prove they hold on any CPU.

Why: llama.cpp's logits and hidden states depend on the kernels that computed them. A batched
decode and a one-token decode of the same history differ, and so do thread counts and CPUs
(AVX2 against AVX-512, VNNI, AMX). The differences are small, but where two tokens are nearly
tied they flip an argmax, so a test that passes on the machine it was written on can fail on the
next one. `scripts/measure_kernel_ties.py` measures the size of those differences; the constants
below are its largest figures, with a margin.

`TOKENROUTER_KERNEL_NOISE=SEED` in the environment makes every `LlamaContext` in that process
(and in every server or CLI it starts, which inherit the variable) add seeded noise of that size
to each logit and hidden state it reads, as another CPU's kernels would. The kernel-sensitive
tests (`pytest -m kernel`) must pass under several seeds: then they do not depend on how a CPU
rounds. The noise is a function of (seed, position, token): a state reads the same twice, and
the batched and one-token reads of one position move together, as they do from one CPU to
another. What still differs between those two paths is this machine's own kernels: noise keyed on
the path as well would add a second difference on top of the real one, more than any CPU shows.

Off by default: `LlamaContext` asks `from_environment()` once, at construction, and with the
variable unset nothing is wrapped; the product's per-token read path is untouched.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

ENV_VAR = "TOKENROUTER_KERNEL_NOISE"

KERNEL_NOISE_NATS = 0.6
"""The largest change of a top-2 logit margin (nats) between two kernels reading one history:
what can flip an argmax, or a tie's verdict. scripts/measure_kernel_ties.py, 10 prompts x 64
tokens, one-token against batched decodes: 0.56 (Q3_K_S, the device model) on a 2-core Xeon with
the project's x86-64-v3 build, 0.58 with a native AVX-512/AMX build (p99 0.47-0.51, median
0.07-0.09); thread counts change nothing. shared/decision.py's TIE_NATS is this bound, and tests
excuse exactly the positions whose margin is below it (docs/architecture.md, "Kernels and ties")."""

KERNEL_NOISE_HIDDEN = 0.2
"""The change of one element of the final hidden state that covers 99 % of elements (the same
measurement: p99 0.18, median 0.03; elements are O(1), a few outliers reach 7)."""


class KernelNoise:
    """Adds seeded, state-keyed uniform noise to one context's logits and hidden states.

    Each logit moves by at most `logit_nats / 2`, so two reads of one state (two kernels) differ
    by at most `logit_nats` in any regret, the measured bound."""

    def __init__(self, seed: int, logit_nats: float = KERNEL_NOISE_NATS, hidden: float = KERNEL_NOISE_HIDDEN) -> None:
        self.seed = seed
        self.logit_nats = logit_nats
        self.hidden = hidden

    def attach(self, ctx: Any) -> None:
        """Wrap a `shared.llama_backend.LlamaContext`'s decode and read methods (as instance
        attributes) so that every read of an output carries this noise. Outputs are keyed by their
        batch index, as llama.cpp's are. (Typed Any: llama_backend imports this module.)"""
        outputs: dict[int, tuple[int, int]] = {}  # batch index -> (position, token)
        reads: dict[tuple[int, int], np.ndarray] = {}  # (kind, batch index) -> noisy copy
        run, decode_one, decode_outputs = ctx._run, ctx.decode_one, ctx.decode_outputs
        logits, hidden = ctx.logits, ctx.hidden

        def forget() -> None:
            outputs.clear()
            reads.clear()

        def noisy_run(rows: list[tuple[int, int, int]], n_out: int) -> None:
            run(rows, n_out)
            forget()
            for j in range(len(rows) - n_out, len(rows)):
                outputs[j] = (rows[j][1], rows[j][2])

        def noisy_decode_one(seq: int, pos: int, token: int) -> None:
            decode_one(seq, pos, token)
            forget()
            outputs[0] = (pos, token)

        def noisy_decode_outputs(item: Any, offsets: Sequence[int]) -> list[int]:
            got = decode_outputs(item, offsets)
            forget()
            for o, j in zip(offsets, got):
                outputs[j] = (item.pos + o, item.tokens[o])
            return got

        def read(kind: int, i: int, base: Callable[[int], np.ndarray], scale: float) -> np.ndarray:
            got = reads.get((kind, i))
            if got is None:
                clean = base(i)
                pos, token = outputs.get(i, (-1, -1))
                rng = np.random.default_rng([self.seed, kind, pos + 1, token + 1])
                got = clean + rng.uniform(-scale / 2, scale / 2, clean.shape).astype(clean.dtype)
                reads[(kind, i)] = got
            return got

        ctx._run = noisy_run  # type: ignore[method-assign]
        ctx.decode_one = noisy_decode_one  # type: ignore[method-assign]
        ctx.decode_outputs = noisy_decode_outputs  # type: ignore[method-assign]
        ctx.logits = lambda i: read(0, i, logits, self.logit_nats)  # type: ignore[method-assign]
        ctx.hidden = lambda i: read(1, i, hidden, self.hidden)  # type: ignore[method-assign]


def from_environment() -> KernelNoise | None:
    """The noise `TOKENROUTER_KERNEL_NOISE=SEED` asks for, or None (the default: no noise)."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        seed = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_VAR} must be an integer seed, got {raw!r} (unset it for no noise)") from None
    log.debug("kernel noise on: seed %d", seed)
    return KernelNoise(seed)
