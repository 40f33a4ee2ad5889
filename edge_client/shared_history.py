"""How the device and the cloud share an answer: one interface, two implementations.

A session shares the answer as **tokens** (both models have one tokenizer: positions
are token indices) or as **text** (protocol v3: the models tokenize differently,
positions are byte offsets and each side re-tokenizes; shared/text_history.py).
The strategies (edge_client/strategies.py) are written once, over `SharedHistory`;
everything that depends on the mode is here, one class per mode:

    guess       the cloud's lookahead guess for this position (a judge for shared/decision.py)
    take_guess  write the guessed position (no round trip)
    ask         the cloud writes a hard position (one round trip); False: it could not
    check       the cloud's verdict on a drafted clause, applied (the check)
    stream      the cloud writes the rest of the answer (policy `cloud`)

Each class also speaks its mode's requests through the session (`CloudSession.request`:
failover and deadlines are the session's; what the cloud holds is the link's `held`,
edge_client/held_answer.py). `history_of` picks the implementation from the session's
accepted mode.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from edge_client.answer import Route
from edge_client.cloud_link import CloudLink, CloudText, CloudToken
from edge_client.cloud_session import CloudSession
from edge_client.turn import ClauseDraft, Turn
from shared.decision import GuessJudge
from shared.protocol import Verdict
from shared.text_history import TokenView, complete_utf8, device_pieces


class SharedHistory(Protocol):
    """Each method acts on `turn` through `cloud`: the session (of a tier) sharing it this way."""

    def guess(self, turn: Turn, cloud: CloudSession) -> GuessJudge | None:
        """The cloud's guess for this position if one came (the rule says when it is due)."""
        ...

    def take_guess(self, turn: Turn, cloud: CloudSession, guess: GuessJudge) -> None:
        """Write this position from `guess` (the rule chose it over the device's token)."""
        ...

    def ask(
        self, turn: Turn, cloud: CloudSession, proposed: int, hidden: np.ndarray, score: float | None, explore: bool
    ) -> bool:
        """The cloud writes this position (and, in text mode, perhaps a few more); False: it could not
        (lost, slow, declined), and nothing was written."""
        ...

    def check(self, turn: Turn, cloud: CloudSession, start: int, draft: ClauseDraft) -> None:
        """The cloud's check of the clause drafted from history index `start`: release what it keeps,
        its own token where it rejects (the device's history follows); the drafts stand unchecked
        when no verdict comes."""
        ...

    def stream(self, turn: Turn, cloud: CloudSession) -> bool:
        """The cloud writes the rest of the answer; False: the stream broke off."""
        ...


