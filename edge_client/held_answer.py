"""What the cloud holds of the answer, as the device knows it, and the messages that change it.

A link (edge_client/cloud_link.py) shares the answer one of two ways, picked by the cloud's
accept (protocol v3's `mode`): as the device's own **tokens** (`HeldTokens`: positions are
token indices) or as the answer's **text** (`HeldText`: positions are byte offsets, and each
side tokenizes the text itself; shared/text_history.py). Both answer the same questions for
the device's session (edge_client/cloud_session.py), which never branches on the mode:

    covered   how much of the device's history the cloud holds (or covers with its text)
    sync      send what the cloud lacks of the device's history (no reply awaited)
    reuse     bring a kept session in line with a new answer; False: open a new one
    align     after another tier rewrote the device's history: cut back to what both share
    prefill   make the cloud hold a history ahead of time (tokens only: text shares no prompt)

and each speaks its own requests (`ask`, `generate`, `verify`, ...: docs/protocol.md), which the
device's per-mode strategies (edge_client/shared_history.py) call. The request plumbing
(ids, deadlines, stale replies, traffic) is the link's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NoReturn, Protocol, TypeVar

import numpy as np

from shared.protocol import (
    Accept,
    Generate,
    Message,
    Next,
    Rollback,
    Sync,
    TextGenerate,
    TextReply,
    TextRollback,
    TextSync,
    TextVerdict,
    TextVerify,
    Tokens,
    Verdict,
    Verify,
    token_hash,
)
from shared.sampling import Guess
from shared.sequences import common_prefix
from shared.text_history import SPAN_TOKENS, AnswerText, TextGuess, complete_utf8, valid_utf8

ReplyT = TypeVar("ReplyT", Tokens, Verdict, TextReply, TextVerdict)  # a reply that answers a request


class Transport(Protocol):
    """What a held answer asks of its link (edge_client/cloud_link.py `CloudLink`): send, await the reply
    to a request (a deadline abandons it: `undo`), and count the round trip and the cloud's work."""

    messages: list[dict]  # the chat the session was opened for

    def send(self, msg: Message) -> None: ...

    def new_request(self) -> int: ...

    def reply(
        self, request_id: int, kind: type[ReplyT], undo: Callable[[], None], declined: Callable[[], None] | None = None
    ) -> ReplyT: ...

    def next_reply(self, timeout_s: float) -> Next | None: ...

    def count_work(self, reply: Tokens | Verdict | TextReply | TextVerdict) -> None: ...

    def round_trip_done(self, t0: float) -> None: ...

    def stop_listening(self) -> None: ...

    def lost(self, why: str) -> NoReturn: ...


@dataclass(slots=True)
class CloudToken:
    token: int
    logprob: float
    eog: bool


@dataclass(slots=True)
class CloudText:
    """Text mode: text the cloud wrote (whole UTF-8 characters) with its own tokens' count."""

    text: bytes
    n_tokens: int
    logprob: float
    eog: bool
    guess: TextGuess | None = None  # the cloud's most likely next pieces (a span asked with lookahead)


class HeldAnswer(Protocol):
    """What a session's cloud holds of the answer (one implementation per mode)."""

    mode: str  # "tokens" or "text" (the accept's)

    @property
    def covered(self) -> int:
        """How much of the device's history the cloud holds (text: covers with its text)."""
        ...

    def sync(self, history: list[int]) -> None: ...

    def reuse(self, prompt: list[int], messages: list[dict]) -> bool: ...

    def align(self, history: list[int]) -> None: ...

    def prefill(self, history: list[int]) -> None: ...


