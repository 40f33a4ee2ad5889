"""What one routed answer produces: a stream of token events and one final record.

These types are the contract between the routed generator (text in, tokens out)
and everything that consumes an answer: the CLI, the voice pipeline, the replay
harness (which stores `Answer.to_json()` rows). They hold no model or network state.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from shared.protocol import WORK_FIELDS, Work

Route = Literal["edge", "cloud"]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One accepted token of an answer, emitted as soon as it is released."""

    index: int  # position within the answer (0 = first generated token)
    token_id: int
    text: str  # the token's text; multi-byte characters complete on a later token
    route: Route  # which model wrote it
    score: float | None  # router score at this position (None when not computed)
    lookahead: bool = False  # the cloud's lookahead guess decided this position (taken, or near enough to keep)
    overruled: bool = False  # the cloud's check replaced the device's unflagged token here


@dataclass(slots=True)
class Traffic:
    """Cloud traffic of a link, a session or one answer (the difference of two totals)."""

    bytes_up: int = 0
    bytes_down: int = 0
    round_trips: int = 0
    cloud_compute_ms: float = 0.0  # all cloud model time, background prefill included
    wait_ms: float = 0.0  # device time spent waiting on cloud replies (network + cloud compute)
    background_ms: float = 0.0  # the part of cloud_compute_ms done while the device was not waiting
    # Failovers (edge_client/cloud_session.py): sessions rebuilt on another replica mid-answer; the time from
    # each loss to its rebuilt session; a request lost in flight and asked again: its wait on the new replica,
    # and the part of it that replica spent prefilling the history. Time lost: failover_ms + resume_ms.
    reconnects: int = 0
    failover_ms: float = 0.0
    resume_ms: float = 0.0
    resume_prefill_ms: float = 0.0
    # the cloud model's work, reported with its replies (protocol v2; shared/protocol.py `Work`): units
    # that carry over to a GPU (docs/server.md, "what it costs on a GPU"); 0 from a v1 server
    work: Work = field(default_factory=Work)

    @property
    def failover_lost_ms(self) -> float:
        """The time the answer lost to failovers: rebuilding the sessions, and the requests asked again."""
        return self.failover_ms + self.resume_ms

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, f) + getattr(other, f) for f in _SCALARS), work=self.work + other.work)

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, f) - getattr(other, f) for f in _SCALARS), work=self.work - other.work)

    def to_json(self) -> dict[str, float]:
        """Flat: the traffic's figures, then the work's fields (a replay row's `traffic`)."""
        d = {f: getattr(self, f) for f in _SCALARS} | {f: getattr(self.work, f) for f in WORK_FIELDS}
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


_SCALARS = tuple(f.name for f in fields(Traffic) if f.name != "work")


@dataclass(slots=True)
class Latency:
    """Wall-clock figures of one answer, in milliseconds."""

    first_token: float = 0.0
    per_token_p50: float = 0.0
    per_token_p95: float = 0.0
    total: float = 0.0
    router_p50: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {k: round(getattr(self, k), 3) for k in self.__slots__}


