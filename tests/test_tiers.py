"""A pool of tiers: the device, a cloud, and a tier above it (`--tier`), with an engine that
sends the hardest positions up. The stand-ins: SmolLM2 Q3_K_S on the device, SmolLM2 Q4_1 as
the cloud (tokens), Gemma-3-270M as the top tier (another vocabulary: text mode), each a real
server on loopback."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from edge_client.cloud_link import CloudText
from edge_client.shared_history import TEXT
from shared.cost_engine import CostEngine
from shared.decision_engine import DecisionEngineError, EngineSetup, Position, build_engine
from shared.learned_router import LearnedRouter
from shared.policy import PolicyConfig, RoutingPolicy
from tests.conftest import GEMMA, LONG_QUESTIONS, chat
from tests.helpers import StandInEngine, ask_cli, make_generator, make_turn, metric


def test_each_tier_reads_the_router_that_predicts_its_gain_in_the_top_tiers_unit(edge_model):
    """`tier_routers`: below Gemma, tier 1 reads the router Gemma judged and Gemma its own router in that unit
    (the signed gain); with the top tier's model unknown (a URL) nothing is judged: tier 1 reads the pair's
    score (None), Gemma its pair's router."""
    from edge_client.generator import shipped_router, tier_routers

    judged = tier_routers(edge_model, ["smollm2-135m-q4_1", GEMMA])
    assert judged[0] is None and len(judged) == 3
    assert [r.meta["cloud_model"] for r in judged[1:]] == ["smollm2-135m-q4_1", GEMMA]
    assert judged[1].meta["judge_model"] == GEMMA and judged[1].meta["label_space"] == "text"
    assert all(r.signed for r in judged[1:])  # the signed gain label: a loss counts against the tier
    assert shipped_router(edge_model.info.name, "smollm2-135m-q4_1", judge=GEMMA) != shipped_router(
        edge_model.info.name, "smollm2-135m-q4_1"
    )
    assert tier_routers(edge_model, ["smollm2-135m-q4_1", ""]) == []  # nothing known to judge by
    top_unknown = tier_routers(edge_model, ["smollm2-135m-q4_1", GEMMA, ""])
    assert top_unknown[1] is None and top_unknown[3] is None and top_unknown[2].meta["cloud_model"] == GEMMA
    assert not top_unknown[2].signed  # Gemma's pair router: no top to judge by


def test_escalate_sends_hard_positions_up_by_score():
    policy = RoutingPolicy(PolicyConfig("router", threshold=0.3, cloud_fraction=None))
    engine = build_engine("escalate:above=0.7", EngineSetup(policy, {}, tiers=3))
    assert [engine.decide(Position(score=s)) for s in (0.1, 0.5, 0.69, 0.7, 0.95)] == [0, 1, 1, 2, 2]
    two = build_engine("escalate", EngineSetup(policy, {}, tiers=2))  # no tier above the cloud: the router
    assert [two.decide(Position(score=s)) for s in (0.1, 0.5, 0.95)] == [0, 1, 1]
    with pytest.raises(DecisionEngineError, match="above must be a number within"):
        build_engine("escalate:above=2", EngineSetup(policy, {}, tiers=3))
    with pytest.raises(DecisionEngineError, match="escalate takes above=SCORE or top_share"):
        build_engine("escalate:below=0.2", EngineSetup(policy, {}, tiers=3))
    with pytest.raises(DecisionEngineError, match="escalate takes above=SCORE or top_share"):
        build_engine("escalate:above=0.5,top_share=0.2", EngineSetup(policy, {}, tiers=3))


def test_escalate_calibrates_the_top_tiers_share_online():
    """`top_share=0.2`: of the hard positions, about a fifth go to the top tier, whatever the scores'
    scale (two score distributions, one threshold each would need)."""
    rng = np.random.default_rng(0)
    for scores in (rng.uniform(0.0, 1.0, 4000), rng.beta(1.0, 8.0, 4000)):  # a wide and a low distribution
        policy = RoutingPolicy(PolicyConfig("router", threshold=0.0, cloud_fraction=None))  # every position hard
        engine = build_engine("escalate:top_share=0.2", EngineSetup(policy, {}, tiers=3))
        tiers = [engine.decide(Position(index=i, score=float(s))) for i, s in enumerate(scores)]
        share = tiers[1000:].count(2) / len(tiers[1000:])  # after the calibrator has seen 1000 scores
        assert 0.15 < share < 0.25, share
        assert set(tiers) == {1, 2}


