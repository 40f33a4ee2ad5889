"""The cloud's model engine: one llama.cpp context, one sequence per session.

Why one shared context rather than saving and restoring each session's state:
switching a session in by `llama_state_seq_set_data` costs a copy of its whole
KV cache (measured in docs/benchmarks.md), while sequences in one unified KV
pool cost nothing to switch and let one decode serve several sessions.

Not thread-safe by design: every call runs on the server's single engine
thread (see `EngineWorker`), which also makes the order of a session's
operations the order its messages arrived in.

A prefill (the background work after a `sync`) decodes the whole history and
keeps a copy of the next position's logits (`SeqState.ready`). A hard-token
request that brings no new tokens, the common case once the device syncs
eagerly, then samples from that copy without a decode: the device waits for
a round trip, not for the model. Any other change of the history (new tokens,
a rollback, a verify) drops the copy, and `generate` decodes at least the last
token, so its logits are fresh even if other sessions decoded in between.

The pool is a budget: when it (or the sequence slots) runs out, idle
sessions are evicted least recently used first and rebuilt when they return
(docs/server.md gives the memory per session). Sessions are named by a
handle that stays the same across eviction; `SeqState.seq` is the llama.cpp
sequence they occupy while resident.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, TypeVar

import llama_cpp as lc
import numpy as np

from models.registry import ModelInfo
from shared.llama_backend import DecodeError, DecodeItem, LlamaContext, LlamaModel
from shared.protocol import SamplingParams
from shared.sampling import NO_GUESS, Guess, Sampler, log_softmax_at, regret

if TYPE_CHECKING:
    from cloud_server.scheduler import BatchObserver

T = TypeVar("T")


class EngineFull(RuntimeError):
    """No free sequence slot or KV cells for a session."""


@dataclass(slots=True)
class SeqState:
    seq: int  # llama.cpp sequence id while resident in the KV cache; -1 while evicted
    history: list[int]
    sampler: Sampler
    n_decoded: int = 0  # history[:n_decoded] is in the KV cache (or in `saved`)
    compute_s: float = 0.0
    handle: int = -1  # the session's id for callers: stable across eviction and restore
    last_used: float = 0.0  # for least-recently-used eviction
    saved: bytes | None = None  # KV state kept in host memory while evicted (evict_mode "save")
    evicted: bool = False  # was evicted since its last decode (counts a restore)
    ready: np.ndarray | None = None  # logits of the next position, kept by a prefill; valid while ready_len == len(history)
    ready_len: int = -1
    guess: int = -1  # the token announced for the next position (a `next` message), written if asked there
    guess_logprob: float = 0.0

    @property
    def has_ready(self) -> bool:
        """Kept next-position logits exist and still describe the history."""
        return self.ready is not None and self.ready_len == len(self.history)

    def take_ready(self) -> np.ndarray | None:
        """The kept next-position logits if they still describe the history (then forgotten)."""
        logits = self.ready if self.has_ready else None
        if logits is None:
            self.guess = -1
        self.ready, self.ready_len = None, -1
        return logits

    def keep_ready(self, logits: np.ndarray) -> None:
        self.ready = logits.copy()
        self.ready_len = len(self.history)
        self.guess = -1

    def drop_ready(self) -> None:
        self.ready, self.ready_len, self.guess = None, -1, -1


@dataclass(slots=True)
class EngineStats:
    """Counters the metrics endpoint reads."""

    evictions: int = 0
    restores_loaded: int = 0  # state copied back from host memory
    restores_recomputed: int = 0  # rebuilt by re-prefill from the token history
    recomputed_tokens: int = 0
    saved_bytes: int = 0  # host memory held by saved states now


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
    """Sessions over one shared KV pool of `n_ctx` cells (the KV memory budget).

    `max_sessions` sessions may be open; at most `kv_slots` of them hold KV
    cells at once. When a session needs room, idle sessions are evicted least
    recently used first: their state is saved to host memory (`evict_mode`
    "save", bounded by `max_saved_bytes`) or dropped and rebuilt later by
    re-prefilling the token history the server keeps ("recompute").
    """

    EVICT_MODES = ("recompute", "save")
    KV_LAYOUTS = ("unified", "split")

    def __init__(
        self,
        info: ModelInfo,
        n_ctx: int = 8192,
        max_sessions: int = 16,
        threads: int | None = None,
        kv_slots: int | None = None,
        evict_mode: str = "recompute",
        max_saved_bytes: int = 256 << 20,
        n_batch: int = 512,
        kv_layout: str = "unified",
        n_gpu_layers: int = 0,
    ) -> None:
        if evict_mode not in self.EVICT_MODES:
            raise ValueError(f"evict_mode must be one of {self.EVICT_MODES}, got {evict_mode!r}")
        if kv_layout not in self.KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {self.KV_LAYOUTS}, got {kv_layout!r}")
        kv_slots = min(kv_slots or max_sessions, max_sessions, 256)  # llama.cpp allows 256 sequences
        self.model = LlamaModel(info, n_gpu_layers=n_gpu_layers)
        self.ctx = LlamaContext(
            self.model, n_ctx=n_ctx, n_seq=kv_slots, n_batch=n_batch, threads=threads, embeddings=False, kv_unified=kv_layout == "unified"
        )
        self.kv_layout = kv_layout
        # cells one session may hold: the whole pool when unified, an equal share when split
        self.seq_cells = self.ctx.n_ctx if kv_layout == "unified" else int(lc.llama_n_ctx_seq(self.ctx.ptr))
        self.max_sessions = max_sessions
        self.kv_slots = kv_slots
        self.evict_mode = evict_mode
        self.max_saved_bytes = max_saved_bytes
        self.stats = EngineStats()
        self.kv_bytes_per_cell = _kv_bytes_per_cell(self.model)
        self._free = list(range(kv_slots - 1, -1, -1))
        self._seqs: dict[int, SeqState] = {}  # by handle
        self._next_handle = 0
        self._cells_used = 0  # sum of n_decoded over resident sessions

    # ---------------------------------------------------------------- sessions

    def open(self, prompt: list[int], sampling: SamplingParams) -> int:
        """A new session (no KV cells yet: they are taken when it is first decoded). Returns its handle."""
        if len(self._seqs) >= self.max_sessions:
            raise EngineFull(f"all {self.max_sessions} sessions are in use")
        handle = self._next_handle
        self._next_handle += 1
        self._seqs[handle] = SeqState(-1, list(prompt), Sampler(sampling), handle=handle, last_used=time.monotonic())
        return handle

    def close(self, seq: int) -> None:
        s = self._seqs.pop(seq, None)
        if s is not None:
            self._release(s)
            self._drop_saved(s)

    def history(self, seq: int) -> list[int]:
        return self._seqs[seq].history

    @property
    def n_sessions(self) -> int:
        return len(self._seqs)

    @property
    def n_resident(self) -> int:
        return self.kv_slots - len(self._free)

    @property
    def cells_used(self) -> int:
        return self._cells_used

    @property
    def kv_budget_bytes(self) -> int:
        return self.ctx.n_ctx * self.kv_bytes_per_cell

    @property
    def kv_bytes_used(self) -> int:
        return self._cells_used * self.kv_bytes_per_cell

    # ---------------------------------------------------------------- residency (KV budget)

    def _release(self, s: SeqState) -> None:
        """Give back a session's sequence slot and cells (its history stays)."""
        if s.seq >= 0:
            self.ctx.clear(s.seq)
            self._free.append(s.seq)
            s.seq = -1
            self._cells_used -= s.n_decoded
            if s.saved is None:  # nothing kept: rebuilt from the history when it returns
                s.n_decoded = 0

    def _drop_saved(self, s: SeqState) -> None:
        if s.saved is not None:
            self.stats.saved_bytes -= len(s.saved)
            s.saved = None
            if s.seq < 0:
                s.n_decoded = 0

    def _evict(self, s: SeqState) -> None:
        if self.evict_mode == "save" and s.n_decoded > 0:
            state = self.ctx.save_seq(s.seq)
            while self.stats.saved_bytes + len(state) > self.max_saved_bytes and self._drop_oldest_saved():
                pass
            if self.stats.saved_bytes + len(state) <= self.max_saved_bytes:
                s.saved = state
                self.stats.saved_bytes += len(state)
        self._release(s)
        s.evicted = True
        self.stats.evictions += 1

    def _drop_oldest_saved(self) -> bool:
        saved = [x for x in self._seqs.values() if x.saved is not None and x.seq < 0]
        if not saved:
            return False
        self._drop_saved(min(saved, key=lambda x: x.last_used))
        return True

    def _victims(self, protect: set[int], pending: set[int] = frozenset()) -> list[SeqState]:  # type: ignore[assignment]
        """Resident sessions that may be evicted: idle ones first, then least recently used."""
        cands = (x for x in self._seqs.values() if x.seq >= 0 and x.handle not in protect)
        return sorted(cands, key=lambda x: (x.handle in pending, x.last_used))

    def _make_room(self, s: SeqState, cells: int, protect: set[int], pending: set[int] = frozenset()) -> bool:  # type: ignore[assignment]
        """Ensure `s` holds a slot (restoring its state) and `cells` more cells are free; evict LRU idle sessions."""
        need_slot = s.seq < 0
        restore = s.n_decoded if need_slot and s.saved is not None else 0
        victims = self._victims(protect | {s.handle}, pending)
        while (need_slot and not self._free) or self.ctx.n_ctx - self._cells_used < cells + restore:
            if not victims:
                return False
            self._evict(victims.pop(0))
        if need_slot:
            s.seq = self._free.pop()
            self.ctx.clear(s.seq)
            if s.saved is not None:
                self.ctx.load_seq(s.seq, s.saved)
                self._drop_saved_keep(s)
                self._cells_used += s.n_decoded
                self.stats.restores_loaded += 1
            elif s.evicted:
                self.stats.restores_recomputed += 1
                self.stats.recomputed_tokens += len(s.history)
            s.evicted = False
        return True

    def _drop_saved_keep(self, s: SeqState) -> None:
        assert s.saved is not None
        self.stats.saved_bytes -= len(s.saved)
        s.saved = None

    def resident(self, seq: int, cells: int = 0) -> SeqState:
        """The session, holding a KV slot and `cells` free cells (for direct engine methods)."""
        s = self._seqs[seq]
        if not self._make_room(s, cells, set()):
            raise EngineFull(f"no KV room for {cells} more cells; the budget is {self.ctx.n_ctx} cells")
        return s

    # ---------------------------------------------------------------- token ops

    def append(self, seq: int, tokens: list[int]) -> None:
        self._seqs[seq].history.extend(tokens)  # kept logits no longer match: take_ready checks the length

    def rollback(self, seq: int, n: int) -> None:
        s = self._seqs[seq]
        if n > len(s.history):
            raise ValueError(f"cannot roll back to {n}: the history holds {len(s.history)} tokens")
        del s.history[n:]
        s.drop_ready()  # the same length may come back with other tokens
        if s.n_decoded > n:
            if s.seq >= 0:
                self.ctx.truncate(s.seq, n)
                self._cells_used -= s.n_decoded - n
            else:
                self._drop_saved(s)  # a saved state past the cut is of no use: rebuild on return
            s.n_decoded = min(s.n_decoded, n)

    def prefill(self, seq: int) -> float:
        """Decode the pending tokens and keep the next position's logits (background work after
        a sync; see the module docstring). Returns seconds spent."""
        s = self._seqs[seq]
        end = len(s.history)
        if end <= s.n_decoded or not s.history:
            return 0.0
        t0 = time.perf_counter()
        out = self._decode(s, end, want_logits=True)
        s.keep_ready(self.ctx.logits(out))
        dt = time.perf_counter() - t0
        s.compute_s += dt
        return dt

    def generate_one(self, seq: int) -> tuple[int, float, float]:
        """Write the next token: (token, logprob, seconds of compute). The token joins the history.

        The unbatched path; the server batches through `step` (cloud_server/scheduler.py).
        """
        s = self._seqs[seq]
        if not s.history:
            raise ValueError("cannot generate from an empty history")
        t0 = time.perf_counter()
        ready = s.take_ready()
        if ready is not None:
            token, logprob = self._write_ready(s, ready)
        else:
            self._stale_last(s)
            out = self._decode(s, len(s.history), want_logits=True)
            token, logprob = self._sample(s, out)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        return token, logprob, dt

    def _stale_last(self, s: SeqState) -> None:
        """Logits of the last decoded token may be stale (others decoded since): redo that token."""
        if s.n_decoded == len(s.history) and s.n_decoded > 0:
            if s.seq >= 0:
                self.ctx.truncate(s.seq, s.n_decoded - 1)
                self._cells_used -= 1
                s.n_decoded -= 1
            else:
                self._drop_saved(s)  # rebuilt by re-prefill

    def peek_next(self, seq: int) -> Guess:
        """The token the session would write next, from the kept logits, without writing it,
        with the most likely tokens there; NO_GUESS when no kept logits describe the history.
        The choice is remembered, so a later generate at this position writes this very token
        (a `next` message promised it), even when sampling is random."""
        s = self._seqs[seq]
        if not s.has_ready:
            return NO_GUESS
        if s.guess < 0:
            s.guess = s.sampler.sample(s.ready)
        g = Guess.of(s.ready, s.guess)
        s.guess_logprob = g.logprob
        return g

    def _write_ready(self, s: SeqState, logits: np.ndarray) -> tuple[int, float]:
        """Write the next token from kept logits: the announced guess if there is one."""
        if s.guess < 0:
            return self._sample_from(s, logits)
        token, logprob, s.guess = s.guess, s.guess_logprob, -1
        s.history.append(token)
        return token, logprob

    def _sample(self, s: SeqState, out: int) -> tuple[int, float]:
        return self._sample_from(s, self.ctx.logits(out))

    def _sample_from(self, s: SeqState, logits: np.ndarray) -> tuple[int, float]:
        token = s.sampler.sample(logits)
        logprob = log_softmax_at(logits, token)
        s.history.append(token)
        return token, logprob

    def step(self, reqs: list, budget: int) -> tuple[list, int, int, float]:
        """One batched decode serving `reqs` (scheduler Requests, oldest first) within `budget` tokens.

        Returns (outcomes in request order, items decoded, tokens decoded, decode seconds).
        A generate whose pending tokens exceed the remaining budget gets a chunk
        of them decoded now and its token in a later batch.
        """
        from cloud_server.scheduler import GENERATE, StepOutcome

        outcomes = [StepOutcome() for _ in reqs]
        pending = {r.handle for r in reqs}
        protect: set[int] = set()  # sessions already in this batch
        plan: list[tuple[int, SeqState, int, bool]] = []  # (request index, state, end, wants output)
        left = budget
        for i, r in enumerate(reqs):
            s = self._seqs.get(r.handle)
            if s is None:
                outcomes[i].error = KeyError(f"session {r.handle} is closed")
                continue
            gen = r.kind == GENERATE
            if gen and not s.history:
                outcomes[i].error = ValueError("cannot generate from an empty history")
                continue
            if gen and (ready := s.take_ready()) is not None:  # kept by a prefill: no decode
                outcomes[i].done, outcomes[i].result = True, (*self._write_ready(s, ready), r.compute_s)
                s.last_used = time.monotonic()
                continue
            if left <= 0:
                continue
            if gen:
                self._stale_last(s)
            target = len(s.history)
            base = s.n_decoded if (s.seq >= 0 or s.saved is not None) else 0
            if target <= base:
                outcomes[i].done, outcomes[i].result = True, 0.0
                continue
            take = min(target - base, left)
            if target > self.seq_cells:
                outcomes[i].error = EngineFull(f"session needs {target} KV cells; a session may hold {self.seq_cells}")
                continue
            if not self._make_room(s, take, protect, pending):
                if not plan:  # every other session could have been evicted: it can never fit
                    outcomes[i].error = EngineFull(f"the KV budget ({self.ctx.n_ctx} cells) cannot hold this session")
                continue  # older requests hold the room: next batch
            protect.add(s.handle)
            plan.append((i, s, s.n_decoded + take, s.n_decoded + take == len(s.history)))
            left -= take
        if not plan:
            return outcomes, 0, 0, 0.0
        items = [DecodeItem(s.seq, s.n_decoded, s.history[s.n_decoded : end]) for _, s, end, _ in plan]
        n_tokens = sum(len(it.tokens) for it in items)
        t0 = time.perf_counter()
        try:
            outs = self.ctx.decode(items)
        except DecodeError as exc:
            for i, s, _, _ in plan:
                self.ctx.truncate(s.seq, s.n_decoded)  # drop any partially written cells
                outcomes[i].error = EngineFull(str(exc))
            return outcomes, 0, 0, time.perf_counter() - t0
        now = time.monotonic()
        for (i, s, end, want), out in zip(plan, outs):
            self._cells_used += end - s.n_decoded
            s.n_decoded = end
            s.last_used = now
            outcomes[i].progressed = True
            if want and reqs[i].kind == GENERATE:
                token, logprob = self._sample(s, out)
                outcomes[i].done, outcomes[i].result = True, (token, logprob)
            elif want:  # a prefill that reached the end: keep the next position's logits
                s.keep_ready(self.ctx.logits(out))
                outcomes[i].done, outcomes[i].result = True, 0.0
        dt = time.perf_counter() - t0
        for (i, s, _, _) in plan:
            s.compute_s += dt
            reqs[i].compute_s += dt
            if outcomes[i].done and reqs[i].kind == GENERATE:
                token, logprob = outcomes[i].result
                outcomes[i].result = (token, logprob, reqs[i].compute_s)
            elif outcomes[i].done:
                outcomes[i].result = reqs[i].compute_s
        return outcomes, len(items), n_tokens, dt

    def verify(self, seq: int, tokens: list[int], offsets: list[int], bonus: bool = False, tolerance: float = 0.0) -> VerifyResult:
        """Check drafted `tokens` (appended after the history) in one forward pass.

        Used by the `verify` message (router-verify, speculative decoding). At
        each offset in `offsets` the cloud's own choice (its sampler; argmax when
        greedy) is compared with the draft. With `tolerance` > 0 every other
        offset is checked too, leniently: a draft more than `tolerance` nats
        below the cloud's most likely token is rejected, and the cloud's own
        choice written there. The history keeps the drafts up to the first
        rejected offset, then the cloud's token there; with `bonus` and no
        rejection the cloud's next token is appended as well.
        """
        s = self._seqs[seq]
        if not s.history:
            raise ValueError("cannot verify from an empty history")
        if len(tokens) + 1 > self.ctx.n_batch:
            raise ValueError(f"at most {self.ctx.n_batch - 1} drafted tokens per verify")
        base = len(s.history)
        if base + len(tokens) > self.seq_cells:
            raise EngineFull(f"session needs {base + len(tokens)} KV cells; a session may hold {self.seq_cells}")
        t0 = time.perf_counter()
        self._stale_last(s)
        if s.n_decoded < base - 1:
            self._decode(s, base - 1, want_logits=False)  # pending history, no outputs
        s = self.resident(seq, len(tokens) + 1)
        rows = [s.history[-1], *tokens]  # row r predicts the token at offset r
        exact = set(offsets)
        wanted = (list(range(len(tokens))) if tolerance > 0 else list(offsets)) + ([len(tokens)] if bonus else [])
        try:
            outs = self.ctx.decode_outputs(DecodeItem(s.seq, base - 1, rows), wanted)
        except DecodeError as exc:
            self.ctx.truncate(s.seq, s.n_decoded)
            raise EngineFull(str(exc)) from exc
        self._cells_used += base + len(tokens) - s.n_decoded
        s.n_decoded = base + len(tokens)
        result = VerifyResult(accepted=len(tokens))
        for offset, out in zip(wanted, outs):
            logits = self.ctx.logits(out)
            if offset < len(tokens) and offset not in exact and regret(logits, tokens[offset]) <= tolerance:
                continue  # leniently checked and within the tolerance: the draft stands (no draw from the sampler)
            token = s.sampler.sample(logits)
            if offset == len(tokens) or token != tokens[offset]:
                result.accepted, result.token, result.logprob = offset, token, log_softmax_at(logits, token)
                break
        keep = base + result.accepted  # drafted tokens the history keeps
        if keep < s.n_decoded:
            self.ctx.truncate(s.seq, keep)
            self._cells_used -= s.n_decoded - keep
            s.n_decoded = keep
        s.history.extend(tokens[: result.accepted])
        if result.token >= 0:
            s.history.append(result.token)
            result.eog = self.model.is_eog(result.token)
        s.last_used = time.monotonic()
        dt = time.perf_counter() - t0
        s.compute_s += dt
        result.compute_ms = dt * 1000.0
        return result

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def _decode(self, s: SeqState, end: int, want_logits: bool) -> int:
        if end > self.seq_cells:
            raise EngineFull(f"session needs {end} KV cells; a session may hold {self.seq_cells}")
        self.resident(s.handle, end - (s.n_decoded if s.seq >= 0 or s.saved is not None else 0))
        tokens = s.history[s.n_decoded : end]
        try:
            out = self.ctx.decode([DecodeItem(s.seq, s.n_decoded, tokens)])[0]
        except DecodeError as exc:
            self.ctx.truncate(s.seq, s.n_decoded)  # drop any partially written cells
            raise EngineFull(str(exc)) from exc
        self._cells_used += end - s.n_decoded
        s.n_decoded = end
        s.last_used = time.monotonic()
        return out if want_logits else -1

    def close_all(self) -> None:
        for seq in list(self._seqs):
            self.close(seq)
        self.ctx.close()
        self.model.close()


