"""What the session layer may ask of a model engine, and the errors an engine may give.

Why a Protocol: the server runs either the embedded llama.cpp engine
(cloud_server/engine.py, batched on one thread) or a remote completions
server (cloud_server/remote_engine.py). They differ in what they can do (a
remote engine sees only the top log-probabilities its server returns, and
some servers return none), so each says so in `capabilities()`, the session
lists that in its `accept` (protocol v2) and refuses the rest by name instead
of reaching into an engine's context or model. Each engine counts its work
per session (`take_work`: forward passes, tokens per kind, remote requests),
which the session reports with its replies. An engine refuses what a client
asked for with an `EngineError`, which names the protocol error code the
client gets (`engine_errors` turns it into that ProtocolError); anything else
escaping an engine is a bug.

This module imports nothing from cloud_server: every other module builds on it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, TypeVar, runtime_checkable

from shared.protocol import CAP_GENERATE, CAP_GUESS, CAP_VERIFY, ErrorCode, ProtocolError, SamplingParams, Work
from shared.sampling import Guess, SamplingError
from shared.text_history import AnswerText

T = TypeVar("T")


class EngineError(Exception):
    """A request the engine refuses or cannot serve; `code` is the ErrorCode the device gets (the session lives on)."""

    code: str = ErrorCode.BUSY


class EngineFull(EngineError, RuntimeError):
    """No free session, sequence slot or KV cells (at hello: the server is full; later: the context is)."""

    code = ErrorCode.CONTEXT_FULL


class NotSupported(EngineError):
    """This server's engine cannot do what was asked (e.g. verify with a remote engine)."""

    code = ErrorCode.BAD_FIELD


class EmptyHistory(EngineError, ValueError):
    """Nothing to continue from: the session's history is empty (e.g. after a rollback to 0)."""

    code = ErrorCode.BAD_FIELD

    def __init__(self, what: str = "generate") -> None:
        super().__init__(f"cannot {what}: the session history is empty; sync tokens first")


class ChurnLimited(EngineError):
    """The session's owner has spent its KV churn budget: it forced too many other sessions' KV cells to be
    recomputed lately (cloud_server/kv_pool.py, `ChurnBudget`); it is refused before it slows the others."""

    code = ErrorCode.BUSY


class EngineFailed(EngineError):
    """The engine failed on this request (a decode error, a remote server's failure); others are unaffected."""

    code = ErrorCode.BUSY


@contextmanager
def engine_errors() -> Iterator[None]:
    """An engine's refusal as the ProtocolError it names (the session survives it)."""
    try:
        yield
    except EngineError as exc:
        raise ProtocolError(exc.code, str(exc)) from None
    except SamplingError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"sampling: {exc}") from None


class GenerateResult(NamedTuple):
    """One token written by the cloud (a tuple, so `token, logprob, seconds = ...` reads naturally)."""

    token: int
    logprob: float
    compute_s: float


