"""Conversation history: a system prompt plus turns, bounded in tokens, and which of them a prompt carries."""

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

# Which earlier exchanges a prompt carries (DialogueOptions.memory): "follow-ups" those a follow-up request goes
# on from (is_follow_up), "all" the whole history, "none" nothing but the system prompt.
MEMORY_MODES = ("follow-ups", "all", "none")


@dataclass
class DialogueOptions:
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_history_tokens: int = 768  # oldest exchanges are dropped beyond this
    # The device's small model copies the last answer's words into the next one ("set a timer" answered with
    # the router's settings), so by default only a follow-up sees the exchanges it follows (issue 45)
    memory: str = "follow-ups"

    def __post_init__(self) -> None:
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"dialogue memory must be one of {', '.join(MEMORY_MODES)}, not {self.memory!r}")


# A request that opens with one of these goes on from the one before: "and on Sunday?", "what about italy".
CONNECTIVES = ("and", "but", "also", "so", "then", "or", "what about", "how about", "what else")
# Words (and "… one" phrases: "one" alone is mostly a number) that point back at something said before.
BACK_REFERENCES = (
    *("it", "its", "that", "this", "those", "these", "they", "them", "their", "there"),
    *("he", "she", "him", "her", "his", "which one", "another one", "other one", "same one"),
)
# Set phrases whose "it", "there" or "this" points at nothing said: removed before looking for BACK_REFERENCES.
POINTS_AT_NOTHING = (
    *("time is it", "day is it", "date is it", "year is it", "late is it", "cold is it", "hot is it", "warm is it"),
    *("is it going to", "will it rain", "will it snow", "is it raining", "is it snowing", "is it cold", "is it hot"),
    *("is it warm", "is it sunny", "is it windy", "is there", "are there", "there is", "there are", "hi there"),
    *("hello there", "this morning", "this afternoon", "this evening", "this week", "this weekend", "this year"),
)
SHORT_WORDS = 3  # a request this short without a verb is a fragment of the conversation: "on sunday?", "why?"
# Words that make a short request one of its own: verbs ("stop", "play jazz", "what's up"), greetings, thanks.
STANDS_ALONE = frozenset(
    "is are was were be am do does did can could will would should have has had set play turn tell call text "
    "send stop start open close show find give make get go take say read write remind add cancel pause resume "
    "skip repeat help thank thanks hi hello hey bye goodbye".split()
)


def is_follow_up(request: str, previous_request: str | None) -> bool:
    """Whether `request` goes on from the exchange before it (`previous_request`; None: there is none), so its
    prompt needs that exchange. The rule, on the lowercased words ("'s" read as "is"):

    - it opens with a connective (CONNECTIVES): "and what about italy", "but on sunday";
    - or it points back (BACK_REFERENCES): "how long does it take", "is that true", "how do i get there",
      except in set phrases that point at nothing (POINTS_AT_NOTHING): "what time is it", "is it going to
      rain", "is there a pharmacy near me";
    - or it is a fragment: SHORT_WORDS words at most, none of them a verb or greeting (STANDS_ALONE):
      "on sunday?", "why?", "in french".

    Anything else stands on its own ("set a timer for ten minutes", "what is two plus two") and gets no history:
    the small device model copies the words of whatever answer is in its prompt. A false "yes" costs little
    (the prompt carries the history, as it always did); a false "no" loses the context of a real follow-up.
    """
    if previous_request is None:
        return False
    text = " ".join(re.sub(r"[^\w\s]", " ", re.sub(r"'s\b", " is", request.lower())).split())
    if not text:
        return False
    if any(text == c or text.startswith(c + " ") for c in CONNECTIVES):
        return True
    padded = f" {text} "
    for phrase in POINTS_AT_NOTHING:
        padded = padded.replace(f" {phrase} ", " ")
    if any(f" {word} " in padded for word in BACK_REFERENCES):
        return True
    words = text.split()
    return len(words) <= SHORT_WORDS and not STANDS_ALONE.intersection(words)


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
    turns: list[dict] = field(default_factory=list)  # the whole conversation, user and assistant in turn
    # Per exchange in `turns` (a user and an assistant message): whether its request followed up the one before
    # (is_follow_up), so that "follow-ups" memory knows how far back a follow-up's context reaches
    follow_ups: list[bool] = field(init=False, default_factory=list)
    # A request the person went on with after its reply started (VoiceOptions.rejoin_cut_off): the next user
    # message continues it, and its cut-off reply is not kept
    continuing: str | None = None

    def __post_init__(self) -> None:
        requests = [t["content"] for t in self.turns[::2]]
        self.follow_ups = [is_follow_up(r, requests[i - 1] if i else None) for i, r in enumerate(requests)]

    def request(self, user_text: str) -> str:
        """The user message that `user_text` makes: itself, or the rest of the request it goes on with."""
        return join_request(self.continuing, user_text) if self.continuing else user_text

    def messages(self, user_text: str | None = None) -> list[dict]:
        """The prompt for `user_text`: the system prompt, the earlier turns the memory policy keeps for its
        request (`remembered`), and the request. Without `user_text`: the system prompt and the whole history.
        The generator reuses its KV cache for the part a prompt shares with the last one (a follow-up's prompt
        extends it; an unrelated request's shares the system prompt)."""
        system = {"role": "system", "content": self.opts.system_prompt}
        if user_text is None:
            return [system, *self.turns]
        request = self.request(user_text)
        return [system, *self.remembered(request), {"role": "user", "content": request}]

    def remembered(self, request: str) -> list[dict]:
        """The earlier turns the prompt for `request` carries (DialogueOptions.memory). With "follow-ups": none
        for a request of its own; for a follow-up, the exchange it follows and, while that one was a follow-up
        too, the ones before it, back to the question the chain began with."""
        if self.opts.memory == "all":
            return list(self.turns)
        if self.opts.memory == "none" or not is_follow_up(request, self._last_request()):
            return []
        first = len(self.follow_ups) - 1  # the exchange the request follows
        while first > 0 and self.follow_ups[first]:
            first -= 1
        return self.turns[2 * first :]

    def _last_request(self) -> str | None:
        return self.turns[-2]["content"] if self.turns else None

    def add_exchange(self, user_text: str, assistant_text: str) -> str:
        """Record a finished (or interrupted) exchange; `assistant_text` is what was actually said. Returns
        the user message recorded (`request`)."""
        request, self.continuing = self.request(user_text), None
        self.follow_ups.append(is_follow_up(request, self._last_request()))
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
            del self.follow_ups[0]

    def reset(self) -> None:
        self.turns.clear()
        self.follow_ups.clear()
        self.continuing = None

    @staticmethod
    def is_reset_command(text: str) -> bool:
        t = " ".join("".join(c for c in text.lower() if c.isalnum() or c.isspace()).split())
        return any(p in t for p in RESET_PHRASES) and len(t.split()) <= 5
