"""Typed events the pipeline emits to its observers (the TUI, the CLI, tests).

An interruption is an event like any other: observers learn that playback
stopped and what part of the answer was actually heard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..answer import Answer, TokenEvent
from .endofturn import TurnDecision
from .timings import TurnTimings


@dataclass(frozen=True, slots=True)
class Listening:
    """The pipeline is ready for the person to speak."""


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    t: float


@dataclass(frozen=True, slots=True)
class PartialTranscript:
    stable: str  # agreed by two consecutive decodes; only grows
    unstable: str


@dataclass(frozen=True, slots=True)
class FinalTranscript:
    text: str


@dataclass(frozen=True, slots=True)
class TurnJudged:
    """At a pause, the end-of-turn judge set how long to wait (finished: short; unfinished: long)."""

    decision: TurnDecision


@dataclass(frozen=True, slots=True)
class AnswerToken:
    token: TokenEvent


@dataclass(frozen=True, slots=True)
class ReplyHeld:
    """Speech-like sound while the reply plays: playback paused (`held`) until it proves to be speech (then an
    Interruption follows) or a false start (`held=False`: playback resumes). Without echo cancellation on open
    speakers the reply's own echo does this over and over: the reply stutters."""

    t: float
    held: bool


@dataclass(frozen=True, slots=True)
class Interruption:
    """Barge-in: playback and generation stopped; `heard` is what the person actually heard."""

    t_onset: float  # capture time of the interrupting speech onset
    t_stopped: float  # when playback was paused
    heard: str
    rejoined: bool = False  # the person went on with the request: nothing of this reply is kept


@dataclass(slots=True)
class TurnDone:
    transcript: str
    answer: Answer | None
    spoken_text: str  # what went into the history (all of it, or only what was played)
    interrupted: bool
    timings: TurnTimings = field(default_factory=TurnTimings)
    reset: bool = False  # the person asked to reset the conversation
    end_of_turn: TurnDecision | None = None  # why the turn ended when it did
    draft: str = (
        "off"  # the reply drafted from a partial transcript: "hit" (released), "miss", "none" (no draft), "off"
    )
    request: str = ""  # the user message answered: the transcript, or the request it went on with joined to it
    rejoined: bool = False  # the person went on with this request: its reply stopped and the next turn answers it


@dataclass(frozen=True, slots=True)
class Notice:
    """Something the person should know (a recoverable error, a device problem)."""

    level: str  # "info" | "warning" | "error"
    message: str


Event = (
    Listening
    | SpeechStarted
    | PartialTranscript
    | TurnJudged
    | FinalTranscript
    | AnswerToken
    | ReplyHeld
    | Interruption
    | TurnDone
    | Notice
)
