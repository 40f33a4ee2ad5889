"""The production server over a real WebSocket on loopback: keys, quotas, abuse, limits, metrics, audit, faults.

Every test talks to a real `tokenrouter-cloud serve` child process running the
bundled SmolLM2 model.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cloud_server.local import LocalCloudServer
from models.registry import DEFAULT_CLOUD_MODEL
from shared import routing_log
from shared.llama_backend import LlamaModel
from shared.protocol import (
    Accept,
    Close,
    Error,
    Generate,
    Reject,
    Rollback,
    Sync,
    Tokens,
    decode,
    encode,
)
from tests.conftest import chat
from tests.helpers import get, hello, make_generator, metric, sessions, wait_for

ALICE, BOB = "alice-secret-key", "bob-secret-key"


class Client:
    """A bare protocol client: frames in, frames out, no routing logic."""

    def __init__(self, server: LocalCloudServer, **kw) -> None:
        self.ws = connect(
            server.url, open_timeout=10, compression=None, **kw
        ).__enter__()  # closed by close() or the test

    def send(self, msg) -> None:
        self.ws.send(encode(msg))

    def recv(self, timeout: float = 15.0):
        return decode(self.ws.recv(timeout=timeout))

    def open(self, key: str, info, question: str = "say hi"):
        self.send(hello(info, key, question))
        return self.recv()

    def close(self) -> None:
        self.ws.close()


@pytest.fixture(scope="module")
def audit_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("audit")


@pytest.fixture(scope="module")
def prod_server(tmp_path_factory, audit_dir):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(
        "# name and quotas per key; the file may hold sha256: digests instead of keys\n"
        f"{ALICE} name=alice max_sessions=1 tokens_per_minute=5\n"
        f"{BOB} name=bob max_cloud_fraction=0.25\n"
    )
    args = [
        "--api-keys",
        str(keys),
        "--audit-dir",
        str(audit_dir),
        "--idle-timeout-s",
        "3",
        "--max-messages-per-s",
        "40",
        "--abuse-warmup-tokens",
        "4",
        "--n-ctx",
        "4096",
    ]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        yield server


def test_unknown_key_is_refused_with_a_reason(prod_server, cloud_info):
    c = Client(prod_server)
    reply = c.open("not-a-key", cloud_info)
    assert isinstance(reply, Reject) and reply.code == "unauthorized" and "API key" in reply.reason
    with pytest.raises(ConnectionClosed):
        c.recv(timeout=5)


def test_key_session_quota_refuses_a_second_session_then_frees_it(prod_server, cloud_info):
    a = Client(prod_server)
    assert isinstance(a.open(ALICE, cloud_info), Accept)
    b = Client(prod_server)
    reply = b.open(ALICE, cloud_info)
    assert isinstance(reply, Reject) and reply.code == "busy"
    assert "alice" in reply.reason and "1 open sessions" in reply.reason
    a.send(Close(reason="done"))
    a.close()
    assert wait_for(lambda: sessions(prod_server) == 0)
    c = Client(prod_server)
    assert isinstance(c.open(ALICE, cloud_info), Accept)
    c.close()
    assert wait_for(lambda: sessions(prod_server) == 0)


def test_tokens_per_minute_quota_names_the_wait(prod_server, cloud_info):
    c = Client(prod_server)
    acc = c.open(ALICE, cloud_info)
    assert isinstance(acc, Accept)
    pos = acc.n_prompt
    got = []
    for rid in range(1, 8):
        c.send(Generate(request_id=rid, position=pos, tokens=[]))
        reply = c.recv()
        if isinstance(reply, Error):
            assert reply.code == "busy" and "5 cloud tokens per minute" in reply.message and "retry in" in reply.message
            assert reply.request_id == rid
            break
        assert isinstance(reply, Tokens)
        got.append(reply.ids[0])
        pos += 1
    assert len(got) == 5, "exactly the quota's five tokens must be served"
    c.close()
    assert wait_for(lambda: sessions(prod_server) == 0)


def audit_index(audit_dir: Path) -> list[dict]:
    return [json.loads(line) for f in audit_dir.glob("*/index.jsonl") for line in f.read_text().splitlines()]


def test_abuse_check_throttles_and_flags_a_session_and_its_audit_log_is_kept(prod_server, cloud_info, audit_dir):
    """The module's server and audit dir are shared: the test counts its own flag and reads its own entry (the
    entries and flags there before it are left out), whatever ran before it."""
    assert wait_for(lambda: sessions(prod_server) == 0)
    flags0 = metric(prod_server, "tokenrouter_abuse_flags_total ")
    entries0 = len(audit_index(audit_dir))
    c = Client(prod_server)
    acc = c.open(BOB, cloud_info, "tell me about the moon")
    pos, rid, refused, written = acc.n_prompt, 0, None, []
    for _ in range(10):  # only hard tokens, no device tokens: 100% to the cloud, the cap is 25%
        rid += 1
        c.send(Generate(request_id=rid, position=pos, tokens=[]))
        reply = c.recv()
        if isinstance(reply, Error):
            refused = reply
            break
        written.append(reply.ids[0])
        pos += 1
    assert (
        refused is not None and refused.code == "busy" and "throttled" in refused.message and "25%" in refused.message
    )
    # the device writes tokens itself: the fraction falls under the cap and hard tokens are served again
    device = [504, 3575, 282, 4649, 314, 7042, 30, 504, 3575, 282, 4649, 314, 7042, 30, 504, 3575] * 2
    c.send(Sync(position=pos, tokens=device))
    pos += len(device)
    rid += 1
    c.send(Generate(request_id=rid, position=pos, tokens=[]))
    assert isinstance(c.recv(), Tokens)
    c.send(Close())
    c.close()
    assert wait_for(lambda: sessions(prod_server) == 0)
    assert metric(prod_server, "tokenrouter_abuse_flags_total ") - flags0 == 1  # once per session
    # written after the connection closed; an earlier test's last entry may still land after `entries0`
    mine = wait_for(lambda: [e for e in audit_index(audit_dir)[entries0:] if e["key"] == "bob" and e["flagged"]], 5)
    assert len(mine) == 1, audit_index(audit_dir)[entries0:]
    entry = mine[0]
    logged = list(
        routing_log.read(
            (audit_dir / next(audit_dir.glob("*/" + entry["file"])).parent.name / entry["file"]).read_bytes()
        )
    )
    writers = [t.writer for t in logged]
    assert writers == ["cloud"] * len(written) + ["edge"] * len(device) + ["cloud"]
    assert logged[0].position == acc.n_prompt and entry["cloud_tokens"] == len(written) + 1


def test_message_rate_limit_answers_busy(prod_server, cloud_info):
    c = Client(prod_server)
    acc = c.open(BOB, cloud_info)
    for _ in range(150):  # 40/s sustained, bursts of 80: a flood of no-op rollbacks trips it
        c.send(Rollback(position=acc.n_prompt))
    codes = []
    try:
        while True:
            reply = c.recv(timeout=3)
            codes.append((reply.code, reply.message))
    except (TimeoutError, ConnectionClosed):
        pass
    assert codes and all(code == "busy" and "rate limit" in msg for code, msg in codes)
    c.close()


def test_idle_connection_is_closed(prod_server, cloud_info):
    c = Client(prod_server)
    assert isinstance(c.open(BOB, cloud_info), Accept)
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed) as info:
        c.recv(timeout=10)
    assert 2.5 < time.monotonic() - t0 < 8
    assert info.value.rcvd is not None and info.value.rcvd.code == 1001 and "idle" in info.value.rcvd.reason
    assert wait_for(lambda: sessions(prod_server) == 0)


def test_device_disconnecting_mid_request_leaves_no_session(prod_server, cloud_info):
    for _ in range(3):
        c = Client(prod_server)
        acc = c.open(BOB, cloud_info, "write a long poem about the sea")
        c.send(Sync(position=acc.n_prompt, tokens=[504] * 40))  # keeps bob's cloud fraction low
        c.send(Generate(request_id=1, position=acc.n_prompt + 40, tokens=[], max_tokens=200))
        c.recv()  # the first token: the request is running
        c.ws.socket.close()  # vanish without a close frame
    assert wait_for(lambda: sessions(prod_server) == 0, timeout=20)


def test_metrics_expose_sessions_tokens_batches_kv_and_rejections(prod_server):
    text = get(prod_server.http_url + "/metrics")
    for name in [
        "tokenrouter_sessions ",
        "tokenrouter_sessions_resident ",
        "tokenrouter_hard_tokens_total ",
        "tokenrouter_device_tokens_total ",
        "tokenrouter_batch_items_bucket",
        "tokenrouter_batch_tokens_bucket",
        "tokenrouter_queue_wait_seconds_bucket",
        "tokenrouter_decode_seconds_bucket",
        "tokenrouter_hard_token_seconds_bucket",
        "tokenrouter_kv_bytes_used ",
        "tokenrouter_kv_budget_bytes ",
        "tokenrouter_evictions_total ",
        'tokenrouter_restores_total{how="recomputed"}',
        'tokenrouter_rejections_total{reason="unauthorized"}',
        'tokenrouter_rejections_total{reason="key_sessions"}',
        'tokenrouter_protocol_errors_total{code="busy"}',
    ]:
        assert name in text, f"{name!r} missing from /metrics"
    hard = float(
        next(line.split()[1] for line in text.splitlines() if line.startswith("tokenrouter_hard_tokens_total "))
    )
    assert hard >= 5
    budget = float(
        next(line.split()[1] for line in text.splitlines() if line.startswith("tokenrouter_kv_budget_bytes "))
    )
    assert budget == 4096 * 23040, "SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K,V x f16 = 23040 bytes per cell"


# --------------------------------------------------------------------------- backpressure


def test_slow_reader_gets_backpressure_not_unbounded_buffering(cloud_info):
    """A device that stops reading stalls its own generation once the socket buffers fill; nothing is lost.

    The server's listening socket gets a small send buffer (`--socket-sndbuf`, inherited by
    accepted sockets) and the client a small receive buffer, so the stall shows within a
    few hundred tokens instead of the several MB Linux would otherwise buffer on loopback.
    """
    import socket

    args = ["--socket-sndbuf", "4096", "--max-messages-per-s", "100000", "--n-ctx", "4096", "--max-sessions", "4"]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        c = Client(server, sock=sock, max_queue=4)
        acc = c.open(server.api_key, cloud_info)
        n = 650  # the stall comes after ~510 tokens (uvicorn's 64 KiB write buffer + the socket buffers)
        sender = threading.Thread(
            target=lambda: [c.send(Generate(request_id=i + 1, position=acc.n_prompt + i, tokens=[])) for i in range(n)],
            daemon=True,
        )
        sender.start()

        def served() -> float:
            line = next(
                ln
                for ln in get(server.http_url + "/metrics").splitlines()
                if ln.startswith("tokenrouter_hard_tokens_total ")
            )
            return float(line.split()[1])

        assert wait_for(lambda: served() > 50, timeout=30)
        # stalled: the count stops growing well before all requests are served
        assert wait_for(lambda: _stable(served), timeout=60)
        stalled_at = served()
        assert stalled_at < n, "the server wrote everything: no backpressure (or buffers far larger than configured)"
        # another device is served meanwhile: one slow reader blocks only itself
        other = Client(server)
        acc2 = other.open(server.api_key, cloud_info)
        other.send(Generate(request_id=1, position=acc2.n_prompt, tokens=[]))
        assert isinstance(other.recv(timeout=20), Tokens)
        other.close()
        # now read everything: every request answered once, in order, no gaps
        positions = []
        while len(positions) < n:
            reply = c.recv(timeout=30)
            assert isinstance(reply, Tokens) and reply.request_id == len(positions) + 1
            positions.append(reply.position)
        assert positions == list(range(acc.n_prompt, acc.n_prompt + n))
        c.close()


def _stable(read, window_s: float = 1.0) -> bool:
    a = read()
    time.sleep(window_s)
    return read() == a


# --------------------------------------------------------------------------- restart mid-answer


def test_server_restart_mid_answer_rebuilds_the_session_and_the_answer_is_unchanged(cloud_info):
    """Same model on both sides, greedy, every token hard: kill the server after five tokens,
    start a new one on the same port; the device reconnects, rebuilds the session from its
    token history (hello + rollback(0) + sync), and the answer equals an undisturbed run."""
    edge = LlamaModel(cloud_info)
    server = LocalCloudServer(model=DEFAULT_CLOUD_MODEL).start()
    holder = {"server": server}
    q = chat("tell me about the moon")
    try:
        gen = make_generator(edge, server, threshold=0.0, timeout_s=5.0)
        gen.cloud.reconnects = 1
        undisturbed = gen.generate(q, max_tokens=20)
        gen.close()
        assert not undisturbed.degraded and undisturbed.n_cloud_tokens == undisturbed.n_tokens

        gen = make_generator(edge, server, threshold=0.0, timeout_s=5.0)
        gen.cloud.reconnects = 1
        restarted = threading.Event()

        def restart_after_five(ev) -> None:
            if ev.index == 4 and not restarted.is_set():
                restarted.set()
                old = holder["server"]
                old.kill()
                holder["server"] = LocalCloudServer(
                    model=DEFAULT_CLOUD_MODEL, api_key=old.api_key, port=old.port
                ).start()

        disturbed = gen.generate(q, max_tokens=20, on_token=restart_after_five)
        gen.close()
        assert restarted.is_set()
        assert not disturbed.degraded, gen.last_cloud_error
        assert disturbed.routes == ["cloud"] * disturbed.n_tokens, "after the restart the cloud must write again"
        assert disturbed.tokens == undisturbed.tokens
        assert disturbed.text == undisturbed.text
    finally:
        holder["server"].stop()
        edge.close()
