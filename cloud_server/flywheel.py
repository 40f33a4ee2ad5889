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

Rows are buffered per edge model and written when `shard_rows` accumulate
and when a connection closes; writes are atomic.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np

from models.train.shards import make_records, write_shard
from shared.learned_router import N_LOGIT_FEATURES

log = logging.getLogger(__name__)


class FlywheelRecorder:
    def __init__(self, directory: str | Path, cloud_name: str, cloud_fingerprint: str, shard_rows: int = 4096) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cloud_name = cloud_name
        self.cloud_fingerprint = cloud_fingerprint
        self.shard_rows = shard_rows
        self._lock = threading.Lock()
        self._rows: dict[str, list[tuple[np.ndarray, int, int, int]]] = {}
        self._n_written = 0

    def record(self, edge_fingerprint: str, hidden: np.ndarray, proposed: int, cloud_token: int, position: int) -> None:
        """One hard position. Cheap: a copy of the float16 hidden state into a list."""
        if hidden is None or proposed < 0:
            return
        with self._lock:
            rows = self._rows.setdefault(edge_fingerprint, [])
            rows.append((np.asarray(hidden, dtype=np.float16).copy(), int(proposed), int(cloud_token), int(position)))
            full = len(rows) >= self.shard_rows
        if full:
            self.flush(edge_fingerprint)

    def flush(self, edge_fingerprint: str | None = None) -> list[Path]:
        """Write buffered rows (of one edge model, or all) as shards."""
        written: list[Path] = []
        with self._lock:
            keys = [edge_fingerprint] if edge_fingerprint is not None else list(self._rows)
            batches = [(k, self._rows.pop(k, [])) for k in keys]
        for edge_fp, rows in batches:
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
            }
            meta = {
                "source": "flywheel",
                "edge_fingerprint": edge_fp,
                "cloud_fingerprint": self.cloud_fingerprint,
                "cloud_model": self.cloud_name,
                "edge_model": f"live:{edge_fp[:12]}",
                "n_embd": int(hidden.shape[1]),
            }
            with self._lock:
                self._n_written += 1
                index = self._n_written
            path = self.dir / f"live-{edge_fp[:12]}-{time.strftime('%Y%m%d-%H%M%S')}-{index:05d}.npz"
            write_shard(path, make_records(cols, meta))
            log.info("flywheel: wrote %d live positions to %s", n, path)
            written.append(path)
        return written


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