class HeldTokens:
    """The cloud holds the device's own tokens (one vocabulary): it lacks history[covered:]."""

    mode = "tokens"

    def __init__(self, link: Transport) -> None:
        self.link = link
        self.tokens: list[int] = []  # the tokens the cloud's history holds, as far as the device knows

    @property
    def covered(self) -> int:
        return len(self.tokens)

    def start(self, prompt: list[int], accept: Accept) -> None:
        """After the accept: the cloud holds exactly `prompt` (a rebuilt session: the answer so far too)."""
        if accept.n_prompt <= len(prompt) and accept.prompt_hash == token_hash(prompt[: accept.n_prompt]):
            self.tokens = list(prompt[: accept.n_prompt])
            self.send(prompt[accept.n_prompt :])
        else:  # the cloud rendered the chat differently: the device's tokens are the truth
            self.rollback(0)
            self.send(prompt)

    def send(self, tokens: list[int]) -> None:
        """Append device-written tokens to the cloud's history (a `sync`; no reply)."""
        if tokens:
            self.link.send(Sync(position=self.covered, tokens=list(tokens)))
            self.tokens.extend(tokens)

    def pending(self, history: list[int]) -> list[int]:
        """The tokens of `history` the cloud lacks."""
        return history[self.covered :]

    def sync(self, history: list[int]) -> None:
        self.send(self.pending(history))

    def prefill(self, history: list[int]) -> None:
        """Make the cloud hold `history`: roll back to the prefix both share, then sync the rest."""
        self.align(history)
        self.sync(history)

    def reuse(self, prompt: list[int], messages: list[dict]) -> bool:
        self.prefill(prompt)
        return True

    def align(self, history: list[int]) -> None:
        keep = common_prefix(self.tokens, history)
        if keep < self.covered:
            self.rollback(keep)

    def rollback(self, position: int) -> None:
        self.link.send(Rollback(position=position))
        del self.tokens[position:]

    def ask(
        self, history: list[int], proposed: int, hidden: np.ndarray, lookahead: bool, explore: bool
    ) -> CloudToken | None:
        """The cloud's token for the position after `history` (the device proposed `proposed`); None:
        it wrote none. `lookahead`: its guess for the next position follows (`next_guess`)."""
        got = self.generate(self.pending(history), proposed, hidden, max_tokens=1, lookahead=lookahead, explore=explore)
        return got[0] if got else None

    def generate(
        self,
        pending: list[int],
        proposed: int = -1,
        hidden: np.ndarray | None = None,
        max_tokens: int = 1,
        on_token: Callable[[CloudToken], bool] | None = None,
        lookahead: bool = False,
        explore: bool = False,
    ) -> list[CloudToken]:
        """Send `pending` device tokens plus a hard-token request; returns the cloud's tokens.

        With max_tokens > 1 the cloud streams; `on_token` sees each token as it arrives and may
        return False to stop listening (the link then closes, since the cloud is still writing).
        With `lookahead` the cloud then sends its guess for the following position: read it with
        `next_guess`. `explore`: the device's engine kept this position (exploration); the cloud
        may decline it (CloudDeclined)."""
        link = self.link
        request_id = link.new_request()
        link.send(
            Generate(
                request_id=request_id,
                position=self.covered,
                tokens=list(pending),
                proposed=proposed,
                max_tokens=max_tokens,
                hidden=None if hidden is None else hidden.astype(np.float16),
                lookahead=lookahead,
                explore=explore,
            )
        )
        n0 = len(self.tokens)
        self.tokens.extend(pending)

        def declined() -> None:  # an exploration the cloud declined: it took nothing of `pending`
            del self.tokens[n0:]

        t0 = time.perf_counter()
        out: list[CloudToken] = []
        while True:
            # a timeout abandons the request: the cloud finishes it, then this rollback undoes its tokens
            reply = link.reply(request_id, Tokens, undo=lambda: self.rollback(self.covered), declined=declined)
            if reply.position != self.covered:
                link.lost(f"cloud tokens at position {reply.position}, expected {self.covered}")
            link.count_work(reply)
            for token, logprob in zip(reply.ids, reply.logprobs):
                tok = CloudToken(token, logprob, eog=reply.eog and token == reply.ids[-1])
                out.append(tok)
                self.tokens.append(token)
                if on_token is not None and on_token(tok) is False and not reply.final:
                    link.stop_listening()  # the cloud is still writing into this session
                    return out
            if reply.final:
                break
        link.round_trip_done(t0)
        return out

    def next_guess(self, timeout_s: float) -> Guess | None:
        """The cloud's guess for the position after its last token (the `next` message of the last
        generate, sent with lookahead), or None if it did not come within `timeout_s` or the cloud
        had none. Only valid while the device has added nothing since that token."""
        reply = self.link.next_reply(timeout_s)
        if reply is None or reply.token < 0 or reply.position != self.covered:
            return None
        return Guess(reply.token, reply.logprob, reply.top_ids, reply.top_logprobs)

    def verify(
        self,
        tokens: list[int],
        check: list[int],
        bonus: bool = False,
        tolerance: float = 0.0,
        hidden: np.ndarray | None = None,
    ) -> Verdict:
        """Send the tokens the cloud lacks and have it check the drafts at `check` offsets (exactly)
        and, with `tolerance` > 0, every draft (within that many nats). `hidden`: the hidden state at
        each `check` offset (rows), sent as float16.

        One round trip. Afterwards the cloud holds the accepted drafts plus the verdict's token (if
        any); `covered` follows. The caller rolls its own history back to `covered - (token >= 0)`
        and appends the token."""
        link = self.link
        request_id = link.new_request()
        position = self.covered
        link.send(
            Verify(
                request_id=request_id,
                position=position,
                tokens=list(tokens),
                check=list(check),
                bonus=bonus,
                tolerance=tolerance,
                hidden=None if hidden is None else np.asarray(hidden, dtype=np.float16).reshape(-1),
            )
        )
        t0 = time.perf_counter()
        # a timeout abandons it, as a slow generate: the cloud finishes the verify, then this rollback undoes it
        reply = link.reply(request_id, Verdict, undo=lambda: self.rollback(self.covered))
        if reply.position != position or not 0 <= reply.accepted <= len(tokens):
            link.lost(f"verdict for position {reply.position} accepting {reply.accepted} does not match the verify")
        self.tokens.extend(tokens[: reply.accepted])
        if reply.token >= 0:
            self.tokens.append(reply.token)
        link.count_work(reply)
        link.round_trip_done(t0)
        return reply


