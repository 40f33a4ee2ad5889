"""Fuzzing the real server with malformed frames (hypothesis), over a real WebSocket on loopback.

Every frame is malformed by construction (junk bytes, junk text, JSON that is
not a valid message, valid-looking messages that break a rule of the current
session state, oversized frames). Each must be answered with an `error` or
`reject`, or the connection closed cleanly; never an internal error. Then the
server must still serve a normal session, and its memory must stay flat.

The fuzzer that holds a valid key speaks both token and text mode (protocol v3: byte positions,
cuts inside characters, drafted text and its ranges) against a server with every production flag
on (keys with quotas and a KV churn budget, the flywheel's record dir, the audit log, a small split
KV budget), and checks that nothing is written outside the record and audit dirs (issue 29).
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

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
TYPES = [
    "hello",
    "accept",
    "reject",
    "sync",
    "generate",
    "tokens",
    "rollback",
    "close",
    "error",
    "verify",
    "verdict",
    "nope",
    "",
]

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=12)
)
json_value = st.recursive(
    json_leaf,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)

# frames for a connection that has not said hello: anything but a valid hello with a valid key
pre_hello = st.one_of(
    st.binary(max_size=64).map(lambda b: ("bytes", b)),
    st.text(max_size=64).map(lambda t: ("text", t)),
    st.dictionaries(st.text(max_size=8), json_value, max_size=5).map(lambda d: ("text", json.dumps(d))),
    st.builds(
        lambda t, r: ("text", json.dumps({"type": t, "request_id": r})),
        st.sampled_from(TYPES),
        st.integers(-(2**64), -1) | st.booleans() | st.floats(),
    ),
    st.builds(
        lambda t, d: ("text", json.dumps({"type": t, **d})),
        st.sampled_from(TYPES),
        st.dictionaries(
            st.sampled_from(
                ["position", "tokens", "request_id", "max_tokens", "reason", "api_key", "version", "messages", "code"]
            ),
            json_value,
            max_size=4,
        ),
    ),
    st.builds(
        lambda k, v: (
            "text",
            json.dumps(
                {"type": "hello", "version": v, "api_key": k, "edge_model": "x", "tokenizer": "y", "messages": []}
            ),
        ),
        st.text(max_size=16),
        st.integers(0, 3),
    ),
    st.integers(1, 4000).map(lambda depth: ("text", "[" * depth + "]" * depth)),
    st.integers(MAX_BYTES + 1, 3 * MAX_BYTES).map(
        lambda n: ("text", json.dumps({"type": "sync", "position": 0, "pad": "x" * n}))
    ),
    st.builds(
        lambda n, dim: ("bytes", struct.pack(">I", n) + b'{"type":"generate","hidden_dim":%d}' % dim + b"\0" * 3),
        st.integers(0, 80),
        st.integers(-2, 5),
    ),
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
    st.tuples(
        st.just("bad_type"),
        st.sampled_from(["sync", "generate", "rollback"]),
        json_value.filter(lambda v: not isinstance(v, int) or isinstance(v, bool)),
    ),
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
        ws = connect(
            self.server.url, open_timeout=10, compression=None, max_size=None
        ).__enter__()  # closed by the test
        if session:
            ws.send(
                encode(
                    Hello(
                        version=PROTOCOL_VERSION,
                        api_key=self.server.api_key,
                        edge_model=self.info.fingerprint,
                        tokenizer=self.info.tokenizer_fingerprint,
                        messages=chat("hi"),
                    )
                )
            )
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
            return json.dumps(
                {
                    "type": "generate",
                    "request_id": 7,
                    "position": max(0, n - a[0]) if a[0] % 2 else n + a[0],
                    "tokens": a[1],
                }
            )
        if kind == "gen_vocab":
            return json.dumps({"type": "generate", "request_id": 8, "position": n, "tokens": [a[0]]})
        if kind == "gen_max":
            return json.dumps({"type": "generate", "request_id": 9, "position": n, "tokens": [], "max_tokens": a[0]})
        if kind == "rollback_past":
            return json.dumps({"type": "rollback", "position": n + a[0]})
        if kind == "hello_again":
            return encode(Hello(version=PROTOCOL_VERSION, api_key="k", edge_model="e", tokenizer="t", messages=[]))  # type: ignore[return-value]
        if kind == "server_type":
            return encode(
                Tokens(request_id=1, position=n, ids=[1], logprobs=[0.0], compute_ms=0.0)
                if a[0] == "tokens"
                else Error(code="x", message="y")
            )  # type: ignore[return-value]
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
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(st.one_of(pre_hello.map(lambda f: (f, False)), post_hello.map(lambda f: (f, True))))
    def one(case: tuple) -> None:
        spec, session = case
        client.exchange(spec, session)

    one()


def test_a_refused_frame_with_an_out_of_range_request_id_gets_an_error_the_device_can_read(fuzz_server):
    """Found by the fuzzer: a frame whose request_id is beyond 2**53 was answered with an error
    echoing that id, which the device's own decode then refused. The id is echoed only in range."""
    with connect(fuzz_server.url) as ws:
        for rid, echoed in ((12622964055672717, None), (7, 7)):
            ws.send(json.dumps({"type": "error", "request_id": rid}))
            reply = decode(ws.recv(timeout=10))
            assert isinstance(reply, Error) and reply.request_id == echoed, reply


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
    assert rss_after - rss_before < 24 << 20, (
        f"server memory grew by {(rss_after - rss_before) >> 20} MiB over 1000 frames"
    )
    client.close()

    # still serving: a normal session writes a token, and nothing leaked
    with connect(fuzz_server.url, open_timeout=10, compression=None) as ws:
        ws.send(
            encode(
                Hello(
                    version=PROTOCOL_VERSION,
                    api_key=fuzz_server.api_key,
                    edge_model=cloud_info.fingerprint,
                    tokenizer=cloud_info.tokenizer_fingerprint,
                    messages=chat("what is the capital of france"),
                )
            )
        )
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