@dataclass(slots=True)
class Answer:
    """The finished answer with everything needed to audit how it was made."""

    policy: str
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    tiers: list[int] = field(default_factory=list)  # who wrote each token: 0 the device, 1 the cloud, 2+ tiers above it
    scores: list[float | None] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # each token's text, as streamed
    emit_ms: list[float] = field(default_factory=list)  # when each token was released, since the answer began
    degraded: bool = False  # the cloud was lost (unreachable, full, gone) and the edge finished alone
    degraded_reason: str = ""  # why, in the cloud link's words ("" when not degraded)
    interrupted: bool = False  # stopped early by the caller (barge-in)
    finish_reason: str = "stop"  # "stop" (end of generation), "length", "interrupted", "loop" (began to loop)
    decision_engine: str = ""  # what decided the positions the router scored (the token hook): "router", built in
    decision: str = ""  # a per-answer choice of model (replay's query/session policies): "edge" or "cloud"
    latency: Latency = field(default_factory=Latency)
    traffic: Traffic = field(default_factory=Traffic)
    # The cloud work of each tier of a pool (index = tier: [0] the device's, empty), to price each at its own
    # size (shared/gpu_cost.py); `traffic.work` is their sum
    tier_work: list[Work] = field(default_factory=list)
    lost_tiers: list[int] = field(default_factory=list)  # tiers above the cloud lost in this answer (went down)
    cloud_timeouts: int = 0  # cloud replies that did not come within --cloud-timeout (then the device writes the
    # position, or with policy cloud the stream is asked to go on; three in a row give the cloud up)
    lookahead_positions: list[int] = field(default_factory=list)  # answer indices the cloud's lookahead guess decided
    explored_positions: list[int] = field(default_factory=list)  # answer indices asked by exploration (--explore)
    explore_declined: int = 0  # of those, the ones the cloud declined (its key's exploration budget)
    overruled_positions: list[int] = field(
        default_factory=list
    )  # where the cloud's check replaced an unflagged device token
    cloud_capabilities: list[str] | None = None  # what the cloud's engine can do (its accept); None: no cloud
    cloud_mode: str = ""  # how the cloud was asked, after fallbacks (e.g. "per-token+guess+check"; "none", "stream")
    cloud_mode_asked: str = ""  # how the options asked for it (differs when the cloud cannot do something)
    shared_history: str = ""  # what the device and the cloud shared: "tokens", "text" (protocol v3), "" (no cloud)
    edge_model: str = ""
    cloud_model: str = ""
    warnings: list[str] = field(default_factory=list)  # what a person should know about how it was made
    routing_log: bytes = b""
    drift: dict[str, Any] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_cloud_tokens(self) -> int:
        return sum(1 for r in self.routes if r == "cloud")

    @property
    def lookahead_tokens(self) -> int:
        """Cloud tokens taken from a lookahead guess, without a round trip."""
        return sum(1 for i in self.lookahead_positions if self.routes[i] == "cloud")

    @property
    def bytes_up(self) -> int:
        return self.traffic.bytes_up

    @property
    def bytes_down(self) -> int:
        return self.traffic.bytes_down

    @property
    def round_trips(self) -> int:
        return self.traffic.round_trips

    @property
    def cloud_compute_ms(self) -> float:
        return self.traffic.cloud_compute_ms

    def to_json(self) -> dict[str, Any]:
        """The `--json` object of `tokenrouter-edge ask` (documented in the README), also a replay row."""
        return {
            "text": self.text,
            "tokens": self.tokens,
            "routes": self.routes,
            "tiers": self.tiers,
            "scores": [None if s is None else round(s, 6) for s in self.scores],
            "pieces": self.pieces,
            "emit_ms": [round(x, 3) for x in self.emit_ms],
            "n_tokens": self.n_tokens,
            "n_cloud_tokens": self.n_cloud_tokens,
            "policy": self.policy,
            "decision_engine": self.decision_engine,
            "decision": self.decision,
            "degraded": self.degraded,
            "degraded_reason": self.degraded_reason,
            "interrupted": self.interrupted,
            "finish_reason": self.finish_reason,
            "latency_ms": self.latency.to_json(),
            "total_ms": round(self.latency.total, 3),
            "traffic": self.traffic.to_json(),
            "tier_work": [{f: getattr(w, f) for f in WORK_FIELDS} for w in self.tier_work],
            "lost_tiers": self.lost_tiers,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "round_trips": self.round_trips,
            "cloud_compute_ms": round(self.cloud_compute_ms, 3),
            "cloud_timeouts": self.cloud_timeouts,
            "lookahead_tokens": self.lookahead_tokens,
            "lookahead_positions": self.lookahead_positions,
            "overruled_positions": self.overruled_positions,
            "explored_positions": self.explored_positions,
            "explore_declined": self.explore_declined,
            "cloud_capabilities": self.cloud_capabilities,
            "cloud_mode": self.cloud_mode,
            "cloud_mode_asked": self.cloud_mode_asked,
            "shared_history": self.shared_history,
            "cloud_work": self.traffic.work.to_json(),
            "edge_model": self.edge_model,
            "cloud_model": self.cloud_model,
            "drift": self.drift,
            "warnings": self.warnings,
        }
