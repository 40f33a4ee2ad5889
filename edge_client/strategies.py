"""How the device asks the cloud: small strategies, one per way of handing tokens over.

The generator (edge_client/generator.py) runs one strategy at a time over a
`Turn` (edge_client/turn.py: the answer being written) and picks it per clause:

    PerToken     the router (or the cloud's lookahead guess) decides each position;
                 a hard one is one round trip (the product's per-token phase)
    ClauseCheck  the device drafts to a clause end; the cloud checks the clause in one
                 round trip (the cloud's check: `--check`)
    CloudStream  the cloud writes the rest of the answer, streamed (policy `cloud`)
    DeviceOnly   the device writes the answer, no router (a per-answer choice of the device)
    Span         at a hard token the cloud writes up to `span` tokens (replay's router-span)
    DraftVerify  draft to a clause end, one `verify` of the flagged drafts, or of all of
                 them (replay's router-verify and speculative)

Who writes each position is decided by shared/decision.py, the one copy of the
rule; a strategy only carries the decision out. Where the cloud writes, the
session's shared history does it (`history_of`, edge_client/shared_history.py:
tokens, or text where the models tokenize differently), so the first three are
written once for both modes; `Span` and `DraftVerify` are replay's, on tokens only.
Each `run` writes at least one position (or ends the answer) and returns.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edge_client.cloud_session import CloudSession
from edge_client.shared_history import TOKENS, history_of
from edge_client.turn import Turn, draft_clause
from shared.decision import Step
from shared.decision_engine import CLOUD


class Strategy(Protocol):
    def run(self, turn: Turn) -> None:
        """Write at least one position of the answer (or end it)."""
        ...


class PerToken:
    """One position: the cloud's guess or the router decides; a hard position is one round trip
    (with exploration, also a position the router kept, now and then: Turn.explore). If the cloud
    cannot answer (lost, slow, declined, or in text mode the device's text ends inside a
    character), the device writes the position (a fallback, unless it was explored); a lost tier
    above the cloud hands it to the next tier down first."""

    def run(self, turn: Turn) -> None:
        rule = turn.rule
        logits, hidden = turn.decoder.next_distribution()
        proposed = turn.sampler.sample(logits)
        guessing = turn.last_asked or turn.cloud  # the guess comes from the tier that wrote the last position
        guess = history_of(guessing).guess(turn, guessing) if rule.guess_due and guessing.up else None
        score, flagged = turn.flag(hidden, logits, proposed) if rule.router_asked(guess) else (None, None)
        explore = turn.explore(flagged)
        required = guess is not None and rule.cloud_required(turn.decoder.history, turn.prompt_len, proposed)
        step = rule.step(flagged or explore, guess, proposed, required)
        tier = CLOUD if explore else turn.tier
        n_before = len(turn.answer.tokens)
        if step is Step.GUESS_TAKE and guess is not None:  # the cloud's guess, no round trip
            history_of(guessing).take_guess(turn, guessing, guess)
            rule.written(turn.answer.tokens[-1])
        elif step is Step.ASK and (asked := _ask_down(turn, tier, proposed, hidden, score, explore)) is not None:
            turn.asked(*asked, n_before)
            rule.written(turn.answer.tokens[-1], cloud_answered=True)
        else:
            fallback = step is Step.ASK and turn.cloud.configured and not explore
            turn.write(proposed, "edge", score, fallback, lookahead=guess is not None)
            rule.written(proposed)
        turn.sync_eagerly()


def _ask_down(
    turn: Turn, tier: int, proposed: int, hidden: np.ndarray, score: float | None, explore: bool
) -> tuple[CloudSession, int] | None:
    """Ask `tier` to write this position; a tier that is lost (or becomes lost asking) hands the position
    to the next one down, the cloud last. None: no tier wrote it (all lost, or one was slow, declined,
    or could not take a partial character), so the device does."""
    for t in range(tier, CLOUD - 1, -1):
        cloud = turn.cloud_for(t)
        if cloud is None:
            continue
        if history_of(cloud).ask(turn, cloud, proposed, hidden, score, explore):
            return cloud, t
        if cloud.up:
            return None
    return None


class ClauseCheck:
    """Draft to a clause end (plus one token), then the cloud's check of the clause.

    The draft takes one token past the clause end, so that a listener splitting clauses at
    "punctuation then a space" (the voice pipeline's TTS chunker) can cut the clause as soon
    as the verdict comes, not a whole clause later. Nothing is released before the verdict
    (`SharedHistory.check`); if the cloud is lost, the drafts stand (flagged ones as fallbacks).
    """

    def run(self, turn: Turn) -> None:
        dec, cloud = turn.decoder, turn.cloud
        start = len(dec.history)
        turn.align()  # another tier may have rewritten the device's history
        cloud.sync(dec.history)  # what the cloud lacks: it prefills it while the device drafts
        if not cloud.up:
            return  # lost: the per-token phase finishes on the device
        draft = draft_clause(turn)
        if draft is None:
            return  # interrupted: nothing of this clause is released
        turn.last_asked = None  # the check is the first cloud tier's
        history_of(cloud).check(turn, cloud, start, draft)


class CloudStream:
    """Policy `cloud`: the cloud writes the rest of the answer, streamed. The device decodes
    none of it unless the cloud is lost and it has to take over.

    A stream that broke off on one slow reply (past --cloud-timeout) is not a lost cloud: the
    link stays and the next round asks it to go on from what the device holds. Only a lost link
    (gone, or given up after timeouts in a row) hands the rest to the device, and only the device
    writing makes the answer degraded (the generator marks it then, with the link's reason)."""

    def run(self, turn: Turn) -> None:
        history_of(turn.cloud).stream(turn, turn.cloud)


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

            TOKENS.stream_tokens(turn.cloud, turn, min(turn.opts.span, turn.room()), take, proposed=proposed)
            if got:
                return
        turn.write(proposed, "edge", score, fallback=hard and turn.cloud.configured)
        turn.sync_eagerly()


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
        verdict = TOKENS.verify(cloud, dec.history[:held_from], drafts, check, bonus=bonus) if cloud.up else None
        keep = len(drafts) if verdict is None else verdict.accepted
        if verdict is not None:
            turn.settle(held_from, drafts, keep, verdict.token)
        for token in drafts[:keep]:
            turn.out.release(token, "edge", None)
        if verdict is not None and verdict.token >= 0:
            turn.out.release(verdict.token, "cloud", None)
