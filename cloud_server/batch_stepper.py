"""One batched decode over many sessions' requests: the embedded engine's `step` (cloud_server/batch.py).

Why a class of its own: a step plans which queued requests a decode serves and how far
(whose turn it is comes from cloud_server/fair_share.py, room from the KV pool), has the model
runner decode them together, and then writes each session's token or keeps its logits. The
engine (cloud_server/engine.py) owns one stepper over its sessions; the scheduler thread
(cloud_server/scheduler.py) calls the engine's `step`.

No session takes more than `per_session` tokens of one step, so the wait for a running step stays
bounded. Batch isolation: a batched decode that fails is split in halves and retried, down to
the request that fails alone; a session whose logits are not finite fails alone (its cells are
dropped). No other session sees the error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from cloud_server.batch import GENERATE, TURN, Request, StepOutcome, StepReport
from cloud_server.engine_api import EmptyHistory, EngineError, EngineFailed, EngineFull, GenerateResult
from cloud_server.fair_share import FairShare
from cloud_server.kv_pool import KVPool
from cloud_server.model_runner import ModelRunner, named_error
from cloud_server.sequence import SeqState
from shared.llama_backend import DecodeError, DecodeItem
from shared.sampling import SamplingError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Planned:
    """A request's share of one batched decode: its session's history up to `end`."""

    index: int  # in the step's request list
    state: SeqState
    end: int
    wants_output: bool  # the decode reaches the end of the history: logits for the next position


class BatchStepper:
    """Serves the engine's open sessions (`sessions`, by handle: the engine's own table) in batched decodes."""

    def __init__(self, sessions: dict[int, SeqState], fair: FairShare, runner: ModelRunner, pool: KVPool) -> None:
        self.sessions = sessions
        self.fair = fair
        self.runner = runner
        self.pool = pool

    def step(self, reqs: list[Request], budget: int, per_session: int | None = None) -> StepReport:
        """One batched decode serving `reqs` (scheduler Requests, oldest first) within `budget` tokens,
        at most `per_session` (default: all of `budget`) for one session, to the sessions whose turn it
        is (cloud_server/fair_share.py); a TURN request is granted (done) then.

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
                outs = self.runner.decode_items(items)
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
                    outcomes[group[0].index].error = named_error(error)
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

    def _plan(self, reqs: list[Request], budget: int, per_session: int, outcomes: list[StepOutcome]) -> list[_Planned]:
        """Which requests this decode serves and how far; answers those that need no decode."""
        pending = {r.handle for r in reqs}
        busy = {r.handle: s.use for r in reqs if (s := self.sessions.get(r.handle)) is not None}
        served, first = self.fair.turns(busy, (s.use for s in self.sessions.values()))
        now = time.monotonic()
        protect: set[int] = set()  # sessions already in this batch
        plan: list[_Planned] = []
        left = budget
        # less-served keys take the budget first; within each group, oldest first (the scheduler's order)
        for i in sorted(range(len(reqs)), key=lambda i: reqs[i].handle not in first):
            r = reqs[i]
            s = self.sessions.get(r.handle)
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
                    outcomes[i].written = s.write_ready(ready, r.proposed)
                    outcomes[i].done = True
                except SamplingError as exc:
                    outcomes[i].error = exc
                s.kv.last_used = time.monotonic()
                continue
            if left <= 0:
                continue
            if gen:
                self.runner.redo_last(s)
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
            take = min(target - base, left, s.use.chunk(per_session, now))
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
        logits: np.ndarray | None = None
        if p.wants_output:
            try:
                logits = self.runner.finite_logits(out)
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
                outcome.written = s.write(logits, r.proposed)
                outcome.done = True
            except SamplingError as exc:
                outcome.error = exc
        else:  # a prefill that reached the end: keep the next position's logits
            s.keep_ready(logits)
            outcome.done = True
