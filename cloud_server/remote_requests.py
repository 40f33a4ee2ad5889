"""The remote engine's sessions and the completions requests they make, each counted as work.

Why apart from the engine (cloud_server/remote_engine.py): what a request costs the remote
server is one rule, whichever engine call makes it. Each request counts one pass for its prompt
and one per further generated token; tokens processed are the prompt tokens beyond the
session's previous request (what a prefix cache holding it saves), except for prompt
log-probabilities, which vLLM computes over the whole prompt (it skips the prefix cache for
them, vllm-project/vllm#17251), and echo. Requests and replies are shared/completions.py's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Generator

from cloud_server.engine_api import EngineFull
from shared.completions import CompletionsClient, Position
from shared.protocol import NEXT_TOP, SamplingParams, Work
from shared.sampling import Guess, Sampler
from shared.sequences import common_prefix

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RemoteSession:
    history: list[int]
    sampling: SamplingParams
    sampler: Sampler
    compute_s: float = 0.0
    cached: list[int] = field(default_factory=list)  # tokens the engine processed for the last request
    appended: bool = True  # device tokens arrived since the last request: a warm-up is worth sending
    guess: Guess | None = None  # the guess announced for position guess_at (written there if asked)
    guess_at: int = -1
    wants_guess: bool = False  # a guess follows the next generate (the device's lookahead): ask for two tokens
    warmup: concurrent.futures.Future[None] | None = None
    work: Work = field(default_factory=Work)

    def check_room(self, extra: int, n_ctx: int) -> None:
        """EngineFull unless `extra` more tokens fit in the `n_ctx` tokens of context the server allows."""
        if len(self.history) + extra > n_ctx:
            raise EngineFull(f"session needs {len(self.history) + extra} tokens of context; the server allows {n_ctx}")

    def settle(self, timeout_s: float) -> None:
        """Wait for the session's warm-up: its prefix then serves this request instead of being computed twice."""
        fut, self.warmup = self.warmup, None
        if fut is not None:
            try:
                fut.result(timeout=timeout_s)
            except Exception:  # noqa: BLE001 - the warm-up's own failure is not this request's
                pass


class RemoteRequests:
    """Sessions' requests over one client; `lock` guards the work counters (requests run in many threads)."""

    def __init__(self, client: CompletionsClient, lock: threading.Lock) -> None:
        self.client = client
        self._lock = lock

    def request(
        self,
        s: RemoteSession,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        logprobs: int | None,
        kind: str,
        extra_kind: str | None = None,
        echo: bool = False,
        prompt_logprobs: bool = False,
        n_scored: int = 0,
    ) -> list[Position]:
        """One completions request for session `s`; its work is counted (module docstring). Returns
        the generated positions, or with echo/prompt_logprobs the last `n_scored` prompt positions
        followed by the generated ones."""
        c = self.client
        t0 = time.perf_counter()
        reply = c.post(c.body(prompt, max_tokens, sampling, logprobs, echo=echo, prompt_logprobs=prompt_logprobs))
        assert reply is not None
        log.debug(
            "%s request: %d prompt tokens, %d to write, %.3f s", kind, len(prompt), max_tokens, time.perf_counter() - t0
        )
        steps = c.positions(reply, max_tokens, prompt, n_scored, echo, prompt_logprobs)
        n_generated = max(len(steps) - n_scored, 1)
        fresh = len(prompt) - common_prefix(s.cached, prompt)
        processed = len(prompt) if (echo or prompt_logprobs) else max(fresh, 1)
        with self._lock:
            w = s.work
            w.engine_requests += 1
            w.passes += 1 + (n_generated - 1)
            setattr(w, kind, getattr(w, kind) + processed + (0 if extra_kind else n_generated - 1))
            if extra_kind:  # the second token of generate's two: decoding the first for the guess
                setattr(w, extra_kind, getattr(w, extra_kind) + n_generated - 1)
        gen = [p.token for p in steps[n_scored:]]
        s.cached = prompt + gen[:-1]
        return steps

    def stream(self, s: RemoteSession, prompt: list[int], max_tokens: int) -> Generator[Position, None, None]:
        """A streamed greedy continuation for verify; its work is counted for what was received."""
        c = self.client
        fresh = len(prompt) - common_prefix(s.cached, prompt)
        got: list[int] = []
        t0 = time.perf_counter()
        try:
            for pos in c.stream(c.body(prompt, max_tokens, SamplingParams(), NEXT_TOP)):
                got.append(pos.token)
                yield pos
        finally:
            with self._lock:
                w = s.work
                w.engine_requests += 1
                w.passes += max(len(got), 1)
                w.verify_tokens += max(fresh, 1) + max(len(got) - 1, 0)
            s.cached = prompt + got[:-1]
            log.debug(
                "verify stream: %d prompt tokens, %d of %d read, %.3f s",
                len(prompt),
                len(got),
                max_tokens,
                time.perf_counter() - t0,
            )
