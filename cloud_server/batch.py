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
from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

from cloud_server.engine_api import Engine, GenerateResult, VerifyResult

PREFILL, GENERATE = "prefill", "generate"
TURN = "turn"  # a session's turn at the engine for bounded work of its own (a verify's next chunk): `Request.work`


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
    work: Callable[[], Any] | None = None  # TURN: run on the engine thread once the turn is granted
    t_enqueued: float = field(default_factory=time.perf_counter)
    started: bool = False
    compute_s: float = 0.0  # decode time of every batch this request took part in


@dataclass(slots=True)
class VerifyJob:
    """A verify under way, judged a chunk of drafts at a time (`CloudEngine.verify_step`): the drafts
    judged and kept so far are in the history, so an eviction between chunks rebuilds them as usual."""

    tokens: list[int]
    check: list[int]
    bonus: bool = False
    tolerance: float = 0.0
    base: int = -1  # the history's length when it began (-1: not begun); an error rolls back to it
    done: int = 0  # drafts judged, kept and appended to the history so far
    compute_s: float = 0.0


@dataclass(slots=True)
class StepOutcome:
    """What `BatchEngine.step` did with one request: done with a result, failed, or still pending.

    The result of a generate is a GenerateResult, of a prefill its compute seconds, of a turn (granted)
    None. `written`: a generate's (token, logprob) within the step, before its compute is known."""

    done: bool = False
    result: GenerateResult | float | None = None
    written: tuple[int, float] | None = None
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

    def step(self, reqs: list[Request], budget: int, per_session: int | None = None) -> StepReport:
        """One batched decode serving `reqs` within `budget` tokens, at most `per_session` of them for
        one session; a TURN request is granted (done) when its session may run now."""
        ...

    def verify_step(self, handle: int, job: VerifyJob, max_tokens: int) -> VerifyResult | None:
        """The next bounded piece of a verify: its verdict when done, else None."""
        ...

    def abandon_verify(self, handle: int, job: VerifyJob) -> None:
        """A verify failed partway: the history as before it began."""
        ...
