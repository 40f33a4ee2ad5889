"""The flywheel's recorder trusts no writer (issue 47 #5): rows name their key and session and can be
dropped, widths are checked against the edge model, and writing happens on a worker thread within a
queue and a disk budget, each drop counted. The recorder itself, on a temporary record dir; the
server's side is in tests/test_server_abuse.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import cloud_server.flywheel as flywheel
from cloud_server.auth import digest
from cloud_server.flywheel import ROW_OVERHEAD, SHARD_OVERHEAD, FlywheelRecorder, known_widths
from models.train.cli import main as train_main
from models.train.shards import ORIGIN, load_records, make_records, read_shard, shard_paths, write_shard
from tests.helpers import wait_for

EDGE = "sha256:edge-model"
WIDTH = 8


def recorder(tmp_path, **options) -> FlywheelRecorder:
    return FlywheelRecorder(tmp_path, "cloud", "sha256:cloud", {EDGE: WIDTH}, **options)


def row(value: float = 0.5, width: int = WIDTH) -> np.ndarray:
    return np.full(width, value, dtype=np.float16)


def test_rows_name_their_key_and_session_and_one_keys_rows_can_be_dropped(tmp_path, capsys):
    """A key that claims the honest device's edge model writes crafted rows beside the honest ones: each
    row names its key (the digest, never the key) and its session, and `tokenrouter-train drop-rows --key`
    removes that key's rows and leaves the others; an older shard without the columns still reads."""
    rec = recorder(tmp_path)
    for i in range(3):
        assert rec.record(EDGE, row(0.5), 5, 5, 10 + i, key=digest("honest"), session="s1")
    for i in range(5):
        assert rec.record(EDGE, row(1234.0), 5, 6, 20 + i, key=digest("hostile"), session="s2")
    rec.flush(EDGE)
    assert rec.wait_idle()
    (shard,) = shard_paths([tmp_path])
    r = read_shard(shard)
    assert sorted(set(r["key_digest"])) == sorted([digest("honest"), digest("hostile")])
    assert "hostile" not in {k.split(":")[0] for k in r["key_digest"]}  # digests only
    assert list(r["session_id"]) == ["s1"] * 3 + ["s2"] * 5
    old = tmp_path / "old.npz"  # written before the origin columns existed
    first_two = r.subset(np.arange(len(r)) < 2).columns
    write_shard(old, make_records({k: v for k, v in first_two.items() if k not in ORIGIN}, r.meta))
    with np.load(old) as z:
        assert "key_digest" not in z.files
    assert list(read_shard(old)["key_digest"]) == ["", ""]

    train_main(["drop-rows", str(tmp_path), "--key", "hostile"])  # the key, or its digest
    assert "dropped 5 rows from 1 shards" in capsys.readouterr().out
    kept = read_shard(shard)
    assert len(kept) == 3 and set(kept["key_digest"]) == {digest("honest")}
    assert (kept["hidden"] == np.float16(0.5)).all()
    assert len(read_shard(old)) == 2  # untouched
    assert len(load_records([tmp_path])) == 5  # `fit` reads both
    train_main(["drop-rows", str(tmp_path), "--session", "s1"])
    assert not shard.exists()  # no row left: the shard is gone
    with pytest.raises(SystemExit, match="name the rows to drop"):
        train_main(["drop-rows", str(tmp_path)])


def test_rows_of_another_width_or_model_or_not_finite_are_dropped_and_counted(tmp_path):
    """Issue 47 #5: 65,536-wide hidden states under a 576-wide model's name were recorded. A row is kept
    only at its edge model's width, for a model the cloud knows, with finite values."""
    counted: list[tuple[str, int]] = []
    rec = recorder(tmp_path, on_drop=lambda reason, n: counted.append((reason, n)))
    assert not rec.record(EDGE, row(width=65536), 5, 5, 1)
    assert not rec.record(EDGE, row(width=WIDTH - 1), 5, 5, 1)
    assert not rec.record("sha256:made-up", row(), 5, 5, 1)
    assert not rec.record(EDGE, np.array([np.nan] + [0.0] * (WIDTH - 1), dtype=np.float16), 5, 5, 1)
    assert not rec.record(EDGE, np.array([np.inf] + [0.0] * (WIDTH - 1), dtype=np.float16), 5, 5, 1)
    assert rec.record(EDGE, row(), 5, 5, 1)
    assert rec.dropped == {"width": 2, "unknown_model": 1, "non_finite": 2}
    assert sorted(counted) == sorted([("width", 1)] * 2 + [("unknown_model", 1)] + [("non_finite", 1)] * 2)


def test_the_shipped_routers_edge_model_is_known_at_its_width(edge_info):
    assert known_widths()[edge_info.fingerprint] == 576
    assert known_widths(edge_models=["smollm2-135m-q4_1"]).keys() > {edge_info.fingerprint}


def test_a_slow_writer_never_blocks_recording_and_a_full_queue_drops_and_counts(tmp_path, monkeypatch):
    """The worker thread writes; while it is stuck (a slow disk), `record` still returns at once, and rows
    past the queue's bytes are dropped and counted, never waited for."""
    release = threading.Event()
    real_write = flywheel.write_shard

    def stuck_write(path, records) -> None:
        release.wait(30)
        real_write(path, records)

    monkeypatch.setattr(flywheel, "write_shard", stuck_write)
    row_bytes = WIDTH * 2 + ROW_OVERHEAD
    rec = recorder(tmp_path, shard_rows=1, queue_bytes=10 * row_bytes)
    assert rec.record(EDGE, row(), 5, 5, 0)  # the worker takes it and is stuck writing it
    assert wait_for(lambda: rec._busy and not rec._queue, timeout=5.0, poll_s=0.01)
    t0 = time.perf_counter()
    kept = [rec.record(EDGE, row(), 5, 5, i) for i in range(1, 31)]
    took = time.perf_counter() - t0
    assert kept == [True] * 10 + [False] * 20
    assert rec.dropped["queue_full"] == 20
    assert took < 0.5, f"recording waited for the writer: {took:.2f} s"
    release.set()
    assert rec.wait_idle()
    assert rec.written_rows == 11


def test_the_record_dir_stays_within_its_disk_budget(tmp_path):
    """Past --record-max-mib the rows are dropped and counted; the shards never exceed the budget."""
    budget = 3 * SHARD_OVERHEAD  # room for a few small shards
    rec = recorder(tmp_path, shard_rows=2, max_bytes=budget)
    for i in range(40):
        rec.record(EDGE, row(float(i)), 5, 5, i)
    rec.flush()
    assert rec.wait_idle()
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.npz"))
    assert 0 < on_disk <= budget
    assert rec.dropped["disk_budget"] > 0
    assert rec.written_rows + rec.dropped["disk_budget"] == 40
    again = recorder(tmp_path, shard_rows=1, max_bytes=budget)  # a restart counts what is there
    again.record(EDGE, row(), 5, 5, 0)
    again.flush()
    assert again.wait_idle() and again.dropped["disk_budget"] == 1
