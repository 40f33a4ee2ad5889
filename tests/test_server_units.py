"""Small parts of the production server on their own: key files, quotas, the abuse check, audit sampling and
retention, TLS, the sampler's numerical guard."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from websockets.sync.client import connect

from cloud_server.audit import AuditLog, AuditOptions
from cloud_server.auth import KeyChecker, digest
from cloud_server.local import LocalCloudServer
from cloud_server.quotas import KeyPolicy, QuotaExceeded, Quotas, SessionGuard
from edge_client.cloud_link import CloudLink, CloudUnavailable, WakingConnection
from models.registry import DEFAULT_CLOUD_MODEL
from shared import routing_log
from shared.model_info import ModelInfo
from shared.protocol import PROTOCOL_VERSION, Accept, Hello, SamplingParams, decode, encode
from shared.sampling import Sampler, SamplingError
from tests.conftest import chat

ROOT = Path(__file__).resolve().parents[1]


def test_key_file_options_digests_and_clear_errors():
    keys = KeyChecker(
        [f"{digest('alpha')} name=a max_sessions=2 tokens_per_minute=60 max_cloud_fraction=0.4", "beta"],
        default=KeyPolicy(max_sessions=9),
    )
    a = keys.identify("alpha")
    assert a == KeyPolicy(name="a", max_sessions=2, tokens_per_minute=60, max_cloud_fraction=0.4)
    b = keys.identify("beta")
    assert b is not None and b.max_sessions == 9 and b.name.startswith("key-")
    assert keys.identify("gamma") is None and keys.check("alpha") and not keys.check("")
    with pytest.raises(ValueError, match="bad option 'max_sesions=2'"):
        KeyChecker(["k max_sesions=2"])
    with pytest.raises(ValueError, match="no API keys configured"):
        KeyChecker([])
    assert KeyChecker([], insecure=True).identify("anything").name == "anonymous"
    out = subprocess.run(
        [sys.executable, "-m", "cloud_server.cli", "hash-key", "alpha"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert out.stdout.strip() == digest("alpha")


def test_quotas_sessions_and_token_bucket():
    q, key = Quotas(), KeyPolicy(name="k", max_sessions=1, tokens_per_minute=3)
    q.open_session(key)
    with pytest.raises(QuotaExceeded, match="already has 1 open sessions"):
        q.open_session(key)
    q.close_session(key)
    q.open_session(key)
    for _ in range(3):
        q.take_cloud_tokens(key, 1)
    with pytest.raises(QuotaExceeded, match=r"retry in \d+\.\d s") as exc:
        q.take_cloud_tokens(key, 1)
    assert exc.value.kind == "key_tokens_per_minute"
    q.take_cloud_tokens(KeyPolicy(name="free"), 10**6)  # no limit set: never refused
    with pytest.raises(QuotaExceeded, match="used its 0 cloud tokens"):  # 0: none at all (was a division by 0)
        q.take_cloud_tokens(KeyPolicy(name="none", tokens_per_minute=0), 1)
    explorer = KeyPolicy(name="e", explore_per_minute=2)
    q.take_explore(explorer)
    q.take_explore(explorer)
    with pytest.raises(QuotaExceeded, match="2 exploration requests per minute") as exc:
        q.take_explore(explorer)
    assert exc.value.kind == "key_explore_per_minute"
    q.take_cloud_tokens(explorer, 1)  # a separate budget from its cloud tokens
    with pytest.raises(QuotaExceeded):
        q.take_explore(KeyPolicy(name="never", explore_per_minute=0))


def test_abuse_guard_flags_over_cap_after_warmup_and_recovers():
    g = SessionGuard(KeyPolicy(max_cloud_fraction=0.5), warmup_tokens=4)
    for _ in range(4):  # warm-up: anything goes
        g.check_hard_token()
        g.cloud_token()
    with pytest.raises(QuotaExceeded, match="throttled"):
        g.check_hard_token()
    assert g.flagged and g.throttled == 1
    g.device_tokens(10)
    g.check_hard_token()  # 5/15 <= 50%


def test_audit_sampling_retention_and_rollbacks(tmp_path):
    log = AuditLog(AuditOptions(str(tmp_path), sample_rate=0.5), cloud_model="cloud-fp")
    kept = [sid for sid in (f"s{i}" for i in range(200)) if log.sampled(sid)]
    assert 60 < len(kept) < 140, "about half the sessions are sampled"
    assert all(log.sampled(s) for s in kept), "the choice is stable for a session id"
    dropped = next(f"s{i}" for i in range(200) if not log.sampled(f"s{i}"))
    a = log.start(dropped, "k", n_prompt=10)
    a.tokens(10, [1, 2, 3], cloud=False)
    a.tokens(13, [4], cloud=True)
    a.rollback(12)  # the device took back two tokens
    a.tokens(12, [5], cloud=True)
    assert log.finish(a, "edge-fp") is None, "not sampled, not flagged: not kept"
    a.flagged = True
    path = log.finish(a, "edge-fp")
    assert path is not None
    logged = list(routing_log.read(path.read_bytes()))
    assert [(t.position, t.writer, t.model) for t in logged] == [
        (10, "edge", "edge-fp"),
        (11, "edge", "edge-fp"),
        (12, "cloud", "cloud-fp"),
    ]
    entry = json.loads((path.parent / "index.jsonl").read_text().splitlines()[-1])
    assert entry["flagged"] and entry["cloud_tokens"] == 1 and entry["key"] == "k"
    old = tmp_path / (datetime.now(timezone.utc) - timedelta(days=40)).strftime("%Y-%m-%d")
    old.mkdir()
    (old / "x.trlg").write_bytes(b"")
    assert log.sweep() == 1 and not old.exists() and path.exists()
    with pytest.raises(ValueError, match="sample_rate"):
        AuditLog(AuditOptions(str(tmp_path), sample_rate=2.0), "c")


@pytest.fixture
def tls_cert(tmp_path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
        env=dict(os.environ),
    )
    return cert, key


def test_tls_through_uvicorn_options(tls_cert, cloud_info):
    cert, key = tls_cert
    with LocalCloudServer(
        model=DEFAULT_CLOUD_MODEL, extra_args=["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    ) as server:
        assert server.url.startswith("wss://")
        ctx = ssl.create_default_context(cafile=str(cert))
        # the device's own connection class: a server that stalls fails this test in 30 s, never hangs it
        try:
            ws = connect(server.url, ssl=ctx, open_timeout=30, create_connection=WakingConnection)
        except TimeoutError:
            pytest.fail("the TLS server did not answer the upgrade in 30 s; its log:\n" + "\n".join(server.log[-30:]))
        with ws:
            ws.send(
                encode(
                    Hello(
                        version=PROTOCOL_VERSION,
                        api_key=server.api_key,
                        edge_model=cloud_info.fingerprint,
                        tokenizer=cloud_info.tokenizer_fingerprint,
                        messages=chat("hi"),
                    )
                )
            )
            assert isinstance(decode(ws.recv(timeout=30)), Accept)


def test_a_tls_cloud_that_goes_silent_after_the_handshake_cannot_hang_the_device(tls_cert, monkeypatch):
    """A server that completes TLS and then answers nothing: the device gives up within its connect
    timeout and answers alone (`CloudUnavailable`). websockets' own client waited forever here (its
    reader blocked in an SSL read that closing the socket does not wake); `WakingConnection` fixes it.
    Stand-in: a bare TLS socket, since the real server does not stall on purpose."""
    cert, key = tls_cert
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept_and_say_nothing() -> None:
        conn, _ = listener.accept()
        held.append(server_ctx.wrap_socket(conn, server_side=True))  # the handshake, then silence

    thread = threading.Thread(target=accept_and_say_nothing, daemon=True)
    thread.start()
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the device trusts the test's certificate
    link = CloudLink(f"wss://127.0.0.1:{listener.getsockname()[1]}/v1/route", "key", connect_timeout_s=1.0)
    outcome: list[BaseException] = []

    def open_link() -> None:
        try:
            link.open(
                cast(ModelInfo, None), [], [], SamplingParams(), "never"
            )  # fails at the connection, before the hello
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    opener = threading.Thread(target=open_link, daemon=True)
    opener.start()
    opener.join(20)
    try:
        assert not opener.is_alive(), "the device still waits for a silent TLS server after 20 s"
        assert len(outcome) == 1 and isinstance(outcome[0], CloudUnavailable), outcome
        assert "cannot connect" in str(outcome[0]) and held, "the TLS handshake itself must have completed"
    finally:
        listener.close()
        for s in held:
            s.close()


def test_sampling_refuses_non_finite_logits_and_probabilities_by_name():
    """NaN or +inf logits, or a temperature so small that logits / T overflow, raise SamplingError
    (a ValueError the server answers as bad_field), never an arbitrary token or numpy's own error."""
    logits = np.linspace(-3.0, 5.0, 1000, dtype=np.float32)
    greedy, hot = Sampler(SamplingParams()), Sampler(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1))
    assert greedy.sample(logits) == 999 and 950 <= hot.sample(logits) <= 999
    for bad in (np.nan, np.inf):
        broken = logits.copy()
        broken[10] = bad
        for sampler in (greedy, hot):
            with pytest.raises(SamplingError, match="not finite"):
                sampler.sample(broken)
    tiny = Sampler(SamplingParams(temperature=1e-308, top_k=50, top_p=1.0))
    with pytest.raises(SamplingError, match="temperature"):
        tiny.sample(logits)
    masked = logits.copy()
    masked[:500] = -np.inf  # masked tokens are fine: only the best must be finite
    assert greedy.sample(masked) == 999 and 950 <= hot.sample(masked) <= 999


