"""An example decision engine for TokenRouter's token hook (shared/decision_engine.py).

`budget` lets the built-in routing policy decide, but sends at most `max_cloud`
positions of an answer to the cloud; the rest of the answer stays on the device.
The policy still sees every score, so a calibrated cloud share keeps learning.

    pip install examples/budget-engine
    tokenrouter-edge ask "why is the sky blue" --decision-engine budget:max_cloud=4
"""

from __future__ import annotations

from shared.decision_engine import CLOUD, DEVICE, DecisionEngine, EngineSetup, Position
from shared.policy import RoutingPolicy


class BudgetEngine:
    """The policy's decisions, capped at `max_cloud` cloud positions per answer."""

    name = "budget"

    def __init__(self, policy: RoutingPolicy, max_cloud: int) -> None:
        self.policy = policy
        self.max_cloud = max_cloud
        self.spent = 0

    def start_answer(self) -> None:
        self.spent = 0

    def decide(self, position: Position) -> int:
        wanted = self.policy.decide(position.score)  # always asked: the calibration sees every score
        if wanted and self.spent < self.max_cloud:
            self.spent += 1
            return CLOUD
        return DEVICE


def make_engine(setup: EngineSetup) -> DecisionEngine:
    """The entry point: `--decision-engine budget[:max_cloud=N]` (default 8)."""
    unknown = set(setup.options) - {"max_cloud"}
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))}; budget takes max_cloud=N")
    text = setup.options.get("max_cloud", "8")
    if not text.isdigit():
        raise ValueError(f"max_cloud must be a whole number >= 0, not {text!r}")
    return BudgetEngine(setup.policy, int(text))
