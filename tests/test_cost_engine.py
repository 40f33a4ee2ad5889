"""The `cost` engine (shared/cost_engine.py) and the GPU cost model it prices tiers with
(shared/gpu_cost.py): synthetic score streams stand in for a router here (the engine's arithmetic
is what is tested); tests/test_tiers.py runs it over three real servers."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.replay.metrics import gpu_seconds
from shared.cost_engine import CostEngine
from shared.decision_engine import DecisionEngineError, EngineSetup, Position, build_engine
from shared.gpu_cost import PRODUCTION_CLOUD, GpuCostModel
from shared.policy import PolicyConfig, RoutingPolicy

POLICY = RoutingPolicy(PolicyConfig("router", threshold=0.5, cloud_fraction=0.3))


def engine(spec: str = "cost", tiers: int = 3) -> CostEngine:
    built = build_engine(spec, EngineSetup(POLICY, {}, tiers=tiers))
    assert isinstance(built, CostEngine)
    return built


def test_the_cost_model_is_docs_servers_and_scales_with_model_size():
    """docs/server.md: a 70B on 4 H100s, ~15 ms a pass, ~71 us a token; an 8B fits one GPU."""
    assert PRODUCTION_CLOUD.gpus == 4 and abs(PRODUCTION_CLOUD.pass_s - 0.015) < 0.0005
    assert abs(PRODUCTION_CLOUD.token_s - 71e-6) < 1e-6
    assert gpu_seconds(2, 10) == pytest.approx(4 * (2 * PRODUCTION_CLOUD.pass_s + 10 * PRODUCTION_CLOUD.token_s))
    small, big = GpuCostModel.for_size(8), GpuCostModel.for_size(70.6)
    assert (small.gpus, big.gpus) == (1, 4)
    assert 8 < big.gpu_ms_per_ask() / small.gpu_ms_per_ask() < 10  # 9x the weights read per pass
    with pytest.raises(ValueError, match="positive number of billions"):
        GpuCostModel.for_size(0)


def test_the_price_calibrates_to_the_spend_whatever_the_scores_scale():
    """The default spend is the router's: its cloud share (0.3) at the first cloud tier. Over two
    score distributions (wide and low), the spend per position after calibration is within 10% of it."""
    rng = np.random.default_rng(0)
    for draw in (lambda n: rng.uniform(0, 1, n), lambda n: rng.beta(0.7, 6.0, n)):
        e = engine()
        target = 0.3 * e.costs[1]
        assert e.target == pytest.approx(target)
        s1, s2 = draw(6000), draw(6000)
        spent = []
        for i in range(6000):
            if i % 40 == 0:
                e.start_answer()
            costs = [e.cost(t) for t in range(3)]  # with the catch-up pass where others wrote since
            tier = e.decide(
                Position(
                    index=i % 40, score=float(s1[i]), tier_scores=np.array([0, s1[i], s2[i]]), in_first_clause=False
                )
            )
            spent.append(costs[tier])
        assert abs(np.mean(spent[2000:]) / target - 1) < 0.1, np.mean(spent[2000:])


def test_an_ask_after_others_wrote_costs_the_tiers_catch_up_pass():
    """A tier's cache follows the history: asked after the device (or another tier) wrote, the server
    first takes those tokens in, a pass of its own (bench_pool's pairs measured ~1 + asks + such switches
    passes per answer; docs/journal/router.md). Asks in a row cost one pass each; the prompt's pass, at
    the start of every answer, is no decision's."""
    e = engine("cost:sizes=8/70")
    pass_ms = [0.0, *(1000.0 * GpuCostModel.for_size(b).gpu_seconds(1, 0) for b in (8, 70))]
    want = [0, 2, 2, 0, 2, 1, 1, 0]  # who should write each position; scores that make it so, below
    e.price, e.target = 0.0, float("inf")  # no spend to aim at: the price stays 0 and the scores alone decide
    spent = 0.0
    e.start_answer()
    for i, tier in enumerate(want):
        costs = [e.cost(t) for t in range(3)]
        assert costs[0] == 0.0
        for t in (1, 2):  # in step only when it wrote the last position (or at the start: the prompt)
            in_step = i == 0 or want[i - 1] == t
            assert costs[t] == pytest.approx(e.costs[t] + (0.0 if in_step else pass_ms[t])), (i, t)
        scores = np.array([0.0, 0.5 if tier == 1 else -1.0, 0.9 if tier == 2 else -1.0])
        got = e.decide(Position(index=i, score=0.0, tier_scores=scores, in_first_clause=False))
        assert got == tier, (i, got)
        spent += costs[got]
    assert e.spent == pytest.approx(spent)
    # 8B: two asks in a row after the 70B wrote, one catch-up; 70B: asked twice, each after the device
    assert spent == pytest.approx(2 * e.costs[1] + pass_ms[1] + 3 * e.costs[2] + 2 * pass_ms[2])


def test_a_position_goes_where_gain_best_pays_for_cost():
    e = engine("cost:sizes=8/70")
    c1, c2 = e.costs[1], e.costs[2]
    e.price = 0.005  # fixed here: a GPU-ms is worth 0.005 of gain
    cases = {(0.01, 0.02): 0, (0.5, 0.5): 1, (0.3, 0.95): 2 if 0.95 - 0.005 * c2 > 0.3 - 0.005 * c1 else 1}
    for (g1, g2), want in cases.items():
        e.price = 0.005
        assert e.decide(Position(score=g1, tier_scores=np.array([0, g1, g2]))) == want, (g1, g2)
    e.price = 0.005
    assert e.decide(Position(score=0.3)) == 1  # no tier scores (the evals): every tier reads the pair's score


def test_the_answers_budgets_hold():
    """gpu_ms caps each answer's spend; wait_ms caps the added wait before the first clause only."""
    e = engine("cost:gpu_ms=100,gpu_ms_per_token=1000")  # a spend target no answer reaches: only the cap binds
    for _ in range(3):
        e.start_answer()
        tiers = [e.decide(Position(score=0.99, tier_scores=np.array([0, 0.99, 0.99]))) for _ in range(60)]
        assert sum(e.costs[t] for t in tiers) <= 100 and e.spent <= 100 and any(tiers)
    e = engine("cost:gpu_ms=10")  # room for one 8B ask: then the budget, not the price, keeps the device
    e.start_answer()
    e.decide(Position(score=0.99))
    price = e.price
    assert [e.decide(Position(score=0.99)) for _ in range(20)] == [0] * 20 and e.price == price  # nothing learned
    e = engine("cost:wait_ms=100,gpu_ms_per_token=1000")
    e.start_answer()
    first = [e.decide(Position(score=0.99, in_first_clause=True)) for _ in range(20)]
    assert sum(e.waits[t] for t in first) <= 100 and first.count(0) > 0
    later = [e.decide(Position(score=0.99, in_first_clause=False)) for _ in range(20)]
    assert 0 not in later  # after the first clause the wait budget no longer binds


def test_bad_options_are_named():
    for spec, match in (
        ("cost:speed=1", "cost takes gpu_ms, gpu_ms_per_token, rtt_ms, sizes, wait_ms, not speed"),
        ("cost:sizes=8", "names 1 model sizes for a pool of 2 cloud tiers"),
        ("cost:gpu_ms=-1", "gpu_ms must be a number >= 0"),
        ("cost:wait_ms=soon", "wait_ms must be a number"),
    ):
        with pytest.raises(DecisionEngineError, match=match):
            engine(spec)
    assert engine("cost", tiers=2).costs[1] == pytest.approx(PRODUCTION_CLOUD.gpu_ms_per_ask())  # a pair: the 70B
