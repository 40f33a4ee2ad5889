"""Token-routed decoding end to end: real models, a real cloud server on loopback, a real WebSocket."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge_client.generator import RoutedGenerator
from shared.decision import ClauseEnds
from shared.kernel_noise import KERNEL_NOISE_NATS
from shared.llama_backend import LlamaModel
from shared.policy import replay_decisions
from shared.router import HeuristicRouter, RandomRouter
from tests.conftest import LONG_QUESTIONS, QUESTIONS, chat
from tests.helpers import first_difference, is_greedy_choice, make_generator, reference_greedy, teacher_forced_logits

MAX_TOKENS = 40


def answer_tokens(gen: RoutedGenerator, question: str) -> tuple[list[int], list[str]]:
    a = gen.generate(chat(question), max_tokens=MAX_TOKENS)
    assert not a.degraded, "the cloud was lost during a test that needs it"
    return a.tokens, a.routes


@pytest.mark.kernel
@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0])
def test_lossless_with_same_model_on_both_sides(edge_model, edge_info, same_model_server, threshold):
    """Same GGUF on device and cloud, greedy: routing must not change a single token.

    Threshold 0 routes every position, 1 almost none; any slip in sync, rollback
    or acceptance would show up as a different token.
    """
    edge_only = make_generator(edge_model, None, mode="edge")
    routed = make_generator(edge_model, same_model_server, threshold=threshold)
    try:
        for q in QUESTIONS:
            expected, _ = answer_tokens(edge_only, q)
            got, routes = answer_tokens(routed, q)
            assert got == expected, f"routing changed the answer to {q!r} at threshold {threshold}"
            if threshold == 0.0:
                assert set(routes) == {"cloud"}
    finally:
        edge_only.close()
        routed.close()


@pytest.mark.kernel
def test_lossless_with_random_routing_and_multi_turn(edge_model, same_model_server):
    """Random decisions (different each position) and a follow-up turn on the same session."""
    edge_only = make_generator(edge_model, None, mode="edge")
    routed = make_generator(edge_model, same_model_server, threshold=0.5, router=RandomRouter(seed=7), sync_every=3)
    try:
        history = chat(QUESTIONS[0])
        expected = edge_only.generate(history, max_tokens=MAX_TOKENS)
        got = routed.generate(history, max_tokens=MAX_TOKENS)
        assert got.tokens == expected.tokens
        assert 0 < got.n_cloud_tokens < got.n_tokens
        follow = history + [{"role": "assistant", "content": got.text}, {"role": "user", "content": "and in french?"}]
        expected2 = edge_only.generate(follow, max_tokens=MAX_TOKENS)
        got2 = routed.generate(follow, max_tokens=MAX_TOKENS)
        assert got2.tokens == expected2.tokens
        assert got2.n_cloud_tokens > 0 and not got2.degraded
    finally:
        edge_only.close()
        routed.close()


@pytest.mark.kernel
def test_policies_match_each_model_alone(edge_model, edge_info, cloud_info, cloud_server):
    """Default pair: `cloud` = the cloud model's own greedy output, `edge` = the edge model's, each up to
    where it begins to loop (shared/decision.py, "Loops": the answer ends there, finish reason "loop")."""
    from shared.decision import RepeatWatch

    def until_loop(tokens: list[int]) -> list[int]:
        watch = RepeatWatch()
        return next((tokens[: i + 1] for i in range(len(tokens)) if watch.said_again(tokens[: i + 1])), tokens)

    cloud_gen = make_generator(edge_model, cloud_server, mode="cloud")
    edge_gen = make_generator(edge_model, cloud_server, mode="edge")
    try:
        for q in QUESTIONS[:2]:
            c = cloud_gen.generate(chat(q), max_tokens=MAX_TOKENS)
            assert not c.degraded and set(c.routes) == {"cloud"}
            assert c.tokens == until_loop(reference_greedy(cloud_info, chat(q), MAX_TOKENS))
            assert c.round_trips == 1, "cloud-only should stream the whole answer from one request"
            e = edge_gen.generate(chat(q), max_tokens=MAX_TOKENS)
            assert set(e.routes) == {"edge"} and e.bytes_up == 0
            expected = reference_greedy(edge_info, chat(q), MAX_TOKENS)
            assert e.tokens == until_loop(expected)
            assert (e.finish_reason == "loop") == (e.tokens != expected)
        assert c.tokens != e.tokens, "the default pair should differ somewhere (else routing is moot)"
    finally:
        cloud_gen.close()
        edge_gen.close()


@pytest.mark.parametrize("threshold,warmup,hysteresis", [(0.3, 0, 0.0), (0.3, 3, 0.1)])
def test_router_routes_exactly_the_tokens_over_threshold(edge_model, cloud_server, threshold, warmup, hysteresis):
    gen = make_generator(edge_model, cloud_server, threshold=threshold, warmup=warmup, hysteresis=hysteresis)
    try:
        total_cloud = 0
        for q in QUESTIONS:
            a = gen.generate(chat(q), max_tokens=MAX_TOKENS)
            assert not a.degraded
            expected = replay_decisions(a.scores, threshold, warmup, hysteresis)
            assert [r == "cloud" for r in a.routes] == expected
            assert all(r == "edge" for r in a.routes[:warmup])
            total_cloud += a.n_cloud_tokens
            assert a.round_trips == a.n_cloud_tokens  # one round trip per hard token
        assert total_cloud > 0
    finally:
        gen.close()


@pytest.mark.kernel
@pytest.mark.parametrize("nats", [0.0, 1.0])
def test_lookahead_takes_the_clouds_own_choice_without_a_round_trip(
    edge_model, edge_info, cloud_info, cloud_server, nats
):
    """With lookahead, the position right after each round-trip cloud token is decided by the
    cloud's guess, not the router: the device keeps its own token where the cloud finds it at
    most `nats` less likely than the guess, and takes the guess (no round trip) elsewhere.
    Every other position is routed by the threshold as before. Checked against both models run
    alone over the answer (teacher forcing), with KERNEL_NOISE_NATS of tolerance for llama.cpp's
    batch-dependent rounding."""
    threshold, tol = 0.3, KERNEL_NOISE_NATS
    gen = make_generator(
        edge_model, cloud_server, threshold=threshold, lookahead=True, lookahead_nats=nats, lookahead_wait_s=5.0
    )  # a guess is never late here
    try:
        taken = kept = 0
        # the shared questions, then more only until both outcomes were seen (on a Zen 3 VM no guess was
        # taken at 1 nat in the shared three: which positions are near-ties depends on the CPU's kernels)
        for q in QUESTIONS + LONG_QUESTIONS:
            if q not in QUESTIONS and taken and kept:
                break
            heard: list = []
            a = gen.generate(chat(q), max_tokens=MAX_TOKENS, on_token=heard.append)
            assert not a.degraded
            guessed_at = set(a.lookahead_positions)
            assert [e.index for e in heard if e.lookahead] == a.lookahead_positions, "the listener sees each guess"
            expected = {i for i in range(1, a.n_tokens) if a.routes[i - 1] == "cloud" and i - 1 not in guessed_at}
            assert guessed_at == expected, "a guess comes exactly after each round-trip cloud token"
            assert guessed_at == {i for i, s in enumerate(a.scores) if s is None}, (
                "the router is not asked where a guess decides"
            )
            cloud = teacher_forced_logits(cloud_info, chat(q), a.tokens)
            edge = teacher_forced_logits(edge_info, chat(q), a.tokens)
            for i, (token, route, score) in enumerate(zip(a.tokens, a.routes, a.scores)):
                writer = cloud if route == "cloud" else edge
                assert is_greedy_choice(writer[i], token), f"position {i}: not the {route} model's own choice"
                if score is not None:
                    assert (route == "cloud") == (score >= threshold)
                    continue
                logp = cloud[i] - np.logaddexp.reduce(cloud[i].astype(np.float64))
                if route == "edge":  # kept: the cloud finds the device's token nearly as likely
                    assert logp.max() - logp[token] <= nats + tol
                    kept += 1
                else:  # taken: the device's own choice (one of its near-greedy tokens) was worse to the cloud
                    own = [int(e) for e in np.nonzero(edge[i] >= edge[i].max() - 0.25)[0] if e != token]
                    assert any(logp[token] - logp[e] > nats - tol for e in own), (
                        f"position {i}: guess taken without cause"
                    )
                    taken += 1
            guessed_cloud = sum(1 for i in guessed_at if a.routes[i] == "cloud")
            assert a.lookahead_tokens == guessed_cloud
            assert a.round_trips == a.n_cloud_tokens - guessed_cloud, "a taken guess needs no round trip"
        assert taken > 0 and kept > 0, "the default pair both agrees and disagrees right after routed tokens"
    finally:
        gen.close()


def test_a_late_guess_is_ignored_and_skipped(edge_model, cloud_server):
    """A guess that has not arrived when the device needs it (here: no wait at all) leaves the
    position to the router; the `next` message arriving later is skipped by the following
    requests, so nothing is lost or misread: every token goes through the router as without
    lookahead, one round trip per cloud token, on a session that stays healthy."""
    gen = make_generator(edge_model, cloud_server, threshold=0.3, lookahead=True, lookahead_wait_s=0.0)
    try:
        for q in QUESTIONS:
            a = gen.generate(chat(q), max_tokens=MAX_TOKENS)
            assert not a.degraded and a.n_cloud_tokens > 0
            assert a.lookahead_positions == [] and None not in a.scores
            assert [s >= 0.3 for s in a.scores] == [r == "cloud" for r in a.routes]
            assert a.round_trips == a.n_cloud_tokens
    finally:
        gen.close()


def _segments(edge: LlamaModel, tokens: list[int], longest: int) -> int:
    """How many drafts the check cuts an answer into: one token past each clause end, at the end
    of generation, or after `longest`."""
    ends, n, run, after_end = ClauseEnds(edge.token_bytes, edge.is_eog), 0, 0, False
    for i, t in enumerate(tokens):
        run += 1
        if after_end or edge.is_eog(t) or run == longest or i == len(tokens) - 1:
            n, run, after_end = n + 1, 0, False
        else:
            after_end = ends(t)
    return n


@pytest.mark.kernel
def test_check_with_one_model_on_both_sides_changes_nothing(edge_model, same_model_server):
    """The cloud's check with the same GGUF on both sides, greedy: the cloud accepts every draft,
    so the answer is the device's own token for token, nothing is overruled, flagged drafts count
    as the cloud's (it chose the same token), and each clause costs exactly one verify."""
    edge_only = make_generator(edge_model, None, mode="edge")
    gen = make_generator(edge_model, same_model_server, threshold=0.5, check="all")
    try:
        for q in QUESTIONS:
            expected = edge_only.generate(chat(q), max_tokens=MAX_TOKENS)
            a = gen.generate(chat(q), max_tokens=MAX_TOKENS)
            assert a.tokens == expected.tokens, q
            assert not a.degraded and a.overruled_positions == [] and a.lookahead_positions == []
            assert [s >= 0.5 for s in a.scores] == [r == "cloud" for r in a.routes]
            assert a.round_trips == _segments(edge_model, a.tokens, gen.opts.check_max_draft), q
    finally:
        gen.close()
        edge_only.close()


