"""What the server promises under hostile input (issue 16; docs/security.md).

One session can never hurt another, and no client input reaches `internal`: bad values are
named errors at the protocol's edge, honest sessions' answers do not change while a hostile
one sends them, a slow reader is dropped at the send timeout with its KV freed, every close
carries a close frame with a valid reason, and logs stay parseable and free of secrets.
Against real `tokenrouter-cloud serve` processes on loopback, except where noted.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cloud_server.config import READY_LINE
from cloud_server.local import REPO_ROOT, LocalCloudServer
from models.registry import DEFAULT_CLOUD_MODEL
from shared.protocol import PROTOCOL_VERSION, Accept, Error, Generate, Hello, Reject, Sync, Tokens, decode, encode
from tests.conftest import chat
from tests.helpers import get, hello_json, metric, sessions, wait_for

QUESTIONS = ["what is the capital of france", "how do you say hello in japanese", "set a timer for ten minutes"]


def raw(frame: str, placeholder: str, literal: str) -> str:
    """A JSON literal json.dumps cannot write (1e400, NaN) in place of a placeholder string."""
    return frame.replace(json.dumps(placeholder), literal)


def closed_with_frame(ws, timeout: float = 10.0):
    """Read until the server closes; the close frame it sent (None: dropped without one)."""
    try:
        while True:
            ws.recv(timeout=timeout)
    except ConnectionClosed as exc:
        return exc.rcvd


@pytest.fixture(scope="module")
def server():
    """Split KV layout: each session attends over its own cells only, so a session's logits do not
    depend on which other sessions share the pool. In the unified layout they do (docs/server.md,
    batch invariance): there even two runs without any hostile client differ at near-ties, and
    the isolation test below could not tell a hostile session's effect from that noise."""
    args = [
        "--max-sessions",
        "8",
        "--n-ctx",
        "4096",
        "--kv-layout",
        "split",
        "--max-messages-per-s",
        "100000",
        "--max-message-bytes",
        "4096",
    ]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as srv:
        yield srv


# --------------------------------------------------------------------------- bad values: named errors, never internal


def bad_hellos(server: LocalCloudServer, info) -> list[tuple[str, str]]:
    """(frame, the field the refusal must name): the values the hostile-client probe found."""
    h = lambda **over: hello_json(info, server.api_key, **over)  # noqa: E731
    return [
        (h(api_key="\ud800"), "api_key"),
        (h(api_key="x" * 1000), "api_key"),
        (h(tokenizer="\ud800"), "tokenizer"),
        (h(tokenizer=info.tokenizer_fingerprint + "\n2026-01-01 00:00:00 ERROR forged line"), "tokenizer"),
        (h(messages=[{"role": "user", "content": "hello \udc80"}]), "messages[0].content"),
        (h(sampling={"seed": -1}), "sampling.seed"),
        (raw(h(sampling={"seed": "@"}), "@", "1e400"), "sampling.seed"),
        (raw(h(sampling={"top_k": "@"}), "@", "Infinity"), "sampling.top_k"),
        (raw(h(sampling={"temperature": "@"}), "@", "NaN"), "sampling.temperature"),
        (h(sampling={"temperature": 1e-308}), "sampling.temperature"),
    ]


def test_a_bad_hello_is_rejected_naming_the_field_with_a_close_frame(server, cloud_info):
    for frame, name in bad_hellos(server, cloud_info):
        with connect(server.url, open_timeout=10, compression=None) as ws:
            ws.send(frame)
            reply = decode(ws.recv(timeout=10))
            assert isinstance(reply, Reject) and reply.code == "bad_field" and f"field {name!r}" in reply.reason, (
                name,
                reply,
            )
            close = closed_with_frame(ws)
            assert close is not None and close.code == 1008, (name, close)
    assert wait_for(lambda: sessions(server) == 0)


def test_a_bad_close_reason_is_a_named_error_and_any_valid_one_is_echoed_in_a_valid_close_frame(server, cloud_info):
    with connect(server.url, open_timeout=10, compression=None) as ws:
        ws.send(hello_json(cloud_info, server.api_key))
        assert isinstance(decode(ws.recv(timeout=10)), Accept)
        ws.send(json.dumps({"type": "close", "reason": "bye \ud800"}))
        reply = decode(ws.recv(timeout=10))
        assert isinstance(reply, Error) and reply.code == "bad_field" and "'reason'" in reply.message
        ws.send(json.dumps({"type": "close", "reason": "é" * 200 + "\n"}))  # 401 bytes: over a close frame's 123
        close = closed_with_frame(ws)
        assert close is not None and close.code == 1000
        assert close.reason == "é" * 61 and len(close.reason.encode()) <= 123
    assert wait_for(lambda: sessions(server) == 0)