# --------------------------------------------------------------------------- issue 47: prices and budgets


def _char_view(max_token_bytes: int = 1):
    """A view whose tokens are single characters (ids: code points), and its tokenizer's call count."""
    from shared.text_history import AnswerText

    calls = []

    def tokenize(s: str) -> list[int]:
        calls.append(len(s))
        return [ord(c) for c in s]

    return AnswerText(tokenize, lambda t: chr(t).encode(), max_token_bytes=max_token_bytes), calls


def test_plan_check_marks_the_same_drafts_as_the_pairwise_rule_and_stops_at_the_limit():
    from shared.text_history import TooManyDrafts, plan_check

    view, _ = _char_view()
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 60))
        cuts = sorted({int(x) for x in rng.integers(0, n + 1, int(rng.integers(0, 12)))})
        ranges = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if a < b]
        plan = plan_check(view, [], b"ab", b"x" * n, ranges)
        pairwise = [i for i in range(n) if any(i < b and i + 1 > a for a, b in ranges)]
        assert plan.exact == pairwise and len(plan.drafts) == n
    with pytest.raises(TooManyDrafts, match="at most 8"):
        plan_check(view, [], b"", b"x" * 9, [], max_drafts=8)
    assert len(plan_check(view, [], b"", b"x" * 8, [], max_drafts=8).drafts) == 8


