"""The answer shared as text (protocol v3, mode "text"): the four verbs with byte positions.

The device's tokenizer differs from the model's (or the device asked for text: `hello.text_mode`
"always"), so the shared answer is its UTF-8 text and positions are byte counts;
cloud_server/text_session.py keeps the engine's token history in step with the text. This module
checks each `text_*` message against the text, moves the text through the `TextSession`, counts
the engine tokens behind it (the accounting counts the cloud model's tokens in both modes) and
sends the replies. A refused request leaves the answer as it was; one that failed after a reply
went out keeps what was sent.
"""

from __future__ import annotations

from typing import cast

from cloud_server.answer import Send, SharedAnswer, check_can_verify, check_max_tokens
from cloud_server.engine_api import Capabilities, TextEngine, Worker, engine_errors
from cloud_server.session_accounting import SessionAccounting
from cloud_server.text_session import SpanPiece, TextSession
from shared.protocol import (
    CAP_GENERATE,
    CAP_GUESS,
    CAP_VERIFY,
    ErrorCode,
    ProtocolError,
    TextGenerate,
    TextReply,
    TextRollback,
    TextSync,
    TextVerdict,
    TextVerify,
)
from shared.text_history import on_char_boundary

PROPOSED_TOKENS = 4  # `proposed_text` spells one device token: at most this many of the cloud's longest