@pytest.mark.kernel
@pytest.mark.parametrize("check, threshold", [("off", 0.0), ("all", 0.5), ("after-first-clause", 0.5)])
def test_same_model_on_both_sides_changes_nothing_on_long_answers(edge_model, same_model_server, check, threshold):
    """Same GGUF on both sides, greedy, long answers (hundreds of positions, where llama.cpp's
    batched kernels on the cloud and one-token kernels on the device disagree at near-ties
    several times): every route (every position asked with threshold 0, lookahead guesses, the
    cloud's check) must leave the device's answer unchanged, because a token within TIE_NATS of
    the cloud's best is the cloud's own choice (shared/decision.py). Without the tie rule this
    fails on an AMD EPYC VM (scripts/measure_kernel_ties.py: 15 argmax flips in 458 positions)."""
    edge_only = make_generator(edge_model, None, mode="edge")
    gen = make_generator(
        edge_model,
        same_model_server,
        threshold=threshold,
        check=check,
        lookahead=True,
        lookahead_wait_s=5.0,
        timeout_s=10.0,
    )
    try:
        n = 0
        for q in LONG_QUESTIONS:
            if n >= 200:
                break
            expected = edge_only.generate(chat(q), max_tokens=96)
            a = gen.generate(chat(q), max_tokens=96)
            assert not a.degraded
            assert a.tokens == expected.tokens, (
                f"{q!r}: first difference at {first_difference(a.tokens, expected.tokens)}"
            )
            assert a.overruled_positions == [], "one model never overrules itself"
            n += a.n_tokens
            if check == "off":
                assert a.n_cloud_tokens == a.n_tokens - len(a.lookahead_positions), "every position asked or guessed"
        assert n >= 200, "long answers"
    finally:
        gen.close()
        edge_only.close()


