"""Network emulation on loopback: a TCP proxy that delays each direction like a real link.

Why a proxy rather than `tc netem`: tc needs CAP_NET_ADMIN and network
namespaces, which containers and CI machines rarely grant; a user-space proxy
runs anywhere and, since everything passes through it, can measure exactly
what delay it added (reported next to the figures it affected).

Each direction is modelled as a FIFO link: a chunk read from one side waits
for the link to be free (bandwidth cap: size / rate of serialisation), then
for the one-way delay (RTT/2 plus Gaussian jitter, plus an occasional stall
standing in for a loss and its retransmission), and never overtakes an
earlier chunk (TCP delivers in order, so a stall holds up what follows).

    with NetemProxy("127.0.0.1", server_port, PROFILES["lte"]) as proxy:
        url = f"ws://127.0.0.1:{proxy.port}/v1/route"
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np


@dataclass(frozen=True, slots=True)
class NetProfile:
    """An emulated network. Delays are round-trip figures, split evenly between directions."""

    name: str
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0  # standard deviation of the RTT
    stall_prob: float = 0.0  # chance that a chunk stalls (a loss and its retransmission)
    stall_ms: float = 0.0
    up_mbps: float | None = None  # device -> cloud bandwidth cap (None: unlimited)
    down_mbps: float | None = None

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0 or self.stall_ms < 0:
            raise ValueError(f"network profile {self.name!r}: delays must be >= 0")
        if not 0.0 <= self.stall_prob <= 1.0:
            raise ValueError(f"network profile {self.name!r}: stall probability must be within [0, 1]")
        for bw in (self.up_mbps, self.down_mbps):
            if bw is not None and bw <= 0:
                raise ValueError(
                    f"network profile {self.name!r}: bandwidth must be > 0 Mbit/s (or unset for unlimited)"
                )

    def to_json(self) -> dict:
        return asdict(self)


# The issue fixes RTT, jitter and (for lte) stalls; the bandwidth caps and the
# stalls of `bad` are this harness's choices (typical uplink-limited links).
PROFILES: dict[str, NetProfile] = {
    "none": NetProfile("none"),
    "lan": NetProfile("lan", rtt_ms=2.0),
    "wifi": NetProfile("wifi", rtt_ms=20.0, jitter_ms=5.0, up_mbps=50.0, down_mbps=50.0),
    "lte": NetProfile("lte", rtt_ms=60.0, jitter_ms=20.0, stall_prob=0.01, stall_ms=200.0, up_mbps=5.0, down_mbps=20.0),
    "bad": NetProfile("bad", rtt_ms=150.0, jitter_ms=50.0, stall_prob=0.02, stall_ms=300.0, up_mbps=1.0, down_mbps=2.0),
}


def get_profile(name: str, **overrides: float | None) -> NetProfile:
    """A preset by name, with any non-None overrides (rtt_ms=..., jitter_ms=...) applied."""
    if name not in PROFILES:
        raise ValueError(f"unknown network profile {name!r}; choose one of {', '.join(PROFILES)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return replace(PROFILES[name], **changes) if changes else PROFILES[name]


@dataclass(slots=True)
class DirectionStats:
    """What one direction did: configured delays against the delays achieved."""

    chunks: int = 0
    bytes: int = 0
    stalls: int = 0
    planned_ms: list[float] = field(default_factory=list)  # release - arrival, as drawn
    achieved_ms: list[float] = field(default_factory=list)  # write - arrival, as done
    late_ms: list[float] = field(default_factory=list)  # write - release: the proxy's own overhead

    def summary(self) -> dict:
        def pct(xs: list[float], q: float) -> float | None:
            return round(float(np.percentile(xs, q)), 3) if xs else None

        return {
            "chunks": self.chunks,
            "bytes": self.bytes,
            "stalls": self.stalls,
            "planned_ms_mean": round(float(np.mean(self.planned_ms)), 3) if self.planned_ms else None,
            "achieved_ms_mean": round(float(np.mean(self.achieved_ms)), 3) if self.achieved_ms else None,
            "achieved_ms_p50": pct(self.achieved_ms, 50),
            "achieved_ms_p95": pct(self.achieved_ms, 95),
            "overhead_ms_p50": pct(self.late_ms, 50),
            "overhead_ms_p95": pct(self.late_ms, 95),
            "overhead_ms_max": round(max(self.late_ms), 3) if self.late_ms else None,
        }


class _Link:
    """One direction's delay model (FIFO, bandwidth, jitter, stalls); seeded, so runs repeat."""

    def __init__(self, profile: NetProfile, up: bool, seed: int) -> None:
        self.one_way_s = profile.rtt_ms / 2000.0
        self.sd_s = profile.jitter_ms / 1000.0 / math.sqrt(2.0)  # two directions add up to the RTT's spread
        self.stall_prob = profile.stall_prob
        self.stall_s = profile.stall_ms / 1000.0
        mbps = profile.up_mbps if up else profile.down_mbps
        self.bytes_per_s = None if mbps is None else mbps * 1e6 / 8.0
        self.rng = random.Random(seed)
        self.free_at = 0.0  # when the link finishes serialising what it holds
        self.last_release = 0.0

    def release_time(self, now: float, size: int, stats: DirectionStats) -> float:
        start = max(now, self.free_at)
        if self.bytes_per_s is not None:
            self.free_at = start + size / self.bytes_per_s
            start = self.free_at
        delay = self.one_way_s + (self.rng.gauss(0.0, self.sd_s) if self.sd_s > 0 else 0.0)
        if self.stall_prob > 0 and self.rng.random() < self.stall_prob:
            delay += self.stall_s
            stats.stalls += 1
        release = max(start + max(delay, 0.0), self.last_release)
        self.last_release = release
        return release


