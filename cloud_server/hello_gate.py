"""Connections that have not said hello yet: a cap in all and per client address.

Why: before its hello a connection proves nothing (no key), yet each holds a file descriptor and
uvicorn's buffers (about 34 KiB). 1,015 such connections, each waiting out the 300 s idle timeout,
used up a process's 1,024 descriptors: /healthz timed out and honest devices answered degraded.
So a connection waits for its hello at most `--hello-timeout-s` (cloud_server/app.py), and at
most `max_total` wait at once, `max_per_address` of them from one address; one over either cap is
closed at once (1013 "try again later", naming the cap). Checked in O(1) before any other work;
HTTP routes (/healthz, /readyz) are not counted, so they answer with the caps reached.

The address is the one uvicorn reports: the peer's, or X-Forwarded-For's from a proxy it trusts
(`FORWARDED_ALLOW_IPS`, 127.0.0.1 by default). Behind a balancer on another host every connection
comes from the balancer's address: set `--max-pre-hello-per-address` to `--max-pre-hello` there
(the balancer limits per client itself).
"""

from __future__ import annotations

import math
import time

TRY_AGAIN_LATER = 1013  # RFC 6455 (IANA registry): the server is overloaded; the client may retry later


class HelloGate:
    """Counts the connections waiting for their hello, in all and per address (the event loop is
    the only caller: no lock)."""

    def __init__(self, max_total: int, max_per_address: int) -> None:
        self.max_total = max_total
        self.max_per_address = max_per_address
        self.total = 0
        self._per_address: dict[str, int] = {}

    def enter(self, address: str) -> str:
        """Count one more connection from `address` waiting for its hello: "" if admitted, else
        why not (the close reason; nothing is counted then)."""
        n = self._per_address.get(address, 0)
        if self.total >= self.max_total:
            return f"too many connections waiting for hello ({self.max_total}); send hello at once, retry later"
        if n >= self.max_per_address:
            return (
                f"too many connections waiting for hello from your address ({self.max_per_address}); "
                "send hello at once, retry later"
            )
        self._per_address[address] = n + 1
        self.total += 1
        return ""

    def leave(self, address: str) -> None:
        """The connection from `address` said hello, or ended: it no longer counts."""
        n = self._per_address.get(address, 0) - 1
        if n > 0:
            self._per_address[address] = n
        else:
            self._per_address.pop(address, None)
        self.total = max(0, self.total - 1)

    def waiting(self, address: str) -> int:
        """Connections from `address` waiting for their hello now."""
        return self._per_address.get(address, 0)


class HelloWait:
    """One admitted connection's wait for its hello: its deadline, and its place in the gate,
    given back once (`done`) when the hello arrives or the connection ends."""

    def __init__(self, gate: HelloGate, address: str, timeout_s: float) -> None:
        self.gate = gate
        self.address = address
        self.deadline = time.monotonic() + timeout_s
        self.waiting = True

    def left(self) -> float:
        """Seconds left to say hello (inf once it arrived)."""
        return self.deadline - time.monotonic() if self.waiting else math.inf

    def done(self) -> None:
        if self.waiting:
            self.waiting = False
            self.gate.leave(self.address)
