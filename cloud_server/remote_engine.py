"""A cloud engine over an OpenAI-compatible completions server (vLLM, SGLang, llama.cpp servers).

Why: a 70B model runs across several GPUs in a serving engine built for it, not
in this process. This server keeps the protocol, sessions, quotas and audit;
the engine behind it sees "continue this token sequence" requests. The whole
history is sent each time and the engine's prefix cache (vLLM
`--enable-prefix-caching`, on by default in V1) makes that cost only the new
tokens; many sessions' requests run concurrently and the engine batches them.

The whole engine contract, from the top log-probabilities the server returns
(`logprobs`: its NEXT_TOP most likely tokens per position):

    generate  one request; when a guess follows (`expect_guess`: the device's
              lookahead), `max_tokens: 2`: the second token is the guess for the
              next position, and a later generate there writes it as promised,
              without a request. Why one request: the guess then arrives with the
              token, never late; the token waits one decode step longer, which
              the device would spend waiting for the guess anyway.
              Greedy: the tie rule (shared/decision.py `cloud_choice`) on a
              logits-like view of the first position's top list.
    guess     the guess the last generate brought, else one request (`max_tokens: 1`).
    verify    the drafts' log-probabilities, judged by shared/decision.py
              `judge_draft` on the same views, by one of (`--remote-verify`):
                prompt-logprobs  vLLM's `prompt_logprobs`: one request, one pass
                echo             the completions API's `echo` + `logprobs`: one
                                 request, one pass (chosen by `auto` only for
                                 token-id prompts: a text prompt is re-tokenized)
                generate         the engine's own greedy continuation, streamed, with
                                 its top list per position: a draft equal to the
                                 engine's token is judged where it stands; at the
                                 first that differs the stream is closed (the engine
                                 stops), and if that draft stands one more request
                                 continues from it; one decode step per position read
              `auto` takes the first the engine answers (probed at start).
    prefill   after hello/sync a warm-up request (`max_tokens: 1`) in the
              background, so the prefix cache holds the history before the next
              hard token; a request of the session waits for it rather than
              duplicating its work.

The view approximation: a position's view holds only the tokens the server
listed (its top NEXT_TOP and the token itself); every other token counts as
infinitely unlikely. Under greedy decoding a verdict needs the best token's
log-probability and the draft's, both listed where the draft is the prompt
token (prompt-logprobs, echo), so those verdicts are exact; in `generate` mode a
draft outside the top list counts as beyond any tolerance (it is at least the
list's spread below the best). Where the server lists nothing for a position
(llama-cpp-python omits the end-of-generation token), a draft other than the
engine's token there counts as beyond any tolerance too. With a temperature the
tie rule does not apply (as in cloud_choice) and a rejected draft's replacement
is drawn from the view by the session's seeded sampler: a draw from the top list.

Sampling: generate and guess send the session's temperature, top_p, top_k and
`seed + position`, so the engine's draw is reproducible per position on one
engine (not the same draw as the embedded engine's numpy sampler); verify
requests are greedy (only the log-probabilities are used).

Requests and replies (prompt formats `ids` and `text`, how token ids are read back, the
views) are shared/completions.py's. The tokenizer comes from a GGUF of the same model loaded
vocab-only (a few MB; the weights are never read).

The parts, apart: remote_requests.py (a session's requests, each counted as work:
shared/protocol.py `Work`), remote_verify.py (the verify strategies), remote_probe.py (what
the server can do).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from typing import Any, Callable, TypeVar

from cloud_server.engine_api import (
    Capabilities,
    EmptyHistory,
    EngineError,
    EngineFailed,
    GenerateResult,
    NotSupported,
    Owner,
    VerifyResult,
)
from cloud_server.engine_base import EngineBase
from cloud_server.remote_probe import VERIFY_MODES, probe_server
from cloud_server.remote_requests import RemoteRequests, RemoteSession
from cloud_server.remote_verify import RemoteVerifier
from shared.completions import CompletionsClient, CompletionsError, VocabModel
from shared.decision import TIE_NATS, cloud_choice
from shared.model_info import ModelInfo
from shared.protocol import NEXT_TOP, SamplingParams
from shared.sampling import NO_GUESS, Guess, Sampler

__all__ = ["VERIFY_MODES", "RemoteEngine", "RemoteEngineError", "RemoteSession", "RemoteWorker"]

T = TypeVar("T")
log = logging.getLogger(__name__)

PROBE_RETRY_S = 5.0  # an engine not up at start is probed again this often


class RemoteEngineError(EngineFailed):
    """The remote completions server failed or answered something unusable (the device gets `busy`)."""


def _guarded(fn: Callable[..., T]) -> Callable[..., T]:
    """Any unexpected failure inside a request becomes a named RemoteEngineError (the session lives on)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except EngineError:
            raise
        except CompletionsError as exc:
            raise RemoteEngineError(str(exc)) from None
        except KeyError as exc:  # a closed session's handle
            raise RemoteEngineError(f"session {exc} is closed") from None
        except Exception as exc:  # noqa: BLE001 - a bug or a reply shape not foreseen: named, logged
            log.warning("remote engine request failed", exc_info=True)
            raise RemoteEngineError(f"the remote engine request failed ({type(exc).__name__}: {exc})") from exc

    return wrapper


