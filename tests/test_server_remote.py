"""The remote engine against a real OpenAI-compatible server on loopback, end to end.

llama-cpp-python ships one (`python -m llama_cpp.server`; it keeps every position's logits,
`logits_all`, its default, so `logprobs` and `echo` work). Its completions endpoint takes only
string prompts, so these tests run the `text` prompt format, and its `echo` costs ~60-100 ms of
Python per echoed token on this machine, so the probe (`--remote-verify auto`) picks verify by
continuation for it. vLLM cannot run here: its reply shapes (token ids in "token_id:N" names,
`prompt_logprobs`) are checked on recorded reply bodies, the only part that differs.

No mock of the engine: every test talks to the real server process, except the stand-in of an
engine without log-probabilities (`NoLogprobsProxy`, see its docstring).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from websockets.sync.client import connect

from cloud_server.engine import CloudEngine
from cloud_server.engine_api import EmptyHistory, Engine, EngineFailed, NotSupported, Worker
from cloud_server.local import LocalCloudServer
from cloud_server.remote_engine import RemoteEngine, RemoteEngineError, RemoteWorker
from edge_client.cloud_link import CloudLink
from edge_client.generator import RoutedGenerator, open_generator
from edge_client.options import GeneratorOptions
from models.registry import DEFAULT_CLOUD_MODEL
from shared.decision import CLAUSE_END
from shared.llama_backend import LlamaModel
from shared.protocol import (
    PROTOCOL_VERSION,
    Accept,
    Close,
    Error,
    ErrorCode,
    Generate,
    Next,
    Reject,
    Rollback,
    SamplingParams,
    Tokens,
    Verdict,
    Verify,
    decode,
    encode,
)
from shared.sampling import NO_GUESS
from tests.conftest import chat
from tests.helpers import agree_up_to_a_tie, ask_json, follow_reference, hello, reference_greedy
from tests.test_server_engine import assert_implements

ROOT = Path(__file__).resolve().parents[1]
WIFI = "how do i reset my wifi router"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(model_path: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's own server on loopback (with its `logits_all` on: logprobs and echo work)."""
    port = free_port()
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("llama_server_plain_kernels.py")),
        "--model",
        str(model_path),
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
        "--logits_all",
        "true",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(base + "/models", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError("llama_cpp.server did not start:\n" + log_path.read_text()[-2000:])
        time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)  # in case a test left it stopped
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def llama_server(cloud_info, tmp_path_factory):
    """(process, base URL) of the engine shared by this module's tests."""
    proc, base = start_llama_server(cloud_info.path, tmp_path_factory.mktemp("llama_server") / "server.log")
    try:
        yield proc, base
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def openai_server(llama_server):
    return llama_server[1]


def remote_args(base: str, *more: str) -> list[str]:
    return ["--remote-url", base, "--remote-prompt-format", "text", *more]


@pytest.fixture(scope="module")
def remote_cloud(openai_server):
    """A cloud server whose engine is the llama-cpp-python server (capabilities probed at start)."""
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=remote_args(openai_server)) as server:
        yield server


@pytest.fixture(scope="module")
def edge(edge_info):
    model = LlamaModel(edge_info)
    yield model
    model.close()


def generator(edge: LlamaModel, server: LocalCloudServer, timeout_s: float = 2.0, **options: object) -> RoutedGenerator:
    """The product's generator with every default (lookahead, the check after the first clause,
    the shipped router at 30% cloud tokens) unless `options` say otherwise."""
    opts = GeneratorOptions(cloud=server.url, api_key=server.api_key, cloud_timeout_s=timeout_s, **options)  # type: ignore[arg-type]
    return RoutedGenerator(edge, opts, lambda: CloudLink(server.url, server.api_key, timeout_s=timeout_s))


