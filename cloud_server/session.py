"""One device connection: the protocol state machine on the cloud side.

Independent of FastAPI: it takes decoded messages and a `send` coroutine, so
the rules (hello first, positions must match the history, limits) can be read
in one place. A rule broken raises ProtocolError; the transport turns that
into an `error` reply and keeps the connection.

The engine is reached only through the `Engine` and `Worker` protocols
(cloud_server/engine_api.py): what it cannot do (its `capabilities`) is
refused with a named error, and an engine's refusal (`EngineError`, a
`SamplingError`) becomes the error code it names; the session lives on.
A refused `generate` leaves the history as it was, so the device may retry at
the same position.

Protocol v2: the `accept` lists the engine's capabilities (what the device may
ask for), and every reply carries the engine's work for this session since the
previous reply (forward passes, tokens per kind, remote requests: shared/protocol.py
`Work`), background prefill included. A v1 device is served as before.

Protocol v3, text mode: a device whose tokenizer differs from the model's (or
that asks for it: `hello.text_mode` "always") shares the answer as text; the
`text_*` messages carry byte positions, and cloud_server/text_session.py keeps
the engine's token history in step with the text. Token messages are refused
in a text session and text messages in a token session (`out_of_order`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Awaitable, Callable, NoReturn, cast

from cloud_server.audit import SessionAudit
from cloud_server.auth import KeyChecker
from cloud_server.config import ServerConfig
from cloud_server.engine_api import EngineError, EngineFull, GenerateResult, Owner, TextEngine, Worker
from cloud_server.flywheel import recorder_for
from cloud_server.quotas import KeyPolicy, QuotaExceeded, SessionGuard
from cloud_server.routing_watch import SessionRouting
from cloud_server.services import Services
from cloud_server.text_session import SpanPiece, TextSession
from shared.model_info import ModelInfo
from shared.protocol import (
    CAP_GENERATE,
    CAP_GUESS,
    CAP_VERIFY,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    WORK_FIELDS,
    Accept,
    Close,
    ErrorCode,
    Generate,
    Hello,
    Message,
    Next,
    ProtocolError,
    Reject,
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
    Work,
    sampling_from_dict,
    token_hash,
)
from shared.sampling import NO_GUESS, Guess, SamplingError
from shared.text_history import on_char_boundary

log = logging.getLogger(__name__)


def vars_of(work: Work) -> dict[str, int]:
    """A Work's fields as keyword arguments of a reply message."""
    return {f: getattr(work, f) for f in WORK_FIELDS}


class ConnectionDone(Exception):
    """The connection should close (after a reject or a close)."""


@dataclass(slots=True)
class SessionState:
    """What a connection holds once `hello` is accepted: its engine session, key, abuse guard and audit."""

    handle: int  # the engine's session
    session_id: str
    key: KeyPolicy  # holds one of the key's sessions until close
    guard: SessionGuard
    audit: SessionAudit | None  # None when the audit log is off
    flagged: bool = False  # the abuse check flagged it (counted and logged once per session)
    routing: SessionRouting = field(default_factory=SessionRouting)  # the routing watch's counts

    def record_tokens(self, position: int, tokens: list[int], cloud: bool) -> None:
        if self.audit is not None:
            self.audit.tokens(position, tokens, cloud=cloud)

    def record_rollback(self, position: int) -> None:
        if self.audit is not None:
            self.audit.rollback(position)

    def flag(self) -> bool:
        """Mark the session (and its audit log, if any) flagged; True the first time only, audit log or
        not, so the caller counts and logs each session once."""
        first, self.flagged = not self.flagged, True
        if self.audit is not None:
            self.audit.flagged = True
        return first


@contextmanager
def engine_errors() -> Iterator[None]:
    """An engine's refusal as the ProtocolError it names (the session survives it)."""
    try:
        yield
    except EngineError as exc:
        raise ProtocolError(exc.code, str(exc)) from None
    except SamplingError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"sampling: {exc}") from None


