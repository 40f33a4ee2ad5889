"""The cloud's model engine: one llama.cpp context, one sequence per session.

Why one shared context rather than saving and restoring each session's state:
switching a session in by `llama_state_seq_set_data` costs a copy of its whole
KV cache (measured in docs/benchmarks.md), while sequences in one unified KV
pool cost nothing to switch and let one decode serve several sessions.

Not thread-safe by design: every call runs on the server's single engine
thread (see `EngineWorker`), which also makes the order of a session's
operations the order its messages arrived in.

Each session's history is decoded lazily, all but its last token, so the
next `generate` decodes at least one token and gets that token's logits fresh
even if other sessions decoded in between.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from models.registry import ModelInfo
from shared.llama_backend import DecodeError, DecodeItem, LlamaContext, LlamaModel
from shared.protocol import SamplingParams
from shared.sampling import Sampler, log_softmax_at

T = TypeVar("T")


class EngineFull(RuntimeError):
    """No free sequence slot or KV cells for a session."""


@dataclass(slots=True)
class SeqState:
    seq: int
    history: list[int]
    sampler: Sampler
    n_decoded: int = 0  # history[:n_decoded] is in the KV cache
    compute_s: float = 0.0


@dataclass(slots=True)
class GenerateResult:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    compute_ms: float = 0.0
    eog: bool = False


@dataclass(slots=True)
class VerifyResult:
    accepted: int
    token: int = -1
    logprob: float = 0.0
    compute_ms: float = 0.0
    eog: bool = False


class CloudEngine:
    def __init__(self, info: ModelInfo, n_ctx: int = 8192, max_sessions: int = 16, threads: int | None = None) -> None:
        self.model = LlamaModel(info)
        self.ctx = LlamaContext(self.model, n_ctx=n_ctx, n_seq=max_sessions, threads=threads, embeddings=False)
        self.max_sessions = max_sessions
        self._free = list(range(max_sessions - 1, -1, -1))
        self._seqs: dict[int, SeqState] = {}

    # ---------------------------------------------------------------- sessions

    def open(self, prompt: list[int], sampling: SamplingParams) -> int:
        if not self._free:
            raise EngineFull(f"all {self.max_sessions} session slots are in use")
        seq = self._free.pop()
        self.ctx.clear(seq)
        self._seqs[seq] = SeqState(seq, list(prompt), Sampler(sampling))
        return seq

    def close(self, seq: int) -> None:
        if self._seqs.pop(seq, None) is not None:
            self.ctx.clear(seq)
            self._free.append(seq)

    def history(self, seq: int) -> list[int]:
        return self._seqs[seq].history

    @property
    def n_sessions(self) -> int:
        return len(self._seqs)

    # ---------------------------------------------------------------- token ops

    def append(self, seq: int, tokens: list[int]) -> None:
        self._seqs[seq].history.extend(tokens)

    def rollback(self, seq: int, n: int) -> None:
        s = self._seqs[seq]
        if n > len(s.history):
            raise ValueError(f"cannot roll back to {n}: the history holds {len(s.history)} tokens")
        del s.history[n:]
        if s.n_decoded > n:
            self.ctx.truncate(seq, n)
            s.n_decoded = n

    def prefill(self, seq: int) -> float:
        """Decode all but the last pending token (background work after a sync). Returns seconds spent."""
        s = self._seqs[seq]
        end = len(s.history) - 1
        if end <= s.n_decoded:
            return 0.0
        t0 = time.perf_counter()
        self._decode(s, end, want_logits=False)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        return dt

    def generate_one(self, seq: int) -> tuple[int, float, float]:
        """Write the next token: (token, logprob, seconds of compute). The token joins the history."""
        s = self._seqs[seq]
        if not s.history:
            raise ValueError("cannot generate from an empty history")
        t0 = time.perf_counter()
        if s.n_decoded == len(s.history):  # logits of the last token may be stale: redo it
            self.ctx.truncate(seq, len(s.history) - 1)
            s.n_decoded -= 1
        out = self._decode(s, len(s.history), want_logits=True)
        logits = self.ctx.logits(out)
        token = s.sampler.sample(logits)
        logprob = log_softmax_at(logits, token)
        s.history.append(token)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        return token, logprob, dt

    def verify(self, seq: int, tokens: list[int], offsets: list[int], bonus: bool = False) -> VerifyResult:
        """Check drafted `tokens` (appended after the history) in one forward pass.

        At each offset in `offsets` the cloud's own choice (its sampler; argmax
        when greedy) is compared with the draft. The history keeps the drafts up
        to the first rejected offset, followed by the cloud's token there; with
        `bonus` and no rejection, the cloud's next token is appended as well.
        """
        s = self._seqs[seq]
        if not s.history:
            raise ValueError("cannot verify from an empty history")
        if len(tokens) + 1 > self.ctx.n_batch:
            raise ValueError(f"at most {self.ctx.n_batch - 1} drafted tokens per verify")
        t0 = time.perf_counter()
        base = len(s.history)
        if s.n_decoded == base:  # logits of the last token may be stale: redo it
            self.ctx.truncate(seq, base - 1)
            s.n_decoded -= 1
        if s.n_decoded < base - 1:
            self._decode(s, base - 1, want_logits=False)  # pending history, no outputs
        if base + len(tokens) > self.ctx.n_ctx:
            raise EngineFull(f"session needs {base + len(tokens)} KV cells; the server has {self.ctx.n_ctx}")
        rows = [s.history[-1], *tokens]  # row r predicts the token at offset r
        wanted = list(offsets) + ([len(tokens)] if bonus else [])
        try:
            outs = self.ctx.decode_outputs(DecodeItem(seq, base - 1, rows), wanted)
        except DecodeError as exc:
            self.ctx.truncate(seq, s.n_decoded)
            raise EngineFull(str(exc)) from exc
        result = VerifyResult(accepted=len(tokens))
        for offset, out in zip(wanted, outs):
            logits = self.ctx.logits(out)
            token = s.sampler.sample(logits)
            if offset == len(tokens) or token != tokens[offset]:
                result.accepted, result.token, result.logprob = offset, token, log_softmax_at(logits, token)
                break
        keep = base + result.accepted  # drafted tokens in the history
        self.ctx.truncate(seq, keep)
        s.history.extend(tokens[: result.accepted])
        s.n_decoded = keep
        if result.token >= 0:
            s.history.append(result.token)
            result.eog = self.model.is_eog(result.token)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        result.compute_ms = dt * 1000.0
        return result

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def _decode(self, s: SeqState, end: int, want_logits: bool) -> int:
        tokens = s.history[s.n_decoded : end]
        if s.n_decoded + len(tokens) > self.ctx.n_ctx:
            raise EngineFull(f"session needs {s.n_decoded + len(tokens)} KV cells; the server has {self.ctx.n_ctx}")
        try:
            out = self.ctx.decode([DecodeItem(s.seq, s.n_decoded, tokens)])[0]
        except DecodeError as exc:
            self.ctx.truncate(s.seq, s.n_decoded)  # drop any partially written cells
            raise EngineFull(str(exc)) from exc
        s.n_decoded = end
        return out if want_logits else -1

    def close_all(self) -> None:
        for seq in list(self._seqs):
            self.close(seq)
        self.ctx.close()
        self.model.close()


class EngineWorker:
    """Runs engine calls one at a time on a dedicated thread, awaitable from asyncio."""

    def __init__(self, engine: CloudEngine) -> None:
        self.engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.engine.close_all()

