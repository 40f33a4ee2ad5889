"""Failover: sessions that survive their replica's death, drain or scale-in behind a real HAProxy.

Real parts throughout: cloud replicas are `tokenrouter-cloud` processes on
loopback, the balancer is Debian's HAProxy configured as docs/server.md shows
(cloud_server/local_fleet.py), the device is the real generator with its
default options. The device runs the cloud's own model, greedy, so a session
rebuilt on another replica must give the answer an undisturbed run gives (up to
a near-tie that llama.cpp's batched and one-token kernels may break either way:
tests/helpers.py, `agree_up_to_a_tie`).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cloud_server.local import LocalCloudServer
from cloud_server.local_fleet import LocalFleet, find_haproxy
from edge_client.generator import open_generator
from edge_client.options import GeneratorOptions
from edge_client.reconnect import Backoff
from models.registry import DEFAULT_CLOUD_MODEL
from shared.protocol import Generate, Tokens, decode, encode
from tests.conftest import chat
from tests.helpers import agree_up_to_a_tie, hello, metric, wait_for

QUESTION = chat("Tell me about the history of Rome.")
needs_haproxy = pytest.mark.skipif(find_haproxy() is None, reason="haproxy is not installed (scripts/setup.sh)")


def test_backoff_waits_are_jittered_doubling_and_capped():
    """Each wait is uniform in [0, cap]: the first cap is short (a balancer redispatches at once), then
    doubles up to the most; two devices' waits differ (jitter), so a dead replica's sessions spread out."""
    rng = random.Random(0)
    waits = Backoff(first_s=0.05, max_s=0.4, rng=rng).waits()
    caps = [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]
    got = [next(waits) for _ in caps]
    assert all(0 <= w <= c for w, c in zip(got, caps)), got
    many = [next(Backoff(first_s=0.05).waits()) for _ in range(200)]
    assert len(set(many)) == 200 and 0.015 < sum(many) / 200 < 0.035  # uniform in [0, 50 ms]: mean ~25 ms


def test_a_drain_counts_each_session_it_closes_once_however_it_closes():
    """sessions_drained_total counts every session a drain moves: one idle between requests (closed at
    once; most sessions of a fleet are), one that finishes its reply and is closed by its handler, and
    one still busy at the time limit. Before, only the second kind was counted. The Drain itself, on a
    real event loop; the server wires `on_drained` to the counter (cloud_server/app.py), whose process
    exits once drained, so its /metrics cannot be read after."""
    import asyncio

    from cloud_server.drain import GOING_AWAY, Drain

    async def scenario() -> tuple[int, list[tuple[str, int]], int]:
        counted: list[int] = []
        drain = Drain(on_drained=lambda: counted.append(1))
        closed: list[tuple[str, int]] = []

        def closer(name: str):
            async def close(code: int, reason: str) -> None:
                closed.append((name, code))
                drain.unregister(name)

            return close

        drain.register("idle", closer("idle")).waiting = True
        busy = drain.register("busy", closer("busy"))
        drain.register("stuck", closer("stuck"))
        task = asyncio.ensure_future(drain.run(timeout_s=0.3))
        await asyncio.sleep(0.05)
        drain.drained(busy)  # its reply is sent: the handler closes it (cloud_server/app.py)
        drain.drained(busy)  # and the count does not move again
        drain.unregister("busy")
        left = await task
        return left, closed, len(counted)

    left, closed, counted = asyncio.run(scenario())
    assert left == 1 and closed == [("idle", GOING_AWAY), ("stuck", GOING_AWAY)], (left, closed)
    assert counted == 3


def test_drain_finishes_the_reply_then_closes_going_away(cloud_info):
    """SIGTERM while a session streams a reply: /readyz says 503 at once (on a connection already
    open; /healthz, the liveness, stays 200), no new connection is taken, the reply in flight arrives whole, then the connection is
    closed 1001 "going away" and the server exits by itself."""
    server = LocalCloudServer(model=DEFAULT_CLOUD_MODEL).start()
    try:
        probe = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        probe.request("GET", "/readyz")
        ok = probe.getresponse()
        assert ok.status == 200 and b'"ready": true' in ok.read()
        with connect(server.url, open_timeout=10) as ws:
            ws.send(encode(hello(cloud_info, server.api_key, "tell me about the moon")))
            n = decode(ws.recv(timeout=30)).n_prompt
            ws.send(encode(Generate(request_id=1, position=n, tokens=[], max_tokens=40)))
            first = decode(ws.recv(timeout=30))
            assert isinstance(first, Tokens) and not first.final
            server.terminate()
            probe.request("GET", "/readyz")
            answer = probe.getresponse()
            assert answer.status == 503 and b"draining" in answer.read()
            probe.request("GET", "/healthz")
            alive = probe.getresponse()
            assert alive.status == 200 and b"draining" in alive.read()
            got = list(first.ids)
            while True:
                msg = decode(ws.recv(timeout=30))
                if isinstance(msg, Tokens):
                    got += msg.ids
                    if msg.final:
                        break
            assert len(got) == 40 or msg.eog, "the reply in flight must arrive whole"
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
            assert "draining" in closed.value.rcvd.reason
        assert server.wait(10) == 0, "a drained server exits by itself, cleanly"
        with pytest.raises(OSError):
            connect(server.url, open_timeout=2).close()
    finally:
        server.stop()


def _ask(fleet: LocalFleet, disturb: str | None, at: int = 8, **options: object):
    """One answer through the balancer with the default options (the device on the cloud's model),
    `disturb` ("kill", "drain", "scale_in") applied to the replica holding the session at token `at`.
    Returns (answer, victim, time from the disturbance to the next cloud token in s)."""
    opts = GeneratorOptions(
        edge_model=DEFAULT_CLOUD_MODEL, cloud=fleet.url, api_key=fleet.api_key, max_tokens=48, **options
    )
    seen: dict[str, float | int] = {}

    def on_token(ev) -> None:
        if disturb and ev.index == at and "t" not in seen:
            seen["victim"] = fleet.holder()
            seen["t"] = time.perf_counter()
            getattr(fleet, disturb)(int(seen["victim"]))
        elif "t" in seen and "next_cloud" not in seen and ev.route == "cloud":
            seen["next_cloud"] = time.perf_counter() - seen["t"]

    with open_generator(opts) as gen:
        a = gen.generate(QUESTION, on_token=on_token)
    return a, seen.get("victim"), seen.get("next_cloud")


@pytest.fixture
def fleet():
    if find_haproxy() is None:
        pytest.skip("haproxy is not installed (scripts/setup.sh installs it)")
    with LocalFleet(2, model=DEFAULT_CLOUD_MODEL) as f:
        yield f


@needs_haproxy
@pytest.mark.kernel
@pytest.mark.parametrize("disturb", ["kill", "drain", "scale_in"])
def test_a_session_survives_its_replica(fleet, cloud_info, disturb):
    """Kill -9, drain (SIGTERM) or scale in the replica holding the session mid-answer: the device
    rebuilds the session on the other replica (one failover, counted there as resumed), the answer is
    not degraded and equals the undisturbed one (nothing lost or applied twice), and the next answer
    goes on through the balancer without another failover."""
    undisturbed, _, _ = _ask(fleet, None)
    assert not undisturbed.degraded and undisturbed.n_cloud_tokens > 0
    a, victim, _ = _ask(fleet, disturb)
    assert victim is not None
    survivor = 1 - int(victim)
    assert not a.degraded, a.degraded_reason
    assert a.traffic.reconnects == 1 and a.traffic.failover_ms > 0  # measured; bounded by --reconnect-wait + a try
    assert metric(fleet.replicas[survivor], "tokenrouter_sessions_resumed_total") == 1
    assert agree_up_to_a_tie(cloud_info, QUESTION, a.tokens, undisturbed.tokens), (a.text, undisturbed.text)
    assert fleet.replicas[int(victim)].wait(15) is not None, "the victim is gone"
    again, _, _ = _ask(fleet, None)
    assert not again.degraded and again.traffic.reconnects == 0


@needs_haproxy
@pytest.mark.parametrize("disturb", ["kill", "drain"])
def test_a_replica_lost_between_answers_costs_the_next_answer_nothing(fleet, disturb):
    """The device keeps its session between answers; its replica dies or drains meanwhile (a drain closes
    an idle session at once). The next answer opens a new session through the balancer at its start: not
    degraded, and no failover needed (nothing was in flight)."""
    opts = GeneratorOptions(edge_model=DEFAULT_CLOUD_MODEL, cloud=fleet.url, api_key=fleet.api_key, max_tokens=16)
    with open_generator(opts) as gen:
        first = gen.generate(QUESTION)
        assert not first.degraded and gen.link is not None
        victim = fleet.holder()
        getattr(fleet, disturb)(victim)
        assert fleet.replicas[victim].wait(15) is not None
        second = gen.generate(chat("And of Athens?"))
        assert not second.degraded, second.degraded_reason
        assert second.n_cloud_tokens > 0 and second.traffic.reconnects == 0
        assert fleet.sessions(1 - victim) == 1


@needs_haproxy
@pytest.mark.kernel
@pytest.mark.parametrize("text_mode", ["never", "always"])
def test_a_reply_lost_in_flight_is_asked_again(fleet, cloud_info, text_mode):
    """Every token hard (threshold 0), and the replica killed from another thread while the device
    waits for a reply: the request lost with it is asked again on the rebuilt session, so the cloud
    writes every position, none twice, and the answer equals the undisturbed one. In tokens and in
    text mode (the text path's lossless setting: the same model on both sides)."""
    hard = dict(threshold=0.0, cloud_fraction=None, lookahead=False, check="off", text_mode=text_mode)
    undisturbed, _, _ = _ask(fleet, None, **hard)
    assert undisturbed.n_cloud_tokens == undisturbed.n_tokens
    victim = {}

    def kill_soon() -> None:
        while not fleet.sessions(fleet.holder()):
            time.sleep(0.005)
        time.sleep(0.15)  # mid-answer: a request is in flight most of the time
        victim["i"] = fleet.holder()
        fleet.kill(victim["i"])

    killer = threading.Thread(target=kill_soon)
    killer.start()
    a, _, _ = _ask(fleet, None, **hard)
    killer.join()
    assert "i" in victim and not a.degraded, a.degraded_reason
    assert a.traffic.reconnects == 1
    assert a.routes == ["cloud"] * a.n_tokens, "after the failover the cloud writes again"
    assert agree_up_to_a_tie(cloud_info, QUESTION, a.tokens, undisturbed.tokens), (a.text, undisturbed.text)


def _ready(server: LocalCloudServer) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.http_url + "/readyz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@needs_haproxy
def test_a_full_replica_leaves_the_balancer_and_new_sessions_go_elsewhere():
    """Replicas of one session each: once a device holds one, its /readyz says 503 "full", the balancer
    stops sending it new sessions, and the next device's session opens on the other replica (not
    refused, not degraded); when the first device leaves, the replica is ready again."""
    with LocalFleet(2, model=DEFAULT_CLOUD_MODEL, extra_args=["--max-sessions", "1"]) as fleet:
        opts = GeneratorOptions(edge_model=DEFAULT_CLOUD_MODEL, cloud=fleet.url, api_key=fleet.api_key, max_tokens=8)
        with open_generator(opts) as first:
            assert not first.generate(QUESTION).degraded and first.link is not None
            held = fleet.holder()
            status, body = _ready(fleet.replicas[held])
            assert status == 503 and body["why"].startswith("full"), body
            assert wait_for(lambda: fleet.up() == [1 - held], 10), (
                fleet.up()
            )  # the balancer's checks take the full replica out
            with open_generator(opts) as second:
                a = second.generate(QUESTION)
                assert not a.degraded, a.degraded_reason
                assert fleet.sessions(1 - held) == 1 and fleet.sessions(held) == 1
        assert _ready(fleet.replicas[held])[0] == 200
        fleet.wait_up(2)


def test_fleet_config_names_what_the_docs_say():
    """The balancer the tests run is the one docs/server.md shows: health checks on /readyz, client-IP
    affinity, redispatch of refused connections, and a tunnel timeout for WebSockets."""
    from cloud_server.local_fleet import haproxy_config
    from tests.conftest import ROOT

    cfg = haproxy_config(8000, [8001, 8002], "/tmp/admin.sock")
    doc = (ROOT / "docs" / "server.md").read_text()
    for line in ("option httpchk GET /readyz", "balance source", "option redispatch 1", "timeout tunnel"):
        assert line in cfg and line in doc, line
