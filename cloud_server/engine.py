"""The cloud's embedded model engine: one llama.cpp context, one sequence per session.

It implements `TextEngine` (cloud_server/engine_api.py) and, for the batch scheduler,
`BatchEngine` (cloud_server/batch.py), from parts apart as in vLLM:

    sequence.py      `SeqState`: a session's history, sampler and the logits a prefill kept
    kv_pool.py       the KV pool: slots, the cell budget, LRU eviction, save/restore
    model_runner.py  decodes sessions' tokens and reads back checked logits
    batch_stepper.py one batched decode over many sessions' requests (`step`)
    fair_share.py    whose turn it is in a step: short work first, then fair queueing between keys
    verifier.py      drafts judged a bounded piece at a time (`verify_step`)

Not thread-safe by design: every call runs on the server's single engine thread (see
`EngineWorker` in cloud_server/scheduler.py), which also makes the order of a session's
operations the order its messages arrived in.

`prefill` decodes the whole history and keeps the next position's logits, so a hard-token
request that brings no new tokens samples without a decode (cloud_server/sequence.py). Any other
change of the history drops that copy, and `generate` decodes at least the last token, so its
logits are fresh even if other sessions decoded in between. `prefill`, `generate` and `verify`
here serve one session alone; the server batches through `step` and `verify_step`.
"""

from __future__ import annotations

import time

import llama_cpp as lc
import numpy as np

from cloud_server.batch import Request, StepReport, VerifyJob
from cloud_server.batch_stepper import BatchStepper
from cloud_server.engine_api import Capabilities, EmptyHistory, GenerateResult, Owner, VerifyResult
from cloud_server.engine_base import EngineBase
from cloud_server.fair_share import FairShare, Usage
from cloud_server.kv_pool import EVICT_MODES, EngineStats, KVPool
from cloud_server.model_runner import ModelRunner
from cloud_server.sequence import SeqState
from cloud_server.verifier import MAX_VERIFY_ROWS, Verifier
from shared.llama_backend import LlamaContext, LlamaModel
from shared.model_info import ModelInfo
from shared.protocol import SamplingParams
from shared.sampling import NO_GUESS, Guess, Sampler
from shared.text_history import AnswerText

__all__ = ["CloudEngine", "EngineStats", "SeqState", "Usage"]


