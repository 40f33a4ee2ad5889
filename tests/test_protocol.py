"""The wire format: every message survives a round trip; malformed frames name their problem."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol import (
    Accept,
    Close,
    Error,
    ErrorCode,
    Generate,
    Hello,
    Next,
    ProtocolError,
    Reject,
    Rollback,
    Sync,
    Tokens,
    decode,
    encode,
    sampling_from_dict,
)

MESSAGES = [
    Hello(
        version=1,
        api_key="k",
        edge_model="sha256:a",
        tokenizer="sha256:b",
        messages=[{"role": "user", "content": "hi"}],
        sampling={"temperature": 0.7},
    ),
    Accept(session_id="s1", cloud_model="sha256:c", tokenizer="sha256:b", n_prompt=12, prompt_hash="abcd"),
    Reject(code="unauthorized", reason="missing or wrong API key"),
    Sync(position=12, tokens=[1, 2, 3]),
    Generate(
        request_id=4,
        position=15,
        tokens=[7],
        proposed=9,
        max_tokens=1,
        hidden=np.linspace(-1, 1, 576, dtype=np.float32),
    ),
    Generate(request_id=5, position=16, tokens=[], max_tokens=64),
    Generate(request_id=6, position=16, tokens=[3], proposed=2, lookahead=True),
    Tokens(request_id=4, position=16, ids=[42], logprobs=[-0.25], compute_ms=3.5, final=True, eog=False),
    Next(request_id=4, position=17, token=77, logprob=-0.5),
    Rollback(position=10),
    Close(reason="bye"),
    Error(code="bad_frame", message="nope", request_id=None),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: f"{m.type}-{getattr(m, 'request_id', '')}")
def test_round_trip(msg):
    frame = encode(msg)
    back = decode(frame)
    assert type(back) is type(msg)
    for name in msg.__dataclass_fields__:
        a, b = getattr(msg, name), getattr(back, name)
        if isinstance(a, np.ndarray):
            assert b.dtype == np.float16 and np.allclose(a, b, atol=1e-3)
        else:
            assert a == b


def test_hidden_state_travels_as_binary_float16():
    msg = Generate(request_id=1, position=0, tokens=[1], hidden=np.ones(576, dtype=np.float32))
    frame = encode(msg)
    assert isinstance(frame, bytes)
    (n,) = struct.unpack(">I", frame[:4])
    assert len(frame) == 4 + n + 576 * 2  # header + 2 bytes per dimension
    assert isinstance(encode(Sync(position=0, tokens=[1])), str)  # no payload: a text frame


@pytest.mark.parametrize(
    "frame,code",
    [
        (b"\x00", ErrorCode.BAD_FRAME),
        (b"\x00\x00\x00\x05{}", ErrorCode.BAD_FRAME),
        ("[1, 2]", ErrorCode.BAD_FRAME),
        ('{"type": 3}', ErrorCode.BAD_FRAME),
        ('{"type": "nope"}', ErrorCode.UNKNOWN_TYPE),
        ('{"type": "sync", "position": 1}', ErrorCode.BAD_FIELD),
        ('{"type": "sync", "position": -1, "tokens": []}', ErrorCode.BAD_FIELD),
        ('{"type": "sync", "position": 1, "tokens": [true]}', ErrorCode.BAD_FIELD),
        ('{"type": "generate", "request_id": 1, "position": 0, "tokens": [], "max_tokens": 0}', ErrorCode.BAD_FIELD),
        ('{"type": "generate", "request_id": 1, "position": 0, "tokens": [], "lookahead": 1}', ErrorCode.BAD_FIELD),
        (
            '{"type": "next", "request_id": 1, "position": 3, "token": 5, "top_ids": [5, 6], "top_logprobs": [-0.1]}',
            ErrorCode.BAD_FIELD,
        ),
        ('{"type": "generate", "request_id": 1, "position": 0, "tokens": [], "hidden_dim": 4}', ErrorCode.BAD_FRAME),
        (
            '{"type": "hello", "version": 1, "api_key": "", "edge_model": "", "tokenizer": "", "messages": [{"role": 1}]}',
            ErrorCode.BAD_FIELD,
        ),
    ],
)
def test_malformed_frames_name_the_problem(frame, code):
    with pytest.raises(ProtocolError) as err:
        decode(frame)
    assert err.value.code == code and err.value.message


def test_size_limit():
    with pytest.raises(ProtocolError) as err:
        decode(json.dumps({"type": "sync", "position": 0, "tokens": [1] * 100}), max_bytes=64)
    assert err.value.code == ErrorCode.TOO_LARGE and "64-byte limit" in err.value.message


def test_sampling_validation():
    assert sampling_from_dict({"temperature": 0.5, "seed": 3}).seed == 3
    for bad in ({"temperature": -1}, {"top_p": 0}, {"color": "red"}, {"seed": "x"}):
        with pytest.raises(ProtocolError):
            sampling_from_dict(bad)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=256), st.text(max_size=256)))
def test_decode_never_crashes_on_garbage(frame):
    try:
        decode(frame)
    except ProtocolError as exc:
        assert exc.code in vars(ErrorCode).values()


# --------------------------------------------------------------------------- field ranges (issue 16)

GOOD_HELLO = {
    "type": "hello",
    "version": 1,
    "api_key": "k",
    "edge_model": "sha256:a",
    "tokenizer": "sha256:b",
    "messages": [{"role": "user", "content": "hi"}],
}


def _hello(**over) -> str:
    return json.dumps({**GOOD_HELLO, **over})


def _raw(frame: str, placeholder: str, literal: str) -> str:
    """Put a JSON literal json.dumps cannot write (1e400, NaN spelled by hand) in place of a string."""
    return frame.replace(json.dumps(placeholder), literal)


BAD_VALUES = [
    # strings: valid UTF-8 only (json.loads lets unpaired surrogates through), identifiers without control characters
    (_hello(api_key="\ud800"), "api_key"),
    (_hello(api_key="x" * 300), "api_key"),
    (_hello(tokenizer="\udc80"), "tokenizer"),
    (_hello(tokenizer="sha256:b\n2026-01-01 INFO forged line"), "tokenizer"),
    (_hello(edge_model="\ud800x"), "edge_model"),
    (_hello(client="a\x1bb"), "client"),
    (_hello(messages=[{"role": "user", "content": "a\udc80b"}]), "messages[0].content"),
    (_hello(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (_hello(messages=[{"role": "user", "content": "hi", "extra": 1}]), "messages[0]"),
    ('{"type": "close", "reason": "\\ud800"}', "reason"),
    ('{"type": "error", "code": "x", "message": "\\udfff"}', "message"),
    # sampling: temperature 0 or [1e-3, 10], top_p (0, 1], top_k [1, 2^20], seed uint32, all finite
    (_hello(sampling={"seed": -1}), "sampling.seed"),
    (_hello(sampling={"seed": 2**32}), "sampling.seed"),
    (_raw(_hello(sampling={"seed": "@"}), "@", "1e400"), "sampling.seed"),
    (_hello(sampling={"seed": 1.5}), "sampling.seed"),
    (_hello(sampling={"seed": True}), "sampling.seed"),
    (_raw(_hello(sampling={"top_k": "@"}), "@", "Infinity"), "sampling.top_k"),
    (_hello(sampling={"top_k": 0}), "sampling.top_k"),
    (_hello(sampling={"top_k": 2**21}), "sampling.top_k"),
    (_hello(sampling={"top_k": 4.0}), "sampling.top_k"),
    (_raw(_hello(sampling={"temperature": "@"}), "@", "NaN"), "sampling.temperature"),
    (_raw(_hello(sampling={"temperature": "@"}), "@", "-Infinity"), "sampling.temperature"),
    (_hello(sampling={"temperature": 1e-308}), "sampling.temperature"),
    (_hello(sampling={"temperature": -0.5}), "sampling.temperature"),
    (_hello(sampling={"temperature": 10.5}), "sampling.temperature"),
    (_hello(sampling={"temperature": "hot"}), "sampling.temperature"),
    (_hello(sampling={"top_p": 0}), "sampling.top_p"),
    (_raw(_hello(sampling={"top_p": "@"}), "@", "NaN"), "sampling.top_p"),
    (_hello(sampling={"color": "red"}), "sampling"),
    (_hello(sampling=[1]), "sampling"),
    # positions and token ids: non-negative int32, no bools, no floats
    ('{"type": "sync", "position": 1.0, "tokens": []}', "position"),
    ('{"type": "sync", "position": true, "tokens": []}', "position"),
    ('{"type": "sync", "position": 2147483648, "tokens": []}', "position"),
    ('{"type": "sync", "position": 3, "tokens": [1.0]}', "tokens"),
    ('{"type": "sync", "position": 3, "tokens": [-1]}', "tokens"),
    ('{"type": "sync", "position": 3, "tokens": [2147483648]}', "tokens"),
    ('{"type": "rollback", "position": "3"}', "position"),
    ('{"type": "generate", "request_id": -1, "position": 0, "tokens": []}', "request_id"),
    ('{"type": "generate", "request_id": 9007199254740993, "position": 0, "tokens": []}', "request_id"),
    ('{"type": "generate", "request_id": 1, "position": 0, "tokens": [], "max_tokens": 1.5}', "max_tokens"),
    ('{"type": "generate", "request_id": 1, "position": 0, "tokens": [], "proposed": -2}', "proposed"),
    ('{"type": "verify", "request_id": 1, "position": 0, "tokens": [1], "check": [0], "tolerance": NaN}', "tolerance"),
    (
        '{"type": "verify", "request_id": 1, "position": 0, "tokens": [1], "check": [0], "tolerance": 1e400}',
        "tolerance",
    ),
    ('{"type": "verify", "request_id": 1, "position": 0, "tokens": [1], "check": [0], "tolerance": -1}', "tolerance"),
    ('{"type": "verify", "request_id": 1, "position": 0, "tokens": [], "check": []}', "tokens"),
    ('{"type": "verify", "request_id": 1, "position": 0, "tokens": [1, 2], "check": [1, 0]}', "check"),
    ('{"type": "tokens", "request_id": 1, "position": 0, "ids": [1], "logprobs": [NaN], "compute_ms": 1}', "logprobs"),
]


@pytest.mark.parametrize("frame,name", BAD_VALUES, ids=[f"{i}-{n}" for i, (_, n) in enumerate(BAD_VALUES)])
def test_every_bad_value_is_a_bad_field_error_naming_the_field(frame, name):
    with pytest.raises(ProtocolError) as err:
        decode(frame)
    assert err.value.code == ErrorCode.BAD_FIELD, err.value
    assert err.value.field == name and f"field {name!r}" in err.value.message, err.value.message
    assert err.value.mtype == json.loads(frame)["type"]
    err.value.message.encode("utf-8")  # safe to send and to log


def test_a_non_finite_hidden_state_is_refused():
    frame = encode(Generate(request_id=1, position=0, tokens=[], hidden=np.array([1.0, np.nan, 2.0], dtype=np.float32)))
    with pytest.raises(ProtocolError) as err:
        decode(frame)
    assert err.value.code == ErrorCode.BAD_FIELD and err.value.field == "hidden"


def test_error_messages_never_echo_a_client_string():
    for frame in (
        _hello(api_key="SECRET-KEY\ud800"),
        _hello(api_key="SECRET-KEY" * 40),
        _hello(sampling={"SECRET-KEY\n": 1}),
    ):
        with pytest.raises(ProtocolError) as err:
            decode(frame)
        assert "\n" not in err.value.message and "\ud800" not in err.value.message
        assert "SECRET-KEY" not in err.value.message or "'SECRET-KEY\\n'" in err.value.message  # escaped, never raw


def test_sampling_range_edges_are_accepted():
    for ok in (
        {"temperature": 0},
        {"temperature": 1e-3},
        {"temperature": 10},
        {"top_p": 1},
        {"top_p": 1e-9},
        {"top_k": 1},
        {"top_k": 1 << 20},
        {"seed": 0},
        {"seed": 2**32 - 1},
    ):
        sampling_from_dict(ok)
        decode(_hello(sampling=ok))


def test_unparseable_numbers_are_bad_frames():
    with pytest.raises(ProtocolError) as err:
        decode('{"type": "sync", "position": ' + "9" * 5000 + ', "tokens": []}')  # over Python's int-digits limit
    assert err.value.code == ErrorCode.BAD_FRAME


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["\ud800", "a\udc80", "\n", "x" * 300]),
)
_value = st.recursive(
    _leaf,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)
_FIELDS = [
    "version",
    "api_key",
    "edge_model",
    "tokenizer",
    "messages",
    "sampling",
    "client",
    "position",
    "tokens",
    "request_id",
    "proposed",
    "max_tokens",
    "lookahead",
    "check",
    "bonus",
    "tolerance",
    "reason",
    "code",
    "message",
]


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(["hello", "sync", "generate", "verify", "rollback", "close", "error", "tokens", "next"]),
    st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=6),
)
def test_decode_of_typed_garbage_is_a_message_or_a_named_error(mtype, fields_):
    try:
        msg = decode(json.dumps({"type": mtype, **fields_}))
    except ProtocolError as exc:
        assert exc.code in (ErrorCode.BAD_FIELD, ErrorCode.BAD_FRAME) and exc.message
        if exc.code == ErrorCode.BAD_FIELD:
            assert exc.field and exc.mtype == mtype
        return
    frame = encode(msg)
    if isinstance(frame, str):
        frame.encode("utf-8")  # a decoded message re-encodes as valid UTF-8