class EngineWorker:
    """Runs engine work on one dedicated thread, awaitable from asyncio.

    `call(fn, *args)` runs any engine method there; `generate`/`prefill` go
    through the batch scheduler, which serves many sessions in one decode.
    """

    def __init__(self, engine: CloudEngine, max_batch_tokens: int = 512, observer: "BatchObserver | None" = None) -> None:
        from cloud_server.scheduler import BatchScheduler

        self.engine = engine
        self.scheduler = BatchScheduler(engine, max_batch_tokens, observer)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        return await self.scheduler.call(fn, *args)

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        return self.scheduler.submit(fn, *args)

    async def generate(self, seq: int) -> tuple[int, float, float]:
        """The session's next token, batched with other sessions': (token, logprob, compute seconds)."""
        from cloud_server.scheduler import GENERATE

        return await self.scheduler.request(seq, GENERATE)

    async def prefill(self, seq: int) -> float:
        """Decode the session's pending tokens (all but the last), batched. Returns compute seconds."""
        from cloud_server.scheduler import PREFILL

        return await self.scheduler.request(seq, PREFILL)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.engine.close_all()


def _kv_bytes_per_cell(model: LlamaModel) -> int:
    """Bytes one token takes in the KV cache (f16 keys and values, every layer)."""
    n_layer = int(lc.llama_model_n_layer(model.ptr))
    n_head = max(1, int(lc.llama_model_n_head(model.ptr)))
    n_head_kv = int(lc.llama_model_n_head_kv(model.ptr))
    head_dim = model.n_embd // n_head
    return 2 * n_layer * n_head_kv * head_dim * 2