def _check_start(edge: LlamaModel, tokens: list[int], mode: str) -> int:
    """The first answer index the check covers: 0, or two past the first clause's end."""
    if mode == "all":
        return 0
    ends = ClauseEnds(edge.token_bytes, edge.is_eog)
    return next((i + 2 for i, t in enumerate(tokens) if ends(t)), len(tokens))


@pytest.mark.kernel
@pytest.mark.parametrize("mode", ["all", "after-first-clause"])
def test_check_keeps_only_tokens_the_cloud_accepts(edge_model, edge_info, cloud_info, cloud_server, mode):
    """The cloud's check over a real WebSocket with the default pair, checked against both models
    run alone over the answer (teacher forcing, with KERNEL_NOISE_NATS of tolerance for llama.cpp's
    batch-dependent rounding): where the check covers the answer, a device token is the device's
    own choice, unflagged, and within `check_nats` to the cloud; a cloud token is the cloud's own
    choice, and where the router had not flagged it (overruled), the device's choice was beyond
    `check_nats`. The eval's `+verify` methods assume exactly this rule. With
    "after-first-clause" the first clause and one token more follow the per-token rules
    (router and lookahead guesses, released at once), and the check takes over after them."""
    # the shipped router's top score per answer here is 0.3-0.63 (measured with and without
    # kernel noise): at 0.6 a CPU could flag nothing in all thirteen questions, at 0.4 each
    # outcome shows up within a few
    nats, tol, threshold = 1.0, KERNEL_NOISE_NATS, 0.4
    gen = make_generator(
        edge_model,
        cloud_server,
        threshold=threshold,
        timeout_s=10.0,
        check=mode,
        check_nats=nats,
        lookahead=True,
        lookahead_wait_s=5.0,
    )
    try:
        kept_lenient = overruled = flagged = 0
        # the shared questions, then more only until each outcome was seen (which drafts are
        # flagged, kept or overruled depends on the CPU's kernels)
        for q in QUESTIONS + LONG_QUESTIONS:
            if q not in QUESTIONS and overruled and kept_lenient and (flagged or mode != "all"):
                break
            heard: list = []
            a = gen.generate(chat(q), max_tokens=32, on_token=heard.append)
            assert not a.degraded
            assert [e.index for e in heard if e.overruled] == a.overruled_positions, "the listener sees each overrule"
            assert [e.index for e in heard if e.lookahead] == a.lookahead_positions
            start = _check_start(edge_model, a.tokens, mode)
            assert all(i < start for i in a.lookahead_positions) and all(i >= start for i in a.overruled_positions)
            cloud = teacher_forced_logits(cloud_info, chat(q), a.tokens)
            own = teacher_forced_logits(edge_info, chat(q), a.tokens)
            for i, (token, route, score) in enumerate(zip(a.tokens, a.routes, a.scores)):
                logp = cloud[i] - np.logaddexp.reduce(cloud[i].astype(np.float64))
                if i < start:  # per-token: the router decides, or the lookahead guess right after a cloud token
                    if i not in a.lookahead_positions:
                        assert (route == "cloud") == (score >= threshold), f"{q!r} position {i}"
                    continue
                if route == "edge":
                    assert score < threshold, f"{q!r} position {i}: a flagged draft must be the cloud's"
                    assert is_greedy_choice(own[i], token), f"{q!r} position {i}: not the device's own token"
                    assert logp.max() - logp[token] <= nats + tol, f"{q!r} position {i}: kept beyond the tolerance"
                    kept_lenient += int(logp[token] < logp.max() - 1e-3)
                    continue
                assert is_greedy_choice(cloud[i], token), f"{q!r} position {i}: not the cloud's own token"
                if i in a.overruled_positions:
                    assert score < threshold
                    # the overruled draft was the device's choice on its own path: a token within
                    # the kernels' noise of its best here, and one of those was beyond the tolerance
                    drafts = np.flatnonzero(own[i] >= own[i].max() - KERNEL_NOISE_NATS)
                    assert logp.max() - logp[drafts].min() > nats - tol, f"{q!r} position {i}: overruled without cause"
                    overruled += 1
                else:
                    assert score >= threshold
                    flagged += 1
            assert (mode == "after-first-clause" or a.round_trips >= 1) and a.round_trips <= a.n_tokens
        assert overruled > 0 and kept_lenient > 0, "the default pair is overruled and kept within the tolerance"
        assert flagged > 0 or mode != "all", "and some drafts are flagged"
        assert 0 < gen.overruled.share < 1, "the running overruled share the router's calibration subtracts"
    finally:
        gen.close()