# --------------------------------------------------------------------------- the engine alone


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
        # the same tokens, up to a near-tie the server's batched kernels may break the other way
        assert agree_up_to_a_tie(cloud_info, q, out, ref[: len(out)]), (eng.model.detokenize(out), ref)
        assert "Paris" in eng.model.detokenize(out)
    finally:
        eng.close_all()


def test_the_probe_finds_guesses_and_a_way_to_verify(openai_server, cloud_info):
    """auto: llama-cpp-python lists top log-probabilities (guess) and has no prompt_logprobs; with a
    text prompt echo is not chosen, so drafts are judged against its own continuation. Asked for
    echo, it has that too; asked for vLLM's prompt_logprobs, it has not: verify is off."""
    for want, mode, verify in (("auto", "generate", True), ("echo", "echo", True), ("prompt-logprobs", "off", False)):
        eng = RemoteEngine(cloud_info, openai_server, prompt_format="text", verify=want)
        try:
            caps = eng.probe()
            assert caps.generate and caps.guess and caps.verify is verify and eng.verify_mode == mode, caps
            assert caps.names() == ["generate", "guess", "verify"][: 3 if verify else 2]
        finally:
            eng.close_all()


def test_remote_verdicts_and_guesses_are_the_embedded_engines(openai_server, cloud_info, edge_info):
    """The same drafts judged by the embedded engine and by the remote engine (by continuation, and
    once by echo) get the same verdicts: exact checks, the lenient check within 1 nat, a bonus (up
    to a near-tie: the remote server's batched kernels may break one the other way). The guess a
    generate brings along is the embedded engine's guess, and is written when asked for."""
    q = chat(WIFI)
    drafts = reference_greedy(edge_info, q, 10)  # the device's own answer: drafts the cloud disagrees with
    cases = [(list(range(10)), 0.0, False), ([], 1.0, False), ([3], 1.0, True), ([], 50.0, True)]
    local = CloudEngine(cloud_info, n_ctx=1024, max_sessions=4, threads=1)
    want = []
    try:
        for check, tol, bonus in cases:
            h = local.open(local.chat_tokens(q), SamplingParams())
            r = local.verify(h, drafts, check, bonus, tol)
            want.append((r.accepted, r.token))
            local.close(h)
        h = local.open(local.chat_tokens(q), SamplingParams())
        local.prefill(h)
        first = local.generate(h).token
        local.prefill(h)
        local_guess = local.guess(h)
    finally:
        local.close_all()
    for mode, which in (("generate", cases), ("echo", cases[1:2])):
        eng = RemoteEngine(cloud_info, openai_server, prompt_format="text", verify=mode)
        try:
            eng.probe()
            for (check, tol, bonus), expected in zip(which, want if mode == "generate" else want[1:2]):
                prompt = eng.chat_tokens(q)
                h = eng.open(prompt, SamplingParams())
                r = eng.verify(h, drafts, check, bonus, tol)
                # the same verdict, or one that departs at a near-tie (within the check's tolerance)
                served, want_served = drafts[: r.accepted] + [r.token], drafts[: expected[0]] + [expected[1]]
                assert agree_up_to_a_tie(cloud_info, q, served, want_served, tol + 0.5), (mode, check, tol, r, expected)
                assert eng.history(h) == prompt + drafts[: r.accepted] + ([r.token] if r.token >= 0 else [])
                work = eng.take_work(h)
                assert work.engine_requests >= 1 and work.passes >= 1 and work.verify_tokens >= 1
                eng.close(h)
            if mode == "generate":
                h = eng.open(eng.chat_tokens(q), SamplingParams())
                eng.expect_guess(h, True)  # the device's lookahead: one request brings the token and the guess
                tok = eng.generate(h).token
                ref = follow_reference(cloud_info, q, [first, local_guess.token], [tok])
                g = eng.guess(h)
                assert agree_up_to_a_tie(cloud_info, q, [tok, g.token], ref), (tok, g, ref)
                if [tok, g.token] == [first, local_guess.token]:  # the runners-up too, up to a tie among them
                    assert len(set(g.top_ids[:3]) & set(local_guess.top_ids[:3])) >= 2, (g, local_guess)
                second = eng.generate(h)  # writes the announced guess, without a request
                assert second.token == g.token
                w = eng.take_work(h)
                n_prompt = len(eng.history(h)) - 2
                assert (w.engine_requests, w.passes, w.generate_tokens, w.guess_tokens) == (1, 2, n_prompt, 1), w
                g = eng.guess(h)  # no guess came with the last token: a request of its own
                w = eng.take_work(h)
                assert g.token >= 0 and len(g.top_ids) == 8 and (w.engine_requests, w.guess_tokens) == (1, 1), w
        finally:
            eng.close_all()


