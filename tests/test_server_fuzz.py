"""Fuzzing the real server with malformed frames (hypothesis), over a real WebSocket on loopback.

Every frame is malformed by construction (junk bytes, junk text, JSON that is
not a valid message, valid-looking messages that break a rule of the current
session state, oversized frames). Each must be answered with an `error` or
`reject`, or the connection closed cleanly; never an internal error. Then the
server must still serve a normal session, and its memory must stay flat.
"""

from __future__ import annotations

import json
import struct
import time

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cloud_server.local import LocalCloudServer
from models.registry import DEFAULT_CLOUD_MODEL
from shared.protocol import PROTOCOL_VERSION, Accept, Error, Generate, Hello, Reject, Tokens, decode, encode
from tests.conftest import chat

MAX_BYTES = 4096
CLEAN_CLOSE = {1000, 1001, 1008, 1009}
TYPES = ["hello", "accept", "reject", "sync", "generate", "tokens", "rollback", "close", "error", "verify", "verdict", "nope", ""]

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)

# frames for a connection that has not said hello: anything but a valid hello with a valid key
pre_hello = st.one_of(
    st.binary(max_size=64).map(lambda b: ("bytes", b)),
    st.text(max_size=64).map(lambda t: ("text", t)),
    st.dictionaries(st.text(max_size=8), json_value, max_size=5).map(lambda d: ("text", json.dumps(d))),
    st.builds(lambda t, r: ("text", json.dumps({"type": t, "request_id": r})), st.sampled_from(TYPES), st.integers(-(2**64), -1) | st.booleans() | st.floats()),
    st.builds(lambda t, d: ("text", json.dumps({"type": t, **d})), st.sampled_from(TYPES), st.dictionaries(st.sampled_from(["position", "tokens", "request_id", "max_tokens", "reason", "api_key", "version", "messages", "code"]), json_value, max_size=4)),
    st.builds(lambda k, v: ("text", json.dumps({"type": "hello", "version": v, "api_key": k, "edge_model": "x", "tokenizer": "y", "messages": []})), st.text(max_size=16), st.integers(0, 3)),
    st.integers(1, 4000).map(lambda depth: ("text", "[" * depth + "]" * depth)),
    st.integers(MAX_BYTES + 1, 3 * MAX_BYTES).map(lambda n: ("text", json.dumps({"type": "sync", "position": 0, "pad": "x" * n}))),
    st.builds(lambda n, dim: ("bytes", struct.pack(">I", n) + b'{"type":"generate","hidden_dim":%d}' % dim + b"\0" * 3), st.integers(0, 80), st.integers(-2, 5)),
)

# frames for a live session holding `n` tokens: each breaks a rule (position, range, type, state)
post_hello = st.one_of(
    st.tuples(st.just("sync_pos"), st.integers(1, 50), st.lists(st.integers(0, 100), max_size=4)),
    st.tuples(st.just("gen_pos"), st.integers(1, 50), st.lists(st.integers(0, 100), max_size=4)),
    st.tuples(st.just("gen_vocab"), st.integers(49152, 2**40) | st.integers(-(2**40), -1)),
    st.tuples(st.just("gen_max"), st.sampled_from([0, 513, 10**6])),
    st.tuples(st.just("rollback_past"), st.integers(1, 10**6)),
    st.tuples(st.just("hello_again"), st.just(0)),
    st.tuples(st.just("server_type"), st.sampled_from(["accept", "tokens", "reject", "error"])),
    st.tuples(st.just("bad_type"), st.sampled_from(["sync", "generate", "rollback"]), json_value.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))),
    st.tuples(st.just("junk"), st.binary(max_size=32)),
)


