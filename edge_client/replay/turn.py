"""What replaying one turn under one policy records, and how cloud traffic is counted.

Every policy produces a TurnRecord with the same fields, so metrics and the
report never need to know which decoding path made an answer.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from edge_client.answer import TokenEvent

from edge_client.cloud_link import CloudLink
from shared.llama_backend import LlamaModel


@dataclass(slots=True)
class Traffic:
    """Cloud traffic totals of all links a runner has used (lost links included)."""

    bytes_up: int = 0
    bytes_down: int = 0
    round_trips: int = 0
    cloud_compute_ms: float = 0.0
    wait_ms: float = 0.0  # device time spent waiting on cloud calls (network + cloud compute)
    background_ms: float = 0.0  # cloud compute done while the device was not waiting (prefill after sync)

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))


class LinkFactory:
    """Makes CloudLinks to one URL and remembers them, so traffic can be totalled per turn."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        self.url, self.api_key, self.timeout_s = url, api_key, timeout_s
        self.links: list[CloudLink] = []

    def __call__(self) -> CloudLink:
        link = CloudLink(self.url, self.api_key, timeout_s=self.timeout_s)
        self.links.append(link)
        return link

    def totals(self) -> Traffic:
        t = Traffic()
        for link in self.links:
            s = link.stats
            t.bytes_up += s.bytes_up
            t.bytes_down += s.bytes_down
            t.round_trips += s.round_trips
            t.cloud_compute_ms += s.cloud_compute_ms
            t.wait_ms += sum(s.rtt_ms)
            t.background_ms += s.background_ms
        return t


@dataclass(slots=True)
class TurnRecord:
    """One answer as replayed: tokens, who wrote them, when each reached the user, what it cost."""

    tokens: list[int] = field(default_factory=list)
    routes: list[str] = field(default_factory=list)  # "edge" | "cloud" per token
    pieces: list[str] = field(default_factory=list)  # each token's text
    emit_ms: list[float] = field(default_factory=list)  # when each token was released, since the turn began
    total_ms: float = 0.0
    traffic: Traffic = field(default_factory=Traffic)
    degraded: bool = False
    finish_reason: str = "stop"
    decision: str = ""  # query/session policies: which model answered

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def to_json(self) -> dict:
        d = asdict(self)
        d["text"] = self.text
        d["emit_ms"] = [round(x, 3) for x in self.emit_ms]
        d["total_ms"] = round(self.total_ms, 3)
        return d


class Emitter:
    """Releases tokens to the user and stamps the time; the one place a turn's tokens are recorded."""

    def __init__(self, model: LlamaModel, record: TurnRecord, t0: float, on_token: Callable[[TokenEvent], None] | None = None) -> None:
        self.model = model
        self.record = record
        self.t0 = t0
        self.on_token = on_token
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: int, route: str) -> None:
        r = self.record
        r.emit_ms.append((time.perf_counter() - self.t0) * 1000.0)
        r.tokens.append(token)
        r.routes.append(route)
        r.pieces.append(self._utf8.decode(self.model.token_bytes(token)))
        if self.on_token is not None:
            self.on_token(TokenEvent(len(r.tokens) - 1, token, r.pieces[-1], route, None))  # type: ignore[arg-type]

    def finish(self) -> None:
        tail = self._utf8.decode(b"", final=True)
        if tail and self.record.pieces:
            self.record.pieces[-1] += tail
        self.record.total_ms = (time.perf_counter() - self.t0) * 1000.0