class HeldText:
    """The cloud holds the answer's text (protocol v3's text mode): the device's history from
    `prompt_len` on, as text (`answer_text`), is what both share; each side holds its own tokens."""

    mode = "text"

    def __init__(self, link: Transport, answer_text: AnswerText | None, prompt_len: int) -> None:
        self.link = link
        self._answer_text = answer_text  # None: a link used without a device model (the raw requests only)
        self.prompt_len = prompt_len  # where the answer starts in the device's history
        self.text = bytearray()  # the answer text the cloud holds
        self._covered = prompt_len  # how much of the device's history the cloud's text covers

    @property
    def covered(self) -> int:
        return self._covered

    @property
    def answer_text(self) -> AnswerText:
        assert self._answer_text is not None, "the link was opened without the device model's view of the text"
        return self._answer_text

    def taken(self, history_len: int) -> None:
        """The device took the cloud's text: its history (of `history_len`) is what the cloud holds."""
        self._covered = history_len

    def pending(self, history: list[int]) -> bytes:
        """The answer text of `history` the cloud lacks, up to the last whole character. Where the
        device's text departs from the cloud's (a rollback on the device), the cloud's is cut first."""
        return self._lacking(self._answer(history))

    def _answer(self, history: list[int]) -> bytes:
        """The answer text of the device's `history` (read once per call: it is the whole answer's)."""
        return self.answer_text.text_of(history[self.prompt_len :])

    def _lacking(self, answer: bytes) -> bytes:
        if not answer.startswith(self.text):
            keep = common_prefix(answer, self.text)
            self.rollback(complete_utf8(answer[:keep]))
        pending = answer[len(self.text) :]
        return pending[: complete_utf8(pending)]

    def sync(self, history: list[int]) -> None:
        """Send the answer text the cloud lacks (whole characters; no reply)."""
        answer = self._answer(history)
        self.send(self._lacking(answer))
        whole = len(self.text) == len(answer)
        self._covered = len(history) if whole else max(self._covered, len(history) - 1)

    def send(self, text: bytes) -> None:
        if text:
            self.link.send(TextSync(byte_position=len(self.text), text=text.decode("utf-8")))
            self.text += text

    def reuse(self, prompt: list[int], messages: list[dict]) -> bool:
        """Each side renders the chat itself, so a new chat is a new session; the same chat answered
        again starts from no answer text."""
        if messages != self.link.messages:
            return False
        if self.text:
            self.rollback(0)
        self.prompt_len = self._covered = len(prompt)
        return True

    def align(self, history: list[int]) -> None:
        """Nothing to do: the text follows the device's history at the next `pending`."""

    def prefill(self, history: list[int]) -> None:
        """Nothing to do: a text session shares the answer, not the prompt."""

    def rollback(self, byte_position: int) -> None:
        self.link.send(TextRollback(byte_position=byte_position))
        del self.text[byte_position:]

    def ask(
        self, history: list[int], proposed: bytes, hidden: np.ndarray, lookahead: bool, explore: bool
    ) -> CloudText | None:
        """The cloud's span for the position after `history` (`proposed`: the device's token's text), or
        None where the device's text ends inside a character (the cloud is asked on whole characters only).
        `lookahead`: the span comes with the cloud's guess for the next position."""
        answer = self._answer(history)
        if complete_utf8(answer) != len(answer):
            return None
        return self.generate(self._lacking(answer), proposed, hidden, lookahead=lookahead, explore=explore)

    def generate(
        self,
        pending: bytes,
        proposed: bytes = b"",
        hidden: np.ndarray | None = None,
        max_tokens: int = SPAN_TOKENS,
        at_word: bool = True,
        on_text: Callable[[CloudText], bool] | None = None,
        lookahead: bool = False,
        explore: bool = False,
    ) -> CloudText:
        """Send `pending` device text plus a hard position; returns the cloud's text (a span,
        shared/text_history.py), all of it: with `at_word` False a stream of up to `max_tokens`
        cloud tokens, each piece shown to `on_text` as it comes (False: stop listening; the link
        then closes, since the cloud is still writing). `proposed`: the device's token's text.
        `lookahead`: the span comes with the cloud's guess for the next position (`CloudText.guess`)."""
        link = self.link
        request_id = link.new_request()
        link.send(
            TextGenerate(
                request_id=request_id,
                byte_position=len(self.text),
                text=pending.decode("utf-8"),
                # a byte-fallback token may be part of a character: only its whole characters can travel
                proposed_text=proposed[: valid_utf8(proposed)].decode("utf-8"),
                max_tokens=max_tokens,
                at_word=at_word,
                hidden=None if hidden is None else hidden.astype(np.float16),
                lookahead=lookahead,
                explore=explore,
            )
        )
        n0 = len(self.text)
        self.text += pending

        def declined() -> None:  # an exploration the cloud declined: it took nothing of `pending`
            del self.text[n0:]

        t0 = time.perf_counter()
        out = CloudText(b"", 0, 0.0, False)
        while True:
            # a timeout abandons it: the cloud finishes the span, then this rollback undoes its text
            reply = link.reply(request_id, TextReply, undo=lambda: self.rollback(len(self.text)), declined=declined)
            if reply.byte_position != len(self.text):
                link.lost(f"cloud text at byte {reply.byte_position}, expected {len(self.text)}")
            link.count_work(reply)
            piece = CloudText(reply.text.encode("utf-8"), reply.n_tokens, reply.logprob, reply.eog)
            self.text += piece.text
            guess = None
            if reply.guess_texts:
                guess = TextGuess([t.encode("utf-8") for t in reply.guess_texts], list(reply.guess_logprobs))
            out = CloudText(
                out.text + piece.text, out.n_tokens + piece.n_tokens, out.logprob + piece.logprob, piece.eog, guess
            )
            if on_text is not None and on_text(piece) is False and not reply.final:
                link.stop_listening()  # the cloud is still writing into this session
                return out
            if reply.final:
                break
        link.round_trip_done(t0)
        return out

    def verify(
        self,
        history: list[int],
        start: int,
        flagged: list[bool],
        tolerance: float,
        eog: bool = False,
        hidden: np.ndarray | None = None,
    ) -> TextVerdict | None:
        """The cloud's check of the drafts history[start:] (their `flagged` by the router; `eog`: the
        last one ends the answer) as text, with the flagged drafts' byte ranges. None: no whole
        character was drafted. The verdict's `byte_position + accepted_bytes` is where the kept
        answer text ends; afterwards the cloud holds the kept bytes and the verdict's text."""
        pending = self.pending(history)  # the text the cloud lacks, the drafts' included
        position = len(self.text)
        if not pending and not eog:
            return None
        answer = history[self.prompt_len :]
        first = start - self.prompt_len
        # each draft's bytes, from the cloud's end of text (the drafted text's start)
        ends = [len(self.answer_text.text_of(answer[:n])) - position for n in range(first, len(answer) + 1)]
        ranges: list[tuple[int, int]] = []
        rows: list[int] = []  # which flagged draft each range is (its hidden row)
        for i, hard in enumerate(flagged):
            lo, hi = max(0, ends[i]), min(ends[i + 1], len(pending))
            if hard and lo < hi:
                ranges.append((lo, hi))
                rows.append(sum(flagged[:i]))
        verdict = self._check(
            pending, ranges, tolerance, eog, eog and flagged[-1], hidden[rows] if hidden is not None and rows else None
        )
        if not verdict.text and len(self.text) == ends[-1] + position:
            self._covered = len(history)  # the cloud holds all of it (else the text that follows)
        return verdict

    def _check(
        self,
        drafted: bytes,
        flagged: list[tuple[int, int]],
        tolerance: float,
        eog: bool,
        check_eog: bool,
        hidden: np.ndarray | None,
    ) -> TextVerdict:
        """One `text_verify` of `drafted` text (whole characters) with the router-`flagged` [start,
        end) byte ranges of it. One round trip; `text` follows the kept bytes and the verdict's text."""
        link = self.link
        request_id = link.new_request()
        position = len(self.text)
        link.send(
            TextVerify(
                request_id=request_id,
                byte_position=position,
                text=drafted.decode("utf-8"),
                check=[b for r in flagged for b in r],
                tolerance=tolerance,
                eog=eog,
                check_eog=check_eog,
                max_tokens=SPAN_TOKENS,
                hidden=None if hidden is None else np.asarray(hidden, dtype=np.float16).reshape(-1),
            )
        )
        t0 = time.perf_counter()
        # a timeout abandons it: the cloud finishes the check, then this rollback undoes what it kept
        reply = link.reply(request_id, TextVerdict, undo=lambda: self.rollback(position))
        if reply.byte_position != position or not 0 <= reply.accepted_bytes <= len(drafted):
            link.lost(
                f"text verdict at byte {reply.byte_position} keeping {reply.accepted_bytes} does not match the check"
            )
        self.text += drafted[: reply.accepted_bytes] + reply.text.encode("utf-8")
        link.count_work(reply)
        link.round_trip_done(t0)
        return reply
