"""The cloud server over a real WebSocket on loopback: auth, bad input, failover."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

import pytest
from websockets.sync.client import connect

from cloud_server.local import LocalCloudServer
from edge_client.cloud_link import CloudLink, CloudRejected
from models.registry import DEFAULT_CLOUD_MODEL
from shared.llama_backend import LlamaModel
from shared.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    Generate,
    Next,
    SamplingParams,
    Sync,
    decode,
    encode,
)
from tests.conftest import chat
from tests.helpers import agree_up_to_a_tie, hello, make_generator, reference_greedy


def exchange(ws, frame) -> object:
    ws.send(frame)
    return decode(ws.recv(timeout=10), 1 << 22)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_health_and_info(cloud_server, cloud_info):
    assert get_json(cloud_server.http_url + "/healthz")["status"] == "ok"
    info = get_json(cloud_server.http_url + "/v1/info")
    assert info["model_fingerprint"] == cloud_info.fingerprint
    assert info["tokenizer_fingerprint"] == cloud_info.tokenizer_fingerprint
    assert info["protocol_version"] == PROTOCOL_VERSION and info["auth_required"] is True


@pytest.mark.parametrize("key", ["", "wrong-key"])
def test_missing_or_wrong_key_is_rejected(cloud_server, edge_info, key):
    with connect(cloud_server.url) as ws:
        reply = exchange(ws, encode(hello(edge_info, key, "hi")))
    assert reply.type == "reject" and reply.code == ErrorCode.UNAUTHORIZED
    assert "API key" in reply.reason


def test_right_key_is_accepted_and_prompt_matches(cloud_server, edge_info):
    edge = LlamaModel(edge_info)
    try:
        prompt = edge.chat_tokens(chat("hi"))
    finally:
        edge.close()
    link = CloudLink(cloud_server.url, cloud_server.api_key)
    accept = link.open(edge_info, chat("hi"), prompt, SamplingParams(), "never")
    assert accept.n_prompt == len(prompt) and link.held.covered == len(prompt)
    link.close()


def test_vocabulary_mismatch_is_rejected_at_hello(cloud_server, edge_info):
    with connect(cloud_server.url) as ws:
        reply = exchange(ws, encode(hello(edge_info, cloud_server.api_key, "hi", tokenizer="sha256:" + "0" * 32)))
    assert reply.type == "reject" and reply.code == ErrorCode.VOCAB_MISMATCH
    assert "vocabulary" in reply.reason


def test_vocabulary_mismatch_with_a_real_other_model(cloud_server):
    """Gemma-3-270M (a different tokenizer) as the device model: refused with a clear error."""
    from models.registry import model_info

    gemma = model_info("gemma3-270m")
    link = CloudLink(cloud_server.url, cloud_server.api_key)
    with pytest.raises(CloudRejected) as err:
        link.open(gemma, chat("hi"), [1, 2, 3], SamplingParams(), "never")
    assert err.value.code == ErrorCode.VOCAB_MISMATCH


def test_bad_frames_get_errors_and_the_server_keeps_serving(cloud_server, edge_info):
    bad = [
        (os.urandom(64), ErrorCode.BAD_FRAME),  # random bytes
        ("not json at all", ErrorCode.BAD_FRAME),
        (b"\x00\x00\x10\x00{}", ErrorCode.BAD_FRAME),  # header length beyond the frame
        ("x" * (MAX_MESSAGE_BYTES + 10), ErrorCode.TOO_LARGE),
        (json.dumps({"type": "teleport"}), ErrorCode.UNKNOWN_TYPE),
        (json.dumps({"type": "sync", "position": "zero", "tokens": []}), ErrorCode.BAD_FIELD),
        (encode(Sync(position=0, tokens=[1])), ErrorCode.OUT_OF_ORDER),  # before hello
        (encode(Generate(request_id=5, position=0, tokens=[])), ErrorCode.OUT_OF_ORDER),
    ]
    with connect(cloud_server.url, max_size=None) as ws:
        for frame, code in bad:
            reply = exchange(ws, frame)
            assert reply.type == "error" and reply.code == code, (frame[:40], reply)
        # the same connection can still open a session; then out-of-order positions are refused
        assert exchange(ws, encode(hello(edge_info, cloud_server.api_key, "hi"))).type == "accept"
        reply = exchange(ws, encode(Generate(request_id=9, position=3, tokens=[])))
        assert reply.type == "error" and reply.code == ErrorCode.OUT_OF_ORDER and reply.request_id == 9
        reply = exchange(ws, encode(hello(edge_info, cloud_server.api_key, "hi")))
        assert reply.type == "error" and reply.code == ErrorCode.OUT_OF_ORDER
    # and a fresh device session is served normally
    edge = LlamaModel(edge_info)
    gen = make_generator(edge, cloud_server, threshold=0.0)
    try:
        a = gen.generate(chat("what is two plus two"), max_tokens=6)
        assert not a.degraded and a.n_cloud_tokens == a.n_tokens
    finally:
        gen.close()
        edge.close()
    assert get_json(cloud_server.http_url + "/healthz")["sessions"] == 0


def test_lookahead_sends_the_next_token_the_cloud_then_writes(cloud_server, edge_info):
    """Over a raw WebSocket: a generate with lookahead is answered by its token and then a `next`
    for the following position, which is not in the history (a device token there is accepted)
    and is exactly what a generate at that position writes. A `next` from the device is refused."""
    with connect(cloud_server.url, max_size=None) as ws:
        accept = exchange(ws, encode(hello(edge_info, cloud_server.api_key, "hi")))
        n = accept.n_prompt
        tok = exchange(ws, encode(Generate(request_id=1, position=n, tokens=[], lookahead=True)))
        assert tok.type == "tokens" and tok.position == n and tok.final
        nxt = decode(ws.recv(timeout=10))
        assert nxt.type == "next" and nxt.request_id == 1 and nxt.position == n + 1 and nxt.token >= 0
        assert nxt.top_ids[0] == nxt.token and len(nxt.top_ids) == len(nxt.top_logprobs) == 8
        assert nxt.top_logprobs[0] == pytest.approx(nxt.logprob, abs=1e-5) and all(
            a >= b for a, b in zip(nxt.top_logprobs, nxt.top_logprobs[1:])
        )
        second = exchange(ws, encode(Generate(request_id=2, position=n + 1, tokens=[])))
        assert second.ids == [nxt.token] and second.logprobs[0] == pytest.approx(nxt.logprob, abs=1e-5)

        # the device writes its own token after a guess instead: the guess is forgotten
        exchange(ws, encode(Generate(request_id=3, position=n + 2, tokens=[], lookahead=True)))
        other = decode(ws.recv(timeout=10)).top_ids[1]
        ws.send(encode(Sync(position=n + 3, tokens=[other])))
        after = exchange(ws, encode(Generate(request_id=4, position=n + 4, tokens=[])))
        assert after.type == "tokens" and after.position == n + 4

        reply = exchange(ws, encode(Next(request_id=5, position=n + 5, token=1)))
        assert reply.type == "error" and reply.code == ErrorCode.OUT_OF_ORDER


@pytest.mark.kernel
def test_server_killed_mid_answer_device_finishes_and_reconnects(edge_info):
    """kill -9 of the server after five cloud tokens: the device finishes alone (degraded), its
    answer from the fallback point on is the device model's own continuation (nothing lost or
    duplicated; up to a near-tie its kernels may break either way), and the next question
    reconnects to a new server on the same port."""
    edge = LlamaModel(edge_info)
    server = LocalCloudServer(model=DEFAULT_CLOUD_MODEL).start()
    gen = make_generator(edge, server, threshold=0.0, timeout_s=3.0)
    killed = threading.Event()

    def kill_after_five(ev) -> None:
        if ev.index == 4 and not killed.is_set():
            killed.set()
            server.kill()

    try:
        a = gen.generate(chat("tell me about the moon"), max_tokens=24, on_token=kill_after_five)
        assert killed.is_set() and a.degraded
        assert a.n_tokens == 24 or a.finish_reason == "stop"
        assert a.routes[:5] == ["cloud"] * 5
        assert "cloud" not in a.routes[6:], "after the kill every token must come from the device"
        assert a.text.strip()
        # nothing lost or duplicated: from the fallback point on, the answer is the device's own
        k = a.routes.index("edge")
        alone = reference_greedy(edge_info, chat("tell me about the moon"), a.n_tokens, prefix=a.tokens[:k])
        assert agree_up_to_a_tie(edge_info, chat("tell me about the moon"), a.tokens, alone), (a.tokens, alone)
        # a new server on the same port: the next question reconnects and routes again
        server = LocalCloudServer(model=DEFAULT_CLOUD_MODEL, api_key=server.api_key, port=server.port).start()
        b = gen.generate(chat("tell me about the sun"), max_tokens=8)
        assert not b.degraded and b.n_cloud_tokens == b.n_tokens
    finally:
        gen.close()
        server.stop()
        edge.close()


@pytest.mark.serial  # a stall timed against the cloud timeout
def test_a_cloud_that_stalls_once_but_writes_every_token_is_not_degraded(edge_info):
    """Issue 45: cloud-alone answers were labelled degraded ("the cloud was lost") although the cloud wrote
    every token: one reply slower than --cloud-timeout broke the stream off, and the label stuck though the
    cloud was asked again and went on. The server is stopped (SIGSTOP) for 0.7 s after the fourth token,
    with a 0.4 s timeout: the answer is the cloud's, counted as one timeout or more, and not degraded.
    Stopped for good instead, the cloud is given up after three timeouts in a row: degraded, and the
    reason names the timeout."""
    edge = LlamaModel(edge_info)
    server = LocalCloudServer(model=DEFAULT_CLOUD_MODEL).start()
    assert server.proc is not None
    pid = server.proc.pid
    stalled = threading.Event()

    def stall_after_four(resume_after_s: float | None):
        def on_token(ev) -> None:
            if ev.index == 3 and not stalled.is_set():
                stalled.set()
                os.kill(pid, signal.SIGSTOP)
                if resume_after_s is not None:
                    threading.Timer(resume_after_s, os.kill, (pid, signal.SIGCONT)).start()

        return on_token

    question = chat("tell me about the moon")
    try:
        gen = make_generator(edge, server, mode="cloud", timeout_s=0.4)
        try:
            a = gen.generate(question, max_tokens=24, on_token=stall_after_four(0.7))
            assert stalled.is_set() and a.cloud_timeouts >= 1, a.to_json()
            assert a.n_cloud_tokens == a.n_tokens > 4 and not a.degraded and a.degraded_reason == "", a.to_json()
        finally:
            gen.close()
        stalled.clear()
        gen = make_generator(edge, server, mode="cloud", timeout_s=0.4)
        try:
            b = gen.generate(question, max_tokens=24, on_token=stall_after_four(None))
            assert b.degraded and "edge" in b.routes and b.cloud_timeouts == 3, b.to_json()
            assert b.degraded_reason == "no answer from the cloud within 0.4 s, 3 times in a row", b.degraded_reason
        finally:
            os.kill(pid, signal.SIGCONT)
            gen.close()
    finally:
        server.stop()
        edge.close()
