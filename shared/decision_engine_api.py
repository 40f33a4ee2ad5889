"""The types a decision engine is written against (shared/decision_engine.py is the hook that finds,
builds and calls engines; it re-exports these, so an engine imports them from either).

A position's tier is an int: `DEVICE` (0) keeps the device's token, `CLOUD` (1) asks the cloud's
model, and 2, 3, ... the tiers above it where the pool has them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shared.policy import RoutingPolicy

DEVICE, CLOUD = 0, 1


@dataclass(slots=True)
class Position:
    """One answer position as an engine sees it. The generator reuses one object per answer
    and the arrays are views into the model's buffers: read them during `decide` only (copy
    what you keep)."""

    index: int = 0  # the position in the answer, from 0
    proposed: int = -1  # the device model's token there
    score: float = 0.0  # the router's score, 0 (easy) to 1 (hard)
    hidden: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # the device model's last hidden state
    logits: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # its next-token logits
    # Per tier (index = tier), the score of the router trained for the device and that tier's model, where
    # one ships (the device fills it; the evals leave it empty): read it through `score_for`
    tier_scores: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    in_first_clause: bool = True  # no clause of the answer has ended before this position (the device fills it)
    # The rule gives this position to the cloud whatever the engine says: part of a number (shared/decision.py,
    # "Numbers"); a tier above the cloud that the engine chose stays
    cloud_required: bool = False

    def score_for(self, tier: int) -> float:
        """The expected gain of asking `tier`: its own router's score, else the pair's (`score`)."""
        return float(self.tier_scores[tier]) if tier < len(self.tier_scores) else self.score


class DecisionEngine(Protocol):
    """Decides the tier of each position the rule asks about. Called from the per-token loop:
    keep `decide` cheap (no I/O, no logging above debug, no large allocations)."""

    name: str

    def start_answer(self) -> None:
        """A new answer begins (reset per-answer state such as a budget)."""
        ...

    def decide(self, position: Position) -> int:
        """The tier that writes this position: DEVICE (0), CLOUD (1), or a tier above it (2, ...)."""
        ...


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """What an engine's factory is given."""

    policy: RoutingPolicy  # the built-in policy for these options: wrap it (keeps the calibration) or ignore it
    options: dict[str, str]  # the `name:key=value,...` options of --decision-engine
    edge_model: str = ""
    cloud_model: str = ""
    tiers: int = 2  # the pool's tiers, the device included: 0 .. tiers - 1


class DecisionEngineError(ValueError):
    """An engine that cannot be found, built or trusted; the message says what to do."""


def option_number(engine: str, key: str, text: str, high: float = math.inf) -> float:
    """An engine's numeric option (`key=text`), within [0, high]; else an error naming engine, key and range."""
    bounds = f"within [0, {high:g}]" if high < math.inf else ">= 0"
    try:
        value = float(text)
    except ValueError:
        raise DecisionEngineError(f"{engine}: {key} must be a number {bounds}, not {text!r}") from None
    if not 0.0 <= value <= high:
        raise DecisionEngineError(f"{engine}: {key} must be a number {bounds}, not {text!r}")
    return value
