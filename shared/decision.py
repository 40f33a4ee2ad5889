"""The per-position routing rule: who writes each token of an answer, in one place.

Every caller that decides or judges a token calls this module: the device's
generator (edge_client/generator.py, through its strategies), both cloud
engines when they judge a draft or write a hard token, and the trainer's
eval (models/train/evaluate.py), which replays the rule in-process. To change
lookahead or the check, change it here; the table-driven test
(tests/test_decision.py) pins every combination.

At each position of an answer the device has proposed a token. Then, in order:

1. **Check phase** (`--check all`, or after the first clause with
   `--check after-first-clause`): the device drafts; the cloud's `verify`
   judges each draft (`judge_draft`): router-flagged drafts exactly, the
   others within `check_nats`. Nothing else is asked.
2. **A lookahead guess** (the last token was a cloud round trip with
   lookahead on, and the guess arrived in time): the guess alone decides
   (`take_guess`); the router is not asked. In text mode the guess is the
   cloud's next pieces as text, judged on the device token's bytes
   (shared/text_history.py, `TextGuess`).
3. **The router**: a flagged position asks the cloud (one `generate`); the
   cloud writes its choice (`cloud_choice`). Otherwise the device's token
   stands.

**Numbers.** A number is written by one model: a position where the device
proposes a digit, or right after a digit (or after a "," or "." that follows
one), is the cloud's (`NumberWatch`; `whole_numbers`, on by default). Asked
digit by digit, "140,000,000 miles" came out "140,760,000": each model alone
writes a whole number, spliced they write neither. The decision engine is
overruled towards the cloud only (shared/decision_engine.py, `engine_tier`);
in the check phase such a draft is judged exactly, as a flagged one.

**The opening.** The answer's first `opening_tokens` positions are the cloud's
too (0: off): the device's first words set an answer's course ("the capital
of canada is« par»is"; "remind me to call my mother" said back), and the
router keeps them as often as any.

**Loops.** An answer ends where it says a run of `LOOP_TOKENS` tokens again
(`RepeatWatch`; the device's `stop_loops`, on by default; finish reason
"loop"). A small model's loops do not end by themselves, and giving the
repeating positions to the cloud did not end them either: the cloud continued
"how to boil an egg, how to boil an egg, ..." itself (docs/journal/router.md).

**Ties.** llama.cpp's batched and one-token kernels are not bitwise equal, so
two runs of one model disagree at near-ties depending on how their histories
were batched. A proposed or drafted token within `TIE_NATS` of the cloud's
most likely token counts as the cloud's own choice under greedy decoding:
then the same model on both sides changes nothing, on any CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol, Sequence

import numpy as np

from shared.kernel_noise import KERNEL_NOISE_NATS
from shared.sampling import Sampler, regret

TIE_NATS = KERNEL_NOISE_NATS
"""A token this close to the best (in nats, a difference of logits) is a tie under greedy
decoding: the largest change of a top-2 margin between llama.cpp's batched and one-token
kernels (0.6; shared/kernel_noise.py has the measurement). Any smaller and the same model on
both sides would change an answer on some CPU; it stays below the check's default tolerance
(1 nat). What a tie costs in quality: docs/router.md ("Ties"); the measurement: docs/journal/router.md."""

CHECK_MODES = ("off", "all", "after-first-clause")
CLAUSE_END = (".", ",", ";", ":", "!", "?", "\n")
OVERRULED_DECAY = 0.995  # per released token, for the running overruled share (half-life ~140 tokens)
# Defaults the device (GeneratorOptions) and the eval's model of the cloud's work (models/train/evaluate.py
# CloudWork) share, so the eval counts the passes the device causes:
CHECK_MAX_DRAFT = 12  # the check's longest draft when no clause ends
SYNC_EVERY = 4  # device tokens sent to the cloud eagerly after this many (0: only with hard tokens)


def draft_ends(n_drafted: int, past_clause_end: bool, max_draft: int) -> bool:
    """The check's draft is complete: one token past a clause end (so a TTS chunker cutting at
    "punctuation then a space" can cut the clause at once), or `max_draft` tokens long."""
    return past_clause_end or n_drafted >= max_draft


class Step(Enum):
    """What happens at one position (see the module docstring for the order)."""

    KEEP = "keep"  # the device's token stands; no cloud
    ASK = "ask"  # router-flagged: the cloud writes this position (a round trip)
    GUESS_KEEP = "guess-keep"  # the cloud's guess decided: the device's token is close enough
    GUESS_TAKE = "guess-take"  # the cloud's guess decided: its token replaces the device's
    DRAFT = "draft"  # check phase: drafted, judged later by the cloud's verify


@dataclass(frozen=True, slots=True)
class RuleOptions:
    """The knobs of the rule (GeneratorOptions carries them from the command line)."""

    lookahead: bool = True
    lookahead_nats: float = 1.0
    check: str = "after-first-clause"
    check_nats: float = 1.0
    tie_nats: float = TIE_NATS
    whole_numbers: bool = True  # a number's digits are the cloud's (module docstring, "Numbers")
    opening_tokens: int = 0  # the answer's first positions that are the cloud's ("The opening")

    def __post_init__(self) -> None:
        if self.check not in CHECK_MODES:
            raise ValueError(f"check must be one of {', '.join(CHECK_MODES)}, not {self.check!r}")
        if self.check != "off" and not 0.0 < self.check_nats < float("inf"):
            raise ValueError(f"check_nats (--check-nats) must be a finite number of nats > 0, not {self.check_nats}")
        if not 0.0 <= self.lookahead_nats < float("inf"):
            raise ValueError(
                f"lookahead_nats (--lookahead-nats) must be a finite number of nats >= 0, not {self.lookahead_nats}"
            )
        if self.opening_tokens < 0:
            raise ValueError(f"opening_tokens (--opening-tokens) must be >= 0, not {self.opening_tokens}")
        if not 0.0 <= self.tie_nats < float("inf"):
            raise ValueError(f"tie_nats must be a finite number of nats >= 0, not {self.tie_nats}")


def is_tie(logits: np.ndarray, token: int, tie_nats: float = TIE_NATS) -> bool:
    """`token` is within `tie_nats` of the most likely token of `logits`."""
    return regret(logits, token) <= tie_nats


def cloud_choice(logits: np.ndarray, sampler: Sampler, proposed: int = -1, tie_nats: float = TIE_NATS) -> int:
    """The cloud's token at a position where the device proposed `proposed` (-1: none).

    Greedy: the proposed token when it ties with the best (module docstring), else the argmax.
    Sampling: the sampler's draw (a tie means nothing for a random draw)."""
    if sampler.greedy and proposed >= 0 and is_tie(logits, proposed, tie_nats):
        return proposed
    return sampler.sample(logits)


