"""The device model's decoding state: a token history and its KV cache.

The history is the truth; the KV cache follows it lazily. Tokens written by
the cloud are simply appended (acceptance), and `truncate` rolls both back
exactly. `next_distribution` decodes whatever the cache lacks in one batch
and returns the logits and final hidden state for the next position.
"""

from __future__ import annotations

import numpy as np

from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel
from shared.sequences import common_prefix


class EdgeDecoder:
    def __init__(self, model: LlamaModel, n_ctx: int = 4096, threads: int = 1) -> None:
        self.model = model
        self.ctx = LlamaContext(model, n_ctx=n_ctx, n_seq=1, threads=threads, embeddings=True)
        self.history: list[int] = []
        self._n_decoded = 0  # history[:_n_decoded] is in the KV cache
        self._out = -1  # batch index holding the logits of history[-1], or -1 if stale

    def __len__(self) -> int:
        return len(self.history)

    def set_history(self, tokens: list[int]) -> int:
        """Make `tokens` the history, keeping the cache for the common prefix. Returns that prefix length."""
        keep = common_prefix(self.history, tokens)
        self.truncate(keep)
        self.history.extend(tokens[keep:])
        return keep

    def append(self, token: int) -> None:
        self.history.append(token)

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens (exact: the cache forgets positions >= n)."""
        del self.history[n:]
        if self._n_decoded > n:
            self.ctx.truncate(0, n)
            self._n_decoded = n
            self._out = -1

    def next_distribution(self) -> tuple[np.ndarray, np.ndarray]:
        """(logits, hidden) for the position after the history; views valid until the next decode."""
        n = len(self.history)
        if n == 0:
            raise ValueError("the history is empty: set a prompt first")
        if self._n_decoded == n and self._out < 0:  # cached but its outputs were overwritten
            self.ctx.truncate(0, n - 1)
            self._n_decoded = n - 1
        if self._n_decoded < n:
            if n - self._n_decoded == 1:
                self.ctx.decode_one(0, self._n_decoded, self.history[-1])
                self._out = 0
            else:
                self._out = self.ctx.decode([DecodeItem(0, self._n_decoded, self.history[self._n_decoded :])])[0]
            self._n_decoded = n
        return self.ctx.logits(self._out), self.ctx.hidden(self._out)

    def decode_reading(self, at: int) -> np.ndarray:
        """Decode what the cache lacks, as `next_distribution` would, and read the logits at history
        position `at` too (one more output of the same batch); a copy. A position decoded earlier
        has lost its outputs: the cache rolls back to it and decodes from there."""
        n = len(self.history)
        if not 0 <= at < n:
            raise ValueError(f"position {at} is outside the history (0..{n - 1})")
        if at < self._n_decoded:  # the cache alone rolls back; the history stays
            self.ctx.truncate(0, at)
            self._n_decoded, self._out = at, -1
        if n - at > self.ctx.n_batch and at > self._n_decoded:  # outputs must lie in the last batch: head first
            self.ctx.decode([DecodeItem(0, self._n_decoded, self.history[self._n_decoded : at])])
            self._n_decoded, self._out = at, -1
        item = DecodeItem(0, self._n_decoded, self.history[self._n_decoded :])
        offsets = sorted({at - self._n_decoded, n - 1 - self._n_decoded})
        outs = self.ctx.decode_outputs(item, offsets)
        read = self.ctx.logits(outs[0]).copy()
        self._n_decoded, self._out = n, outs[-1]
        return read

    def close(self) -> None:
        self.ctx.close()
