"""The answer shared as the cloud model's token ids (protocol v1-v3, mode "tokens").

The device and the cloud read one vocabulary, so the engine's history (the prompt, then the
answer's tokens) is the shared answer itself, and positions are token counts. `sync` appends the
device's tokens, `generate` writes the cloud's tokens at a hard position (with `lookahead`, a
`next` announcing its guess for the position after), `verify` judges the device's drafts in one
batched pass, `rollback` cuts the history back. A refused request leaves the history as it was,
so the device may retry at the same position.
"""

from __future__ import annotations

import logging
import time

from cloud_server.answer import SharedAnswer, check_can_verify, check_max_tokens
from cloud_server.engine_api import EngineError, GenerateResult, VerifyResult, engine_errors
from cloud_server.session_accounting import vars_of
from shared.protocol import (
    ErrorCode,
    Generate,
    Next,
    ProtocolError,
    Rollback,
    Sync,
    Tokens,
    Verdict,
    Verify,
)
from shared.sampling import NO_GUESS, Guess, SamplingError

log = logging.getLogger("cloud_server.session")


class TokenAnswer(SharedAnswer):
    """One session's answer as token ids: the engine's history is the shared answer."""

    mode = "tokens"
    messages = (Sync, Generate, Verify, Rollback)
    other_mode = "in a session that shares tokens, not text"

    def capabilities(self) -> list[str]:
        return self.caps.names()

    # ------------------------------------------------------------ checks (before anything is kept)

    def _check_position(self, mtype: str, position: int) -> None:
        n = len(self.engine.history(self.handle))
        if position != n:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER, f"{mtype} at position {position}, but the session holds {n} tokens"
            )

    def _check_fits(self, n_more: int) -> None:
        """`context_full` before anything is kept when `n_more` tokens would not fit in the session's
        history (its KV cells): what the server refuses it does not keep."""
        limit, n = self.caps.session_cells, len(self.engine.history(self.handle))
        if limit and n + n_more > limit:
            raise ProtocolError(
                ErrorCode.CONTEXT_FULL,
                f"{n_more} more tokens after {n} would not fit: a session may hold {limit}; "
                "finish the answer on the device",
            )

    def _check_tokens(self, tokens: list[int]) -> None:
        n_vocab = self.caps.n_vocab
        if any(t < 0 or t >= n_vocab for t in tokens):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"token ids must be within [0, {n_vocab})", field="tokens")

    # ------------------------------------------------------------ the four verbs

    async def sync(self, msg: Sync) -> None:
        self._check_position("sync", msg.position)
        self._check_tokens(msg.tokens)
        self._check_fits(len(msg.tokens))
        self.engine.append(self.handle, msg.tokens)
        try:
            await self.acct.prefill()
        except ProtocolError:  # refused (busy, context_full): the history as before, the device may resend
            await self.worker.call(self.engine.rollback, self.handle, msg.position)
            raise
        self.acct.device_tokens(msg.position, msg.tokens)

    async def rollback(self, msg: Rollback) -> None:
        n = len(self.engine.history(self.handle))
        if msg.position > n:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"rollback to {msg.position}, but the session holds {n} tokens")
        await self.worker.call(self.engine.rollback, self.handle, msg.position)
        self.acct.rolled_back(msg.position)

    async def generate(self, msg: Generate) -> None:
        """A hard position: the device's tokens, then the cloud's, one `tokens` reply each."""
        self._check_position("generate", msg.position)
        self._check_tokens(msg.tokens)
        if msg.proposed >= self.caps.n_vocab:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"proposed must be -1 or within [0, {self.caps.n_vocab})", field="proposed"
            )
        check_max_tokens(msg.max_tokens, self.max_tokens)
        t_received = time.perf_counter()
        acct, position = self.acct, msg.position + len(msg.tokens)
        with acct.exploring(msg.explore):  # refused here, an exploration was not made: its budget is given back
            written = await self._first_token(msg)
            acct.count_ask(msg.explore, disagreed=written.token != msg.proposed)
        for i in range(msg.max_tokens):
            if i > 0:  # a refusal from here on keeps the tokens already sent
                acct.admit_hard_tokens(1)
                with engine_errors():
                    written = await self.worker.generate(self.handle)
            token = written.token
            acct.cloud_token(position + i, token)
            eog = self.engine.is_eog(token)
            final = eog or i == msg.max_tokens - 1
            if i == 0:
                acct.record_choice(msg.hidden, msg.proposed, token, position, msg.explore)
            await self._send_tokens(msg.request_id, position + i, written, final, eog)
            acct.services.metrics.hard_token_time.observe(time.perf_counter() - t_received)
            t_received = time.perf_counter()
            if final:
                if msg.lookahead and not eog:
                    await self._send_next(msg.request_id, position + i + 1)
                return

    async def _first_token(self, msg: Generate) -> GenerateResult:
        """The device's tokens and the cloud's first: refused, it leaves the history as it was (the
        device may retry at msg.position)."""
        self.acct.admit_hard_tokens(1, carried=len(msg.tokens))
        self.engine.append(self.handle, msg.tokens)
        if self.caps.guess:
            self.engine.expect_guess(self.handle, msg.lookahead and msg.max_tokens == 1)
        try:
            with engine_errors():
                first = await self.worker.generate(self.handle, msg.proposed)
        except Exception:
            self.acct.guard.device_tokens(-len(msg.tokens))
            if msg.tokens:
                await self.worker.call(self.engine.rollback, self.handle, msg.position)
            raise
        self.acct.device_tokens(msg.position, msg.tokens, guarded=True)
        return first

    async def verify(self, msg: Verify) -> None:
        """The cloud's check: the drafts judged in one pass, kept up to the first rejected one."""
        check_can_verify(self.caps, "verify", "generate")
        self._check_position("verify", msg.position)
        self._check_tokens(msg.tokens)
        if len(msg.tokens) > self.caps.max_verify_tokens:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"verify: at most {self.caps.max_verify_tokens} drafted tokens", field="tokens"
            )
        acct = self.acct
        acct.admit_hard_tokens(1)
        with engine_errors():
            r = await self.worker.verify(self.handle, msg.tokens, msg.check, msg.bonus, msg.tolerance)
        judged = min(r.accepted + 1, len(msg.tokens))  # the kept drafts, and the one rejected (if any)
        flagged_judged = sum(1 for off in msg.check if off < judged)
        acct.routing.checked += judged - flagged_judged
        acct.routing.overruled += r.token >= 0 and r.accepted < len(msg.tokens) and r.accepted not in msg.check
        acct.device_tokens(msg.position, msg.tokens[: r.accepted])
        if r.token >= 0:
            acct.cloud_token(msg.position + r.accepted, r.token)
        self._record_checked(msg, r)
        await self.send(
            Verdict(
                **acct.reply_work(),
                request_id=msg.request_id,
                position=msg.position,
                accepted=r.accepted,
                token=r.token,
                logprob=r.logprob,
                compute_ms=r.compute_ms,
                eog=r.eog,
            )
        )

    def _record_checked(self, msg: Verify, r: VerifyResult) -> None:
        """The flywheel (opt-in): the checked hard tokens the answer kept, and the cloud's own at the rejection."""
        if self.acct.recorder is None or msg.hidden is None:
            return
        rows = msg.hidden.reshape(len(msg.check), -1)
        for off, hidden in zip(msg.check, rows):
            if off > r.accepted:  # after the rejection: never written
                break
            cloud = r.token if off == r.accepted else msg.tokens[off]  # at the rejection, the cloud's own token
            self.acct.record_choice(hidden, msg.tokens[off], cloud, msg.position + off)

    # ------------------------------------------------------------ replies

    async def _send_tokens(self, request_id: int, position: int, w: GenerateResult, final: bool, eog: bool) -> None:
        await self.send(
            Tokens(
                **self.acct.reply_work(),
                request_id=request_id,
                position=position,
                ids=[w.token],
                logprobs=[w.logprob],
                compute_ms=w.compute_s * 1000.0,
                final=final,
                eog=eog,
            )
        )

    async def _send_next(self, request_id: int, position: int) -> None:
        """Lookahead: decode the token just written (the next sync's prefill would have) and
        announce the choice its logits give for `position`. The decode is reported as
        background prefill with the next reply. No guess (-1, which the device reads as none)
        when the engine cannot guess or the guess fails: the tokens are already sent."""
        g: Guess = NO_GUESS
        work = self.acct.take_work()
        if self.caps.guess:
            try:
                self.acct.prefill_ms += 1000.0 * await self.worker.prefill(self.handle)
                g = await self.worker.call(self.engine.guess, self.handle)
            except (EngineError, SamplingError) as exc:
                log.debug("session %s: no lookahead guess (%s)", self.acct.session_id, exc)
            guess = self.engine.take_work(self.handle)  # the decode of the written token: the guess's work
            guess.guess_tokens += guess.prefill_tokens
            guess.prefill_tokens = 0
            work.add(guess)
        await self.send(
            Next(
                **vars_of(work),
                request_id=request_id,
                position=position,
                token=g.token,
                logprob=g.logprob,
                top_ids=g.top_ids,
                top_logprobs=g.top_logprobs,
            )
        )
