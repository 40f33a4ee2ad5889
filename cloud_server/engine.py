"""The cloud's embedded model engine: one llama.cpp context, one sequence per session.

Sessions share one KV pool (cloud_server/kv_pool.py: slots, the cell budget,
LRU eviction, save/restore); this module decodes, writes tokens and judges
drafts. It implements `Engine` (cloud_server/engine_api.py) and, for the batch
scheduler, `BatchEngine.step` (cloud_server/batch.py).

Not thread-safe by design: every call runs on the server's single engine
thread (see `EngineWorker` in cloud_server/scheduler.py), which also makes the
order of a session's operations the order its messages arrived in.

A prefill (the background work after a `sync`) decodes the whole history and
keeps a copy of the next position's logits (`SeqState.ready`). A hard-token
request that brings no new tokens, the common case once the device syncs
eagerly, then samples from that copy without a decode: the device waits for
a round trip, not for the model. Any other change of the history (new tokens,
a rollback, a verify) drops the copy, and `generate` decodes at least the last
token, so its logits are fresh even if other sessions decoded in between.

Who writes a token is decided by shared/decision.py: `generate` writes
`cloud_choice` (a proposed token within TIE_NATS of the best stands under
greedy decoding, since llama.cpp's batched and one-token kernels differ
bitwise) and `verify` judges each draft with `judge_draft`.

Batch isolation: a batched decode that fails is split in halves and retried,
down to the request that fails alone; a session whose logits are not finite
fails alone (its cells are dropped). No other session sees the error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NoReturn

import llama_cpp as lc
import numpy as np

from cloud_server.batch import GENERATE, Request, StepOutcome, StepReport
from cloud_server.engine_api import (
    Capabilities,
    EmptyHistory,
    EngineError,
    EngineFailed,
    EngineFull,
    GenerateResult,
    NotSupported,
    VerifyResult,
)
from cloud_server.kv_pool import EVICT_MODES, EngineStats, KVPool, Residency
from shared.decision import cloud_choice, judge_draft
from shared.llama_backend import DecodeError, DecodeItem, LlamaContext, LlamaModel
from shared.model_info import ModelInfo
from shared.protocol import SamplingParams, Work
from shared.sampling import NO_GUESS, Guess, Sampler, SamplingError, log_softmax_at
from shared.text_history import AnswerText

__all__ = ["CloudEngine", "EngineStats", "SeqState"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqState:
    """One session: its token history (the truth), its sampler, and where its KV lives (`kv`)."""

    kv: Residency
    history: list[int]
    sampler: Sampler
    compute_s: float = 0.0
    ready: np.ndarray | None = None  # next position's logits kept by a prefill; valid while ready_len == len(history)
    ready_len: int = -1
    guess: int = -1  # the token announced for the next position (a `next` message), written if asked there
    guess_logprob: float = 0.0
    work: Work = field(default_factory=Work)  # passes and tokens since the session last took them (take_work)

    def count_pass(self, kind: str, n_tokens: int) -> None:
        """One forward pass that processed `n_tokens` of this session's tokens for `kind` (a Work field)."""
        if n_tokens > 0:
            self.work.passes += 1
            setattr(self.work, kind, getattr(self.work, kind) + n_tokens)

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
class _Planned:
    """A request's share of one batched decode: its session's history up to `end`."""

    index: int  # in the step's request list
    state: SeqState
    end: int
    wants_output: bool  # the decode reaches the end of the history: logits for the next position


