"""Issue 47, connections and drain: the costs a client pushes onto others before it has a session.

A drained server exits within `--drain-timeout-s` + 1 s whatever its clients do (an HTTP client
that pipelines requests and never reads kept it alive for good); connections that never say hello
are closed at a deadline and capped in all and per address, named in their close frame, while
/healthz answers and an honest device beside them answers token for token as alone; FastAPI's API
docs are off unless asked for; a client's bidi controls are escaped in the log; an exploration
refused as `busy` spends no budget and is not counted. Real `tokenrouter-cloud serve` processes on
loopback (attackers from 127.0.0.2 and up: Linux routes all of 127/8 to loopback, so they are other
addresses than the honest device's 127.0.0.1), with small caps so that each test takes seconds.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from cloud_server.hello_gate import TRY_AGAIN_LATER, HelloGate
from cloud_server.local import LocalCloudServer
from cloud_server.logs import escape
from edge_client.answer import Answer
from edge_client.cloud_link import CloudLink
from edge_client.generator import RoutedGenerator
from edge_client.options import GeneratorOptions
from models.registry import DEFAULT_CLOUD_MODEL
from shared.protocol import Accept, Error, Generate, Reject, Tokens, decode, encode
from tests.helpers import hello_json, metric, sessions, wait_for

PER_ADDRESS, TOTAL, HELLO_S = 3, 8, 1.5
QUESTION = "how do you say hello in japanese"


def closed_with_frame(ws: ClientConnection, timeout: float = 10.0):
    """Read until the server closes; the close frame it sent (None: dropped without one)."""
    try:
        while True:
            ws.recv(timeout=timeout)
    except ConnectionClosed as exc:
        return exc.rcvd
    except TimeoutError:
        return "still open"


def ws_from(server: LocalCloudServer, address: str) -> ClientConnection:
    """A WebSocket to `server` from the loopback address `address` (e.g. 127.0.0.2); it says nothing."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(address, 0))
    return connect(server.url, sock=sock, open_timeout=10, compression=None).__enter__()  # closed by the caller


