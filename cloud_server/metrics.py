"""Prometheus metrics (`GET /metrics`), one registry per app so tests can run several servers.

Names (all prefixed tokenrouter_):
    sessions, sessions_resident                gauges
    connections_total, hard_tokens_total, device_tokens_total
    batch_items, batch_tokens                  histograms: sessions / tokens per decode
    queue_wait_seconds, decode_seconds         histograms
    hard_token_seconds                         histogram: generate received -> token sent
    kv_cells_used, kv_bytes_used, kv_budget_bytes, kv_saved_bytes
    evictions_total, restores_total{how}       KV budget
    rejections_total{reason}                   refusals: auth, quotas, capacity, limits, abuse
    protocol_errors_total{code}, abuse_flags_total
    sessions_resumed_total, sessions_drained_total   failover: sessions rebuilt here, closed by a drain
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from cloud_server.engine import EngineStats
    from cloud_server.kv_pool import KVPool

P = "tokenrouter_"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.connections = Counter(P + "connections", "WebSocket connections accepted", registry=r)
        self.hard_tokens = Counter(P + "hard_tokens", "Tokens written by the cloud model", registry=r)
        self.device_tokens = Counter(
            P + "device_tokens", "Device-written tokens received (sync and generate)", registry=r
        )
        self.batch_items = Histogram(P + "batch_items", "Sessions served per decode", buckets=_COUNTS, registry=r)
        self.batch_tokens = Histogram(P + "batch_tokens", "Tokens decoded per decode", buckets=_COUNTS, registry=r)
        self.queue_wait = Histogram(
            P + "queue_wait_seconds", "Wait from request to its first batch", buckets=_LATENCY, registry=r
        )
        self.decode_time = Histogram(P + "decode_seconds", "Time of one batched decode", buckets=_LATENCY, registry=r)
        self.hard_token_time = Histogram(
            P + "hard_token_seconds", "Generate received to token sent", buckets=_LATENCY, registry=r
        )
        self.rejections = Counter(P + "rejections", "Refused sessions or requests, by reason", ["reason"], registry=r)
        self.protocol_errors = Counter(
            P + "protocol_errors", "Frames answered with an error, by code", ["code"], registry=r
        )
        self.abuse_flags = Counter(P + "abuse_flags", "Sessions flagged by the abuse check", registry=r)
        self.resumed = Counter(
            P + "sessions_resumed", "Sessions a device rebuilt here after losing its replica mid-answer", registry=r
        )
        self.drained = Counter(
            P + "sessions_drained",
            "Sessions closed 1001 by a drain: between requests at once, after their reply, or at the time limit",
            registry=r,
        )
        self.routing_alarms = Counter(
            P + "routing_alarms",
            "Sessions whose routing left the fleet's band (cloud_server/routing_watch.py), by rate and side",
            ["signal", "side"],
            registry=r,
        )
        self.flywheel_dropped = Counter(
            P + "flywheel_dropped",
            "Flywheel rows not recorded (cloud_server/flywheel.py), by reason: unknown_model, width, non_finite "
            "(refused), queue_full, disk_budget (past --record-queue-mib, --record-max-mib)",
            ["reason"],
            registry=r,
        )
        self.explored = Counter(
            P + "explored", "Exploration requests served (the device's router kept them)", registry=r
        )

    def bind(self, n_sessions: Callable[[], int], kv: KVPool | None = None) -> None:
        """Read gauges on each scrape (no bookkeeping on the hot path): the open sessions, and the KV
        cache's figures where this server holds one (the embedded engine; a remote engine holds its own)."""
        Gauge(P + "sessions", "Open sessions", registry=self.registry).set_function(n_sessions)
        if kv is not None:
            self.registry.register(_EngineCollector(kv))

    # BatchObserver (cloud_server/scheduler.py)
    def on_batch(self, n_items: int, n_tokens: int, decode_s: float) -> None:
        self.batch_items.observe(n_items)
        self.batch_tokens.observe(n_tokens)
        self.decode_time.observe(decode_s)

    def on_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """KV budget figures straight from the KV pool's counters."""

    def __init__(self, kv: KVPool) -> None:
        self.kv = kv

    def collect(self) -> Iterator[Any]:
        e = self.kv
        st: EngineStats = e.stats
        yield GaugeMetricFamily(P + "sessions_resident", "Sessions holding KV cells", value=e.n_resident)
        yield GaugeMetricFamily(P + "kv_cells_used", "KV cells in use", value=e.cells_used)
        yield GaugeMetricFamily(P + "kv_bytes_used", "KV cache bytes in use", value=e.kv_bytes_used)
        yield GaugeMetricFamily(P + "kv_budget_bytes", "KV cache budget in bytes", value=e.kv_budget_bytes)
        yield GaugeMetricFamily(
            P + "kv_saved_bytes", "Host memory held by evicted sessions' saved KV", value=st.saved_bytes
        )
        yield CounterMetricFamily(P + "evictions", "Sessions evicted from the KV cache", value=st.evictions)
        restores = CounterMetricFamily(P + "restores", "Evicted sessions brought back", labels=["how"])
        restores.add_metric(["loaded"], st.restores_loaded)
        restores.add_metric(["recomputed"], st.restores_recomputed)
        yield restores