class TokenHistory:
    """Both sides hold the answer as the same tokens (protocol v1/v2, and v3's "tokens" mode)."""

    def guess(self, turn: Turn, cloud: CloudSession) -> GuessJudge | None:
        wait_s = turn.opts.lookahead_wait_s
        return cloud.once(lambda link: link.tokens.next_guess(wait_s))

    def take_guess(self, turn: Turn, cloud: CloudSession, guess: GuessJudge) -> None:
        turn.write(guess.token, "cloud", None, lookahead=True)  # type: ignore[attr-defined]  # a token Guess

    def ask(
        self, turn: Turn, cloud: CloudSession, proposed: int, hidden: np.ndarray, score: float | None, explore: bool
    ) -> bool:
        turn.align()  # another tier may have rewritten the device's history (a text tier re-tokenizes it)
        history, lookahead = turn.decoder.history, turn.opts.lookahead
        got = cloud.request(
            lambda link: link.tokens.ask(history, proposed, hidden, lookahead, explore), rebuild_at=history
        )
        if got is None:
            return False
        turn.write(got.token, "cloud", score)
        return True

    def check(self, turn: Turn, cloud: CloudSession, start: int, draft: ClauseDraft) -> None:
        """One `verify`: router-flagged drafts are checked exactly, the others within `check_nats`
        (shared/decision.py, `judge_draft`). The verdict keeps the drafts before the first rejected
        one (flagged ones count as the cloud's: it chose the same token) and, at the rejected one,
        gives the cloud's token; the device rolls its history back to there."""
        dec = turn.decoder
        drafts, flagged, scores = dec.history[start:], draft.flagged, draft.scores
        check = [i for i, f in enumerate(flagged) if f]
        verdict = self.verify(cloud, dec.history[:start], drafts, check, turn.opts.check_nats, hidden=draft.hidden())
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

    def stream(self, turn: Turn, cloud: CloudSession) -> bool:
        def take(tok: CloudToken) -> bool:
            turn.write(tok.token, "cloud", None)  # decoded lazily, only if the device must take over
            return not tok.eog and not turn.finished()

        return self.stream_tokens(cloud, turn, turn.room(), take)

    @staticmethod
    def verify(
        cloud: CloudSession,
        history: list[int],
        drafts: list[int],
        check: list[int],
        tolerance: float = 0.0,
        bonus: bool = False,
        hidden: np.ndarray | None = None,
    ) -> Verdict | None:
        """The cloud's verdict on `drafts` (after `history`, which it may partly lack), or None: the
        drafts stand unless a failover re-asks. Tokens of `history` the cloud lacks are synced first,
        so only the drafts are judged and the verdict's `accepted` counts from the first draft."""

        def request(link: CloudLink) -> Verdict:
            held = link.tokens
            held.sync(history)
            return held.verify(drafts, check, bonus=bonus, tolerance=tolerance, hidden=hidden)

        return cloud.request(request, rebuild_at=history)

    @staticmethod
    def stream_tokens(
        cloud: CloudSession, turn: Turn, max_tokens: int, on_token: Callable[[CloudToken], bool], proposed: int = -1
    ) -> bool:
        """The cloud writes up to `max_tokens` tokens after the device's history, streamed to `on_token`
        (False: stop listening). False when the cloud was lost. After a failover the stream goes on
        from what the device took (the rest of `max_tokens`)."""
        got = 0

        def counted(tok: CloudToken) -> bool:
            nonlocal got
            got += 1
            return on_token(tok)

        def request(link: CloudLink) -> bool:
            held, first = link.tokens, proposed if got == 0 else -1
            held.generate(held.pending(turn.decoder.history), first, max_tokens=max_tokens - got, on_token=counted)
            return True

        return cloud.request(request) is not None


