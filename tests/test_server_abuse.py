"""The eleven holes of issue 29 and resource abuse beside honest devices, over real servers on loopback.

Each hole a hostile client with a valid key found is a regression test here: a named error or a
clean close, `/healthz` back to 0 sessions, nothing written outside the record dir. Then the
resource-abuse tests: a client that never reads, KV churn over few KV slots, verifies of hundreds of
drafts and long text, each beside an honest device (the product's generator, as `tokenrouter-edge
ask --seed 7` runs it) whose answer must be token for token the one it gives alone, not degraded,
and not much slower (docs/security.md).

Real parts throughout: `tokenrouter-cloud serve` child processes with production flags (keys with
quotas, record dir, audit dir, a small split KV budget), real WebSockets, the bundled models.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from cloud_server.auth import digest
from cloud_server.local import REPO_ROOT, LocalCloudServer
from edge_client.answer import Answer
from edge_client.cloud_link import CloudLink
from edge_client.generator import RoutedGenerator
from edge_client.options import GeneratorOptions
from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, model_info
from models.train.shards import Records, load_records, read_shard, shard_paths
from shared.llama_backend import LlamaModel
from shared.protocol import (
    Accept,
    Error,
    Generate,
    Sync,
    TextReply,
    Tokens,
    Verdict,
    decode,
    encode,
)
from tests.helpers import hello_json, metric, sessions, wait_for

HONEST, HOSTILE = "honest-" + os.urandom(4).hex(), "hostile-" + os.urandom(4).hex()
QUESTION = "what is the capital of france"
N_CTX, KV_SLOTS = 1024, 2  # split layout: 512 KV cells per session, two sessions resident at once
SEND_TIMEOUT_S = 2.0
SEND_QUEUE_BYTES = 16384


# --------------------------------------------------------------------------- plumbing


def no_sessions_left(server: LocalCloudServer) -> None:
    assert wait_for(lambda: sessions(server) == 0, 20), "sessions leaked:\n" + "\n".join(server.log[-30:])


def open_session(server: LocalCloudServer, key: str, info, **over: object) -> tuple[ClientConnection, Accept]:
    ws = connect(server.url, open_timeout=10, compression=None, max_size=None).__enter__()  # closed by the test
    ws.send(hello_json(info, key, QUESTION, **over))
    acc = decode(ws.recv(timeout=30))
    assert isinstance(acc, Accept), acc
    return ws, acc


def reply(ws: ClientConnection, timeout: float = 30.0):
    return decode(ws.recv(timeout=timeout), 1 << 22)


def close_frame(ws: ClientConnection, timeout: float = 15.0):
    """Read until the server closes: its close frame (None: dropped without one)."""
    try:
        while True:
            ws.recv(timeout=timeout)
    except ConnectionClosed as exc:
        return exc.rcvd


def hidden_frame(request_id: int, position: int, width: int, value: float = 0.25) -> bytes:
    """A `generate` with a hidden state of `width` floats (what a device's model of that width sends)."""
    head = json.dumps(
        {
            "type": "generate",
            "request_id": request_id,
            "position": position,
            "tokens": [],
            "proposed": 28,
            "hidden_dim": width,
        }
    ).encode()
    return len(head).to_bytes(4, "big") + head + np.full(width, value, dtype="<f2").tobytes()


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


SHARD_NAME = re.compile(r"live-[0-9a-f]{12}-\d{8}-\d{6}-\d{5}\.npz(\.tmp\.npz)?")  # written, or being written


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """Where the production server may write: records/ and audit/ (keys.txt is the test's)."""
    root = tmp_path_factory.mktemp("abuse")
    (root / "keys.txt").write_text(
        f"{HONEST} name=honest\n{HOSTILE} name=hostile max_sessions=4 kv_churn_per_minute=1024\n"
    )
    return root


@pytest.fixture(scope="module")
def prod(tree):
    """Every production flag: keys with quotas, the flywheel's record dir, the audit log, a small split KV
    budget (two sessions resident), a send budget, the default fair scheduling."""
    args = [
        "--api-keys",
        str(tree / "keys.txt"),
        "--record-dir",
        str(tree / "records"),
        "--audit-dir",
        str(tree / "audit"),
        "--kv-layout",
        "split",
        "--n-ctx",
        str(N_CTX),
        "--kv-slots",
        str(KV_SLOTS),
        "--max-sessions",
        "8",
        "--send-timeout-s",
        str(SEND_TIMEOUT_S),
        "--max-send-queue-bytes",
        str(SEND_QUEUE_BYTES),
        "--max-messages-per-s",
        "100000",
        "--log-level",
        "info",
    ]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        yield server
    outside = files_under(tree) - files_under(tree / "records") - files_under(tree / "audit") - {tree / "keys.txt"}
    assert not outside, f"the server wrote outside its record and audit dirs: {outside}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """No audit dir, no record dir; a key with an abuse cap (the flag's count without an audit log)."""
    keys = tmp_path_factory.mktemp("plain") / "keys.txt"
    keys.write_text(f"{HOSTILE} name=capped max_cloud_fraction=0.25\n")
    args = ["--api-keys", str(keys), "--abuse-warmup-tokens", "4", "--n-ctx", "1024", "--max-sessions", "2"]
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, extra_args=args) as server:
        yield server


# --------------------------------------------------------------------------- 1. text positions inside a character


@pytest.mark.parametrize("text,cut", [("é", 1), ("😀", 2), ("a€", 2)])
def test_a_text_rollback_inside_a_character_is_a_named_error(prod, cloud_info, text, cut):
    ws, acc = open_session(prod, HOSTILE, cloud_info, text_mode="always")
    try:
        assert acc.mode == "text"
        ws.send(json.dumps({"type": "text_sync", "byte_position": 0, "text": text}))
        ws.send(json.dumps({"type": "text_rollback", "byte_position": cut}))
        err = reply(ws)
        assert isinstance(err, Error) and err.code == "bad_field" and "byte_position" in err.message, err
        assert "inside a UTF-8 character" in err.message
        # the session lives on: the answer is as it was, and the cloud writes after it
        n = len(text.encode())
        ws.send(json.dumps({"type": "text_generate", "request_id": 1, "byte_position": n, "text": ""}))
        out = reply(ws)
        assert isinstance(out, TextReply) and out.byte_position == n, out
    finally:
        ws.close()
    no_sessions_left(prod)


def test_a_cloud_span_that_spells_no_character_ends_at_its_last_whole_one(prod, cloud_info):
    """Found by the text-mode fuzzer: asked for a stream after a prompt holding "\\x80", the model writes
    byte tokens that form no UTF-8 character ("\\xc3" then a letter); that became shared text and the
    re-tokenization raised (`internal`). The span now ends at its last whole character."""
    ws, acc = open_session(
        prod, HOSTILE, cloud_info, text_mode="always", messages=[{"role": "user", "content": "J\x80Ç"}]
    )
    try:
        ws.send(
            json.dumps({"type": "text_generate", "request_id": 1, "byte_position": 0, "text": "", "at_word": False})
        )
        pieces = [reply(ws)]
        while isinstance(pieces[-1], TextReply) and not pieces[-1].final:
            pieces.append(reply(ws))
        assert all(isinstance(p, TextReply) for p in pieces), pieces
        end = pieces[-1].byte_position + len(pieces[-1].text.encode())
        ws.send(json.dumps({"type": "text_generate", "request_id": 2, "byte_position": end, "text": " ok"}))
        assert isinstance(reply(ws), TextReply)  # the session goes on from the text both sides hold
    finally:
        ws.close()
    no_sessions_left(prod)


# --------------------------------------------------------------------------- 2, 3. the flywheel's record dir


def session_rows(records: Path, sessions: set[str], n: int, timeout: float = 10.0) -> Records:
    """The flywheel's rows of `sessions` in `records`, once `n` of them are written (the shards are written
    by the recorder's thread after the sessions close; other tests' rows in the same folder are not read)."""

    def mine() -> Records | None:
        parts = [read_shard(p) for p in shard_paths([records])]
        parts = [r.subset(np.isin(r["session_id"], list(sessions))) for r in parts]
        rows = [r for r in parts if len(r)]
        if sum(len(r) for r in rows) < n:
            return None
        return Records({k: np.concatenate([r[k] for r in rows]) for k in rows[0].columns}, rows[0].meta)

    found = wait_for(mine, timeout)
    assert found is not None, f"fewer than {n} rows of sessions {sorted(sessions)} in {records}"
    return found


def dropped(server: LocalCloudServer, reason: str) -> float:
    return metric(server, f'tokenrouter_flywheel_dropped_total{{reason="{reason}"}}')


def test_a_session_with_mixed_hidden_widths_leaks_nothing_and_spoils_no_other_rows(prod, cloud_info, edge_info, tree):
    """Issue 29 #2: a 576-wide then a 10-wide hidden state, nine rounds (more than --max-sessions): each
    session is released. Issue 47 #5: the edge model is 576 wide, so the 10-wide rows are dropped and
    counted; the 576-wide ones are kept beside an honest session's, each under its own session."""
    records = tree / "records"
    width0 = dropped(prod, "width")
    mine = set()
    for _ in range(9):
        ws, acc = open_session(prod, HOSTILE, cloud_info, edge_model=edge_info.fingerprint)
        mine.add(acc.session_id)
        ws.send(hidden_frame(1, acc.n_prompt, 576))
        assert isinstance(reply(ws), Tokens)
        ws.send(hidden_frame(2, acc.n_prompt + 1, 10))
        assert isinstance(reply(ws), Tokens)
        ws.close()
        no_sessions_left(prod)
    ws, acc = open_session(prod, HONEST, cloud_info, edge_model=edge_info.fingerprint)  # the server is not full
    mine.add(acc.session_id)
    ws.send(hidden_frame(1, acc.n_prompt, 576))
    assert isinstance(reply(ws), Tokens)
    ws.close()
    no_sessions_left(prod)
    rows = session_rows(records, mine, 10)
    assert len(rows) == 10 and rows["hidden"].shape[1] == 576  # nine hostile rows and the honest one
    assert set(rows["session_id"]) == mine
    assert dropped(prod, "width") - width0 == 9


def test_record_file_names_come_from_a_digest_never_from_client_text(prod, cloud_info, tree):
    """Issue 29 #3: an edge model fingerprint "/../../TRAV" wrote a shard two folders above the record dir.
    Such a model is no model the cloud knows: its rows are dropped (counted), and no path holds its text."""
    records = tree / "records"
    before = files_under(tree.parent)
    unknown0 = dropped(prod, "unknown_model")
    tag = os.urandom(3).hex()  # this test's edge models, told apart from any other test's
    fps = {f"/../../TRAV{tag}", f"../TRAV2{tag}", f"x/../../../TRAV3{tag}", f"C:\\\\TRAV4{tag}", f"TRAV5\u00e9{tag}"}
    for fp in sorted(fps):
        ws, acc = open_session(prod, HOSTILE, cloud_info, edge_model=fp)
        ws.send(hidden_frame(1, acc.n_prompt, 8))
        assert isinstance(reply(ws), Tokens)
        ws.close()
    no_sessions_left(prod)
    assert dropped(prod, "unknown_model") - unknown0 == len(fps)
    new = files_under(tree.parent) - before
    assert all(p.parent == records or (tree / "audit") in p.parents for p in new), new
    assert all(SHARD_NAME.fullmatch(p.name) for p in files_under(records)), files_under(records)
    assert not any("TRAV" in str(p) for p in files_under(tree.parent)), "a client's text became part of a path"


def test_crafted_rows_name_their_key_and_session_and_that_keys_rows_can_be_dropped(
    prod, cloud_info, edge_info, tree, tmp_path
):
    """Issue 47 #5: a key that claims the honest device's edge model sent crafted rows (hidden states of
    1234.0) into the shard beside the honest rows, with nothing to tell them apart. Each row now names
    its key's digest and its session, and `tokenrouter-train drop-rows --key` removes that key's rows
    from a copy of the record dir, leaving the honest session's rows."""
    sessions = {}
    for key, value, n in ((HONEST, 0.25, 3), (HOSTILE, 1234.0, 12)):
        ws, acc = open_session(prod, key, cloud_info, edge_model=edge_info.fingerprint)
        sessions[key] = acc.session_id
        for i in range(n):
            ws.send(hidden_frame(i + 1, acc.n_prompt + i, 576, value))
            assert isinstance(reply(ws), Tokens)
        ws.close()
    no_sessions_left(prod)
    rows = session_rows(tree / "records", set(sessions.values()), 15)
    crafted = (rows["hidden"] == np.float16(1234.0)).all(axis=1)
    assert crafted.sum() == 12
    assert set(rows["key_digest"][crafted]) == {digest(HOSTILE)}
    assert set(rows["session_id"][crafted]) == {sessions[HOSTILE]}
    assert set(rows["key_digest"][~crafted]) == {digest(HONEST)}
    copy = tmp_path / "records"  # the test's own copy: other tests' shards stay as they are
    copy.mkdir()
    for p in shard_paths([tree / "records"]):
        shutil.copy(p, copy / p.name)
    run = subprocess.run(
        [sys.executable, "-m", "models.train.cli", "drop-rows", str(copy), "--key", digest(HOSTILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    left = load_records([copy]) if shard_paths([copy]) else None
    kept = [read_shard(p) for p in shard_paths([copy])]
    assert not any((r["key_digest"] == digest(HOSTILE)).any() for r in kept)
    assert sum(int((r["session_id"] == sessions[HONEST]).sum()) for r in kept) == 3
    assert left is not None and len(left) == sum(len(r) for r in kept)


# --------------------------------------------------------------------------- 4. the abuse flag, once per session


def test_the_abuse_flag_counts_once_per_session_without_an_audit_dir(plain, cloud_info):
    """Issue 29 #4: 70 refused generates gave 32 "flagged" warnings when --audit-dir was off."""
    no_sessions_left(plain)  # nothing an earlier test left can be flagged inside this one's count
    flags0 = metric(plain, "tokenrouter_abuse_flags_total ")
    mark = plain.log_mark()
    for _ in range(2):  # two sessions: one flag each
        ws, acc = open_session(plain, HOSTILE, cloud_info)
        position, refused = acc.n_prompt, 0
        for i in range(24):  # only hard tokens: over the key's 25% cap after 4 tokens (32 errors would close)
            ws.send(encode(Generate(request_id=i + 1, position=position, tokens=[])))
            r = reply(ws)
            if isinstance(r, Error):
                assert r.code == "busy" and "throttled" in r.message, r
                refused += 1
            else:
                position += 1
        assert refused >= 15
        ws.close()
    no_sessions_left(plain)
    assert metric(plain, "tokenrouter_abuse_flags_total ") - flags0 == 2
    assert wait_for(lambda: sum("flagged" in line for line in plain.log_since(mark)) == 2, 5), plain.log[-20:]


# --------------------------------------------------------------------------- 5. a client that never reads


def never_reader(server: LocalCloudServer, key: str, info, rcvbuf: int = 2048) -> tuple[ClientConnection, Accept]:
    """A real socket with a tiny receive buffer whose owner will read nothing after the accept."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    ws = connect(server.url, sock=sock, compression=None, max_queue=1).__enter__()  # closed by the caller
    ws.send(hello_json(info, key, "write a very long poem about the sea"))
    acc = decode(ws.recv(timeout=30))
    assert isinstance(acc, Accept), acc
    return ws, acc


def ask_forever(ws: ClientConnection, acc: Accept, n: int = 400) -> None:
    """Hard tokens one at a time at the positions they will take (the answer's end cannot stop the
    stream), from a thread: the sends block once the server stops reading this client."""

    def send() -> None:
        try:
            for i in range(n):
                ws.send(encode(Generate(request_id=i + 1, position=acc.n_prompt + i, tokens=[])))
        except (ConnectionClosed, OSError):
            pass

    threading.Thread(target=send, daemon=True).start()


def test_a_client_that_never_reads_is_closed_by_its_send_budget(prod, cloud_info):
    """Issue 29 #5: a 2 KB receive buffer, long generations asked, nothing read: the server streamed
    1,735 tokens (308 KB queued) and dropped it only at 40 s. Now its session ends once its unread
    replies pass the byte budget or the oldest is older than --send-timeout-s, with a named reason."""
    slow0 = metric(prod, 'tokenrouter_rejections_total{reason="slow_reader"}')
    ws, acc = never_reader(prod, HOSTILE, cloud_info)
    t0 = time.monotonic()
    ask_forever(ws, acc)
    assert wait_for(lambda: sessions(prod) == 0, 30), "the never-reading client's session was not ended"
    took = time.monotonic() - t0
    assert took < SEND_TIMEOUT_S + 8, f"ended after {took:.1f} s (send timeout {SEND_TIMEOUT_S} s)"
    assert metric(prod, 'tokenrouter_rejections_total{reason="slow_reader"}') == slow0 + 1
    frame = close_frame(ws, timeout=10)  # what the kernel buffers held, then the close frame if it fit
    if frame is not None:
        assert frame.code == 1008 and "slow reader" in frame.reason, frame
    ws.close()


def test_the_send_budget_counts_unread_bytes_and_their_age_on_a_real_socket():
    """In-process, on a real loopback TCP pair whose reader never reads: the budget trips on bytes past
    its limit, and on the age of the oldest unread frame, and not while the reader keeps up."""
    from cloud_server.app import _SendBudget

    async def main() -> tuple[str, str, str]:
        accepted: asyncio.Queue = asyncio.Queue()

        async def on_client(reader, writer) -> None:
            await accepted.put(writer)

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        results = []
        for limit, age in ((8192, 60.0), (1 << 20, 0.5), (1 << 20, 0.5)):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            sock.connect(("127.0.0.1", port))
            sock.setblocking(False)
            writer = await accepted.get()
            budget = _SendBudget(writer.transport, limit, age)
            frame = b"x" * 200
            reads = len(results) == 2  # the third reader keeps up
            verdict = ""
            t_end = time.monotonic() + 3
            while not verdict and time.monotonic() < t_end:
                writer.write(frame)
                verdict = budget.sent(len(frame) - budget._HEADER)
                await asyncio.sleep(0.01)
                if reads:
                    try:
                        while sock.recv(65536):
                            pass
                    except BlockingIOError:
                        pass
            results.append(verdict)
            writer.transport.abort()
            sock.close()
        server.close()
        return tuple(results)  # type: ignore[return-value]

    by_bytes, by_age, kept_up = asyncio.run(main())
    assert by_bytes.startswith("slow reader:") and "bytes of replies unread" in by_bytes, by_bytes
    assert by_age.startswith("slow reader:") and "unread for" in by_age, by_age
    assert kept_up == "", kept_up


# --------------------------------------------------------------------------- 6. KV churn: a budget per key


def test_kv_churn_past_its_key_budget_is_refused_by_name_and_falls_on_its_own_sessions(prod, cloud_info):
    """Issue 29 #6: over two KV slots, sessions that sync 20-120 tokens and generate one in a loop made
    honest sessions recompute their KV again and again. A key's sessions evict their own first, and
    once they made others recompute more than the key's budget (1024 cells a minute here), a request
    that would evict again is refused with `busy` naming the KV churn, until the budget refills."""
    honest_ws, honest_acc = open_session(prod, HONEST, cloud_info)
    honest_ws.send(encode(Generate(request_id=1, position=honest_acc.n_prompt, tokens=[])))
    assert isinstance(reply(honest_ws), Tokens)
    links = [open_session(prod, HOSTILE, cloud_info) for _ in range(3)]  # three sessions, two KV slots
    held = [acc.n_prompt for _, acc in links]
    rng = np.random.default_rng(7)
    refusals: list[str] = []
    try:
        for _ in range(3):  # each round: every session needs a slot, so each evicts a sibling (~130-340 cells)
            for i, (ws, _) in enumerate(links):
                tokens = [int(t) for t in rng.integers(100, 40000, 100)]
                ws.send(encode(Generate(request_id=2, position=held[i], tokens=tokens)))
                got = reply(ws, 60)
                if isinstance(got, Error):  # refused: nothing kept, the session as it was
                    assert got.code == "busy", got
                    refusals.append(got.message)
                else:
                    assert isinstance(got, Tokens) and got.position == held[i] + 100, got
                    held[i] += 101
        assert refusals and all("KV churn" in m and "'hostile'" in m and "retry in" in m for m in refusals), refusals
        # the honest session kept its slot all along: its next token needs no recompute and comes at once
        honest_ws.send(encode(Generate(request_id=2, position=honest_acc.n_prompt + 1, tokens=[])))
        assert isinstance(reply(honest_ws), Tokens)
    finally:
        for ws, _ in links:
            ws.close()
        honest_ws.close()
    no_sessions_left(prod)


# --------------------------------------------------------------------------- 7. a full server: a degraded answer


def test_a_full_server_is_a_degraded_answer_on_the_device(plain, cloud_info):
    """Issue 29 #7: `tokenrouter-edge ask` exited with rc 1 ("cloud rejected the session (busy)") when
    another key held every session. It answers alone, marked degraded, with the reason."""
    held = [open_session(plain, HOSTILE, cloud_info)[0] for _ in range(2)]  # --max-sessions 2
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "edge_client.cli",
                "ask",
                QUESTION,
                "--cloud",
                plain.url,
                "--api-key",
                plain.api_key,
                "--seed",
                "7",
                "--max-tokens",
                "12",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
            timeout=300,
            cwd=REPO_ROOT,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        answer = json.loads(out.stdout)
        assert answer["degraded"] is True and answer["n_tokens"] > 0 and answer["n_cloud_tokens"] == 0, answer
        assert "full" in answer["degraded_reason"] and "session" in answer["degraded_reason"], answer
    finally:
        for ws in held:
            ws.close()
    no_sessions_left(plain)


# --------------------------------------------------------------------------- 8. accept's limits, verify chunks


def test_accept_announces_a_verify_limit_that_fits_after_the_prompt(prod, cloud_info):
    """Issue 29 #8: in the split layout `accept` said 511 drafts where a session with its prompt could
    verify 478. Now it announces what fits, a verify of that many drafts is served, one more refused."""
    ws, acc = open_session(prod, HOSTILE, cloud_info)
    try:
        cells = N_CTX // KV_SLOTS
        assert acc.max_verify_tokens == min(511, cells - acc.n_prompt), acc
        n = acc.max_verify_tokens
        ws.send(json.dumps({"type": "verify", "request_id": 1, "position": acc.n_prompt, "tokens": [28] * (n + 1)}))
        err = reply(ws)
        assert isinstance(err, Error) and err.code in ("context_full", "bad_field"), err
        ws.send(
            json.dumps(
                {
                    "type": "verify",
                    "request_id": 2,
                    "position": acc.n_prompt,
                    "tokens": [28] * n,
                    "check": [],
                    "tolerance": 1000,
                }
            )
        )
        v = reply(ws, 120)
        assert isinstance(v, Verdict) and v.accepted == n and v.token == -1, v
    finally:
        ws.close()
    no_sessions_left(prod)


# --------------------------------------------------------------------------- 9. what the server refuses it does not keep


def test_text_refused_as_context_full_is_neither_kept_nor_read_again(prod, cloud_info):
    """Issue 29 #9: four 1 MB `text_sync` frames, each answered context_full, were kept anyway, and every
    later 1-byte `text_sync` re-read them (1 s of engine time each). Now a refused text leaves the answer
    as it was, and what follows costs what it would have cost without it."""
    proc = psutil.Process(prod.proc.pid)
    ws, acc = open_session(prod, HOSTILE, cloud_info, text_mode="always")
    try:
        big = "a" * 1_000_000
        t0 = time.monotonic()
        for _ in range(4):
            ws.send(json.dumps({"type": "text_sync", "byte_position": 0, "text": big}))
            err = reply(ws)
            assert isinstance(err, Error) and err.code == "context_full", err
        refused_s = time.monotonic() - t0
        rss = proc.memory_info().rss
        t0 = time.monotonic()
        ws.send(json.dumps({"type": "text_sync", "byte_position": 0, "text": "P"}))  # at 0: nothing was kept
        ws.send(json.dumps({"type": "text_generate", "request_id": 1, "byte_position": 1, "text": "aris"}))
        out = reply(ws)
        assert isinstance(out, TextReply) and out.byte_position == 5, out
        assert time.monotonic() - t0 < 5 and refused_s < 10, (refused_s, time.monotonic() - t0)
        assert proc.memory_info().rss - rss < 16 << 20
        # token mode: a sync that cannot fit is refused before it is kept
        ws2, acc2 = open_session(prod, HOSTILE, cloud_info)
        ws2.send(encode(Sync(position=acc2.n_prompt, tokens=[28] * (N_CTX // KV_SLOTS))))
        err = reply(ws2)
        assert isinstance(err, Error) and err.code == "context_full", err
        ws2.send(encode(Generate(request_id=1, position=acc2.n_prompt, tokens=[])))  # the history is as before
        assert isinstance(reply(ws2), Tokens)
        ws2.close()
    finally:
        ws.close()
    no_sessions_left(prod)


# --------------------------------------------------------------------------- 10. tracebacks before auth


def raw_text_frame(port: int, payload: bytes) -> bytes:
    """Open a WebSocket by hand and send one text frame holding `payload` (not UTF-8: no client
    library would send it); returns what the server sent back before closing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        (
            "GET /v1/route HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    mask = os.urandom(4)
    s.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except OSError:
        pass
    s.close()
    return out


def test_tracebacks_before_any_key_are_rate_limited(plain):
    """Issue 29 #10: 20 text frames holding the byte 0xff on 20 unauthenticated connections wrote 20
    tracebacks (uvicorn's, before our code runs) in one second; one per 10 s is the promise."""
    mark = plain.log_mark()
    for _ in range(20):
        back = raw_text_frame(plain.port, b"\xff")
        assert back[:1] == b"\x88", back  # a close frame (1007, invalid data), not a dropped socket
    time.sleep(0.5)
    lines = plain.log_since(mark)
    assert sum("Traceback" in line for line in lines) <= 1, "\n".join(lines)
    assert sessions(plain) == 0


# --------------------------------------------------------------------------- 11. a verify's scratch memory


def test_a_long_verify_returns_its_scratch_memory(prod, cloud_info):
    """Issue 29 #11: one 511-draft verify with a tolerance took the server from ~395 to ~587 MB for good
    (the logits of every draft at once). A verify is judged in bounded chunks: RSS stays near rest."""
    proc = psutil.Process(prod.proc.pid)
    ws, acc = open_session(prod, HOSTILE, cloud_info)
    try:

        def verify(n: int, rid: int) -> None:
            ws.send(
                json.dumps(
                    {
                        "type": "verify",
                        "request_id": rid,
                        "position": acc.n_prompt,
                        "tokens": [28] * n,
                        "check": [],
                        "tolerance": 1000,
                    }
                )
            )
            v = reply(ws, 120)
            assert isinstance(v, Verdict) and v.accepted == n, v
            ws.send(json.dumps({"type": "rollback", "position": acc.n_prompt}))

        verify(64, 1)  # warm: one chunk's buffers
        time.sleep(0.3)
        rest = proc.memory_info().rss
        verify(acc.max_verify_tokens, 2)
        time.sleep(0.3)
        grew = proc.memory_info().rss - rest
        assert grew < 24 << 20, f"a {acc.max_verify_tokens}-draft verify kept {grew >> 20} MiB"
    finally:
        ws.close()
    no_sessions_left(prod)


# --------------------------------------------------------------------------- resource abuse beside honest devices


@pytest.fixture(scope="module")
def edge():
    model = LlamaModel(model_info(DEFAULT_EDGE_MODEL))
    yield model
    model.close()


def honest_answer(server: LocalCloudServer, edge: LlamaModel) -> tuple[Answer, float]:
    """What `tokenrouter-edge ask --seed 7` answers against `server` (a fresh generator each time, as a
    fresh process has), and its wall time in seconds."""
    opts = GeneratorOptions(cloud=server.url, api_key=HONEST, seed=7, max_tokens=40)
    gen = RoutedGenerator(edge, opts, lambda: CloudLink(server.url, HONEST, timeout_s=opts.cloud_timeout_s))
    try:
        t0 = time.perf_counter()
        answer = gen.generate(
            [{"role": "system", "content": opts.system_prompt}, {"role": "user", "content": QUESTION}]
        )
        return answer, time.perf_counter() - t0
    finally:
        gen.close()


class Abuser(threading.Thread):
    """Runs one kind of resource abuse against the server until stopped; counts what it got."""

    def __init__(self, server: LocalCloudServer, info, kind: str) -> None:
        super().__init__(daemon=True)
        self.server, self.info, self.kind = server, info, kind
        self.stop = threading.Event()
        self.rounds = 0
        self.codes: dict[str, int] = {}
        self.failure: BaseException | None = None

    def count(self, what: str) -> None:
        self.codes[what] = self.codes.get(what, 0) + 1

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                getattr(self, self.kind)()
                self.rounds += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc

    def never_reading(self) -> None:
        dropped = 'tokenrouter_rejections_total{reason="slow_reader"}'
        before = metric(self.server, dropped)
        ws, acc = never_reader(self.server, HOSTILE, self.info)
        try:
            ask_forever(ws, acc)
            ended = wait_for(lambda: metric(self.server, dropped) > before, SEND_TIMEOUT_S + 15)
            self.count("closed as a slow reader" if ended else "never closed")
        finally:
            ws.socket.close()

    def kv_churn(self) -> None:
        """Two sessions of one key, each: sync 20-120 random tokens, generate one, roll back; over two KV slots."""
        rng = np.random.default_rng(self.rounds)
        links = [open_session(self.server, HOSTILE, self.info) for _ in range(2)]
        try:
            for _ in range(6):
                for ws, acc in links:
                    n = int(rng.integers(20, 121))
                    ws.send(encode(Sync(position=acc.n_prompt, tokens=[int(t) for t in rng.integers(100, 40000, n)])))
                    ws.send(encode(Generate(request_id=1, position=acc.n_prompt + n, tokens=[])))
                    r = reply(ws, 60)
                    while isinstance(r, Error) and r.request_id is None:  # the sync's refusal, then the generate's
                        self.count(r.code)
                        r = reply(ws, 60)
                    self.count(r.code if isinstance(r, Error) else r.type)
                    ws.send(json.dumps({"type": "rollback", "position": acc.n_prompt}))
                    if self.stop.is_set():
                        return
        finally:
            for ws, _ in links:
                ws.close()

    def long_verify(self) -> None:
        """Verifies of every draft a session may carry (all within the tolerance: every chunk is judged)."""
        ws, acc = open_session(self.server, HOSTILE, self.info)
        try:
            for i in range(6):
                ws.send(
                    json.dumps(
                        {
                            "type": "verify",
                            "request_id": i + 1,
                            "position": acc.n_prompt,
                            "tokens": [28] * acc.max_verify_tokens,
                            "check": [],
                            "tolerance": 1000,
                        }
                    )
                )
                r = reply(ws, 120)
                self.count(r.code if isinstance(r, Error) else r.type)
                ws.send(json.dumps({"type": "rollback", "position": acc.n_prompt}))
                if self.stop.is_set():
                    return
        finally:
            ws.close()

    def long_text(self) -> None:
        """Text mode: a megabyte refused, then text that fits (hundreds of tokens to prefill), rolled back."""
        ws, acc = open_session(self.server, HOSTILE, self.info, text_mode="always")
        try:
            for i in range(4):
                ws.send(json.dumps({"type": "text_sync", "byte_position": 0, "text": "a" * 1_000_000}))
                r = reply(ws, 60)
                self.count(r.code if isinstance(r, Error) else r.type)
                ws.send(json.dumps({"type": "text_sync", "byte_position": 0, "text": "the sea is wide. " * 24}))
                ws.send(
                    json.dumps({"type": "text_generate", "request_id": i + 1, "byte_position": 17 * 24, "text": ""})
                )
                r = reply(ws, 60)
                self.count(r.code if isinstance(r, Error) else r.type)
                ws.send(json.dumps({"type": "text_rollback", "byte_position": 0}))
                if self.stop.is_set():
                    return
        finally:
            ws.close()


@pytest.mark.parametrize("kind", ["never_reading", "kv_churn", "long_verify", "long_text"])
def test_honest_devices_are_unchanged_beside_resource_abuse(prod, cloud_info, edge, kind):
    """An honest device answers beside each kind of abuse exactly as it does alone (token for token), not
    degraded, without cloud timeouts, and not much slower: the abuser is slowed or refused first.

    Timing on this shared 2-core machine: the honest device's own model and the server share the cores
    with the abuser's traffic and other jobs, so the bound is 1.5x an alone run measured here, in this
    test, plus 0.5 s of room for that noise (measured ratios are in docs/server.md)."""
    alone = [honest_answer(prod, edge) for _ in range(2)]
    ref, t_alone = alone[0][0], min(t for _, t in alone)
    assert not ref.degraded and ref.n_cloud_tokens > 0, ref.to_json()
    assert alone[1][0].tokens == ref.tokens, "the honest device is not reproducible even alone"
    abuser = Abuser(prod, cloud_info, kind)
    abuser.start()
    try:
        time.sleep(1.5)  # the abuse is under way before the honest device asks
        beside = [honest_answer(prod, edge) for _ in range(3)]
    finally:
        abuser.stop.set()
        abuser.join(timeout=120)
    assert abuser.failure is None, repr(abuser.failure)
    assert abuser.rounds >= 1 or abuser.codes, (kind, abuser.codes)
    assert "internal" not in abuser.codes and "never closed" not in abuser.codes, abuser.codes
    times = [round(t, 2) for _, t in beside]
    waits = [round(a.traffic.wait_ms) for a, _ in alone + beside]
    print(f"{kind}: alone {t_alone:.2f} s, beside {times}, cloud waits (ms) {waits}, abuser {abuser.codes}")
    for answer, _ in beside:
        assert not answer.degraded and answer.cloud_timeouts == 0, (kind, answer.to_json())
        assert answer.tokens == ref.tokens, (kind, ref.text, answer.text)
    # the bound, 1.5x the time alone, plus 0.5 s for this shared machine's noise; the best of three runs
    assert min(t for _, t in beside) <= 1.5 * t_alone + 0.5, (kind, t_alone, times)
    no_sessions_left(prod)


def test_a_burst_of_wide_hidden_states_blocks_neither_healthz_nor_an_honest_device(prod, cloud_info, edge, edge_info):
    """Issue 47 #5: 512 generates with 65,536-wide hidden states under the honest device's edge model
    (576 wide) had a 64 MiB shard compressed on the event loop: /healthz was blocked 5.4 s and the
    honest device took 2.4x its time, with cloud timeouts. Now such rows are refused by width before
    anything is kept, and shards are written by the recorder's thread: bursts of 120 such generates,
    each closed (before, the close wrote their 15 MiB on the event loop: /healthz waited 912 ms),
    beside /healthz (answers within 100 ms) and an honest device (its answer unchanged, not degraded,
    within 1.5x its time alone plus 0.5 s of this machine's noise)."""
    alone = [honest_answer(prod, edge) for _ in range(2)]
    ref, t_alone = alone[0][0], min(t for _, t in alone)
    width0 = dropped(prod, "width")
    stop, bursts, worst = threading.Event(), [0], [0.0]

    def burst() -> None:
        rng = np.random.default_rng(1)
        while not stop.is_set():
            ws, acc = open_session(prod, HOSTILE, cloud_info, edge_model=edge_info.fingerprint)
            try:
                for i in range(120):
                    head = json.dumps(
                        {
                            "type": "generate",
                            "request_id": i + 1,
                            "position": acc.n_prompt + i,
                            "tokens": [],
                            "proposed": 28,
                            "hidden_dim": 65536,
                        }
                    ).encode()
                    payload = rng.standard_normal(65536).astype("<f2").tobytes()
                    ws.send(len(head).to_bytes(4, "big") + head + payload)
                    assert isinstance(reply(ws, 60), Tokens)
            finally:
                ws.close()
            bursts[0] += 1

    def healthz() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            sessions(prod)
            worst[0] = max(worst[0], time.perf_counter() - t0)
            time.sleep(0.02)

    threads = [threading.Thread(target=f, daemon=True) for f in (burst, healthz)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        beside = [honest_answer(prod, edge) for _ in range(3)]
        assert wait_for(lambda: bursts[0] >= 2, 120), "the bursts did not run"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    times = [round(t, 2) for _, t in beside]
    print(
        f"wide bursts: {bursts[0]}, /healthz worst {worst[0] * 1000:.0f} ms, honest alone {t_alone:.2f} s, "
        f"beside {times}"
    )
    assert worst[0] < 0.1, f"/healthz took {worst[0] * 1000:.0f} ms beside the bursts"
    assert dropped(prod, "width") - width0 >= 240  # every wide row refused, counted
    for answer, _ in beside:
        assert not answer.degraded and answer.cloud_timeouts == 0, answer.to_json()
        assert answer.tokens == ref.tokens, (ref.text, answer.text)
    assert min(t for _, t in beside) <= 1.5 * t_alone + 0.5, (t_alone, times)
    no_sessions_left(prod)