def judge_draft(
    logits: np.ndarray, draft: int, exact: bool, tolerance: float, sampler: Sampler, tie_nats: float = TIE_NATS
) -> int:
    """The cloud's verdict on one drafted token: -1 if it stands, else the cloud's token there.

    `exact` (router-flagged) drafts stand only as the cloud's own choice (`cloud_choice`); the
    others also stand within `tolerance` nats of the cloud's best (BiLD's rollback rule), without
    a draw from the sampler."""
    if not exact and regret(logits, draft) <= tolerance:
        return -1
    token = cloud_choice(logits, sampler, draft, tie_nats)
    return -1 if token == draft else token


class GuessJudge(Protocol):
    """A lookahead guess as the rule asks it: how much worse the device's token is. Token mode's
    `Guess`; text mode's `TextGuess.for_tokens` (shared/text_history.py)."""

    def regret(self, token: int) -> float: ...


def take_guess(guess: GuessJudge, proposed: int, lookahead_nats: float) -> bool:
    """The cloud's lookahead guess replaces the device's token: the cloud finds it more than
    `lookahead_nats` less likely than the guess (a token outside the guess's top list counts
    as worse)."""
    return guess.regret(proposed) > lookahead_nats


class ClauseEnds:
    """Which tokens end a clause (punctuation, a newline, or the end of generation): where a
    draft is handed to the cloud for its check. Cached per token: asked once per drafted token."""

    def __init__(self, token_bytes: Callable[[int], bytes], is_eog: Callable[[int], bool]) -> None:
        self._token_bytes = token_bytes
        self._is_eog = is_eog
        self._known: dict[int, bool] = {}

    def __call__(self, token: int) -> bool:
        hit = self._known.get(token)
        if hit is None:
            text = self._token_bytes(token).decode("utf-8", errors="ignore")
            hit = self._known[token] = any(c in text for c in CLAUSE_END) or self._is_eog(token)
        return hit


class NumberWatch:
    """Whether a position writes part of a number (module docstring, "Numbers"). Which tokens hold a
    digit and which join a number's parts is cached per token: asked once per position."""

    JOINERS = (",", ".")

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._kinds: dict[int, int] = {}  # token -> 0 neither, 1 holds a digit, 2 a joiner

    def _kind(self, token: int) -> int:
        kind = self._kinds.get(token)
        if kind is None:
            text = self._token_bytes(token).decode("utf-8", errors="ignore") if token >= 0 else ""
            kind = 1 if any(c.isdigit() for c in text) else 2 if text.strip() in self.JOINERS and text else 0
            self._kinds[token] = kind
        return kind

    def at(self, history: Sequence[int], start: int, proposed: int) -> bool:
        """The position after `history` (the answer begins at `start`) writes part of a number."""
        n = len(history) - start
        last = self._kind(history[-1]) if n >= 1 else 0
        if self._kind(proposed) == 1 or last == 1:
            return True
        return last == 2 and n >= 2 and self._kind(history[-2]) == 1