def test_top_share_sends_its_share_from_the_first_answer():
    """Issue 45: `escalate:top_share=0.3` in one `ask` sent nothing to the top tier: its calibration
    started at above=0.8 and an answer's few hard positions never moved it. With the policy's target
    share and the router's score distribution (here: uniform scores, so the top f of them score above
    1 - f), it starts calibrated: the hard positions are the top 30 %, their top 30 % the top 9 %."""
    uniform = lambda f: 1.0 - f  # noqa: E731  (Router.threshold_for of a router whose scores are uniform)
    policy = RoutingPolicy(PolicyConfig("router", threshold=None, cloud_fraction=0.3), prior=uniform)
    engine = build_engine("escalate:top_share=0.3", EngineSetup(policy, {}, tiers=3))
    assert engine.above == pytest.approx(0.91, abs=0.01)
    scores = np.random.default_rng(1).uniform(0.0, 1.0, 400)  # a few answers' worth, not a calibration's
    tiers = [engine.decide(Position(index=i, score=float(s))) for i, s in enumerate(scores)]
    hard = [t for t in tiers if t > 0]
    assert 0.2 < hard.count(2) / len(hard) < 0.4, (hard.count(2), len(hard))
    assert 0.2 < len(hard) / len(tiers) < 0.4


@pytest.mark.slow
def test_a_tier_named_by_its_url_is_asked(cloud_server):
    """`--tier ws://HOST:PORT/v1/route` with the cloud's `--api-key`: a running server as the top tier
    (here the loopback cloud's own), and the positions the engine sends up are written there."""
    before = metric(cloud_server, "tokenrouter_hard_tokens_total")
    flags = ["--tier", cloud_server.url, "--api-key", cloud_server.api_key, "--decision-engine", "escalate:above=0"]
    p = ask_cli("explain how vaccines work", *flags, "--threshold", "0", "--max-tokens", "16")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    up = out["tiers"].count(2)
    assert up > 0 and len(out["tiers"]) == out["n_tokens"] and not out["degraded"], out
    assert metric(cloud_server, "tokenrouter_hard_tokens_total") - before >= up


def test_three_tiers_share_one_answer(edge_model, cloud_server, gemma_server):
    """Every position hard (threshold 0); the escalate engine sends those scoring at least 0.15 to
    Gemma (tier 2, text mode) and the rest to the cloud (tier 1, tokens). Both servers write; each
    position's tier follows its score; the cloud's token session stays a prefix of the device's
    history though Gemma's text re-tokenizes it; the base model's warning is given."""
    hard1, hard2 = (metric(s, "tokenrouter_hard_tokens_total") for s in (cloud_server, gemma_server))
    gen = make_generator(
        edge_model, cloud_server, threshold=0.0, tiers=[gemma_server], decision_engine="escalate:above=0.15"
    )
    try:
        answers = [gen.generate(chat(q), max_tokens=32) for q in LONG_QUESTIONS[:2]]
        link = gen.cloud.link
        assert link is not None and link.mode == "tokens"
        assert link.tokens.tokens == gen.decoder.history[: link.held.covered], (
            "the cloud holds a prefix of the device's history"
        )
        assert gen.tiers[0].link is not None and gen.tiers[0].link.mode == "text"
    finally:
        gen.close()
    for a in answers:
        assert not a.degraded and a.n_cloud_tokens == a.n_tokens and len(a.tiers) == a.n_tokens
        for tier, score in zip(a.tiers, a.scores):
            if score is not None:  # where the engine decided (a span's first token)
                assert tier == (2 if score >= 0.15 else 1), (tier, score)
        assert any("cloud's model is a base model" in w for w in a.warnings)
    tiers = [t for a in answers for t in a.tiers]
    assert 1 in tiers and 2 in tiers
    assert metric(cloud_server, "tokenrouter_hard_tokens_total") > hard1
    assert metric(gemma_server, "tokenrouter_hard_tokens_total") > hard2


