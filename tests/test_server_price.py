"""Issue 47: every request priced before any work, over a real server on loopback.

A frame whose sizes already say it will be refused (a text check of thousands of ranges or of more
text than a check may judge, a `proposed_text` of a megabyte, a hello of a megabyte or of thousands
of messages) is refused by name at once, without tokenizing or planning anything; and what a key
makes the engine do (the prefill of its hellos, resumes included) is charged to that key's
engine-time budget, so a loop of hellos slows its own sessions only. Each attack runs beside an
honest device (the product's generator, as `tokenrouter-edge ask --seed 7` runs it) whose answer
must be token for token the one it gives alone, not degraded, and not much slower.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

import psutil
import pytest
from websockets.sync.client import ClientConnection, connect

from cloud_server.local import LocalCloudServer
from models.registry import DEFAULT_CLOUD_MODEL
from shared.protocol import Accept, Error, Reject, TextReply, decode
from tests.helpers import hello_json, metric, sessions, wait_for
from tests.test_server_abuse import (  # noqa: F401 - `edge` is a fixture
    HONEST,
    HOSTILE,
    QUESTION,
    edge,
    honest_answer,
    no_sessions_left,
    reply,
)

N_CTX, KV_SLOTS = 1024, 2  # split layout: 512 KV cells per session (the layout)
HOARDER = "hoarder-" + os.urandom(4).hex()  # a key with an engine-time budget (item 7's hellos)
ENGINE_S_PER_MINUTE = 6.0  # its budget: a tenth of the engine, repaid at 0.1 s a second
REFUSED_WITHIN_S = 0.2  # a frame refused by its sizes is answered within this (the issue: 5.7 s, 15.4 s, 0.9 s)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The issue's setup: an honest key, a hostile one capped at 4 sessions, and one with an engine-time budget."""
    keys = tmp_path_factory.mktemp("price") / "keys.txt"
    keys.write_text(
        f"{HONEST} name=honest\n{HOSTILE} name=hostile max_sessions=4\n"
        f"{HOARDER} name=hoarder max_sessions=4 engine_seconds_per_minute={ENGINE_S_PER_MINUTE}\n"
    )
    args = ["--api-keys", str(keys), "--kv-layout", "split", "--n-ctx", str(N_CTX), "--kv-slots", str(KV_SLOTS)]
    args += ["--max-sessions", "8", "--max-messages-per-s", "100000", "--log-level", "info"]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as s:
        yield s


def text_session(server: LocalCloudServer, info) -> ClientConnection:
    """A hostile text-mode session whose prompt is prefilled (a first span was written), so what is timed
    next is the frame alone."""
    ws = connect(server.url, open_timeout=10, compression=None, max_size=None).__enter__()  # closed by the caller
    ws.send(hello_json(info, HOSTILE, QUESTION, text_mode="always"))
    acc = decode(ws.recv(timeout=30))
    assert isinstance(acc, Accept) and acc.mode == "text", acc
    ws.send(json.dumps({"type": "text_generate", "request_id": 1, "byte_position": 0, "text": ""}))
    first = reply(ws, 60)
    assert isinstance(first, TextReply), first
    ws.send(json.dumps({"type": "text_rollback", "byte_position": 0}))
    return ws


def timed(ws: ClientConnection, frame: str):
    t0 = time.monotonic()
    ws.send(frame)
    out = reply(ws, 60)
    return out, time.monotonic() - t0


def verify_frame(text: str, check: list[int]) -> str:
    return json.dumps(
        {
            "type": "text_verify",
            "request_id": 2,
            "byte_position": 0,
            "text": text,
            "check": check,
            "tolerance": 0,
            "max_tokens": 4,
        }
    )


# the frames: 19,000 words flagged in 4,096 one-byte ranges; 100 KB; a megabyte as one token's text
RANGES = [0] + [b for i in range(1, 4096) for b in (i, i)] + [4096]
MANY_RANGES = verify_frame("a " * 19000, RANGES)
LONG_CHECK = verify_frame("a " * 50000, [0, 1])
LONG_PROPOSAL = json.dumps(
    {
        "type": "text_generate",
        "request_id": 3,
        "byte_position": 0,
        "text": "",
        "proposed_text": "word " * 200000,
        "max_tokens": 1,
    }
)


