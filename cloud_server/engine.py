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

Fair sharing between keys: short work first. Each session's owner (its API key) has an account at
the engine (`Usage`): the engine time its sessions used (`vtime`), and whether it asked lately for
work longer than one chunk (a prefill or verify past the per-session tokens of a step: hundreds of
drafts, a long text, a history to recompute after churning the KV cache), or whose device left
replies unread until it was dropped (`demote`). Such a key is heavy for `HEAVY_HOLD_S`. While any light key is at work (a request queued, or one within `ANTICIPATE_S`: a
device between two hard tokens is thinking, not gone) only light keys are served, and a heavy key
at most once per `STARVE_S`, so it is slowed, never stopped; among the keys served, those within
`FAIR_SLICE_S` of engine time of the least-served go first (fair queueing, as Linux's CFS does for
CPU time; a key back from idle cannot bank the time it was away, nor gain any by opening more
sessions). A heavy key's sessions take a quarter of the per-session tokens of a step, so a device
that comes to the engine while they have it waits a short chunk only. No session takes more than
`per_session` tokens of one step, and a verify is judged `MAX_VERIFY_ROWS` drafts at a time
(`verify_step`), so the wait for a running step, and the logits buffer a verify needs, stay bounded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NoReturn

import llama_cpp as lc
import numpy as np

from cloud_server.batch import GENERATE, TURN, Request, StepOutcome, StepReport, VerifyJob
from cloud_server.engine_api import (
    Capabilities,
    EmptyHistory,
    EngineError,
    EngineFailed,
    EngineFull,
    GenerateResult,
    NotSupported,
    Owner,
    VerifyResult,
)
from cloud_server.kv_pool import EVICT_MODES, EngineStats, KVPool, Residency
from shared.decision import cloud_choice, judge_draft
from shared.llama_backend import DecodeError, DecodeItem, LlamaContext, LlamaModel
from shared.model_info import ModelInfo
from shared.protocol import SamplingParams, Work
from shared.sampling import NO_GUESS, Guess, Sampler, SamplingError, log_softmax_at
from shared.text_history import AnswerText

__all__ = ["CloudEngine", "EngineStats", "SeqState", "Usage"]

log = logging.getLogger(__name__)

FAIR_SLICE_S = 0.05  # engine seconds a key may run ahead of the least-served key at work
ANTICIPATE_S = 0.5  # a key that had work queued this recently still counts as at work (a device thinking)
HEAVY_HOLD_S = 10.0  # a key that asked for work longer than one chunk stays heavy this long
STARVE_S = 1.0  # a heavy key held back this long gets one turn anyway
HEAVY_CHUNK = 4  # a heavy key's sessions take 1/HEAVY_CHUNK of the per-session tokens of a step
MAX_VERIFY_ROWS = 64  # rows (drafts + 1) one piece of a verify decodes: its logits take 64 x n_vocab floats