def test_check_finishes_on_the_device_when_the_cloud_is_lost(edge_model, cloud_server):
    """A verify that gets no answer in time (no wait at all here) is abandoned like a slow hard
    token: the clause's drafts stand, flagged ones marked as fallbacks in the routing log, and the
    link rolls the verify back and stays; three in a row drop the cloud for the answer (degraded).
    No token is lost: the answer is the device's own, token for token."""
    from shared.routing_log import read

    edge_only = make_generator(edge_model, None, mode="edge")
    gen = make_generator(edge_model, cloud_server, threshold=0.5, timeout_s=0.0, check="all")
    try:
        expected = edge_only.generate(chat(QUESTIONS[1]), max_tokens=MAX_TOKENS)
        a = gen.generate(chat(QUESTIONS[1]), max_tokens=MAX_TOKENS)
        assert a.tokens == expected.tokens and set(a.routes) == {"edge"}
        assert a.cloud_timeouts >= 1 and a.degraded == (a.cloud_timeouts >= 3)
        assert [t.fallback for t in read(a.routing_log)] == [s >= 0.5 for s in a.scores]
        assert any(s >= 0.5 for s in a.scores), "some draft was flagged"
    finally:
        gen.close()
        edge_only.close()


def test_check_refuses_settings_it_cannot_use(edge_model):
    for nats in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="check_nats"):
            make_generator(edge_model, None, check="all", check_nats=nats)
    with pytest.raises(ValueError, match="check must be one of"):
        make_generator(edge_model, None, check="yes")