class Flood(threading.Thread):
    """Sends one hostile frame again and again on text sessions (a new one when the errors close it)."""

    def __init__(self, server: LocalCloudServer, info, frame: str, code: str, per_s: float = 0.0) -> None:
        """`per_s`: frames a second at most (0: as fast as the replies come)."""
        super().__init__(daemon=True)
        self.server, self.info, self.frame, self.code, self.per_s = server, info, frame, code, per_s
        self.stop = threading.Event()
        self.sent = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                ws = text_session(self.server, self.info)
                try:
                    for _ in range(30):  # under the 32 protocol errors that close a connection
                        ws.send(self.frame)
                        out = reply(ws, 60)
                        assert isinstance(out, Error) and out.code == self.code, out
                        self.sent += 1
                        if self.per_s:
                            time.sleep(1.0 / self.per_s)
                        if self.stop.is_set():
                            break
                finally:
                    ws.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc


def honest_beside(server: LocalCloudServer, edge, attack: Callable[[], list[threading.Thread]]) -> str:  # noqa: F811
    """The honest device alone (twice), then three times beside the attack `attack()` starts: unchanged token
    for token, not degraded, no cloud timeouts, the best of three within 1.5x its time alone plus 0.5 s
    (this shared 2-core machine's noise, as in tests/test_server_abuse.py). Returns the timings, printed."""
    alone = [honest_answer(server, edge) for _ in range(2)]
    ref, t_alone = alone[0][0], min(t for _, t in alone)
    assert not ref.degraded and ref.n_cloud_tokens > 0, ref.to_json()
    threads = attack()
    try:
        time.sleep(1.5)  # the attack is under way before the honest device asks
        beside = [honest_answer(server, edge) for _ in range(3)]
    finally:
        for t in threads:
            t.stop.set()  # type: ignore[attr-defined]
        for t in threads:
            t.join(timeout=120)
    for t in threads:
        assert t.failure is None, repr(t.failure)  # type: ignore[attr-defined]
    times = [round(t, 2) for _, t in beside]
    for answer, _ in beside:
        assert not answer.degraded and answer.cloud_timeouts == 0, answer.to_json()
        assert answer.tokens == ref.tokens, (ref.text, answer.text)
    assert min(t for _, t in beside) <= 1.5 * t_alone + 0.5, (t_alone, times)
    return f"alone {t_alone:.2f} s, beside {times}"


# --------------------------------------------------------------------------- 1. a text check priced by its sizes


def test_a_text_check_too_big_to_judge_is_refused_before_it_is_planned(server, cloud_info, edge):  # noqa: F811
    """Issue 47 #1: 19,000 words in 4,096 flagged ranges were tokenized and planned on the engine thread
    (5.7 s; 100 KB: 15.4 s) before `bad_field`. Now a check that flags more ranges than a check may judge
    tokens, or holds more text than that many of the longest token spell, is refused from its sizes."""
    ws = text_session(server, cloud_info)
    try:
        for frame, field in ((MANY_RANGES, "check"), (LONG_CHECK, "text")):
            out, took = timed(ws, frame)
            assert isinstance(out, Error) and out.code == "bad_field" and field in out.message, out
            assert "at most 511" in out.message and took < REFUSED_WITHIN_S, (out, took)
        # text within the length bound but of too many tokens: planned off the engine thread, stopped early
        out, took = timed(ws, verify_frame("a " * 19000, [0, 1]))
        assert isinstance(out, Error) and out.code == "bad_field" and "at most 511" in out.message, out
        assert took < 1.0, took
        ws.send(verify_frame("Paris.", [0, 6]))  # the session goes on: a check that fits is judged
        assert reply(ws, 60).type == "text_verdict"
    finally:
        ws.close()
    print(honest_beside(server, edge, lambda: [start(Flood(server, cloud_info, MANY_RANGES, "bad_field"))]))
    no_sessions_left(server)


def start(t: threading.Thread) -> threading.Thread:
    t.start()
    return t


# --------------------------------------------------------------------------- 6. one token's text, priced by its length


def test_a_proposed_text_longer_than_a_token_is_refused_before_it_is_read(server, cloud_info, edge):  # noqa: F811
    """Issue 47 #6: a 1 MB `proposed_text` was tokenized on the event loop (0.9 s a frame). It is the text of
    one device token: longer than 4 of the cloud's longest tokens, it is `bad_field` naming it, unread. The
    honest device runs beside two connections sending 5 such frames a second each (the issue's 30 frames
    took 0.9 s each; faster, megabyte frames price the frame size and message rate, not this field)."""
    ws = text_session(server, cloud_info)
    try:
        out, took = timed(ws, LONG_PROPOSAL)
        assert isinstance(out, Error) and out.code == "bad_field" and "proposed_text" in out.message, out
        assert took < REFUSED_WITHIN_S, took
        ws.send(
            json.dumps(
                {"type": "text_generate", "request_id": 4, "byte_position": 0, "text": "", "proposed_text": " The"}
            )
        )
        assert isinstance(reply(ws, 60), TextReply)  # a token's text is read as before
    finally:
        ws.close()
    print(
        honest_beside(
            server, edge, lambda: [start(Flood(server, cloud_info, LONG_PROPOSAL, "bad_field", 5)) for _ in range(2)]
        )
    )
    no_sessions_left(server)


