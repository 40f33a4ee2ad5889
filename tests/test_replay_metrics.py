"""Metric helpers of the replay harness: ROUGE-L, clause detection, per-policy summaries, NLL scoring."""

from __future__ import annotations

import pytest

from edge_client.replay.metrics import CloudScorer, first_clause_index, quality_gap_recovered, rouge_l, summarize
from edge_client.replay.policies import parse_policies
from edge_client.replay.sessions import SessionError, jsonl_sessions, load_sessions
from shared.llama_backend import LlamaModel


def test_rouge_l():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("a b c", "x y z") == 0.0
    # LCS "the cat the mat" = 4 of 6 candidate words and 4 of 5 reference words
    assert rouge_l("the cat sat on the mat", "the cat on mat") == pytest.approx(2 * (4 / 6) * 1.0 / ((4 / 6) + 1.0))
    assert rouge_l("", "") == 1.0 and rouge_l("a", "") == 0.0


def test_first_clause_index():
    assert first_clause_index(["Sure", ",", " I", " can", "."]) == 1
    assert first_clause_index([".", "Hi", " there", "!"]) == 3  # a leading mark does not end a clause
    assert first_clause_index(["no", " boundary"]) == 1


def _row(policy, emit, routes, compute_ms=0.0, nll=1.0):
    n = len(emit)
    return {
        "policy": policy,
        "tokens": list(range(n)),
        "routes": routes,
        "pieces": ["a"] * (n - 1) + ["."],
        "emit_ms": emit,
        "total_ms": emit[-1] + 1.0,
        "cloud_nll": nll,
        "rouge_l_vs_cloud": 0.5,
        "traffic": {
            "bytes_up": 100,
            "bytes_down": 50,
            "round_trips": 2,
            "cloud_compute_ms": compute_ms,
            "wait_ms": 10.0,
        },
    }


def test_summarize():
    s = summarize([_row("p", [100.0, 110.0, 130.0, 160.0], ["edge", "cloud", "edge", "edge"], compute_ms=8.0)])
    assert s["ttft_ms_p50"] == 100.0
    assert s["first_clause_ms_p50"] == 160.0
    assert s["per_token_ms_p50"] == 20.0
    assert s["cloud_fraction"] == 0.25
    assert s["cloud_compute_s_per_1k"] == pytest.approx(0.008 / 0.004)
    assert s["bytes_up_per_token"] == 25.0 and s["round_trips_per_answer"] == 2.0
    assert s["answered_within_150ms"] == 1.0
    assert quality_gap_recovered(2.0, 1.0, 1.2) == pytest.approx(0.8)
    assert quality_gap_recovered(1.0, 1.0, 1.0) is None


def test_parse_policies_errors():
    specs = parse_policies("edge,router-sync:nosync,router-verify")
    assert [s.name for s in specs] == ["edge", "router-sync:nosync", "router-verify"]
    assert not specs[1].eager_sync and specs[2].eager_sync
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        parse_policies("edge,fast")
    with pytest.raises(ValueError, match="suffix"):
        parse_policies("edge:nosync")
    with pytest.raises(ValueError, match="twice"):
        parse_policies("edge,edge")


def test_sessions(tmp_path):
    a = load_sessions("clinc150", "val", limit=3, seed=0)
    assert [s.id for s in a] == [s.id for s in load_sessions("clinc150", "val", limit=3, seed=0)]  # deterministic
    assert len(a) == 3 and a[0].turns[0].text
    f = tmp_path / "s.jsonl"
    f.write_text(
        '{"id": "x", "turns": ["hi", {"text": "switch to light mode"}]}\n{"turns": [{"wav": "a.wav"}], "light_mode": true}\n'
    )
    s = jsonl_sessions(f)
    assert s[0].wants_light_mode and s[1].light_mode and s[1].turns[0].wav == str(tmp_path / "a.wav")
    f.write_text('{"turns": []}\n')
    with pytest.raises(SessionError, match='non-empty "turns"'):
        jsonl_sessions(f)
    with pytest.raises(SessionError, match="unknown CLINC150 split"):
        load_sessions("clinc150", "dev")


def test_cloud_scorer_nll_matches_greedy_logprobs(cloud_info):
    """The scorer's NLL of the cloud's own greedy answer is small, and a shuffled answer scores worse."""
    model = LlamaModel(cloud_info)
    scorer = CloudScorer(model)
    try:
        msgs = [{"role": "user", "content": "what is the capital of france"}]
        answer = scorer.greedy(msgs, 16)
        good = scorer.nll_per_token(msgs, answer)
        bad = scorer.nll_per_token(msgs, answer[::-1])
        assert good is not None and bad is not None and 0.0 <= good < bad
        assert scorer.nll_per_token(msgs, []) is None
    finally:
        scorer.close()
        model.close()