class CloudEngine:
    """Sessions over one shared KV pool of `n_ctx` cells (the KV memory budget).

    `max_sessions` sessions may be open; at most `kv_slots` of them hold KV
    cells at once; the pool evicts idle ones when a session needs room.
    """

    EVICT_MODES = EVICT_MODES
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
        if evict_mode not in EVICT_MODES:
            raise ValueError(f"evict_mode must be one of {EVICT_MODES}, got {evict_mode!r}")
        if kv_layout not in self.KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {self.KV_LAYOUTS}, got {kv_layout!r}")
        kv_slots = min(kv_slots or max_sessions, max_sessions, 256)  # llama.cpp allows 256 sequences
        self.model = LlamaModel(info, n_gpu_layers=n_gpu_layers)
        self.ctx = LlamaContext(
            self.model,
            n_ctx=n_ctx,
            n_seq=kv_slots,
            n_batch=n_batch,
            threads=threads,
            embeddings=False,
            kv_unified=kv_layout == "unified",
        )
        self.kv_layout = kv_layout
        # cells one session may hold: the whole pool when unified, an equal share when split
        seq_cells = self.ctx.n_ctx if kv_layout == "unified" else int(lc.llama_n_ctx_seq(self.ctx.ptr))
        self.pool = KVPool(self.ctx, kv_slots, seq_cells, evict_mode, max_saved_bytes)
        self.max_sessions = max_sessions
        self._seqs: dict[int, SeqState] = {}  # by handle
        self._next_handle = 0
        self._caps = Capabilities(
            "llama.cpp",
            self.model.n_vocab,
            guess=True,
            verify=True,
            max_verify_tokens=self.ctx.n_batch - 1,
            how="embedded llama.cpp: every logit in-process",
            text=True,
        )
        self._answer_text = AnswerText.for_model(self.model)

    # ---------------------------------------------------------------- what it is

    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def n_batch(self) -> int:
        """Tokens one decode may take (the scheduler caps its batches at this)."""
        return self.ctx.n_batch

    @property
    def n_sessions(self) -> int:
        return len(self._seqs)

    # the pool's figures, for metrics and tests
    @property
    def stats(self) -> EngineStats:
        return self.pool.stats

    @property
    def seq_cells(self) -> int:
        return self.pool.seq_cells

    @property
    def kv_slots(self) -> int:
        return self.pool.kv_slots

    @property
    def n_resident(self) -> int:
        return self.pool.n_resident

    @property
    def cells_used(self) -> int:
        return self.pool.cells_used

    @property
    def kv_budget_bytes(self) -> int:
        return self.pool.kv_budget_bytes

    @property
    def kv_bytes_used(self) -> int:
        return self.pool.kv_bytes_used

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        return self.model.chat_tokens(messages)

    def answer_text(self) -> AnswerText:
        """Text mode (protocol v3): this model's view of the shared answer text."""
        return self._answer_text

    def eog_token(self) -> int:
        return self.model.eog_token

    def peek(self, handle: int) -> int:
        """The argmax of the logits a prefill kept for the next position, or -1 when none describe
        the history. Nothing is written or promised (text mode's span rule looks ahead with it)."""
        s = self._seqs[handle]
        return int(np.argmax(s.ready)) if s.ready is not None and s.has_ready else -1

    def peek_guess(self, handle: int) -> Guess | None:
        """`peek` with the most likely tokens and their log-probabilities (text mode's lookahead
        guess, shared/text_history.py `TextGuess`); None when no kept logits describe the history."""
        s = self._seqs[handle]
        if s.ready is None or not s.has_ready:
            return None
        return Guess.of(s.ready, int(np.argmax(s.ready)))

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    # ---------------------------------------------------------------- sessions

    def open(self, prompt: list[int], sampling: SamplingParams) -> int:
        """A new session (no KV cells yet: they are taken when it is first decoded). Returns its handle."""
        if len(self._seqs) >= self.max_sessions:
            raise EngineFull(f"all {self.max_sessions} sessions are in use")
        handle = self._next_handle
        self._next_handle += 1
        self._seqs[handle] = SeqState(self.pool.add(handle), list(prompt), Sampler(sampling))
        return handle

    def close(self, handle: int) -> None:
        s = self._seqs.pop(handle, None)
        if s is not None:
            self.pool.remove(s.kv)

    def history(self, handle: int) -> list[int]:
        return self._seqs[handle].history

    def append(self, handle: int, tokens: list[int]) -> None:
        self._seqs[handle].history.extend(tokens)  # kept logits no longer match: take_ready checks the length

    def rollback(self, handle: int, n: int) -> None:
        s = self._seqs[handle]
        if not 0 <= n <= len(s.history):
            raise ValueError(f"cannot roll back to {n}: the history holds {len(s.history)} tokens")
        del s.history[n:]
        s.drop_ready()  # the same length may come back with other tokens
        self.pool.truncate(s.kv, n)

    def take_work(self, handle: int) -> Work:
        """The session's passes and tokens since the last call (then reset)."""
        s = self._seqs.get(handle)
        if s is None:
            return Work()
        work, s.work = s.work, Work()
        return work

    def close_all(self) -> None:
        for handle in list(self._seqs):
            self.close(handle)
        self.ctx.close()
        self.model.close()

    # ---------------------------------------------------------------- one session at a time

    def prefill(self, handle: int) -> float:
        """Decode the pending tokens and keep the next position's logits (background work after
        a sync; see the module docstring). Returns seconds spent."""
        s = self._seqs[handle]
        end = len(s.history)
        if end <= s.kv.n_decoded or not s.history:
            return 0.0
        t0 = time.perf_counter()
        n = end - s.kv.n_decoded
        s.keep_ready(self._decode_to(s, end))
        s.count_pass("prefill_tokens", n)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        return dt

    def generate(self, handle: int, proposed: int = -1) -> GenerateResult:
        """Write the next token (shared/decision.py's `cloud_choice` with the device's `proposed`
        token, -1: none); it joins the history. The unbatched path: the server batches through `step`."""
        s = self._seqs[handle]
        if not s.history:
            raise EmptyHistory("generate")
        t0 = time.perf_counter()
        ready = s.take_ready()
        if ready is not None:
            token, logprob = self._write_ready(s, ready, proposed)
        else:
            self._redo_last(s)
            n = len(s.history) - s.kv.n_decoded
            logits = self._decode_to(s, len(s.history))
            s.count_pass("generate_tokens", n)
            token, logprob = self._write(s, logits, proposed)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        return GenerateResult(token, logprob, dt)

    def guess(self, handle: int) -> Guess:
        """The token the session would write next, from the kept logits, without writing it,
        with the most likely tokens there; NO_GUESS when no kept logits describe the history.
        The choice is remembered, so a later generate at this position writes this very token
        (a `next` message promised it), even when sampling is random."""
        s = self._seqs[handle]
        if s.ready is None or not s.has_ready:
            return NO_GUESS
        if s.guess < 0:
            s.guess = s.sampler.sample(s.ready)
        g = Guess.of(s.ready, s.guess)
        s.guess_logprob = g.logprob
        return g

    def expect_guess(self, handle: int, wanted: bool) -> None:
        """Nothing to prepare: the guess comes from decoding the written token (see `guess`)."""

    def verify(
        self, handle: int, tokens: list[int], check: list[int], bonus: bool = False, tolerance: float = 0.0
    ) -> VerifyResult:
        """Judge drafted `tokens` (appended after the history) in one forward pass.

        Used by the `verify` message (the device's check, router-verify, speculative decoding).
        Each draft at an offset in `check` (router-flagged) is judged exactly, and with
        `tolerance` > 0 every other draft leniently (shared/decision.py's `judge_draft`); the
        others stand unread. The history keeps the drafts up to the first rejected one, then the
        cloud's token there; with `bonus` and no rejection the cloud's next token is appended.
        """
        s = self._seqs[handle]
        if not s.history:
            raise EmptyHistory("verify")
        if len(tokens) > self._caps.max_verify_tokens:
            raise NotSupported(f"at most {self._caps.max_verify_tokens} drafted tokens per verify")
        base = len(s.history)
        self.pool.check_fits(base + len(tokens))
        t0 = time.perf_counter()
        s.drop_ready()
        self._redo_last(s)
        if s.kv.n_decoded < base - 1:
            n = base - 1 - s.kv.n_decoded
            self._decode_to(s, base - 1, want_logits=False)  # pending history, no outputs
            s.count_pass("verify_tokens", n)
        self.pool.ensure(s.kv, len(tokens) + 1, n_history=base)
        rows = [s.history[-1], *tokens]  # row r predicts the token at offset r
        exact = set(check)
        wanted = (list(range(len(tokens))) if tolerance > 0 else list(check)) + ([len(tokens)] if bonus else [])
        try:
            outs = self._decode_outputs(DecodeItem(s.kv.seq, base - 1, rows), wanted)
            result = self._judge(s, tokens, exact, tolerance, wanted, outs)
        except Exception as exc:
            self.pool.discard_partial(s.kv)  # the history is unchanged: so are its cells
            _raise_named(exc)
        s.count_pass("verify_tokens", len(rows))
        self.pool.decoded(s.kv, base + len(tokens))
        self.pool.truncate(s.kv, base + result.accepted)  # drafted tokens the history keeps
        s.history.extend(tokens[: result.accepted])
        if result.token >= 0:
            s.history.append(result.token)
            result.eog = self.model.is_eog(result.token)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        result.compute_ms = dt * 1000.0
        return result

    def _judge(
        self, s: SeqState, tokens: list[int], exact: set[int], tolerance: float, wanted: list[int], outs: list[int]
    ) -> VerifyResult:
        result = VerifyResult(accepted=len(tokens))
        for offset, out in zip(wanted, outs):
            logits = self._finite_logits(out)
            if offset < len(tokens):
                token = judge_draft(logits, tokens[offset], offset in exact, tolerance, s.sampler)
                if token < 0:
                    continue  # the draft stands
            else:
                token = cloud_choice(logits, s.sampler)  # the bonus: the cloud's own next token
            result.accepted, result.token, result.logprob = offset, token, log_softmax_at(logits, token)
            break
        return result

    # ---------------------------------------------------------------- many sessions in one decode

    def step(self, reqs: list[Request], budget: int) -> StepReport:
        """One batched decode serving `reqs` (scheduler Requests, oldest first) within `budget` tokens.

        A generate whose pending tokens exceed the remaining budget gets a chunk of them decoded
        now and its token in a later batch. A failure is confined to the request that causes it
        (see the module docstring); the report sums every decode this took.
        """
        outcomes = [StepOutcome() for _ in reqs]
        plan = self._plan(reqs, budget, outcomes)
        n_items = n_tokens = 0
        decode_s = 0.0
        groups = [plan] if plan else []
        while groups:  # a stack: a failed group is retried as two halves, the first half first
            group = groups.pop()
            items = [
                DecodeItem(p.state.kv.seq, p.state.kv.n_decoded, p.state.history[p.state.kv.n_decoded : p.end])
                for p in group
            ]
            t0 = time.perf_counter()
            try:
                outs = self._decode_items(items)
                error: Exception | None = None
            except Exception as exc:  # noqa: BLE001 - confined below to the request that causes it
                error = exc
            dt = time.perf_counter() - t0
            decode_s += dt
            for p in group:
                reqs[p.index].compute_s += dt
                p.state.compute_s += dt
            if error is not None:
                for p in group:
                    self.pool.discard_partial(p.state.kv)
                if len(group) == 1:
                    if not isinstance(error, DecodeError):
                        log.warning("decode failed for session %d", group[0].state.kv.handle, exc_info=error)
                    outcomes[group[0].index].error = _named(error)
                else:
                    mid = len(group) // 2
                    groups += [group[mid:], group[:mid]]
                continue
            n_items += len(items)
            n_tokens += sum(len(it.tokens) for it in items)
            for p, item in zip(group, items):  # one pass for each session in it (shared/protocol.py, Work)
                kind = "generate_tokens" if reqs[p.index].kind == GENERATE else "prefill_tokens"
                p.state.count_pass(kind, len(item.tokens))
            for p, out in zip(group, outs):
                self._finish(p, reqs[p.index], outcomes[p.index], out)
        for r, o in zip(reqs, outcomes):
            if o.done and r.kind == GENERATE:
                o.result = GenerateResult(o.result[0], o.result[1], r.compute_s)
            elif o.done:
                o.result = r.compute_s
        return StepReport(outcomes, n_items, n_tokens, decode_s)

    def _plan(self, reqs: list[Request], budget: int, outcomes: list[StepOutcome]) -> list[_Planned]:
        """Which requests this decode serves and how far; answers those that need no decode."""
        pending = {r.handle for r in reqs}
        protect: set[int] = set()  # sessions already in this batch
        plan: list[_Planned] = []
        left = budget
        for i, r in enumerate(reqs):
            s = self._seqs.get(r.handle)
            if s is None:
                outcomes[i].error = EngineFailed(f"session {r.handle} is closed")
                continue
            gen = r.kind == GENERATE
            if gen and not s.history:
                outcomes[i].error = EmptyHistory("generate")
                continue
            if gen and (ready := s.take_ready()) is not None:  # kept by a prefill: no decode
                try:
                    outcomes[i].result = self._write_ready(s, ready, r.proposed)
                    outcomes[i].done = True
                except SamplingError as exc:
                    outcomes[i].error = exc
                s.kv.last_used = time.monotonic()
                continue
            if left <= 0:
                continue
            if gen:
                self._redo_last(s)
            target = len(s.history)
            base = s.kv.n_decoded
            if target <= base:
                outcomes[i].done = True
                continue
            if target > self.pool.seq_cells:
                outcomes[i].error = EngineFull(
                    f"session needs {target} KV cells; a session may hold {self.pool.seq_cells}"
                )
                continue
            take = min(target - base, left)
            if not self.pool.make_room(s.kv, take, protect, pending, n_history=target):
                if not plan:  # every other session could have been evicted: it can never fit
                    outcomes[i].error = EngineFull(f"the KV budget ({self.pool.n_ctx} cells) cannot hold this session")
                continue  # older requests hold the room: next batch
            protect.add(r.handle)
            plan.append(_Planned(i, s, base + take, base + take == target))
            left -= take
        return plan

    def _finish(self, p: _Planned, r: Request, outcome: StepOutcome, out: int) -> None:
        """After a decode that included `p`: commit its cells, then write its token or keep its logits."""
        s = p.state
        logits = None
        if p.wants_output:
            try:
                logits = self._finite_logits(out)
            except SamplingError as exc:
                self.pool.discard_partial(s.kv)  # not committed: this session alone fails, its cells as before
                outcome.error = exc
                return
        self.pool.decoded(s.kv, p.end)
        outcome.progressed = True
        if logits is None:
            return
        if r.kind == GENERATE:
            try:
                outcome.result = self._write(s, logits, r.proposed)
                outcome.done = True
            except SamplingError as exc:
                outcome.error = exc
        else:  # a prefill that reached the end: keep the next position's logits
            s.keep_ready(logits)
            outcome.done = True

    # ---------------------------------------------------------------- writing tokens

    def _write(self, s: SeqState, logits: np.ndarray, proposed: int) -> tuple[int, float]:
        """Append the cloud's choice where the device proposed `proposed` (the tie rule)."""
        if not 0 <= proposed < logits.shape[0]:
            proposed = -1
        token = cloud_choice(logits, s.sampler, proposed)
        logprob = log_softmax_at(logits, token)
        s.history.append(token)
        return token, logprob

    def _write_ready(self, s: SeqState, logits: np.ndarray, proposed: int) -> tuple[int, float]:
        """Write the next token from kept logits: the announced guess if there is one (it was promised)."""
        if s.guess < 0:
            return self._write(s, logits, proposed)
        token, logprob, s.guess = s.guess, s.guess_logprob, -1
        s.history.append(token)
        return token, logprob

    # ---------------------------------------------------------------- decoding

    def _redo_last(self, s: SeqState) -> None:
        """Logits of the last decoded token may be stale (others decoded since): decode that token again."""
        if s.kv.n_decoded == len(s.history):
            self.pool.forget_last(s.kv)

    def _decode_to(self, s: SeqState, end: int, want_logits: bool = True) -> np.ndarray:
        """Decode the session's history up to `end` alone; the logits of position `end` (checked finite)."""
        self.pool.check_fits(end)
        self.pool.ensure(s.kv, end - s.kv.n_decoded, n_history=len(s.history))
        item = DecodeItem(s.kv.seq, s.kv.n_decoded, s.history[s.kv.n_decoded : end])
        try:
            out = self._decode_items([item])[0]
            logits = self._finite_logits(out) if want_logits else np.empty(0, dtype=np.float32)
        except Exception as exc:
            self.pool.discard_partial(s.kv)  # drop any partially written cells
            _raise_named(exc)
        self.pool.decoded(s.kv, end)
        return logits

    def _finite_logits(self, out: int) -> np.ndarray:
        """Output `out`'s logits; SamplingError if any is NaN or +inf (a broken decode)."""
        logits = self._output_logits(out)
        if not np.isfinite(np.max(logits)):  # NaN propagates through max, +inf is the max
            raise SamplingError("the model's logits are not finite at this position; the decode was dropped")
        return logits

    # the three calls into llama.cpp (a test subclass overrides them to inject failures)
    def _decode_items(self, items: list[DecodeItem]) -> list[int]:
        return self.ctx.decode(items)

    def _decode_outputs(self, item: DecodeItem, wanted: list[int]) -> list[int]:
        return self.ctx.decode_outputs(item, wanted)

    def _output_logits(self, out: int) -> np.ndarray:
        return self.ctx.logits(out)


def _named(exc: BaseException) -> Exception:
    """A failure of one session's decode as an error the session can answer (EngineError or SamplingError)."""
    if isinstance(exc, (EngineError, SamplingError)):
        return exc
    if isinstance(exc, DecodeError):
        return EngineFull(str(exc))
    return EngineFailed(f"the engine failed on this request ({type(exc).__name__}: {exc})")


def _raise_named(exc: Exception) -> NoReturn:
    """Re-raise `exc` as its named error (itself if it already is one)."""
    named = _named(exc)
    if named is exc:
        raise exc
    raise named from exc