class Usage:
    """One owner's (API key's) account at the engine, shared by its sessions (module docstring)."""

    def __init__(self) -> None:
        self.vtime = 0.0  # engine seconds charged (fair queueing)
        self.last_busy = -float("inf")  # when one of its sessions last had a request queued (monotonic)
        self.heavy_until = 0.0  # heavy (it asked for work longer than one chunk) until then
        self.served_at = 0.0  # when it was last given a turn
        self.sessions = 0

    def heavy(self, now: float) -> bool:
        return now < self.heavy_until

    def long_work(self, now: float) -> None:
        """One of its requests needs more than one chunk: heavy for HEAVY_HOLD_S."""
        self.heavy_until = now + HEAVY_HOLD_S


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
    use: Usage = field(default_factory=Usage)  # its owner's account at the engine (shared by its sessions)

    def charge(self, seconds: float) -> None:
        """`seconds` of engine time used by this session, charged to its owner."""
        self.use.vtime += seconds

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
        self._vclock = 0.0  # the least-served busy key's engine time, never decreasing (fair queueing)
        self._uses: dict[str, Usage] = {}  # by owner name (or "#handle" for a session without an owner)
        self._caps = Capabilities(
            "llama.cpp",
            self.model.n_vocab,
            guess=True,
            verify=True,
            max_verify_tokens=self.ctx.n_batch - 1,
            how="embedded llama.cpp: every logit in-process",
            text=True,
            session_cells=seq_cells,
        )
        self._answer_text = AnswerText.for_model(self.model, bounded=True)  # text mode refuses long text unread

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

    def open(self, prompt: list[int], sampling: SamplingParams, owner: Owner | None = None) -> int:
        """A new session (no KV cells yet: they are taken when it is first decoded). Returns its handle.
        `owner`: whose KV churn budget pays for the evictions it causes (cloud_server/kv_pool.py)."""
        if len(self._seqs) >= self.max_sessions:
            raise EngineFull(f"all {self.max_sessions} sessions are in use")
        handle = self._next_handle
        self._next_handle += 1
        key = owner.name if owner is not None and owner.name else f"#{handle}"  # no owner: the session alone
        use = self._uses.setdefault(key, Usage())
        use.sessions += 1
        self._wake(use, time.monotonic())  # at work from now: its prompt's prefill comes next
        self._seqs[handle] = SeqState(self.pool.add(handle, owner), list(prompt), Sampler(sampling), use=use)
        return handle

    def demote(self, owner: str) -> None:
        """`owner`'s device asked for work it does not read (a slow reader): its key is heavy for a while."""
        if owner in self._uses:
            self._uses[owner].long_work(time.monotonic())

    def close(self, handle: int) -> None:
        s = self._seqs.pop(handle, None)
        if s is not None:
            self.pool.remove(s.kv)
            s.use.sessions -= 1
            if s.use.sessions <= 0 and not s.kv.owner.name:
                self._uses.pop(f"#{handle}", None)  # a key's usage outlives its sessions (it decays)

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
        s.charge(dt)
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
        s.charge(dt)
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
        """Judge drafted `tokens` (appended after the history), `MAX_VERIFY_ROWS` at a time.

        Used by the `verify` message (the device's check, router-verify, speculative decoding).
        Each draft at an offset in `check` (router-flagged) is judged exactly, and with
        `tolerance` > 0 every other draft leniently (shared/decision.py's `judge_draft`); the
        others stand unread. The history keeps the drafts up to the first rejected one, then the
        cloud's token there; with `bonus` and no rejection the cloud's next token is appended.
        On an error the history is as it was. (The server goes through `verify_step`, one chunk per
        turn between other sessions' work; this runs all chunks at once.)
        """
        job = VerifyJob(list(tokens), sorted(check), bonus, tolerance)
        try:
            while (result := self.verify_step(handle, job, MAX_VERIFY_ROWS)) is None:
                pass
        except Exception:
            self.abandon_verify(handle, job)
            raise
        return result

    def verify_step(self, handle: int, job: VerifyJob, max_tokens: int) -> VerifyResult | None:
        """One bounded piece of `job`: decode at most `max_tokens` rows (and `MAX_VERIFY_ROWS`), either
        history the KV cache lacks or the next chunk of drafts, judged as `verify` says. Returns the
        verdict once a draft is rejected or all are judged, else None (call again). On an error the
        caller rolls back with `abandon_verify`."""
        s = self._seqs[handle]
        if job.base < 0:  # the checks of the whole verify, before any work
            if not s.history:
                raise EmptyHistory("verify")
            if len(job.tokens) > self._caps.max_verify_tokens:
                raise NotSupported(f"at most {self._caps.max_verify_tokens} drafted tokens per verify")
            self.pool.check_fits(len(s.history) + len(job.tokens))
            job.base = len(s.history)
            if len(job.tokens) >= max_tokens:
                s.use.long_work(time.monotonic())  # more than one chunk: its key is heavy for a while
        rows = max(2, self._chunk(s, min(max_tokens, MAX_VERIFY_ROWS), time.monotonic()))
        t0 = time.perf_counter()
        s.drop_ready()
        self._redo_last(s)
        behind = len(s.history) - 1 - s.kv.n_decoded  # history the KV cache lacks (after an eviction)
        result: VerifyResult | None = None
        if behind > 0:  # this turn rebuilds history; the drafts come next turn
            if behind > max_tokens:
                s.use.long_work(time.monotonic())
            n = min(behind, rows)
            self._decode_to(s, s.kv.n_decoded + n, want_logits=False)
            s.count_pass("verify_tokens", n)
        else:
            take = min(len(job.tokens) - job.done, rows - 1)
            last = job.done + take == len(job.tokens)
            exact = {c - job.done for c in job.check if job.done <= c < job.done + take}
            r = self._verify_span(s, job.tokens[job.done : job.done + take], exact, job.bonus and last, job.tolerance)
            if r.token >= 0 or last:
                r.accepted += job.done
                result = r
            else:
                job.done += take  # all kept: in the history now
        dt = time.perf_counter() - t0
        s.compute_s += dt
        s.charge(dt)
        job.compute_s += dt
        if result is not None:
            result.compute_ms = job.compute_s * 1000.0
        return result

    def abandon_verify(self, handle: int, job: VerifyJob) -> None:
        """A verify failed partway: the history (and KV) as before it began."""
        s = self._seqs.get(handle)
        if s is not None and 0 <= job.base < len(s.history):
            self.rollback(handle, job.base)

    def _verify_span(
        self, s: SeqState, tokens: list[int], exact: set[int], bonus: bool, tolerance: float
    ) -> VerifyResult:
        """Judge `tokens` after the history in one decode (`verify`'s rule); the history keeps what stands."""
        base = len(s.history)
        self.pool.check_fits(base + len(tokens))
        if s.kv.n_decoded < base - 1:
            n = base - 1 - s.kv.n_decoded
            self._decode_to(s, base - 1, want_logits=False)  # pending history, no outputs
            s.count_pass("verify_tokens", n)
        self.pool.ensure(s.kv, len(tokens) + 1, n_history=base)
        rows = [s.history[-1], *tokens]  # row r predicts the token at offset r
        wanted = (list(range(len(tokens))) if tolerance > 0 else sorted(exact)) + ([len(tokens)] if bonus else [])
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

    def step(self, reqs: list[Request], budget: int, per_session: int | None = None) -> StepReport:
        """One batched decode serving `reqs` (scheduler Requests, oldest first) within `budget` tokens,
        at most `per_session` (default: all of `budget`) for one session, to the sessions whose turn it
        is (fair queueing, see the module docstring); a TURN request is granted (done) then.

        A request whose pending tokens exceed its share gets a chunk of them decoded now and the
        rest (and its token) in a later batch. A failure is confined to the request that causes it
        (see the module docstring); the report sums every decode this took.
        """
        outcomes = [StepOutcome() for _ in reqs]
        plan = self._plan(reqs, budget, per_session or budget, outcomes)
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
            n_group = max(1, sum(len(it.tokens) for it in items))
            for p, item in zip(group, items):
                reqs[p.index].compute_s += dt
                p.state.compute_s += dt
                p.state.charge(dt * len(item.tokens) / n_group)  # its share of the decode, by tokens
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
                assert o.written is not None
                o.result = GenerateResult(o.written[0], o.written[1], r.compute_s)
            elif o.done and r.kind != TURN:
                o.result = r.compute_s
        return StepReport(outcomes, n_items, n_tokens, decode_s)

    @staticmethod
    def _chunk(s: SeqState, limit: int, now: float) -> int:
        """How many tokens `s` may decode in one step: `limit`, or for a heavy key's session a quarter of it,
        so a device coming to the engine while such a session has it waits a short chunk only."""
        return max(1, limit // HEAVY_CHUNK) if s.use.heavy(now) else limit

    def _wake(self, use: Usage, now: float) -> None:
        """`use`'s key is at work now; back from idle, it starts at most two slices behind the busiest (it is
        served first, but cannot bank the time it spent idle, as in Linux's CFS)."""
        if now - use.last_busy >= ANTICIPATE_S:
            use.vtime = max(use.vtime, self._vclock - 2 * FAIR_SLICE_S)
        use.last_busy = now

    def _turns(self, reqs: list[Request]) -> tuple[set[int], set[int]]:
        """The sessions with requests queued whose turn it is (module docstring): the light keys' while any
        light key is at work (a heavy key's too once held back STARVE_S). Returns (served, first): all
        of those are served while the step's budget lasts (work-conserving: another session's token in
        the same decode costs little), and `first`, those within FAIR_SLICE_S of engine time of the
        least-served, take the budget before the others and alone may run a TURN (a verify's piece,
        which lengthens the step for everyone)."""
        busy = [s for r in reqs if (s := self._seqs.get(r.handle)) is not None]
        if not busy:
            return set(), set()
        now = time.monotonic()
        for s in busy:
            self._wake(s.use, now)
        at_work = {id(s.use): s.use for s in self._seqs.values() if now - s.use.last_busy < ANTICIPATE_S}
        light = [u for u in at_work.values() if not u.heavy(now)]
        cohort = light or list(at_work.values())
        floor = min(u.vtime for u in cohort)
        self._vclock = max(self._vclock, floor)
        ids = {id(u) for u in cohort}
        starving = {s.kv.handle for s in busy if now - s.use.served_at > STARVE_S}  # slowed, never stopped
        served = {s.kv.handle for s in busy if id(s.use) in ids} | starving
        first = {s.kv.handle for s in busy if id(s.use) in ids and s.use.vtime - floor < FAIR_SLICE_S} | starving
        for s in busy:
            if s.kv.handle in served:
                s.use.served_at = now
        return served, first

    def _plan(self, reqs: list[Request], budget: int, per_session: int, outcomes: list[StepOutcome]) -> list[_Planned]:
        """Which requests this decode serves and how far; answers those that need no decode."""
        pending = {r.handle for r in reqs}
        served, first = self._turns(reqs)
        now = time.monotonic()
        protect: set[int] = set()  # sessions already in this batch
        plan: list[_Planned] = []
        left = budget
        # less-served keys take the budget first; within each group, oldest first (the scheduler's order)
        for i in sorted(range(len(reqs)), key=lambda i: reqs[i].handle not in first):
            r = reqs[i]
            s = self._seqs.get(r.handle)
            if s is None:
                outcomes[i].error = EngineFailed(f"session {r.handle} is closed")
                continue
            if r.handle not in served or (r.kind == TURN and r.handle not in first):
                continue  # not its turn: short work, and less-served keys, first
            if r.kind == TURN:
                outcomes[i].done = True  # the scheduler runs its work now
                continue
            gen = r.kind == GENERATE
            if gen and not s.history:
                outcomes[i].error = EmptyHistory("generate")
                continue
            if gen and (ready := s.take_ready()) is not None:  # kept by a prefill: no decode
                try:
                    outcomes[i].written = self._write_ready(s, ready, r.proposed)
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
            if target - base > per_session:
                s.use.long_work(now)  # more than one chunk: its key is heavy for a while
            take = min(target - base, left, self._chunk(s, per_session, now))
            try:
                room = self.pool.make_room(s.kv, take, protect, pending, n_history=target)
            except EngineError as exc:  # its owner's KV churn budget is spent (kv_pool.py)
                outcomes[i].error = exc
                continue
            if not room:
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
                outcome.written = self._write(s, logits, r.proposed)
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