def test_the_remote_engine_implements_the_protocol_and_says_what_it_can_do(cloud_info):
    eng = RemoteEngine(cloud_info, "http://127.0.0.1:9/v1")
    worker = RemoteWorker(eng, concurrency=2)
    try:
        assert_implements(eng, Engine)
        assert_implements(worker, Worker)
        assert not hasattr(eng, "ctx"), "no fake llama.cpp context: capabilities say what it can do"
        caps = eng.capabilities()  # not probed (nothing listens): hard tokens only
        assert caps.generate and not caps.guess and not caps.verify and caps.max_verify_tokens == 0
        assert caps.names() == ["generate"] and caps.n_vocab == 49152
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
        with pytest.raises(RemoteEngineError, match="unreachable"):
            eng.probe()
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
        tok = eng.client.positions(reply, 1)[0].token
        assert tok == (eng.model.end_token if token == "end" else token)
        assert eng.is_eog(tok) == (token == "end")
        with pytest.raises(Exception, match="return_tokens_as_token_ids"):
            eng.client.positions({"choices": [{"text": "", "finish_reason": "length"}]}, 1)
    finally:
        eng.close_all()


def test_vllm_prompt_logprobs_and_top_lists_are_read_by_token_id(cloud_info):
    """A recorded vLLM reply shape (completions with prompt_logprobs, logprobs and
    return_tokens_as_token_ids): the drafts' own log-probabilities and alternatives by id."""
    eng = RemoteEngine(cloud_info, "http://127.0.0.1:9/v1")
    try:
        reply = {
            "choices": [
                {
                    "text": " is",
                    "prompt_logprobs": [
                        None,
                        {"7042": {"logprob": -0.5, "rank": 1, "decoded_token": " Paris"}},
                        {
                            "314": {"logprob": -3.0, "rank": 4, "decoded_token": " is"},
                            "28": {"logprob": -0.2, "rank": 1},
                        },
                    ],
                    "logprobs": {
                        "tokens": ["token_id:314"],
                        "token_logprobs": [-0.3],
                        "top_logprobs": [{"token_id:314": -0.3, "token_id:28": -1.5}],
                    },
                }
            ]
        }
        pos = eng.client.positions(reply, 1, [1, 7042, 314], n_scored=2, prompt_logprobs=True)
        assert [p.token for p in pos] == [7042, 314, 314]
        assert pos[1].logprob == -3.0 and pos[1].top == {314: -3.0, 28: -0.2}
        assert pos[2].guess().top_ids == [314, 28]
    finally:
        eng.close_all()


# --------------------------------------------------------------------------- over the wire