# --------------------------------------------------------------------------- cross-session isolation


def honest_answers(
    server: LocalCloudServer, info, n_tokens: int, hostile: threading.Event | None = None
) -> list[list[int]]:
    """Each question's greedy answer, written by the cloud token by token, all sessions at once."""
    out: list[list[int]] = [[] for _ in QUESTIONS]
    errors: list[BaseException] = []
    start = threading.Barrier(len(QUESTIONS))

    def run(i: int) -> None:
        try:
            with connect(server.url, open_timeout=10, compression=None) as ws:
                ws.send(hello_json(info, server.api_key, messages=chat(QUESTIONS[i])))
                acc = decode(ws.recv(timeout=30))
                assert isinstance(acc, Accept)
                start.wait(timeout=30)
                ws.send(encode(Generate(request_id=1, position=acc.n_prompt, tokens=[], max_tokens=n_tokens)))
                while True:
                    reply = decode(ws.recv(timeout=60))
                    assert isinstance(reply, Tokens), reply
                    out[i] += reply.ids
                    if reply.final or reply.eog:
                        break
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    if hostile is not None:
        hostile.set()
    assert not errors, errors
    return out


def hostile_client(server: LocalCloudServer, info, stop: threading.Event, seen: dict[str, int]) -> None:
    """Sends every bad value, over and over, until the honest sessions are done (at least once each)."""
    rounds = 0
    while not stop.is_set() or rounds == 0:
        for frame, _ in bad_hellos(server, info):
            with connect(server.url, open_timeout=10, compression=None) as ws:
                ws.send(frame)
                reply = decode(ws.recv(timeout=30))
                seen[reply.code] = seen.get(reply.code, 0) + 1
                close = closed_with_frame(ws)
                assert close is not None and close.code != 1011
        # a valid session at the edges of the ranges, then an empty history, surrogates, a NaN hidden state
        with connect(server.url, open_timeout=10, compression=None) as ws:
            ws.send(
                hello_json(
                    info,
                    server.api_key,
                    messages=chat("tell me a story"),
                    sampling={"temperature": 10, "top_k": 1 << 20, "top_p": 1e-6, "seed": 2**32 - 1},
                )
            )
            acc = decode(ws.recv(timeout=30))
            assert isinstance(acc, Accept), acc
            frames = [
                encode(Generate(request_id=1, position=acc.n_prompt, tokens=[], max_tokens=3)),
                json.dumps({"type": "rollback", "position": 0}),
                encode(Generate(request_id=2, position=0, tokens=[])),
                json.dumps({"type": "sync", "position": 0, "tokens": [1, 2, 3]}),
                json.dumps({"type": "generate", "request_id": 3, "position": 3, "tokens": [True]}),
                raw(
                    json.dumps({"type": "generate", "request_id": 4, "position": 3, "tokens": [], "max_tokens": "@"}),
                    "@",
                    "1e400",
                ),
                raw(
                    json.dumps(
                        {
                            "type": "verify",
                            "request_id": 5,
                            "position": 3,
                            "tokens": [5],
                            "check": [0],
                            "tolerance": "@",
                        }
                    ),
                    "@",
                    "NaN",
                ),
                json.dumps({"type": "close", "reason": "\udc80"}),
                json.dumps({"type": "generate", "request_id": 6, "position": 3, "tokens": [], "max_tokens": 2}),
            ]
            for frame in frames:
                ws.send(frame)
            replies = []
            while (
                len([r for r in replies if isinstance(r, Error) or (isinstance(r, Tokens) and r.final)])
                < len(frames) - 2
            ):
                replies.append(decode(ws.recv(timeout=30)))
            for r in replies:
                if isinstance(r, Error):
                    assert r.code != "internal", r
                    seen[r.code] = seen.get(r.code, 0) + 1
        rounds += 1


