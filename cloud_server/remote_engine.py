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

Work (shared/protocol.py `Work`): each request counts one pass for its prompt
and one per further generated token; tokens processed are the prompt tokens
beyond the session's previous request (what a prefix cache holding it saves),
except for prompt log-probabilities, which vLLM computes over the whole prompt
(it skips the prefix cache for them, vllm-project/vllm#17251), and echo.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

from cloud_server.engine_api import (
    Capabilities,
    EmptyHistory,
    EngineError,
    EngineFailed,
    EngineFull,
    GenerateResult,
    NotSupported,
    Owner,
    VerifyResult,
)
from shared.completions import CompletionsClient, CompletionsError, Position, VocabModel, first_choice
from shared.decision import TIE_NATS, cloud_choice, judge_draft
from shared.model_info import ModelInfo
from shared.protocol import NEXT_TOP, SamplingParams, Work
from shared.sampling import NO_GUESS, Guess, Sampler
from shared.sequences import common_prefix

T = TypeVar("T")
log = logging.getLogger(__name__)

VERIFY_MODES = ("auto", "prompt-logprobs", "echo", "generate", "off")
PROBE_RETRY_S = 5.0  # an engine not up at start is probed again this often
MAX_VERIFY_ONE_PASS = 512  # drafts per verify with prompt log-probabilities or echo
MAX_VERIFY_GENERATE = 64  # drafts per verify by continuation (one decode step each)


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


class RemoteEngine:
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
        self.model = VocabModel(info)
        try:
            self.client = CompletionsClient(self.model, base_url, model_name, api_key, prompt_format, timeout_s)
        except ValueError:
            self.model.close()
            raise
        self.base_url = self.client.base_url
        self.prompt_format = prompt_format
        self.max_sessions = max_sessions
        self.n_ctx = n_ctx  # tokens of context a session may use (the remote server's limit)
        self.timeout_s = timeout_s
        self.verify_request = verify
        self.verify_mode = "off"  # what the probe found (see probe)
        self.top_logprobs = False  # the engine lists top log-probabilities per generated position
        self._caps = Capabilities("remote", self.model.n_vocab, how="not probed yet", session_cells=n_ctx)
        self._sessions: dict[int, RemoteSession] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def capabilities(self) -> Capabilities:
        return self._caps

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        return self.model.chat_tokens(messages)

    # ---------------------------------------------------------------- what the engine can do

    def probe(self) -> Capabilities:
        """Ask the engine what it supports (a few requests of a short prompt) and set the capabilities.
        An engine that answers a request without the field asked for does not support it; one that
        refuses it (HTTP 4xx) neither. Raises RemoteEngineError when the engine is unreachable."""
        try:
            return self._probe()
        except CompletionsError as exc:
            raise RemoteEngineError(str(exc)) from None

    def _probe(self) -> Capabilities:
        c = self.client
        prompt = self.model.chat_tokens([{"role": "user", "content": "Say hello."}])
        reply = c.post(c.body(prompt, 2, SamplingParams(), NEXT_TOP), probing=True)
        try:
            steps = c.positions(reply, 2) if reply else []
        except CompletionsError:  # no log-probabilities and a text that is not one token: no top lists
            steps = []
        self.top_logprobs = bool(steps) and len(steps[0].top) >= 2
        guess = self.top_logprobs and len(steps) >= 2 and len(steps[1].top) >= 2
        mode, want = "off", self.verify_request
        if want in ("auto", "prompt-logprobs"):
            reply = c.post(c.body(prompt, 1, SamplingParams(), NEXT_TOP, prompt_logprobs=True), probing=True)
            if reply and isinstance(first_choice(reply).get("prompt_logprobs"), list):
                mode = "prompt-logprobs"
        if mode == "off" and (want == "echo" or (want == "auto" and self.prompt_format == "ids")):
            reply = c.post(c.body(prompt, 1, SamplingParams(), NEXT_TOP, echo=True), probing=True)
            lp = first_choice(reply).get("logprobs") if reply else None
            if isinstance(lp, dict) and len(lp.get("token_logprobs") or []) > 1:  # the prompt's too
                mode = "echo"
        if mode == "off" and want in ("auto", "generate") and self.top_logprobs:
            mode = "generate"
        if want not in ("auto", mode):
            log.warning("remote engine at %s does not support --remote-verify %s; verify is off", self.base_url, want)
        self.verify_mode = mode
        limit = {"generate": MAX_VERIFY_GENERATE, "off": 0}.get(mode, MAX_VERIFY_ONE_PASS)
        how = f"verify: {mode}; guess: {'max_tokens 2' if guess else 'none'}; prompt: {self.prompt_format}"
        self._caps = Capabilities(
            "remote",
            self.model.n_vocab,
            guess=guess,
            verify=mode != "off",
            max_verify_tokens=limit,
            how=how,
            session_cells=self.n_ctx,
        )
        log.info("remote engine at %s: %s", self.base_url, how)
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
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise EngineFull(f"all {self.max_sessions} sessions are in use")
            handle = self._next
            self._next += 1
            self._sessions[handle] = RemoteSession(list(prompt), sampling, Sampler(sampling))
            return handle

    def close(self, handle: int) -> None:
        with self._lock:
            self._sessions.pop(handle, None)

    def history(self, handle: int) -> list[int]:
        return self._sessions[handle].history

    @property
    def n_sessions(self) -> int:
        return len(self._sessions)

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

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def take_work(self, handle: int) -> Work:
        with self._lock:
            s = self._sessions.get(handle)
            if s is None:
                return Work()
            work, s.work = s.work, Work()
            return work

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
            self._request(s, prompt, 1, SamplingParams(), None, "prefill_tokens")
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

    def _settle(self, s: RemoteSession) -> None:
        """Wait for the session's warm-up: its prefix then serves this request instead of being computed twice."""
        fut, s.warmup = s.warmup, None
        if fut is not None:
            try:
                fut.result(timeout=self.timeout_s)
            except Exception:  # noqa: BLE001 - the warm-up's own failure is not this request's
                pass

    # ---------------------------------------------------------------- generate and guess

    @_guarded
    def generate(self, handle: int, proposed: int = -1) -> GenerateResult:
        """The cloud's next token (shared/decision.py's `cloud_choice` with `proposed` where the top
        list allows); it joins the history. With the session's lookahead on, the same request
        brings the guess for the position after it."""
        s = self._sessions[handle]
        if not s.history:
            raise EmptyHistory("generate")
        self._check_room(s, 1)
        t0 = time.perf_counter()
        if s.guess is not None and s.guess_at == len(s.history):  # announced in a `next`: written as promised
            g, s.guess = s.guess, None
            s.history.append(g.token)
            return GenerateResult(g.token, g.logprob, time.perf_counter() - t0)
        self._settle(s)
        want_guess, s.wants_guess = self._caps.guess and s.wants_guess, False
        n = 2 if want_guess else 1
        logprobs = NEXT_TOP if self.top_logprobs else None
        steps = self._request(s, list(s.history), n, s.sampling, logprobs, "generate_tokens", extra_kind="guess_tokens")
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
        self._settle(s)
        t0 = time.perf_counter()
        steps = self._request(s, list(s.history), 1, s.sampling, NEXT_TOP, "guess_tokens")
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
        self._check_room(s, len(tokens) + 1)
        self._settle(s)
        s.guess = None
        t0 = time.perf_counter()
        if self.verify_mode == "generate":
            result = self._verify_by_continuation(s, tokens, set(check), bonus, tolerance)
        else:
            result = self._verify_in_one_pass(s, tokens, set(check), bonus, tolerance)
        s.history.extend(tokens[: result.accepted])
        if result.token >= 0:
            s.history.append(result.token)
            result.eog = self.model.is_eog(result.token)
        s.appended = False
        dt = time.perf_counter() - t0
        s.compute_s += dt
        result.compute_ms = dt * 1000.0
        return result

    def _judge(self, s: RemoteSession, pos: Position, draft: int, exact: bool, tolerance: float) -> int:
        """shared/decision.py's verdict on `draft` at `pos` (-1: it stands); where nothing was listed,
        only the engine's own token stands."""
        if not pos.listed:
            return -1 if draft == pos.token or pos.token < 0 else pos.token
        return judge_draft(pos.view(self.model.n_vocab), draft, exact, tolerance, s.sampler, TIE_NATS)

    def _bonus(self, s: RemoteSession, pos: Position, at: int) -> VerifyResult:
        token = cloud_choice(pos.view(self.model.n_vocab), s.sampler) if pos.listed else pos.token
        if token < 0:
            return VerifyResult(accepted=at)
        return VerifyResult(accepted=at, token=token, logprob=pos.logprob_of(token))

    def _verify_in_one_pass(
        self, s: RemoteSession, tokens: list[int], exact: set[int], bonus: bool, tolerance: float
    ) -> VerifyResult:
        """prompt-logprobs or echo: every draft's log-probability and top list from one request."""
        prompt = s.history + tokens
        positions = self._request(
            s,
            prompt,
            1,
            SamplingParams(),
            NEXT_TOP,
            "verify_tokens",
            echo=self.verify_mode == "echo",
            prompt_logprobs=self.verify_mode == "prompt-logprobs",
            n_scored=len(tokens),
        )
        for i, draft in enumerate(tokens):
            if i not in exact and tolerance <= 0:
                continue  # unchecked: it stands unread
            token = self._judge(s, positions[i], draft, i in exact, tolerance)
            if token >= 0:
                return VerifyResult(accepted=i, token=token, logprob=positions[i].logprob_of(token))
        if bonus and len(positions) > len(tokens):
            return self._bonus(s, positions[len(tokens)], len(tokens))
        return VerifyResult(accepted=len(tokens))

    def _verify_by_continuation(
        self, s: RemoteSession, tokens: list[int], exact: set[int], bonus: bool, tolerance: float
    ) -> VerifyResult:
        """generate: the engine's greedy continuation, streamed, with its top lists; each draft is
        judged where the context is the drafts' own, and the stream is closed (the engine stops)
        at the first draft off the engine's path (see the module docstring)."""
        start = 0  # drafts before this one are judged and stand: the next request's context
        while True:
            n = len(tokens) - start + int(bonus)
            if n <= 0:
                return VerifyResult(accepted=len(tokens))
            prompt = s.history + tokens[:start]
            steps = self._stream(s, prompt, n)
            try:
                restart = False
                for k, pos in enumerate(steps):
                    i = start + k
                    if i == len(tokens):
                        return self._bonus(s, pos, i)
                    draft = tokens[i]
                    if i in exact or tolerance > 0:
                        token = self._judge(s, pos, draft, i in exact, tolerance)
                        if token >= 0:
                            return VerifyResult(accepted=i, token=token, logprob=pos.logprob_of(token))
                    if draft != pos.token:  # it stands, off the engine's path: continue from it
                        start, restart = i + 1, True
                        break
                    if self.model.is_eog(pos.token):
                        break
                if not restart:
                    return VerifyResult(accepted=len(tokens))
            finally:
                steps.close()

    def _stream(self, s: RemoteSession, prompt: list[int], max_tokens: int) -> Iterator[Position]:
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

    # ---------------------------------------------------------------- requests

    def _check_room(self, s: RemoteSession, extra: int) -> None:
        if len(s.history) + extra > self.n_ctx:
            raise EngineFull(
                f"session needs {len(s.history) + extra} tokens of context; the server allows {self.n_ctx}"
            )

    def _request(
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
