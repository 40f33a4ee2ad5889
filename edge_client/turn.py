"""One answer being written (`Turn`): what every strategy reads and extends, and the check's draft.

The generator (edge_client/generator.py) builds a Turn per answer; a strategy
(edge_client/strategies.py) extends it position by position, and where the cloud
writes, the session's shared history (edge_client/shared_history.py: tokens or
text) carries that out on it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from edge_client.answer import Answer, Route
from edge_client.cloud_session import CloudSession
from edge_client.decoder import EdgeDecoder
from edge_client.options import GeneratorOptions
from edge_client.prefetch import TierForecast
from edge_client.writer import AnswerWriter
from shared.decision import AnswerRule, ClauseEnds, OverruledShare, RepeatWatch, draft_ends
from shared.decision_engine import CLOUD, DEVICE, DecisionEngine, Position, engine_tier
from shared.exploration import Exploration
from shared.learned_router import score_tiers
from shared.llama_backend import LlamaModel
from shared.policy import RoutingPolicy
from shared.router import Router
from shared.sampling import Sampler
from shared.text_history import AnswerText, TextGuess


@dataclass(slots=True)
class Turn:
    """One answer being written: what every strategy reads and extends."""

    model: LlamaModel
    decoder: EdgeDecoder
    router: Router
    policy: RoutingPolicy
    engine: DecisionEngine  # decides the positions the router scores (the token hook)
    rule: AnswerRule
    cloud: CloudSession
    sampler: Sampler
    opts: GeneratorOptions
    out: AnswerWriter
    clause_ends: ClauseEnds
    overruled: OverruledShare
    max_tokens: int
    stop: threading.Event | None = None
    router_ms: list[float] = field(default_factory=list)
    text: AnswerText | None = None  # text mode: the device model's view of the answer text
    prompt_len: int = 0  # where the answer starts in the decoder's history
    text_guess: TextGuess | None = None  # text mode: the cloud's guess that came with its last span
    position: Position = field(default_factory=Position)  # what the engine is shown, reused at each position
    exploration: Exploration | None = None  # asks the cloud at random where the engine kept the device's token
    # The pool's tiers above `cloud` (tier 2, 3, ...): each session joins the answer when first asked
    tiers: list[CloudSession] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the chat (a tier's session starts from it)
    tier: int = 0  # the engine's last decision
    last_asked: CloudSession | None = None  # the session whose reply made a lookahead guess due (None: `cloud`)
    tier_writes: list[tuple[int, int, int]] = field(default_factory=list)  # answer [start, end) by tiers >= 2
    _joined: set[int] = field(default_factory=set)
    _last_written: dict[int, int] = field(default_factory=dict)  # tier >= 2 -> answer length when it last wrote
    _rewritten: bool = False  # a text tier re-tokenized the device's history since the sessions were aligned
    # Per tier (index = tier), the router that predicts that tier's gain where one ships, in the top
    # tier's unit (RoutedGenerator._tier_routers; None: the pair's router stands in); empty when none
    tier_routers: list[Router | None] = field(default_factory=list)
    forecast: TierForecast | None = None  # --prefetch forecast: which tiers the routers expect soon
    _clause_scan: int = 0  # the history up to here holds no clause end (Position.in_first_clause)
    _clause_ended: bool = False
    loops: RepeatWatch = field(default_factory=RepeatWatch)  # the answer ends where it begins to loop
    looped: bool = False  # it did (finish reason "loop")

    @property
    def answer(self) -> Answer:
        return self.out.answer

    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def room(self) -> int:
        """How many more tokens the answer may take."""
        return self.max_tokens - len(self.answer.tokens)

    def finished(self) -> bool:
        tokens = self.answer.tokens
        if self.opts.stop_loops and self.loops.said_again(self.decoder.history, self.prompt_len):
            self.looped = True
        return (bool(tokens) and self.model.is_eog(tokens[-1])) or self.room() <= 0 or self.stopped() or self.looped

    def flag(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> tuple[float, bool]:
        """The router's score at this position and the decision engine's (is it hard?)."""
        t0 = time.perf_counter()
        score = self.router.score(hidden, logits, proposed)
        index = len(self.decoder.history) - self.prompt_len
        n_tiers = 2 + len(self.tiers)
        if self.tier_routers:
            self._score_tiers(score, hidden, logits, proposed)
        self.position.in_first_clause = self._in_first_clause()
        required = self.rule.cloud_required(self.decoder.history, self.prompt_len, proposed)
        self.tier = engine_tier(self.engine, self.position, index, proposed, score, hidden, logits, n_tiers, required)
        if not self.rule.checking:  # the rule's positions count against --cloud-fraction, as the check's overrules
            self.policy.share_taken_elsewhere(self.overruled.add(1, required))
        if self.forecast is not None:
            self.forecast.observe(self.position, self.tier)
        self.router_ms.append((time.perf_counter() - t0) * 1000.0)
        return score, self.tier != DEVICE

    def _score_tiers(self, score: float, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> None:
        """Each tier's expected gain into the reused Position.tier_scores (allocated once per turn)."""
        if len(self.position.tier_scores) != len(self.tier_routers):
            self.position.tier_scores = np.zeros(len(self.tier_routers), np.float32)
        score_tiers(self.position.tier_scores, self.tier_routers, self.router, score, hidden, logits, proposed)

    def _in_first_clause(self) -> bool:
        """No clause end in the answer so far (each token is looked at once)."""
        if not self._clause_ended:
            history = self.decoder.history
            for i in range(max(self._clause_scan, self.prompt_len), len(history)):
                if self.clause_ends(history[i]):
                    self._clause_ended = True
                    break
            self._clause_scan = len(history)
        return not self._clause_ended

    def cloud_for(self, tier: int) -> CloudSession | None:
        """The session of `tier` (1: `cloud`), joining this answer when first asked; None when it is not up
        (the device then writes the position, a fallback)."""
        if tier <= CLOUD:
            return self.cloud if self.cloud.up else None
        session = self.tiers[tier - 2]
        if tier not in self._joined:
            self._joined.add(tier)
            prompt = self.decoder.history[: self.prompt_len]
            session.start_answer(self.messages, prompt, lambda: self.decoder.history)
        return session if session.up else None

    def lost_tiers(self) -> list[int]:
        """The tiers above the cloud that joined this answer and are lost now (their positions went down)."""
        return [t for t in sorted(self._joined) if not self.tiers[t - 2].up]

    def asked(self, cloud: CloudSession, tier: int, n_before: int) -> None:
        """`cloud` (of `tier`) wrote the answer's positions from `n_before` on: its guess is due next."""
        self.last_asked = cloud
        if tier >= 2:
            self.tier_writes.append((n_before, len(self.answer.tokens), tier))
            self._last_written[tier] = len(self.answer.tokens)

    def explore(self, flagged: bool | None) -> bool:
        """Exploration: ask the cloud about this position although the engine kept it (`flagged` False)?
        Recorded in the answer's `explored_positions`."""
        if flagged is not False or self.exploration is None or not self.cloud.up or not self.exploration.pick():
            return False
        self.answer.explored_positions.append(len(self.answer.tokens))
        return True

    def write(
        self, token: int, route: Route, score: float | None, fallback: bool = False, lookahead: bool = False
    ) -> None:
        """Append a final token to the device's history and release it."""
        self.decoder.append(token)
        self.out.release(token, route, score, fallback, lookahead=lookahead)

    def settle(self, start: int, drafts: list[int], accepted: int, token: int) -> None:
        """Apply a verdict to drafts the device's history holds from `start`: keep the first
        `accepted`, then the cloud's `token` (if >= 0). The kept drafts stay decoded."""
        if token >= 0:
            self.decoder.truncate(start + accepted)
            self.decoder.append(token)

    def rewrote_history(self) -> None:
        """The device's history was re-tokenized (a text tier's reply): token sessions must be aligned
        before they are sent more."""
        self._rewritten = bool(self.tiers)  # with one cloud, its own session follows its own text

    def align(self) -> None:
        """After a rewrite, roll each token session back to what it shares with the device's history
        (CloudSession.align); nothing to do otherwise, so the per-token loop pays no comparison."""
        if self._rewritten:
            self._rewritten = False
            for session in (self.cloud, *self.tiers):
                session.align(self.decoder.history)

    def sync_eagerly(self) -> None:
        """Send the final device tokens the cloud lacks once there are `sync_every` of them; likewise to a
        tier above it that wrote within the last `prefetch_window` positions, or that the forecast expects
        (`--prefetch forecast`); any other tier is brought up to date when next asked."""
        cloud, every, history = self.cloud, self.opts.sync_every, self.decoder.history
        self.align()
        if cloud.up and every > 0 and len(history) - cloud.cloud_len >= every:
            cloud.sync(history)
        if every <= 0:
            return
        for tier in range(2, 2 + len(self.tiers)):  # prefetch: the tiers likely to be asked soon (prefetch.py)
            last = self._last_written.get(tier)
            recent = last is not None and len(self.answer.tokens) - last <= self.opts.prefetch_window
            if not recent and (self.forecast is None or not self.forecast.expects(tier)):
                continue
            session = self.cloud_for(tier)  # a tier the forecast expects joins the answer now
            if session is not None and len(history) - session.cloud_len >= every:
                session.sync(history)