class RemoteEngine(EngineBase[RemoteSession]):
    """The `Engine` contract over a remote completions server (see the module docstring).

    Thread-safe: RemoteWorker runs requests of many sessions concurrently; one session has at
    most one request of its own in flight (plus its background warm-up, which requests wait for).
    """

    def __init__(
        self,
        info: ModelInfo,
        base_url: str,
        model_name: str = "",
        api_key: str = "",
        prompt_format: str = "ids",
        max_sessions: int = 64,
        n_ctx: int = 8192,
        timeout_s: float = 30.0,
        verify: str = "auto",
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"remote verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        model = VocabModel(info)
        try:
            self.client = CompletionsClient(model, base_url, model_name, api_key, prompt_format, timeout_s)
        except ValueError:
            model.close()
            raise
        super().__init__(
            model, Capabilities("remote", model.n_vocab, how="not probed yet", session_cells=n_ctx), max_sessions
        )
        self.base_url = self.client.base_url
        self.prompt_format = prompt_format
        self.n_ctx = n_ctx  # tokens of context a session may use (the remote server's limit)
        self.timeout_s = timeout_s
        self.verify_request = verify
        self.verify_mode = "off"  # what the probe found (see probe)
        self.top_logprobs = False  # the engine lists top log-probabilities per generated position
        self.requests = RemoteRequests(self.client, self._lock)
        self.verifier = RemoteVerifier(model, self.requests)
        self._stop = threading.Event()

    # ---------------------------------------------------------------- what the engine can do

    def probe(self) -> Capabilities:
        """Ask the engine what it supports (cloud_server/remote_probe.py) and set the capabilities.
        Raises RemoteEngineError when the engine is unreachable."""
        try:
            found = probe_server(self.client, self.model, self.prompt_format, self.verify_request, self.n_ctx)
        except CompletionsError as exc:
            raise RemoteEngineError(str(exc)) from None
        self.top_logprobs, self.verify_mode, self._caps = found.top_logprobs, found.verify_mode, found.caps
        return self._caps

    def probe_until_up(self) -> None:
        """Probe now; if the engine is not up yet (it may load a 70B model for minutes), keep
        probing in the background. Until then the capabilities say generate only."""
        try:
            self.probe()
            return
        except RemoteEngineError as exc:
            log.warning("remote engine not reachable yet (%s); probing every %.0f s", exc, PROBE_RETRY_S)

        def retry() -> None:
            while not self._stop.wait(PROBE_RETRY_S):
                try:
                    self.probe()
                    return
                except RemoteEngineError:
                    continue

        threading.Thread(target=retry, name="remote-probe", daemon=True).start()

    # ---------------------------------------------------------------- sessions

    def demote(self, owner: str) -> None:
        """Nothing to do: the remote engine schedules its own GPU."""

    def open(self, prompt: list[int], sampling: SamplingParams, owner: Owner | None = None) -> int:
        """A new session (`owner` is not needed: the remote engine keeps no KV of its own to evict)."""
        return self._add(lambda handle: RemoteSession(list(prompt), sampling, Sampler(sampling)))

    def close(self, handle: int) -> None:
        self._drop(handle)

    def append(self, handle: int, tokens: list[int]) -> None:
        s = self._sessions[handle]
        s.history.extend(tokens)
        if tokens:
            s.appended, s.guess = True, None

    def rollback(self, handle: int, n: int) -> None:
        s = self._sessions[handle]
        if not 0 <= n <= len(s.history):
            raise ValueError(f"cannot roll back to {n}: the history holds {len(s.history)} tokens")
        del s.history[n:]
        s.guess = None

    # ---------------------------------------------------------------- prefill: a warm-up request

    def prefill(self, handle: int) -> float:
        """A warm-up request (`max_tokens: 1`) so that the engine's prefix cache holds the history;
        nothing when no device tokens arrived since the session's last request. Returns seconds."""
        s = self._sessions.get(handle)
        if s is None or not s.appended or not s.history or len(s.history) >= self.n_ctx:
            return 0.0
        s.appended = False
        t0 = time.perf_counter()
        prompt = list(s.history)
        try:
            self.requests.request(s, prompt, 1, SamplingParams(), None, "prefill_tokens")
        except (EngineError, CompletionsError) as exc:  # only a cache hint: the next request says what is wrong
            log.debug("warm-up failed: %s", exc)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        return dt

    def prefill_in_background(self, handle: int, pool: concurrent.futures.Executor) -> None:
        """Start the warm-up on `pool` (not awaited: the device's next request does not wait for a sync)."""
        s = self._sessions.get(handle)
        if s is None or not s.appended or (s.warmup is not None and not s.warmup.done()):
            return
        s.warmup = pool.submit(self.prefill, handle)

    # ---------------------------------------------------------------- generate and guess

    @_guarded
    def generate(self, handle: int, proposed: int = -1) -> GenerateResult:
        """The cloud's next token (shared/decision.py's `cloud_choice` with `proposed` where the top
        list allows); it joins the history. With the session's lookahead on, the same request
        brings the guess for the position after it."""
        s = self._sessions[handle]
        if not s.history:
            raise EmptyHistory("generate")
        s.check_room(1, self.n_ctx)
        t0 = time.perf_counter()
        if s.guess is not None and s.guess_at == len(s.history):  # announced in a `next`: written as promised
            g, s.guess = s.guess, None
            s.history.append(g.token)
            return GenerateResult(g.token, g.logprob, time.perf_counter() - t0)
        s.settle(self.timeout_s)
        want_guess, s.wants_guess = self._caps.guess and s.wants_guess, False
        n = 2 if want_guess else 1
        logprobs = NEXT_TOP if self.top_logprobs else None
        steps = self.requests.request(
            s, list(s.history), n, s.sampling, logprobs, "generate_tokens", extra_kind="guess_tokens"
        )
        first = steps[0]
        token, logprob = first.token, first.logprob_of(first.token)
        if s.sampler.greedy and 0 <= proposed < self.model.n_vocab and proposed != token and first.top:
            if cloud_choice(first.view(self.model.n_vocab), s.sampler, proposed, TIE_NATS) == proposed:
                token, logprob = proposed, first.logprob_of(proposed)  # within TIE_NATS of the best: the device's
        s.history.append(token)
        s.appended = False
        if len(steps) >= 2 and token == first.token and steps[1].top and steps[1].token >= 0:
            s.guess, s.guess_at = steps[1].guess(), len(s.history)
        dt = time.perf_counter() - t0
        s.compute_s += dt
        return GenerateResult(token, logprob, dt)

    def expect_guess(self, handle: int, wanted: bool) -> None:
        self._sessions[handle].wants_guess = wanted

    @_guarded
    def guess(self, handle: int) -> Guess:
        """The token the session would write next with its top list, without writing it: the one
        the last generate brought along, else one request. A later generate here writes it."""
        s = self._sessions[handle]
        if s.guess is not None and s.guess_at == len(s.history):
            return s.guess
        if not self._caps.guess or not s.history or len(s.history) >= self.n_ctx:
            return NO_GUESS
        s.settle(self.timeout_s)
        t0 = time.perf_counter()
        steps = self.requests.request(s, list(s.history), 1, s.sampling, NEXT_TOP, "guess_tokens")
        s.compute_s += time.perf_counter() - t0
        if not steps[0].top or steps[0].token < 0:
            return NO_GUESS
        s.guess, s.guess_at = steps[0].guess(), len(s.history)
        return s.guess

    # ---------------------------------------------------------------- verify

    @_guarded
    def verify(
        self, handle: int, tokens: list[int], check: list[int], bonus: bool = False, tolerance: float = 0.0
    ) -> VerifyResult:
        """Judge drafted `tokens` after the history (shared/decision.py's `judge_draft` at each
        offset in `check`, and at every offset leniently with `tolerance` > 0); the history keeps
        the drafts before the first rejected one, then the cloud's token (see the module docstring)."""
        s = self._sessions[handle]
        if self.verify_mode == "off":
            raise NotSupported("verify is not supported by this server's engine (remote); use generate")
        if not s.history:
            raise EmptyHistory("verify")
        if len(tokens) > self._caps.max_verify_tokens:
            raise NotSupported(f"at most {self._caps.max_verify_tokens} drafted tokens per verify")
        s.check_room(len(tokens) + 1, self.n_ctx)
        s.settle(self.timeout_s)
        s.guess = None
        t0 = time.perf_counter()
        result = self.verifier.verify(self.verify_mode, s, tokens, set(check), bonus, tolerance)
        s.history.extend(tokens[: result.accepted])
        if result.token >= 0:
            s.history.append(result.token)
            result.eog = self.model.is_eog(result.token)
        s.appended = False
        dt = time.perf_counter() - t0
        s.compute_s += dt
        result.compute_ms = dt * 1000.0
        return result

    def close_all(self) -> None:
        self._stop.set()
        with self._lock:
            self._sessions.clear()
        self.client.close()
        self.model.close()


class RemoteWorker:
    """The `Worker` over a RemoteEngine: requests run concurrently in threads (the remote engine batches)."""

    def __init__(self, engine: RemoteEngine, concurrency: int = 64) -> None:
        self.engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="remote")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._pool.submit(fn, *args)

    async def generate(self, handle: int, proposed: int = -1) -> GenerateResult:
        return await self.call(self.engine.generate, handle, proposed)

    async def prefill(self, handle: int) -> float:
        """The warm-up request, started and not awaited (its time is not the device's)."""
        self.engine.prefill_in_background(handle, self._pool)
        return 0.0

    async def verify(
        self, handle: int, tokens: list[int], check: list[int], bonus: bool = False, tolerance: float = 0.0
    ) -> VerifyResult:
        """One request (or a stream) to the remote engine, which shares its own GPU between sessions."""
        return await self.call(self.engine.verify, handle, tokens, check, bonus, tolerance)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.engine.close_all()
