"""Per-key quotas and the per-session abuse check.

Why here and not in a gateway: the limits that matter are in tokens, and only
the server counts them. Three checks:

* concurrent sessions per key (refused at hello);
* cloud tokens per minute per key, a token bucket shared by the key's sessions
  (a generate over it gets a `busy` error naming the wait);
* a session's cloud-token fraction: a device whose router is calibrated to
  send, say, 30% of tokens to the cloud has no business sending 90%. Past the
  key's `max_cloud_fraction` (after a warm-up) the session is flagged (metric,
  log, its audit log always kept) and its hard tokens are refused until its
  own tokens bring the fraction back under the cap.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """What one API key may do; None means unlimited."""

    name: str = "anonymous"
    # "sha256:<hex>" of the key (cloud_server/auth.py): what records name it by, never the key; not a limit
    digest: str = field(default="", compare=False)
    max_sessions: int | None = None
    tokens_per_minute: int | None = None
    max_cloud_fraction: float | None = None
    kv_churn_per_minute: int | None = None  # KV cells its sessions may make others recompute (cloud_server/kv_pool.py)
    explore_per_minute: int | None = None  # exploration requests its sessions may make (shared/decision_engine.py)
    engine_seconds_per_minute: float | None = None  # engine time its sessions may use (cloud_server/fair_share.py)


class QuotaExceeded(Exception):
    """A quota refused the request; `reason` says which and what to do."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind  # label for the rejections metric


@dataclass(slots=True)
class _Bucket:
    capacity: float
    rate: float  # tokens per second
    level: float
    t: float = field(default_factory=time.monotonic)

    def take(self, n: float = 1.0) -> float:
        """Take n tokens; returns 0 if granted, else the seconds until they would be."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now
        if self.level >= n:
            self.level -= n
            return 0.0
        return (n - self.level) / self.rate


class Quotas:
    """Live counters per key (thread-safe: the event loop is the only writer, but cheap to guard)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._explore: dict[str, _Bucket] = {}

    def open_session(self, key: KeyPolicy) -> None:
        with self._lock:
            n = self._sessions.get(key.name, 0)
            if key.max_sessions is not None and n >= key.max_sessions:
                raise QuotaExceeded(
                    f"key {key.name!r} already has {n} open sessions, its limit; close one or ask for a higher quota",
                    "key_sessions",
                )
            self._sessions[key.name] = n + 1

    def close_session(self, key: KeyPolicy) -> None:
        with self._lock:
            n = self._sessions.get(key.name, 0) - 1
            if n > 0:
                self._sessions[key.name] = n
            else:
                self._sessions.pop(key.name, None)

    def sessions(self, key_name: str) -> int:
        return self._sessions.get(key_name, 0)

    def take_cloud_tokens(self, key: KeyPolicy, n: int) -> None:
        wait = self._take(self._buckets, key.name, key.tokens_per_minute, n)
        if wait:
            raise QuotaExceeded(
                f"key {key.name!r} used its {key.tokens_per_minute} cloud tokens per minute; retry in {wait:.1f} s",
                "key_tokens_per_minute",
            )

    def take_explore(self, key: KeyPolicy) -> None:
        """One exploration request, from the key's budget (a token bucket shared by its sessions)."""
        if self._take(self._explore, key.name, key.explore_per_minute, 1):
            raise QuotaExceeded(
                f"key {key.name!r} used its {key.explore_per_minute} exploration requests per minute; the device "
                "writes this position",
                "key_explore_per_minute",
            )

    def give_back_explore(self, key: KeyPolicy) -> None:
        """An exploration taken from the key's budget was refused for another reason (busy): it was
        not made, so it costs nothing (a refused request must not spend the budget of the next)."""
        with self._lock:
            b = self._explore.get(key.name)
            if b is not None:
                b.level = min(b.capacity, b.level + 1.0)

    def _take(self, buckets: dict[str, _Bucket], name: str, per_minute: int | None, n: int) -> float:
        """Take `n` from `name`'s bucket of `per_minute` (None: no limit; 0: none at all); returns 0 when
        granted, else the seconds until it would be."""
        if per_minute is None:
            return 0.0
        if per_minute <= 0:
            return float("inf")
        with self._lock:
            b = buckets.get(name)
            if b is None:
                b = buckets[name] = _Bucket(capacity=float(per_minute), rate=per_minute / 60.0, level=float(per_minute))
            return b.take(n)


class SessionGuard:
    """The abuse check for one session: cloud-token fraction against the key's cap."""

    def __init__(self, key: KeyPolicy, warmup_tokens: int = 32) -> None:
        self.cap = key.max_cloud_fraction
        self.warmup_tokens = warmup_tokens
        self.edge_tokens = 0
        self.cloud_tokens = 0
        self.flagged = False
        self.throttled = 0  # hard tokens refused

    def device_tokens(self, n: int) -> None:
        self.edge_tokens += n

    def check_hard_token(self) -> None:
        """Raise QuotaExceeded if one more cloud token would put the session over its cap."""
        if self.cap is None:
            return
        total = self.edge_tokens + self.cloud_tokens + 1
        if total <= self.warmup_tokens:
            return
        fraction = (self.cloud_tokens + 1) / total
        if fraction > self.cap:
            self.flagged = True
            self.throttled += 1
            raise QuotaExceeded(
                f"throttled: this session asks the cloud for {fraction:.0%} of its tokens, over its key's cap of "
                f"{self.cap:.0%}; recalibrate the device's router (policy cloud_fraction)",
                "abuse_cloud_fraction",
            )

    def cloud_token(self) -> None:
        self.cloud_tokens += 1