def test_reconfigure_rebuilds_the_policy_only_when_its_settings_change(edge_model, cloud_server):
    """A new cloud fraction needs a new policy (calibrated from the router's prior); a new check mode keeps
    the policy and its running state. The next answer routes by the new fraction."""
    gen = make_generator(edge_model, cloud_server, router=HeuristicRouter("entropy", edge_model.n_vocab))
    try:
        kept = gen.policy
        gen.reconfigure(check="all")
        assert gen.policy is kept and gen.opts.check == "all"
        gen.reconfigure(check="off", cloud_fraction=1.0)
        assert gen.policy is not kept and gen.policy.config.cloud_fraction == 1.0
        a = gen.generate(chat(QUESTIONS[0]), max_tokens=16)
        assert a.n_cloud_tokens == a.n_tokens, "a fraction of 1: every token from the cloud"
        with pytest.raises(ValueError, match="check"):
            gen.reconfigure(check="sometimes")
        assert gen.opts.check == "off", "a refused change changes nothing"
    finally:
        gen.close()


def test_guess_regret_reads_the_clouds_top_list():
    from shared.sampling import Guess

    g = Guess(token=5, logprob=-0.2, top_ids=[5, 7, 9], top_logprobs=[-0.2, -1.5, -4.0])
    assert g.regret(5) == 0.0
    assert g.regret(7) == pytest.approx(1.3) and g.regret(9) == pytest.approx(3.8)
    assert g.regret(11) == float("inf"), "outside the listed tokens: at least as bad as the last, so taken"


def test_cloud_fraction_target_is_approached(edge_model, cloud_server):
    from shared.policy import PolicyConfig, RoutingPolicy

    router = HeuristicRouter("entropy", edge_model.n_vocab)
    gen = make_generator(
        edge_model,
        cloud_server,
        router=router,
        policy=RoutingPolicy(PolicyConfig("router", cloud_fraction=0.3), prior=router.threshold_for),
    )
    try:
        n = c = 0
        for q in QUESTIONS * 2:
            a = gen.generate(chat(q), max_tokens=MAX_TOKENS)
            n, c = n + a.n_tokens, c + a.n_cloud_tokens
            assert a.n_cloud_tokens > 0, "calibrated from the first answer on (the router's prior)"
        assert 0.14 <= c / n <= 0.46, (
            f"cloud fraction {c / n:.2f} far from the 0.30 target (6 short answers: a loose band)"
        )
    finally:
        gen.close()