@dataclass(slots=True)
class VerifyResult:
    """The verdict on a drafted span: drafts before `accepted` stand; `token` (-1: none) is written after them."""

    accepted: int
    token: int = -1
    logprob: float = 0.0
    compute_ms: float = 0.0
    eog: bool = False


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine can do; the session refuses the rest with a named error instead of calling it."""

    name: str  # "llama.cpp" or "remote", for messages and /v1/info
    n_vocab: int
    generate: bool = True
    guess: bool = False  # lookahead: `guess` announces the next token (else the device gets a `next` with -1)
    verify: bool = False
    max_verify_tokens: int = 0  # drafted tokens one verify may carry
    how: str = ""  # how guesses and verifies are made, for /v1/info (e.g. "echo", "prompt-logprobs")
    text: bool = False  # text mode (protocol v3): the engine is a `TextEngine` (a mismatched tokenizer is served)
    session_cells: int = 0  # tokens one session's history may hold (its KV cells); 0: not known

    def verify_limit(self, n_prompt: int) -> int:
        """Drafts one verify may carry in a session opened with `n_prompt` tokens (what `accept` announces):
        the engine's limit, and no more than fit in the session's KV cells after the prompt."""
        if not self.verify:
            return 0
        if self.session_cells <= 0:
            return self.max_verify_tokens
        return max(0, min(self.max_verify_tokens, self.session_cells - n_prompt))

    def names(self) -> list[str]:
        """The capability names an `accept` lists (shared/protocol.py, CAP_*)."""
        return [
            n for n, on in ((CAP_GENERATE, self.generate), (CAP_GUESS, self.guess), (CAP_VERIFY, self.verify)) if on
        ]


@dataclass(frozen=True, slots=True)
class Owner:
    """Who a session belongs to (its API key's name), the KV churn its sessions may force on others (KV
    cells per minute that evictions they cause make other sessions recompute) and the engine time they
    may use per minute (cloud_server/fair_share.py); None: no limit."""

    name: str = ""
    kv_churn_per_minute: int | None = None
    engine_seconds_per_minute: float | None = None  # engine time its sessions may use (None: no limit)


@runtime_checkable
class Engine(Protocol):
    """Sessions of token histories over one model. Handles are ints from `open`, stable until `close`.

    Not thread-safe in general: the worker decides where calls run (the embedded engine's single
    thread). `history` returns the live list; callers read it, never write it."""

    @property
    def n_sessions(self) -> int: ...

    def capabilities(self) -> Capabilities: ...

    def chat_tokens(self, messages: list[dict]) -> list[int]: ...

    def open(self, prompt: list[int], sampling: SamplingParams, owner: Owner | None = None) -> int:
        """A new session; `owner` (None: nobody in particular) shares one KV churn budget among its sessions."""
        ...

    def close(self, handle: int) -> None: ...

    def history(self, handle: int) -> list[int]: ...

    def append(self, handle: int, tokens: list[int]) -> None: ...

    def rollback(self, handle: int, n: int) -> None: ...

    def prefill(self, handle: int) -> float: ...

    def generate(self, handle: int, proposed: int = -1) -> GenerateResult: ...

    def guess(self, handle: int) -> Guess: ...

    def expect_guess(self, handle: int, wanted: bool) -> None:
        """Whether `guess` follows the session's next generate (the device asked for lookahead): an
        engine that makes both in one request (remote: `max_tokens: 2`) must know before."""
        ...

    def verify(
        self, handle: int, tokens: list[int], check: list[int], bonus: bool = False, tolerance: float = 0.0
    ) -> VerifyResult: ...

    def is_eog(self, token: int) -> bool: ...

    def demote(self, owner: str) -> None:
        """Serve `owner`'s sessions after the others' for a while: its device asked for work it does not
        read (a slow reader). An engine that does not share itself between keys ignores it."""
        ...

    def take_work(self, handle: int) -> Work:
        """The session's work since the last call (then reset); see shared/protocol.py's `Work`."""
        ...

    def close_all(self) -> None: ...


@runtime_checkable
class TextEngine(Engine, Protocol):
    """An engine that serves text mode (protocol v3; `Capabilities.text`): the session
    (cloud_server/text_session.py) re-tokenizes the shared answer text with its model."""

    def answer_text(self) -> AnswerText:
        """The model's view of the shared answer text (shared/text_history.py)."""
        ...

    def eog_token(self) -> int:
        """The model's end-of-generation token (text mode's check judges a drafted end with it)."""
        ...

    def peek(self, handle: int) -> int:
        """The most likely next token from the logits a prefill kept, without writing or promising
        it (-1: none kept). The span rule looks at it to stop before a new word."""
        ...

    def peek_guess(self, handle: int) -> Guess | None:
        """The same position's most likely tokens with their log-probabilities (None: no logits
        kept): text mode's lookahead guess."""
        ...


@runtime_checkable
class Worker(Protocol):
    """Runs an engine's work where it must run, awaitable from asyncio (EngineWorker, RemoteWorker)."""

    @property
    def engine(self) -> Engine: ...

    async def call(self, fn: Callable[..., T], *args: Any) -> T: ...

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]: ...

    async def generate(self, handle: int, proposed: int = -1) -> GenerateResult: ...

    async def prefill(self, handle: int) -> float: ...

    async def verify(
        self, handle: int, tokens: list[int], check: list[int], bonus: bool = False, tolerance: float = 0.0
    ) -> VerifyResult:
        """The engine's `verify`, run as the worker shares the engine (the embedded one: in bounded chunks
        between other sessions' work). On an error the history is as before the verify."""
        ...

    def shutdown(self) -> None: ...
