"""The types the batch scheduler and a batching engine exchange: requests, outcomes, the step contract.

Why a module of its own: the scheduler (cloud_server/scheduler.py) drives an
engine's `step`, and the engine (cloud_server/engine.py) fills in outcomes for
the scheduler's requests. Both import these types from here, so neither
imports the other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from cloud_server.engine_api import Engine

PREFILL, GENERATE = "prefill", "generate"


class BatchObserver(Protocol):
    """What the scheduler reports (metrics.py implements it)."""

    def on_batch(self, n_items: int, n_tokens: int, decode_s: float) -> None: ...

    def on_queue_wait(self, seconds: float) -> None: ...


@dataclass(slots=True)
class Request:
    """One session's prefill or generate, waiting for (or partway through) the engine."""

    handle: int
    kind: str
    future: "asyncio.Future[Any] | concurrent.futures.Future[Any]"
    loop: asyncio.AbstractEventLoop | None
    proposed: int = -1  # generate: the device's proposed token (the tie rule, shared/decision.py); -1: none
    t_enqueued: float = field(default_factory=time.perf_counter)
    started: bool = False
    compute_s: float = 0.0  # decode time of every batch this request took part in


@dataclass(slots=True)
class StepOutcome:
    """What `BatchEngine.step` did with one request: done with a result, failed, or still pending.

    The result of a generate is a GenerateResult, of a prefill its compute seconds."""

    done: bool = False
    result: Any = None
    error: BaseException | None = None
    progressed: bool = False


class StepReport(NamedTuple):
    """One `step`: outcomes in request order, and what was decoded (summed over retried sub-batches)."""

    outcomes: list[StepOutcome]
    n_items: int
    n_tokens: int
    decode_s: float


@runtime_checkable
class BatchEngine(Engine, Protocol):
    """An engine that serves many sessions' requests in one decode (the embedded llama.cpp engine)."""

    @property
    def n_batch(self) -> int: ...

    def step(self, reqs: list[Request], budget: int) -> StepReport: ...
