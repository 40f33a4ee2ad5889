"""Draining: how a replica leaves (a rolling update, a scale-in) without cutting a reply in half.

On SIGTERM the server stops listening at once (a balancer's next connection is
refused, and redispatched to another replica; its readiness check fails), lets
each session finish the request it is serving, then closes that connection
with 1001 "going away". Connections waiting for their device's next message
are closed at once. The device fails over: it rebuilds its session on another
replica from its own history and asks again (edge_client/cloud_session.py),
so a drain costs a reconnect and a prefill, never a token. After `timeout_s`
the rest are closed anyway (docs/server.md, "Failover").
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass
from types import FrameType
from typing import Awaitable, Callable

import uvicorn

log = logging.getLogger(__name__)

GOING_AWAY = 1001
DRAIN_REASON = "going away: this replica is draining; reconnect (another replica takes the session)"


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
    signal, or SIGINT, stops at once as uvicorn does."""

    def __init__(self, drain: Drain, timeout_s: float, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
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
        self.should_exit = True