class Connection:
    def __init__(
        self,
        worker: Worker,
        config: ServerConfig,
        keys: KeyChecker,
        info: ModelInfo,
        send: Callable[[Message], Awaitable[None]],
        services: Services | None = None,
    ) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.caps = self.engine.capabilities()
        self.config = config
        self.keys = keys
        self.info = info
        self.send = send
        self.session: SessionState | None = None  # set by an accepted hello
        self.n_errors = 0
        self.cloud_tokens = 0
        self.recorder = recorder_for(config.record_dir, info.name, info.fingerprint)  # None unless --record-dir
        self.prefill_ms = 0.0  # background prefill after hello/sync, reported with the next reply (prefill_ms)
        self.services = services or Services()
        self.edge_model = ""
        self.text: TextSession | None = None  # text mode (protocol v3): the shared answer text

    @property
    def session_id(self) -> str:
        return self.session.session_id if self.session is not None else ""

    @property
    def seq(self) -> int | None:
        """The engine session's handle once hello was accepted, else None (the transport asks)."""
        return self.session.handle if self.session is not None else None

    async def on_message(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            if self.session is not None:
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, "hello sent twice on one connection")
            return await self._hello(msg)
        st = self.session
        if st is None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"first message must be hello, got {msg.type}")
        if isinstance(msg, (TextSync, TextGenerate, TextRollback, TextVerify)):
            if self.text is None:
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{msg.type} in a session that shares tokens, not text")
            if isinstance(msg, TextSync):
                return await self._text_sync(st, self.text, msg)
            if isinstance(msg, TextGenerate):
                return await self._text_generate(st, self.text, msg)
            if isinstance(msg, TextVerify):
                return await self._text_verify(st, self.text, msg)
            return await self._text_rollback(self.text, msg)
        if self.text is not None and isinstance(msg, (Sync, Generate, Verify, Rollback)):
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{msg.type} in a text-mode session: use text_* messages")
        if isinstance(msg, Sync):
            return await self._sync(st, msg)
        if isinstance(msg, Generate):
            return await self._generate(st, msg)
        if isinstance(msg, Verify):
            return await self._verify(st, msg)
        if isinstance(msg, Rollback):
            return await self._rollback(st, msg)
        if isinstance(msg, Close):
            raise ConnectionDone(msg.reason)
        raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{msg.type} is not a device-to-cloud message")

    async def _reject(self, code: str, reason: str, kind: str | None = None) -> NoReturn:
        log.info("reject: %s (%s)", code, reason)
        self.services.metrics.rejections.labels(kind or code).inc()
        await self.send(Reject(code=code, reason=reason))
        raise ConnectionDone(reason)

    async def _hello(self, msg: Hello) -> None:
        if msg.version not in SUPPORTED_VERSIONS:
            await self._reject(
                ErrorCode.VERSION_MISMATCH,
                f"protocol version {msg.version} not supported; this server speaks "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}",
            )
        key = self.keys.identify(msg.api_key)
        if key is None:
            await self._reject(ErrorCode.UNAUTHORIZED, "missing or wrong API key")
        same_vocab = msg.tokenizer == self.info.tokenizer_fingerprint
        text_mode = (
            self.caps.text
            and msg.version >= 3
            and (msg.text_mode == "always" or (msg.text_mode == "auto" and not same_vocab))
        )
        if not same_vocab and not text_mode:
            await self._reject(
                ErrorCode.VOCAB_MISMATCH,
                f"device tokenizer {msg.tokenizer} differs from the cloud model's ({self.info.name}, "
                f"{self.info.tokenizer_fingerprint}); token routing needs one vocabulary: use an edge model "
                "built from the same tokenizer, or text mode (protocol v3, text_mode auto"
                + ("" if self.caps.text else "; this server's engine cannot")
                + ")",
            )
        sampling = sampling_from_dict(msg.sampling)
        try:
            self.services.quotas.open_session(key)
        except QuotaExceeded as exc:
            await self._reject(ErrorCode.BUSY, exc.reason, exc.kind)
        try:
            # the template and the tokenizer read only the vocabulary: off the engine thread, whose time is shared
            prompt = await asyncio.to_thread(self.engine.chat_tokens, msg.messages)
            handle = await self.worker.call(
                self.engine.open, prompt, sampling, Owner(key.name, key.kv_churn_per_minute)
            )
        except EngineFull as exc:
            self.services.quotas.close_session(key)
            await self._reject(ErrorCode.BUSY, f"{exc}; try again later", "capacity")
        except BaseException:
            self.services.quotas.close_session(key)
            raise
        session_id = f"s{handle}-{id(self):x}"
        self.edge_model = msg.edge_model
        st = self.session = SessionState(
            handle,
            session_id,
            key,
            SessionGuard(key, self.services.abuse_warmup_tokens),
            self.services.audit.start(session_id, key.name, len(prompt)),
        )
        if text_mode:  # what text mode supports (docs/protocol.md): hard positions, and the check where the engine can
            self.text = TextSession(
                self.worker, cast(TextEngine, self.engine), handle, len(prompt), self.caps.session_cells
            )
        await self.send(
            Accept(
                session_id=session_id,
                cloud_model=self.info.fingerprint,
                tokenizer=self.info.tokenizer_fingerprint,
                n_prompt=len(prompt),
                prompt_hash=token_hash(prompt),
                max_message_bytes=self.config.max_message_bytes,
                version=min(msg.version, PROTOCOL_VERSION),
                capabilities=(
                    [CAP_GENERATE, CAP_GUESS] + [CAP_VERIFY] * self.caps.verify if text_mode else self.caps.names()
                ),
                max_verify_tokens=self.caps.verify_limit(len(prompt)),  # what fits after this prompt
                mode="text" if text_mode else "tokens",
                base_model=not self.info.chat,
            )
        )
        if msg.resume:  # a failover: the device lost its replica mid-answer and rebuilds the session here
            self.services.metrics.resumed.inc()
        await self._prefill(st)

    def _check_position(self, st: SessionState, mtype: str, position: int) -> None:
        n = len(self.engine.history(st.handle))
        if position != n:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER, f"{mtype} at position {position}, but the session holds {n} tokens"
            )

    def _check_fits(self, st: SessionState, n_more: int) -> None:
        """`context_full` before anything is kept when `n_more` tokens would not fit in the session's
        history (its KV cells): what the server refuses it does not keep."""
        limit, n = self.caps.session_cells, len(self.engine.history(st.handle))
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

    async def _prefill(self, st: SessionState) -> None:
        with engine_errors():
            self.prefill_ms += 1000.0 * await self.worker.prefill(st.handle)

    def _take_work(self, st: SessionState) -> Work:
        """The engine's work for this session not yet reported (carried by the next reply)."""
        return self.engine.take_work(st.handle)

    def _reply_work(self, st: SessionState) -> dict:
        """A reply's report of the work since the last one: the engine's counts and the background
        prefill time (syncs, the lookahead's decode), as the reply's fields."""
        prefill_ms, self.prefill_ms = self.prefill_ms, 0.0
        return {**vars_of(self._take_work(st)), "prefill_ms": prefill_ms}

    def _check_max_tokens(self, max_tokens: int) -> None:
        if max_tokens > self.config.max_tokens_per_request:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"max_tokens {max_tokens} exceeds the server limit {self.config.max_tokens_per_request}",
                field="max_tokens",
            )

    async def _sync(self, st: SessionState, msg: Sync) -> None:
        self._check_position(st, "sync", msg.position)
        self._check_tokens(msg.tokens)
        self._check_fits(st, len(msg.tokens))
        self.engine.append(st.handle, msg.tokens)
        try:
            await self._prefill(st)
        except ProtocolError:  # refused (busy, context_full): the history as before, the device may resend
            await self.worker.call(self.engine.rollback, st.handle, msg.position)
            raise
        self._device_tokens(st, msg.position, msg.tokens)

    def _device_tokens(self, st: SessionState, position: int, tokens: list[int], guarded: bool = False) -> None:
        """Account tokens the device wrote (abuse check unless already `guarded`, audit, metrics)."""
        if tokens:
            if not guarded:
                st.guard.device_tokens(len(tokens))
            self.services.metrics.device_tokens.inc(len(tokens))
            st.record_tokens(position, tokens, cloud=False)
            self._advanced(st, len(tokens))

    def _cloud_token(self, st: SessionState, position: int, token: int) -> None:
        st.guard.cloud_token()
        self.services.metrics.hard_tokens.inc()
        st.record_tokens(position, [token], cloud=True)
        self._advanced(st, 1)

    def _advanced(self, st: SessionState, n: int, final: bool = False) -> None:
        """The session's answer grew by `n` positions: compare its routing with the fleet's band now and then."""
        st.routing.positions += n
        for alarm in self.services.watch.check(st.routing, final):
            self.services.metrics.routing_alarms.labels(alarm.signal, alarm.side).inc()
            log.warning("session %s (key %s): routing alarm: %s", st.session_id, st.key.name, alarm.describe())
            if st.audit is not None:
                st.audit.flagged = True  # kept, whatever the sample rate
                st.audit.alarms.append(alarm.describe())

    def _admit_explore(self, st: SessionState) -> None:
        """An exploration request, from its key's budget: over it, declined (`explore_limited`), nothing changed."""
        try:
            self.services.quotas.take_explore(st.key)
        except QuotaExceeded as exc:
            self.services.metrics.rejections.labels(exc.kind).inc()
            raise ProtocolError(ErrorCode.EXPLORE_LIMITED, exc.reason) from None
        self.services.metrics.explored.inc()

    def _cloud_span(self, st: SessionState, position: int, tokens: list[int]) -> None:
        """Account a span of tokens the cloud wrote from `position` (text mode's pieces)."""
        for i, token in enumerate(tokens):
            self._cloud_token(st, position + i, token)
        self.cloud_tokens += len(tokens)

    def _admit_hard_tokens(self, st: SessionState, n: int, carried: int = 0) -> None:
        """Quota and abuse checks before the cloud writes; refusals are `busy` errors naming the limit.

        `carried`: device tokens arriving with the request; the abuse check counts them, and a
        refusal counts them out again (the refused request leaves the session as it was)."""
        st.guard.device_tokens(carried)
        try:
            st.guard.check_hard_token()
            self.services.quotas.take_cloud_tokens(st.key, n)
        except QuotaExceeded as exc:
            st.guard.device_tokens(-carried)
            self.services.metrics.rejections.labels(exc.kind).inc()
            if exc.kind.startswith("abuse") and st.flag():  # once per session
                self.services.metrics.abuse_flags.inc()
                log.warning("session %s (key %s) flagged: %s", st.session_id, st.key.name, exc.reason)
            raise ProtocolError(ErrorCode.BUSY, exc.reason) from None

    async def _rollback(self, st: SessionState, msg: Rollback) -> None:
        n = len(self.engine.history(st.handle))
        if msg.position > n:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"rollback to {msg.position}, but the session holds {n} tokens")
        await self.worker.call(self.engine.rollback, st.handle, msg.position)
        st.record_rollback(msg.position)

    async def _generate(self, st: SessionState, msg: Generate) -> None:
        self._check_position(st, "generate", msg.position)
        self._check_tokens(msg.tokens)
        if msg.proposed >= self.caps.n_vocab:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"proposed must be -1 or within [0, {self.caps.n_vocab})", field="proposed"
            )
        self._check_max_tokens(msg.max_tokens)
        t_received = time.perf_counter()
        if msg.explore:
            self._admit_explore(st)
        # the first token: refused, it leaves the history as it was (the device may retry at msg.position)
        self._admit_hard_tokens(st, 1, carried=len(msg.tokens))
        self.engine.append(st.handle, msg.tokens)
        if self.caps.guess:
            self.engine.expect_guess(st.handle, msg.lookahead and msg.max_tokens == 1)
        try:
            with engine_errors():
                first = await self.worker.generate(st.handle, msg.proposed)
        except Exception:
            st.guard.device_tokens(-len(msg.tokens))
            if msg.tokens:
                await self.worker.call(self.engine.rollback, st.handle, msg.position)
            raise
        self._device_tokens(st, msg.position, msg.tokens, guarded=True)
        position = msg.position + len(msg.tokens)
        for i in range(msg.max_tokens):
            if i == 0:
                written = first
            else:  # a refusal from here on keeps the tokens already sent
                self._admit_hard_tokens(st, 1)
                with engine_errors():
                    written = await self.worker.generate(st.handle)
            token = written.token
            if i == 0:
                self._count_ask(st, msg.explore, disagreed=token != msg.proposed)
            self._cloud_token(st, position + i, token)
            eog = self.engine.is_eog(token)
            final = eog or i == msg.max_tokens - 1
            self.cloud_tokens += 1
            if i == 0 and self.recorder is not None and msg.hidden is not None:  # flywheel (opt-in)
                self.recorder.record(self.edge_model, msg.hidden, msg.proposed, token, position)
            await self._send_tokens(st, msg.request_id, position + i, written, final, eog)
            self.services.metrics.hard_token_time.observe(time.perf_counter() - t_received)
            t_received = time.perf_counter()
            if final:
                if msg.lookahead and not eog:
                    await self._send_next(st, msg.request_id, position + i + 1)
                return

    def _count_ask(self, st: SessionState, explore: bool, disagreed: bool) -> None:
        """A hard position served: one the router asked for, or an exploration (with its label)."""
        r = st.routing
        if explore:
            r.explored += 1
            r.disagreed += disagreed
        else:
            r.asked += 1

    async def _send_tokens(
        self, st: SessionState, request_id: int, position: int, w: GenerateResult, final: bool, eog: bool
    ) -> None:
        await self.send(
            Tokens(
                **self._reply_work(st),
                request_id=request_id,
                position=position,
                ids=[w.token],
                logprobs=[w.logprob],
                compute_ms=w.compute_s * 1000.0,
                final=final,
                eog=eog,
            )
        )

    async def _send_next(self, st: SessionState, request_id: int, position: int) -> None:
        """Lookahead: decode the token just written (the next sync's prefill would have) and
        announce the choice its logits give for `position`. The decode is reported as
        background prefill with the next reply. No guess (-1, which the device reads as none)
        when the engine cannot guess or the guess fails: the tokens are already sent."""
        g: Guess = NO_GUESS
        work = self._take_work(st)
        if self.caps.guess:
            try:
                self.prefill_ms += 1000.0 * await self.worker.prefill(st.handle)
                g = await self.worker.call(self.engine.guess, st.handle)
            except (EngineError, SamplingError) as exc:
                log.debug("session %s: no lookahead guess (%s)", st.session_id, exc)
            guess = self.engine.take_work(st.handle)  # the decode of the written token: the guess's work
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

    async def _verify(self, st: SessionState, msg: Verify) -> None:
        if not self.caps.verify:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"verify is not supported by this server's engine ({self.caps.name}); use generate",
            )
        self._check_position(st, "verify", msg.position)
        self._check_tokens(msg.tokens)
        if len(msg.tokens) > self.caps.max_verify_tokens:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"verify: at most {self.caps.max_verify_tokens} drafted tokens", field="tokens"
            )
        self._admit_hard_tokens(st, 1)
        with engine_errors():
            r = await self.worker.verify(st.handle, msg.tokens, msg.check, msg.bonus, msg.tolerance)
        self.cloud_tokens += int(r.token >= 0)
        judged = min(r.accepted + 1, len(msg.tokens))  # the kept drafts, and the one rejected (if any)
        flagged_judged = sum(1 for off in msg.check if off < judged)
        st.routing.checked += judged - flagged_judged
        st.routing.overruled += r.token >= 0 and r.accepted < len(msg.tokens) and r.accepted not in msg.check
        self._device_tokens(st, msg.position, msg.tokens[: r.accepted])
        if r.token >= 0:
            self._cloud_token(st, msg.position + r.accepted, r.token)
        if self.recorder is not None and msg.hidden is not None:  # flywheel (opt-in): the checked hard tokens
            rows = msg.hidden.reshape(len(msg.check), -1)
            for off, hidden in zip(msg.check, rows):
                if off > r.accepted:  # after the rejection: never written
                    break
                cloud = r.token if off == r.accepted else msg.tokens[off]  # at the rejection, the cloud's own token
                self.recorder.record(self.edge_model, hidden, msg.tokens[off], cloud, msg.position + off)
        await self.send(
            Verdict(
                **self._reply_work(st),
                request_id=msg.request_id,
                position=msg.position,
                accepted=r.accepted,
                token=r.token,
                logprob=r.logprob,
                compute_ms=r.compute_ms,
                eog=r.eog,
            )
        )

    # ---------------------------------------------------------------- text mode (protocol v3)

    def _check_bytes(self, text: TextSession, mtype: str, byte_position: int) -> None:
        if byte_position != len(text.text):
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"{mtype} at byte {byte_position}, but the session's answer holds {len(text.text)} bytes",
            )

    async def _text_sync(self, st: SessionState, text: TextSession, msg: TextSync) -> None:
        self._check_bytes(text, "text_sync", msg.byte_position)
        n = len(self.engine.history(st.handle))
        with engine_errors():
            added = await text.append(msg.text.encode())  # refused unkept when it cannot fit
        try:
            await self._prefill(st)
        except ProtocolError:  # refused: the answer as before (the device may resend), nothing kept
            with engine_errors():
                await text.rollback(msg.byte_position)
            raise
        self._device_tokens(st, n, added)

    async def _text_rollback(self, text: TextSession, msg: TextRollback) -> None:
        if msg.byte_position > len(text.text):
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"text_rollback to byte {msg.byte_position}, but the session's answer holds {len(text.text)} bytes",
            )
        if not on_char_boundary(text.text, msg.byte_position):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text_rollback: byte_position {msg.byte_position} falls inside a UTF-8 character of the answer; "
                "cut the answer between characters",
                field="byte_position",
            )
        with engine_errors():
            await text.rollback(msg.byte_position)

    async def _text_generate(self, st: SessionState, text: TextSession, msg: TextGenerate) -> None:
        """A hard position in text mode: the device's text, then the cloud's span (or stream)."""
        self._check_bytes(text, "text_generate", msg.byte_position)
        self._check_max_tokens(msg.max_tokens)
        if msg.explore:
            self._admit_explore(st)
        self._admit_hard_tokens(st, 1)
        n = len(self.engine.history(st.handle))
        with engine_errors():
            carried = await text.append(msg.text.encode())  # refused unkept when it cannot fit
        self._device_tokens(st, n, carried)
        sent = False

        async def emit(piece: SpanPiece) -> None:
            nonlocal sent
            if not sent:  # the label: the cloud's text goes another way than the device's token
                self._count_ask(st, msg.explore, disagreed=not piece.text.startswith(msg.proposed_text.encode()))
            self._cloud_span(st, len(self.engine.history(st.handle)) - len(piece.tokens), piece.tokens)
            await self.send(
                TextReply(
                    **self._reply_work(st),
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
                await text.span(
                    msg.proposed_text,
                    msg.max_tokens,
                    msg.at_word,
                    lambda: self._admit_hard_tokens(st, 1),
                    emit,
                    lookahead=msg.lookahead,
                )
        except Exception:
            # nothing sent: the request leaves the answer as it was (the device may retry there);
            # else the answer keeps what was sent, and the engine's history follows it again
            await text.rollback(len(text.text) if sent else msg.byte_position)
            raise

    async def _text_verify(self, st: SessionState, text: TextSession, msg: TextVerify) -> None:
        """The cloud's check in text mode: judge the drafted text, keep it up to the first
        rejected cloud token, then the cloud's span from there (cloud_server/text_session.py)."""
        if not self.caps.verify:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text_verify is not supported by this server's engine ({self.caps.name}); use text_generate",
            )
        self._check_bytes(text, "text_verify", msg.byte_position)
        self._check_max_tokens(msg.max_tokens)
        self._admit_hard_tokens(st, 1)
        flagged = list(zip(msg.check[::2], msg.check[1::2]))
        drafted = msg.text.encode()
        n0 = len(self.engine.history(st.handle))  # the shared text's tokens (the kept drafts' come after)
        sent = False

        async def emit(piece: SpanPiece, kept: int) -> None:
            nonlocal sent
            history = self.engine.history(st.handle)
            base = len(history) - len(piece.tokens)
            self._device_tokens(st, n0, history[min(n0, base) : base])  # the kept drafts, in cloud tokens
            self._cloud_span(st, base, piece.tokens)
            await self.send(
                TextVerdict(
                    **self._reply_work(st),
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
                await text.check(
                    drafted,
                    flagged,
                    msg.tolerance,
                    msg.eog,
                    msg.check_eog,
                    msg.max_tokens,
                    self.caps.max_verify_tokens,
                    lambda: self._admit_hard_tokens(st, 1),
                    emit,
                )
        except Exception:
            # nothing sent: the answer is as it was (the device's drafts stand); else as sent
            await text.rollback(len(text.text) if sent else msg.byte_position)
            raise

    async def demote(self) -> None:
        """The device reads nothing it asked for (a slow reader): its key's sessions are served after the
        others' for a while (cloud_server/engine.py, "short work first")."""
        if self.session is not None:
            try:
                await self.worker.call(self.engine.demote, self.session.key.name)
            except RuntimeError:  # the engine is shutting down: nothing left to share
                pass

    async def close(self) -> None:
        """End the session: its engine session and its key's session quota are released first, whatever
        happens after; then the observers (audit log, flywheel) each get their turn. An observer's
        failure is raised after all of them ran (the transport logs it, rate-limited), never before
        the release: a session that leaked would hold a slot until a restart."""
        st, self.session = self.session, None
        if st is not None:
            self._advanced(st, 0, final=True)  # the routing watch's last look (counts only: cannot fail)
        try:
            if st is not None:
                try:
                    await self.worker.call(self.engine.close, st.handle)
                finally:
                    self.services.quotas.close_session(st.key)
        finally:
            observers: list[Callable[[], object]] = []
            if st is not None and st.audit is not None:
                audit = st.audit
                extra = {"alarms": audit.alarms} if audit.alarms else None
                observers.append(lambda: self.services.audit.finish(audit, edge_model=self.edge_model, extra=extra))
            if self.recorder is not None:
                recorder = self.recorder
                observers.append(lambda: recorder.flush(self.edge_model))
            _run_all(observers)


def _run_all(calls: list[Callable[[], object]]) -> None:
    """Run every call even when one raises; the first failure is raised after the last call."""
    failure: BaseException | None = None
    for call in calls:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - raised below, once the others ran
            failure = failure or exc
    if failure is not None:
        raise failure