def test_cloud_server_serves_every_message_through_the_remote_engine(remote_cloud, cloud_info):
    """accept lists the probed capabilities (protocol v2); tokens as the model alone writes them
    (up to a near-tie, which the server's batched kernels may break the other way);
    a lookahead `next` carries a real guess that a generate there writes; verify judges drafts;
    every reply reports the engine's work; an empty history is a named error; a v1 device is
    still accepted."""
    with urllib.request.urlopen(remote_cloud.http_url + "/v1/info", timeout=5) as r:
        info = json.loads(r.read())
    assert info["engine"] == "remote" and info["capabilities"] == ["generate", "guess", "verify"]
    assert "verify: generate" in info["engine_detail"] and info["protocol_versions"] == [1, 2, 3]
    ref = reference_greedy(cloud_info, chat(WIFI), 10)
    with connect(remote_cloud.url, open_timeout=10, compression=None) as ws:
        ws.send(encode(hello(cloud_info, remote_cloud.api_key, question=WIFI)))
        acc = decode(ws.recv(timeout=10))
        assert isinstance(acc, Accept) and acc.version == PROTOCOL_VERSION
        assert acc.capabilities == ["generate", "guess", "verify"] and acc.max_verify_tokens == 64
        ws.send(encode(Generate(request_id=1, position=acc.n_prompt, tokens=[], max_tokens=4)))
        got, work = [], 0
        while True:
            m = decode(ws.recv(timeout=30))
            assert isinstance(m, Tokens) and m.position == acc.n_prompt + len(got)
            got += m.ids
            work += m.engine_requests
            if m.final:
                break
        assert len(got) == 4 and work >= 4
        ref = follow_reference(cloud_info, chat(WIFI), ref, got)  # the model's tokens, up to a near-tie
        n = acc.n_prompt + len(got)

        ws.send(encode(Generate(request_id=2, position=n, tokens=[], lookahead=True)))
        tok = decode(ws.recv(timeout=30))
        assert isinstance(tok, Tokens) and len(tok.ids) == 1 and tok.passes >= 2 and tok.guess_tokens == 1
        ref = follow_reference(cloud_info, chat(WIFI), ref, got + tok.ids)
        nxt = decode(ws.recv(timeout=30))  # it came with the token: no request of its own
        assert isinstance(nxt, Next) and nxt.request_id == 2 and nxt.position == n + 1
        assert len(nxt.top_ids) == 8 and nxt.engine_requests == 0
        ref = follow_reference(cloud_info, chat(WIFI), ref, got + tok.ids + [nxt.token])
        ws.send(encode(Generate(request_id=3, position=n + 1, tokens=[])))  # writes the guess, no request
        tok = decode(ws.recv(timeout=30))
        assert isinstance(tok, Tokens) and tok.ids == [nxt.token] and tok.engine_requests == 0

        n += 2
        ws.send(encode(Verify(request_id=4, position=n, tokens=ref[6:9], check=[0, 1, 2], bonus=True)))
        v = decode(ws.recv(timeout=30))
        assert isinstance(v, Verdict) and v.token >= 0 and v.verify_tokens >= 3
        # the reference's own drafts pass, and the bonus is its next token (a near-tie may break either way)
        follow_reference(cloud_info, chat(WIFI), ref, ref[: 6 + v.accepted] + [v.token])

        ws.send(encode(Rollback(position=0)))
        ws.send(encode(Generate(request_id=5, position=0, tokens=[])))
        err = decode(ws.recv(timeout=10))
        assert isinstance(err, Error) and err.code == ErrorCode.BAD_FIELD and "history is empty" in err.message
        ws.send(encode(Close()))
    with connect(remote_cloud.url, open_timeout=10, compression=None) as ws:
        ws.send(encode(hello(cloud_info, remote_cloud.api_key, version=1)))
        acc = decode(ws.recv(timeout=10))
        assert isinstance(acc, Accept) and acc.version == 1
        ws.send(encode(Close()))
    with connect(remote_cloud.url, open_timeout=10, compression=None) as ws:
        ws.send(encode(hello(cloud_info, remote_cloud.api_key, version=4)))
        rej = decode(ws.recv(timeout=10))
        assert isinstance(rej, Reject) and rej.code == ErrorCode.VERSION_MISMATCH and "1, 2, 3" in rej.reason


