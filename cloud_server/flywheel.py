"""The flywheel: record live hard-token requests as training shards (opt-in).

Privacy choice: OFF by default. When an operator starts the server with
`--record-dir DIR`, every `generate` that carries the device's hidden state
records (hidden state, proposed token, cloud token, position) into DIR in the
training shard format (models/train/shards.py), so `tokenrouter-train fit`
can retrain the router on live traffic. No text and no token history is
stored, but a hidden state is a summary of the conversation so far and can
leak some of it: enable this only where users have agreed to it, and treat
DIR as user data.

What live rows lack: the edge's logit features (the cloud never sees the
edge's logits; `fit` fills them with training means) and the divergence label
(no rollout; `fit` uses mismatch = proposed != cloud token instead).

Whoever writes to it is a client, so (issue 47):

* each row names its key (the digest, as the audit log does) and its session, so
  that one key's rows can be dropped (`tokenrouter-train drop-rows --key`);
* a row is kept only for an edge model the cloud knows the width of (the shipped
  routers' edge models, the cloud's own model, `--record-edge-model`), at that
  width, with finite values; the rest are dropped and counted
  (`tokenrouter_flywheel_dropped_total{reason}`);
* the event loop only checks and queues a row: a worker thread buffers the rows
  per (edge model, width) and writes the shards. The queue holds at most
  `queue_bytes` of hidden states and the record dir at most `max_bytes`; past
  either, rows are dropped and counted, never waited for.

Shards are written when `shard_rows` accumulate and when a connection closes;
writes are atomic. The edge model's fingerprint is the client's text: it never
becomes part of a path (file names hold a digest of it).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from cloud_server.config import ServerConfig
from models.registry import ROUTERS_DIR, model_info
from models.train.shards import Records, make_records, write_shard
from shared.learned_router import N_LOGIT_FEATURES, RouterFile
from shared.model_info import ModelInfo

log = logging.getLogger(__name__)
SHARD_BYTES = 16 << 20  # a buffer is written once its hidden states take this much, whatever its rows
ROW_OVERHEAD = 64  # bytes a queued row takes besides its hidden state (tokens, position, key and session)
SHARD_OVERHEAD = 8 << 10  # a shard's bytes besides its columns' (zip headers, meta), at most
DROP_REASONS = ("unknown_model", "width", "non_finite", "queue_full", "disk_budget")


@dataclass(slots=True)
class _Row:
    edge: str  # the edge model's fingerprint, as the client claimed it
    hidden: np.ndarray  # float16
    proposed: int
    cloud_token: int
    position: int
    explored: bool
    key: str  # the key's digest
    session: str


_FLUSH = object()  # a queue item: write every buffer of one edge model (the item after it names which)


class FlywheelRecorder:
    def __init__(
        self,
        directory: str | Path,
        cloud_name: str,
        cloud_fingerprint: str,
        widths: dict[str, int],
        shard_rows: int = 4096,
        queue_bytes: int = 32 << 20,
        max_bytes: int = 1 << 30,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cloud_name = cloud_name
        self.cloud_fingerprint = cloud_fingerprint
        self.widths = dict(widths)  # edge model fingerprint -> its hidden state's width
        self.shard_rows = shard_rows
        self.queue_bytes = queue_bytes
        self.max_bytes = max_bytes
        self.on_drop = on_drop  # (reason, rows): the server's metric
        self.dropped: Counter[str] = Counter()
        self.written_rows = 0
        self.disk_bytes = sum(p.stat().st_size for p in self.dir.glob("*.npz"))  # what earlier runs left
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._queued = 0  # bytes of the rows queued
        self._busy = False  # the worker holds items taken off the queue
        self._rows: dict[tuple[str, int], list[_Row]] = {}  # the worker's buffers (only it touches them)
        self._n_written = 0
        threading.Thread(target=self._work, name="flywheel", daemon=True).start()

    # ------------------------------------------------------------ the event loop's side: O(width), never waits

    def record(
        self,
        edge_fingerprint: str,
        hidden: np.ndarray,
        proposed: int,
        cloud_token: int,
        position: int,
        explored: bool = False,
        key: str = "",
        session: str = "",
    ) -> bool:
        """Queue one hard position (`explored`: asked at random where the device's engine kept it, an
        unbiased label) of `key`'s `session`. False when it was dropped (counted by reason)."""
        if hidden is None or proposed < 0:
            return False
        width = self.widths.get(edge_fingerprint)
        if width is None:
            return self._drop("unknown_model")
        if np.size(hidden) != width:
            return self._drop("width")
        row = np.asarray(hidden, dtype=np.float16).reshape(-1).copy()
        if not np.isfinite(row).all():
            return self._drop("non_finite")
        item = _Row(edge_fingerprint, row, int(proposed), int(cloud_token), int(position), bool(explored), key, session)
        size = row.nbytes + ROW_OVERHEAD
        with self._cond:
            full = self._queued + size > self.queue_bytes
            if not full:
                self._queue.append(item)
                self._queued += size
                self._cond.notify()
        return self._drop("queue_full") if full else True

    def flush(self, edge_fingerprint: str | None = None) -> None:
        """Ask the worker to write the buffered rows (of one edge model, every width; or all)."""
        with self._cond:
            self._queue.extend((_FLUSH, edge_fingerprint))
            self._cond.notify()

    def close(self, timeout: float = 30.0) -> bool:
        """Write every buffered row now (the server's shutdown); False if the worker did not finish in time."""
        self.flush()
        return self.wait_idle(timeout)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until the worker has written everything queued so far (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _drop(self, reason: str, n: int = 1) -> bool:
        self.dropped[reason] += n
        if self.on_drop is not None:
            self.on_drop(reason, n)
        return False

    # ------------------------------------------------------------ the worker's side

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                items = list(self._queue)
                self._queue.clear()
                self._queued = 0
                self._busy = True
            try:
                self._take(items)
            except Exception:  # noqa: BLE001 - a failed write must not end the recorder
                log.exception("flywheel: rows not written")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _take(self, items: list[object]) -> None:
        it = iter(items)
        for item in it:
            if item is _FLUSH:
                edge = next(it)
                self._write([k for k in self._rows if edge is None or k[0] == edge])
                continue
            assert isinstance(item, _Row)
            k = (item.edge, item.hidden.size)
            rows = self._rows.setdefault(k, [])
            rows.append(item)
            if len(rows) >= min(self.shard_rows, max(SHARD_BYTES // item.hidden.nbytes, 1)):
                self._write([k])

    def _write(self, keys: list[tuple[str, int]]) -> None:
        """One shard per (edge model, width) buffer, within the disk budget (past it, its rows are dropped)."""
        for k in keys:
            rows = self._rows.pop(k, [])
            if not rows:
                continue
            records = self._records(k[0], rows)
            size = sum(v.nbytes for v in records.columns.values()) + SHARD_OVERHEAD  # compressed, no bigger
            if self.disk_bytes + size > self.max_bytes:
                self._drop("disk_budget", len(rows))
                continue
            self._n_written += 1
            path = self.dir / f"live-{shard_tag(k[0])}-{time.strftime('%Y%m%d-%H%M%S')}-{self._n_written:05d}.npz"
            write_shard(path, records)
            log.info("flywheel: wrote %d live positions to %s", len(rows), path)
            self.disk_bytes += path.stat().st_size
            self.written_rows += len(rows)

    def _records(self, edge_fp: str, rows: list[_Row]) -> Records:
        n = len(rows)
        proposed = np.array([r.proposed for r in rows])
        cloud = np.array([r.cloud_token for r in rows])
        cols = {
            "hidden": np.stack([r.hidden for r in rows]),
            "logit_feats": np.full((n, N_LOGIT_FEATURES), np.nan, dtype=np.float32),
            "proposed": proposed,
            "cloud_token": cloud,
            "position": np.array([r.position for r in rows]),
            "prompt_id": np.full(n, -1),
            "mismatch": (proposed != cloud).astype(np.int8),
            "divergent": np.full(n, -1),
            "regret": np.full(n, np.nan, dtype=np.float32),
            "explored": np.array([r.explored for r in rows], dtype=np.int8),
            "key_digest": np.array([r.key for r in rows], dtype=str),
            "session_id": np.array([r.session for r in rows], dtype=str),
        }
        meta = {
            "source": "flywheel",
            "edge_fingerprint": edge_fp,
            "cloud_fingerprint": self.cloud_fingerprint,
            "cloud_model": self.cloud_name,
            "edge_model": f"live:{shard_tag(edge_fp)}",
            "n_embd": int(cols["hidden"].shape[1]),
        }
        return make_records(cols, meta)


def shard_tag(edge_fingerprint: str) -> str:
    """A file-name-safe tag for a client's edge model fingerprint: a digest, never the client's text
    (a fingerprint "/../../x" once wrote a shard two folders above the record dir)."""
    return hashlib.sha256(edge_fingerprint.encode("utf-8", "replace")).hexdigest()[:12]


def known_widths(cloud: ModelInfo | None = None, edge_models: list[str] = ()) -> dict[str, int]:
    """Edge model fingerprint -> hidden-state width, for the edge models the cloud knows: those of the
    shipped routers (models/routers), the cloud's own model, and `edge_models` (names or .gguf paths)."""
    widths: dict[str, int] = {}
    for path in sorted(ROUTERS_DIR.glob("*.npz")):
        try:
            meta = RouterFile.load(path).meta
            widths[str(meta["edge_fingerprint"])] = int(meta["n_embd"])
        except (OSError, KeyError, ValueError) as exc:
            log.warning("flywheel: %s names no edge model (%s)", path, exc)
    infos = [cloud] if cloud is not None else []
    infos += [model_info(m) for m in edge_models]
    for info in infos:
        if getattr(info, "header", None) is None:
            continue
        arch = info.header.get("general.architecture")
        width = info.header.get(f"{arch}.embedding_length")
        if width:
            widths[info.fingerprint] = int(width)
    return widths


_recorders: dict[str, FlywheelRecorder] = {}
_recorders_lock = threading.Lock()


def recorder_for(
    config: ServerConfig, cloud: ModelInfo, on_drop: Callable[[str, int], None] | None = None
) -> FlywheelRecorder | None:
    """The process-wide recorder for `config.record_dir` (None when recording is off)."""
    if not config.record_dir:
        return None
    with _recorders_lock:
        rec = _recorders.get(config.record_dir)
        if rec is None:
            rec = _recorders[config.record_dir] = FlywheelRecorder(
                config.record_dir,
                cloud.name,
                cloud.fingerprint,
                known_widths(cloud, config.record_edge_models),
                queue_bytes=config.record_queue_bytes,
                max_bytes=config.record_max_bytes,
                on_drop=on_drop,
            )
        return rec