def healthz_s(server: LocalCloudServer) -> float:
    """Seconds one GET /healthz takes (it must answer 200)."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(server.http_url + "/healthz", timeout=5) as r:
        assert r.status == 200
    return time.perf_counter() - t0


def rejections(server: LocalCloudServer, reason: str) -> float:
    return metric(server, f'tokenrouter_rejections_total{{reason="{reason}"}}')


@pytest.fixture(scope="module")
def gated():
    """Small caps before hello, info-level log (the bidi test reads its reject line)."""
    args = [
        "--max-pre-hello-per-address",
        str(PER_ADDRESS),
        "--max-pre-hello",
        str(TOTAL),
        "--hello-timeout-s",
        str(HELLO_S),
        "--log-level",
        "info",
    ]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        yield server


# --------------------------------------------------------------------------- drain: a hard deadline


def test_a_drained_server_exits_within_its_timeout_beside_an_http_client_that_never_reads():
    """Issue 47, reproduction 2: a 4 KB receive buffer, /metrics requests pipelined until the server
    stops reading them (its responses fill both sides' buffers), then SIGTERM: it exits by itself,
    cleanly, within the drain timeout + 1 s (it stayed up for good before)."""
    drain_s = 2.0
    args = ["--drain-timeout-s", str(drain_s), "--socket-sndbuf", "4096", "--log-level", "info"]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", server.port))
        client.setblocking(False)
        requests = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 3000
        sent, t_end = 0, time.monotonic() + 3
        while sent < len(requests) and time.monotonic() < t_end:  # the kernel's receive buffer takes them all
            try:
                sent += client.send(requests[sent:])
            except BlockingIOError:
                time.sleep(0.02)
        mark = server.log_mark()
        time.sleep(0.5)  # the server writes responses until both sides' buffers are full
        served = len([line for line in server.log_since(mark) if "GET /metrics" in line])
        assert served < 100, f"{served} responses read: nothing is stuck, the test proves nothing"
        mark = server.log_mark()
        t0 = time.monotonic()
        server.terminate()
        status = server.wait(drain_s + 5)
        took = time.monotonic() - t0
        client.close()
        assert status == 0, (status, server.log[-20:])
        assert took <= drain_s + 1.0, (
            f"exited {took:.2f} s after SIGTERM (drain timeout {drain_s} s)",
            [ln for ln in server.log[-40:] if "access" not in ln],
        )
        log = server.log_since(mark)
        assert any("aborted 1 connections" in line for line in log), log[-20:]


# --------------------------------------------------------------------------- before hello: a deadline and caps


def honest_answer(server: LocalCloudServer, edge) -> Answer:
    """What `tokenrouter-edge ask --seed 7` answers against `server`, from 127.0.0.1."""
    opts = GeneratorOptions(cloud=server.url, api_key=server.api_key, seed=7, max_tokens=32)
    gen = RoutedGenerator(edge, opts, lambda: CloudLink(server.url, server.api_key, timeout_s=opts.cloud_timeout_s))
    try:
        return gen.generate([{"role": "system", "content": opts.system_prompt}, {"role": "user", "content": QUESTION}])
    finally:
        gen.close()


class SilentCrowd(threading.Thread):
    """Keeps the per-address cap of 127.0.0.2 full of connections that never say hello, reopening
    each as the server closes it, until stopped; counts the close frames by code."""

    def __init__(self, server: LocalCloudServer) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stop = threading.Event()
        self.codes: dict[int, int] = {}
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                socks = [ws_from(self.server, "127.0.0.2") for _ in range(PER_ADDRESS + 1)]
                for ws in socks:
                    close = closed_with_frame(ws, timeout=HELLO_S + 5)
                    code = close.code if close is not None and close != "still open" else -1
                    self.codes[code] = self.codes.get(code, 0) + 1
                    ws.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc


def test_connections_without_hello_are_capped_per_address_closed_at_the_deadline_and_harm_nobody(
    gated, edge_model, cloud_info
):
    """Issue 47, reproduction 3, in small: 127.0.0.2 opens more silent WebSockets than its cap; the
    extra ones are closed at once (1013, the cap named), the others at the hello deadline (1008);
    /healthz answers within 100 ms meanwhile; an honest device from 127.0.0.1 beside a crowd that
    keeps the cap full answers token for token as alone, not degraded; a connection with a session
    no longer counts."""
    alone = honest_answer(gated, edge_model)
    assert not alone.degraded and alone.n_cloud_tokens > 0, alone.to_json()
    capped0, timed_out0 = rejections(gated, "pre_hello_cap"), rejections(gated, "hello_timeout")

    t0 = time.monotonic()
    silent = [ws_from(gated, "127.0.0.2") for _ in range(PER_ADDRESS)]
    extra = [ws_from(gated, "127.0.0.2") for _ in range(2)]
    for ws in extra:
        close = closed_with_frame(ws, timeout=2)
        assert close is not None and close != "still open", close
        assert close.code == TRY_AGAIN_LATER and f"from your address ({PER_ADDRESS})" in close.reason, close
    health = [healthz_s(gated) for _ in range(3)]  # the cap is reached: health checks answer anyway
    assert min(health) <= 0.1 and statistics.median(health) <= 0.5, health
    for ws in silent:
        close = closed_with_frame(ws, timeout=HELLO_S + 5)
        assert close is not None and close != "still open", close
        assert close.code == 1008 and f"no hello within {HELLO_S:g} s" in close.reason, close
    took = time.monotonic() - t0
    assert HELLO_S - 0.2 <= took <= HELLO_S + 1.5, took
    assert rejections(gated, "pre_hello_cap") - capped0 == 2
    assert rejections(gated, "hello_timeout") - timed_out0 == PER_ADDRESS

    crowd = SilentCrowd(gated)
    crowd.start()
    try:
        time.sleep(0.3)  # the crowd holds the cap before the honest device asks
        beside = [honest_answer(gated, edge_model) for _ in range(2)]
    finally:
        crowd.stop.set()
        crowd.join(timeout=30)
    assert crowd.failure is None, repr(crowd.failure)
    assert crowd.codes.get(TRY_AGAIN_LATER, 0) >= 1 and crowd.codes.get(1008, 0) >= PER_ADDRESS, crowd.codes
    for answer in beside:
        assert not answer.degraded and answer.cloud_timeouts == 0, answer.to_json()
        assert answer.tokens == alone.tokens, (alone.text, answer.text)

    # sessions leave the gate: PER_ADDRESS sessions from 127.0.0.2, then one more silent connection is let in
    sessions_ = [ws_from(gated, "127.0.0.2") for _ in range(PER_ADDRESS)]
    for ws in sessions_:
        ws.send(hello_json(cloud_info, gated.api_key))
        assert isinstance(decode(ws.recv(timeout=30)), Accept)
    late = ws_from(gated, "127.0.0.2")
    assert closed_with_frame(late, timeout=0.5) == "still open"
    late.close()
    for ws in sessions_:
        ws.close()
    assert wait_for(lambda: sessions(gated) == 0)


def test_the_cap_in_all_closes_the_next_connection_by_name_and_readiness_answers(gated, cloud_info):
    """TOTAL silent connections from three addresses (each under its own cap): the next, from a fourth,
    is closed at once naming the cap in all; /healthz and /readyz answer meanwhile; once the silent
    ones are closed at the deadline, a device is served again."""
    crowd = []
    for i in range(TOTAL):
        crowd.append(ws_from(gated, f"127.0.0.{2 + i % 3}"))
    time.sleep(0.2)  # all admitted (the server counts each as it accepts it)
    one_more = ws_from(gated, "127.0.0.9")
    close = closed_with_frame(one_more, timeout=2)
    assert close is not None and close != "still open", close
    assert close.code == TRY_AGAIN_LATER and f"waiting for hello ({TOTAL})" in close.reason, close
    assert healthz_s(gated) < 1.0
    with urllib.request.urlopen(gated.http_url + "/readyz", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["ready"] is True
    for ws in crowd:
        close = closed_with_frame(ws, timeout=HELLO_S + 5)
        assert close is not None and close != "still open" and close.code == 1008, close
    with connect(gated.url, open_timeout=10, compression=None) as ws:
        ws.send(hello_json(cloud_info, gated.api_key))
        assert isinstance(decode(ws.recv(timeout=30)), Accept)
    assert wait_for(lambda: sessions(gated) == 0)


def test_the_hello_gate_counts_per_address_and_in_all():
    """In-process: admitted up to each cap, refused past it with the cap named, freed by `leave`."""
    gate = HelloGate(max_total=3, max_per_address=2)
    assert gate.enter("a") == "" and gate.enter("a") == ""
    assert "from your address (2)" in gate.enter("a")
    assert gate.enter("b") == ""
    assert "waiting for hello (3)" in gate.enter("c")
    gate.leave("a")
    assert gate.enter("c") == "" and gate.total == 3 and gate.waiting("a") == 1
    for address in ("a", "b", "c"):
        gate.leave(address)
    assert gate.total == 0 and gate.waiting("a") == 0


# --------------------------------------------------------------------------- API docs, log escaping, counters


@pytest.fixture(scope="module")
def explorer():
    """API docs on; a key may explore twice a minute; no cloud-token fraction over 50 % from the first
    token (so a generate that carries no device tokens is refused `busy`)."""
    args = ["--api-docs", "--key-explore-per-minute", "2", "--key-max-cloud-fraction", "0.5"]
    args += ["--abuse-warmup-tokens", "0"]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        yield server


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_api_docs_are_off_by_default_and_served_with_the_option(gated, explorer):
    paths = ("/docs", "/openapi.json", "/redoc")
    assert [status_of(gated.http_url + p) for p in paths] == [404, 404, 404]
    assert [status_of(explorer.http_url + p) for p in paths] == [200, 200, 200]


def test_a_clients_bidi_controls_are_escaped_in_the_log(gated, cloud_info):
    """A tokenizer holding U+202E (right-to-left override) is refused `vocab_mismatch`; the INFO line
    that names it shows the control as an escape, so the rest of the line reads as written."""
    mark = gated.log_mark()
    tokenizer = cloud_info.tokenizer_fingerprint + "\u202e" + "evil\u2066"
    with connect(gated.url, open_timeout=10, compression=None) as ws:
        ws.send(hello_json(cloud_info, gated.api_key, tokenizer=tokenizer))
        reply = decode(ws.recv(timeout=10))
        assert isinstance(reply, Reject) and reply.code == "vocab_mismatch", reply
    line = wait_for(lambda: [ln for ln in gated.log_since(mark) if "reject: vocab_mismatch" in ln])
    assert line and "\\u202eevil\\u2066" in line[0], line
    assert not any(c in line[0] for c in "\u202e\u2066"), line
    for control in "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069":
        assert escape(f"a{control}b") == "a" + control.encode("unicode_escape").decode() + "b"


def test_an_exploration_refused_busy_spends_no_budget_and_is_not_counted(explorer, cloud_info):
    """Explorations refused `busy` (the session's cloud share over its cap) leave the key's budget of
    2 a minute whole and `explored_total` unchanged: the next two explorations that carry device
    tokens are served and counted, the third is declined (`explore_limited`)."""
    explored0 = metric(explorer, "tokenrouter_explored_total")
    with connect(explorer.url, open_timeout=10, compression=None) as ws:
        ws.send(hello_json(cloud_info, explorer.api_key))
        acc = decode(ws.recv(timeout=30))
        assert isinstance(acc, Accept), acc
        position, rid = acc.n_prompt, 0

        def explore(tokens: list[int]):
            nonlocal rid
            rid += 1
            ws.send(encode(Generate(request_id=rid, position=position, tokens=tokens, explore=True)))
            return decode(ws.recv(timeout=30))

        for _ in range(4):  # all cloud, no device tokens: over the 50 % cap
            reply = explore([])
            assert isinstance(reply, Error) and reply.code == "busy" and "throttled" in reply.message, reply
        assert metric(explorer, "tokenrouter_explored_total") == explored0
        for _ in range(2):
            reply = explore([28] * 4)
            assert isinstance(reply, Tokens), reply
            position = reply.position + len(reply.ids)
        reply = explore([28] * 4)
        assert isinstance(reply, Error) and reply.code == "explore_limited", reply
    assert metric(explorer, "tokenrouter_explored_total") - explored0 == 2
    assert wait_for(lambda: sessions(explorer) == 0)
