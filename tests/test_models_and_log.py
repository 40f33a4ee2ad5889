"""Model registry and fingerprints, routing policies, and the compact routing log."""

from __future__ import annotations

import json

import pytest

from models.registry import DERIVED_SHA256, ModelNotFoundError, model_info, resolve_path, sha256_file
from shared import routing_log
from shared.gguf import GGUFError, read_header
from shared.llama_backend import LlamaModel
from shared.policy import PolicyConfig, RoutingPolicy, ScoreCalibrator, replay_decisions


def test_default_pair_shares_a_vocabulary_but_not_a_model(edge_info, cloud_info):
    assert edge_info.tokenizer_fingerprint == cloud_info.tokenizer_fingerprint
    assert edge_info.fingerprint != cloud_info.fingerprint
    assert edge_info.path.stat().st_size < cloud_info.path.stat().st_size  # lower-bit on the device


def test_derived_edge_model_is_reproducible(edge_info):
    assert sha256_file(edge_info.path) == DERIVED_SHA256


def test_gemma_has_another_vocabulary(cloud_info):
    gemma = model_info("gemma3-270m")
    assert gemma.tokenizer_fingerprint != cloud_info.tokenizer_fingerprint


def test_unknown_model_and_bad_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither a registered name"):
        resolve_path("no-such-model")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_header(bad)
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(resolve_path("smollm2-135m-q4_1").read_bytes()[:1000])
    with pytest.raises(GGUFError, match="truncated"):
        model_info(truncated)


def test_threshold_warmup_and_hysteresis_rules():
    scores = [0.9, 0.9, 0.2, 0.7, 0.45, 0.3, 0.8]
    assert replay_decisions(scores, 0.5) == [True, True, False, True, False, False, True]
    assert replay_decisions(scores, 0.5, warmup=2) == [False, False, False, True, False, False, True]
    # once routing, 0.45 >= 0.5 - 0.1 keeps routing; 0.3 does not
    assert replay_decisions(scores, 0.5, hysteresis=0.1) == [True, True, False, True, True, False, True]
    assert replay_decisions(scores, 0.0) == [True] * len(scores)
    assert replay_decisions([0.999], 1.0) == [False]


def test_calibrator_reaches_the_target_fraction():
    import numpy as np

    rng = np.random.default_rng(0)
    policy = RoutingPolicy(PolicyConfig("router", cloud_fraction=0.2))
    decisions = [policy.decide(float(s)) for s in rng.beta(2, 5, size=4000)]
    assert abs(np.mean(decisions[1000:]) - 0.2) < 0.03
    assert ScoreCalibrator(0.0).threshold > 1.0 and ScoreCalibrator(1.0).threshold == 0.0
    # tokens the cloud's check overrules take 12% of the answer: the router is calibrated to the rest
    policy.share_taken_elsewhere(0.12)
    decisions = [policy.decide(float(s)) for s in rng.beta(2, 5, size=4000)]
    assert abs(np.mean(decisions[1000:]) - 0.08) < 0.03
    policy.share_taken_elsewhere(0.5)  # more than the whole target: the router still flags a little
    assert policy.calibrator.target == 0.01
    fixed = RoutingPolicy(PolicyConfig("router", threshold=0.4))
    fixed.share_taken_elsewhere(0.1)
    assert fixed.threshold == 0.4


def test_a_cloud_share_of_zero_is_the_device_alone():
    """A router asked for 0 % cloud tokens sends nothing up at all (no check, no guess, no session): its
    policy is the device's. Any other share, or a fixed threshold, keeps the router."""
    assert RoutingPolicy(PolicyConfig("router", cloud_fraction=0.0)).mode == "edge"
    assert PolicyConfig("edge").device_alone and not PolicyConfig("cloud", cloud_fraction=0.0).device_alone
    assert RoutingPolicy(PolicyConfig("router", cloud_fraction=0.01)).mode == "router"
    assert RoutingPolicy(PolicyConfig("router", threshold=1.0)).mode == "router"


def test_routing_log_is_two_bytes_per_token_and_exports_jsonl():
    log = routing_log.RoutingLog(edge_model="sha256:e", cloud_model="sha256:c", start_position=30)
    log.append("edge", 0.1)
    log.append("cloud", 0.93)
    log.append("cloud", None)
    log.append("edge", 0.7, fallback=True)
    data = log.to_bytes()
    header = 4 + 10 + 1 + len("sha256:e") + 1 + len("sha256:c")
    assert len(data) == header + 2 * 4
    rows = [json.loads(line) for line in routing_log.to_jsonl(data).splitlines()]
    assert [r["position"] for r in rows] == [30, 31, 32, 33]
    assert [r["writer"] for r in rows] == ["edge", "cloud", "cloud", "edge"]
    assert rows[1]["model"] == "sha256:c" and abs(rows[1]["score"] - 0.93) <= 1 / 255
    assert rows[2]["score"] is None and rows[3]["fallback"] is True
    assert "token_id" not in rows[0]  # no content unless enabled
    with_ids = routing_log.RoutingLog(record_token_ids=True)
    with_ids.append("edge", 0.5, token_id=1234)
    assert next(routing_log.read(with_ids.to_bytes())).token_id == 1234
    with pytest.raises(ValueError, match="truncated"):
        list(routing_log.read(data[:-1]))


@pytest.mark.kernel
def test_context_greedy_matches_token_by_token_reference(cloud_info):
    """`LlamaContext.greedy` (used by the replay metrics and the scripts) equals a plain token-by-token
    greedy decode, and stops right after an end-of-generation token."""
    from shared.llama_backend import LlamaContext, LlamaModel
    from tests.conftest import QUESTIONS, chat
    from tests.helpers import reference_greedy

    model = LlamaModel(cloud_info)
    ctx = LlamaContext(model, n_ctx=1024, embeddings=False)
    try:
        steps = list(ctx.greedy(model.chat_tokens(chat(QUESTIONS[0])), 64))
        tokens = [t for _, t in steps]
        assert tokens == reference_greedy(cloud_info, chat(QUESTIONS[0]), 64)
        assert all(i == 0 for i, _ in steps[1:]), "after the prompt every step is a single-token decode"
        assert not any(model.is_eog(t) for t in tokens[:-1])
    finally:
        ctx.close()
        model.close()


def test_the_chat_template_renders_every_dialogue_and_both_prompt_kinds(edge_info):
    """The compiled template is kept per model and per kind of prompt: each render still follows its
    own messages, and a prompt without the generation tail is a prefix of the one with it."""
    m = LlamaModel(edge_info, vocab_only=True)
    try:
        a = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what time is it"}]
        b = [*a, {"role": "assistant", "content": "Noon."}, {"role": "user", "content": "and in Tokyo"}]
        with_tail, without = m.render_chat(a), m.render_chat(a, add_generation_prompt=False)
        assert with_tail.startswith(without) and with_tail.endswith("<|im_start|>assistant\n")
        assert "what time is it" in with_tail and "Tokyo" not in with_tail
        assert "Tokyo" in m.render_chat(b) and m.render_chat(a) == with_tail
        assert m.render_chat(b, add_generation_prompt=False).endswith("and in Tokyo<|im_end|>\n")
    finally:
        m.close()
