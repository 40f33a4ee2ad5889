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

Rows are buffered per edge model and hidden-state width, and written when
`shard_rows` accumulate and when a connection closes; writes are atomic. The
edge model's fingerprint is the client's text: it never becomes part of a
path (file names hold a digest of it), and a session whose hidden states have
another width than its model's others gets a buffer (and shards) of its own,
so it cannot spoil the rows of the sessions it claims to share a model with.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import numpy as np

from models.train.shards import make_records, write_shard
from shared.learned_router import N_LOGIT_FEATURES

log = logging.getLogger(__name__)
_Row = tuple[np.ndarray, int, int, int, bool]  # hidden state, proposed token, cloud token, position, explored
MAX_HIDDEN = 1 << 16  # widest hidden state recorded (a 70B model's is 8192); wider rows are no model's
SHARD_BYTES = 64 << 20  # a buffer is written once its hidden states take this much, whatever its rows


class FlywheelRecorder:
    def __init__(self, directory: str | Path, cloud_name: str, cloud_fingerprint: str, shard_rows: int = 4096) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cloud_name = cloud_name
        self.cloud_fingerprint = cloud_fingerprint
        self.shard_rows = shard_rows
        self._lock = threading.Lock()
        # rows by (edge model fingerprint, hidden-state width): one shard holds rows of one width
        self._rows: dict[tuple[str, int], list[_Row]] = {}
        self._n_written = 0

    def record(
        self,
        edge_fingerprint: str,
        hidden: np.ndarray,
        proposed: int,
        cloud_token: int,
        position: int,
        explored: bool = False,
    ) -> None:
        """One hard position (`explored`: asked at random where the device's engine kept it, an unbiased
        label). Cheap: a copy of the float16 hidden state into a list."""
        if hidden is None or proposed < 0:
            return
        row = np.asarray(hidden, dtype=np.float16).reshape(-1).copy()
        if not 0 < row.size <= MAX_HIDDEN:
            return
        key = (edge_fingerprint, row.size)
        with self._lock:
            rows = self._rows.setdefault(key, [])
            rows.append((row, int(proposed), int(cloud_token), int(position), bool(explored)))
            full = len(rows) >= min(self.shard_rows, SHARD_BYTES // row.nbytes)
        if full:
            self._write([(key, self._take(key))])

    def flush(self, edge_fingerprint: str | None = None) -> list[Path]:
        """Write buffered rows (of one edge model, every width; or all) as shards."""
        with self._lock:
            keys = [k for k in self._rows if edge_fingerprint is None or k[0] == edge_fingerprint]
        return self._write([(k, self._take(k)) for k in keys])

    def _take(self, key: tuple[str, int]) -> list[_Row]:
        with self._lock:
            return self._rows.pop(key, [])

    def _write(self, batches: list[tuple[tuple[str, int], list[_Row]]]) -> list[Path]:
        """One shard per (edge model, width) batch of rows."""
        written: list[Path] = []
        for (edge_fp, _), rows in batches:
            if not rows:
                continue
            n = len(rows)
            hidden = np.stack([r[0] for r in rows])
            proposed = np.array([r[1] for r in rows])
            cloud = np.array([r[2] for r in rows])
            cols = {
                "hidden": hidden,
                "logit_feats": np.full((n, N_LOGIT_FEATURES), np.nan, dtype=np.float32),
                "proposed": proposed,
                "cloud_token": cloud,
                "position": np.array([r[3] for r in rows]),
                "prompt_id": np.full(n, -1),
                "mismatch": (proposed != cloud).astype(np.int8),
                "divergent": np.full(n, -1),
                "regret": np.full(n, np.nan, dtype=np.float32),
                "explored": np.array([r[4] for r in rows], dtype=np.int8),
            }
            meta = {
                "source": "flywheel",
                "edge_fingerprint": edge_fp,
                "cloud_fingerprint": self.cloud_fingerprint,
                "cloud_model": self.cloud_name,
                "edge_model": f"live:{shard_tag(edge_fp)}",
                "n_embd": int(hidden.shape[1]),
            }
            with self._lock:
                self._n_written += 1
                index = self._n_written
            path = self.dir / f"live-{shard_tag(edge_fp)}-{time.strftime('%Y%m%d-%H%M%S')}-{index:05d}.npz"
            write_shard(path, make_records(cols, meta))
            log.info("flywheel: wrote %d live positions to %s", n, path)
            written.append(path)
        return written


def shard_tag(edge_fingerprint: str) -> str:
    """A file-name-safe tag for a client's edge model fingerprint: a digest, never the client's text
    (a fingerprint "/../../x" once wrote a shard two folders above the record dir)."""
    return hashlib.sha256(edge_fingerprint.encode("utf-8", "replace")).hexdigest()[:12]


_recorders: dict[str, FlywheelRecorder] = {}
_recorders_lock = threading.Lock()


def recorder_for(directory: str | None, cloud_name: str, cloud_fingerprint: str) -> FlywheelRecorder | None:
    """The process-wide recorder for `directory` (None when recording is off)."""
    if not directory:
        return None
    with _recorders_lock:
        rec = _recorders.get(directory)
        if rec is None:
            rec = _recorders[directory] = FlywheelRecorder(directory, cloud_name, cloud_fingerprint)
        return rec
