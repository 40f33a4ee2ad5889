"""How the device asks the cloud: small strategies, one per way of handing tokens over.

The generator (edge_client/generator.py) runs one strategy at a time over a
`Turn` (the answer being written) and picks it per clause:

    PerToken     the router (or the cloud's lookahead guess) decides each position;
                 a hard one is one `generate` round trip (the product's per-token phase)
    ClauseCheck  the device drafts to a clause end; one `verify` judges the clause
                 (the cloud's check: `--check`)
    CloudStream  the cloud writes the rest of the answer, streamed (policy `cloud`)
    DeviceOnly   the device writes the answer, no router (a per-answer choice of the device)
    Span         at a hard token the cloud writes up to `span` tokens (replay's router-span)
    DraftVerify  draft to a clause end, one `verify` of the flagged drafts, or of all of
                 them (replay's router-verify and speculative)
    TextPerToken text mode (protocol v3): PerToken's rule, a hard position gets the cloud's
                 text span, which the device re-tokenizes, and its guess for the next
                 position as text (shared/text_history.py)
    TextStream   text mode, policy `cloud`: the cloud writes the rest, streamed as text
    TextClauseCheck  text mode, the cloud's check: ClauseCheck's draft, one `text_verify` judges
                 the clause's text under the cloud's own tokenization

Who writes each position is decided by shared/decision.py, the one copy of the
rule; a strategy only carries the decision out over the network. Each `run`
writes at least one position (or ends the answer) and returns.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edge_client.answer import Answer, Route
from edge_client.cloud_link import CloudText
from edge_client.cloud_session import CloudSession
from edge_client.decoder import EdgeDecoder
from edge_client.options import GeneratorOptions
from edge_client.writer import AnswerWriter
from shared.decision import AnswerRule, ClauseEnds, OverruledShare, Step, draft_ends
from shared.decision_engine import DecisionEngine, Exploration, Position, engine_flags
from shared.llama_backend import LlamaModel
from shared.policy import RoutingPolicy
from shared.router import Router
from shared.sampling import Sampler
from shared.text_history import AnswerText, TextGuess, complete_utf8, device_pieces


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
        return (bool(tokens) and self.model.is_eog(tokens[-1])) or self.room() <= 0 or self.stopped()

    def flag(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> tuple[float, bool]:
        """The router's score at this position and the decision engine's (is it hard?)."""
        t0 = time.perf_counter()
        score = self.router.score(hidden, logits, proposed)
        index = len(self.decoder.history) - self.prompt_len
        hard = engine_flags(self.engine, self.position, index, proposed, score, hidden, logits)
        self.router_ms.append((time.perf_counter() - t0) * 1000.0)
        return score, hard

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

    def take_text(
        self,
        got: CloudText,
        score: float | None,
        route: Route = "cloud",
        overruled: bool = False,
        lookahead: bool = False,
    ) -> None:
        """Text mode: the cloud's text joins the answer. The device re-tokenizes the answer and
        keeps its KV cache for the common token prefix (shared/text_history.py: a partial last
        token of its own is rolled back), and releases the text as its own tokens, routed cloud
        (the first with the router's score; `route` "edge": the device's own text, `overruled`: the
        first replaces a checked draft, `lookahead`: it is the cloud's guess the device took); an
        end of the answer as its end-of-turn token.
        Text past the answer's room (`max_tokens`) is left out, as the device alone would stop."""
        dec, view, start = self.decoder, self.text, self.prompt_len
        assert view is not None
        pieces, text = device_pieces(self.model, got.text, got.eog, self.room())
        answer = dec.history[start:]
        keep, add = view.reconcile(answer, view.text_of(answer) + text)
        dec.truncate(start + keep)
        dec.history.extend(add)  # decoded when next needed (the KV cache follows lazily)
        self.cloud.text_taken(len(dec.history))
        for i, token in enumerate(pieces):
            self.out.release(
                token, route, score if i == 0 else None, overruled=overruled and i == 0, lookahead=lookahead
            )

    def sync_eagerly(self) -> None:
        """Send the final device tokens the cloud lacks once there are `sync_every` of them."""
        cloud, every = self.cloud, self.opts.sync_every
        if cloud.up and every > 0 and len(self.decoder.history) - cloud.cloud_len >= every:
            cloud.sync(self.decoder.history)


class Strategy(Protocol):
    def run(self, turn: Turn) -> None:
        """Write at least one position of the answer (or end it)."""
        ...


class PerToken:
    """One position: the cloud's guess or the router decides; a hard token is one round trip."""

    def run(self, turn: Turn) -> None:
        rule, cloud = turn.rule, turn.cloud
        logits, hidden = turn.decoder.next_distribution()
        proposed = turn.sampler.sample(logits)
        guess = cloud.guess(turn.opts.lookahead_wait_s) if rule.guess_due and cloud.up else None
        score, flagged = turn.flag(hidden, logits, proposed) if rule.router_asked(guess) else (None, None)
        explore = turn.explore(flagged)
        step = rule.step(flagged or explore, guess, proposed)
        token, route, answered = proposed, "edge", False
        if guess is not None:
            if step is Step.GUESS_TAKE:
                token, route = guess.token, "cloud"
        elif step is Step.ASK and cloud.up:
            got = cloud.ask(turn.decoder.history, proposed, hidden, lookahead=turn.opts.lookahead, explore=explore)
            if got is not None:
                token, route, answered = got.token, "cloud", True
        fallback = step is Step.ASK and not answered and cloud.configured and not explore
        turn.write(token, route, score, fallback, lookahead=guess is not None)
        rule.written(token, cloud_answered=answered)
        turn.sync_eagerly()


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
        past_clause_end = turn.clause_ends(proposed)


class ClauseCheck:
    """Draft to a clause end (plus one token), then one `verify`: the cloud's check.

    The draft takes one token past the clause end, so that a listener splitting clauses at
    "punctuation then a space" (the voice pipeline's TTS chunker) can cut the clause as soon
    as the verdict comes, not a whole clause later. Router-flagged drafts are checked exactly,
    the others within `check_nats` (shared/decision.py, `judge_draft`). The verdict keeps the
    drafts before the first rejected one (flagged ones count as the cloud's: it chose the same
    token) and, at the rejected one, gives the cloud's token; the device rolls its history back
    to there. Nothing is released before the verdict. If the cloud is lost, the drafts stand
    (flagged ones as fallbacks).
    """

    def run(self, turn: Turn) -> None:
        dec, cloud, opts = turn.decoder, turn.cloud, turn.opts
        start = len(dec.history)
        cloud.sync(dec.history)  # final tokens not yet synced: the cloud prefills them while the device drafts
        if not cloud.up:
            return  # lost: the per-token phase finishes on the device
        draft = draft_clause(turn)
        if draft is None:
            return  # interrupted: nothing of this clause is released
        drafts, flagged, scores = dec.history[start:], draft.flagged, draft.scores
        check = [i for i, f in enumerate(flagged) if f]
        verdict = cloud.verify(dec.history[:start], drafts, check, tolerance=opts.check_nats, hidden=draft.hidden())
        release = turn.out.release
        if verdict is None:
            draft.release_unchecked(turn, drafts)
            return
        at = verdict.accepted  # the rejected draft, where the cloud wrote its own token (if any)
        turn.settle(start, drafts, at, verdict.token)
        for token, score, flag in zip(drafts[:at], scores, flagged):
            release(token, "cloud" if flag else "edge", score)
        overruled = verdict.token >= 0 and at < len(drafts) and not flagged[at]
        if verdict.token >= 0:
            release(verdict.token, "cloud", scores[at] if at < len(drafts) else None, overruled=overruled)
        turn.policy.share_taken_elsewhere(turn.overruled.add(at + (verdict.token >= 0), overruled))


class CloudStream:
    """Policy `cloud`: the cloud writes the rest of the answer, streamed. The device decodes
    none of it unless the stream breaks off and it has to take over."""

    def run(self, turn: Turn) -> None:
        def take(tok) -> bool:
            turn.write(tok.token, "cloud", None)  # decoded lazily, only if the device must take over
            return not tok.eog and not turn.finished()

        if not turn.cloud.stream(turn.decoder.history, turn.room(), take):
            turn.answer.degraded = True


class DeviceOnly:
    """A per-answer choice of the device (replay's query and session policies): no router."""

    def run(self, turn: Turn) -> None:
        logits, _ = turn.decoder.next_distribution()
        turn.write(turn.sampler.sample(logits), "edge", None)


class Span:
    """Replay's router-span: at a hard token the cloud writes up to `span` tokens in one call."""

    def run(self, turn: Turn) -> None:
        logits, hidden = turn.decoder.next_distribution()
        proposed = turn.sampler.sample(logits)
        score, hard = turn.flag(hidden, logits, proposed)
        if hard and turn.cloud.up:
            got: list[int] = []

            def take(tok) -> bool:
                turn.write(tok.token, "cloud", None)
                got.append(tok.token)
                return not turn.stopped()

            turn.cloud.stream(turn.decoder.history, min(turn.opts.span, turn.room()), take, proposed=proposed)
            if got:
                return
        turn.write(proposed, "edge", score, fallback=hard and turn.cloud.configured)
        turn.sync_eagerly()


class TextPerToken:
    """Text mode (protocol v3): PerToken's rule over text. A hard position is one
    `text_generate`, whose span of the cloud's text the device takes (`Turn.take_text`); with
    lookahead the span brings the cloud's guess for the next position (`TextGuess`), which then
    decides that position instead of the router: the device's token stands if the cloud finds its
    bytes close enough, else the device takes the guess's text. If the cloud cannot answer (lost,
    slow, or the device's text ends inside a character), the device writes the position (a fallback)."""

    def run(self, turn: Turn) -> None:
        rule, cloud, model = turn.rule, turn.cloud, turn.model
        logits, hidden = turn.decoder.next_distribution()
        proposed = turn.sampler.sample(logits)
        text_guess, turn.text_guess = (turn.text_guess if rule.guess_due else None), None
        guess = text_guess.for_tokens(model.token_bytes, model.is_eog) if text_guess is not None else None
        score, flagged = turn.flag(hidden, logits, proposed) if rule.router_asked(guess) else (None, None)
        explore = turn.explore(flagged)
        step = rule.step(flagged or explore, guess, proposed)
        if step is Step.GUESS_TAKE and text_guess is not None:  # the cloud's guess, no round trip
            best = text_guess.best
            turn.take_text(CloudText(best, 1, text_guess.logprobs[0], not best), None, lookahead=True)
            rule.written(turn.answer.tokens[-1])
            turn.sync_eagerly()
            return
        if step is Step.ASK and cloud.up:
            got = cloud.ask_text(
                turn.decoder.history, model.token_bytes(proposed), hidden, turn.opts.lookahead, explore=explore
            )
            if got is not None and (got.text or got.eog):  # (a span of only a cut character brings nothing)
                turn.take_text(got, score)
                turn.text_guess = got.guess
                rule.written(turn.answer.tokens[-1], cloud_answered=True)
                turn.sync_eagerly()
                return
        fallback = step is Step.ASK and cloud.configured and not explore
        turn.write(proposed, "edge", score, fallback=fallback, lookahead=guess is not None)
        rule.written(proposed)
        turn.sync_eagerly()


class TextClauseCheck:
    """Text mode, the cloud's check: ClauseCheck's draft (to a clause end and one token more,
    nothing released before the verdict), then one `text_verify` of the clause's text with the
    byte ranges the router flagged. The cloud judges its own tokens of the text
    (shared/text_history.py, "The cloud's check"); the device keeps its answer text up to the
    verdict's kept bytes (its drafts wholly inside them stay in its history), appends the cloud's
    text and re-tokenizes (`Turn.take_text`). A draft the cut splits is released as the device's
    text it kept. If the cloud is lost or slow, the drafts stand (flagged ones as fallbacks)."""

    def run(self, turn: Turn) -> None:
        dec, cloud, opts, view = turn.decoder, turn.cloud, turn.opts, turn.text
        assert view is not None
        start = len(dec.history)
        cloud.sync(dec.history)  # the text not yet synced: the cloud prefills it while the device drafts
        if not cloud.up:
            return  # lost: the per-token phase finishes on the device
        draft = draft_clause(turn)
        if draft is None:
            return  # interrupted: nothing of this clause is released
        flagged, scores = draft.flagged, draft.scores
        drafts = dec.history[start:]
        eog = turn.model.is_eog(drafts[-1])
        verdict = cloud.verify_text(
            dec.history,
            start,
            flagged,
            opts.check_nats,
            eog=eog,
            hidden=draft.hidden(),
        )
        release = turn.out.release
        if verdict is None:
            draft.release_unchecked(turn, drafts)
            return
        answer = dec.history[turn.prompt_len :]
        first = start - turn.prompt_len
        ends = [len(view.text_of(answer[: first + i + 1])) for i in range(len(drafts))]
        kept = verdict.byte_position + verdict.accepted_bytes
        rejected = bool(verdict.text) or verdict.eog != eog or kept < ends[-1]
        if not rejected:
            for token, score, flag in zip(drafts, scores, flagged):
                release(token, "cloud" if flag else "edge", score)
            turn.policy.share_taken_elsewhere(turn.overruled.add(len(drafts), False))
            return
        # the drafts wholly kept (ending on a whole character, so the rest is text of its own)
        j = sum(1 for i, e in enumerate(ends) if e <= kept and not (eog and i == len(drafts) - 1))
        while j > 0 and complete_utf8(view.text_of(answer[: first + j])) != ends[j - 1]:
            j -= 1
        cut = min(j, len(drafts) - 1)  # the draft the cloud's text replaces (in part)
        text = view.text_of(answer)
        own = text[ends[j - 1] if j else len(view.text_of(answer[:first])) : kept]
        dec.truncate(start + j)
        for token, score, flag in zip(drafts[:j], scores, flagged):
            release(token, "cloud" if flag else "edge", score)
        if own:  # the kept part of a draft the cut splits: the device's text
            turn.take_text(CloudText(own, 0, 0.0, False), scores[cut], route="edge")
        overruled = not flagged[cut]
        got = CloudText(verdict.text.encode("utf-8"), verdict.n_tokens, verdict.logprob, verdict.eog)
        n_before = len(turn.answer.tokens)
        turn.take_text(got, None if own else scores[cut], overruled=overruled)
        n_cloud = len(turn.answer.tokens) - n_before
        turn.policy.share_taken_elsewhere(turn.overruled.add(j + n_cloud, overruled and n_cloud > 0))


class TextStream:
    """Text mode, policy `cloud`: the cloud writes the rest of the answer, streamed as text."""

    def run(self, turn: Turn) -> None:
        def take(got: CloudText) -> bool:
            turn.take_text(got, None)
            return not turn.finished()

        if not turn.cloud.stream_text(turn.decoder.history, turn.room(), take):
            turn.answer.degraded = True


class DraftVerify:
    """Replay's router-verify (`check_all` False) and speculative (True): draft to a clause
    boundary, one `verify` of the flagged drafts (all of them for speculative), roll back to
    the first rejected one. Drafts before the first flag are final and released at once; the
    rest wait for the verdict. With `check_all` and no rejection the cloud adds a bonus token."""

    def __init__(self, check_all: bool) -> None:
        self.check_all = check_all

    def run(self, turn: Turn) -> None:
        dec, cloud = turn.decoder, turn.cloud
        start = len(dec.history)
        flags: list[int] = []  # draft offsets to check
        room = min(turn.room(), turn.opts.check_max_draft)
        while True:
            logits, hidden = dec.next_distribution()
            proposed = turn.sampler.sample(logits)
            score, hard = (None, True) if self.check_all else turn.flag(hidden, logits, proposed)
            if hard:
                flags.append(len(dec.history) - start)
            if not flags:  # nothing before it is in doubt: the token is final
                turn.write(proposed, "edge", score)
                turn.sync_eagerly()
            else:
                dec.append(proposed)
            n = len(dec.history) - start
            if turn.stopped() or turn.model.is_eog(proposed) or turn.clause_ends(proposed) or n >= room:
                break
        if not flags:
            return
        held_from = start + flags[0]
        drafts = dec.history[held_from:]
        if turn.stopped():
            dec.truncate(held_from)  # interrupted: the held drafts are never released
            return
        check = [f - flags[0] for f in flags]
        bonus = self.check_all and turn.room() > len(drafts) and not turn.model.is_eog(drafts[-1])
        verdict = cloud.verify(dec.history[:held_from], drafts, check, bonus=bonus) if cloud.up else None
        keep = len(drafts) if verdict is None else verdict.accepted
        if verdict is not None:
            turn.settle(held_from, drafts, keep, verdict.token)
        for token in drafts[:keep]:
            turn.out.release(token, "edge", None)
        if verdict is not None and verdict.token >= 0:
            turn.out.release(verdict.token, "cloud", None)
