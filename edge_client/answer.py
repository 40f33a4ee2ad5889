"""What one routed answer produces: a stream of token events and a final record.

These types are the contract between the routed generator (text in, tokens out)
and everything that consumes an answer: the CLI, the voice pipeline, the replay
harness. They hold no model or network state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Route = Literal["edge", "cloud"]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One accepted token of an answer, emitted as soon as it is known."""

    index: int  # position within the answer (0 = first generated token)
    token_id: int
    text: str  # the token's text; multi-byte characters complete on a later token
    route: Route  # which model wrote it
    score: float | None  # router score at this position (None when not computed)


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

    text: str
    tokens: list[int]
    routes: list[Route]
    scores: list[float | None]
    policy: str
    degraded: bool = False  # the cloud was lost and the edge finished alone
    interrupted: bool = False  # stopped early by the caller (barge-in)
    finish_reason: str = "stop"  # "stop" (end of generation), "length", "interrupted"
    latency: Latency = field(default_factory=Latency)
    bytes_up: int = 0
    bytes_down: int = 0
    round_trips: int = 0
    cloud_timeouts: int = 0  # hard positions the device wrote because the cloud was slow
    lookahead_positions: list[int] = field(default_factory=list)  # answer indices the cloud's lookahead guess decided
    overruled_positions: list[int] = field(default_factory=list)  # answer indices where the cloud's check replaced an unflagged device token
    cloud_compute_ms: float = 0.0
    edge_model: str = ""
    cloud_model: str = ""
    routing_log: bytes = b""
    pieces: list[str] = field(default_factory=list)  # each token's text, as streamed
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

    def to_json(self) -> dict[str, Any]:
        """The `--json` object of `tokenrouter-edge ask` (documented in the README)."""
        return {
            "text": self.text,
            "tokens": self.tokens,
            "routes": self.routes,
            "scores": [None if s is None else round(s, 6) for s in self.scores],
            "n_tokens": self.n_tokens,
            "n_cloud_tokens": self.n_cloud_tokens,
            "policy": self.policy,
            "degraded": self.degraded,
            "interrupted": self.interrupted,
            "finish_reason": self.finish_reason,
            "latency_ms": self.latency.to_json(),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "round_trips": self.round_trips,
            "cloud_timeouts": self.cloud_timeouts,
            "lookahead_tokens": self.lookahead_tokens,
            "lookahead_positions": self.lookahead_positions,
            "overruled_positions": self.overruled_positions,
            "cloud_compute_ms": round(self.cloud_compute_ms, 3),
            "edge_model": self.edge_model,
            "cloud_model": self.cloud_model,
            "drift": self.drift,
        }
