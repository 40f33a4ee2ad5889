"""One device connection: the protocol state machine on the cloud side.

Independent of FastAPI: it takes decoded messages and a `send` coroutine, so
the rules (hello first, positions must match the history, limits) can be read
in one place. A rule broken raises ProtocolError; the transport turns that
into an `error` reply and keeps the connection.

This module is the session's life cycle: `hello` (accepted or rejected), the
dispatch of each message, `close`. What the device asks of the answer (sync,
generate, verify, rollback) goes to the session's `SharedAnswer`
(cloud_server/answer.py), picked once at hello: the answer as token ids
(cloud_server/token_answer.py) or, protocol v3 text mode, as text
(cloud_server/text_answer.py). Both count what they write through the
session's accounting (cloud_server/session_accounting.py: quotas, abuse
guard, metrics, audit, routing watch, flywheel, the work each reply reports).

The engine is reached only through the `Engine` and `Worker` protocols
(cloud_server/engine_api.py): what it cannot do (its `capabilities`) is
refused with a named error, and an engine's refusal (`EngineError`, a
`SamplingError`) becomes the error code it names; the session lives on.

Protocol v2: the `accept` lists the engine's capabilities (what the device may
ask for), and every reply carries the engine's work for this session since the
previous reply (forward passes, tokens per kind, remote requests: shared/protocol.py
`Work`), background prefill included. A v1 device is served as before.

Protocol v3, text mode: a device whose tokenizer differs from the model's (or
that asks for it: `hello.text_mode` "always") shares the answer as text; the
`text_*` messages carry byte positions. Token messages are refused in a text
session and text messages in a token session (`out_of_order`).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, NoReturn

from cloud_server.answer import SharedAnswer, Verb, verbs_of
from cloud_server.auth import KeyChecker
from cloud_server.client_work import off_loop
from cloud_server.config import ServerConfig
from cloud_server.engine_api import EngineFull, Owner, Worker
from cloud_server.flywheel import recorder_for
from cloud_server.quotas import KeyPolicy, QuotaExceeded
from cloud_server.services import Services
from cloud_server.session_accounting import SessionAccounting
from cloud_server.text_answer import TextAnswer
from cloud_server.token_answer import TokenAnswer
from shared.model_info import ModelInfo
from shared.protocol import (
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Accept,
    Close,
    ErrorCode,
    Hello,
    Message,
    ProtocolError,
    Reject,
    sampling_from_dict,
    token_hash,
)

log = logging.getLogger(__name__)

# the four verbs' messages of both modes: one of the other mode is refused by name
ANSWER_MESSAGES = TokenAnswer.messages + TextAnswer.messages


class ConnectionDone(Exception):
    """The connection should close (after a reject or a close)."""


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
        self.session: SessionAccounting | None = None  # set by an accepted hello
        self.answer: SharedAnswer | None = None  # the answer the session shares, in its mode (set at hello)
        self._verbs: dict[type[Message], Verb] = {}  # the answer's handler per message type
        self.n_errors = 0
        self.recorder = recorder_for(config, info)  # None unless --record-dir (built by create_app)
        self.services = services or Services()
        self.edge_model = ""
        self._resuming = False  # a `resume` hello, counted once the device's first request here is served

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
        if self.answer is None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"first message must be hello, got {msg.type}")
        verb = self._verbs.get(type(msg))
        if verb is not None:
            await verb(msg)
            if self._resuming:  # the device rebuilt its answer here: a session resumed
                self._resuming = False
                self.services.metrics.resumed.inc()
            return
        if isinstance(msg, ANSWER_MESSAGES):
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{msg.type} {self.answer.other_mode}")
        if isinstance(msg, Close):
            raise ConnectionDone(msg.reason)
        raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{msg.type} is not a device-to-cloud message")

    # ------------------------------------------------------------ hello: accept or reject

    async def _reject(self, code: str, reason: str, kind: str | None = None) -> NoReturn:
        log.info("reject: %s (%s)", code, reason)
        self.services.metrics.rejections.labels(kind or code).inc()
        await self.send(Reject(code=code, reason=reason))
        raise ConnectionDone(reason)

    async def _hello(self, msg: Hello) -> None:
        key, text_mode = await self._admit(msg)
        prompt, handle = await self._open(msg, key)
        session_id = f"s{handle}-{id(self):x}"
        self.edge_model = msg.edge_model
        acct = self.session = SessionAccounting(
            handle,
            session_id,
            key,
            self.services.audit.start(session_id, key.name, len(prompt), key.digest),
            self.services,
            self.worker,
            self.edge_model,
            self.recorder,
        )
        max_tokens = self.config.max_tokens_per_request
        answer: SharedAnswer = (
            TextAnswer(self.worker, self.caps, max_tokens, acct, self.send, len(prompt))
            if text_mode
            else TokenAnswer(self.worker, self.caps, max_tokens, acct, self.send)
        )
        self.answer, self._verbs = answer, verbs_of(answer)
        await self.send(
            Accept(
                session_id=session_id,
                cloud_model=self.info.fingerprint,
                tokenizer=self.info.tokenizer_fingerprint,
                n_prompt=len(prompt),
                prompt_hash=token_hash(prompt),
                max_message_bytes=self.config.max_message_bytes,
                version=min(msg.version, PROTOCOL_VERSION),
                capabilities=answer.capabilities(),
                max_verify_tokens=self.caps.verify_limit(len(prompt)),  # what fits after this prompt
                mode=answer.mode,
                base_model=not self.info.chat,
            )
        )
        # a failover: the device lost its replica mid-answer and rebuilds the session here; counted once it
        # asks something of it (a hello alone, closed at once, resumed nothing)
        self._resuming = msg.resume
        await acct.prefill()

    async def _admit(self, msg: Hello) -> tuple[KeyPolicy, bool]:
        """The hello's version, key and vocabulary, or a reject: (the key, whether the answer is shared as text)."""
        if msg.version not in SUPPORTED_VERSIONS:
            await self._reject(
                ErrorCode.VERSION_MISMATCH,
                f"protocol version {msg.version} not supported; this server speaks "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}",
            )
        key = self.keys.identify(msg.api_key)
        if key is None:
            await self._reject(ErrorCode.UNAUTHORIZED, "missing or wrong API key")
        if (too_long := self._price_prompt(msg.messages)) is not None:
            await self._reject(ErrorCode.BAD_FIELD, too_long, "prompt_too_long")
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
        return key, text_mode

    def _price_prompt(self, messages: list[dict]) -> str | None:
        """Why the hello's prompt is refused before it is read (`--max-prompt-messages`, `--max-prompt-bytes`),
        or None. The chat template and the tokenizer take time in proportion to both, and a prompt longer than
        that is no device's: one that fits the default 8192 KV cells is at most ~32 KiB of English."""
        limit = self.config.max_prompt_messages
        if len(messages) > limit:
            return f"hello: field 'messages' holds {len(messages)} messages; this server takes at most {limit}"
        limit = self.config.max_prompt_bytes
        n = sum(len(m["content"].encode()) + len(m["role"]) for m in messages)
        if n > limit:
            return f"hello: field 'messages' holds {n} bytes of text; this server takes at most {limit}: shorten the prompt"
        return None

    async def _open(self, msg: Hello, key: KeyPolicy) -> tuple[list[int], int]:
        """One of the key's sessions and an engine session for the hello's prompt, or a reject:
        (the prompt's tokens, the engine's handle). A failure releases the key's session."""
        sampling = sampling_from_dict(msg.sampling)
        try:
            self.services.quotas.open_session(key)
        except QuotaExceeded as exc:
            await self._reject(ErrorCode.BUSY, exc.reason, exc.kind)
        try:
            # the template and the tokenizer read only the vocabulary: off the event loop and the engine thread,
            # whose time is shared (the prompt's size was priced at `_admit`)
            prompt = await off_loop(self.engine.chat_tokens, msg.messages)
            handle = await self.worker.call(
                self.engine.open,
                prompt,
                sampling,
                Owner(key.name, key.kv_churn_per_minute, key.engine_seconds_per_minute),
            )
        except EngineFull as exc:
            self.services.quotas.close_session(key)
            await self._reject(ErrorCode.BUSY, f"{exc}; try again later", "capacity")
        except BaseException:
            self.services.quotas.close_session(key)
            raise
        return prompt, handle

    # ------------------------------------------------------------ the end

    async def demote(self) -> None:
        """The device reads nothing it asked for (a slow reader): its key's sessions are served after the
        others' for a while (cloud_server/fair_share.py, "short work first")."""
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
        st, self.session, self.answer, self._verbs = self.session, None, None, {}
        if st is not None:
            st.advanced(0, final=True)  # the routing watch's last look (counts only: cannot fail)
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
