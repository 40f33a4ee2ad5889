"""The embedded engine's verify: drafted tokens judged a bounded piece at a time.

Why pieces: a verify may carry hundreds of drafts, and the engine thread is shared. Each piece
(`Verifier.step`) decodes at most `MAX_VERIFY_ROWS` rows (drafts + 1), so the wait it adds to other
sessions' steps and the logits buffer it needs stay bounded; the scheduler runs one piece per turn
of the session (cloud_server/scheduler.py). Each draft at an offset the device flagged is judged
exactly, and with a tolerance every other draft leniently (shared/decision.py's `judge_draft`);
the history keeps the drafts up to the first rejected one, then the cloud's token there.
"""

from __future__ import annotations

import time
from typing import Callable

from cloud_server.batch import VerifyJob
from cloud_server.engine_api import EmptyHistory, NotSupported, VerifyResult
from cloud_server.kv_pool import KVPool
from cloud_server.model_runner import ModelRunner, raise_named
from cloud_server.sequence import SeqState
from shared.decision import cloud_choice, judge_draft
from shared.llama_backend import DecodeItem
from shared.sampling import log_softmax_at

MAX_VERIFY_ROWS = 64  # rows (drafts + 1) one piece of a verify decodes: its logits take 64 x n_vocab floats


class Verifier:
    """Judges drafts after a session's history, `max_drafts` at most per verify."""

    def __init__(self, runner: ModelRunner, pool: KVPool, max_drafts: int, is_eog: Callable[[int], bool]) -> None:
        self.runner = runner
        self.pool = pool
        self.max_drafts = max_drafts
        self.is_eog = is_eog

    def step(self, s: SeqState, job: VerifyJob, max_tokens: int) -> VerifyResult | None:
        """One bounded piece of `job`: decode at most `max_tokens` rows (and `MAX_VERIFY_ROWS`), either
        history the KV cache lacks or the next chunk of drafts. Returns the verdict once a draft is
        rejected or all are judged, else None (call again). On an error the caller rolls back to
        `job.base`."""
        if job.base < 0:  # the checks of the whole verify, before any work
            self._begin(s, job, max_tokens)
        rows = max(2, s.use.chunk(min(max_tokens, MAX_VERIFY_ROWS), time.monotonic()))
        t0 = time.perf_counter()
        s.drop_ready()
        self.runner.redo_last(s)
        behind = len(s.history) - 1 - s.kv.n_decoded  # history the KV cache lacks (after an eviction)
        result: VerifyResult | None = None
        if behind > 0:  # this turn rebuilds history; the drafts come next turn
            if behind > max_tokens:
                s.use.long_work(time.monotonic())
            n = min(behind, rows)
            self.runner.decode_to(s, s.kv.n_decoded + n, want_logits=False)
            s.count_pass("verify_tokens", n)
        else:
            take = min(len(job.tokens) - job.done, rows - 1)
            last = job.done + take == len(job.tokens)
            exact = {c - job.done for c in job.check if job.done <= c < job.done + take}
            r = self._span(s, job.tokens[job.done : job.done + take], exact, job.bonus and last, job.tolerance)
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

    def _begin(self, s: SeqState, job: VerifyJob, max_tokens: int) -> None:
        """Refuse a verify that cannot be served, before any work; else note where it began."""
        if not s.history:
            raise EmptyHistory("verify")
        if len(job.tokens) > self.max_drafts:
            raise NotSupported(f"at most {self.max_drafts} drafted tokens per verify")
        self.pool.check_fits(len(s.history) + len(job.tokens))
        job.base = len(s.history)
        if len(job.tokens) >= max_tokens:
            s.use.long_work(time.monotonic())  # more than one chunk: its key is heavy for a while

    def _span(self, s: SeqState, tokens: list[int], exact: set[int], bonus: bool, tolerance: float) -> VerifyResult:
        """Judge `tokens` after the history in one decode (the module's rule); the history keeps what stands."""
        base = len(s.history)
        self.pool.check_fits(base + len(tokens))
        if s.kv.n_decoded < base - 1:
            n = base - 1 - s.kv.n_decoded
            self.runner.decode_to(s, base - 1, want_logits=False)  # pending history, no outputs
            s.count_pass("verify_tokens", n)
        self.pool.ensure(s.kv, len(tokens) + 1, n_history=base)
        rows = [s.history[-1], *tokens]  # row r predicts the token at offset r
        wanted = (list(range(len(tokens))) if tolerance > 0 else sorted(exact)) + ([len(tokens)] if bonus else [])
        try:
            outs = self.runner.decode_outputs(DecodeItem(s.kv.seq, base - 1, rows), wanted)
            result = self._judge(s, tokens, exact, tolerance, wanted, outs)
        except Exception as exc:
            self.pool.discard_partial(s.kv)  # the history is unchanged: so are its cells
            raise_named(exc)
        s.count_pass("verify_tokens", len(rows))
        self.pool.decoded(s.kv, base + len(tokens))
        self.pool.truncate(s.kv, base + result.accepted)  # drafted tokens the history keeps
        s.history.extend(tokens[: result.accepted])
        if result.token >= 0:
            s.history.append(result.token)
            result.eog = self.is_eog(result.token)
        return result

    def _judge(
        self, s: SeqState, tokens: list[int], exact: set[int], tolerance: float, wanted: list[int], outs: list[int]
    ) -> VerifyResult:
        """The verdict from the decoded rows' logits: the first draft judged wrong, or the bonus token."""
        result = VerifyResult(accepted=len(tokens))
        for offset, out in zip(wanted, outs):
            logits = self.runner.finite_logits(out)
            if offset < len(tokens):
                token = judge_draft(logits, tokens[offset], offset in exact, tolerance, s.sampler)
                if token < 0:
                    continue  # the draft stands
            else:
                token = cloud_choice(logits, s.sampler)  # the bonus: the cloud's own next token
            result.accepted, result.token, result.logprob = offset, token, log_softmax_at(logits, token)
            break
        return result