@dataclass(slots=True)
class ClauseDraft:
    """The device's draft of one clause, as the cloud's check sends it: the router's flag and score
    at each drafted token, and the hidden state at each flagged one (hard tokens travel with it)."""

    flagged: list[bool] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    hard_hidden: list[np.ndarray] = field(default_factory=list)

    def hidden(self) -> np.ndarray | None:
        return np.stack(self.hard_hidden) if self.hard_hidden else None

    def release_unchecked(self, turn: Turn, drafts: list[int]) -> None:
        """No verdict came (the cloud is lost or slow): the drafts stand, flagged ones as fallbacks."""
        for token, score, flag in zip(drafts, self.scores, self.flagged):
            turn.out.release(token, "edge", score, fallback=flag)


def draft_clause(turn: Turn) -> ClauseDraft | None:
    """Draft on the device to a clause end and one token more (or `check_max_draft` tokens, or the
    answer's end), appended to the decoder's history; None if the turn was stopped meanwhile (the
    draft is then taken back)."""
    dec = turn.decoder
    start = len(dec.history)
    draft = ClauseDraft()
    room, past_clause_end = min(turn.room(), turn.opts.check_max_draft), False
    while True:
        logits, hidden = dec.next_distribution()
        proposed = turn.sampler.sample(logits)
        score, hard = turn.flag(hidden, logits, proposed)
        if hard:
            draft.hard_hidden.append(hidden.astype(np.float16))  # a copy: the view dies with the next decode
        draft.flagged.append(hard)
        draft.scores.append(score)
        dec.append(proposed)
        if turn.stopped():
            dec.truncate(start)
            return None
        if turn.model.is_eog(proposed) or draft_ends(len(draft.scores), past_clause_end, room):
            return draft
        if turn.opts.stop_loops and turn.loops.said_again(dec.history, turn.prompt_len):
            return draft  # the answer ends here unless the check changes it (Turn.finished)
        past_clause_end = turn.clause_ends(proposed)