LOOP_TOKENS = 8  # an answer that says a run of this many tokens again has begun to loop ("Loops")


class RepeatWatch:
    """Whether an answer's last `n` tokens say again a run the answer already holds (module
    docstring, "Loops"). The answer's runs are kept in a dict, extended as the answer grows: O(1) a
    token. A run kept from tokens since taken back (the check's drafts) is checked against the
    answer before it counts."""

    def __init__(self, n: int = LOOP_TOKENS) -> None:
        self.n = n
        self.reset()

    def reset(self) -> None:
        self._runs: dict[tuple[int, ...], int] = {}  # run -> the index of its last token
        self._upto = 0  # the runs ending before this index are in `_runs`

    def said_again(self, tokens: Sequence[int], start: int = 0) -> bool:
        """`tokens[-n:]` is a run that also ends earlier, after `start` (where the answer begins)."""
        n, last = self.n, len(tokens) - 1
        if last - start + 1 < n + 1:
            return False
        if last < self._upto:  # taken back beyond what was seen: see it again
            self.reset()
        for end in range(max(self._upto, start + n - 1), last):
            self._runs.setdefault(tuple(tokens[end - n + 1 : end + 1]), end)
        self._upto = last
        run = tuple(tokens[last - n + 1 :])
        end = self._runs.get(run)
        return end is not None and tuple(tokens[end - n + 1 : end + 1]) == run


class AnswerRule:
    """The rule's state over one answer: is a guess due, is the check on.

    Callers ask `guess_due` (fetch the cloud's guess if so), then `step(flagged, guess,
    proposed)` with the router's decision (None when it was not asked: the guess decided),
    act on the step, and report the written token with `written`.
    """

    def __init__(
        self, options: RuleOptions, clause_ends: Callable[[int], bool], numbers: NumberWatch | None = None
    ) -> None:
        self.options = options
        self.clause_ends = clause_ends
        self.numbers = numbers  # None: no number rule (a caller that cannot read tokens' text)
        self.start_answer()

    def cloud_required(self, history: Sequence[int], start: int, proposed: int) -> bool:
        """The rule gives this position to the cloud whatever decides the others: it is in the answer's
        opening ("The opening") or writes part of a number ("Numbers")."""
        o = self.options
        if len(history) - start < o.opening_tokens:
            return True
        return o.whole_numbers and self.numbers is not None and self.numbers.at(history, start, proposed)

    def start_answer(self) -> None:
        self.checking = self.options.check == "all"
        self.guess_due = False
        self._after_clause_end = False

    def router_asked(self, guess: GuessJudge | None) -> bool:
        """Whether the router scores this position: always while checking, else unless a guess decides."""
        return self.checking or guess is None

    def step(self, flagged: bool | None, guess: GuessJudge | None, proposed: int, cloud_required: bool = False) -> Step:
        """What happens at this position (the module docstring's order). A guess judges a token the
        rule gives the cloud (`cloud_required`) exactly, within a tie, as the cloud judges a flagged one."""
        if self.checking:
            return Step.DRAFT
        if guess is not None:
            nats = self.options.tie_nats if cloud_required else self.options.lookahead_nats
            return Step.GUESS_TAKE if take_guess(guess, proposed, nats) else Step.GUESS_KEEP
        return Step.ASK if flagged else Step.KEEP

    def written(self, token: int, cloud_answered: bool = False) -> None:
        """Record the token written at this position. `cloud_answered`: a `generate` round trip
        wrote it, so with lookahead the cloud's guess for the next position is due."""
        self.guess_due = self.options.lookahead and cloud_answered and not self.checking
        if self.options.check == "after-first-clause" and not self.checking:
            # the check covers the positions after the one past the first clause's end: the
            # first clause and one token more go out at once (the TTS chunker cuts there)
            self.checking, self._after_clause_end = self._after_clause_end, self.clause_ends(token)
            self.guess_due = self.guess_due and not self.checking


class OverruledShare:
    """The decayed share of answer tokens the cloud's check overruled, or the rule gave the cloud
    (`AnswerRule.cloud_required`) (half-life ~140 tokens).

    The router is calibrated to the rest of --cloud-fraction (RoutingPolicy.share_taken_elsewhere),
    so router flags plus overrules meet the target."""

    def __init__(self) -> None:
        self.share = 0.0

    def add(self, n_released: int, overruled: bool) -> float:
        keep = OVERRULED_DECAY**n_released
        self.share = self.share * keep + (1.0 - OVERRULED_DECAY) * overruled
        return self.share
