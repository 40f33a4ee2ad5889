"""The built-in `cost` engine: per position, the tier whose expected gain best pays for its cost.

For each cloud tier t the engine reads the expected gain of asking it, g_t: the score of the
router trained for the device and that tier's model (`Position.score_for(t)`; the device fills one
per tier where such a router ships, else every tier reads the pair's score). Gains compared across
tiers must be in one unit, so each tier reads the router whose labels the top tier's model judged
(`tokenrouter-train label --judge`, the signed `gain` label: g_t in (-1, 1), negative where the
tier's token is expected to be worse than the device's), where one ships. Each tier has a
cost c_t in GPU-milliseconds per asked token, from the GPU cost model (shared/gpu_cost.py) at the
tier's model size (`sizes=8/70`: an 8B, then a 70B), plus, where others wrote the positions since the
tier last did, the pass it needs to take them in first (its KV cache follows the history): asks
that follow the device's tokens cost a tier two passes, asks in a row one. The position goes to

    argmax_t  g_t - lambda * c_t     (the device, t = 0: gain 0, cost 0)

among the tiers that still fit the answer's budgets: at most `gpu_ms` GPU-ms per answer, and at
most `wait_ms` of added wait before the first clause is out (each ask before it waits a round trip,
`rtt_ms`, plus the tier's pass). lambda, the price of a GPU-millisecond, is calibrated online like
the policy's threshold: it rises while the answers spend more than `gpu_ms_per_token` per position
and falls while they spend less (a dual-ascent step per position). The default spend is what the
built-in router would spend sending its cloud share to the first cloud tier, so the pool is
compared with the pair at equal GPU-seconds.

    --decision-engine cost                       # defaults: sizes 8/.../70; the router's spend
    --decision-engine cost:gpu_ms_per_token=5,gpu_ms=400,wait_ms=120
"""

from __future__ import annotations

import math

from shared.decision_engine_api import DEVICE, DecisionEngineError, EngineSetup, Position, option_number
from shared.gpu_cost import GpuCostModel, default_tier_sizes, parse_tier_sizes

DEFAULT_RTT_MS = 40.0  # a WAN round trip to the cloud
DEFAULT_SHARE = 0.3  # the spend of this cloud share at tier 1, where the policy names none
STEP = 0.05  # lambda's step, in units of the score threshold it sets at tier 1


class CostEngine:
    """gain - lambda * cost per position under per-answer budgets, lambda calibrated online."""

    name = "cost"

    def __init__(
        self,
        costs_ms: list[float],
        waits_ms: list[float],
        gpu_ms_per_token: float,
        gpu_ms: float = math.inf,
        wait_ms: float = math.inf,
        catch_up_ms: list[float] | None = None,
    ) -> None:
        """`costs_ms` and `waits_ms` per cloud tier (1, 2, ...): GPU-ms and wait per ask; `catch_up_ms`:
        GPU-ms of the pass a tier takes in the tokens others wrote since it last wrote (0: not counted)."""
        self.costs = [0.0, *costs_ms]
        self.catch_up = [0.0, *(catch_up_ms or [0.0] * len(costs_ms))]
        self.waits = [0.0, *waits_ms]
        self.target = gpu_ms_per_token
        self.gpu_ms, self.wait_ms = gpu_ms, wait_ms
        self.unit = min(costs_ms)  # the cheapest ask: lambda * unit is a score threshold there
        self.price = 0.5 / self.unit  # lambda: a threshold of 0.5 on the cheapest tier to start
        self.spent = self.waited = 0.0
        self.last: int | None = None  # who wrote the last position (None: none yet, every tier read the prompt)

    def start_answer(self) -> None:
        self.spent = self.waited = 0.0
        self.last = None  # every tier reads the prompt: a cost no decision changes

    def cost(self, tier: int) -> float:
        """GPU-ms of asking `tier` here: the ask, and the catch-up pass if others wrote since it did."""
        in_step = self.last is None or self.last == tier
        return self.costs[tier] + (0.0 if in_step else self.catch_up[tier])

    def decide(self, position: Position) -> int:
        best, best_net, best_cost, open_tiers = DEVICE, 0.0, 0.0, 0
        for tier in range(1, len(self.costs)):
            cost = self.cost(tier)
            if self.spent + cost > self.gpu_ms:
                continue
            if position.in_first_clause and self.waited + self.waits[tier] > self.wait_ms:
                continue
            open_tiers += 1
            net = position.score_for(tier) - self.price * cost
            if net > best_net:
                best, best_net, best_cost = tier, net, cost
        self.last = best
        self.spent += best_cost
        if position.in_first_clause:
            self.waited += self.waits[best]
        if open_tiers:  # (a position the budgets kept on the device says nothing about the price)
            # dual ascent on the spend per position: a step of STEP in tier 1's threshold per unit overspent
            self.price = max(0.0, self.price + STEP * (best_cost - self.target) / (self.unit * self.unit))
        return best


def make_cost_engine(setup: EngineSetup) -> CostEngine:
    """The `cost` engine for this pool, its options checked (module docstring)."""
    known = {"sizes", "gpu_ms_per_token", "gpu_ms", "wait_ms", "rtt_ms"}
    unknown = set(setup.options) - known
    if unknown:
        raise DecisionEngineError(f"cost takes {', '.join(sorted(known))}, not {', '.join(sorted(unknown))}")
    n_cloud = setup.tiers - 1
    if n_cloud < 1:
        raise DecisionEngineError("cost needs at least one cloud tier")
    sizes_text = setup.options.get("sizes")
    try:
        sizes = default_tier_sizes(n_cloud) if sizes_text is None else parse_tier_sizes(sizes_text, n_cloud)
    except ValueError as exc:
        raise DecisionEngineError(f"cost: sizes: {exc}") from None
    models = [GpuCostModel.for_size(b) for b in sizes]
    costs = [m.gpu_ms_per_ask() for m in models]
    rtt = option_number("cost", "rtt_ms", setup.options.get("rtt_ms", str(DEFAULT_RTT_MS)))
    share = setup.policy.config.cloud_fraction
    default_rate = (DEFAULT_SHARE if share is None else share) * costs[0]
    rate = option_number("cost", "gpu_ms_per_token", setup.options.get("gpu_ms_per_token", str(default_rate)))
    return CostEngine(
        costs,
        [rtt + 1000.0 * m.pass_s for m in models],
        rate,
        gpu_ms=option_number("cost", "gpu_ms", setup.options.get("gpu_ms", "inf")),
        wait_ms=option_number("cost", "wait_ms", setup.options.get("wait_ms", "inf")),
        catch_up_ms=[1000.0 * m.gpu_seconds(1, 0) for m in models],
    )
