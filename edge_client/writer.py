"""Releasing an answer's tokens: the one place a token reaches the answer record and the listener.

A token is released once it is final (a checked draft only after its verdict),
so the record's timings (`emit_ms`) are when a listener really got each token.
"""

from __future__ import annotations

import codecs
import time
from typing import Callable

import numpy as np

from edge_client.answer import Answer, Latency, Route, TokenEvent
from shared.llama_backend import LlamaModel
from shared.routing_log import RoutingLog


class AnswerWriter:
    """Builds one `Answer` token by token and tells the listener (`on_token`)."""

    def __init__(
        self,
        model: LlamaModel,
        answer: Answer,
        prompt_len: int,
        on_token: Callable[[TokenEvent], None] | None = None,
        t0: float | None = None,
    ) -> None:
        """`t0`: when the answer was asked for (perf_counter), so timings include its setup."""
        self.model = model
        self.answer = answer
        self.on_token = on_token
        self.t0 = time.perf_counter() if t0 is None else t0
        self._t_last = self.t0
        self._gaps_ms: list[float] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._log = RoutingLog(edge_model=answer.edge_model, cloud_model=answer.cloud_model, start_position=prompt_len)

    def release(
        self,
        token: int,
        route: Route,
        score: float | None,
        fallback: bool = False,
        lookahead: bool = False,
        overruled: bool = False,
    ) -> None:
        """Record one final token and tell the listener. `fallback`: the cloud was asked but the device
        wrote it; `lookahead`: the cloud's guess decided it; `overruled`: the cloud's check replaced it."""
        now = time.perf_counter()
        self._gaps_ms.append((now - self._t_last) * 1000.0)
        self._t_last = now
        a = self.answer
        text = self._utf8.decode(self.model.token_bytes(token))
        a.emit_ms.append((now - self.t0) * 1000.0)
        a.pieces.append(text)
        a.tokens.append(token)
        a.routes.append(route)
        a.scores.append(score)
        i = len(a.tokens) - 1
        if lookahead:
            a.lookahead_positions.append(i)
        if overruled:
            a.overruled_positions.append(i)
        self._log.append(route, score, token, fallback)
        if self.on_token is not None:
            self.on_token(TokenEvent(i, token, text, route, score, lookahead, overruled))

    def finish(self, stopped: bool, router_ms: list[float]) -> Answer:
        """Close the record: finish reason, text, latency figures, routing log."""
        a = self.answer
        ended = bool(a.tokens) and self.model.is_eog(a.tokens[-1])
        a.interrupted = not ended and stopped
        a.finish_reason = "stop" if ended else ("interrupted" if a.interrupted else "length")
        tail = self._utf8.decode(b"", final=True)  # an unfinished multi-byte character
        if tail and a.pieces:
            a.pieces[-1] += tail
        a.text = "".join(a.pieces)
        a.latency = _latency((time.perf_counter() - self.t0) * 1000.0, self._gaps_ms, router_ms)
        a.routing_log = self._log.to_bytes()
        return a


def _latency(total_ms: float, gaps_ms: list[float], router_ms: list[float]) -> Latency:
    if not gaps_ms:
        return Latency(total=total_ms)
    rest = np.array(gaps_ms[1:] if len(gaps_ms) > 1 else gaps_ms)
    return Latency(
        first_token=gaps_ms[0],
        per_token_p50=float(np.percentile(rest, 50)),
        per_token_p95=float(np.percentile(rest, 95)),
        total=total_ms,
        router_p50=float(np.median(router_ms)) if router_ms else 0.0,
    )