# --------------------------------------------------------------------------- 7. a hello priced, its prefill charged


def hello_frame(info, **over: object) -> str:
    return hello_json(info, HOARDER, QUESTION, **over)


def refused_hello(server: LocalCloudServer, frame: str) -> tuple[Reject, float]:
    with connect(server.url, open_timeout=10, compression=None, max_size=None) as ws:
        t0 = time.monotonic()
        ws.send(frame)
        out = decode(ws.recv(timeout=30))
        return out, time.monotonic() - t0  # type: ignore[return-value]


class HelloLoop(threading.Thread):
    """hello (resume: true), accept, close, as fast as the key's 4 sessions allow."""

    def __init__(self, server: LocalCloudServer, info) -> None:
        super().__init__(daemon=True)
        self.frame = hello_frame(info, resume=True)
        self.server = server
        self.stop = threading.Event()
        self.accepted = self.busy = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                with connect(self.server.url, open_timeout=10, compression=None) as ws:
                    ws.send(self.frame)
                    out = decode(ws.recv(timeout=60))  # then closed at once
                if isinstance(out, Accept):
                    self.accepted += 1
                else:
                    assert isinstance(out, Reject) and out.code == "busy", out
                    self.busy += 1
                    time.sleep(0.1)  # the key's 4 sessions are taken: soon one is closed
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc


def test_a_hello_is_priced_before_it_is_read_and_its_prefill_charged_to_its_key(server, cloud_info, edge):  # noqa: F811
    """Issue 47 #7: hellos of 1 MB of text or 8,190 one-letter messages were rendered and tokenized (honest
    3.9-4.7x slower, RSS +100 MiB kept), and a loop of hello (resume), accept, close took 29 s of the engine's
    31 s. A prompt over `--max-prompt-bytes` or `--max-prompt-messages` is `reject bad_field` naming
    `messages` at once; the prefill of every hello is charged to its key, and a key past its engine-time
    budget waits (its own sessions slow down, named in the log)."""
    proc = psutil.Process(server.proc.pid)
    rss = proc.memory_info().rss
    for frame in (
        hello_frame(cloud_info, messages=[{"role": "user", "content": "a" * 1_000_000}]),
        hello_frame(cloud_info, messages=[{"role": "user", "content": "a"}] * 8190),
    ):
        for _ in range(10):
            out, took = refused_hello(server, frame)
            assert isinstance(out, Reject) and out.code == "bad_field" and "'messages'" in out.reason, out
            assert took < REFUSED_WITHIN_S, took
    assert proc.memory_info().rss - rss < 16 << 20

    def loop() -> list[threading.Thread]:
        threads = [start(HelloLoop(server, cloud_info)) for _ in range(4)]
        spent = wait_for(lambda: any("key hoarder used its" in ln for ln in server.log), 60)  # this test's key
        assert spent, "the hoarder key never went past its engine-time budget"
        return threads

    print(honest_beside(server, edge, loop))
    # its last sessions wait for their prefill until the refill paid the key's debt (0.1 s a second)
    assert wait_for(lambda: sessions(server) == 0, 90), "sessions leaked"


# --------------------------------------------------------------------------- sessions_resumed_total


def test_sessions_resumed_counts_only_hellos_that_resumed_a_session(server, cloud_info):
    """A resume hello closed at once resumed nothing: the counter stays; one whose device then asks something
    of the session is counted once."""
    name = "tokenrouter_sessions_resumed_total "
    before = metric(server, name)
    with connect(server.url, open_timeout=10, compression=None) as ws:
        ws.send(hello_json(cloud_info, HONEST, QUESTION, resume=True))
        assert isinstance(decode(ws.recv(timeout=30)), Accept)
    no_sessions_left(server)
    assert metric(server, name) == before
    with connect(server.url, open_timeout=10, compression=None) as ws:
        ws.send(hello_json(cloud_info, HONEST, QUESTION, resume=True))
        acc = decode(ws.recv(timeout=30))
        assert isinstance(acc, Accept)
        for i in range(2):
            ws.send(json.dumps({"type": "generate", "request_id": i + 1, "position": acc.n_prompt + i, "tokens": []}))
            assert decode(ws.recv(timeout=60)).type == "tokens"
    no_sessions_left(server)
    assert metric(server, name) == before + 1