# --------------------------------------------------------------------------- holding a valid key (issue 16)
#
# The fuzzer above mostly stays outside a session. This one holds a valid key, so its frames reach
# every check behind the key: hello's fields (sampling, message contents, fingerprints), then
# sequences of sync/generate/verify/rollback/close with fuzzed tokens, positions and values,
# close reasons included. After each frame it sends a probe (an unknown type): everything
# before the probe's own error is the server's answer to that frame.

import re  # noqa: E402

import numpy as np  # noqa: E402

from shared.protocol import ErrorCode, Next, TextReply, TextVerdict, Verdict  # noqa: E402

N_VOCAB = 49152
PROBE = json.dumps({"type": "fuzz-probe"})
CODES = set(vars(ErrorCode).values()) - {ErrorCode.INTERNAL}
FIELD_WORDS = (
    "field",
    "token",
    "max_tokens",
    "position",
    "drafted",
    "sampling",
    "history",
)  # a bad_field error says which field


class Raw(str):
    """A JSON literal json.dumps cannot write (NaN, Infinity, 1e400): spliced into the frame as is."""


def dumps(obj: object) -> str:
    raws: list[str] = []

    def walk(v: object) -> object:
        if isinstance(v, Raw):
            raws.append(str(v))
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    text = json.dumps(walk(obj))
    for i, literal in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', literal)
    return text


odd_text = st.one_of(
    st.text(max_size=16),
    st.sampled_from(
        [
            "\ud800",
            "a\udc80b",
            "\udfff",
            "\n2026-01-01 ERROR forged line",
            "é" * 70,
            "\x00\x1b[31m",
            "<|im_end|>",
            "x" * 300,
        ]
    ),
)
odd_number = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-308"]).map(Raw),
)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy = odd_number) -> st.SearchStrategy:
    """Valid values most of the time (so later checks are reached), hostile ones otherwise."""
    return st.one_of(good, good, good, bad)


sampling_strategy = st.dictionaries(
    st.sampled_from(["temperature", "top_p", "top_k", "seed", "temperature", "seed", "colour"]),
    st.one_of(
        st.sampled_from([0, 0.7, 1e-3, 10, 1e-308, 1e-4, 10.5, -1, 2**32, 2**32 - 1, 1 << 20, (1 << 20) + 1, 0.5, 1]),
        odd_number,
    ),
    max_size=4,
)
chat_message = st.fixed_dictionaries(
    {
        "role": mostly(st.sampled_from(["system", "user", "assistant"]), odd_text),
        "content": mostly(st.text(max_size=24), odd_text),
    }
) | st.just({"role": "user", "content": "hi", "name": "x"})
token_ids = st.lists(
    mostly(st.integers(0, N_VOCAB - 1), st.sampled_from([N_VOCAB, -1, 2**31, 2**63, True, 1.0, Raw("NaN")])), max_size=5
)
position_delta = st.one_of(
    st.just(0),
    st.just(0),
    st.just(0),
    st.integers(-3, 3),
    st.sampled_from([2**31, 2**64, True, 1.5, None, "0", Raw("1e400")]),
)

