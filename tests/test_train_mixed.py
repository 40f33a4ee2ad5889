"""The learned router for a mixed pair (issue 19), with the real models: device SmolLM2-135M,
cloud Gemma-3-270M (different tokenizers).

label (text labels in the cloud's NLL of the text, models/train/text_label.py) -> shards of the
same shape as same-vocab ones -> fit unchanged -> a router file bound to both models (the
fingerprint guard refuses another cloud) -> the mixed pair's eval runs it next to entropy and
random.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.generator import build_router
from models.registry import DEFAULT_CLOUD_MODEL, model_info
from models.train.cli import DEFAULT_ROUTER, pair_router
from models.train.fit import FitOptions, fit
from models.train.label import LabelOptions, label
from models.train.person_check import person_counts
from models.train.shards import load_records
from models.train.text_eval import TextEvalOptions, TextSide, evaluate_text
from models.train.text_label import text_regret
from shared.learned_router import N_LOGIT_FEATURES, LearnedRouter, RouterMismatchError, load_router
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel
from shared.prompting import DEFAULT_SYSTEM_PROMPT
from shared.router import HeuristicRouter

EDGE, GEMMA = "smollm2-135m-q3_k_s", "gemma3-270m"
PROMPTS = ["what is the capital of france", "set a timer for ten minutes", "tell me a joke", "how do i reset my wifi"]
MAX_TOKENS = 20


def _chat(model: LlamaModel, prompt: str) -> list[int]:
    return model.chat_tokens(
        [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    )


@pytest.fixture(scope="module")
def mixed_labels(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed-labels")
    label(PROMPTS, LabelOptions(EDGE, GEMMA, out, max_tokens=MAX_TOKENS, prompts_per_shard=2, progress=False))
    return out


@pytest.fixture(scope="module")
def mixed_router(mixed_labels, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed-router") / "mixed.npz"
    fit(
        FitOptions(train=[str(mixed_labels)], out=out, label="regret", epochs=4, patience=4, hidden_units=8, buckets=32)
    )
    return out


def test_text_labels_have_the_same_shape_and_the_rule_holds(mixed_labels):
    rec = load_records([mixed_labels])
    edge, cloud = LlamaModel(model_info(EDGE)), LlamaModel(model_info(GEMMA))
    n = len(rec)
    assert rec.meta["label_space"] == "text" and rec.meta["cloud_model"] == GEMMA
    assert rec["hidden"].shape == (n, edge.n_embd) and rec["logit_feats"].shape == (n, N_LOGIT_FEATURES)
    assert 4 * 5 <= n <= 4 * (MAX_TOKENS + 1)
    assert np.isfinite(rec["hidden"].astype(np.float32)).all() and np.isfinite(rec["logit_feats"]).all()
    assert np.isfinite(rec["regret"]).all()
    assert (rec["mismatch"] == (rec["proposed"] != rec["cloud_token"])).all()
    assert (rec["regret"][rec["mismatch"] == 0] == 0).all() and (rec["divergent"] == -1).all()
    assert 0 < rec["mismatch"].mean() < 1

    # one position by hand: the cloud's summed NLL of whole texts, each teacher-forced on its own
    # canonical tokens in a fresh pass (text_eval's TextSide.nll, no shared reference, no branches)
    pid = rec["prompt_id"]
    first = np.flatnonzero(pid == pid[0])
    dev_ref = [int(t) for t in rec["cloud_token"][first]]  # the device's tokens of the cloud's text
    j = next(
        int(rec["position"][r])
        for r in first
        if rec["mismatch"][r]
        and not edge.is_eog(int(rec["proposed"][r]))
        and not edge.is_eog(int(rec["cloud_token"][r]))
    )
    row = first[j]
    e, c = int(rec["proposed"][row]), int(rec["cloud_token"][row])
    prefix = b"".join(edge.token_bytes(t) for t in dev_ref[:j])
    b_e, b_c = edge.token_bytes(e), edge.token_bytes(c)
    side = TextSide(cloud, 1024, 1, embeddings=False)
    try:
        side.start(_chat(cloud, rec.meta["prompts"][0]))
        s_t, s_e, s_c = side.nll(prefix), side.nll(prefix + b_e), side.nll(prefix + b_c)
    finally:
        side.close()
    want = (s_e - s_t) - (s_c - s_t) * len(b_e) / len(b_c)
    assert want == pytest.approx(text_regret(s_e - s_t, len(b_e), False, s_c - s_t, len(b_c), False))
    assert float(rec["regret"][row]) == pytest.approx(want, abs=0.05, rel=0.01)

    # the device side: the row's proposal is the device's greedy token after prompt + prefix
    ctx = LlamaContext(edge, n_ctx=512, threads=1)
    try:
        tokens = _chat(edge, rec.meta["prompts"][0]) + dev_ref[:j]
        out = ctx.decode_outputs(DecodeItem(0, 0, tokens), [len(tokens) - 1])[0]
        assert int(np.argmax(ctx.logits(out))) == e
    finally:
        ctx.close()
    edge.close()
    cloud.close()


def test_a_pool_tier_is_labelled_in_the_top_models_unit(tmp_path):
    """`label --judge`: the "8B" tier (Q4_1, the device's vocabulary) on Gemma's path, its token
    compared with the device's and both judged by Gemma. The compared token is the tier's own greedy
    token where it reads the device's tokens of Gemma's answer, and one mismatch's label is Gemma's
    text rule recomputed by hand in fresh passes."""
    from models.train.text_label import TextScorer
    from shared.text_history import AnswerText

    small = "smollm2-135m-q4_1"
    label(
        PROMPTS[:2],
        LabelOptions(EDGE, small, tmp_path, max_tokens=MAX_TOKENS, prompts_per_shard=2, progress=False, judge=GEMMA),
    )
    rec = load_records([tmp_path])
    assert rec.meta["cloud_model"] == small and rec.meta["judge_model"] == GEMMA
    assert rec.meta["judge_fingerprint"] == model_info(GEMMA).fingerprint and rec.meta["label_space"] == "text"
    assert (rec["mismatch"] == (rec["proposed"] != rec["cloud_token"])).all()
    assert (rec["regret"][rec["mismatch"] == 0] == 0).all() and 0 < rec["mismatch"].mean() < 1

    edge, tier, judge = (LlamaModel(model_info(m)) for m in (EDGE, small, GEMMA))
    scorer = TextScorer(judge, n_ctx=1024)
    try:
        prompt = rec.meta["prompts"][0]
        answer, _ = scorer.answer(_chat(judge, prompt), MAX_TOKENS + 8)
        path = AnswerText.for_model(edge).tokens(answer)  # Gemma's answer, as the device's tokens
        rows = np.flatnonzero(rec["prompt_id"] == rec["prompt_id"][0])
        row = next(
            r
            for r in rows
            if rec["mismatch"][r] and not any(edge.is_eog(int(rec[k][r])) for k in ("proposed", "cloud_token"))
        )
        j, e, c = int(rec["position"][row]), int(rec["proposed"][row]), int(rec["cloud_token"][row])
        ctx = LlamaContext(tier, n_ctx=512, threads=1)
        try:
            tokens = _chat(tier, prompt) + path[:j]
            out = ctx.decode_outputs(DecodeItem(0, 0, tokens), [len(tokens) - 1])[0]
            assert int(np.argmax(ctx.logits(out))) == c
        finally:
            ctx.close()
        prefix = b"".join(edge.token_bytes(t) for t in path[:j])
        b_e, b_c = edge.token_bytes(e), edge.token_bytes(c)
    finally:
        scorer.close()
    side = TextSide(judge, 1024, 1, embeddings=False)
    try:
        side.start(_chat(judge, prompt))
        s_t, s_e, s_c = side.nll(prefix), side.nll(prefix + b_e), side.nll(prefix + b_c)
    finally:
        side.close()
    want = text_regret(s_e - s_t, len(b_e), False, s_c - s_t, len(b_c), False)
    assert float(rec["regret"][row]) == pytest.approx(want, abs=0.05, rel=0.01)
    for m in (edge, tier, judge):
        m.close()
    with pytest.raises(ValueError, match="must share the device's vocabulary"):  # Gemma cannot read its tokens
        label(PROMPTS[:1], LabelOptions(EDGE, GEMMA, tmp_path / "refused", progress=False, judge=small))


def test_router_file_is_bound_to_both_models(mixed_router):
    edge_info, gemma, default_cloud = model_info(EDGE), model_info(GEMMA), model_info(DEFAULT_CLOUD_MODEL)
    router = load_router(mixed_router, edge_info, cloud=gemma)
    assert isinstance(router, LearnedRouter)
    assert router.cloud_fingerprint == gemma.fingerprint and router.edge_fingerprint == edge_info.fingerprint
    assert router.meta["label_space"] == "text"
    with pytest.raises(RouterMismatchError, match="cloud model"):
        load_router(mixed_router, edge_info, cloud=default_cloud)
    with pytest.raises(RouterMismatchError, match="cloud model"):
        load_router(mixed_router, edge_info, cloud=DEFAULT_CLOUD_MODEL)  # by name, as the generator passes it
    assert isinstance(load_router(mixed_router, edge_info, "heuristic", cloud=default_cloud), HeuristicRouter)
    assert isinstance(load_router(mixed_router, edge_info), LearnedRouter)  # no cloud named: not checked
    # same-vocab routers: unchanged for their own cloud, refused for another
    assert isinstance(load_router(DEFAULT_ROUTER, edge_info, cloud=default_cloud), LearnedRouter)
    with pytest.raises(RouterMismatchError):
        load_router(DEFAULT_ROUTER, edge_info, cloud=gemma)
    with pytest.raises(RouterMismatchError):
        build_router(str(mixed_router), 49152, edge_info, "error", DEFAULT_CLOUD_MODEL)
    assert isinstance(build_router(str(mixed_router), 49152, edge_info, "error", GEMMA), LearnedRouter)


def test_shipped_mixed_router_is_the_pairs_default():
    """`--router auto` (the default) with --cloud-model gemma3-270m loads the router shipped for
    the pair; the same-vocab default pair still gets its own."""
    edge_info = model_info(EDGE)
    shipped = pair_router(EDGE, GEMMA)
    assert shipped.is_file()
    router = build_router("auto", 49152, edge_info, "error", GEMMA)
    assert isinstance(router, LearnedRouter) and router.name == f"learned:{shipped.stem}"
    assert router.cloud_fingerprint == model_info(GEMMA).fingerprint
    default = build_router("auto", 49152, edge_info, "error", DEFAULT_CLOUD_MODEL)
    assert isinstance(default, LearnedRouter) and default.name == f"learned:{DEFAULT_ROUTER.stem}"


def test_mixed_eval_runs_the_learned_router(mixed_router):
    r = evaluate_text(
        PROMPTS[:2],
        TextEvalOptions(EDGE, GEMMA, fractions=(0.3,), max_tokens=12, router=mixed_router, keep_answers=True),
    )
    assert set(r["points"]) == {"edge-only", "cloud-only", "learned", "entropy", "random"}
    for method, points in r["points"].items():  # the person check counts the answers it lists
        (point,) = points
        listed = [(a["prompt"], a["text"]) for a in r["answers"] if a["method"] == method]
        assert len(listed) == 2 and all(text for _, text in listed)
        counts = person_counts(listed)
        assert {k: point[k] for k in counts} == counts
    assert (
        set(r["gap_recovered_at_30_bytes"])
        == set(r["gap_recovered_at_30_bytes_ci95"])
        == {
            "learned",
            "entropy",
            "random",
        }
    )
    assert all(0 < p["cloud_bytes"] <= 1 for p in r["points"]["learned"])
    # the work model: nothing for the device alone, the most for the cloud alone; the front holds the
    # cheapest point (the device alone) and no point it lists is beaten on both cost and quality
    cost = {m: ps[0]["gpu_s_per_1k_bytes"] for m, ps in r["points"].items()}
    assert cost["edge-only"] == 0 < cost["learned"] < cost["cloud-only"], cost
    front = r["pareto_front"]
    assert front[0]["method"] == "edge-only" and [p["gpu_s_per_1k_bytes"] for p in front] == sorted(
        p["gpu_s_per_1k_bytes"] for p in front
    )
    every = [(ps[0]["gpu_s_per_1k_bytes"], ps[0]["nll_per_byte"]) for ps in r["points"].values()]
    for p in front:
        c, q = p["gpu_s_per_1k_bytes"], p["nll_per_byte"]
        assert not any(c2 <= c and q2 <= q and (c2, q2) != (c, q) for c2, q2 in every)
    with pytest.raises(RouterMismatchError):
        evaluate_text(PROMPTS[:1], TextEvalOptions(EDGE, GEMMA, fractions=(0.3,), max_tokens=4, router=DEFAULT_ROUTER))
