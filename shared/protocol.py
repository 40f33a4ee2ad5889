"""The TokenRouter wire protocol: typed messages and their WebSocket framing.

One module, imported by both the device and the cloud. docs/protocol.md is the
human-readable description; keep the two in step.

Framing: a message without a payload is a WebSocket *text* frame holding one
JSON object with a "type" field. A message with a payload (the hidden state of
a `generate`) is a *binary* frame:

    u32 big-endian header length N | N bytes of UTF-8 JSON header | payload bytes

Both sides hold the same token history. `position` in a message is the length
of that history before the message's tokens are appended, so either side can
detect a lost or reordered message at once. In text mode (protocol v3: the
models' tokenizers differ, or the device asks for it) the sides share the
answer's text instead and the `text_*` messages carry `byte_position`, the
answer's length in UTF-8 bytes before the message's text (shared/text_history.py).
"""

from __future__ import annotations

import json
import math
import struct
import types
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

import numpy as np

PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)  # a v1 device is served as before: it reads no capabilities and no work counters
# v3: text mode. The device offers it in `hello.text_mode`; `accept.mode` says what the session uses.
TEXT_MODES = ("never", "auto", "always")  # never: tokens only (a tokenizer mismatch is refused); auto: text where
# the tokenizers differ; always: text even for one tokenizer (the text path's lossless test)
HISTORY_MODES = ("tokens", "text")  # what the two sides share: token ids, or the answer's text
MAX_MESSAGE_BYTES = 1 << 20  # default limit for one frame, both directions
MAX_TOKENS_PER_MESSAGE = 8192
NEXT_TOP = 8  # how many of its most likely tokens the cloud lists in a `next` message

# What a server's engine can do, listed in `accept.capabilities` (protocol v2); the device asks for nothing else.
CAP_GENERATE = "generate"  # hard tokens (`generate`), always
CAP_GUESS = "guess"  # lookahead: a `next` carries the cloud's guess (else token -1)
CAP_VERIFY = "verify"  # `verify` (the device's check, draft-then-check policies)
ALL_CAPABILITIES = (CAP_GENERATE, CAP_GUESS, CAP_VERIFY)  # what a v1 server was assumed to do
MAX_CAPABILITIES = 16

# Ranges every decoded message is held to (docs/protocol.md, "Field ranges"): a value outside them
# is refused at the edge with bad_field, so it never reaches a session, the engine or a log line.
INT32_MAX = 2**31 - 1  # positions, token ids, counts: llama.cpp's int32
MAX_REQUEST_ID = 2**53  # integers JSON carries exactly everywhere
UINT32_MAX = 2**32 - 1  # sampling seed
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 10.0  # or exactly 0 (greedy); a tinier one overflows logits / T
MAX_TOP_K = 1 << 20
MAX_ID_CHARS = 256  # api_key, edge_model, tokenizer, client: short identifiers, no control characters
CHAT_ROLES = ("system", "user", "assistant")


