"""Conversation history: a system prompt plus turns, bounded in tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# The voice commands' prompt (listen, file, app, and the voice benchmarks): written for speech. `ask` keeps
# shared/prompting.py's, which the routers were labelled with.
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful voice assistant. Answer in one to three short spoken sentences, "
    "without lists, markdown or emoji."
)

RESET_PHRASES = ("reset the conversation", "reset conversation", "start over", "new conversation")


@dataclass
class DialogueOptions:
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_history_tokens: int = 768  # oldest exchanges are dropped beyond this


@dataclass
class Dialogue:
    opts: DialogueOptions = field(default_factory=DialogueOptions)
    count_tokens: Callable[[list[dict]], int] | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self, user_text: str | None = None) -> list[dict]:
        """Full dialogue to send (the generator reuses its KV cache when it extends the last one)."""
        msgs = [{"role": "system", "content": self.opts.system_prompt}, *self.turns]
        if user_text is not None:
            msgs.append({"role": "user", "content": user_text})
        return msgs

    def add_exchange(self, user_text: str, assistant_text: str) -> None:
        """Record a finished (or interrupted) exchange; `assistant_text` is what was actually said."""
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": assistant_text}]
        self._trim()

    def _trim(self) -> None:
        if self.count_tokens is None:
            return
        while len(self.turns) > 2 and self.count_tokens(self.messages()) > self.opts.max_history_tokens:
            del self.turns[:2]

    def reset(self) -> None:
        self.turns.clear()

    @staticmethod
    def is_reset_command(text: str) -> bool:
        t = " ".join("".join(c for c in text.lower() if c.isalnum() or c.isspace()).split())
        return any(p in t for p in RESET_PHRASES) and len(t.split()) <= 5
