"""The remote engine backend against a real OpenAI-compatible server on loopback.

llama-cpp-python ships one (`python -m llama_cpp.server`); its completions
endpoint takes only string prompts, so the end-to-end test runs the `text`
prompt format. vLLM and llama.cpp's C++ server cannot run here: their reply
shapes (token ids in "token_id:N" logprob tokens, or a `tokens` list) are
checked on recorded reply bodies, which is the only part that differs.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from websockets.sync.client import connect

from cloud_server.engine_api import EmptyHistory, Engine, EngineFailed, NotSupported, Worker
from cloud_server.local import LocalCloudServer
from cloud_server.remote_engine import RemoteEngine, RemoteEngineError, RemoteWorker
from models.registry import DEFAULT_CLOUD_MODEL
from shared.protocol import (
    PROTOCOL_VERSION,
    Accept,
    Close,
    Error,
    ErrorCode,
    Generate,
    Hello,
    Next,
    Rollback,
    SamplingParams,
    Tokens,
    Verify,
    decode,
    encode,
)
from shared.sampling import NO_GUESS
from tests.conftest import chat
from tests.helpers import reference_greedy
from tests.test_server_engine import assert_implements


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def openai_server(cloud_info, tmp_path_factory):
    port = free_port()
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("llama_server_plain_kernels.py")),
        "--model",
        str(cloud_info.path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "2048",
        "--n_threads",
        "1",
        "--n_threads_batch",
        "1",
    ]
    log_path = tmp_path_factory.mktemp("llama_server") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(base + "/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama_cpp.server did not start:\n" + log_path.read_text()[-2000:])
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_remote_engine_writes_the_same_greedy_tokens_as_the_model_alone(openai_server, cloud_info):
    q = chat("what is the capital of france")
    ref = reference_greedy(cloud_info, q, 8)
    eng = RemoteEngine(cloud_info, openai_server, prompt_format="text")
    try:
        h = eng.open(eng.model.chat_tokens(q), SamplingParams())
        out = []
        for _ in range(8):
            token, logprob, seconds = eng.generate(h)
            assert logprob <= 0.0 and seconds > 0
            out.append(token)
            if eng.is_eog(token):
                break
        assert out == ref[: len(out)], (eng.model.detokenize(out), eng.model.detokenize(ref))
        assert "Paris" in eng.model.detokenize(out)
    finally:
        eng.close_all()


def test_cloud_server_serves_sessions_through_the_remote_engine(openai_server, cloud_info):
    """Over the wire: tokens as the model alone writes them; what the remote engine cannot do
    (verify, lookahead guesses) is refused by name or answered with no guess, and the session
    goes on; an empty history is a named error too, never `internal`."""
    args = ["--remote-url", openai_server, "--remote-prompt-format", "text"]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        with urllib.request.urlopen(server.http_url + "/v1/info", timeout=5) as r:
            assert json.loads(r.read())["engine"] == "remote"
        with connect(server.url, open_timeout=10, compression=None) as ws:
            ws.send(
                encode(
                    Hello(
                        version=PROTOCOL_VERSION,
                        api_key=server.api_key,
                        edge_model=cloud_info.fingerprint,
                        tokenizer=cloud_info.tokenizer_fingerprint,
                        messages=chat("what is the capital of france"),
                    )
                )
            )
            acc = decode(ws.recv(timeout=10))
            assert isinstance(acc, Accept)
            ws.send(encode(Generate(request_id=1, position=acc.n_prompt, tokens=[], max_tokens=6)))
            got = []
            while True:
                m = decode(ws.recv(timeout=30))
                assert isinstance(m, Tokens) and m.position == acc.n_prompt + len(got)
                got += m.ids
                if m.final:
                    break
            n = acc.n_prompt + len(got)

            ws.send(encode(Verify(request_id=2, position=n, tokens=[28, 29], check=[0])))
            err = decode(ws.recv(timeout=10))
            assert isinstance(err, Error) and err.code == ErrorCode.BAD_FIELD and err.request_id == 2
            assert "not supported by this server's engine (remote)" in err.message

            ws.send(encode(Generate(request_id=3, position=n, tokens=[], lookahead=True)))
            tok = decode(ws.recv(timeout=30))
            assert isinstance(tok, Tokens) and tok.position == n and tok.final
            nxt = decode(ws.recv(timeout=10))  # at once: the device reads -1 as "no guess"
            assert isinstance(nxt, Next) and nxt.request_id == 3 and nxt.token == -1 and nxt.position == n + 1

            ws.send(encode(Rollback(position=0)))
            ws.send(encode(Generate(request_id=4, position=0, tokens=[])))
            err = decode(ws.recv(timeout=10))
            assert isinstance(err, Error) and err.code == ErrorCode.BAD_FIELD and "history is empty" in err.message
            ws.send(encode(Close()))
        assert got == reference_greedy(cloud_info, chat("what is the capital of france"), 6)[: len(got)]


def test_the_remote_engine_implements_the_protocol_and_says_what_it_cannot_do(cloud_info):
    eng = RemoteEngine(cloud_info, "http://127.0.0.1:9/v1")
    worker = RemoteWorker(eng, concurrency=2)
    try:
        assert_implements(eng, Engine)
        assert_implements(worker, Worker)
        assert not hasattr(eng, "ctx"), "no fake llama.cpp context: capabilities say what it can do"
        caps = eng.capabilities()
        assert caps.generate and not caps.guess and not caps.verify and caps.max_verify_tokens == 0
        assert caps.n_vocab == 49152
        h = eng.open([1, 2, 3], SamplingParams())
        assert eng.guess(h) == NO_GUESS
        with pytest.raises(NotSupported, match="not supported by this server's engine"):
            eng.verify(h, [4], [0])
        eng.rollback(h, 0)
        with pytest.raises(EmptyHistory):
            eng.generate(h)
        assert issubclass(RemoteEngineError, EngineFailed), "a remote failure is a named error (busy)"
    finally:
        worker.shutdown()


def test_unreachable_remote_engine_is_a_clear_error(cloud_info):
    eng = RemoteEngine(cloud_info, f"http://127.0.0.1:{free_port()}/v1", timeout_s=2)
    try:
        h = eng.open([1, 2, 3], SamplingParams())
        with pytest.raises(RemoteEngineError, match="unreachable"):
            eng.generate(h)
    finally:
        eng.close_all()
    with pytest.raises(ValueError, match="http://host:port/v1"):
        RemoteEngine(cloud_info, "vllm:8000")


@pytest.mark.parametrize(
    "reply, token",
    [
        (
            {"choices": [{"text": " Paris", "logprobs": {"tokens": ["token_id:7042"], "token_logprobs": [-0.1]}}]},
            7042,
        ),  # vLLM
        (
            {"choices": [{"text": " Paris", "tokens": [7042], "logprobs": None}]},
            7042,
        ),  # llama.cpp server, return_tokens
        (
            {"choices": [{"text": "", "finish_reason": "stop", "logprobs": {"tokens": [], "token_logprobs": []}}]},
            "end",
        ),  # stopped at EOS
    ],
)
def test_token_ids_are_read_from_each_engines_reply_shape(cloud_info, reply, token):
    eng = RemoteEngine(cloud_info, "http://127.0.0.1:9/v1")
    try:
        tok, logprob = eng._parse(reply)
        assert tok == (eng.model.end_token if token == "end" else token)
        assert eng.is_eog(tok) == (token == "end")
        with pytest.raises(RemoteEngineError, match="return_tokens_as_token_ids"):
            eng._parse({"choices": [{"text": "", "finish_reason": "length"}]})
    finally:
        eng.close_all()
