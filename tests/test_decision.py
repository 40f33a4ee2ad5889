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


def test_a_number_is_watched_from_its_first_digit_to_the_token_after_it():
    """NumberWatch: the device proposing a digit, the token after a digit, and the token after a "," or
    "." that follows a digit are part of a number; a comma after a word, or the answer's start, is not."""
    from shared.decision import NumberWatch

    text = {0: b"The", 1: b" day", 2: b" is", 3: b" ", 4: b"2", 5: b"4", 6: b",", 7: b"0", 8: b" hours", 9: b"."}
    watch = NumberWatch(lambda t: text[t])
    assert not watch.at([], 0, 0) and not watch.at([0, 1, 2], 0, 3)
    assert watch.at([0, 1, 2, 3], 0, 4)  # proposes a digit
    assert watch.at([0, 1, 2, 3, 4], 0, 8)  # after a digit, whatever comes
    assert watch.at([0, 1, 2, 3, 4, 5, 6], 0, 8)  # after "," that follows a digit
    assert not watch.at([0, 1, 6], 0, 2)  # a comma after a word
    assert not watch.at([4, 5, 0], 3, 1)  # the digits before `start` are the prompt's
    rule_on = AnswerRule(RuleOptions(check="off"), lambda t: False, watch)
    rule_off = AnswerRule(RuleOptions(check="off", whole_numbers=False), lambda t: False, watch)
    assert rule_on.cloud_required([0, 3], 0, 4) and not rule_off.cloud_required([0, 3], 0, 4)
    assert not AnswerRule(RuleOptions(check="off"), lambda t: False).cloud_required([0, 3], 0, 4)  # no watch: no rule


def test_a_guess_judges_a_number_within_a_tie_and_the_engine_is_overruled_towards_the_cloud():
    """Where a guess decides, a digit the device would keep within lookahead_nats is taken unless it
    ties; where the router is asked, engine_tier gives a number position to the cloud at least
    (a tier above it stays)."""
    from shared.decision_engine import CLOUD, DEVICE, Position, engine_tier

    class Says:
        name = "says"

        def __init__(self, tier: int) -> None:
            self.tier = tier

        def start_answer(self) -> None:
            pass

        def decide(self, position: Position) -> int:
            return self.tier

    class Off:
        def regret(self, token: int) -> float:
            return 0.8  # within lookahead_nats (1.0), beyond a tie (0.6)

    rule = AnswerRule(RuleOptions(lookahead=True, lookahead_nats=1.0, check="off"), lambda t: False)
    assert rule.step(None, Off(), 5) is Step.GUESS_KEEP
    assert rule.step(None, Off(), 5, cloud_required=True) is Step.GUESS_TAKE
    z = np.zeros(3, np.float32)
    at = Position()
    assert engine_tier(Says(DEVICE), at, 0, 1, 0.0, z, z) == DEVICE
    assert engine_tier(Says(DEVICE), at, 0, 1, 0.0, z, z, 2, True) == CLOUD and at.cloud_required
    assert engine_tier(Says(2), at, 0, 1, 0.0, z, z, 3, True) == 2


def test_a_run_said_again_is_watched_and_a_run_taken_back_does_not_count():
    """RepeatWatch (n=4 here): an answer whose last n tokens end a run it already holds says it again; a
    shorter run, the prompt's tokens, and a run of tokens since taken back (the check's drafts) do not."""
    from shared.decision import LOOP_TOKENS, RepeatWatch

    assert LOOP_TOKENS == 8
    w = RepeatWatch(4)
    assert not w.said_again([1, 2, 3, 4, 5, 1, 2, 3]) and w.said_again([1, 2, 3, 4, 5, 1, 2, 3, 4])
    w.reset()
    assert not w.said_again([1, 2, 3, 4, 5, 2, 3, 4])  # 2 3 4 is three tokens
    w.reset()
    assert not w.said_again([1, 2, 3, 4, 9, 1, 2, 3, 4], start=5)  # the first 1 2 3 4 is the prompt's
    w.reset()
    assert not w.said_again([7, 1, 2, 3, 4, 8, 6])  # sees the runs of tokens ...
    assert not w.said_again([7, 8, 8, 8, 9, 1, 2, 3, 4])  # ... taken back and rewritten: 1 2 3 4 is said once
    w.reset()
    assert w.said_again([5, 5, 5, 5, 5])  # a token said five times is a run of four said twice


def test_the_opening_is_the_clouds_for_as_many_positions_as_asked():
    """opening_tokens=N: the answer's first N positions are the cloud's whatever the router says; 0 (the
    default) leaves them to it; a negative count is refused by name."""
    three = AnswerRule(RuleOptions(check="off", opening_tokens=3, whole_numbers=False), lambda t: False)
    prompt = [9, 9, 9]
    assert all(three.cloud_required(prompt + [1] * i, len(prompt), 1) for i in range(3))
    assert not three.cloud_required(prompt + [1, 2, 3], len(prompt), 4)
    assert not AnswerRule(RuleOptions(check="off", whole_numbers=False), lambda t: False).cloud_required(prompt, 3, 1)
    with pytest.raises(ValueError, match="opening_tokens"):
        RuleOptions(opening_tokens=-1)
