"""One device connection: the protocol state machine on the cloud side.

Independent of FastAPI: it takes decoded messages and a `send` coroutine, so
the rules (hello first, positions must match the history, limits) can be read
in one place. A rule broken raises ProtocolError; the transport turns that
into an `error` reply and keeps the connection.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from cloud_server.auth import KeyChecker
from cloud_server.config import ServerConfig
from cloud_server.audit import SessionAudit
from cloud_server.engine import EngineFull, EngineWorker
from cloud_server.flywheel import recorder_for
from cloud_server.quotas import KeyPolicy, QuotaExceeded, SessionGuard
from cloud_server.services import Services
from models.registry import ModelInfo
from shared.protocol import (
    PROTOCOL_VERSION,
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
    Tokens,
    Verdict,
    Verify,
    sampling_from_dict,
    token_hash,
)
from shared.sampling import NO_GUESS

log = logging.getLogger(__name__)


class ConnectionDone(Exception):
    """The connection should close (after a reject or a close)."""


class Connection:
    def __init__(
        self,
        worker: EngineWorker,
        config: ServerConfig,
        keys: KeyChecker,
        info: ModelInfo,
        send: Callable[[Message], Awaitable[None]],
        services: Services | None = None,
    ) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.config = config
        self.keys = keys
        self.info = info
        self.send = send
        self.seq: int | None = None
        self.session_id = ""
        self.n_errors = 0
        self.cloud_tokens = 0
        self.recorder = recorder_for(config.record_dir, info.name, info.fingerprint)  # None unless --record-dir
        self.prefill_ms = 0.0  # background prefill after hello/sync, reported with the next reply (prefill_ms)
        self.services = services or Services()
        self.key: KeyPolicy | None = None  # set by hello; holds a session of the key's quota
        self.guard: SessionGuard | None = None
        self.edge_model = ""
        self.audit: SessionAudit | None = None

    async def on_message(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            return await self._hello(msg)
        if self.seq is None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"first message must be hello, got {msg.type}")
        if isinstance(msg, Sync):
            return await self._sync(msg)
        if isinstance(msg, Generate):
            return await self._generate(msg)
        if isinstance(msg, Verify):
            return await self._verify(msg)
        if isinstance(msg, Rollback):
            return await self._rollback(msg)
        if isinstance(msg, Close):
            raise ConnectionDone(msg.reason)
        raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{msg.type} is not a device-to-cloud message")

    async def _reject(self, code: str, reason: str, kind: str | None = None) -> None:
        log.info("reject: %s (%s)", code, reason)
        self.services.metrics.rejections.labels(kind or code).inc()
        await self.send(Reject(code=code, reason=reason))
        raise ConnectionDone(reason)

    async def _hello(self, msg: Hello) -> None:
        if self.seq is not None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, "hello sent twice on one connection")
        if msg.version != PROTOCOL_VERSION:
            await self._reject(ErrorCode.VERSION_MISMATCH, f"protocol version {msg.version} not supported; this server speaks {PROTOCOL_VERSION}")
        key = self.keys.identify(msg.api_key)
        if key is None:
            await self._reject(ErrorCode.UNAUTHORIZED, "missing or wrong API key")
        if msg.tokenizer != self.info.tokenizer_fingerprint:
            await self._reject(
                ErrorCode.VOCAB_MISMATCH,
                f"device tokenizer {msg.tokenizer} differs from the cloud model's ({self.info.name}, "
                f"{self.info.tokenizer_fingerprint}); token routing needs one vocabulary: use an edge model "
                "built from the same tokenizer",
            )
        sampling = sampling_from_dict(msg.sampling)
        try:
            self.services.quotas.open_session(key)  # type: ignore[arg-type]
        except QuotaExceeded as exc:
            await self._reject(ErrorCode.BUSY, exc.reason, exc.kind)
        self.key = key
        self.edge_model = msg.edge_model
        prompt = await self.worker.call(self.engine.model.chat_tokens, msg.messages)
        try:
            self.seq = await self.worker.call(self.engine.open, prompt, sampling)
        except EngineFull as exc:
            await self._reject(ErrorCode.BUSY, f"{exc}; try again later", "capacity")
        self.session_id = f"s{self.seq}-{id(self):x}"
        self.guard = SessionGuard(key, self.services.abuse_warmup_tokens)  # type: ignore[arg-type]
        self.audit = self.services.audit.start(self.session_id, key.name, len(prompt))  # type: ignore[union-attr]
        await self.send(
            Accept(
                session_id=self.session_id,
                cloud_model=self.info.fingerprint,
                tokenizer=self.info.tokenizer_fingerprint,
                n_prompt=len(prompt),
                prompt_hash=token_hash(prompt),
                max_message_bytes=self.config.max_message_bytes,
            )
        )
        await self._prefill()

    def _check_position(self, mtype: str, position: int) -> None:
        n = len(self.engine.history(self.seq))  # type: ignore[arg-type]
        if position != n:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{mtype} at position {position}, but the session holds {n} tokens")

    def _check_tokens(self, tokens: list[int]) -> None:
        n_vocab = self.engine.model.n_vocab
        if any(t < 0 or t >= n_vocab for t in tokens):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"token ids must be within [0, {n_vocab})")

    async def _prefill(self) -> None:
        try:
            self.prefill_ms += 1000.0 * await self.worker.prefill(self.seq)  # type: ignore[arg-type]
        except EngineFull as exc:
            raise ProtocolError(ErrorCode.CONTEXT_FULL, str(exc)) from None

    async def _sync(self, msg: Sync) -> None:
        self._check_position("sync", msg.position)
        self._check_tokens(msg.tokens)
        self._device_tokens(msg.position, msg.tokens)
        self.engine.append(self.seq, msg.tokens)  # type: ignore[arg-type]
        await self._prefill()

    def _device_tokens(self, position: int, tokens: list[int]) -> None:
        """Account tokens the device wrote (abuse check, audit, metrics)."""
        if tokens:
            self.guard.device_tokens(len(tokens))  # type: ignore[union-attr]
            self.services.metrics.device_tokens.inc(len(tokens))
            if self.audit is not None:
                self.audit.tokens(position, tokens, cloud=False)

    def _cloud_token(self, position: int, token: int) -> None:
        self.guard.cloud_token()  # type: ignore[union-attr]
        self.services.metrics.hard_tokens.inc()
        if self.audit is not None:
            self.audit.tokens(position, [token], cloud=True)

    def _admit_hard_tokens(self, n: int) -> None:
        """Quota and abuse checks before the cloud writes; refusals are `busy` errors naming the limit."""
        try:
            self.guard.check_hard_token()  # type: ignore[union-attr]
            self.services.quotas.take_cloud_tokens(self.key, n)  # type: ignore[arg-type]
        except QuotaExceeded as exc:
            self.services.metrics.rejections.labels(exc.kind).inc()
            if exc.kind.startswith("abuse") and not (self.audit and self.audit.flagged):
                self.services.metrics.abuse_flags.inc()
                log.warning("session %s (key %s) flagged: %s", self.session_id, self.key.name if self.key else "-", exc.reason)
                if self.audit is not None:
                    self.audit.flagged = True
            raise ProtocolError(ErrorCode.BUSY, exc.reason) from None

    async def _rollback(self, msg: Rollback) -> None:
        n = len(self.engine.history(self.seq))  # type: ignore[arg-type]
        if msg.position > n:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"rollback to {msg.position}, but the session holds {n} tokens")
        await self.worker.call(self.engine.rollback, self.seq, msg.position)
        if self.audit is not None:
            self.audit.rollback(msg.position)

    async def _generate(self, msg: Generate) -> None:
        self._check_position("generate", msg.position)
        self._check_tokens(msg.tokens)
        if msg.max_tokens > self.config.max_tokens_per_request:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"max_tokens {msg.max_tokens} exceeds the server limit {self.config.max_tokens_per_request}")
        t_received = time.perf_counter()
        self._device_tokens(msg.position, msg.tokens)
        self.engine.append(self.seq, msg.tokens)  # type: ignore[arg-type]
        position = msg.position + len(msg.tokens)
        for i in range(msg.max_tokens):
            self._admit_hard_tokens(1)
            try:
                token, logprob, seconds = await self.worker.generate(self.seq)  # type: ignore[arg-type]
            except EngineFull as exc:
                raise ProtocolError(ErrorCode.CONTEXT_FULL, str(exc)) from None
            self._cloud_token(position + i, token)
            eog = self.engine.is_eog(token)
            final = eog or i == msg.max_tokens - 1
            self.cloud_tokens += 1
            if i == 0 and self.recorder is not None and msg.hidden is not None:  # flywheel (opt-in)
                self.recorder.record(self.edge_model, msg.hidden, msg.proposed, token, position)
            prefill_ms, self.prefill_ms = self.prefill_ms, 0.0
            await self.send(Tokens(request_id=msg.request_id, position=position + i, ids=[token], logprobs=[logprob], compute_ms=seconds * 1000.0, final=final, eog=eog, prefill_ms=prefill_ms))
            self.services.metrics.hard_token_time.observe(time.perf_counter() - t_received)
            t_received = time.perf_counter()
            if final:
                if msg.lookahead and not eog:
                    await self._send_next(msg.request_id, position + i + 1)
                return

    async def _send_next(self, request_id: int, position: int) -> None:
        """Lookahead: decode the token just written (the next sync's prefill would have) and
        announce the choice its logits give for `position`. The decode is reported as
        background prefill with the next reply; a full KV cache announces -1 rather than failing."""
        try:
            self.prefill_ms += 1000.0 * await self.worker.prefill(self.seq)  # type: ignore[arg-type]
            g = await self.worker.call(self.engine.peek_next, self.seq)
        except EngineFull:
            g = NO_GUESS
        await self.send(Next(request_id=request_id, position=position, token=g.token, logprob=g.logprob, top_ids=g.top_ids, top_logprobs=g.top_logprobs))

    async def _verify(self, msg: Verify) -> None:
        self._check_position("verify", msg.position)
        self._check_tokens(msg.tokens)
        if len(msg.tokens) >= self.engine.ctx.n_batch:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"verify: at most {self.engine.ctx.n_batch - 1} drafted tokens")
        self._admit_hard_tokens(1)
        try:
            r = await self.worker.call(self.engine.verify, self.seq, msg.tokens, msg.check, msg.bonus, msg.tolerance)
        except EngineFull as exc:
            raise ProtocolError(ErrorCode.CONTEXT_FULL, str(exc)) from None
        self.cloud_tokens += int(r.token >= 0)
        self._device_tokens(msg.position, msg.tokens[: r.accepted])
        if r.token >= 0:
            self._cloud_token(msg.position + r.accepted, r.token)
        if self.recorder is not None and msg.hidden is not None:  # flywheel (opt-in): the checked hard tokens, as for generate
            rows = msg.hidden.reshape(len(msg.check), -1)
            for off, hidden in zip(msg.check, rows):
                if off > r.accepted:  # after the rejection: never written
                    break
                cloud = r.token if off == r.accepted else msg.tokens[off]  # at the rejection, the cloud's own token
                self.recorder.record(self.edge_model, hidden, msg.tokens[off], cloud, msg.position + off)
        prefill_ms, self.prefill_ms = self.prefill_ms, 0.0
        await self.send(
            Verdict(request_id=msg.request_id, position=msg.position, accepted=r.accepted, token=r.token, logprob=r.logprob, compute_ms=r.compute_ms, eog=r.eog, prefill_ms=prefill_ms)
        )

    async def close(self) -> None:
        if self.recorder is not None:
            self.recorder.flush(self.edge_model)
        if self.key is not None:
            key, self.key = self.key, None
            self.services.quotas.close_session(key)
        if self.audit is not None:
            audit, self.audit = self.audit, None
            self.services.audit.finish(audit, edge_model=self.edge_model)
        if self.seq is not None:
            seq, self.seq = self.seq, None
            await self.worker.call(self.engine.close, seq)