def test_the_cost_engine_keeps_each_answer_within_its_gpu_budget(edge_model, cloud_server, gemma_server):
    """`cost:gpu_ms=150`: the positions asked of each tier (the cloud's server counts its own), priced by
    the cost model (an 8B for the cloud, a 70B for Gemma's tier), stay within 150 GPU-ms in each answer; the engine reads Gemma's
    own router (shipped for the device and Gemma) for tier 2 and, for tier 1, the router whose labels Gemma judged (the
    gains in one unit), not the pair's score."""
    gen = make_generator(
        edge_model,
        cloud_server,
        threshold=0.0,
        tiers=[gemma_server],
        decision_engine="cost:gpu_ms=150,gpu_ms_per_token=20",
    )
    assert all(isinstance(r, LearnedRouter) and r.signed for r in gen.tier_routers[1:])  # gains in one unit
    assert gen.tier_routers[1].meta["judge_model"] == GEMMA and gen.tier_routers[2].meta["cloud_model"] == GEMMA
    engine = gen.engine
    assert isinstance(engine, CostEngine)
    seen: list[tuple[float, float, float]] = []
    decide = engine.decide

    def recording(position: Position) -> int:
        seen.append((position.score, position.score_for(1), position.score_for(2)))
        return decide(position)

    engine.decide = recording  # type: ignore[method-assign]
    try:
        written = []
        for q in LONG_QUESTIONS[:3]:
            before = metric(cloud_server, "tokenrouter_hard_tokens_total")
            a = gen.generate(chat(q), max_tokens=24)
            # an ask is a position the engine decided (a text tier's span writes more after it)
            asks = [sum(1 for t, sc in zip(a.tiers, a.scores) if sc is not None and t == tier) for tier in (1, 2)]
            assert metric(cloud_server, "tokenrouter_hard_tokens_total") - before == asks[0]  # one token an ask
            assert asks[0] * engine.costs[1] + asks[1] * engine.costs[2] <= 150 + 1e-6, asks
            assert not a.degraded
            written += a.tiers
    finally:
        gen.close()
    assert any(t > 0 for t in written)  # the cloud tiers wrote within the budget
    assert any(abs(s1 - s) > 0.01 for s, s1, _ in seen)  # tier 1: its router judged by Gemma
    assert any(abs(s2 - s) > 0.01 for s, _, s2 in seen)  # tier 2: its own router


@pytest.mark.kernel
def test_a_pool_of_the_devices_own_model_changes_nothing(edge_model, edge_info, same_model_server):
    """Every tier runs the device's GGUF (the cloud, and a second server as tier 2), every position
    hard, the hardest sent to tier 2: greedy, the answer is the device's own, up to a near-tie the
    kernels may break either way; both tiers wrote."""
    from cloud_server.local import LocalCloudServer
    from tests.helpers import agree_up_to_a_tie

    alone = make_generator(edge_model, None, mode="edge")
    with LocalCloudServer(model=str(edge_info.path)) as top:
        pool = make_generator(
            edge_model, same_model_server, threshold=0.0, tiers=[top], decision_engine="escalate:above=0.15"
        )
        try:
            written = []
            for q in LONG_QUESTIONS[:2]:
                want = alone.generate(chat(q), max_tokens=32)
                got = pool.generate(chat(q), max_tokens=32)
                assert not got.degraded and got.n_cloud_tokens == got.n_tokens
                assert agree_up_to_a_tie(edge_info, chat(q), got.tokens, want.tokens), q
                written += got.tiers
        finally:
            pool.close()
            alone.close()
    assert {1, 2} <= set(written)


def test_a_lost_tier_hands_its_positions_to_the_next_one_down(edge_model, cloud_server):
    """Every hard position goes to tier 2 (a second server of the cloud's model); it is killed after the
    answer's sixth token: the following positions are written by the cloud (tier 1), not the device;
    the answer is not degraded and names the lost tier."""
    from cloud_server.local import LocalCloudServer
    from models.registry import DEFAULT_CLOUD_MODEL

    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL) as top:
        gen = make_generator(edge_model, cloud_server, threshold=0.0, tiers=[top], decision_engine="escalate:above=0")
        seen = []

        def on_token(event: object) -> None:
            seen.append(event)
            if len(seen) == 6:
                top.kill()

        try:
            a = gen.generate(chat(LONG_QUESTIONS[0]), max_tokens=16, on_token=on_token)
        finally:
            gen.close()
    assert a.tiers[:6] == [2] * 6, a.tiers
    assert a.tiers[6:] and set(a.tiers[7:]) == {1}, a.tiers  # (the 7th may be the one asked as the tier died)
    assert a.lost_tiers == [2] and not a.degraded and a.to_json()["lost_tiers"] == [2]