class ErrorCode:
    """Machine-readable reasons carried by `error` and `reject`."""

    BAD_FRAME = "bad_frame"  # not JSON / not an object / broken binary framing
    TOO_LARGE = "too_large"  # frame over the size limit
    UNKNOWN_TYPE = "unknown_type"
    BAD_FIELD = "bad_field"  # a field is missing or has the wrong type or range
    OUT_OF_ORDER = "out_of_order"  # message not valid in this state, or position mismatch
    UNAUTHORIZED = "unauthorized"
    VERSION_MISMATCH = "version_mismatch"
    VOCAB_MISMATCH = "vocab_mismatch"
    CONTEXT_FULL = "context_full"
    BUSY = "busy"
    EXPLORE_LIMITED = "explore_limited"  # an exploration request over the key's budget: declined, the session goes on
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A message that cannot be accepted; `code` is one of ErrorCode.

    `field` names the offending field (bad_field) and `mtype` the message type when decode got
    that far, so the server can answer a broken `hello` with a reject instead of waiting."""

    def __init__(self, code: str, message: str, *, field: str | None = None, mtype: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.mtype = mtype


@dataclass(slots=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 40
    seed: int = 0


# --------------------------------------------------------------------------- the cloud's work

WORK_FIELDS = ("passes", "prefill_tokens", "generate_tokens", "verify_tokens", "guess_tokens", "engine_requests")


@dataclass(slots=True, kw_only=True)
class Work:
    """The cloud model's work, in units that carry over from this CPU to a GPU (docs/server.md, "what it costs").

    Why these units: a forward pass reads every weight once whatever the number of tokens in it, so
    for a memory-bound large model on a GPU a pass over k <= ~32 tokens costs about one decode step;
    wall-clock time on the development machine does not carry over. Replies (`tokens`, `next`,
    `verdict`, protocol v2) carry the work done since the previous reply, background prefill
    included; a zero field is left out of the frame. A pass is counted once per session that
    took part in it (a batch of several sessions is one pass for each)."""

    passes: int = 0  # forward passes that processed this session's tokens
    prefill_tokens: int = 0  # tokens processed in background after hello/sync (and remote warm-ups)
    generate_tokens: int = 0  # tokens processed on the way to a hard token (device tokens it carried, its own)
    verify_tokens: int = 0  # tokens processed to judge drafts (drafts and any history the engine re-read)
    guess_tokens: int = 0  # tokens processed to announce a lookahead guess
    engine_requests: int = 0  # requests to a remote engine (0 with the embedded engine)

    @property
    def tokens(self) -> int:
        """All tokens the cloud model processed."""
        return self.prefill_tokens + self.generate_tokens + self.verify_tokens + self.guess_tokens

    def work(self) -> Work:
        """The work fields alone (of a reply message, which is a Work too)."""
        return Work(**{f: getattr(self, f) for f in WORK_FIELDS})

    def add(self, other: Work) -> None:
        for f in WORK_FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def __add__(self, other: Work) -> Work:
        return Work(**{f: getattr(self, f) + getattr(other, f) for f in WORK_FIELDS})

    def __sub__(self, other: Work) -> Work:
        return Work(**{f: getattr(self, f) - getattr(other, f) for f in WORK_FIELDS})

    def to_json(self) -> dict[str, int]:
        """The work fields and their total (the `cloud_work` object of `ask --json`)."""
        return {"passes": self.passes, "tokens": self.tokens, **{f: getattr(self, f) for f in WORK_FIELDS[1:]}}


# --------------------------------------------------------------------------- messages


@dataclass(slots=True)
class Hello:
    """Device -> cloud, first message: who I am and what I am going to ask."""

    type: ClassVar[str] = "hello"
    version: int
    api_key: str
    edge_model: str  # model fingerprint of the device's model
    tokenizer: str  # tokenizer fingerprint: must equal the cloud's, unless the session is in text mode (v3)
    messages: list[dict]  # chat messages ({"role", "content"}) the answer continues
    sampling: dict = field(default_factory=dict)  # SamplingParams as a dict
    client: str = ""
    # v3: TEXT_MODES, whether the device can share the answer as text. Absent (a v2 device): never; a device
    # asks what its options say (GeneratorOptions.text_mode, the one default: "auto")
    text_mode: str = "never"
    # v3: this session rebuilds one the device lost mid-answer (its replica died or drained: a failover);
    # its prompt is then followed by the answer so far. Counted in metrics; an older server ignores it
    resume: bool = False


@dataclass(slots=True)
class Accept:
    """Cloud -> device: session open. n_prompt/prompt_hash let the device check templates agree."""

    type: ClassVar[str] = "accept"
    session_id: str
    cloud_model: str
    tokenizer: str
    n_prompt: int
    prompt_hash: str
    max_message_bytes: int = MAX_MESSAGE_BYTES
    version: int = PROTOCOL_VERSION
    # v2: what this server's engine can do (CAP_*); absent from a v1 server: ALL_CAPABILITIES assumed
    capabilities: list[str] = field(default_factory=lambda: list(ALL_CAPABILITIES))
    max_verify_tokens: int = 0  # drafts one verify may carry after the prompt (the KV cells allowing; 0: not said)
    mode: str = "tokens"  # v3: HISTORY_MODES; "text": the text_* messages, byte positions
    base_model: bool = False  # v3: the cloud's model has no chat template (it continues text; the device warns)


@dataclass(slots=True)
class Reject:
    """Cloud -> device in place of accept; the connection closes after it."""

    type: ClassVar[str] = "reject"
    code: str
    reason: str


@dataclass(slots=True)
class Sync:
    """Device -> cloud: tokens the device wrote, sent eagerly so the cloud prefills early. No reply."""

    type: ClassVar[str] = "sync"
    position: int
    tokens: list[int]


@dataclass(slots=True)
class Generate:
    """Device -> cloud: a hard position. Append `tokens`, then write up to max_tokens tokens.

    `hidden` (binary payload, float16) is the device model's final hidden state at
    the position; `proposed` is the token the device would have written there.
    With `lookahead` the cloud also sends, after its last token, a `next`
    message: its own choice for the following position (see Next).
    """

    type: ClassVar[str] = "generate"
    request_id: int
    position: int
    tokens: list[int]
    proposed: int = -1
    max_tokens: int = 1
    hidden: np.ndarray | None = None
    lookahead: bool = False
    # v3: the device's router kept this position; it is asked at random for an unbiased label (exploration).
    # Counted against the key's exploration budget: over it, `error(explore_limited)` and nothing changes.
    explore: bool = False


@dataclass(slots=True)
class Tokens(Work):
    """Cloud -> device: tokens written for a generate. Several may answer one request; the last has final=True."""

    type: ClassVar[str] = "tokens"
    request_id: int
    position: int  # where ids[0] goes in the history
    ids: list[int]
    logprobs: list[float]
    compute_ms: float  # cloud model time spent on this message's tokens (prefill + decode)
    final: bool = True
    eog: bool = False  # the last id ends the generation
    prefill_ms: float = 0.0  # background prefill (after sync) since the previous reply: cost, but not waited for


@dataclass(slots=True)
class Next(Work):
    """Cloud -> device, after the final `tokens` of a generate that asked for lookahead: the
    token the cloud would write at `position` (the one after its last), not yet in the history.

    Why: decoding its own last token, which the cloud must do anyway, yields this choice
    for free. If the device's token there differs, the device can take this one without
    another round trip; if the device then asks at `position` with no new tokens, the
    cloud writes exactly this token. -1: none (the answer ended, or the cloud could not).
    `top_ids`/`top_logprobs` are the cloud's most likely tokens there, most likely first,
    so the device can tell how much worse its own token is (its regret).
    """

    type: ClassVar[str] = "next"
    request_id: int
    position: int
    token: int
    logprob: float = 0.0
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Verify:
    """Device -> cloud: check drafted tokens in one round trip (router-verify, speculative decoding).

    `tokens` are the device's tokens since the end of the cloud's history
    (`position`). At each offset in `check` (ascending) the cloud compares its
    own choice with the drafted token; unchecked offsets are taken as they are.
    With `tolerance` > 0 every offset is also checked leniently: a drafted token
    the cloud finds more than `tolerance` nats less likely than its own most
    likely token is rejected (BiLD's rollback rule), one within it is kept.
    The cloud keeps the drafts up to the first rejected offset and writes its
    token there; with `bonus` and nothing rejected it also writes the next token.
    `hidden` (binary payload, float16, optional) holds the device's hidden state at
    each `check` offset, row after row: hard tokens travel with their hidden
    state, as in `generate` (the flywheel records them).
    """

    type: ClassVar[str] = "verify"
    request_id: int
    position: int
    tokens: list[int]
    check: list[int]
    bonus: bool = False
    tolerance: float = 0.0  # nats; 0: only the `check` offsets are checked
    hidden: np.ndarray | None = None  # len(check) rows of the hidden state, flattened


@dataclass(slots=True)
class Verdict(Work):
    """Cloud -> device, the answer to a verify: the cloud's history is now
    position + accepted drafted tokens, then `token` if it is >= 0."""

    type: ClassVar[str] = "verdict"
    request_id: int
    position: int  # the verify's position
    accepted: int  # drafted tokens kept (len(tokens) when none was rejected)
    token: int  # the cloud's token at offset `accepted` (-1: none written)
    logprob: float
    compute_ms: float
    eog: bool = False  # `token` ends the generation
    prefill_ms: float = 0.0  # background prefill since the previous reply, as in `tokens`


@dataclass(slots=True)
class Rollback:
    """Device -> cloud: truncate the history (and KV cache) to `position` tokens."""

    type: ClassVar[str] = "rollback"
    position: int


@dataclass(slots=True)
class TextSync:
    """Device -> cloud, text mode: answer text the device wrote, sent eagerly (no reply)."""

    type: ClassVar[str] = "text_sync"
    byte_position: int  # the answer's length in UTF-8 bytes before `text`
    text: str


@dataclass(slots=True)
class TextGenerate:
    """Device -> cloud, text mode: a hard position. Append `text`, then write a span of the
    cloud's own tokens (shared/text_history.py, `span_done`): at least one, up to `max_tokens`,
    stopping before a token that starts a new word when `at_word`. `proposed_text` is the text of
    the device's own token there ("": none): if it is one token of the cloud's, that token stands
    where it ties with the cloud's best (shared/decision.py). `hidden` as in `generate`."""

    type: ClassVar[str] = "text_generate"
    request_id: int
    byte_position: int
    text: str
    proposed_text: str = ""
    max_tokens: int = 4
    at_word: bool = True
    hidden: np.ndarray | None = None
    lookahead: bool = False  # list the cloud's most likely next pieces with the reply (its guess)
    explore: bool = False  # v3: exploration, as in `generate`


@dataclass(slots=True)
class TextReply(Work):
    """Cloud -> device, text mode: the text the cloud wrote for a text_generate (whole UTF-8
    characters). A stream (`at_word` false) may take several; the last has final=True."""

    type: ClassVar[str] = "text_reply"
    request_id: int
    byte_position: int  # where `text` goes in the answer
    text: str
    n_tokens: int  # the cloud's own tokens it wrote for this text
    logprob: float  # their summed log-probability
    compute_ms: float
    final: bool = True
    eog: bool = False  # the answer ends after `text`
    prefill_ms: float = 0.0
    # with `lookahead`, where the span stopped before a new word: the cloud's most likely next
    # pieces (text; "" = the end of the answer), most likely first, and their log-probabilities
    guess_texts: list[str] = field(default_factory=list)
    guess_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class TextRollback:
    """Device -> cloud, text mode: cut the answer to `byte_position` bytes (whole characters)."""

    type: ClassVar[str] = "text_rollback"
    byte_position: int


@dataclass(slots=True)
class TextVerify:
    """Device -> cloud, text mode: the cloud's check of a drafted clause (shared/text_history.py,
    "The cloud's check"). `text` is the drafted text (whole characters) after the `byte_position`
    bytes the cloud holds; `check` the byte ranges of it the device's router flagged, flattened
    [start0, end0, start1, end1, ...] (ascending, not overlapping); `check_eog`: the drafted end
    of the answer (`eog`) was flagged. The cloud judges its own tokens of the text: those over a
    flagged range exactly, the others within `tolerance` nats. `hidden` (binary payload, float16,
    optional): one row per flagged range, as in `verify`."""

    type: ClassVar[str] = "text_verify"
    request_id: int
    byte_position: int
    text: str
    check: list[int] = field(default_factory=list)
    tolerance: float = 0.0  # nats; 0: only the flagged ranges are judged
    eog: bool = False  # the device's draft ends the answer after `text`
    check_eog: bool = False
    max_tokens: int = 4  # the cap of the cloud's span after a rejection (as text_generate's)
    hidden: np.ndarray | None = None


@dataclass(slots=True)
class TextVerdict(Work):
    """Cloud -> device, text mode: the answer to a text_verify. The cloud's answer is now the
    first `byte_position + accepted_bytes` bytes, then `text` (its span after a rejection, whole
    characters; "" when all was kept), and ends there if `eog`."""

    type: ClassVar[str] = "text_verdict"
    request_id: int
    byte_position: int  # the text_verify's
    accepted_bytes: int  # drafted bytes kept (len(text) of the verify when none was rejected)
    text: str
    n_tokens: int  # the cloud's own tokens behind `text`
    logprob: float
    compute_ms: float  # the check's pass and the span
    eog: bool = False
    prefill_ms: float = 0.0


@dataclass(slots=True)
class Close:
    """Either side: the session ends; the cloud frees its KV cache."""

    type: ClassVar[str] = "close"
    reason: str = ""


@dataclass(slots=True)
class Error:
    """Either side: a message was refused. The session stays usable unless the sender closes it."""

    type: ClassVar[str] = "error"
    code: str
    message: str
    request_id: int | None = None


Message = Union[
    Hello,
    Accept,
    Reject,
    Sync,
    Generate,
    Tokens,
    Next,
    Verify,
    Verdict,
    Rollback,
    TextSync,
    TextGenerate,
    TextReply,
    TextRollback,
    TextVerify,
    TextVerdict,
    Close,
    Error,
]
MESSAGE_TYPES: dict[str, type] = {cls.type: cls for cls in get_args(Message)}  # every message, by its "type"
_HINTS = {cls: get_type_hints(cls) for cls in MESSAGE_TYPES.values()}

# --------------------------------------------------------------------------- encoding


def encode(msg: Message) -> str | bytes:
    """Message -> one WebSocket frame (str for a text frame, bytes for a binary one)."""
    header = {"type": msg.type}
    payload = b""
    for f in fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, np.ndarray):
            arr = np.ascontiguousarray(value, dtype="<f2")
            header[f"{f.name}_dim"] = int(arr.size)
            payload = arr.tobytes()
        elif f.name in _WORK and value == 0:
            continue  # the cloud's work (v2): a zero counter is left out
        elif value is not None or f.name != "hidden":
            header[f.name] = value
    text = json.dumps(header, separators=(",", ":"))
    if not payload:
        return text
    head = text.encode()
    return struct.pack(">I", len(head)) + head + payload