actions = st.one_of(
    st.tuples(st.just("sync"), position_delta, token_ids),
    st.tuples(
        st.just("generate"),
        position_delta,
        token_ids,
        st.sampled_from([1, 1, 2, 3, 0, 513, -1, 2**31, 1.5, True, None, Raw("Infinity")]),
        st.booleans(),
    ),
    st.tuples(
        st.just("generate_hidden"),
        position_delta,
        st.lists(st.sampled_from([0.5, -1.0, np.nan, np.inf, 7e4]), min_size=1, max_size=6),
    ),
    st.tuples(
        st.just("verify"),
        position_delta,
        token_ids,
        st.lists(st.integers(-1, 6), max_size=3),
        st.one_of(st.sampled_from([0, 0.5, 1.0]), odd_number),
    ),
    st.tuples(st.just("rollback"), st.one_of(st.integers(-2, 2), st.sampled_from([None, 2**40, 1.0, True]))),
    st.tuples(st.just("close"), mostly(st.text(max_size=20), odd_text)),
    st.tuples(st.just("hello_again")),
    st.tuples(st.just("junk"), st.binary(max_size=24)),
)
# text mode (protocol v3): byte positions (the answer's end, around it, inside its last characters),
# answer text with multi-byte characters, drafted text with flagged byte ranges
answer_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["é", "😀", "a€", "Paris", " the sea", "日本語", "\u0301e", "x" * 200, "", "<|im_end|>"]),
)
byte_position = st.one_of(
    st.just(0), st.just(0), st.just(0), st.just(0), st.integers(-4, 3), st.sampled_from([2**31, True, 1.5, None])
)
text_start = st.tuples(  # a valid hard position at the answer's start: the fuzzed steps go on from an answer
    st.just("text_generate"), st.just(0), answer_text, st.just(""), st.just(None), st.booleans(), st.booleans()
)
text_actions = st.one_of(
    st.tuples(st.just("text_sync"), byte_position, mostly(answer_text, odd_text)),
    st.tuples(
        st.just("text_generate"),
        byte_position,
        answer_text,
        mostly(answer_text, odd_text),
        st.sampled_from([1, 4, 4, 16, None, None, 0, 513, True]),
        st.booleans(),
        st.booleans(),
    ),
    st.tuples(st.just("text_rollback"), st.one_of(st.integers(-4, 1), st.sampled_from([None, 2**40, 1.0, True]))),
    st.tuples(
        st.just("text_verify"),
        byte_position,
        answer_text,
        st.lists(st.integers(-1, 14), max_size=4),
        st.one_of(st.sampled_from([0, 1.0, 1000]), odd_number),
        st.booleans(),
    ),
    st.tuples(
        st.just("text_generate_hidden"),
        byte_position,
        st.lists(st.sampled_from([0.5, -1.0, np.nan, 7e4]), min_size=1, max_size=6),
    ),
)
valid_sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0, 0.0, 1e-3, 0.7, 10]),
        "top_p": st.sampled_from([1, 0.9, 1e-6]),
        "top_k": st.sampled_from([1, 40, 1 << 20]),
        "seed": st.sampled_from([0, 7, 2**32 - 1]),
    },
)
hostile_hello_field = st.one_of(
    st.tuples(st.just("version"), st.sampled_from([0, 2, -1, 2**40, 1.0, True, None])),
    st.tuples(st.sampled_from(["api_key", "edge_model", "tokenizer", "client"]), odd_text),
    st.tuples(st.just("edge_model"), st.sampled_from(["/../../fuzz", "..\\..\\fuzz", "a/b", "~root"])),
    st.tuples(st.just("text_mode"), st.sampled_from(["always", "auto", "never", "sometimes", "", 1, None])),
    st.tuples(
        st.just("messages"),
        st.one_of(
            st.lists(chat_message, min_size=1, max_size=3), st.sampled_from([[], None, "hi", [1], [{"role": "user"}]])
        ),
    ),
    st.tuples(st.just("sampling"), st.one_of(sampling_strategy, st.sampled_from([None, [], "greedy", 1]))),
)
# a valid hello two times in three (so the session's own checks are reached), else one or two hostile fields
hello_strategy = st.tuples(
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=24)}
                ),
                min_size=1,
                max_size=3,
            ),
            "sampling": valid_sampling,
            "text_mode": st.sampled_from(["never", "always", "always", "auto"]),  # always: a text session
        }
    ),
    st.one_of(st.just([]), st.just([]), st.lists(hostile_hello_field, min_size=1, max_size=2)),
)