def test_ask_with_every_default_through_the_remote_engine(remote_cloud):
    """The command of issue 15: `tokenrouter-edge ask ... --cloud ws://... --json`, every default
    (lookahead, --check after-first-clause, 30% cloud tokens, the 2 s cloud timeout): cloud tokens,
    a guess and checks, not degraded; the mode and the work are reported.

    The guess is asked only after a cloud token in the first clause, and whether the router flags
    one there depends on the CPU's kernels (on one Zen 3 VM the WIFI answer's first clause had
    none), so the questions go on until an answer has one."""
    guessed = []
    for q in (WIFI, "explain how vaccines work", "tell me a fun fact about octopuses"):
        a = ask_json(q, "--cloud", remote_cloud.url, env={"TOKENROUTER_API_KEY": remote_cloud.api_key})
        assert not a["degraded"], a
        assert a["cloud_capabilities"] == ["generate", "guess", "verify"]
        assert a["cloud_mode"] == a["cloud_mode_asked"] == "per-token+guess+check"
        w = a["cloud_work"]
        assert a["n_cloud_tokens"] > 0 and a["round_trips"] > 0, a
        assert w["verify_tokens"] > 0 and w["engine_requests"] > 0 and w["passes"] > 0, w
        assert a["traffic"]["passes"] == w["passes"]
        assert not a["lookahead_positions"] or w["guess_tokens"] > 0, (a["lookahead_positions"], w)
        guessed.append(bool(a["lookahead_positions"]))
        if guessed[-1]:
            break
    assert any(guessed), "no answer had a cloud token in its first clause, so no guess was asked"


def test_a_pool_and_exploration_through_the_remote_engine(remote_cloud, cloud_server, edge):
    """The remote-engine cloud as tier 1, the embedded one as tier 2 (`--tier`), half the hard positions
    sent up (`escalate:top_share=0.5`), exploration at 30 % (the server's default per-key budget): the
    remote engine answers the explored positions and its tier's, the embedded one the top tier's;
    nothing is declined or degraded. Every other option is the default, but the check (off: in the check
    phase only the first cloud tier is asked)."""
    opts = GeneratorOptions(
        cloud=remote_cloud.url,
        api_key=remote_cloud.api_key,
        tiers=(cloud_server.url,),
        decision_engine="escalate:top_share=0.5",
        explore=0.3,
        explore_per_minute=60,
        check="off",
        cloud_timeout_s=5.0,
    )
    links = [lambda s=s: CloudLink(s.url, s.api_key, timeout_s=5.0) for s in (remote_cloud, cloud_server)]
    gen = RoutedGenerator(edge, opts, links[0], tier_connects=links[1:])
    try:
        answers = [gen.generate(chat(q), max_tokens=32) for q in (WIFI, "explain how vaccines work")]
    finally:
        gen.close()
    assert not any(a.degraded or a.explore_declined or a.lost_tiers for a in answers)
    tiers = [t for a in answers for t in a.tiers]
    assert {1, 2} <= set(tiers), tiers
    assert sum(len(a.explored_positions) for a in answers) > 0
    assert all(a.tiers[i] == 1 for a in answers for i in a.explored_positions)  # explored: the cloud's tier
    work = [w for a in answers for w in a.tier_work[1:2]]
    assert sum(w.engine_requests for w in work) > 0  # tier 1's positions went through the remote engine
    assert all(a.tier_work[2].engine_requests == 0 for a in answers)  # the embedded engine makes no requests


def test_check_all_through_the_remote_engine(remote_cloud, edge):
    gen = generator(edge, remote_cloud, timeout_s=5.0, check="all", max_tokens=40)
    try:
        a = gen.generate(chat(WIFI))
    finally:
        gen.close()
    assert not a.degraded and a.cloud_mode == "check" and a.n_cloud_tokens > 0
    assert a.traffic.work.verify_tokens > 0 and a.traffic.round_trips >= 2 and a.traffic.work.generate_tokens == 0