def decode(frame: str | bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """One WebSocket frame -> a validated message, or ProtocolError saying what is wrong.

    Every field is checked for type, range and finiteness here, at the edge: numbers are finite
    (JSON's NaN/Infinity extensions and overflowing literals such as 1e400 are refused), ints
    are ints (no bools, no floats) within their field's range, and strings are valid UTF-8
    (no unpaired surrogates, which json.loads lets through from \\udXXX escapes)."""
    size = len(frame) if isinstance(frame, bytes) else len(frame.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {size} bytes exceeds the {max_bytes}-byte limit")
    payload = b""
    if isinstance(frame, bytes):
        if len(frame) < 4:
            raise ProtocolError(ErrorCode.BAD_FRAME, "binary frame shorter than its 4-byte header length")
        (n,) = struct.unpack(">I", frame[:4])
        if n > len(frame) - 4:
            raise ProtocolError(
                ErrorCode.BAD_FRAME, f"binary frame declares a {n}-byte header but holds {len(frame) - 4}"
            )
        text, payload = frame[4 : 4 + n], frame[4 + n :]
    else:
        text = frame
    try:
        obj = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"message is not valid JSON ({exc})") from None
    except (ValueError, RecursionError) as exc:  # an int of more than 4300 digits, arrays nested thousands deep
        raise ProtocolError(ErrorCode.BAD_FRAME, f"message cannot be parsed ({type(exc).__name__})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError(ErrorCode.BAD_FRAME, 'message must be a JSON object with a string "type"')
    cls = MESSAGE_TYPES.get(obj["type"])
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {_shown(obj['type'])}")
    try:
        msg = _build(cls, obj, payload)
    except ProtocolError as exc:
        exc.mtype = cls.type
        raise
    return msg


def _build(cls: type, obj: dict, payload: bytes) -> Message:
    kwargs: dict[str, Any] = {}
    hints = _HINTS[cls]
    for f in fields(cls):
        if f.name == "hidden":
            kwargs["hidden"] = _decode_hidden(obj.get("hidden_dim"), payload)
            continue
        if f.name not in obj:
            if _has_default(f):
                continue
            raise _bad(cls.type, f.name, "is missing")
        kwargs[f.name] = _check(cls.type, f.name, obj[f.name], hints[f.name])
    if payload and "hidden" not in kwargs:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{cls.type} carries no binary payload")
    msg = cls(**kwargs)
    _check_ranges(msg)
    return msg


def _bad(mtype: str, name: str, what: str) -> ProtocolError:
    """A bad_field error naming the field; never echoes a string value (it may be a key or a prompt)."""
    return ProtocolError(ErrorCode.BAD_FIELD, f"{mtype}: field {name!r} {what}", field=name)


def _shown(value: str, limit: int = 32) -> str:
    """A client-supplied string made safe to quote in a reply or a log line: escaped, short."""
    return ascii(value[:limit]) + ("..." if len(value) > limit else "")


def _has_default(f: Any) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


def _decode_hidden(dim: Any, payload: bytes) -> np.ndarray | None:
    if dim is None and not payload:
        return None
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0 or dim * 2 != len(payload):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"hidden_dim does not match a {len(payload)}-byte float16 payload")
    hidden = np.frombuffer(payload, dtype="<f2")
    if not np.isfinite(hidden).all():
        raise ProtocolError(
            ErrorCode.BAD_FIELD, "field 'hidden' must hold finite numbers (no NaN or infinity)", field="hidden"
        )
    return hidden


# Inclusive ranges of int fields, by name, in every message type (token-id lists: _TOKEN_RANGE).
_INT_RANGES: dict[str, tuple[int, int]] = {
    "version": (0, INT32_MAX),
    "position": (0, INT32_MAX),
    "byte_position": (0, INT32_MAX),
    "n_tokens": (0, INT32_MAX),
    "request_id": (0, MAX_REQUEST_ID),
    "max_tokens": (1, INT32_MAX),
    "proposed": (-1, INT32_MAX),  # -1: none
    "token": (-1, INT32_MAX),  # -1: none
    "n_prompt": (0, INT32_MAX),
    "accepted": (0, INT32_MAX),
    "accepted_bytes": (0, INT32_MAX),
    "max_message_bytes": (0, INT32_MAX),
    "max_verify_tokens": (0, INT32_MAX),
    **{name: (0, INT32_MAX) for name in WORK_FIELDS},
}
_WORK = frozenset(WORK_FIELDS)
_TOKEN_RANGE = (0, INT32_MAX)  # each item of tokens, ids, top_ids, check
_FLOAT_MIN: dict[str, float] = {"tolerance": 0.0, "compute_ms": 0.0, "prefill_ms": 0.0}
_TEXT_LIST_FIELDS = frozenset({"guess_texts"})
_ID_FIELDS = frozenset({"api_key", "edge_model", "tokenizer", "client"})  # short identifiers: no control characters


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_text(value: Any) -> bool:
    """A str that is valid UTF-8: no unpaired surrogate (json.loads accepts "\\ud800")."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _has_control(value: str) -> bool:
    return any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value)


def _check(mtype: str, name: str, value: Any, hint: Any) -> Any:
    """Check `value` against a field's annotation (the few shapes messages use) and its range."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = get_origin(hint), get_args(hint)
    if hint is bool:
        if not isinstance(value, bool):
            raise _bad(mtype, name, "must be true or false")
    elif hint is int:
        lo, hi = _INT_RANGES.get(name, (-INT32_MAX - 1, INT32_MAX))
        if not _is_int(value) or not lo <= value <= hi:
            raise _bad(mtype, name, f"must be an integer within [{lo}, {hi}]")
    elif hint is float:
        if not _is_number(value):
            raise _bad(mtype, name, "must be a finite number")
        value = float(value)
        if name in _FLOAT_MIN and value < _FLOAT_MIN[name]:
            raise _bad(mtype, name, f"must be >= {_FLOAT_MIN[name]:g}")
    elif hint is str:
        if not _is_text(value):
            raise _bad(mtype, name, "must be a string of valid UTF-8 (no unpaired surrogates)")
        if name in _ID_FIELDS and (len(value) > MAX_ID_CHARS or _has_control(value)):
            raise _bad(mtype, name, f"must be at most {MAX_ID_CHARS} characters without control characters")
    elif hint is dict:
        if not isinstance(value, dict):
            raise _bad(mtype, name, "must be an object")
    elif origin is list:
        item = args[0]
        if not isinstance(value, list) or len(value) > MAX_TOKENS_PER_MESSAGE:
            raise _bad(mtype, name, f"must be a list of at most {MAX_TOKENS_PER_MESSAGE} items")
        if item is int:
            lo, hi = _TOKEN_RANGE
            if not all(_is_int(v) and lo <= v <= hi for v in value):
                raise _bad(mtype, name, f"must hold integers within [{lo}, {hi}]")
        elif item is float:
            if not all(_is_number(v) for v in value):
                raise _bad(mtype, name, "must hold finite numbers")
            value = [float(v) for v in value]
        elif item is dict:
            if not all(isinstance(v, dict) for v in value):
                raise _bad(mtype, name, "must hold objects")
        elif item is str and name in _TEXT_LIST_FIELDS:  # pieces of text: any whole characters
            if len(value) > NEXT_TOP or not all(_is_text(v) and len(v) <= MAX_ID_CHARS for v in value):
                raise _bad(mtype, name, f"must hold at most {NEXT_TOP} strings of at most {MAX_ID_CHARS} characters")
        elif item is str:  # capability names: short identifiers
            if len(value) > MAX_CAPABILITIES or not all(
                _is_text(v) and len(v) <= MAX_ID_CHARS and not _has_control(v) for v in value
            ):
                raise _bad(mtype, name, f"must hold at most {MAX_CAPABILITIES} names without control characters")
    else:  # pragma: no cover - a message field of a type this checker does not know
        raise TypeError(f"unchecked field type {hint!r}")
    return value


def _check_ranges(msg: Message) -> None:
    """Rules between fields, and the nested objects of a hello."""
    if isinstance(msg, Verify):
        n = len(msg.tokens)
        if not msg.tokens:
            raise _bad("verify", "tokens", "must not be empty")
        if any(not 0 <= c < n for c in msg.check) or any(a >= b for a, b in zip(msg.check, msg.check[1:])):
            raise _bad("verify", "check", f"must hold ascending, unique offsets within [0, {n})")
        if msg.hidden is not None and (not msg.check or msg.hidden.size == 0 or msg.hidden.size % len(msg.check)):
            raise _bad("verify", "hidden", f"must hold one equal row per check offset ({len(msg.check)})")
    if isinstance(msg, TextVerify):
        n, c = len(msg.text.encode("utf-8")), msg.check
        if not n and not msg.eog:
            raise _bad("text_verify", "text", "must not be empty unless eog")
        if len(c) % 2 or any(a > b for a, b in zip(c, c[1:])) or any(b > n for b in c):
            raise _bad("text_verify", "check", f"must hold ascending [start, end) byte ranges within [0, {n}]")
        if any(a >= b for a, b in zip(c[::2], c[1::2])):
            raise _bad("text_verify", "check", "must hold non-empty ranges")
        if msg.hidden is not None and (not c or msg.hidden.size == 0 or msg.hidden.size % (len(c) // 2)):
            raise _bad("text_verify", "hidden", f"must hold one equal row per flagged range ({len(c) // 2})")
    if isinstance(msg, TextReply) and len(msg.guess_texts) != len(msg.guess_logprobs):
        raise _bad("text_reply", "guess_logprobs", "must have as many items as guess_texts")
    if isinstance(msg, Next) and len(msg.top_ids) != len(msg.top_logprobs):
        raise _bad("next", "top_logprobs", "must have as many items as top_ids")
    if isinstance(msg, Tokens) and len(msg.ids) != len(msg.logprobs):
        raise _bad("tokens", "logprobs", "must have as many items as ids")
    if isinstance(msg, Hello) and msg.text_mode not in TEXT_MODES:
        raise _bad("hello", "text_mode", f"must be one of {', '.join(TEXT_MODES)}")
    if isinstance(msg, Accept) and msg.mode not in HISTORY_MODES:
        raise _bad("accept", "mode", f"must be one of {', '.join(HISTORY_MODES)}")
    if isinstance(msg, Hello):
        for i, m in enumerate(msg.messages):
            name = f"messages[{i}]"
            if set(m) != {"role", "content"}:
                raise _bad("hello", name, 'must be an object with exactly "role" and "content"')
            if m["role"] not in CHAT_ROLES:
                raise _bad("hello", f"{name}.role", f"must be one of {', '.join(CHAT_ROLES)}")
            if not _is_text(m["content"]):
                raise _bad("hello", f"{name}.content", "must be a string of valid UTF-8 (no unpaired surrogates)")
        sampling_from_dict(msg.sampling)


def sampling_from_dict(obj: dict) -> SamplingParams:
    """Validate the `sampling` object of a hello: types, ranges, finite values (docs/protocol.md).

    Why so strict: the engine divides logits by the temperature and seeds numpy with the seed,
    so a tiny temperature gives NaN probabilities and a negative or huge seed raises there."""
    base = asdict(SamplingParams())
    if not isinstance(obj, dict):
        raise _bad("hello", "sampling", "must be an object")
    unknown = set(obj) - set(base)
    if unknown:
        raise _bad(
            "hello", "sampling", f"has unknown fields {', '.join(sorted(_shown(str(k), 16) for k in unknown)[:4])}"
        )
    base.update(obj)
    t, p, k, seed = base["temperature"], base["top_p"], base["top_k"], base["seed"]
    if not _is_number(t) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        raise _bad(
            "hello",
            "sampling.temperature",
            f"must be 0 (greedy) or a number within [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
        )
    if not _is_number(p) or not 0 < p <= 1:
        raise _bad("hello", "sampling.top_p", "must be a number within (0, 1]")
    if not _is_int(k) or not 1 <= k <= MAX_TOP_K:
        raise _bad("hello", "sampling.top_k", f"must be an integer within [1, {MAX_TOP_K}]")
    if not _is_int(seed) or not 0 <= seed <= UINT32_MAX:
        raise _bad("hello", "sampling.seed", f"must be an integer within [0, {UINT32_MAX}]")
    return SamplingParams(temperature=float(t), top_p=float(p), top_k=int(k), seed=int(seed))


def token_hash(tokens: list[int]) -> str:
    """Short digest of a token sequence, to check both sides hold the same prompt."""
    import hashlib

    return hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()[:16]
