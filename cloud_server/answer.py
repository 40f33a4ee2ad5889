"""The answer a session shares with its device: one interface, a token and a text implementation.

Why one seam: a session shares its answer either as the cloud model's token ids (protocol v1-v3,
cloud_server/token_answer.py) or as text (protocol v3 text mode, cloud_server/text_answer.py),
but the device asks the same four things of either: take my part (`sync`), write at a hard
position (`generate`), judge my draft (`verify`), cut back (`rollback`). The connection
(cloud_server/session.py) picks the implementation once, at `hello`, and hands each of the four
messages to it; each implementation checks positions in its own unit (tokens or bytes) and
leaves the counting to the session's accounting (cloud_server/session_accounting.py).

This module also holds the few rules both implementations apply the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Awaitable, Callable

from cloud_server.engine_api import Capabilities, Worker
from cloud_server.session_accounting import SessionAccounting
from shared.protocol import ErrorCode, Message, ProtocolError

Send = Callable[[Message], Awaitable[None]]  # the way to the device (the transport's)
Verb = Callable[[Any], Awaitable[None]]  # a handler of one of the four messages (each takes its own type)


class SharedAnswer(ABC):
    """The answer one session shares, in its own unit (tokens or bytes); what each is given: the
    engine (through its worker), what it can do, the server's limit on a request's tokens, the
    session's accounting and the way to the device."""

    mode: str  # the `accept`'s mode: "tokens" or "text"
    messages: tuple[type[Message], type[Message], type[Message], type[Message]]  # sync, generate, verify, rollback
    other_mode: str  # why the other mode's messages are refused (after the message type)

    def __init__(
        self, worker: Worker, caps: Capabilities, max_tokens: int, acct: SessionAccounting, send: Send
    ) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.caps = caps
        self.max_tokens = max_tokens  # the most tokens one request may ask for
        self.acct = acct
        self.handle = acct.handle
        self.send = send

    @abstractmethod
    def capabilities(self) -> list[str]:
        """What the device may ask for in this mode (the `accept`'s list)."""

    @abstractmethod
    async def sync(self, msg: Any) -> None:
        """The device's part of the answer joins it."""

    @abstractmethod
    async def generate(self, msg: Any) -> None:
        """A hard position: the device's part, then the cloud writes."""

    @abstractmethod
    async def verify(self, msg: Any) -> None:
        """The cloud's check of the device's draft."""

    @abstractmethod
    async def rollback(self, msg: Any) -> None:
        """The answer is cut back."""


def verbs_of(answer: SharedAnswer) -> dict[type[Message], Verb]:
    """The answer's handler for each of its four message types (looked up once per message)."""
    return dict(zip(answer.messages, (answer.sync, answer.generate, answer.verify, answer.rollback)))


def check_max_tokens(max_tokens: int, limit: int) -> None:
    """A request may ask for at most the server's `max_tokens_per_request` tokens."""
    if max_tokens > limit:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"max_tokens {max_tokens} exceeds the server limit {limit}", field="max_tokens"
        )


def check_can_verify(caps: Capabilities, mtype: str, instead: str) -> None:
    """A check is refused by name on an engine that cannot verify (the device asks `instead`)."""
    if not caps.verify:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"{mtype} is not supported by this server's engine ({caps.name}); use {instead}"
        )