class NetemProxy:
    """A loopback TCP proxy on its own thread and event loop; both directions are delayed."""

    def __init__(
        self, target_host: str, target_port: int, profile: NetProfile, seed: int = 0, listen_host: str = "127.0.0.1"
    ) -> None:
        self.target = (target_host, target_port)
        self.profile = profile
        self.seed = seed
        self.listen_host = listen_host
        self.port = 0
        self.up = DirectionStats()
        self.down = DirectionStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._n_conn = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "NetemProxy":
        self._thread = threading.Thread(target=self._run, name="netem", daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0):
            raise RuntimeError("network emulator did not start within 10 s")
        if self._error is not None:
            raise RuntimeError(f"network emulator could not listen on {self.listen_host}: {self._error}")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, self.listen_host, 0))
            self.port = self._server.sockets[0].getsockname()[1]
        except OSError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        if loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), loop)
        self._thread.join(timeout=10.0)
        self._thread = None

    def __enter__(self) -> "NetemProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset_stats(self) -> None:
        self.up, self.down = DirectionStats(), DirectionStats()

    def summary(self) -> dict:
        return {"profile": self.profile.to_json(), "up": self.up.summary(), "down": self.down.summary()}

    # ---------------------------------------------------------------- forwarding

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        n = self._n_conn
        self._n_conn += 1
        up = _Link(self.profile, up=True, seed=self.seed * 7919 + 2 * n)
        down = _Link(self.profile, up=False, seed=self.seed * 7919 + 2 * n + 1)
        try:
            await asyncio.gather(
                self._pipe(client_r, server_w, up, lambda: self.up),
                self._pipe(server_r, client_w, down, lambda: self.down),
            )
        except (asyncio.CancelledError, ConnectionError, OSError):
            pass  # shutting down, or a side hung up
        finally:
            for w in (client_w, server_w):
                w.close()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        stats: Callable[[], DirectionStats],
    ) -> None:
        """Read chunks as they come, schedule each, and write them at their release time."""
        queue: asyncio.Queue[tuple[bytes, float, float] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def read() -> None:
            try:
                while data := await reader.read(65536):
                    now = loop.time()
                    st = stats()
                    queue.put_nowait((data, now, link.release_time(now, len(data), st)))
            except (ConnectionError, OSError):
                pass
            finally:
                queue.put_nowait(None)

        async def write() -> None:
            try:
                while (item := await queue.get()) is not None:
                    data, arrived, release = item
                    wait = release - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    writer.write(data)
                    await writer.drain()
                    done = loop.time()
                    st = stats()
                    st.chunks += 1
                    st.bytes += len(data)
                    st.planned_ms.append((release - arrived) * 1000.0)
                    st.achieved_ms.append((done - arrived) * 1000.0)
                    st.late_ms.append(max(0.0, done - release) * 1000.0)
            except (ConnectionError, OSError):
                pass
            finally:
                try:
                    writer.close()
                except Exception:
                    pass

        await asyncio.gather(read(), write())


def measure_rtt(host: str, port: int, n: int = 20, size: int = 64) -> list[float]:
    """Round trips (ms) of small messages to an echo service at host:port (used to check the proxy)."""
    import socket

    out: list[float] = []
    with socket.create_connection((host, port), timeout=10.0) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = b"x" * size
        for _ in range(n):
            t0 = time.perf_counter()
            sock.sendall(payload)
            got = 0
            while got < size:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("echo service closed the connection")
                got += len(chunk)
            out.append((time.perf_counter() - t0) * 1000.0)
    return out
