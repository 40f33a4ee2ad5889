"""Conversation history: a system prompt plus turns, bounded in tokens."""

from __future__ import annotations

import re
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


def join_request(first: str, more: str) -> str:
    """One request from a request cut off at a pause and the words that went on with it: "What time does the
    store close?" + "On Sunday." -> "What time does the store close on Sunday." (Whisper closed the first half
    as a sentence and opened the second as one)."""
    first, more = first.strip().rstrip(".?!…").rstrip(), more.strip()
    if not first or not more:
        return first or more
    if more[:1].isupper() and not re.match(r"I\b", more):
        more = more[0].lower() + more[1:]
    return f"{first} {more}"


@dataclass
class Dialogue:
    opts: DialogueOptions = field(default_factory=DialogueOptions)
    count_tokens: Callable[[list[dict]], int] | None = None
    turns: list[dict] = field(default_factory=list)
    # A request the person went on with after its reply started (VoiceOptions.rejoin_cut_off): the next user
    # message continues it, and its cut-off reply is not kept
    continuing: str | None = None

    def request(self, user_text: str) -> str:
        """The user message that `user_text` makes: itself, or the rest of the request it goes on with."""
        return join_request(self.continuing, user_text) if self.continuing else user_text

    def messages(self, user_text: str | None = None) -> list[dict]:
        """Full dialogue to send (the generator reuses its KV cache when it extends the last one)."""
        msgs = [{"role": "system", "content": self.opts.system_prompt}, *self.turns]
        if user_text is not None:
            msgs.append({"role": "user", "content": self.request(user_text)})
        return msgs

    def add_exchange(self, user_text: str, assistant_text: str) -> str:
        """Record a finished (or interrupted) exchange; `assistant_text` is what was actually said. Returns
        the user message recorded (`request`)."""
        request, self.continuing = self.request(user_text), None
        self.turns += [{"role": "user", "content": request}, {"role": "assistant", "content": assistant_text}]
        self._trim()
        return request

    def continue_request(self, user_text: str) -> str:
        """The person went on speaking after `user_text` was taken as a whole request: no exchange is recorded,
        and the next user message is the two joined. Returns the request so far."""
        self.continuing = self.request(user_text)
        return self.continuing

    def _trim(self) -> None:
        if self.count_tokens is None:
            return
        while len(self.turns) > 2 and self.count_tokens(self.messages()) > self.opts.max_history_tokens:
            del self.turns[:2]

    def reset(self) -> None:
        self.turns.clear()
        self.continuing = None

    @staticmethod
    def is_reset_command(text: str) -> bool:
        t = " ".join("".join(c for c in text.lower() if c.isalnum() or c.isspace()).split())
        return any(p in t for p in RESET_PHRASES) and len(t.split()) <= 5