def test_cloud_fraction_counts_the_checks_overrules(edge_model, cloud_server):
    """With the cloud's check, tokens it overrules are cloud tokens too: the router is calibrated
    to what they leave of the target, so the total stays near it, not target + overrules."""
    from shared.policy import PolicyConfig, RoutingPolicy

    router = HeuristicRouter("entropy", edge_model.n_vocab)
    gen = make_generator(
        edge_model,
        cloud_server,
        timeout_s=10.0,
        router=router,
        check="all",
        policy=RoutingPolicy(PolicyConfig("router", cloud_fraction=0.3), prior=router.threshold_for),
    )
    try:
        n = c = over = 0
        for q in QUESTIONS * 2:
            a = gen.generate(chat(q), max_tokens=MAX_TOKENS)
            n, c, over = n + a.n_tokens, c + a.n_cloud_tokens, over + len(a.overruled_positions)
        assert over > 0 and gen.policy.calibrator.target < 0.3
        assert 0.14 <= c / n <= 0.46, (
            f"cloud fraction {c / n:.2f} far from the 0.30 target (6 short answers: a loose band)"
        )
    finally:
        gen.close()


def test_seeded_sampling_is_reproducible(edge_model, cloud_server):

    def run(seed: int) -> list[int]:
        gen = make_generator(edge_model, cloud_server, threshold=0.7, temperature=0.9, top_p=0.95, seed=seed)
        try:
            a = gen.generate(chat("tell me a joke"), max_tokens=24)
            assert not a.degraded
            return a.tokens
        finally:
            gen.close()

    first = run(1)
    assert run(1) == first, "the same seed must give the same answer (device and cloud samplers)"
    assert run(2) != first


def test_slow_cloud_positions_fall_back_without_losing_the_session(edge_model, same_model_server):
    """Hard tokens that time out are written by the device; the abandoned requests are rolled
    back on the cloud, so later hard tokens still land in a history identical to the device's."""
    edge_only = make_generator(edge_model, None, mode="edge")
    gen = make_generator(
        edge_model, same_model_server, threshold=0.0, timeout_s=0.0
    )  # no wait at all: every answer is late
    gen.cloud.max_consecutive_timeouts = 100

    def heal(ev) -> None:
        if ev.index == 3 and gen.link is not None:
            gen.link.timeout_s = 10.0  # the network recovers

    try:
        expected = edge_only.generate(chat(QUESTIONS[1]), max_tokens=MAX_TOKENS)
        a = gen.generate(chat(QUESTIONS[1]), max_tokens=MAX_TOKENS, on_token=heal)
        assert a.tokens == expected.tokens
        assert a.cloud_timeouts >= 3 and not a.degraded
        assert a.routes[:3] == ["edge"] * 3 and set(a.routes[5:]) == {"cloud"}
    finally:
        gen.close()
        edge_only.close()


@pytest.mark.kernel
def test_prefill_ahead_of_time_is_exact_and_reaches_the_cloud(edge_model, same_model_server):
    """The voice pipeline prefills from a partial transcript that may still change. After a wrong
    guess the device's cache must hold exactly the real prompt (the first answer position's logits
    equal a fresh decode's, up to llama.cpp's batch-split rounding), the cloud must receive the
    prefix and stay in step (same model on both sides: routed = device-only through the same calls),
    and a busy generator is left alone."""
    import numpy as np

    question, partial = chat(QUESTIONS[0]), chat("what is the biggest city in spain")
    prompt = edge_model.chat_tokens(question)
    fresh = make_generator(edge_model, None, mode="edge")
    fresh.decoder.set_history(prompt)
    expected_logits = fresh.decoder.next_distribution()[0].copy()
    fresh.close()

    edge_only = make_generator(edge_model, None, mode="edge")
    routed = make_generator(edge_model, same_model_server, threshold=0.5, router=RandomRouter(seed=3))
    try:
        answers = []
        for gen in (edge_only, routed):
            gen.generate(chat("hello there"), max_tokens=4)  # the caches hold another prompt
            assert gen.prefill(partial) > 0
            assert gen.prefill(partial) == 0, "already cached: nothing to decode"
            if gen is routed:
                assert gen.link is not None and gen.link.held.covered == len(gen.decoder.history), (
                    "the cloud holds the prefix too"
                )
            else:
                gen.decoder.set_history(prompt)
                logits = gen.decoder.next_distribution()[0]
                assert int(np.argmax(logits)) == int(np.argmax(expected_logits))
                np.testing.assert_allclose(logits, expected_logits, atol=0.05)
            answers.append(gen.generate(question, max_tokens=MAX_TOKENS))
        assert answers[1].tokens == answers[0].tokens and not answers[1].degraded and answers[1].n_cloud_tokens > 0
        with routed._lock:  # an answer in progress owns the caches
            assert routed.prefill(chat("something else entirely")) == 0
    finally:
        edge_only.close()
        routed.close()