def test_an_engine_asking_for_a_tier_the_pool_lacks_is_told_to_add_it(edge_model, cloud_server):
    gen = make_generator(edge_model, cloud_server, threshold=0.0)
    try:
        gen.engine = build_engine(
            "escalate:above=0", EngineSetup(gen.policy, {}, tiers=3)
        )  # built for a pool this generator lacks
        with pytest.raises(DecisionEngineError, match="tiers 0 .the device. to 1 .add tiers with --tier."):
            gen.generate(chat(LONG_QUESTIONS[0]), max_tokens=4)
    finally:
        gen.close()


@pytest.mark.slow
def test_the_command_line_runs_a_pool():
    """`tokenrouter-edge ask --tier local:gemma3-270m --decision-engine escalate:above=0.15`: two loopback
    servers, and the JSON's tiers show both; a malformed tier is refused before any model loads."""

    def ask(*flags: str) -> subprocess.CompletedProcess[str]:
        return ask_cli("explain how vaccines work", *flags)

    flags = ["--tier", f"local:{GEMMA}", "--decision-engine", "escalate:above=0.15", "--router", "entropy"]
    p = ask(*flags, "--threshold", "0", "--max-tokens", "24")
    assert p.returncode != 0 and f"a tier (--tier) {GEMMA!r} is a base model" in p.stderr
    assert "--allow-base-model" in p.stderr
    flags.append("--allow-base-model")
    p = ask(*flags, "--threshold", "0", "--max-tokens", "24")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert 2 in out["tiers"] and not out["degraded"] and len(out["tiers"]) == out["n_tokens"]
    assert "warning: the cloud's model is a base model" in p.stderr
    p = ask("--tier", "gemma")
    assert p.returncode != 0 and "local:MODEL or a ws:// or wss:// URL" in p.stderr


def test_prefetch_keeps_a_tier_in_use_in_step(edge_model, cloud_server, gemma_server):
    """After the top tier writes, the device's next tokens are sent to it as they come (every
    `sync_every`) while it is within `prefetch_window` positions of its last write; with a window of
    0 nothing more goes to it. One request either way."""
    sent = {}
    for window in (8, 0):
        gen = make_generator(edge_model, cloud_server, tiers=[gemma_server], prefetch_window=window)
        try:
            gen.engine = StandInEngine("top-first", lambda i: 2 if i == 0 else 0)  # the top tier writes first
            top = gen.tiers[0]
            before = top.traffic()
            a = gen.generate(chat(LONG_QUESTIONS[0]), max_tokens=24)
            spent = top.traffic() - before
        finally:
            gen.close()
        assert a.tiers[0] == 2 and set(a.tiers[1:]) <= {0, 2} and not a.degraded
        assert spent.round_trips == 1
        sent[window] = spent.bytes_up
    assert sent[8] > sent[0]


def test_the_forecast_expects_a_tier_once_its_scores_reach_its_asking_level():
    """`--prefetch forecast` (edge_client/prefetch.py): never before the engine has asked the tier; then
    while the tier's recent scores reach FORECAST_SHARE of the level it was asked at."""
    from edge_client.prefetch import FORECAST_SHARE, TierForecast

    f = TierForecast(3, window=3)
    at = Position(score=0.1, tier_scores=np.array([0.0, 0.1, 0.9], np.float32))
    f.observe(at, 0)
    assert not f.expects(2)  # high scores, but never asked: no level yet
    f.observe(at, 2)  # asked at 0.9
    assert f.level[2] == pytest.approx(0.9) and not f.expects(2)  # the recent mean is still rising (0.68)
    f.observe(at, 0)
    assert f.expects(2)  # 0.79 >= 0.8 x 0.9
    low = Position(score=0.1, tier_scores=np.array([0.0, 0.1, 0.1], np.float32))
    for _ in range(6):
        f.observe(low, 0)
    assert f.recent[2] < FORECAST_SHARE * 0.9 and not f.expects(2)  # the stretch of hard positions is over
    f.start_answer()
    assert f.recent[2] == 0.0 and f.level[2] == pytest.approx(0.9)  # the level carries over to the next answer


