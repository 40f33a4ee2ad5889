"""A finished turn as one JSON record: what `file --json` prints and what the web app's page gets.

Why one function: the CLI, the benchmarks and the page read the same facts of a turn (what was heard,
the routed answer, the latency waterfall, how the turn ended), so each fact has one key everywhere.
Callers add only what is theirs on top: `file` its run (the reply's WAV, seconds into the input file),
the web app its cloud-share tally (edge_client/webapp/conversation.py). Fields: docs/voice.md.
"""

from __future__ import annotations

from typing import Any

from ..answer import Answer
from .events import TurnDone


def _round(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


# The part of `Answer.to_json` (`ask --json`) a turn needs, under the same names: its text, who wrote each
# token ("tiers": 0 the device, 1 the cloud, 2+ a tier above it), what the cloud cost, and how it ended
# ("finish_reason" "length": cut at the token limit; "warnings": a base model wrote some of it)
TURN_ANSWER_KEYS = (
    "text",
    "pieces",
    "routes",
    "tiers",
    "scores",
    "lookahead_positions",
    "overruled_positions",
    "n_tokens",
    "n_cloud_tokens",
    "round_trips",
    "bytes_up",
    "bytes_down",
    "cloud_timeouts",
    "degraded",
    "finish_reason",
    "warnings",
)


def answer_json(a: Answer) -> dict[str, Any]:
    """The routed answer: `Answer.to_json`'s TURN_ANSWER_KEYS, plus the failovers (the session rebuilt on
    another cloud replica) and what they cost, and the first token's latency."""
    full = a.to_json()
    return {k: full[k] for k in TURN_ANSWER_KEYS} | {
        "reconnects": a.traffic.reconnects,
        "failover_lost_ms": _round(a.traffic.failover_lost_ms),
        "first_token_ms": _round(a.latency.first_token),
    }


def turn_json(done: TurnDone) -> dict[str, Any]:
    """The turn: what was heard and kept, the answer (None: a reset, or no answer), the latency
    waterfall and the reply's playback, and how the end of the turn was decided."""
    return {
        "transcript": done.transcript,
        "request": done.request or done.transcript,  # the user message answered (went on with: the whole)
        "spoken_text": done.spoken_text,  # what went into the history: all of the reply, or what was played
        "interrupted": done.interrupted,
        "rejoined": done.rejoined,  # the person went on: this reply was dropped, the next turn answers it all
        "reset": done.reset,
        "answer": answer_json(done.answer) if done.answer is not None else None,
        **done.timings.to_json(),
        "end_of_turn": done.end_of_turn.to_json() if done.end_of_turn is not None else None,
        "draft": done.draft,
    }
