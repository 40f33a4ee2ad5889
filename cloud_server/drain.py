"""Draining: how a replica leaves (a rolling update, a scale-in) without cutting a reply in half.

On SIGTERM the server stops listening at once (a balancer's next connection is
refused, and redispatched to another replica; its readiness check fails), lets
each session finish the request it is serving, then closes that connection
with 1001 "going away". Connections waiting for their device's next message
are closed at once. The device fails over: it rebuilds its session on another
replica from its own history and asks again (edge_client/cloud_session.py),
so a drain costs a reconnect and a prefill, never a token. After `timeout_s`
the rest are closed anyway (docs/server.md, "Failover").

The deadline holds for every connection, HTTP included, whatever its client does: `ABORT_AFTER_S`
past it (time for the drain's own close frames to go out) every connection uvicorn still holds is
aborted (a client that pipelines requests and never reads its responses once kept a drained server
alive for good: a close waits for room in a buffer that client never empties), uvicorn's own
shutdown cancels what still runs `SHUTDOWN_GRACE_S` past it (`timeout_graceful_shutdown`), and a
watchdog thread ends the process `FORCE_EXIT_S` past it should anything still hold it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Awaitable, Callable

import uvicorn

log = logging.getLogger(__name__)

GOING_AWAY = 1001
DRAIN_REASON = "going away: this replica is draining; reconnect (another replica takes the session)"
ABORT_AFTER_S = 0.2  # past the deadline, every connection still open is aborted
SHUTDOWN_GRACE_S = 0.4  # past the deadline, uvicorn cancels the requests' tasks that still run
FORCE_EXIT_S = 0.8  # past the deadline, the watchdog ends the process (the promise: deadline + 1 s)


@dataclass(slots=True)
class _Conn:
    close: Callable[[int, str], Awaitable[None]]  # sends a close frame (and aborts a socket that takes none)
    waiting: bool = False  # between requests: nothing is lost by closing it now
    drained: bool = False  # closed by the drain (counted once)


class Drain:
    """The replica's connections, and whether it is draining. The route handler registers each
    connection, sets its record's `waiting` around its receive, and closes it after a message once
    `draining` is set. `on_drained` is called once for each session the drain closes, however it is
    closed: between requests, after its reply, or at the time limit (sessions_drained_total)."""

    def __init__(self, on_drained: Callable[[], None] | None = None) -> None:
        self.draining = False
        self._conns: dict[int, _Conn] = {}
        self._empty = asyncio.Event()
        self._empty.set()
        self._on_drained = on_drained

    def drained(self, conn: _Conn) -> None:
        """`conn` is being closed by the drain: counted once, whoever closes it."""
        if not conn.drained:
            conn.drained = True
            if self._on_drained is not None:
                self._on_drained()

    def register(self, key: int, close: Callable[[int, str], Awaitable[None]]) -> _Conn:
        conn = self._conns[key] = _Conn(close)
        self._empty.clear()
        return conn

    def unregister(self, key: int) -> None:
        self._conns.pop(key, None)
        if not self._conns:
            self._empty.set()

    @property
    def n_connections(self) -> int:
        return len(self._conns)

    async def run(self, timeout_s: float) -> int:
        """Drain: close the connections between requests now, the others as their request ends
        (the handler sees `draining`); returns how many were still open after `timeout_s`."""
        self.draining = True
        closing = [asyncio.ensure_future(self._close(c)) for c in self._conns.values() if c.waiting]
        try:
            await asyncio.wait_for(self._empty.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        left = list(self._conns.values())  # past the deadline: closed whatever they are doing
        closing += [asyncio.ensure_future(self._close(c)) for c in left]
        await asyncio.gather(*closing, return_exceptions=True)
        return len(left)

    async def _close(self, conn: _Conn) -> None:
        self.drained(conn)
        await conn.close(GOING_AWAY, DRAIN_REASON)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM drains (`Drain.run`) before the usual shutdown; a second
    signal, or SIGINT, stops as uvicorn does. Whichever signal comes first, the process is gone
    within `timeout_s` (+ `FORCE_EXIT_S` at worst), whatever its clients do."""

    def __init__(self, drain: Drain, timeout_s: float, config: uvicorn.Config) -> None:
        config.timeout_graceful_shutdown = max(0.0, timeout_s) + SHUTDOWN_GRACE_S  # no drain (SIGINT, timeout 0) too
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future[None] | None = None
        self._deadline: float | None = None  # time.monotonic() by which the process is gone

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._deadline is None:  # the first signal sets the deadline; later ones never move it
            self._deadline = time.monotonic() + max(0.0, self.timeout_s)
            _watchdog(self._deadline + FORCE_EXIT_S)
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._abort_at_deadline)
        if sig != signal.SIGTERM or self.drain.draining or self.timeout_s <= 0 or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self.drain.draining = True  # /readyz says 503 from now on
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._task = asyncio.ensure_future(self._drain_then_exit())  # held: a task only weakly referenced may vanish

    async def _drain_then_exit(self) -> None:
        for server in self.servers:  # stop listening: a balancer's next connection goes to another replica
            server.close()
        n = self.drain.n_connections
        left = await self.drain.run(self.timeout_s)
        log.warning("drained %d sessions (%d closed at the %.0f s limit); stopping", n, left, self.timeout_s)
        # uvicorn's shutdown waits for its other connections (HTTP) only until the same deadline
        assert self._deadline is not None
        self.config.timeout_graceful_shutdown = max(0.0, self._deadline - time.monotonic()) + SHUTDOWN_GRACE_S
        self.should_exit = True

    def _abort_at_deadline(self) -> None:
        assert self._loop is not None and self._deadline is not None
        self._loop.call_later(max(0.0, self._deadline + ABORT_AFTER_S - time.monotonic()), self._abort_connections)

    def _abort_connections(self) -> None:
        """Just past the deadline: every connection still open is aborted, whatever it is doing (a
        close would wait for a client that reads nothing to make room for it); its request's task
        then ends."""
        left = list(self.server_state.connections)
        for conn in left:
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()
        if left:
            log.warning("aborted %d connections still open at the %.0f s drain deadline", len(left), self.timeout_s)


def _watchdog(at: float) -> None:
    """Exit the process at `at` (time.monotonic()) if it is still running then: the last resort
    should anything (a client, a stuck task) hold the event loop's shutdown past the deadline."""

    def force_exit() -> None:
        log.error("still running %.1f s past the drain deadline: exiting now", FORCE_EXIT_S)
        logging.shutdown()  # flush the log first
        os._exit(0)  # the sessions were closed by the drain; what held the process is a client's doing

    timer = threading.Timer(max(0.0, at - time.monotonic()), force_exit)
    timer.daemon = True  # a process that exits on its own does not wait for it
    timer.start()
