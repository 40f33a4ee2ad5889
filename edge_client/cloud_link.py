"""The device's connection to the cloud: one WebSocket session, blocking calls.

The decoding loop is synchronous (llama.cpp is), so this uses the `websockets`
library's threading client: a `sync` is a send that returns at once, a request
sends and waits for its reply with a deadline. Any failure raises
CloudUnavailable and leaves the link closed; the generator then finishes on
the device and marks the answer degraded. A full server (`reject busy`) is
such a failure too (`CloudBusy`); other refusals are `CloudRejected`.

The link is the transport: hello and accept, request ids, deadlines, stale
replies, and the cloud's work that every reply reports (`stats`). What the
cloud holds of the answer, and the messages that change it, are the link's
`held` (edge_client/held_answer.py): the device's tokens (`HeldTokens`), or in
text mode (protocol v3, the accept's `mode` "text": the cloud's tokenizer
differs, or the device asked for it) the answer's text (`HeldText`).
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict
from typing import Callable, NoReturn

from websockets.exceptions import WebSocketException
from websockets.sync.client import ClientConnection, connect

from edge_client.answer import Traffic
from edge_client.held_answer import CloudText, CloudToken, HeldText, HeldTokens, ReplyT
from shared.model_info import ALLOW_BASE_MODEL_HINT, BASE_MODEL_NOTE, ModelInfo
from shared.protocol import (
    ALL_CAPABILITIES,
    PROTOCOL_VERSION,
    Accept,
    Close,
    Error,
    ErrorCode,
    Hello,
    Message,
    Next,
    ProtocolError,
    Reject,
    SamplingParams,
    TextReply,
    TextVerdict,
    Tokens,
    Verdict,
    Work,
    decode,
    encode,
)
from shared.text_history import AnswerText

# CloudText and CloudToken (what requests return) live in held_answer; callers import them from here too
__all__ = [
    "CloudBusy",
    "CloudDeclined",
    "CloudError",
    "CloudLink",
    "CloudRejected",
    "CloudText",
    "CloudTimeout",
    "CloudToken",
    "CloudUnavailable",
    "WakingConnection",
]


class CloudUnavailable(ConnectionError):
    """The cloud cannot be reached or stopped answering; finish on the device."""


class CloudTimeout(CloudUnavailable):
    """A hard token did not come back in time. The link stays open: the abandoned request
    was rolled back on the cloud, so the device can write the position itself and go on."""


class CloudBusy(CloudUnavailable):
    """The cloud is full (`reject busy`: every session slot, or the key's, is taken): like an unreachable
    cloud, not a configuration error, so the device answers alone and marks the answer degraded."""


class WakingConnection(ClientConnection):
    """websockets' threading client connection, whose `close_socket` also wakes a read blocked in TLS.

    Why: the library's reader thread waits in select(), then reads. Over TLS a readable socket may hold
    only a session ticket; the SSL read then blocks for application data, and closing the socket does
    not wake it. A TLS server that finished the handshake and then said nothing (stuck, overloaded, a
    middlebox) made `connect(open_timeout=2)` wait forever (plain ws:// gave up after 2 s), and so
    would `close()`. Every wait of the library's for that thread follows `close_socket`, so shutting
    the socket down there (the TCP socket itself, under TLS) bounds them all by their own timeouts."""

    def close_socket(self) -> None:
        try:
            socket.socket.shutdown(self.socket, socket.SHUT_RDWR)
        except OSError:  # already shut down, closed, or never connected
            pass
        super().close_socket()


class CloudRejected(ConnectionError):
    """The cloud refused the session (auth, vocabulary, version): `code` says why. A configuration
    error to report; a full server (`busy`) is `CloudBusy` instead."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"cloud rejected the session ({code}): {reason}")
        self.code = code
        self.reason = reason


class CloudError(RuntimeError):
    """The cloud answered a request with an error message."""

    def __init__(self, err: Error) -> None:
        super().__init__(f"cloud error {err.code}: {err.message}")
        self.code = err.code


class CloudDeclined(Exception):
    """The cloud declined an exploration request (its key's exploration budget is spent): it left the
    session as it was, and the link stays up. The device writes the position itself."""


class CloudLink:
    def __init__(self, url: str, api_key: str, timeout_s: float = 2.0, connect_timeout_s: float = 5.0) -> None:
        self.url = url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.stats = Traffic()  # this link's totals
        self.accept: Accept | None = None
        self.held: HeldTokens | HeldText = HeldTokens(self)  # what the cloud holds (its accept picks the mode)
        self.messages: list[dict] = []  # the chat the session was opened for (text mode renders it on each side)
        self._ws: ClientConnection | None = None
        self._next_request = 1
        self._max_bytes = 1 << 20
        self.consecutive_timeouts = 0

    @property
    def mode(self) -> str:
        """What the session shares (its accept, protocol v3): "tokens" or "text"."""
        return self.held.mode

    @property
    def tokens(self) -> HeldTokens:
        """The held tokens of a session that shares tokens (the token requests live there)."""
        assert isinstance(self.held, HeldTokens), "this session shares text, not tokens"
        return self.held

    @property
    def text(self) -> HeldText:
        """The held text of a text-mode session (the text requests live there)."""
        assert isinstance(self.held, HeldText), "this session shares tokens, not text"
        return self.held

    @property
    def connected(self) -> bool:
        return self._ws is not None

    @property
    def capabilities(self) -> list[str]:
        """What the server's engine can do (its accept; a v1 server: everything was assumed)."""
        if self.accept is None:
            return list(ALL_CAPABILITIES)
        return list(self.accept.capabilities)

    # ---------------------------------------------------------------- session

    def open(
        self,
        edge: ModelInfo,
        messages: list[dict],
        prompt: list[int],
        sampling: SamplingParams,
        text_mode: str,
        resume: bool = False,
        refuse_base_model: bool = False,
        answer_text: AnswerText | None = None,
        prompt_len: int | None = None,
    ) -> Accept:
        """hello -> accept; then make sure the cloud holds exactly `prompt`. `text_mode` (protocol
        v3, GeneratorOptions.text_mode): whether the device offers to share the answer as text
        ("auto": where the tokenizers differ; "always"; "never": a v2 device, tokens only). In a
        text session each side renders `messages` itself: the cloud holds no answer text yet.
        `resume`: this session rebuilds one lost mid-answer (a failover; `prompt` then holds the
        answer so far), which the server counts. `refuse_base_model` (GeneratorOptions.allow_base_model
        off): a cloud whose accept says its model is a base model is refused (CloudRejected `base_model`).
        `answer_text` and `prompt_len` (text mode): the device model's view of the answer's text, and
        where the answer starts in `prompt` (default: all of it is prompt)."""
        try:
            # entered as a context manager (websockets >= 17 asks for it); close_quietly exits it
            self._ws = connect(
                self.url,
                open_timeout=self.connect_timeout_s,
                close_timeout=self.connect_timeout_s,
                max_size=self._max_bytes + 4096,
                compression=None,
                create_connection=WakingConnection,
            ).__enter__()
        except (OSError, TimeoutError, WebSocketException) as exc:
            self._ws = None
            raise CloudUnavailable(f"cannot connect to {self.url}: {exc}") from exc
        hello = Hello(
            version=PROTOCOL_VERSION,
            api_key=self.api_key,
            edge_model=edge.fingerprint,
            tokenizer=edge.tokenizer_fingerprint,
            messages=messages,
            sampling=asdict(sampling),
            client="tokenrouter-edge",
            text_mode=text_mode,
            resume=resume,
        )
        self.send(hello)
        try:
            reply = self._recv(self.connect_timeout_s)
        except CloudTimeout:
            self.close_quietly()
            raise
        if isinstance(reply, Reject):
            self.close_quietly()
            if reply.code == ErrorCode.BUSY:
                raise CloudBusy(f"the cloud is full ({reply.reason}); the device answers alone")
            raise CloudRejected(reply.code, reply.reason)
        if not isinstance(reply, Accept):
            self.close_quietly()
            raise CloudUnavailable(f"cloud answered hello with {reply.type}")
        if refuse_base_model and reply.base_model:
            self.close_quietly()
            raise CloudRejected(
                "base_model",
                f"its model ({reply.cloud_model[:23]}) is a base model: {BASE_MODEL_NOTE}; {ALLOW_BASE_MODEL_HINT}",
            )
        self.accept = reply
        self._max_bytes = reply.max_message_bytes
        self.messages = messages
        if reply.mode == "text":
            self.held = HeldText(self, answer_text, len(prompt) if prompt_len is None else prompt_len)
            if len(prompt) > self.held.prompt_len:
                self.held.sync(prompt)  # a rebuilt session: the answer's text so far
        else:
            self.held = HeldTokens(self)
            self.held.start(prompt, reply)
        return reply

    def close(self, reason: str = "") -> None:
        if self._ws is not None:
            try:
                self.send(Close(reason=reason))
            except CloudUnavailable:
                pass
            self.close_quietly()

    def close_quietly(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.__exit__(None, None, None)
            except Exception:
                pass

    # ---------------------------------------------------------------- requests (for `held`'s messages)

    def new_request(self) -> int:
        request_id = self._next_request
        self._next_request += 1
        return request_id

    def reply(
        self,
        request_id: int,
        kind: type[ReplyT],
        undo: Callable[[], None],
        declined: Callable[[], None] | None = None,
    ) -> ReplyT:
        """The next `kind` reply to `request_id`; stale replies to abandoned requests are skipped.

        No reply within `timeout_s` abandons the request: `undo` rolls the cloud back to what
        the device holds (the cloud still finishes the request first), and CloudTimeout is raised.
        An exploration the cloud declines calls `declined` (it took nothing) and raises CloudDeclined."""
        while True:
            try:
                reply = self._recv(self.timeout_s)
            except CloudTimeout:
                self.consecutive_timeouts += 1
                undo()
                raise
            try:
                if self._stale_error(reply, request_id):
                    continue
            except CloudDeclined:
                if declined is not None:
                    declined()
                raise
            if isinstance(reply, kind) and reply.request_id == request_id:
                return reply

    def next_reply(self, timeout_s: float) -> Next | None:
        """The `next` message (a lookahead guess) of the last request, or None if it did not come within
        `timeout_s`. A guess that comes too late is skipped by later reads, like a stale reply."""
        request_id = self._next_request - 1
        deadline = time.perf_counter() + timeout_s
        while (left := deadline - time.perf_counter()) > 0:
            try:
                reply = self._recv(left)
            except CloudTimeout:
                return None
            if self._stale_error(reply, request_id):
                continue
            if isinstance(reply, Next) and reply.request_id == request_id:
                return reply
        return None

    def count_work(self, reply: Tokens | Verdict | TextReply | TextVerdict) -> None:
        self.stats.cloud_compute_ms += reply.compute_ms + reply.prefill_ms
        self.stats.background_ms += reply.prefill_ms

    def round_trip_done(self, t0: float) -> None:
        self.consecutive_timeouts = 0
        self.stats.round_trips += 1
        self.stats.wait_ms += (time.perf_counter() - t0) * 1000.0

    def stop_listening(self) -> None:
        """The device stopped reading a stream the cloud is still writing into: the session is closed."""
        self.close_quietly()
        self.stats.round_trips += 1

    def lost(self, why: str) -> NoReturn:
        """A reply that does not match its request: the session can no longer be trusted."""
        self.close_quietly()
        raise CloudUnavailable(why)

    # ---------------------------------------------------------------- framing

    def _stale_error(self, reply: Message, request_id: int) -> bool:
        """True for an `error` answering an earlier, abandoned request (skip it). An error for
        `request_id`, or for no request, closes the link and raises CloudError."""
        if not isinstance(reply, Error):
            return False
        if reply.request_id == request_id and reply.code == ErrorCode.EXPLORE_LIMITED:
            raise CloudDeclined(reply.message)
        if reply.request_id in (None, request_id):
            self.close_quietly()
            raise CloudError(reply)
        return True

    def send(self, msg: Message) -> None:
        if self._ws is None:
            raise CloudUnavailable("not connected")
        frame = encode(msg)
        try:
            self._ws.send(frame)
        except (OSError, WebSocketException) as exc:
            self.close_quietly()
            raise CloudUnavailable(f"connection lost while sending {msg.type}: {exc}") from exc
        self.stats.bytes_up += len(frame) if isinstance(frame, bytes) else len(frame.encode())

    def _recv(self, timeout_s: float) -> Message:
        if self._ws is None:
            raise CloudUnavailable("not connected")
        try:
            frame = self._ws.recv(timeout=timeout_s)
        except TimeoutError as exc:
            raise CloudTimeout(f"no answer from the cloud within {timeout_s:.1f} s") from exc
        except (OSError, WebSocketException) as exc:
            self.close_quietly()
            raise CloudUnavailable(f"connection lost: {exc}") from exc
        self.stats.bytes_down += len(frame) if isinstance(frame, bytes) else len(frame.encode())
        try:
            msg = decode(frame, self._max_bytes)
        except ProtocolError as exc:
            self.close_quietly()
            raise CloudUnavailable(f"cloud sent a bad frame: {exc}") from exc
        if isinstance(msg, Work):  # a reply's report of the cloud's work, stale replies' too: it was done
            self.stats.work.add(msg)
        return msg
