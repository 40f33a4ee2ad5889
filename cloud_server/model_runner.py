"""The embedded engine's worker side: runs the model on sessions' tokens and reads back checked logits.

Why apart from the engine: deciding what to decode (cloud_server/batch_stepper.py, verifier.py)
and decoding it are different jobs (vLLM keeps its scheduler and its model runner apart too).
The runner knows llama.cpp's context and the KV pool's cells; a session's history is the truth it
decodes from. A decode that fails drops any cells it wrote, and its error becomes a named one
(`named_error`) the session can answer: a failure stays with the session that caused it.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np

from cloud_server.engine_api import EngineError, EngineFailed, EngineFull
from cloud_server.kv_pool import KVPool
from cloud_server.sequence import SeqState
from shared.llama_backend import DecodeError, DecodeItem, LlamaContext
from shared.sampling import SamplingError


class ModelRunner:
    """Decodes sessions' histories into their KV cells (one session alone, or many items at once)."""

    def __init__(self, ctx: LlamaContext, pool: KVPool) -> None:
        self.ctx = ctx
        self.pool = pool

    def decode_to(self, s: SeqState, end: int, want_logits: bool = True) -> np.ndarray:
        """Decode the session's history up to `end` alone; the logits of position `end` (checked finite)."""
        self.pool.check_fits(end)
        self.pool.ensure(s.kv, end - s.kv.n_decoded, n_history=len(s.history))
        item = DecodeItem(s.kv.seq, s.kv.n_decoded, s.history[s.kv.n_decoded : end])
        try:
            out = self.decode_items([item])[0]
            logits = self.finite_logits(out) if want_logits else np.empty(0, dtype=np.float32)
        except Exception as exc:
            self.pool.discard_partial(s.kv)  # drop any partially written cells
            raise_named(exc)
        self.pool.decoded(s.kv, end)
        return logits

    def redo_last(self, s: SeqState) -> None:
        """Logits of the last decoded token may be stale (others decoded since): decode that token again."""
        if s.kv.n_decoded == len(s.history):
            self.pool.forget_last(s.kv)

    def finite_logits(self, out: int) -> np.ndarray:
        """Output `out`'s logits; SamplingError if any is NaN or +inf (a broken decode)."""
        logits = self.output_logits(out)
        if not np.isfinite(np.max(logits)):  # NaN propagates through max, +inf is the max
            raise SamplingError("the model's logits are not finite at this position; the decode was dropped")
        return logits

    # the three calls into llama.cpp (a test replaces them to inject failures)
    def decode_items(self, items: list[DecodeItem]) -> list[int]:
        return self.ctx.decode(items)

    def decode_outputs(self, item: DecodeItem, wanted: list[int]) -> list[int]:
        return self.ctx.decode_outputs(item, wanted)

    def output_logits(self, out: int) -> np.ndarray:
        return self.ctx.logits(out)


def named_error(exc: BaseException) -> Exception:
    """A failure of one session's decode as an error the session can answer (EngineError or SamplingError)."""
    if isinstance(exc, (EngineError, SamplingError)):
        return exc
    if isinstance(exc, DecodeError):
        return EngineFull(str(exc))
    return EngineFailed(f"the engine failed on this request ({type(exc).__name__}: {exc})")


def raise_named(exc: Exception) -> NoReturn:
    """Re-raise `exc` as its named error (itself if it already is one)."""
    named = named_error(exc)
    if named is exc:
        raise exc
    raise named from exc