def test_a_voice_file_turn_with_every_default_through_the_remote_engine(remote_cloud, tmp_path, monkeypatch):
    """One short spoken question from a WAV file, answered with every default through the remote engine."""
    pytest.importorskip("faster_whisper")
    from voice_audio import speaker, spoken_wav

    import edge_client.generator as generator_module
    from edge_client.voice.cli import run_file_turn
    from edge_client.voice.pipeline import Engines, VoiceOptions

    checks: list[int] = []
    real_check = generator_module._CHECK

    class Spy:  # the real check runs; the spy counts it
        def run(self, turn):
            checks.append(len(turn.decoder.history))
            return real_check.run(turn)

    monkeypatch.setattr(generator_module, "_CHECK", Spy())
    opts = GeneratorOptions(cloud=remote_cloud.url, api_key=remote_cloud.api_key, max_tokens=40)
    with open_generator(opts) as gen:
        engines = Engines(gen)
        q = spoken_wav(speaker(), "How do I reset my router?", tmp_path / "q.wav")
        obj = run_file_turn(
            gen, str(q), str(tmp_path / "r.wav"), VoiceOptions(max_tokens=40), realtime=False, engines=engines
        )
        error = gen.last_cloud_error
    a = obj["answer"]
    assert a["text"].strip() and a["n_tokens"] > 0 and not a["degraded"], (error, obj, remote_cloud.log[-60:])
    assert a["n_cloud_tokens"] > 0, obj
    # The check runs from the second clause on (`after-first-clause`): an answer of one clause has none.
    # (Under load the streaming transcript can differ, "How do I reset my router? I", and so the answer.)
    one_clause = not any(c in a["text"].strip()[:-1] for c in CLAUSE_END)
    assert checks or one_clause, obj


def test_a_killed_engine_mid_answer_leaves_the_device_to_finish(cloud_info, edge, tmp_path):
    """The engine process dies after the first tokens: the device finishes the answer, degraded;
    every position is released exactly once, in order, and the device's history is the answer."""
    proc, base = start_llama_server(cloud_info.path, tmp_path / "server.log")
    try:
        with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=remote_args(base)) as server:
            gen = generator(edge, server, timeout_s=5.0, max_tokens=48)
            events = []

            def on_token(ev) -> None:
                events.append(ev)
                if len(events) == 3:
                    proc.kill()
                    proc.wait(timeout=10)

            try:
                messages = chat(WIFI)
                a = gen.generate(messages, on_token=on_token)
                prompt = edge.chat_tokens(messages)
                assert gen.decoder.history[: len(prompt) + len(a.tokens)] == prompt + a.tokens
            finally:
                gen.close()
    finally:
        stop(proc)
    assert a.degraded and len(a.tokens) > 3
    assert [e.index for e in events] == list(range(len(a.tokens)))  # nothing lost, nothing twice
    assert [e.token_id for e in events] == a.tokens and len(a.routes) == len(a.tokens) == len(a.scores)
    assert a.text == edge.detokenize(a.tokens)


def test_a_slow_engine_hits_the_cloud_timeout_and_the_session_survives(remote_cloud, llama_server, edge):
    """The engine stalls (SIGSTOP) for 1.5 s: the hard tokens asked meanwhile miss the 1 s cloud
    timeout and are written by the device; once it runs again the same session serves the rest."""
    proc, _ = llama_server
    gen = generator(edge, remote_cloud, timeout_s=1.0, max_tokens=24, cloud_fraction=None, threshold=0.0)
    gen.reconfigure(lookahead=False, check="off")  # every position is a hard token: the stall is met
    links = []

    def on_token(ev) -> None:
        links.append(gen.link)
        if ev.index == 3:
            os.kill(proc.pid, signal.SIGSTOP)
            threading.Timer(1.5, os.kill, (proc.pid, signal.SIGCONT)).start()

    try:
        a = gen.generate(chat("what is the capital of france"), on_token=on_token)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        gen.close()
    assert a.cloud_timeouts >= 1 and not a.degraded, a.to_json()
    assert "edge" in a.routes[4:] and a.routes[-1] == "cloud", a.routes  # written by the device, then the cloud again
    assert all(link is links[0] for link in links), "one session throughout"