def test_a_tier_the_forecast_expects_is_brought_into_step_before_it_is_asked(edge_model, cloud_server, gemma_server):
    """With `prefetch="forecast"` and a forecast that expects the top tier (a stand-in for the router's
    scores reaching its asking level), the device's tokens go to it as they come although no position is
    asked of it; without the forecast (`recent`), nothing goes to a tier that was not asked."""
    sent = {}
    for mode in ("forecast", "recent"):
        gen = make_generator(edge_model, cloud_server, tiers=[gemma_server], prefetch=mode, prefetch_window=0)
        try:
            gen.engine = StandInEngine("device-only", lambda i: 0)  # the forecast alone moves the tier
            assert (gen.forecast is not None) == (mode == "forecast")
            if gen.forecast is not None:
                gen.forecast.expects = lambda tier: True  # type: ignore[method-assign]
            top = gen.tiers[0]
            before = top.traffic()
            a = gen.generate(chat(LONG_QUESTIONS[0]), max_tokens=16)
            sent[mode] = top.traffic() - before
        finally:
            gen.close()
        assert set(a.tiers) == {0} and not a.degraded
    assert sent["forecast"].bytes_up > 0 and sent["recent"].bytes_up == 0


def test_a_text_tiers_rewrite_rolls_the_token_cloud_back(edge_model, cloud_server, gemma_server):
    """The cloud (tokens) holds the device's "Hello wor"; the text tier's "ld! How" makes the device
    re-tokenize to "Hello world! How" (" wor" rolled back). The next sync first rolls the cloud back
    to what it shares with the device's history: it holds exactly that history after it, not
    " wor" followed by the new tokens."""
    gen = make_generator(edge_model, cloud_server, tiers=[gemma_server], sync_every=1)
    try:
        messages = chat("say hello")
        prompt = edge_model.chat_tokens(messages)
        assert gen.cloud.start_answer(messages, prompt, lambda: gen.decoder.history)
        gen.decoder.set_history(prompt + gen.answer_text.tokens(b"Hello wor"))
        gen.cloud.sync(gen.decoder.history)
        turn = make_turn(gen, prompt, messages)
        top = turn.cloud_for(2)
        assert top is not None and top.shared_history == "text"
        TEXT.take_text(turn, top, CloudText(b"ld! How", 3, -1.0, False), 0.9)
        assert gen.decoder.history == prompt + gen.answer_text.tokens(b"Hello world! How")
        turn.sync_eagerly()
        assert gen.cloud.link is not None and gen.cloud.link.tokens.tokens == gen.decoder.history
    finally:
        gen.close()


@pytest.mark.slow  # two loopback cloud servers
def test_the_app_runs_a_pool(tmp_path):
    """`tokenrouter-edge app --tier local:smollm2-135m-q4_1 --decision-engine escalate:above=0`: the app
    starts the tier's loopback server with its own cloud, its generator sends the hard positions up to
    it, and the page's record of a turn says who wrote each token. (The turn is asked of the app's
    generator directly; the browser tests drive whole spoken turns.)"""
    from edge_client.answer import Answer
    from edge_client.cli import build_parser
    from edge_client.voice.events import TurnDone
    from edge_client.webapp.cli import build_core
    from edge_client.webapp.conversation import turn_done_message

    args = build_parser().parse_args(
        ["app", "--no-browser", "--config", str(tmp_path / "a.json"), "--tier", "local:smollm2-135m-q4_1"]
        + ["--decision-engine", "escalate:above=0", "--cloud-fraction", "0.5"]
    )
    core = build_core(args)
    try:
        core.load()
        assert core.load_error is None and core.gen is not None and len(core.gen.tiers) == 1
        answer = core.gen.generate(chat(LONG_QUESTIONS[0]), max_tokens=24)
        assert isinstance(answer, Answer) and not answer.degraded
        assert 2 in answer.tiers  # hard positions went to the top tier (the cloud still checks and guesses)
        done = TurnDone(transcript=LONG_QUESTIONS[0], answer=answer, spoken_text=answer.text, interrupted=False)
        assert turn_done_message(done, core.settings)["answer"]["tiers"] == answer.tiers
    finally:
        core.close()