class TextHistory:
    """Each side holds the answer as text and its own tokens of it (protocol v3's "text" mode).

    The cloud's text joins the answer through `take_text`: the device re-tokenizes and keeps its
    KV cache for the common token prefix. A hard position gets the cloud's text span; with
    lookahead the span brings the cloud's guess for the next position as text (`TextGuess`),
    which decides that position: the device's token stands if the cloud finds its bytes close
    enough, else the device takes the guess's text."""

    def guess(self, turn: Turn, cloud: CloudSession) -> GuessJudge | None:
        text_guess, turn.text_guess = turn.text_guess, None  # the guess that came with the last span
        if text_guess is None:
            return None
        return text_guess.for_tokens(turn.model.token_bytes, turn.model.is_eog)

    def take_guess(self, turn: Turn, cloud: CloudSession, guess: GuessJudge) -> None:
        assert isinstance(guess, TokenView)
        best = guess.guess.best
        self.take_text(turn, cloud, CloudText(best, 1, guess.guess.logprobs[0], not best), None, lookahead=True)

    def ask(
        self, turn: Turn, cloud: CloudSession, proposed: int, hidden: np.ndarray, score: float | None, explore: bool
    ) -> bool:
        """One `text_generate`; None back where the device's text ends inside a character (the cloud is
        asked on whole characters only) or a span of only a cut character brings nothing."""
        history, lookahead, proposed_text = turn.decoder.history, turn.opts.lookahead, turn.model.token_bytes(proposed)
        got = cloud.request(
            lambda link: link.text.ask(history, proposed_text, hidden, lookahead, explore), rebuild_at=history
        )
        if got is None or not (got.text or got.eog):
            return False
        self.take_text(turn, cloud, got, score)
        turn.text_guess = got.guess
        return True

    def check(self, turn: Turn, cloud: CloudSession, start: int, draft: ClauseDraft) -> None:
        """One `text_verify` of the clause's text with the byte ranges the router flagged. The cloud
        judges its own tokens of the text (shared/text_history.py, "The cloud's check"); the device
        keeps its answer text up to the verdict's kept bytes (its drafts wholly inside them stay in
        its history), appends the cloud's text and re-tokenizes (`take_text`). A draft the cut
        splits is released as the device's text it kept."""
        dec, view = turn.decoder, turn.text
        assert view is not None
        flagged, scores = draft.flagged, draft.scores
        drafts = dec.history[start:]
        eog = turn.model.is_eog(drafts[-1])
        history, tolerance, hidden = dec.history, turn.opts.check_nats, draft.hidden()
        verdict = cloud.request(  # a failover re-asks from before the drafts
            lambda link: link.text.verify(history, start, flagged, tolerance, eog=eog, hidden=hidden),
            rebuild_at=history[:start],
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
            self.take_text(turn, cloud, CloudText(own, 0, 0.0, False), scores[cut], route="edge")
        overruled = not flagged[cut]
        got = CloudText(verdict.text.encode("utf-8"), verdict.n_tokens, verdict.logprob, verdict.eog)
        n_before = len(turn.answer.tokens)
        self.take_text(turn, cloud, got, None if own else scores[cut], overruled=overruled)
        n_cloud = len(turn.answer.tokens) - n_before
        turn.policy.share_taken_elsewhere(turn.overruled.add(j + n_cloud, overruled and n_cloud > 0))

    def stream(self, turn: Turn, cloud: CloudSession) -> bool:
        """Up to the answer's room of the cloud's tokens, streamed. After a failover the stream goes on
        from what the device took (the rest of the room)."""
        max_tokens, got = turn.room(), 0

        def take(piece: CloudText) -> bool:
            nonlocal got
            got += piece.n_tokens
            self.take_text(turn, cloud, piece, None)
            return not turn.finished()

        def request(link: CloudLink) -> bool:
            held = link.text
            held.generate(held.pending(turn.decoder.history), max_tokens=max_tokens - got, at_word=False, on_text=take)
            return True

        return cloud.request(request) is not None

    @staticmethod
    def take_text(
        turn: Turn,
        cloud: CloudSession,
        got: CloudText,
        score: float | None,
        route: Route = "cloud",
        overruled: bool = False,
        lookahead: bool = False,
    ) -> None:
        """The cloud's text joins the answer. The device re-tokenizes the answer and keeps its KV
        cache for the common token prefix (shared/text_history.py: a partial last token of its own
        is rolled back), and releases the text as its own tokens, routed cloud (the first with the
        router's score; `route` "edge": the device's own text, `overruled`: the first replaces a
        checked draft, `lookahead`: it is the cloud's guess the device took); an end of the answer
        as its end-of-turn token. Text past the answer's room (`max_tokens`) is left out, as the
        device alone would stop."""
        dec, view, start = turn.decoder, turn.text, turn.prompt_len
        assert view is not None
        pieces, text = device_pieces(turn.model, got.text, got.eog, turn.room())
        answer = dec.history[start:]
        keep, add = view.reconcile(answer, view.text_of(answer) + text)
        if keep < len(answer):
            turn.rewrote_history()
        dec.truncate(start + keep)
        dec.history.extend(add)  # decoded when next needed (the KV cache follows lazily)
        if cloud.link is not None:
            cloud.link.text.taken(len(dec.history))
        for i, token in enumerate(pieces):
            turn.out.release(
                token, route, score if i == 0 else None, overruled=overruled and i == 0, lookahead=lookahead
            )


TOKENS = TokenHistory()
TEXT = TextHistory()


def history_of(cloud: CloudSession) -> SharedHistory:
    """How `cloud`'s session shares the answer: as text (its accept said so), else as tokens."""
    return TEXT if cloud.shared_history == "text" else TOKENS
