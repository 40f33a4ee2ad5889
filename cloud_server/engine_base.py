"""What both engines do alike: the open sessions by handle, and the model's facts about tokens.

Why a base class: the embedded engine (cloud_server/engine.py) and the remote one
(cloud_server/remote_engine.py) answer the `Engine` protocol's questions about the model
(capabilities, chat tokens, end of generation) and about a session's history and work the
same way; they differ only in how a session's next tokens are computed.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Protocol, TypeVar

from cloud_server.engine_api import Capabilities, EngineFull
from shared.llama_backend import LlamaModel
from shared.protocol import Work


class SessionState(Protocol):
    """What the base reads of an engine's session: its token history and its uncollected work."""

    history: list[int]
    work: Work


S = TypeVar("S", bound=SessionState)


class EngineBase(Generic[S]):
    """Sessions (engine-specific states `S`) by handle, at most `max_sessions` open at once."""

    def __init__(self, model: LlamaModel, caps: Capabilities, max_sessions: int) -> None:
        self.model = model
        self.max_sessions = max_sessions
        self._caps = caps
        self._sessions: dict[int, S] = {}
        self._next_handle = 0
        self._lock = threading.Lock()  # the remote engine opens, closes and counts from many threads

    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def n_sessions(self) -> int:
        return len(self._sessions)

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        return self.model.chat_tokens(messages)

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def history(self, handle: int) -> list[int]:
        return self._sessions[handle].history

    def take_work(self, handle: int) -> Work:
        """The session's work since the last call (then reset); none for a closed session."""
        with self._lock:
            s = self._sessions.get(handle)
            if s is None:
                return Work()
            work, s.work = s.work, Work()
            return work

    def _add(self, make: Callable[[int], S]) -> int:
        """Open a session whose state `make(handle)` builds; EngineFull when all are in use."""
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise EngineFull(f"all {self.max_sessions} sessions are in use")
            handle = self._next_handle
            self._next_handle += 1
            self._sessions[handle] = make(handle)
            return handle

    def _drop(self, handle: int) -> S | None:
        """Forget a session; its state (None if it was not open)."""
        with self._lock:
            return self._sessions.pop(handle, None)