class NoLogprobsProxy:
    """A stand-in for an engine that returns no log-probabilities and cannot echo: it forwards
    each completions request to the real llama-cpp-python server without `logprobs`, `echo` and
    `prompt_logprobs`, and strips `logprobs` from the reply. Why a stand-in: every engine that runs
    here lists log-probabilities; some servers behind an OpenAI-compatible endpoint do not (or an
    operator turns them off), and the device must then get a negotiated fallback, not errors."""

    def __init__(self, upstream: str) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                for key in ("logprobs", "echo", "prompt_logprobs"):
                    body.pop(key, None)
                proxy.requests += 1
                req = urllib.request.Request(
                    upstream + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=60) as r:
                    reply = json.loads(r.read())
                for choice in reply.get("choices", []):
                    choice.pop("logprobs", None)
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.requests = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_engine_without_logprobs_gets_a_negotiated_fallback(openai_server, edge):
    """No log-probabilities: the server can only write hard tokens; the device, with every default,
    falls back to per-token routing without guesses, says so, and gets no error."""
    proxy = NoLogprobsProxy(openai_server)
    try:
        with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=remote_args(proxy.url)) as server:
            with urllib.request.urlopen(server.http_url + "/v1/info", timeout=5) as r:
                assert json.loads(r.read())["capabilities"] == ["generate"]
            gen = generator(edge, server, timeout_s=5.0, max_tokens=40)
            try:
                a = gen.generate(chat(WIFI))
            finally:
                gen.close()
    finally:
        proxy.close()
    assert not a.degraded and a.cloud_capabilities == ["generate"] and a.n_cloud_tokens > 0
    assert a.cloud_mode == "per-token" and a.cloud_mode_asked == "per-token+guess+check"
    assert not a.lookahead_positions and not a.overruled_positions and a.traffic.work.verify_tokens == 0
    assert proxy.requests >= a.n_cloud_tokens


def test_eval_decides_lookahead_and_the_check_with_the_remote_engine(openai_server):
    """`tokenrouter-train eval --cloud-engine URL`: the lookahead + check method also runs with the
    remote engine's decisions (METHOD@remote), scored by the in-process cloud model, with its work."""
    from models.train.cli import DEFAULT_ROUTER
    from models.train.evaluate import EvalOptions, evaluate

    opts = EvalOptions(
        DEFAULT_ROUTER,
        "smollm2-135m-q3_k_s",
        DEFAULT_CLOUD_MODEL,
        fractions=(0.3,),
        max_tokens=16,
        progress=False,
        verify=("learned",),
        verify_from=("after-first-clause",),
        cloud_engine=openai_server,
        cloud_engine_format="text",
    )
    result = evaluate(["how do i reset my wifi router", "what is the capital of france"], opts)
    name = "learned+verify@1:after-first-clause"
    local, remote = (
        next(p for p in result["methods"][m] if p["target_fraction"] == 0.3) for m in (name, name + "@remote")
    )
    assert result["cloud_engine"] == {"url": openai_server, "prompt_format": "text"}
    assert remote["n_tokens"] > 0 and 0 < remote["cloud_fraction"] < 1
    assert abs(remote["cloud_nll"] - local["cloud_nll"]) < 0.5, (local, remote)  # the same decisions but at near-ties
    assert remote["passes_per_token"] > 0 and remote["cloud_tokens_by_kind_per_token"]["verify"] > 0
    cloud_only = result["methods"]["cloud-only"][0]
    assert cloud_only["passes_per_token"] >= 1.0 and result["methods"]["edge-only"][0]["passes_per_token"] == 0