def test_a_proposal_longer_than_any_token_is_none_without_tokenizing():
    view, calls = _char_view(max_token_bytes=4)
    assert view.proposal(b"", b"ab") == -1 and calls == [2]  # two tokens: read, none
    assert view.proposal(b"", b"x" * 1_000_000) == -1 and calls == [2]  # past the longest token: not read


def test_a_key_past_its_engine_budget_waits_and_others_are_served():
    from cloud_server.fair_share import FairShare

    fair = FairShare()
    greedy, other = fair.join("greedy", 1, 6.0), fair.join("other", 2)
    greedy.spend(5.0)
    assert greedy.wait(time.monotonic()) == 0.0  # within its 6 engine seconds
    greedy.spend(1.5)
    wait = greedy.wait(time.monotonic())
    assert 4.0 < wait <= 5.0 and greedy.debts == 1  # 0.5 s of debt repaid at 0.1 s a second
    served, _ = fair.turns({1: greedy, 2: other}, [greedy, other])
    assert served == {2}
    served, _ = fair.turns({1: greedy}, [greedy, other])
    assert served == set()  # it waits even when nobody else asks
    other.spend(1000.0)
    assert other.wait(time.monotonic()) == 0.0  # no budget: no limit


def test_key_files_take_an_engine_budget():
    keys = KeyChecker([f"{digest('alpha')} name=a engine_seconds_per_minute=2.5", "beta"], default=KeyPolicy())
    assert keys.identify("alpha").engine_seconds_per_minute == 2.5
    assert keys.identify("beta").engine_seconds_per_minute is None
    with pytest.raises(ValueError, match="engine_seconds_per_minute="):
        KeyChecker(["k engine_seconds_per_minute=lots"])