def test_honest_sessions_are_unchanged_token_for_token_by_a_hostile_one(server, cloud_info):
    alone = honest_answers(server, cloud_info, 24)
    assert all(len(a) >= 5 for a in alone), alone
    stop, seen, failures = threading.Event(), {}, []

    def hostile() -> None:
        try:
            hostile_client(server, cloud_info, stop, seen)
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    t = threading.Thread(target=hostile)
    t.start()
    time.sleep(0.3)  # the hostile client is at work before the honest sessions start
    with_hostile = honest_answers(server, cloud_info, 24, hostile=stop)
    t.join(timeout=120)
    assert not failures, failures
    assert seen.get("bad_field", 0) >= 10 and "internal" not in seen, seen
    assert with_hostile == alone
    assert wait_for(lambda: sessions(server) == 0)


# --------------------------------------------------------------------------- limits: busy, idle, errors, size


def test_a_full_server_rejects_a_new_hello_with_busy_and_keeps_serving(cloud_info):
    with LocalCloudServer(
        model=DEFAULT_CLOUD_MODEL, extra_args=["--max-sessions", "1", "--idle-timeout-s", "2", "--n-ctx", "1024"]
    ) as srv:
        with connect(srv.url, open_timeout=10, compression=None) as first:
            first.send(hello_json(cloud_info, srv.api_key))
            acc = decode(first.recv(timeout=10))
            assert isinstance(acc, Accept)
            with connect(srv.url, open_timeout=10, compression=None) as second:
                second.send(hello_json(cloud_info, srv.api_key))
                reply = decode(second.recv(timeout=10))
                assert isinstance(reply, Reject) and reply.code == "busy", reply
                close = closed_with_frame(second)
                assert close is not None and close.code == 1000
            first.send(encode(Generate(request_id=1, position=acc.n_prompt, tokens=[])))
            assert isinstance(decode(first.recv(timeout=10)), Tokens)

        # idle before hello: closed (1001) at the idle timeout
        with connect(srv.url, open_timeout=10, compression=None) as idle:
            t0 = time.monotonic()
            close = closed_with_frame(idle, timeout=10)
            assert close is not None and close.code == 1001 and "idle" in close.reason
            assert 1.5 < time.monotonic() - t0 < 6
        assert wait_for(lambda: sessions(srv) == 0)


def test_32_protocol_errors_close_the_connection_with_1008(server):
    with connect(server.url, open_timeout=10, compression=None) as ws:
        for _ in range(32):
            ws.send("not json")
        codes = []
        try:
            while True:
                codes.append(decode(ws.recv(timeout=10)).code)
        except ConnectionClosed as exc:
            assert exc.rcvd is not None and exc.rcvd.code == 1008 and "too many" in exc.rcvd.reason
        assert codes == ["bad_frame"] * 32


def test_an_oversized_frame_is_refused_and_a_far_larger_one_closes_with_1009(server):
    with connect(server.url, open_timeout=10, compression=None, max_size=None) as ws:
        ws.send(json.dumps({"type": "sync", "position": 0, "tokens": [], "pad": "x" * 5000}))  # the limit is 4096
        reply = decode(ws.recv(timeout=10))
        assert isinstance(reply, Error) and reply.code == "too_large"
        ws.send("x" * (4096 + 4096 + 1))  # over uvicorn's own limit: the WebSocket layer closes
        close = closed_with_frame(ws)
        assert close is not None and close.code == 1009


# --------------------------------------------------------------------------- slow reader