class CloudEngine(EngineBase[SeqState]):
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
        model = LlamaModel(info, n_gpu_layers=n_gpu_layers)
        self.ctx = LlamaContext(
            model,
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
        caps = Capabilities(
            "llama.cpp",
            model.n_vocab,
            guess=True,
            verify=True,
            max_verify_tokens=self.ctx.n_batch - 1,
            how="embedded llama.cpp: every logit in-process",
            text=True,
            session_cells=seq_cells,
        )
        super().__init__(model, caps, max_sessions)
        self.pool = KVPool(self.ctx, kv_slots, seq_cells, evict_mode, max_saved_bytes)
        self.fair = FairShare()
        self.runner = ModelRunner(self.ctx, self.pool)
        self.stepper = BatchStepper(self._sessions, self.fair, self.runner, self.pool)
        self.verifier = Verifier(self.runner, self.pool, caps.max_verify_tokens, model.is_eog)
        self._answer_text = AnswerText.for_model(model, bounded=True)  # text mode refuses long text unread

    @property
    def n_batch(self) -> int:
        """Tokens one decode may take (the scheduler caps its batches at this)."""
        return self.ctx.n_batch

    # ---------------------------------------------------------------- text mode

    def answer_text(self) -> AnswerText:
        """Text mode (protocol v3): this model's view of the shared answer text."""
        return self._answer_text

    def eog_token(self) -> int:
        return self.model.eog_token

    def peek(self, handle: int) -> int:
        """The argmax of the logits a prefill kept for the next position, or -1 when none describe
        the history. Nothing is written or promised (text mode's span rule looks ahead with it)."""
        s = self._sessions[handle]
        return int(np.argmax(s.ready)) if s.ready is not None and s.has_ready else -1

    def peek_guess(self, handle: int) -> Guess | None:
        """`peek` with the most likely tokens and their log-probabilities (text mode's lookahead
        guess, shared/text_history.py `TextGuess`); None when no kept logits describe the history."""
        s = self._sessions[handle]
        if s.ready is None or not s.has_ready:
            return None
        return Guess.of(s.ready, int(np.argmax(s.ready)))

    # ---------------------------------------------------------------- sessions

    def open(self, prompt: list[int], sampling: SamplingParams, owner: Owner | None = None) -> int:
        """A new session (no KV cells yet: they are taken when it is first decoded). Returns its handle.
        `owner`: whose KV churn budget pays for the evictions it causes (cloud_server/kv_pool.py) and
        whose account at the engine its time is charged to (cloud_server/fair_share.py)."""
        name = owner.name if owner is not None else ""
        budget = owner.engine_seconds_per_minute if owner is not None else None
        return self._add(
            lambda h: SeqState(
                self.pool.add(h, owner), list(prompt), Sampler(sampling), use=self.fair.join(name, h, budget)
            )
        )

    def demote(self, owner: str) -> None:
        """`owner`'s device asked for work it does not read (a slow reader): its key is heavy for a while."""
        self.fair.demote(owner)

    def close(self, handle: int) -> None:
        s = self._drop(handle)
        if s is not None:
            self.pool.remove(s.kv)
            self.fair.leave(s.kv.owner.name, handle, s.use)

    def append(self, handle: int, tokens: list[int]) -> None:
        self._sessions[handle].history.extend(tokens)  # kept logits no longer match: take_ready checks the length

    def rollback(self, handle: int, n: int) -> None:
        s = self._sessions[handle]
        if not 0 <= n <= len(s.history):
            raise ValueError(f"cannot roll back to {n}: the history holds {len(s.history)} tokens")
        del s.history[n:]
        s.drop_ready()  # the same length may come back with other tokens
        self.pool.truncate(s.kv, n)

    def close_all(self) -> None:
        for handle in list(self._sessions):
            self.close(handle)
        self.ctx.close()
        self.model.close()

    # ---------------------------------------------------------------- one session at a time

    def prefill(self, handle: int) -> float:
        """Decode the pending tokens and keep the next position's logits (background work after
        a sync; see the module docstring). Returns seconds spent."""
        s = self._sessions[handle]
        end = len(s.history)
        if end <= s.kv.n_decoded or not s.history:
            return 0.0
        t0 = time.perf_counter()
        n = end - s.kv.n_decoded
        s.keep_ready(self.runner.decode_to(s, end))
        s.count_pass("prefill_tokens", n)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        s.charge(dt)
        return dt

    def generate(self, handle: int, proposed: int = -1) -> GenerateResult:
        """Write the next token (shared/decision.py's `cloud_choice` with the device's `proposed`
        token, -1: none); it joins the history. The unbatched path: the server batches through `step`."""
        s = self._sessions[handle]
        if not s.history:
            raise EmptyHistory("generate")
        t0 = time.perf_counter()
        ready = s.take_ready()
        if ready is not None:
            token, logprob = s.write_ready(ready, proposed)
        else:
            self.runner.redo_last(s)
            n = len(s.history) - s.kv.n_decoded
            logits = self.runner.decode_to(s, len(s.history))
            s.count_pass("generate_tokens", n)
            token, logprob = s.write(logits, proposed)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        s.charge(dt)
        return GenerateResult(token, logprob, dt)

    def guess(self, handle: int) -> Guess:
        """The token the session would write next, from the kept logits, without writing it,
        with the most likely tokens there; NO_GUESS when no kept logits describe the history.
        The choice is remembered, so a later generate at this position writes this very token
        (a `next` message promised it), even when sampling is random."""
        s = self._sessions[handle]
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
        """One bounded piece of `job` (cloud_server/verifier.py): its verdict when done, else None (call
        again). On an error the caller rolls back with `abandon_verify`."""
        return self.verifier.step(self._sessions[handle], job, max_tokens)

    def abandon_verify(self, handle: int, job: VerifyJob) -> None:
        """A verify failed partway: the history (and KV) as before it began."""
        s = self._sessions.get(handle)
        if s is not None and 0 <= job.base < len(s.history):
            self.rollback(handle, job.base)

    # ---------------------------------------------------------------- many sessions in one decode

    def step(self, reqs: list[Request], budget: int, per_session: int | None = None) -> StepReport:
        """One batched decode serving `reqs` within `budget` tokens, at most `per_session` for one
        session (cloud_server/batch_stepper.py)."""
        return self.stepper.step(reqs, budget, per_session)
