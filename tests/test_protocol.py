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
    Hello(version=1, api_key="k", edge_model="sha256:a", tokenizer="sha256:b", messages=[{"role": "user", "content": "hi"}], sampling={"temperature": 0.7}),
    Accept(session_id="s1", cloud_model="sha256:c", tokenizer="sha256:b", n_prompt=12, prompt_hash="abcd"),
    Reject(code="unauthorized", reason="missing or wrong API key"),
    Sync(position=12, tokens=[1, 2, 3]),
    Generate(request_id=4, position=15, tokens=[7], proposed=9, max_tokens=1, hidden=np.linspace(-1, 1, 576, dtype=np.float32)),
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
        ('{"type": "next", "request_id": 1, "position": 3, "token": 5, "top_ids": [5, 6], "top_logprobs": [-0.1]}', ErrorCode.BAD_FIELD),
        ('{"type": "generate", "request_id": 1, "position": 0, "tokens": [], "hidden_dim": 4}', ErrorCode.BAD_FRAME),
        ('{"type": "hello", "version": 1, "api_key": "", "edge_model": "", "tokenizer": "", "messages": [{"role": 1}]}', ErrorCode.BAD_FIELD),
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
