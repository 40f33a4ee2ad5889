"""The conversation as the page shows it: each finished turn's record, and the cloud share against its target.

Why here and not in the page: a reloaded tab must show past answers exactly as they were (cloud marks,
the last turn's waterfall), so the records live with the app, not in a tab. And the cloud share is a
target the router meets over many answers (its threshold is calibrated online, shared/policy.py), not
in each one; the reasons a single answer differs are read from the answer here, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_client.answer import Answer
from edge_client.voice.events import TurnDone
from edge_client.voice.turn_record import turn_json

from .settings import AppSettings

MAX_RECORDS = 200  # turns kept for a reloaded tab (the history the model gets is shorter)
SHORT_ANSWER = 20  # tokens: below this one token moves the answer's share by 5 points or more


@dataclass
class ShareTally:
    """Answer tokens and cloud tokens since the cloud share's target was last set."""

    target: float
    tokens: int = 0
    cloud: int = 0

    def add(self, a: Answer) -> None:
        self.tokens += a.n_tokens
        self.cloud += a.n_cloud_tokens


def share_reasons(a: Answer, s: AppSettings) -> list[str]:
    """Why this answer's cloud share is what it is, in the person's words (empty: nothing to explain)."""
    if s.cloud == "none":
        return ["no cloud is set: the device answers alone"]
    if s.cloud_fraction == 0:
        return ["the cloud share is 0%: the device answers alone, with no cloud traffic"]
    why = []
    if a.degraded:
        why.append("the cloud was not there: the device wrote the rest")
    if a.traffic.reconnects:  # a failover: the cloud server went away and another took the session
        lost = a.traffic.failover_lost_ms
        why.append(f"the cloud's server changed mid-answer: the session moved, at a cost of {lost:.0f} ms")
    if 0 < a.n_tokens < SHORT_ANSWER:
        why.append(f"a short answer: one token is {100 / a.n_tokens:.0f}% of it")
    overruled = len(a.overruled_positions)
    if overruled:
        why.append(f"{overruled} token{'s' if overruled > 1 else ''} from the cloud's check of the first clause")
    if a.lookahead_tokens:
        why.append(f"{a.lookahead_tokens} cloud token{'s' if a.lookahead_tokens > 1 else ''} from its lookahead guess")
    return why


def cloud_share(a: Answer, settings: AppSettings, tally: ShareTally | None) -> dict[str, Any]:
    """This answer's cloud share beside its target, the share since the target was set, and why they differ."""
    return {
        "answer": round(a.n_cloud_tokens / a.n_tokens, 3) if a.n_tokens else 0.0,
        "target": 0.0 if settings.cloud == "none" else settings.cloud_fraction,
        "since_target": round(tally.cloud / tally.tokens, 3) if tally and tally.tokens else None,
        "since_target_tokens": tally.tokens if tally else 0,
        "why": share_reasons(a, settings),
    }


def turn_done_message(done: TurnDone, settings: AppSettings, tally: ShareTally | None = None) -> dict[str, Any]:
    """A finished turn for the page: the turn's record (voice/turn_record.py), and with an answer its cloud share."""
    d: dict[str, Any] = {"type": "turn_done", **turn_json(done)}
    if done.answer is not None:
        if settings.cloud == "none":  # the person turned the cloud off: the device finishing alone is no failure
            d["answer"]["degraded"] = False
        d["cloud_share"] = cloud_share(done.answer, settings, tally)
    return d


class TurnLog:
    """The records of finished turns (`turn_done_message`), kept for a tab that reloads or takes over."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.tally: ShareTally | None = None

    def add(self, done: TurnDone, settings: AppSettings) -> dict[str, Any]:
        """Record a finished turn; returns its record (the page's `turn_done` message)."""
        target = settings.cloud_fraction
        if self.tally is None or self.tally.target != target:
            self.tally = ShareTally(target)
        if done.answer is not None and not done.reset:
            self.tally.add(done.answer)
        rec = turn_done_message(done, settings, self.tally)
        if not done.reset:
            self.records.append(rec)
            del self.records[:-MAX_RECORDS]
        return rec

    def for_history(self, history: list[dict[str, str]]) -> list[dict[str, Any] | None]:
        """One record per user/assistant pair of `history` (None where none matches: a turn from before
        this launch, say), so a reloaded page shows what the model remembers, with its marks."""
        pairs = [(history[i]["content"], history[i + 1]["content"]) for i in range(0, len(history) - 1, 2)]
        out: list[dict[str, Any] | None] = [None] * len(pairs)
        j = len(self.records) - 1  # matched from the newest back: the history is the records' tail
        for k in range(len(pairs) - 1, -1, -1):
            for m in range(j, -1, -1):
                r = self.records[m]
                if (r["request"], r["spoken_text"]) == pairs[k]:
                    out[k], j = r, m - 1
                    break
        return out
