"""Per-session routing audit log, persisted in the compact routing-log format (shared/routing_log.py).

Why on the server too: the device's own log can be lost or forged; the
operator needs to know which tokens its model wrote for whom. Each session
records who wrote every position after its prompt (2 bytes a token) and, at
close, is kept if sampled (`sample_rate`, decided by a hash of the session id
so a restart keeps the same choice) or if the abuse check flagged it.

Layout under `directory`:
    YYYY-MM-DD/<session_id>.trlg     routing log (read with shared.routing_log.read)
    YYYY-MM-DD/index.jsonl           one line per kept session: who, when, counts
Day folders older than `retention_days` are deleted (checked at most hourly).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from shared.routing_log import RoutingLog

log = logging.getLogger(__name__)

_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(slots=True)
class AuditOptions:
    directory: str | None = None  # None: no audit log
    sample_rate: float = 1.0  # fraction of sessions kept (flagged ones always are)
    retention_days: float = 30.0
    token_ids: bool = False  # also store token ids (privacy: off by default)


class SessionAudit:
    """Writers of one session's positions; rollbacks cut the record like they cut the history."""

    def __init__(self, session_id: str, key_name: str, n_prompt: int, token_ids: bool, key_digest: str = "") -> None:
        self.session_id = session_id
        self.key_name = key_name
        self.key_digest = key_digest  # as the flywheel's rows name the key (a key's records can be found and dropped)
        self.start = n_prompt
        self.token_ids = token_ids
        self.t_open = time.time()
        self.flagged = False
        self.alarms: list[str] = []  # the routing watch's (cloud_server/routing_watch.py)
        self._writers = bytearray()  # 1 = cloud
        self._ids: list[int] = []

    def tokens(self, position: int, ids: list[int], cloud: bool) -> None:
        """Tokens appended at `position` (the history length before them)."""
        if position < self.start:  # the device rewrote the prompt (e.g. rollback(0) + sync after a reconnect)
            skip = min(len(ids), self.start - position)
            ids, position = ids[skip:], position + skip
        self.rollback(position)
        self._writers.extend((b"\x01" if cloud else b"\x00") * len(ids))
        if self.token_ids:
            self._ids.extend(ids)

    def rollback(self, position: int) -> None:
        if position < self.start:
            self.start = position
            position = self.start
        keep = position - self.start
        del self._writers[keep:]
        del self._ids[keep:]

    def to_log(self, edge_model: str, cloud_model: str) -> RoutingLog:
        rlog = RoutingLog(
            edge_model=edge_model, cloud_model=cloud_model, start_position=self.start, record_token_ids=self.token_ids
        )
        for i, w in enumerate(self._writers):
            rlog.append("cloud" if w else "edge", None, self._ids[i] if self.token_ids else 0)
        return rlog

    @property
    def n_cloud(self) -> int:
        return sum(self._writers)

    def __len__(self) -> int:
        return len(self._writers)


class AuditLog:
    def __init__(self, options: AuditOptions, cloud_model: str) -> None:
        if not 0.0 <= options.sample_rate <= 1.0:
            raise ValueError(f"audit sample_rate must be within [0, 1], got {options.sample_rate}")
        self.options = options
        self.cloud_model = cloud_model
        self.root = Path(options.directory) if options.directory else None
        self._last_sweep = 0.0
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self.sweep()

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def start(self, session_id: str, key_name: str, n_prompt: int, key_digest: str = "") -> SessionAudit | None:
        if not self.enabled:
            return None
        return SessionAudit(session_id, key_name, n_prompt, self.options.token_ids, key_digest)

    def sampled(self, session_id: str) -> bool:
        h = int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big")
        return h < self.options.sample_rate * 2**64

    def finish(self, audit: SessionAudit, edge_model: str, extra: dict | None = None) -> Path | None:
        """Persist the session if sampled or flagged; returns the file written."""
        if self.root is None or not (audit.flagged or self.sampled(audit.session_id)):
            return None
        day = self.root / datetime.now(timezone.utc).strftime("%Y-%m-%d")
        day.mkdir(parents=True, exist_ok=True)
        path = day / f"{_safe(audit.session_id)}.trlg"
        try:
            path.write_bytes(audit.to_log(edge_model, self.cloud_model).to_bytes())
            entry = {
                "session_id": audit.session_id,
                "key": audit.key_name,
                "key_digest": audit.key_digest,
                "opened": round(audit.t_open, 3),
                "closed": round(time.time(), 3),
                "tokens": len(audit),
                "cloud_tokens": audit.n_cloud,
                "flagged": audit.flagged,
                "file": path.name,
                **(extra or {}),
            }
            with (day / "index.jsonl").open("a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as exc:
            log.error("audit log not written for %s: %s", audit.session_id, exc)
            return None
        if time.monotonic() - self._last_sweep > 3600:
            self.sweep()
        return path

    def sweep(self, now: datetime | None = None) -> int:
        """Delete day folders past retention; returns how many."""
        self._last_sweep = time.monotonic()
        if self.root is None:
            return 0
        cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=self.options.retention_days)
        removed = 0
        for d in self.root.iterdir():
            if d.is_dir() and _DAY.match(d.name):
                day_end = datetime.strptime(d.name, "%Y-%m-%d").replace(tzinfo=timezone.utc) + timedelta(days=1)
                if day_end < cutoff:
                    shutil.rmtree(d, ignore_errors=True)
                    removed += 1
        return removed


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:128]