class FuzzClient:
    """Two connections: one that never says hello, one with a live session (kept apart to avoid reconnects)."""

    def __init__(self, server: LocalCloudServer, info) -> None:
        self.server = server
        self.info = info
        self.conns: dict[bool, object] = {False: None, True: None}
        self.n = 0  # tokens the live session holds
        self.sent = 0
        self.outcomes: dict[str, int] = {}

    def _connect(self, session: bool):
        ws = connect(self.server.url, open_timeout=10, compression=None, max_size=None).__enter__()  # closed by the test
        if session:
            ws.send(encode(Hello(version=PROTOCOL_VERSION, api_key=self.server.api_key, edge_model=self.info.fingerprint,
                                 tokenizer=self.info.tokenizer_fingerprint, messages=chat("hi"))))
            acc = decode(ws.recv(timeout=10))
            assert isinstance(acc, Accept)
            self.n = acc.n_prompt
        self.conns[session] = ws
        return ws

    def close(self) -> None:
        for ws in self.conns.values():
            if ws is not None:
                ws.close()

    def frame_for(self, spec: tuple) -> str | bytes:
        kind, *a = spec
        n = self.n
        if kind in ("bytes", "text", "junk"):
            return a[0]
        if kind == "sync_pos":
            return json.dumps({"type": "sync", "position": n + a[0], "tokens": a[1]})
        if kind == "gen_pos":
            return json.dumps({"type": "generate", "request_id": 7, "position": max(0, n - a[0]) if a[0] % 2 else n + a[0], "tokens": a[1]})
        if kind == "gen_vocab":
            return json.dumps({"type": "generate", "request_id": 8, "position": n, "tokens": [a[0]]})
        if kind == "gen_max":
            return json.dumps({"type": "generate", "request_id": 9, "position": n, "tokens": [], "max_tokens": a[0]})
        if kind == "rollback_past":
            return json.dumps({"type": "rollback", "position": n + a[0]})
        if kind == "hello_again":
            return encode(Hello(version=PROTOCOL_VERSION, api_key="k", edge_model="e", tokenizer="t", messages=[]))  # type: ignore[return-value]
        if kind == "server_type":
            return encode(Tokens(request_id=1, position=n, ids=[1], logprobs=[0.0], compute_ms=0.0) if a[0] == "tokens" else Error(code="x", message="y"))  # type: ignore[return-value]
        if kind == "bad_type":
            field = {"sync": "position", "generate": "position", "rollback": "position"}[a[0]]
            return json.dumps({"type": a[0], "request_id": 1, "position": n, "tokens": [], field: a[1]})
        raise AssertionError(kind)

    def exchange(self, spec: tuple, session: bool) -> str:
        ws = self.conns[session] or self._connect(session)
        frame = self.frame_for(spec)
        if spec[0] == "junk" and session:
            frame = b"\xff\xff" + frame  # binary junk: never a valid frame
        self.sent += 1
        try:
            ws.send(frame)
            reply = decode(ws.recv(timeout=10))
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            assert code in CLEAN_CLOSE, f"connection dropped without a clean close ({code}) after {str(frame)[:80]!r}"
            self.conns[session] = None
            return self._count("closed")
        except TimeoutError:
            raise AssertionError(f"no answer to {str(frame)[:120]!r}") from None
        assert isinstance(reply, (Error, Reject)), f"{str(frame)[:120]!r} was answered with {reply}"
        assert reply.code != "internal", f"{str(frame)[:120]!r} caused an internal error"
        if isinstance(reply, Reject):
            ws.close()
            self.conns[session] = None
        return self._count(reply.code)

    def _count(self, what: str) -> str:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1
        return what


@pytest.fixture(scope="module")
def fuzz_server():
    args = ["--max-message-bytes", str(MAX_BYTES), "--max-messages-per-s", "100000", "--n-ctx", "2048"]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        yield server


def run_fuzz(client: FuzzClient, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(st.one_of(pre_hello.map(lambda f: (f, False)), post_hello.map(lambda f: (f, True))))
    def one(case: tuple) -> None:
        spec, session = case
        client.exchange(spec, session)

    one()


def test_malformed_frames_are_all_answered_and_the_server_keeps_serving(fuzz_server, cloud_info):
    proc = psutil.Process(fuzz_server.proc.pid)
    client = FuzzClient(fuzz_server, cloud_info)
    run_fuzz(client, 300)  # warm-up: allocator pools, caches
    rss_before = proc.memory_info().rss
    sent_before = client.sent
    run_fuzz(client, 1000)
    rss_after = proc.memory_info().rss
    assert client.sent - sent_before >= 1000 and client.sent >= 1300
    assert len(client.outcomes) >= 5, client.outcomes  # the frames reached many different checks
    assert rss_after - rss_before < 24 << 20, f"server memory grew by {(rss_after - rss_before) >> 20} MiB over 1000 frames"
    client.close()

    # still serving: a normal session writes a token, and nothing leaked
    with connect(fuzz_server.url, open_timeout=10, compression=None) as ws:
        ws.send(encode(Hello(version=PROTOCOL_VERSION, api_key=fuzz_server.api_key, edge_model=cloud_info.fingerprint,
                             tokenizer=cloud_info.tokenizer_fingerprint, messages=chat("what is the capital of france"))))
        acc = decode(ws.recv(timeout=10))
        assert isinstance(acc, Accept)
        ws.send(encode(Generate(request_id=1, position=acc.n_prompt, tokens=[])))
        assert isinstance(decode(ws.recv(timeout=10)), Tokens)
    import urllib.request

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with urllib.request.urlopen(fuzz_server.http_url + "/healthz", timeout=5) as r:
            if json.loads(r.read())["sessions"] == 0:
                break
        time.sleep(0.1)
    else:
        raise AssertionError("sessions leaked after the fuzz run")