class KeyedFuzzer:
    """One connection per example, with the valid key; checks every answer and tracks the history length."""

    def __init__(self, server: LocalCloudServer, info) -> None:
        self.server, self.info = server, info
        self.outcomes: dict[str, int] = {}
        self.frames = 0

    def count(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def hello_frame(self, h: tuple) -> str:
        good, hostile = h
        obj = {
            "type": "hello",
            "version": PROTOCOL_VERSION,
            "api_key": self.server.api_key,
            "edge_model": self.info.fingerprint,
            "tokenizer": self.info.tokenizer_fingerprint,
            "client": "fuzz",
            **good,
        }
        obj.update(dict(hostile))
        return dumps({k: v for k, v in obj.items() if v is not None})

    def frame(self, action: tuple, n: int) -> str | bytes:
        kind, *a = action

        def pos(d: object) -> object:
            return max(0, n + d) if isinstance(d, int) and not isinstance(d, bool) and abs(d) < 8 else d

        if kind == "sync":
            return dumps({"type": "sync", "position": pos(a[0]), "tokens": a[1]})
        if kind == "generate":
            obj = {
                "type": "generate",
                "request_id": self.frames,
                "position": pos(a[0]),
                "tokens": a[1],
                "lookahead": a[3],
            }
            if a[2] is not None:
                obj["max_tokens"] = a[2]
            return dumps(obj)
        if kind == "generate_hidden":
            with np.errstate(over="ignore"):
                hidden = np.array(a[1], dtype=np.float32).astype("<f2")  # 7e4 overflows float16: infinity
            head = dumps(
                {
                    "type": "generate",
                    "request_id": self.frames,
                    "position": pos(a[0]),
                    "tokens": [],
                    "proposed": 28,  # a proposed token: the flywheel records the row (--record-dir)
                    "hidden_dim": hidden.size,
                }
            ).encode()
            return struct.pack(">I", len(head)) + head + hidden.tobytes()
        if kind == "verify":
            return dumps(
                {
                    "type": "verify",
                    "request_id": self.frames,
                    "position": pos(a[0]),
                    "tokens": a[1],
                    "check": a[2],
                    "tolerance": a[3],
                }
            )
        if kind == "rollback":
            return dumps(
                {
                    "type": "rollback",
                    "position": pos(a[0])
                    if isinstance(a[0], int) and not isinstance(a[0], bool) and abs(a[0]) < 8
                    else a[0],
                }
            )
        if kind == "close":
            return dumps({"type": "close", "reason": a[0]})
        if kind == "hello_again":
            return encode(
                Hello(
                    version=PROTOCOL_VERSION,
                    api_key=self.server.api_key,
                    edge_model=self.info.fingerprint,
                    tokenizer=self.info.tokenizer_fingerprint,
                    messages=chat("hi"),
                )
            )  # type: ignore[return-value]
        if kind == "junk":
            return b"\xff\xff" + a[0]
        return self.text_frame(action, n)

    def text_frame(self, action: tuple, b: int) -> str | bytes:
        """A text-mode frame for a session whose shared answer holds `b` bytes."""
        kind, *a = action

        def at(d: object) -> object:
            return max(0, b + d) if isinstance(d, int) and not isinstance(d, bool) and abs(d) < 8 else d

        if kind == "text_sync":
            return dumps({"type": "text_sync", "byte_position": at(a[0]), "text": a[1]})
        if kind == "text_generate":
            obj = {
                "type": "text_generate",
                "request_id": self.frames,
                "byte_position": at(a[0]),
                "text": a[1],
                "proposed_text": a[2],
                "at_word": a[4],
                "lookahead": a[5],
            }
            if a[3] is not None:
                obj["max_tokens"] = a[3]
            return dumps(obj)
        if kind == "text_rollback":  # at or just before the end: often inside a multi-byte character
            return dumps({"type": "text_rollback", "byte_position": at(a[0])})
        if kind == "text_verify":
            return dumps(
                {
                    "type": "text_verify",
                    "request_id": self.frames,
                    "byte_position": at(a[0]),
                    "text": a[1],
                    "check": a[2],
                    "tolerance": a[3],
                    "eog": a[4],
                }
            )
        if kind == "text_generate_hidden":
            with np.errstate(over="ignore"):
                hidden = np.array(a[1], dtype=np.float32).astype("<f2")
            head = dumps(
                {
                    "type": "text_generate",
                    "request_id": self.frames,
                    "byte_position": at(a[0]),
                    "text": "",
                    "hidden_dim": hidden.size,
                }
            ).encode()
            return struct.pack(">I", len(head)) + head + hidden.tobytes()
        raise AssertionError(kind)

    def exchange(self, ws, frame: str | bytes) -> tuple[list, int | None]:
        """Send a frame and the probe; the replies before the probe's error, and the close code if the server closed."""
        self.frames += 1
        replies = []
        try:
            ws.send(frame)
            ws.send(PROBE)
            while True:
                msg = decode(ws.recv(timeout=30), 1 << 22)
                if isinstance(msg, Error) and msg.code == ErrorCode.UNKNOWN_TYPE and "fuzz-probe" in msg.message:
                    return replies, None
                self.check(msg, frame)
                replies.append(msg)
        except ConnectionClosed as exc:
            assert exc.rcvd is not None, f"dropped without a close frame after {str(frame)[:100]!r}"
            assert exc.rcvd.code in CLEAN_CLOSE, f"close {exc.rcvd.code} ({exc.rcvd.reason}) after {str(frame)[:100]!r}"
            self.count(f"close {exc.rcvd.code}")
            return replies, exc.rcvd.code
        except TimeoutError:
            raise AssertionError(f"no answer to {str(frame)[:120]!r}") from None

    def check(self, msg, frame) -> None:
        assert isinstance(msg, (Accept, Reject, Error, Tokens, Next, Verdict, TextReply, TextVerdict)), (
            f"{str(frame)[:100]!r} -> {msg}"
        )
        if isinstance(msg, (Error, Reject)):
            assert msg.code in CODES, (
                f"{str(frame)[:120]!r} -> {msg.code}: {msg.message if isinstance(msg, Error) else msg.reason}"
            )
            text = msg.message if isinstance(msg, Error) else msg.reason
            assert text and (msg.code != ErrorCode.BAD_FIELD or any(w in text for w in FIELD_WORDS)), text
            self.count(msg.code)
        else:
            self.count(msg.type)

    def run(self, hello: tuple, steps: list[tuple], text_steps: list[tuple] = ()) -> None:
        """One session: the hello, then `steps` (a token session) or `text_steps` (a text session)."""
        with connect(self.server.url, open_timeout=10, compression=None, max_size=None) as ws:
            replies, closed = self.exchange(ws, self.hello_frame(hello))
            accepts = [r for r in replies if isinstance(r, Accept)]
            if closed is not None or not accepts:
                assert closed is not None or any(isinstance(r, Reject) for r in replies) or replies, replies
                return
            text = accepts[0].mode == "text"
            self.count("text session" if text else "token session")
            n = 0 if text else accepts[0].n_prompt  # text: the answer's bytes; tokens: the history's length
            for action in text_steps if text else steps:
                replies, closed = self.exchange(ws, self.frame(action, n))
                if closed is not None:
                    return
                n = self.text_after(action, n, replies) if text else self.history_after(action, n, replies)

    @staticmethod
    def text_after(action: tuple, b: int, replies: list) -> int:
        """The shared answer's length in bytes after `action`, from its answers (errors name it in doubt)."""
        for r in replies:
            if isinstance(r, Error) and (m := re.search(r"holds (\d+) bytes", r.message)):
                return int(m.group(1))
        ends = [r.byte_position + len(r.text.encode()) for r in replies if isinstance(r, TextReply)]
        ends += [
            r.byte_position + r.accepted_bytes + len(r.text.encode()) for r in replies if isinstance(r, TextVerdict)
        ]
        if ends:
            return max(ends)
        kind, a = action[0], (action[1] if len(action) > 1 else None)
        small = isinstance(a, int) and not isinstance(a, bool) and abs(a) < 8
        if not replies and kind == "text_sync" and small and max(0, b + a) == b and isinstance(action[2], str):
            return b + len(action[2].encode())
        if not replies and kind == "text_rollback" and small:
            return max(0, b + a)
        return b

    @staticmethod
    def history_after(action: tuple, n: int, replies: list) -> int:
        """The session's history length after `action`, from its answers (the errors name it when in doubt)."""
        for r in replies:
            if isinstance(r, Error) and (m := re.search(r"holds (\d+) tokens", r.message)):
                return int(m.group(1))
        ends = [r.position + len(r.ids) for r in replies if isinstance(r, Tokens)]
        ends += [r.position + r.accepted + (r.token >= 0) for r in replies if isinstance(r, Verdict)]
        if ends:
            return max(ends)
        if not replies and action[0] == "sync":
            return n + len(action[2])
        if not replies and action[0] == "rollback" and isinstance(action[1], int) and not isinstance(action[1], bool):
            return max(0, n + action[1])
        return n


def run_keyed(fuzzer: KeyedFuzzer, examples: int) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(
        hello_strategy,
        st.lists(actions, min_size=1, max_size=6),
        st.tuples(text_start, st.lists(st.one_of(text_actions, text_actions, text_actions, actions), max_size=6)).map(
            lambda t: [t[0], *t[1]]
        ),
    )
    def one(hello: tuple, steps: list[tuple], text_steps: list[tuple]) -> None:
        fuzzer.run(hello, steps, text_steps)

    one()


@pytest.fixture(scope="module")
def prod_fuzz_server(tmp_path_factory):
    """Every production flag on: a key with quotas (sessions, tokens per minute, an abuse cap, a KV churn
    budget), the flywheel's record dir, the audit log, a small split KV budget (two sessions resident)."""
    root = tmp_path_factory.mktemp("prodfuzz")
    key = "fuzz-key-" + os.urandom(4).hex()
    (root / "keys.txt").write_text(
        f"{key} name=fuzz max_sessions=3 tokens_per_minute=3000 max_cloud_fraction=0.8 kv_churn_per_minute=4096\n"
    )
    args = [
        "--api-keys",
        str(root / "keys.txt"),
        "--record-dir",
        str(root / "records"),
        "--audit-dir",
        str(root / "audit"),
        "--kv-layout",
        "split",
        "--n-ctx",
        "1024",
        "--kv-slots",
        "2",
        "--max-sessions",
        "4",
        "--abuse-warmup-tokens",
        "8",
        "--max-message-bytes",
        str(MAX_BYTES),
        "--max-messages-per-s",
        "100000",
    ]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        server.api_key = key  # the key file's, with its quotas (the server's own plain key has none)
        server.root = root  # type: ignore[attr-defined]
        yield server


def test_a_client_with_a_valid_key_gets_named_errors_or_clean_closes_never_internal(prod_fuzz_server, cloud_info):
    """Token and text sessions, fuzzed, against every production flag: named errors or clean closes only,
    memory flat, no session leaked, nothing written outside the record and audit dirs."""
    fuzz_server = prod_fuzz_server
    proc = psutil.Process(fuzz_server.proc.pid)
    root: Path = fuzz_server.root
    outside_before = {p for p in root.parent.rglob("*") if p.is_file()}
    fuzzer = KeyedFuzzer(fuzz_server, cloud_info)
    t0 = time.monotonic()
    run_keyed(fuzzer, 25)  # warm-up: allocator pools, caches
    rss_before, frames_before = proc.memory_info().rss, fuzzer.frames
    run_keyed(fuzzer, 90)
    rss_after = proc.memory_info().rss
    print(f"keyed fuzz: {fuzzer.frames} frames in {time.monotonic() - t0:.0f} s: {fuzzer.outcomes}")
    assert fuzzer.frames - frames_before >= 150
    for reached in ("accept", "tokens", "bad_field", "out_of_order", "close 1000", "text session", "text_reply"):
        assert fuzzer.outcomes.get(reached), f"the fuzzer never reached {reached!r}: {fuzzer.outcomes}"
    assert rss_after - rss_before < 24 << 20, f"server memory grew by {(rss_after - rss_before) >> 20} MiB"
    deadline = time.monotonic() + 20
    import urllib.request

    while time.monotonic() < deadline:
        with urllib.request.urlopen(fuzz_server.http_url + "/healthz", timeout=5) as r:
            if json.loads(r.read())["sessions"] == 0:
                break
        time.sleep(0.1)
    else:
        raise AssertionError(
            "sessions leaked after the keyed fuzz run; server log:\n" + "\n".join(fuzz_server.log[-40:])
        )
    written = {p for p in root.parent.rglob("*") if p.is_file()} - outside_before
    allowed = (root / "records", root / "audit")
    assert all(any(d in p.parents for d in allowed) for p in written), [p for p in written if root not in p.parents]
