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

from .settings import AppSettings

MAX_RECORDS = 200  # turns kept for a reloaded tab (the history the model gets is shorter)
SHORT_ANSWER = 20  # tokens: below this one token moves the answer's share by 5 points or more


def _round(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(float(x), nd)


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


def turn_json(done: TurnDone, settings: AppSettings, tally: ShareTally | None = None) -> dict[str, Any]:
    """A finished turn for the page: what was said and kept, the waterfall, and how the answer was routed."""
    t = done.timings
    d: dict[str, Any] = {
        "type": "turn_done",
        "transcript": done.transcript,
        "spoken_text": done.spoken_text,
        "interrupted": done.interrupted,
        "reset": done.reset,
        "timings": t.relative_ms(),
        "eos_to_first_audio_ms": _round(t.end_of_speech_to_first_audio_ms),
        "endpoint_to_first_audio_ms": _round(t.endpoint_to_first_audio_ms),
        "playback_gaps": t.playback_gaps,  # where synthesis fell behind playback (TurnTimings)
        "playback_gap_ms": _round(t.playback_gap_ms),
        "first_piece_cached": t.first_piece_cached,  # the first piece played from the synthesiser's cache
        "draft": done.draft,
        "end_of_turn": done.end_of_turn.to_json() if done.end_of_turn is not None else None,
        "answer": None,
    }
    a = done.answer
    if a is not None:
        d["answer"] = {
            "text": a.text,
            "pieces": a.pieces,
            "routes": a.routes,
            "tiers": a.tiers,  # who wrote each token: 0 the device, 1 the cloud, 2+ a tier above it (--tier)
            "scores": [_round(s, 3) for s in a.scores],
            "lookahead_positions": a.lookahead_positions,
            "overruled_positions": a.overruled_positions,
            "n_tokens": a.n_tokens,
            "n_cloud_tokens": a.n_cloud_tokens,
            "round_trips": a.round_trips,
            "bytes_up": a.bytes_up,
            "bytes_down": a.bytes_down,
            "cloud_timeouts": a.cloud_timeouts,
            "reconnects": a.traffic.reconnects,  # failovers: the session rebuilt on another cloud replica
            "failover_lost_ms": _round(a.traffic.failover_lost_ms),
            "degraded": bool(a.degraded and settings.cloud != "none"),
            "finish_reason": a.finish_reason,  # "length": cut at the token limit, not a complete answer
            "warnings": a.warnings,  # a base model wrote some of it (generator.base_model_warnings)
            "first_token_ms": _round(a.latency.first_token),
        }
        d["cloud_share"] = {
            "answer": round(a.n_cloud_tokens / a.n_tokens, 3) if a.n_tokens else 0.0,
            "target": 0.0 if settings.cloud == "none" else settings.cloud_fraction,
            "since_target": round(tally.cloud / tally.tokens, 3) if tally and tally.tokens else None,
            "since_target_tokens": tally.tokens if tally else 0,
            "why": share_reasons(a, settings),
        }
    return d


class TurnLog:
    """The records of finished turns (`turn_json`), kept for a tab that reloads or takes over."""

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
        rec = turn_json(done, settings, self.tally)
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
                if (r["transcript"], r["spoken_text"]) == pairs[k]:
                    out[k], j = r, m - 1
                    break
        return out
