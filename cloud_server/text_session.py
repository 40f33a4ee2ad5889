"""Text mode on the cloud (protocol v3): the session's shared answer is text, not token ids.

The device and this server's model may tokenize differently (SmolLM2 on the device, Gemma in
the cloud). The session holds the answer's text (`text`, UTF-8 bytes); the engine's token
history is the cloud model's prompt followed by its own tokenization of that text, brought in
step after every change by shared/text_history.py (`AnswerText.reconcile`: keep the longest
common token prefix, roll back the rest, append the new tokens; the KV cache follows as usual).

A hard position (`text_generate`) writes a span of the cloud's own tokens: the first through
the engine's `generate` (with the device's proposed token when its text is one token of this
model: the tie rule of shared/decision.py), the others until `span_done` says stop, or until a
base model starts the transcript's next line (`AnswerText.stop_cut`: the answer ends there). To know
whether the next token starts a new word, the engine decodes the token just written (the
decode the next sync's prefill would make) and peeks at its most likely successor.

With `lookahead` the reply lists the cloud's most likely next pieces (`TextGuess`, from the logits
the span rule peeked at; shared/text_history.py "The cloud's lookahead guess in text mode").

The cloud's check (`text_verify`, `check`): the drafted text's tokens under this model's
tokenizer (shared/text_history.py, `plan_check`) are judged in one batched pass by the engine's
`verify` (shared/decision.py's `judge_draft` per token); the answer keeps the drafted bytes up to
the first rejected token, and the cloud writes its span from there, opening it with the token the
pass chose at the rejection when the cut falls on that token's start.

The text answer (cloud_server/text_answer.py) checks positions and the session's accounting
counts; this module only moves the text and the engine's history. It runs only on an engine that can
(`Capabilities.text`: the embedded llama.cpp engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from cloud_server.client_work import off_loop
from cloud_server.engine_api import EngineFull, GenerateResult, NotSupported, TextEngine, Worker
from shared.text_history import (
    DONE,
    PEEK,
    WRITE,
    SpanWriter,
    TextGuess,
    on_char_boundary,
    plan_check,
)


@dataclass(slots=True)
class SpanPiece:
    """Text the cloud wrote, ready for a `text_reply`."""

    byte_position: int
    text: bytes
    tokens: list[int]  # the cloud's tokens behind it (the ones written for this piece)
    logprob: float
    compute_s: float
    final: bool
    eog: bool
    guess: TextGuess | None = None  # the cloud's most likely next pieces (asked with lookahead)


class TextSession:
    """One session's shared answer text and the engine history that follows it."""

    def __init__(self, worker: Worker, engine: TextEngine, handle: int, n_prompt: int, max_history: int = 0) -> None:
        """`max_history`: the tokens the session's history may hold (its KV cells; 0: no limit known)."""
        self.worker = worker
        self.engine = engine
        self.handle = handle
        self.n_prompt = n_prompt
        self.max_history = max_history
        self.view = engine.answer_text()
        self.text = b""  # the answer so far, as both sides hold it

    async def _tokens_for(self, text: bytes) -> tuple[int, list[int]]:
        """(answer tokens of the history that stand, tokens to append) for answer `text`; EngineFull,
        before any work that grows with the text, when `text` cannot fit in the session's history.

        Why here: what the server refuses it must neither keep nor re-read. A text too long for the
        KV cells is refused from its length alone (no tokenizer splits fewer than
        `AnswerText.fewest_tokens` bytes per token), so a megabyte costs nothing; shorter text is
        tokenized off the event loop and the engine thread (the tokenizer only reads the vocabulary)."""
        self._refuse_if_too_long(text)
        held = self.engine.history(self.handle)[self.n_prompt :]
        keep, add = await off_loop(self.view.reconcile, held, text)
        if self.max_history and self.n_prompt + keep + len(add) > self.max_history:
            raise EngineFull(self._too_long(keep + len(add)))
        return keep, add

    def _refuse_if_too_long(self, text: bytes) -> None:
        """EngineFull if `text` cannot fit in the history whatever its tokens: a check on its length alone."""
        fewest = self.view.fewest_tokens(text)
        if self.max_history and self.n_prompt + fewest > self.max_history:
            raise EngineFull(self._too_long(fewest))

    def _too_long(self, n_tokens: int) -> str:
        return (
            f"the answer text would take at least {n_tokens} of this model's tokens after a {self.n_prompt}-token "
            f"prompt; a session may hold {self.max_history}: finish the answer on the device"
        )

    async def _follow(self) -> list[int]:
        """Bring the engine's history to prompt + tokens(text); returns the tokens appended."""
        return await self._apply(*await self._tokens_for(self.text))

    async def _apply(self, keep: int, add: list[int]) -> list[int]:
        if self.n_prompt + keep < len(self.engine.history(self.handle)):
            await self.worker.call(self.engine.rollback, self.handle, self.n_prompt + keep)
        self.engine.append(self.handle, add)
        return add

    async def append(self, text: bytes) -> list[int]:
        """The device wrote `text` (whole characters): returns the cloud tokens appended. Refused
        (EngineFull) without keeping anything when the answer would not fit."""
        new = self.text + text
        planned = await self._tokens_for(new)
        self.text = new
        return await self._apply(*planned)

    async def rollback(self, byte_position: int) -> None:
        """Cut the answer to `byte_position` bytes (the caller checked it is a character boundary
        within the text: shared/text_history.py, `on_char_boundary`)."""
        if not on_char_boundary(self.text, byte_position):
            raise ValueError(f"byte {byte_position} is not a character boundary of the answer")
        self.text = self.text[:byte_position]
        await self._follow()

    async def span(
        self,
        proposed_text: str,
        max_tokens: int,
        at_word: bool,
        admit: Callable[[], None],
        emit: Callable[[SpanPiece], Awaitable[None]],
        first: GenerateResult | None = None,
        lookahead: bool = False,
    ) -> None:
        """Write the cloud's span after the text (shared/text_history.py, `span_done`), handing
        the text to `emit`: once (a span), or piece by piece with `at_word` False (a stream).
        `admit` is called before each token after the first (quotas; it may raise). On an error
        the engine's history may hold tokens of no emitted text: the caller rolls back. `first`: the
        span's first token, already in the engine's history (a check's choice at its rejection).
        `lookahead`: a span that did not end the answer comes with the cloud's guess for the next
        position (`TextGuess`, from the logits the span rule looked at anyway)."""
        engine, worker, handle = self.engine, self.worker, self.handle
        w = SpanWriter(self.view, self.text, max_tokens, at_word)  # the span rule and loop, shared with the text eval
        tokens: list[int] = []
        logprob = compute = 0.0
        result = first
        if result is None:
            result = await worker.generate(handle, self.view.proposal(self.text, proposed_text.encode()))
        steps = w.steps(engine.is_eog)
        ask = next(steps)
        while ask != DONE:
            if ask == WRITE:
                if result is None:  # every token after the first is admitted first
                    admit()
                    result = await worker.generate(handle)
                tokens.append(result.token)
                logprob += result.logprob
                compute += result.compute_s
                ask, result = steps.send(result.token), None
            elif ask == PEEK:
                compute += await worker.prefill(handle)
                ask = steps.send(await worker.call(engine.peek, handle))
            else:  # FLUSH: a stream's piece
                await self._emit(emit, w.whole(), tokens, logprob, compute, final=False, eog=False)
                w.flush(self.text)
                tokens, logprob, compute = [], 0.0, 0.0
                ask = next(steps)
        eog, whole = w.eog, w.whole()
        guess = None
        if lookahead and at_word and not eog and len(whole) == len(w.written):
            compute += await worker.prefill(handle)  # (done already where the span rule looked ahead)
            top = await worker.call(engine.peek_guess, handle)
            guess = TextGuess.of(top, self.view, engine.is_eog) if top is not None else None
        await self._emit(emit, whole, tokens, logprob, compute, final=True, eog=eog, guess=guess)

    async def check(
        self,
        drafted: bytes,
        flagged: list[tuple[int, int]],
        tolerance: float,
        eog: bool,
        check_eog: bool,
        max_tokens: int,
        max_verify_tokens: int,
        admit: Callable[[], None],
        emit: Callable[[SpanPiece, int], Awaitable[None]],
    ) -> None:
        """The cloud's check of `drafted` (whole characters) after the text (module docstring):
        hands `emit` the span written after the kept bytes (empty when all were kept) and how
        many drafted bytes were kept. On an error the caller rolls back to the text before."""
        engine, worker, handle = self.engine, self.worker, self.handle
        self._refuse_if_too_long(self.text + drafted)  # before any work that grows with the text (and the
        # answer priced the check's sizes: cloud_server/text_answer.py)
        history = engine.history(handle)
        try:  # off the engine thread (it only reads the vocabulary), stopped at the first draft too many
            plan = await off_loop(
                plan_check,
                self.view,
                history[self.n_prompt :],
                self.text,
                drafted,
                flagged,
                engine.eog_token() if eog else -1,
                check_eog,
                max_verify_tokens,
            )
        except ValueError as exc:  # TooManyDrafts too
            raise NotSupported(f"text_verify: {exc}") from None
        if self.n_prompt + plan.keep < len(history):
            await worker.call(engine.rollback, handle, self.n_prompt + plan.keep)
        engine.append(handle, plan.context)
        r = await worker.verify(handle, plan.drafts, plan.exact, False, tolerance)
        check_s = r.compute_ms / 1000.0
        if r.token < 0:  # all kept: the history follows the text (a drafted end is not history)
            self.text += drafted
            await self._follow()
            await emit(SpanPiece(len(self.text), b"", [], 0.0, check_s, True, eog), len(drafted))
            return
        kept = plan.accepted_bytes(r.accepted)
        self.text += drafted[:kept]
        first = None
        if plan.continues(r.accepted):  # the pass's choice at the rejection opens the span
            first = GenerateResult(r.token, r.logprob, check_s)
        else:  # the cut fell before that token: the cloud writes from the cut
            await self._follow()

        async def emit_kept(piece: SpanPiece) -> None:
            if first is None:
                piece.compute_s += check_s
            await emit(piece, kept)

        await self.span("", max_tokens, True, admit, emit_kept, first)

    async def _emit(
        self,
        emit: Callable[[SpanPiece], Awaitable[None]],
        written: bytes | bytearray,
        tokens: list[int],
        logprob: float,
        compute_s: float,
        final: bool,
        eog: bool,
        guess: TextGuess | None = None,
    ) -> None:
        """Add `written` to the shared text (the seam removed at the answer's start), bring the
        engine's history to it (a partial last token is rolled back), then hand it out."""
        position = len(self.text)
        self.text = self.view.join(self.text, bytes(written))
        await self._follow()
        await emit(SpanPiece(position, self.text[position:], tokens, logprob, compute_s, final, eog, guess))