def test_a_slow_reader_is_closed_at_the_send_timeout_and_its_session_freed(cloud_info):
    """The device stops reading during a long generate: its session is gone (KV freed) within the send
    timeout + 1 s of the last token the server could write, with a close frame where the socket allows."""
    timeout_s = 2.0
    args = [
        "--send-timeout-s",
        str(timeout_s),
        "--socket-sndbuf",
        "4096",
        "--max-messages-per-s",
        "100000",
        "--n-ctx",
        "4096",
    ]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as srv:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        ws = connect(srv.url, sock=sock, max_queue=4, compression=None).__enter__()  # closed below
        ws.send(hello_json(cloud_info, srv.api_key, messages=chat("write a long poem about the sea")))
        acc = decode(ws.recv(timeout=10))
        n = 900  # one token each, so the answer's end cannot stop the stream before the buffers fill
        sender = threading.Thread(
            target=lambda: [
                ws.send(encode(Generate(request_id=i + 1, position=acc.n_prompt + i, tokens=[]))) for i in range(n)
            ],
            daemon=True,
        )
        sender.start()
        last, t_last, t_gone = -1.0, time.monotonic(), None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            served = metric(srv, "tokenrouter_hard_tokens_total ")
            now = time.monotonic()
            if served != last:
                last, t_last = served, now
            if sessions(srv) == 0:
                t_gone = now
                break
            time.sleep(0.05)
        assert t_gone is not None, "the slow reader's session was never closed"
        assert 50 < last < n, f"{last} tokens served: no stall (buffers larger than configured?)"
        assert t_gone - t_last <= timeout_s + 1.0 + 0.3, (
            f"closed {t_gone - t_last:.1f} s after the last token (send timeout {timeout_s} s)"
        )
        assert metric(srv, 'tokenrouter_rejections_total{reason="slow_reader"}') == 1
        close = closed_with_frame(ws, timeout=10)
        if close is not None:  # delivered when the client's buffers had room for it
            assert close.code == 1008 and "slow reader" in close.reason
        ws.close()
        # the server serves others meanwhile and after
        with connect(srv.url, open_timeout=10, compression=None) as other:
            other.send(hello_json(cloud_info, srv.api_key))
            acc2 = decode(other.recv(timeout=10))
            other.send(encode(Generate(request_id=1, position=acc2.n_prompt, tokens=[])))
            assert isinstance(decode(other.recv(timeout=10)), Tokens)


# --------------------------------------------------------------------------- logs