@pytest.mark.kernel
def test_complete_prefill_lets_the_answer_start_without_a_decode(edge_model, same_model_server):
    """At the first pause the voice pipeline decodes the whole prompt of its latest guess. When
    the final transcript is that guess, the first answer token needs no decode on either side:
    the device reads the kept logits, and the cloud (every token is hard here) samples from the
    logits its prefill kept (no model time for that request). The answer is exact: same model
    on both sides, so routed = device-only."""
    question = chat(QUESTIONS[2])
    prompt = edge_model.chat_tokens(question)
    edge_only = make_generator(edge_model, None, mode="edge")
    routed = make_generator(edge_model, same_model_server, threshold=0.0)
    try:
        expected = edge_only.generate(question, max_tokens=MAX_TOKENS)
        routed.generate(chat("hello there"), max_tokens=4)  # the caches hold another prompt
        assert routed.prefill(question, complete=True) > 0
        assert routed.decoder.history == prompt and routed.link is not None and routed.link.held.covered == len(prompt)
        time.sleep(0.5)  # the cloud's prefill runs in the background

        calls = {"edge_decodes": 0}
        ctx = routed.decoder.ctx
        for name in ("decode", "decode_one"):
            real = getattr(ctx, name)

            def counted(*a, _real=real, **k):  # noqa: ANN001, ANN202
                calls["edge_decodes"] += 1
                return _real(*a, **k)

            setattr(ctx, name, counted)
        stats = routed.link.stats
        model_ms0 = stats.cloud_compute_ms - stats.background_ms
        first: dict = {}

        def on_token(ev) -> None:  # noqa: ANN001
            if not first:
                first.update(
                    edge_decodes=calls["edge_decodes"],
                    cloud_model_ms=stats.cloud_compute_ms - stats.background_ms - model_ms0,
                    route=ev.route,
                )

        a = routed.generate(question, max_tokens=MAX_TOKENS, on_token=on_token)
        assert first == {"edge_decodes": 0, "cloud_model_ms": 0.0, "route": "cloud"}, first
        assert a.tokens == expected.tokens and not a.degraded
    finally:
        edge_only.close()
        routed.close()


def test_the_listen_header_says_whether_the_cloud_is_off_connected_or_lost(edge_model):
    """`listen`'s header line: off (no cloud for this device), connected, or not connected with the
    reason, and a degraded last answer. (A cloud that was configured but not connected used to show
    as "off": the check read an attribute the generator does not have.)"""
    from cloud_server.local import LocalCloudServer
    from edge_client.voice.app import cloud_state
    from edge_client.voice.events import TurnDone

    edge_only = make_generator(edge_model, None, mode="edge")
    try:
        assert cloud_state(edge_only, None).plain == "cloud: off (edge only)"
    finally:
        edge_only.close()
    with LocalCloudServer() as server:
        gen = make_generator(edge_model, server, threshold=0.0)  # every token hard: the cloud is asked at once
        try:
            assert cloud_state(gen, None).plain == "cloud: not connected"  # configured, no answer yet
            gen.generate(chat(QUESTIONS[1]), max_tokens=4)
            assert cloud_state(gen, None).plain == "cloud: connected"
            server.kill()
            a = gen.generate(chat(QUESTIONS[1]), max_tokens=4)
            assert a.degraded
            last = TurnDone("q", a, a.text, False)
            line = cloud_state(gen, last).plain
            assert line.startswith("cloud: not connected (") and gen.last_cloud_error in line, line
            assert line.endswith("last answer degraded (edge finished alone)")
        finally:
            gen.close()


SHORT_QUESTIONS = [  # CLINC150-style voice questions whose answers are a sentence or two
    "what is the capital of australia",
    "how do i reset my wifi router",
    "tell me a fun fact about octopuses",
    "what time is it in tokyo",
    "how many ounces are in a cup",
    "who wrote romeo and juliet",
]


