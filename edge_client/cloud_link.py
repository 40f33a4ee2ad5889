"""The device's connection to the cloud: one WebSocket session, blocking calls.

The decoding loop is synchronous (llama.cpp is), so this uses the `websockets`
library's threading client: `sync` is a send that returns at once, `generate`
sends and waits for the tokens with a deadline. Any failure raises
CloudUnavailable and leaves the link closed; the generator then finishes on
the device and marks the answer degraded. A full server (`reject busy`) is
such a failure too (`CloudBusy`); other refusals are `CloudRejected`.

The link also records the tokens the cloud holds (`held`, `cloud_len`), so the
device knows which tokens to send with the next message and how to bring a
session it reuses in line with a new turn (`resync`), what the server's engine
can do (`capabilities`, from its accept: protocol v2), and the cloud's work
that every reply reports (`stats`: passes, tokens per kind, engine requests).

In text mode (protocol v3, `mode` "text": the cloud's tokenizer differs, or the
device asked for it) the link holds the answer text the cloud holds
(`held_text`) instead, and speaks the `text_*` messages (docs/protocol.md).
"""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass
from typing import Callable, TypeVar

import numpy as np
from websockets.exceptions import WebSocketException
from websockets.sync.client import ClientConnection, connect

from edge_client.answer import Traffic
from shared.model_info import ALLOW_BASE_MODEL_HINT, BASE_MODEL_NOTE, ModelInfo
from shared.protocol import (
    ALL_CAPABILITIES,
    PROTOCOL_VERSION,
    Accept,
    Close,
    Error,
    ErrorCode,
    Generate,
    Hello,
    Message,
    Next,
    ProtocolError,
    Reject,
    Rollback,
    SamplingParams,
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
    decode,
    encode,
    token_hash,
)
from shared.sampling import Guess
from shared.sequences import common_prefix
from shared.text_history import TextGuess, valid_utf8

ReplyT = TypeVar("ReplyT", Tokens, Verdict, TextReply, TextVerdict)  # a reply that answers a request


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