def test_json_logs_parse_line_by_line_and_hold_no_key_prompt_tokens_or_query_string(tmp_path, cloud_info):
    key, wrong = "k3y-" + os.urandom(6).hex(), "wr0ng-" + os.urandom(6).hex()
    prompt, query_secret = "zanzibar marker question " + os.urandom(4).hex(), "q-" + os.urandom(6).hex()
    tokens = [12345, 23456, 34567]
    (tmp_path / "keys.txt").write_text(key + "\n")
    cmd = [
        sys.executable,
        "-m",
        "cloud_server.cli",
        "serve",
        "--port",
        "0",
        "--threads",
        "1",
        "--model",
        DEFAULT_CLOUD_MODEL,
        "--api-keys",
        str(tmp_path / "keys.txt"),
        "--log-format",
        "json",
        "--log-level",
        "info",
        "--n-ctx",
        "1024",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    env.pop("TOKENROUTER_API_KEYS", None)
    err_path = tmp_path / "stderr.log"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not line.startswith(READY_LINE):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, err_path.read_text()[-2000:]
        port = int(dict(p.split("=", 1) for p in line.split()[1:])["port"])
        url = f"ws://127.0.0.1:{port}/v1/route"
        get(f"http://127.0.0.1:{port}/healthz?api_key={query_secret}")
        with connect(f"{url}?api_key={query_secret}", open_timeout=10, compression=None) as ws:
            ws.send(
                json.dumps(
                    {
                        "type": "hello",
                        "version": 1,
                        "api_key": key,
                        "edge_model": cloud_info.fingerprint,
                        "tokenizer": cloud_info.tokenizer_fingerprint,
                        "messages": chat(prompt),
                    }
                )
            )
            acc = decode(ws.recv(timeout=10))
            assert isinstance(acc, Accept)
            ws.send(encode(Sync(position=acc.n_prompt, tokens=tokens)))
            ws.send(encode(Generate(request_id=1, position=acc.n_prompt + 3, tokens=[], max_tokens=2)))
            while not decode(ws.recv(timeout=10)).final:
                pass
            ws.send(encode(Sync(position=0, tokens=tokens)))  # out of order: an error, logged at info
            assert decode(ws.recv(timeout=10)).code == "out_of_order"
        for over in (
            {"api_key": wrong},
            {"api_key": key + "\ud800"},
            {"tokenizer": "fp\n2026-01-01 ERROR forged"},
            {"sampling": {"temperature": 1e-308}},
        ):
            with connect(url, open_timeout=10, compression=None) as ws:
                ws.send(
                    json.dumps(
                        {
                            "type": "hello",
                            "version": 1,
                            "api_key": key,
                            "edge_model": "e",
                            "tokenizer": "t",
                            "messages": chat(prompt),
                            **over,
                        }
                    )
                )
                assert isinstance(decode(ws.recv(timeout=10)), Reject)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    text = err_path.read_text()
    records = [json.loads(ln) for ln in text.splitlines() if ln.strip()]  # every line is one JSON object
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    loggers = {r["logger"] for r in records}
    assert {"uvicorn.error", "uvicorn.access"} <= loggers, loggers  # uvicorn's own lines, in the same format
    assert any("WebSocket /v1/route" in r["msg"] for r in records) and any("GET /healthz" in r["msg"] for r in records)
    for secret in (key, wrong, query_secret, prompt, "zanzibar", "12345, 23456", "12345,23456", "forged"):
        assert secret not in text, f"{secret!r} in the log"


def test_text_logs_escape_client_values_and_drop_query_strings():
    """In-process: the text formatter keeps a client's newline on its line, tracebacks indented."""
    import io

    from cloud_server.logs import TracebackLimit, setup_logging

    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging("info", "text", stream=stream, tracebacks=TracebackLimit())  # not the process's own
        logging.getLogger("cloud_server.session").info("reject: %s", "fp\n2026-01-01 ERROR forged \ud800")
        logging.getLogger("uvicorn.access").info(
            '%s - "%s %s HTTP/%s" %d', "1.2.3.4:5", "GET", "/healthz?api_key=SECRET", "1.1", 200
        )
        try:
            raise ValueError("boom\nFAKE LINE")
        except ValueError:
            logging.getLogger("cloud_server.app").error("failed", exc_info=True)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.captureWarnings(False)
    lines = stream.getvalue().splitlines()
    assert len(lines[0].split(" INFO ")) == 2 and "forged \\ud800" in lines[0] and "\\n2026" in lines[0]
    assert "SECRET" not in stream.getvalue() and '"GET /healthz HTTP/1.1" 200' in lines[1]
    assert all(ln.startswith("    ") for ln in lines[3:]) and any("FAKE LINE" in ln for ln in lines[3:])


# --------------------------------------------------------------------------- transport units


def test_close_reasons_are_valid_utf8_of_at_most_123_bytes():
    from cloud_server.app import close_reason

    for text in ("bye", "\ud800", "é" * 200, "a" * 500, "x\udc80y" * 50, "€" * 41 + "é"):
        out = close_reason(text)
        data = out.encode("utf-8")  # never raises: no surrogates left
        assert len(data) <= 123 and (out == text or len(text.encode("utf-8", "replace")) > 123 or "?" in out)


def test_failures_log_one_traceback_per_interval_and_count_the_rest(caplog):
    from cloud_server.app import _FailureLog

    failures = _FailureLog(every_s=0.3)
    with caplog.at_level(logging.DEBUG, logger="cloud_server.app"):
        for _ in range(50):
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                failures.report("session s1")
        time.sleep(0.35)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            failures.report("session s2")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and all(r.exc_info for r in errors)
    assert "49 more failures" in errors[1].getMessage()


def test_an_unexpected_exception_closes_only_its_session_with_1011_and_logs_once(monkeypatch, caplog, cloud_info):
    """In-process (a failure cannot be provoked from outside any more): every connection whose
    session raises gets `internal` and close 1011; the server logs one traceback, not one each."""
    from starlette.testclient import TestClient

    import cloud_server.app as app_module
    from cloud_server.config import ServerConfig

    class Failing(app_module.Connection):
        async def on_message(self, msg):
            if isinstance(msg, Generate):
                raise RuntimeError("injected failure")
            return await super().on_message(msg)

    monkeypatch.setattr(app_module, "Connection", Failing)
    app = app_module.create_app(
        ServerConfig(model=DEFAULT_CLOUD_MODEL, insecure=True, n_ctx=1024, max_sessions=4, threads=1)
    )
    hello = Hello(
        version=PROTOCOL_VERSION,
        api_key="any",
        edge_model=cloud_info.fingerprint,
        tokenizer=cloud_info.tokenizer_fingerprint,
        messages=chat("hi"),
    )
    with caplog.at_level(logging.INFO, logger="cloud_server.app"), TestClient(app) as client:
        for _ in range(5):
            with client.websocket_connect("/v1/route") as ws:
                ws.send_text(encode(hello))
                acc = decode(ws.receive_text())
                assert isinstance(acc, Accept)
                ws.send_text(encode(Generate(request_id=1, position=acc.n_prompt, tokens=[])))
                reply = decode(ws.receive_text())
                assert isinstance(reply, Error) and reply.code == "internal"
                close = ws.receive()
                assert close["type"] == "websocket.close" and close["code"] == 1011
        assert client.get("/healthz").json()["sessions"] == 0
    tracebacks = [r for r in caplog.records if r.name == "cloud_server.app" and r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
