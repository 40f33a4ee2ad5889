"""The network emulator: it adds the configured delay (measured), caps bandwidth, stalls, and says what it did."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from edge_client.replay.netem import PROFILES, NetemProxy, NetProfile, get_profile, measure_rtt


@pytest.fixture(scope="module")
def echo_port():
    """A plain TCP echo service on loopback: the far end of the emulated link."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def echo(c: socket.socket = conn) -> None:
                with c:
                    while data := c.recv(65536):
                        c.sendall(data)

            threading.Thread(target=echo, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    stop.set()
    srv.close()


def test_direct_loopback_is_fast(echo_port):
    assert np.median(measure_rtt("127.0.0.1", echo_port, n=10)) < 5.0


def test_proxy_adds_the_configured_round_trip(echo_port):
    with NetemProxy("127.0.0.1", echo_port, NetProfile("t", rtt_ms=40.0)) as proxy:
        rtts = measure_rtt("127.0.0.1", proxy.port, n=20)
        summary = proxy.summary()
    assert 39.0 <= np.median(rtts) <= 40.0 + 10.0
    assert min(rtts) >= 39.0  # never faster than the link
    up = summary["up"]
    assert up["chunks"] == 20 and up["planned_ms_mean"] == pytest.approx(20.0)
    assert up["achieved_ms_mean"] >= 20.0 and up["overhead_ms_p50"] < 5.0  # the proxy measures its own overhead


def test_jitter_spreads_round_trips_around_the_mean(echo_port):
    with NetemProxy("127.0.0.1", echo_port, NetProfile("j", rtt_ms=60.0, jitter_ms=20.0), seed=3) as proxy:
        rtts = measure_rtt("127.0.0.1", proxy.port, n=40)
    assert 45.0 <= np.mean(rtts) <= 80.0
    assert np.std(rtts) >= 5.0


def test_bandwidth_cap_delays_large_messages(echo_port):
    size = 100_000  # 0.8 Mbit: 100 ms at 8 Mbit/s, each way
    with NetemProxy("127.0.0.1", echo_port, NetProfile("bw", rtt_ms=2.0, up_mbps=8.0)) as proxy:
        rtts = measure_rtt("127.0.0.1", proxy.port, n=3, size=size)
    assert min(rtts) >= 100.0
    assert np.median(rtts) <= 160.0


def test_stalls_hold_up_the_link(echo_port):
    with NetemProxy("127.0.0.1", echo_port, NetProfile("s", rtt_ms=2.0, stall_prob=1.0, stall_ms=50.0)) as proxy:
        rtts = measure_rtt("127.0.0.1", proxy.port, n=3)
        summary = proxy.summary()
    assert min(rtts) >= 100.0  # a stall each way
    assert summary["up"]["stalls"] == 3 and summary["down"]["stalls"] == 3


def test_presets_and_overrides():
    assert PROFILES["lte"].rtt_ms == 60.0 and PROFILES["lte"].stall_prob == 0.01
    assert get_profile("wifi", rtt_ms=30.0, jitter_ms=None).rtt_ms == 30.0
    with pytest.raises(ValueError, match="unknown network profile 'mars'"):
        get_profile("mars")
    with pytest.raises(ValueError, match="stall probability"):
        NetProfile("x", stall_prob=2.0)
    with pytest.raises(ValueError, match="bandwidth"):
        NetProfile("x", up_mbps=0.0)