class TextAnswer(SharedAnswer):
    """One session's answer as text, and the engine history that follows it (`TextSession`)."""

    mode = "text"
    messages = (TextSync, TextGenerate, TextVerify, TextRollback)
    other_mode = "in a text-mode session: use text_* messages"

    def __init__(
        self,
        worker: Worker,
        caps: Capabilities,
        max_tokens: int,
        acct: SessionAccounting,
        send: Send,
        n_prompt: int,
    ) -> None:
        """`n_prompt`: the prompt's tokens (the text follows them in the engine's history)."""
        super().__init__(worker, caps, max_tokens, acct, send)
        self.text = TextSession(worker, cast(TextEngine, self.engine), self.handle, n_prompt, caps.session_cells)

    def capabilities(self) -> list[str]:
        """What text mode supports (docs/protocol.md): hard positions, and the check where the engine can."""
        return [CAP_GENERATE, CAP_GUESS] + [CAP_VERIFY] * self.caps.verify

    def _price_proposal(self, proposed_text: str) -> None:
        """Refuse a `proposed_text` longer than a device token can be, before it is read: it is the text of
        one token of the device's, which another tokenizer may spell longer than this model's longest token,
        but not `PROPOSED_TOKENS` times longer."""
        longest = self.text.view.max_token_bytes or 256
        limit = PROPOSED_TOKENS * longest
        if len(proposed_text.encode()) > limit:  # (the frame's size, already read once when it was decoded)
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text_generate: proposed_text holds more than {limit} bytes; it is the text of one token of the "
                f"device's (this model's longest spells {longest} bytes)",
                field="proposed_text",
            )

    def _price_check(self, msg: TextVerify) -> None:
        """Refuse a check that must judge more of the cloud's tokens than one check may carry, from its sizes
        alone, before any tokenizing or planning: more flagged ranges than that (an honest device flags one
        per drafted token of its own, a dozen or so), or more text than that many of the longest token spell."""
        limit = self.caps.max_verify_tokens
        n_ranges = len(msg.check) // 2
        if n_ranges > limit:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text_verify: check holds {n_ranges} flagged ranges; at most {limit} per check: check a shorter draft",
                field="check",
            )
        longest = self.text.view.max_token_bytes
        n_bytes = len(msg.text.encode())  # (the frame's size, already read once when it was decoded)
        fewest = -(-n_bytes // longest) + msg.eog if longest > 0 else 0
        if fewest > limit:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text_verify: {n_bytes} bytes of drafted text take at least {fewest} of the cloud's tokens; at most "
                f"{limit} per check: check a shorter draft",
                field="text",
            )

    def _check_bytes(self, mtype: str, byte_position: int) -> None:
        if byte_position != len(self.text.text):
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"{mtype} at byte {byte_position}, but the session's answer holds {len(self.text.text)} bytes",
            )

    def _history_len(self) -> int:
        return len(self.engine.history(self.handle))

    async def sync(self, msg: TextSync) -> None:
        self._check_bytes("text_sync", msg.byte_position)
        n = self._history_len()
        with engine_errors():
            added = await self.text.append(msg.text.encode())  # refused unkept when it cannot fit
        try:
            await self.acct.prefill()
        except ProtocolError:  # refused: the answer as before (the device may resend), nothing kept
            with engine_errors():
                await self.text.rollback(msg.byte_position)
            raise
        self.acct.device_tokens(n, added)

    async def rollback(self, msg: TextRollback) -> None:
        text = self.text.text
        if msg.byte_position > len(text):
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"text_rollback to byte {msg.byte_position}, but the session's answer holds {len(text)} bytes",
            )
        if not on_char_boundary(text, msg.byte_position):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text_rollback: byte_position {msg.byte_position} falls inside a UTF-8 character of the answer; "
                "cut the answer between characters",
                field="byte_position",
            )
        with engine_errors():
            await self.text.rollback(msg.byte_position)

    async def generate(self, msg: TextGenerate) -> None:
        """A hard position in text mode: the device's text, then the cloud's span (or stream)."""
        self._check_bytes("text_generate", msg.byte_position)
        check_max_tokens(msg.max_tokens, self.max_tokens)
        self._price_proposal(msg.proposed_text)
        with self.acct.exploring(msg.explore):  # refused here, an exploration was not made: its budget is given back
            await self._generate(msg)

    async def _generate(self, msg: TextGenerate) -> None:
        acct = self.acct
        acct.admit_hard_tokens(1)
        n = self._history_len()
        with engine_errors():
            carried = await self.text.append(msg.text.encode())  # refused unkept when it cannot fit
        acct.device_tokens(n, carried)
        sent = False

        async def emit(piece: SpanPiece) -> None:
            nonlocal sent
            if not sent:  # the label: the cloud's text goes another way than the device's token
                acct.count_ask(msg.explore, disagreed=not piece.text.startswith(msg.proposed_text.encode()))
            acct.cloud_span(self._history_len() - len(piece.tokens), piece.tokens)
            await self.send(
                TextReply(
                    **acct.reply_work(),
                    request_id=msg.request_id,
                    byte_position=piece.byte_position,
                    text=piece.text.decode("utf-8"),
                    n_tokens=len(piece.tokens),
                    logprob=piece.logprob,
                    compute_ms=piece.compute_s * 1000.0,
                    final=piece.final,
                    eog=piece.eog,
                    guess_texts=[p.decode("utf-8") for p in piece.guess.pieces] if piece.guess else [],
                    guess_logprobs=list(piece.guess.logprobs) if piece.guess else [],
                )
            )
            sent = True

        try:
            with engine_errors():
                await self.text.span(
                    msg.proposed_text,
                    msg.max_tokens,
                    msg.at_word,
                    lambda: acct.admit_hard_tokens(1),
                    emit,
                    lookahead=msg.lookahead,
                )
        except Exception:
            # nothing sent: the request leaves the answer as it was (the device may retry there);
            # else the answer keeps what was sent, and the engine's history follows it again
            await self.text.rollback(len(self.text.text) if sent else msg.byte_position)
            raise

    async def verify(self, msg: TextVerify) -> None:
        """The cloud's check in text mode: judge the drafted text, keep it up to the first
        rejected cloud token, then the cloud's span from there (cloud_server/text_session.py)."""
        check_can_verify(self.caps, "text_verify", "text_generate")
        self._check_bytes("text_verify", msg.byte_position)
        check_max_tokens(msg.max_tokens, self.max_tokens)
        self._price_check(msg)
        acct = self.acct
        acct.admit_hard_tokens(1)
        flagged = list(zip(msg.check[::2], msg.check[1::2]))
        n0 = self._history_len()  # the shared text's tokens (the kept drafts' come after)
        sent = False

        async def emit(piece: SpanPiece, kept: int) -> None:
            nonlocal sent
            history = self.engine.history(acct.handle)
            base = len(history) - len(piece.tokens)
            acct.device_tokens(n0, history[min(n0, base) : base])  # the kept drafts, in cloud tokens
            acct.cloud_span(base, piece.tokens)
            await self.send(
                TextVerdict(
                    **acct.reply_work(),
                    request_id=msg.request_id,
                    byte_position=msg.byte_position,
                    accepted_bytes=kept,
                    text=piece.text.decode("utf-8"),
                    n_tokens=len(piece.tokens),
                    logprob=piece.logprob,
                    compute_ms=piece.compute_s * 1000.0,
                    eog=piece.eog,
                )
            )
            sent = True

        try:
            with engine_errors():
                await self.text.check(
                    msg.text.encode(),
                    flagged,
                    msg.tolerance,
                    msg.eog,
                    msg.check_eog,
                    msg.max_tokens,
                    self.caps.max_verify_tokens,
                    lambda: acct.admit_hard_tokens(1),
                    emit,
                )
        except Exception:
            # nothing sent: the answer is as it was (the device's drafts stand); else as sent
            await self.text.rollback(len(self.text.text) if sent else msg.byte_position)
            raise
