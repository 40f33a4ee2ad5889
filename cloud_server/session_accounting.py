"""What every request of an accepted session counts, whatever the mode of its answer.

Why apart from the answer: the token and the text answer (cloud_server/token_answer.py,
cloud_server/text_answer.py) write different units, but they admit and count the same way: the
key's quotas and the abuse guard before the cloud writes, then the metrics, the audit log, the
routing watch (cloud_server/routing_watch.py) and the flywheel (cloud_server/flywheel.py) for what
was written, and the engine's work each reply reports (shared/protocol.py `Work`). Each answer is
given this object; it never sends anything itself.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from cloud_server.audit import SessionAudit
from cloud_server.engine_api import Engine, Worker, engine_errors
from cloud_server.flywheel import FlywheelRecorder
from cloud_server.quotas import KeyPolicy, QuotaExceeded, SessionGuard
from cloud_server.routing_watch import SessionRouting
from cloud_server.services import Services
from shared.protocol import WORK_FIELDS, ErrorCode, ProtocolError, Work

log = logging.getLogger("cloud_server.session")  # one logger for the session's events, as before the split


def vars_of(work: Work) -> dict[str, int]:
    """A Work's fields as keyword arguments of a reply message."""
    return {f: getattr(work, f) for f in WORK_FIELDS}


class SessionAccounting:
    """An accepted session (its engine handle, key, abuse guard, audit log) and the counting that
    goes with every position its answer gains."""

    def __init__(
        self,
        handle: int,
        session_id: str,
        key: KeyPolicy,
        audit: SessionAudit | None,
        services: Services,
        worker: Worker,
        edge_model: str = "",
        recorder: FlywheelRecorder | None = None,
    ) -> None:
        self.handle = handle  # the engine's session
        self.session_id = session_id
        self.key = key  # holds one of the key's sessions until close
        self.guard = SessionGuard(key, services.abuse_warmup_tokens)
        self.audit = audit  # None when the audit log is off
        self.services = services
        self.worker = worker
        self.engine: Engine = worker.engine
        self.edge_model = edge_model
        self.recorder = recorder  # the flywheel (None unless --record-dir)
        self.flagged = False  # the abuse check flagged it (counted and logged once per session)
        self.routing = SessionRouting(key=key.digest)  # the routing watch's counts
        self.prefill_ms = 0.0  # background prefill after hello/sync, reported with the next reply (prefill_ms)

    # ------------------------------------------------------------ admission (before the cloud writes)

    def admit_hard_tokens(self, n: int, carried: int = 0) -> None:
        """Quota and abuse checks before the cloud writes; refusals are `busy` errors naming the limit.

        `carried`: device tokens arriving with the request; the abuse check counts them, and a
        refusal counts them out again (the refused request leaves the session as it was)."""
        self.guard.device_tokens(carried)
        try:
            self.guard.check_hard_token()
            self.services.quotas.take_cloud_tokens(self.key, n)
        except QuotaExceeded as exc:
            self.guard.device_tokens(-carried)
            self.services.metrics.rejections.labels(exc.kind).inc()
            if exc.kind.startswith("abuse") and self._flag():  # once per session
                self.services.metrics.abuse_flags.inc()
                log.warning("session %s (key %s) flagged: %s", self.session_id, self.key.name, exc.reason)
            raise ProtocolError(ErrorCode.BUSY, exc.reason) from None

    @contextmanager
    def exploring(self, explore: bool) -> Iterator[None]:
        """Around a request that may be an exploration: its key's budget is taken first (over it:
        declined, `explore_limited`, nothing changed) and given back if the request ends before the
        cloud answered the position (refused `busy`, an engine error): what was refused was not
        explored, so it neither spends the budget nor counts in `explored_total` (`count_ask` counts)."""
        if not explore:
            yield
            return
        try:
            self.services.quotas.take_explore(self.key)
        except QuotaExceeded as exc:
            self.services.metrics.rejections.labels(exc.kind).inc()
            raise ProtocolError(ErrorCode.EXPLORE_LIMITED, exc.reason) from None
        served = self.routing.explored
        try:
            yield
        finally:
            if self.routing.explored == served:
                self.services.quotas.give_back_explore(self.key)

    def _flag(self) -> bool:
        """Mark the session (and its audit log, if any) flagged; True the first time only, audit log or
        not, so the caller counts and logs each session once."""
        first, self.flagged = not self.flagged, True
        if self.audit is not None:
            self.audit.flagged = True
        return first

    # ------------------------------------------------------------ what was written

    def device_tokens(self, position: int, tokens: list[int], guarded: bool = False) -> None:
        """Account tokens the device wrote (abuse check unless already `guarded`, audit, metrics)."""
        if tokens:
            if not guarded:
                self.guard.device_tokens(len(tokens))
            self.services.metrics.device_tokens.inc(len(tokens))
            if self.audit is not None:
                self.audit.tokens(position, tokens, cloud=False)
            self.advanced(len(tokens))

    def cloud_token(self, position: int, token: int) -> None:
        """Account one token the cloud wrote at `position`."""
        self.guard.cloud_token()
        self.services.metrics.hard_tokens.inc()
        if self.audit is not None:
            self.audit.tokens(position, [token], cloud=True)
        self.advanced(1)

    def cloud_span(self, position: int, tokens: list[int]) -> None:
        """Account a span of tokens the cloud wrote from `position` (text mode's pieces)."""
        for i, token in enumerate(tokens):
            self.cloud_token(position + i, token)

    def rolled_back(self, position: int) -> None:
        if self.audit is not None:
            self.audit.rollback(position)

    def advanced(self, n: int, final: bool = False) -> None:
        """The session's answer grew by `n` positions: compare its routing with the fleet's band now and then."""
        self.routing.positions += n
        for alarm in self.services.watch.check(self.routing, final):
            self.services.metrics.routing_alarms.labels(alarm.signal, alarm.side).inc()
            log.warning("session %s (key %s): routing alarm: %s", self.session_id, self.key.name, alarm.describe())
            if self.audit is not None:
                self.audit.flagged = True  # kept, whatever the sample rate
                self.audit.alarms.append(alarm.describe())

    def count_ask(self, explore: bool, disagreed: bool) -> None:
        """A hard position served: one the router asked for, or an exploration (with its label)."""
        r = self.routing
        if explore:
            r.explored += 1
            r.disagreed += disagreed
            self.services.metrics.explored.inc()
        else:
            r.asked += 1

    def record_choice(
        self, hidden: np.ndarray | None, device_token: int, cloud_token: int, position: int, explored: bool = False
    ) -> None:
        """The flywheel (opt-in): the device's hidden state at a hard position, both sides' choices, and
        whether the position was explored (asked at random, not sent up by the device's engine)."""
        if self.recorder is not None and hidden is not None:
            self.recorder.record(
                self.edge_model, hidden, device_token, cloud_token, position, explored, self.key.digest, self.session_id
            )

    # ------------------------------------------------------------ the engine's work, reported with each reply

    async def prefill(self) -> None:
        """Decode the history's new tokens now (background prefill), timed for the next reply."""
        with engine_errors():
            self.prefill_ms += 1000.0 * await self.worker.prefill(self.handle)

    def take_work(self) -> Work:
        """The engine's work for this session not yet reported (carried by the next reply)."""
        return self.engine.take_work(self.handle)

    def reply_work(self) -> dict:
        """A reply's report of the work since the last one: the engine's counts and the background
        prefill time (syncs, the lookahead's decode), as the reply's fields."""
        prefill_ms, self.prefill_ms = self.prefill_ms, 0.0
        return {**vars_of(self.take_work()), "prefill_ms": prefill_ms}
