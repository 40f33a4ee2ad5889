"""The per-position rule (shared/decision.py), table-driven: every combination of router flag,
guess present or late, check off / all / after the first clause, and ties.

These are unit tests of pure functions on hand-made logits: the rule has no model or network
state, which is why the generator, both engines and the trainer's eval can share it.
"""

from __future__ import annotations

import numpy as np
import pytest

from shared.decision import (
    TIE_NATS,
    AnswerRule,
    ClauseEnds,
    OverruledShare,
    RuleOptions,
    Step,
    cloud_choice,
    judge_draft,
    take_guess,
)
from shared.protocol import SamplingParams
from shared.sampling import Guess, Sampler

GREEDY = Sampler(SamplingParams())
COMMA, WORD, EOG = 1, 2, 3


def logits_with(best: int, gaps: dict[int, float], n: int = 16) -> np.ndarray:
    """Logits where `best` is the most likely token and token t sits gaps[t] nats below it."""
    x = np.full(n, -20.0, dtype=np.float32)
    x[best] = 0.0
    for t, gap in gaps.items():
        x[t] = -gap
    return x


def clause_ends(token: int) -> bool:
    return token in (COMMA, EOG)


# -------------------------------------------------------------------- judging one token


@pytest.mark.parametrize(
    "gap, exact, tolerance, tie, verdict",
    [
        (0.0, True, 0.0, TIE_NATS, -1),  # the cloud's own choice stands
        (TIE_NATS / 2, True, 0.0, TIE_NATS, -1),  # flagged, within the tie: the cloud's own choice
        (TIE_NATS * 2, True, 5.0, TIE_NATS, 0),  # flagged, beyond the tie: exact, the tolerance does not apply
        (TIE_NATS / 2, True, 0.0, 0.0, 0),  # no tie tolerance: replaced
        (0.9, False, 1.0, TIE_NATS, -1),  # unflagged within the check's tolerance
        (1.1, False, 1.0, TIE_NATS, 0),  # unflagged beyond it: the cloud writes its own
    ],
)
def test_judge_draft(gap, exact, tolerance, tie, verdict):
    logits = logits_with(0, {5: gap})
    assert judge_draft(logits, 5, exact, tolerance, GREEDY, tie) == verdict


def test_cloud_choice_keeps_a_tied_proposal_only_when_greedy():
    logits = logits_with(0, {5: TIE_NATS / 2, 6: 3 * TIE_NATS})
    assert cloud_choice(logits, GREEDY, proposed=5) == 5
    assert cloud_choice(logits, GREEDY, proposed=6) == 0
    assert cloud_choice(logits, GREEDY, proposed=-1) == 0
    sampled = Sampler(SamplingParams(temperature=1e-3, seed=1))  # nearly greedy, but a draw: ties mean nothing
    assert cloud_choice(logits, sampled, proposed=5) == 0


@pytest.mark.parametrize(
    "gap, nats, take", [(0.0, 1.0, False), (0.5, 1.0, False), (1.5, 1.0, True), (0.3, 0.0, True), (None, 1.0, True)]
)
def test_take_guess(gap, nats, take):
    """The guess replaces the device's token beyond `nats`; a token outside its top list is worse."""
    logits = logits_with(0, {} if gap is None else {5: gap})
    guess = Guess.of(logits, 0, top=4 if gap is not None else 1)
    assert take_guess(guess, 0 if gap == 0.0 else 5, nats) is take


# -------------------------------------------------------------------- the per-answer rule

GUESS = Guess.of(logits_with(0, {5: 2.0, 6: 0.5}), 0, top=3)


@pytest.mark.parametrize(
    "check, checking, flagged, guess, proposed, step",
    [
        ("off", False, False, None, 5, Step.KEEP),
        ("off", False, True, None, 5, Step.ASK),
        ("off", False, None, GUESS, 6, Step.GUESS_KEEP),  # within lookahead_nats of the guess
        ("off", False, None, GUESS, 5, Step.GUESS_TAKE),
        ("off", False, None, GUESS, 9, Step.GUESS_TAKE),  # outside the guess's top list
        ("all", True, False, None, 5, Step.DRAFT),
        ("all", True, True, None, 5, Step.DRAFT),
        ("all", True, True, GUESS, 5, Step.DRAFT),  # a pending guess is ignored by the check
        ("after-first-clause", False, True, None, 5, Step.ASK),  # the first clause: per-token
    ],
)
def test_step_table(check, checking, flagged, guess, proposed, step):
    rule = AnswerRule(RuleOptions(lookahead=True, lookahead_nats=1.0, check=check), clause_ends)
    assert rule.checking is checking
    assert rule.router_asked(guess) is (checking or guess is None)
    assert rule.step(flagged, guess, proposed) is step


def test_a_guess_is_due_only_after_a_round_trip_with_lookahead():
    on = AnswerRule(RuleOptions(lookahead=True, check="off"), clause_ends)
    on.written(WORD, cloud_answered=True)
    assert on.guess_due
    on.written(WORD, cloud_answered=False)  # a guess taken, or a device token: no guess follows
    assert not on.guess_due
    off = AnswerRule(RuleOptions(lookahead=False, check="off"), clause_ends)
    off.written(WORD, cloud_answered=True)
    assert not off.guess_due  # late guesses: the caller passes guess=None and the router decides


def test_after_first_clause_checks_from_the_token_after_the_one_past_the_clause_end():
    rule = AnswerRule(RuleOptions(lookahead=True, check="after-first-clause"), clause_ends)
    phases = []
    for token in (WORD, WORD, COMMA, WORD, WORD, COMMA, WORD):
        phases.append(rule.checking)
        rule.written(token, cloud_answered=True)
    assert phases == [False, False, False, False, True, True, True]
    assert not rule.guess_due, "the check ignores a pending guess"
    rule.start_answer()
    assert not rule.checking and not rule.guess_due, "each answer starts with its first clause"


@pytest.mark.parametrize(
    "bad",
    [
        dict(check="yes"),
        dict(check="all", check_nats=0.0),
        dict(check="all", check_nats=float("nan")),
        dict(lookahead_nats=-1.0),
        dict(tie_nats=float("inf")),
    ],
)
def test_bad_options_are_refused(bad):
    with pytest.raises(ValueError):
        RuleOptions(**bad)


def test_clause_ends_reads_the_token_text():
    text = {COMMA: b",", WORD: b" word", EOG: b""}
    ends = ClauseEnds(lambda t: text[t], lambda t: t == EOG)
    assert [ends(t) for t in (COMMA, WORD, EOG)] == [True, False, True]


def test_overruled_share_decays():
    share = OverruledShare()
    first = share.add(1, True)
    assert 0 < first < 0.01
    assert share.add(500, False) < first / 5