class CloudLink:
    def __init__(self, url: str, api_key: str, timeout_s: float = 2.0, connect_timeout_s: float = 5.0) -> None:
        self.url = url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.stats = Traffic()  # this link's totals
        self.accept: Accept | None = None
        self.held: list[int] = []  # the tokens the cloud's history holds, as far as the device knows
        self.mode = "tokens"  # what the session shares (its accept, protocol v3): "tokens" or "text"
        self.held_text = bytearray()  # text mode: the answer text the cloud holds
        self.messages: list[dict] = []  # the chat the session was opened for (text mode renders it on each side)
        self._ws: ClientConnection | None = None
        self._next_request = 1
        self._max_bytes = 1 << 20
        self.consecutive_timeouts = 0

    @property
    def cloud_len(self) -> int:
        """How many tokens the cloud's history holds."""
        return len(self.held)

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
    ) -> Accept:
        """hello -> accept; then make sure the cloud holds exactly `prompt`. `text_mode` (protocol
        v3, GeneratorOptions.text_mode): whether the device offers to share the answer as text
        ("auto": where the tokenizers differ; "always"; "never": a v2 device, tokens only). In a
        text session each side renders `messages` itself: the cloud holds no answer text yet.
        `resume`: this session rebuilds one lost mid-answer (a failover; `prompt` then holds the
        answer so far), which the server counts. `refuse_base_model` (GeneratorOptions.allow_base_model
        off): a cloud whose accept says its model is a base model is refused (CloudRejected `base_model`)."""
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
        self._send(hello)
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
        self.mode = reply.mode
        if self.mode == "text":
            return reply
        if reply.n_prompt <= len(prompt) and reply.prompt_hash == token_hash(prompt[: reply.n_prompt]):
            self.held = list(prompt[: reply.n_prompt])
            self.sync(prompt[reply.n_prompt :])  # a rebuilt session: the answer so far
        else:  # the cloud rendered the chat differently: the device's tokens are the truth
            self.rollback(0)
            self.sync(prompt)
        return reply

    def close(self, reason: str = "") -> None:
        if self._ws is not None:
            try:
                self._send(Close(reason=reason))
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

    # ---------------------------------------------------------------- token traffic

    def sync(self, tokens: list[int]) -> None:
        """Append device-written tokens to the cloud's history (no reply)."""
        if tokens:
            self._send(Sync(position=self.cloud_len, tokens=list(tokens)))
            self.held.extend(tokens)

    def resync(self, history: list[int]) -> None:
        """Make the cloud hold `history` (a new turn of a conversation, a prefill ahead of
        time): roll back to the prefix it shares with what the cloud holds, then sync the rest."""
        keep = common_prefix(self.held, history)
        if keep < self.cloud_len:
            self.rollback(keep)
        self.sync(history[keep:])

    def rollback(self, position: int) -> None:
        self._send(Rollback(position=position))
        del self.held[position:]

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

        With max_tokens > 1 the cloud streams; `on_token` sees each token as it
        arrives and may return False to stop listening (the link then closes,
        since the cloud is still writing). With `lookahead` the cloud then sends
        its guess for the following position: read it with `next_guess`. `explore`: the device's
        engine kept this position (exploration); the cloud may decline it (CloudDeclined).
        """
        request_id = self._new_request()
        self._send(
            Generate(
                request_id=request_id,
                position=self.cloud_len,
                tokens=list(pending),
                proposed=proposed,
                max_tokens=max_tokens,
                hidden=None if hidden is None else hidden.astype(np.float16),
                lookahead=lookahead,
                explore=explore,
            )
        )
        self.held.extend(pending)
        t0 = time.perf_counter()
        out: list[CloudToken] = []
        while True:
            # a timeout abandons the request: the cloud finishes it, then this rollback undoes its tokens
            try:
                reply = self._reply(request_id, Tokens, undo=lambda: self.rollback(self.cloud_len))
            except CloudDeclined:
                del self.held[len(self.held) - len(pending) :]  # the cloud took nothing of it
                raise
            if reply.position != self.cloud_len:
                self.close_quietly()
                raise CloudUnavailable(f"cloud tokens at position {reply.position}, expected {self.cloud_len}")
            self._count_work(reply)
            for token, logprob in zip(reply.ids, reply.logprobs):
                tok = CloudToken(token, logprob, eog=reply.eog and token == reply.ids[-1])
                out.append(tok)
                self.held.append(token)
                if on_token is not None and on_token(tok) is False and not reply.final:
                    self.close_quietly()  # the cloud is still writing into this session
                    self.stats.round_trips += 1
                    return out
            if reply.final:
                break
        self._round_trip_done(t0)
        return out

    def next_guess(self, timeout_s: float) -> Guess | None:
        """The cloud's guess for the position after its last token (the `next` message of the
        last generate, sent with lookahead), or None if it did not come within `timeout_s` or
        the cloud had none. Only valid while the device has added nothing since that token.
        A guess that comes too late is skipped by later reads, like a stale reply."""
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
                if reply.token < 0 or reply.position != self.cloud_len:
                    return None
                return Guess(reply.token, reply.logprob, reply.top_ids, reply.top_logprobs)
        return None

    def verify(
        self,
        tokens: list[int],
        check: list[int],
        bonus: bool = False,
        tolerance: float = 0.0,
        hidden: np.ndarray | None = None,
    ) -> Verdict:
        """Send the tokens the cloud lacks and have it check the drafts at `check` offsets
        (exactly) and, with `tolerance` > 0, every draft (within that many nats).
        `hidden`: the hidden state at each `check` offset (rows), sent as float16.

        One round trip. Afterwards the cloud holds the accepted drafts plus the
        verdict's token (if any); `cloud_len` follows. The caller rolls its own
        history back to `cloud_len - (token >= 0)` and appends the token.
        """
        request_id = self._new_request()
        position = self.cloud_len
        self._send(
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
        reply = self._reply(request_id, Verdict, undo=lambda: self.rollback(self.cloud_len))
        if reply.position != position or not 0 <= reply.accepted <= len(tokens):
            self.close_quietly()
            raise CloudUnavailable(
                f"verdict for position {reply.position} accepting {reply.accepted} does not match the verify"
            )
        self.held.extend(tokens[: reply.accepted])
        if reply.token >= 0:
            self.held.append(reply.token)
        self._count_work(reply)
        self._round_trip_done(t0)
        return reply

    # ---------------------------------------------------------------- text mode (protocol v3)

    def text_sync(self, text: bytes) -> None:
        """Append answer text the device wrote (whole UTF-8 characters) to the cloud's (no reply)."""
        if text:
            self._send(TextSync(byte_position=len(self.held_text), text=text.decode("utf-8")))
            self.held_text += text

    def text_rollback(self, byte_position: int) -> None:
        self._send(TextRollback(byte_position=byte_position))
        del self.held_text[byte_position:]

    def text_generate(
        self,
        pending: bytes,
        proposed: bytes = b"",
        hidden: np.ndarray | None = None,
        max_tokens: int = 4,
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
        request_id = self._new_request()
        self._send(
            TextGenerate(
                request_id=request_id,
                byte_position=len(self.held_text),
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
        self.held_text += pending
        t0 = time.perf_counter()
        out = CloudText(b"", 0, 0.0, False)
        while True:
            # a timeout abandons it: the cloud finishes the span, then this rollback undoes its text
            try:
                reply = self._reply(request_id, TextReply, undo=lambda: self.text_rollback(len(self.held_text)))
            except CloudDeclined:
                del self.held_text[len(self.held_text) - len(pending) :]  # the cloud took nothing of it
                raise
            if reply.byte_position != len(self.held_text):
                self.close_quietly()
                raise CloudUnavailable(f"cloud text at byte {reply.byte_position}, expected {len(self.held_text)}")
            self._count_work(reply)
            piece = CloudText(reply.text.encode("utf-8"), reply.n_tokens, reply.logprob, reply.eog)
            self.held_text += piece.text
            guess = None
            if reply.guess_texts:
                guess = TextGuess([t.encode("utf-8") for t in reply.guess_texts], list(reply.guess_logprobs))
            out = CloudText(
                out.text + piece.text, out.n_tokens + piece.n_tokens, out.logprob + piece.logprob, piece.eog, guess
            )
            if on_text is not None and on_text(piece) is False and not reply.final:
                self.close_quietly()  # the cloud is still writing into this session
                self.stats.round_trips += 1
                return out
            if reply.final:
                break
        self._round_trip_done(t0)
        return out

    def text_verify(
        self,
        drafted: bytes,
        flagged: list[tuple[int, int]],
        tolerance: float,
        eog: bool = False,
        check_eog: bool = False,
        hidden: np.ndarray | None = None,
        max_tokens: int = 4,
    ) -> TextVerdict:
        """The cloud's check of `drafted` text (whole characters; the text the cloud lacks, the
        draft's included) with the router-`flagged` [start, end) byte ranges of it; `eog`: the
        draft ends the answer. One round trip. Afterwards the cloud holds the kept drafted bytes
        and the verdict's text (`held_text` follows)."""
        request_id = self._new_request()
        position = len(self.held_text)
        self._send(
            TextVerify(
                request_id=request_id,
                byte_position=position,
                text=drafted.decode("utf-8"),
                check=[b for r in flagged for b in r],
                tolerance=tolerance,
                eog=eog,
                check_eog=check_eog,
                max_tokens=max_tokens,
                hidden=None if hidden is None else np.asarray(hidden, dtype=np.float16).reshape(-1),
            )
        )
        t0 = time.perf_counter()
        # a timeout abandons it: the cloud finishes the check, then this rollback undoes what it kept
        reply = self._reply(request_id, TextVerdict, undo=lambda: self.text_rollback(position))
        if reply.byte_position != position or not 0 <= reply.accepted_bytes <= len(drafted):
            self.close_quietly()
            raise CloudUnavailable(
                f"text verdict at byte {reply.byte_position} keeping {reply.accepted_bytes} does not match the check"
            )
        self.held_text += drafted[: reply.accepted_bytes] + reply.text.encode("utf-8")
        self._count_work(reply)
        self._round_trip_done(t0)
        return reply

    # ---------------------------------------------------------------- requests

    def _new_request(self) -> int:
        request_id = self._next_request
        self._next_request += 1
        return request_id

    def _reply(self, request_id: int, kind: type[ReplyT], undo: Callable[[], None]) -> ReplyT:
        """The next `kind` reply to `request_id`; stale replies to abandoned requests are skipped.

        No reply within `timeout_s` abandons the request: `undo` rolls the cloud back to what
        the device holds (the cloud still finishes the request first), and CloudTimeout is raised."""
        while True:
            try:
                reply = self._recv(self.timeout_s)
            except CloudTimeout:
                self.consecutive_timeouts += 1
                undo()
                raise
            if self._stale_error(reply, request_id):
                continue
            if isinstance(reply, kind) and reply.request_id == request_id:
                return reply

    def _count_work(self, reply: Tokens | Verdict | TextReply | TextVerdict) -> None:
        self.stats.cloud_compute_ms += reply.compute_ms + reply.prefill_ms
        self.stats.background_ms += reply.prefill_ms

    def _round_trip_done(self, t0: float) -> None:
        self.consecutive_timeouts = 0
        self.stats.round_trips += 1
        self.stats.wait_ms += (time.perf_counter() - t0) * 1000.0

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

    def _send(self, msg: Message) -> None:
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