def test_short_voice_answers_get_cloud_help_at_the_asked_share_from_the_first(edge_model, cloud_server):
    """Issue 33: "what is the capital of australia" got 0 of its 11 tokens from the cloud. With the
    defaults (the shipped learned router, a 30 % share calibrated from the router's prior, the voice
    dialogue's prompt, no lookahead or check so the router alone decides), a fresh generator's first
    six short answers already get cloud help, and most answers get some. (On the 2-core VM, 2026-12-06: 26
    of 132 tokens, 20 %, every answer at least one: the prior calibrates on the cloud's path, so the
    device's first answers run a little under the share; hence the bound of 10 %.)"""
    from edge_client.generator import build_router
    from edge_client.voice.dialogue import DEFAULT_SYSTEM_PROMPT as VOICE_PROMPT
    from models.registry import DEFAULT_CLOUD_MODEL
    from shared.policy import PolicyConfig, RoutingPolicy

    router = build_router("auto", edge_model.n_vocab, edge_model.info, "error", DEFAULT_CLOUD_MODEL)
    policy = RoutingPolicy(PolicyConfig("router", cloud_fraction=0.3), prior=router.threshold_for)
    gen = make_generator(edge_model, cloud_server, router=router, policy=policy, cloud_fraction=0.3, threshold=None)
    try:
        answers = [
            gen.generate([{"role": "system", "content": VOICE_PROMPT}, {"role": "user", "content": q}], max_tokens=32)
            for q in SHORT_QUESTIONS
        ]
    finally:
        gen.close()
    assert router.name.startswith("learned") and not any(a.degraded for a in answers)
    routed = sum(a.routes.count("cloud") for a in answers)
    total = sum(a.n_tokens for a in answers)
    assert 0.1 <= routed / total <= 0.5, (routed, total)
    assert sum(1 for a in answers if "cloud" in a.routes) >= len(answers) - 1, [a.routes for a in answers]


NUMBER_QUESTIONS = [
    "how many hours are in a day",
    "how many centimeters are in a meter",
    "how many ounces are in a pound",
    "how many weeks are in a year",
    "what is the largest planet in our solar system",
]


def test_a_number_in_a_routed_answer_is_the_clouds_whole(edge_model, cloud_server, cloud_info):
    """Every default, the default pair: each token of a number in the routed answer (a digit, the
    token after one, a "," or "." joining two parts) is the cloud model's own greedy choice there
    (teacher-forced on the answer). With `whole_numbers` off the device's digits stand in some
    answers ("A day is approximately 8 hours": the cloud says 24), so the rule is what keeps them.
    Asked as `ask` asks (its system prompt), where the tune split of the question set saw them spliced."""
    from dataclasses import replace

    from edge_client.cloud_link import CloudLink
    from edge_client.options import GeneratorOptions
    from shared.decision import TIE_NATS, NumberWatch
    from shared.prompting import DEFAULT_SYSTEM_PROMPT
    from shared.sampling import regret

    watch = NumberWatch(edge_model.token_bytes)

    def numbers_not_the_clouds(opts: GeneratorOptions) -> tuple[int, list[str], float]:
        """Number tokens, those not the cloud's greedy choice, and the largest regret of one (nats)."""
        gen = RoutedGenerator(edge_model, opts, lambda: CloudLink(cloud_server.url, cloud_server.api_key, 10.0))
        n, off, worst = 0, [], 0.0
        try:
            for q in NUMBER_QUESTIONS:
                messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": q}]
                a = gen.generate(messages, max_tokens=48)
                assert not a.degraded, a.degraded_reason
                logits = teacher_forced_logits(cloud_info, messages, a.tokens)
                for i, token in enumerate(a.tokens):
                    if watch.at(a.tokens[:i], 0, token):
                        n += 1
                        worst = max(worst, regret(logits[i], token))
                        if not is_greedy_choice(logits[i], token):
                            off.append(f"{a.text!r} at {i} ({a.pieces[i]!r})")
        finally:
            gen.close()
        return n, off, worst

    opts = GeneratorOptions(seed=0, cloud_timeout_s=10.0, lookahead_wait_s=5.0)
    n, off, _ = numbers_not_the_clouds(opts)
    assert n >= 4 and not off, off
    _, _, worst = numbers_not_the_clouds(replace(opts, whole_numbers=False))
    assert worst > TIE_NATS, "without the rule every number was the cloud's anyway: this test shows nothing"
