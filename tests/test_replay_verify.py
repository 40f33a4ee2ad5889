"""The verify message (router-verify, speculative): wire format, the engine's one-pass check, the real server."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_server.engine import CloudEngine
from edge_client.cloud_link import CloudError, CloudLink
from shared.decision import TIE_NATS
from shared.protocol import ErrorCode, ProtocolError, SamplingParams, Verdict, Verify, decode, encode
from tests.conftest import chat


def test_verify_round_trips_and_rejects_bad_offsets():
    msg = Verify(request_id=3, position=10, tokens=[5, 6, 7], check=[0, 2], bonus=True)
    assert decode(encode(msg)) == msg
    v = Verdict(request_id=3, position=10, accepted=2, token=9, logprob=-0.5, compute_ms=1.0)
    assert decode(encode(v)) == v
    for check in ([3], [2, 1], [1, 1], [-1]):
        with pytest.raises(ProtocolError) as err:
            decode(encode(Verify(request_id=1, position=0, tokens=[5, 6, 7], check=check)))
        assert err.value.code == ErrorCode.BAD_FIELD
    with pytest.raises(ProtocolError, match="must not be empty"):
        decode(encode(Verify(request_id=1, position=0, tokens=[], check=[])))
    lenient = Verify(request_id=4, position=10, tokens=[5, 6], check=[], tolerance=1.5)
    assert decode(encode(lenient)) == lenient
    rows = np.arange(6, dtype=np.float16)  # the hidden state at both check offsets, 3 wide
    carried = decode(
        encode(Verify(request_id=5, position=10, tokens=[5, 6, 7], check=[0, 2], tolerance=1.0, hidden=rows))
    )
    assert isinstance(carried, Verify) and np.array_equal(carried.hidden, rows) and carried.check == [0, 2]
    for bad_rows, check in ((np.arange(5, dtype=np.float16), [0, 2]), (rows, [])):
        with pytest.raises(ProtocolError, match="one equal row per check offset") as err:
            decode(encode(Verify(request_id=6, position=10, tokens=[5, 6, 7], check=check, hidden=bad_rows)))
        assert err.value.code == ErrorCode.BAD_FIELD
    for bad in ("-1", "NaN", "Infinity", '"1"'):
        with pytest.raises(ProtocolError, match="tolerance") as err:
            decode(
                '{"type": "verify", "request_id": 1, "position": 0, "tokens": [5], "check": [], "tolerance": %s}' % bad
            )
        assert err.value.code == ErrorCode.BAD_FIELD


@pytest.fixture(scope="module")
def engine(cloud_info):
    eng = CloudEngine(cloud_info, n_ctx=2048, max_sessions=4, threads=1)
    yield eng
    eng.close_all()


def _greedy(engine: CloudEngine, prompt: list[int], n: int) -> list[int]:
    seq = engine.open(prompt, SamplingParams())
    engine.prefill(seq)
    out = [engine.generate(seq)[0] for _ in range(n)]
    engine.close(seq)
    return out


@pytest.mark.kernel
def test_engine_verify_matches_generation(engine):
    prompt = engine.model.chat_tokens(chat("what is the capital of france"))
    ref = _greedy(engine, prompt, 16)

    # every draft right: all accepted, and the bonus is the cloud's next token
    seq = engine.open(prompt, SamplingParams())
    engine.prefill(seq)
    r = engine.verify(seq, ref[:10], list(range(10)), bonus=True)
    assert (r.accepted, r.token) == (10, ref[10]) and r.compute_ms > 0
    assert engine.history(seq)[len(prompt) :] == ref[:11]
    assert [engine.generate(seq)[0] for _ in range(5)] == ref[11:16]  # the KV cache is consistent
    engine.close(seq)

    # a wrong draft at offset 4: rolled back there, the cloud's token written in its place
    seq = engine.open(prompt, SamplingParams())
    draft = ref[:8]
    draft[4] = (draft[4] + 1) % engine.model.n_vocab
    r = engine.verify(seq, draft, [0, 4, 7])
    assert (r.accepted, r.token) == (4, ref[4])
    assert engine.history(seq)[len(prompt) :] == ref[:5]
    assert [engine.generate(seq)[0] for _ in range(3)] == ref[5:8]
    # an unchecked wrong token is taken as it is
    r = engine.verify(seq, [ref[8], 0], [0])
    assert r.accepted == 2 and r.token == -1
    assert engine.history(seq)[-2:] == [ref[8], 0]
    engine.close(seq)


@pytest.mark.kernel
def test_engine_verify_with_a_tolerance_rejects_only_drafts_too_unlikely_to_the_cloud(engine):
    """With a tolerance every drafted token is checked: one the cloud finds within `tolerance`
    nats of its own choice stands, one beyond it (and beyond a tie) is rolled back and the
    cloud's token written there; a flagged offset is still checked exactly."""
    prompt = engine.model.chat_tokens(chat("how do i say thank you in french"))
    ref = _greedy(engine, prompt, 8)
    seq = engine.open(prompt + ref[:3], SamplingParams())
    engine.prefill(seq)
    g = engine.guess(seq)  # the cloud's ranking at offset 3
    engine.close(seq)
    assert g.token == ref[3]
    # a draft beyond a tie (shared/decision.py: within TIE_NATS it would be the cloud's own choice)
    alt = next(i for i, lp in zip(g.top_ids[1:], g.top_logprobs[1:]) if g.logprob - lp > TIE_NATS + 0.05)
    regret = g.logprob - g.top_logprobs[g.top_ids.index(alt)]
    draft = ref[:3] + [alt]
    cases = [
        (regret + 0.02, [], (4, -1)),
        (regret - 0.02, [], (3, ref[3])),
        (regret + 0.02, [3], (3, ref[3])),
        (0.0, [], (4, -1)),
    ]
    for tolerance, check, expected in cases:
        seq = engine.open(prompt, SamplingParams())
        engine.prefill(seq)
        r = engine.verify(seq, draft, check, tolerance=tolerance)
        assert (r.accepted, r.token) == expected, (tolerance, check)
        assert engine.history(seq)[len(prompt) :] == draft[: r.accepted] + ([r.token] if r.token >= 0 else [])
        engine.close(seq)


def test_verify_over_the_wire(cloud_server, edge_info, cloud_info):
    from shared.llama_backend import LlamaModel

    edge = LlamaModel(edge_info)
    try:
        msgs = chat("set a timer for ten minutes")
        prompt = edge.chat_tokens(msgs)
        link = CloudLink(cloud_server.url, cloud_server.api_key, timeout_s=10.0)
        link.open(edge_info, msgs, prompt, SamplingParams(), "never")
        ref = [t.token for t in link.tokens.generate([], max_tokens=6)]
        link.tokens.rollback(len(prompt))
        v = link.tokens.verify(ref[:3] + [0], [0, 3], bonus=False)
        assert v.accepted == 3 and v.token == ref[3]
        assert link.held.covered == len(prompt) + 4 and link.stats.round_trips == 2 and link.stats.cloud_compute_ms > 0
        nxt = link.tokens.generate([], max_tokens=2)  # positions agree after the verdict
        assert [t.token for t in nxt] == ref[4:6]
        link.tokens.tokens.pop()  # the device is off by one: a verify at the wrong position is refused
        with pytest.raises(CloudError, match="out_of_order"):
            link.tokens.verify([1], [0])
    finally:
        edge.close()
