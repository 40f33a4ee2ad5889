"""The learned router on the device: model binding, fallback, drift, generator wiring, flywheel.

Uses the shipped router for the default pair (models/routers/) and the real
edge model; the flywheel test runs the real cloud server on loopback with
--record-dir and a real WebSocket, then fits on what it recorded.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from cloud_server.local import LocalCloudServer
from edge_client.generator import build_router, open_generator
from edge_client.options import GeneratorOptions
from models.registry import DEFAULT_CLOUD_MODEL
from models.train.cli import DEFAULT_ROUTER
from models.train.fit import FitOptions, fit
from models.train.shards import load_records
from shared.learned_router import DriftMonitor, LearnedRouter, RouterFileError, RouterMismatchError, load_router
from shared.router import HeuristicRouter, RandomRouter
from tests.conftest import chat

pytestmark = pytest.mark.skipif(
    not DEFAULT_ROUTER.is_file(),
    reason="no shipped router; run `tokenrouter-train reproduce --out models/routers/<pair>.npz`",
)


def test_shipped_router_is_small_and_bound_to_the_default_pair(edge_info, cloud_info):
    assert DEFAULT_ROUTER.stat().st_size < 2_000_000
    router = load_router(DEFAULT_ROUTER, edge_info)
    assert isinstance(router, LearnedRouter)
    assert router.edge_fingerprint == edge_info.fingerprint
    assert router.cloud_fingerprint == cloud_info.fingerprint


def test_fingerprint_mismatch_is_refused_or_falls_back(cloud_info, caplog):
    # the cloud model stands in for "a different edge model": same tokenizer, other weights
    with pytest.raises(RouterMismatchError, match="retrain"):
        load_router(DEFAULT_ROUTER, cloud_info)
    with caplog.at_level(logging.WARNING):
        fallback = load_router(DEFAULT_ROUTER, cloud_info, on_mismatch="heuristic")
    assert isinstance(fallback, HeuristicRouter) and fallback.kind == "entropy"
    assert "falling back" in caplog.text
    assert isinstance(build_router(str(DEFAULT_ROUTER), 49152, cloud_info, "heuristic"), HeuristicRouter)
    with pytest.raises(RouterMismatchError):
        build_router(str(DEFAULT_ROUTER), 49152, cloud_info)
    with pytest.raises(ValueError, match="router_on_mismatch"):
        load_router(DEFAULT_ROUTER, cloud_info, on_mismatch="ignore")


def test_bad_router_files_get_clear_errors(tmp_path, edge_info):
    with pytest.raises(RouterFileError, match="does not exist"):
        load_router(tmp_path / "missing.npz", edge_info)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(RouterFileError, match="not a TokenRouter router file"):
        load_router(bad, edge_info)


def test_drift_monitor_psi():
    ref = np.array([10, 30, 40, 20], dtype=float)
    same, shifted = DriftMonitor(ref, min_count=10), DriftMonitor(ref, min_count=10)
    rng = np.random.default_rng(0)
    for s in rng.choice([0.1, 0.3, 0.6, 0.9], size=2000, p=ref / ref.sum()):
        same.observe(float(s))
    for _ in range(2000):
        shifted.observe(0.95)
    assert same.psi() < 0.02 and same.report()["status"] == "stable"
    assert shifted.psi() > 1.0 and shifted.report()["status"] == "drift"
    assert DriftMonitor(ref).report()["status"] == "insufficient"


def test_generator_uses_the_learned_router_and_reports_drift():
    opts = GeneratorOptions(cloud="none", policy="router", cloud_fraction=0.3, router=str(DEFAULT_ROUTER), max_tokens=8)
    with open_generator(opts) as gen:
        assert isinstance(gen.router, LearnedRouter)
        answer = gen.generate(chat("what is the capital of france"), max_tokens=8)
    assert answer.drift is not None and answer.drift["n_scores"] == answer.n_tokens
    assert {"psi", "status", "router"} <= set(answer.drift)
    assert all(s is not None and 0.0 <= s <= 1.0 for s in answer.scores)


def test_every_router_gives_a_calibration_prior_and_says_whether_it_reports_drift(edge_info):
    """The Router protocol's three methods, on each kind a generator can be given: the policy seeds its
    calibration from `threshold_for`, and each answer copies `drift_report` (learned routers only)."""
    rng = np.random.default_rng(0)
    heuristic = HeuristicRouter("entropy", 1000)
    random = RandomRouter(seed=1)
    learned = load_router(DEFAULT_ROUTER, edge_info)
    for router in (heuristic, random, learned):
        assert 0.0 <= router.threshold_for(0.3) <= 1.0 and router.threshold_for(0.1) >= router.threshold_for(0.5)
    scores = np.array([random.score(np.zeros(1), rng.standard_normal(1000), 0) for _ in range(4000)])
    assert abs(float(np.mean(scores >= random.threshold_for(0.3))) - 0.3) < 0.03  # uniform scores: exact prior
    assert heuristic.drift_report() is None and random.drift_report() is None
    assert learned.drift_report()["router"] == learned.name


def live_answers(record: Path, questions: list[str], max_tokens: int, **opts) -> list:
    """Answers to `questions` through a loopback cloud server whose flywheel records into `record`; the
    router policy, threshold 0 (every position sent up) and check off unless `opts` say otherwise."""
    with LocalCloudServer(
        model=DEFAULT_CLOUD_MODEL, extra_args=["--record-dir", str(record), "--threads", "1"]
    ) as server:
        o = {"policy": "router", "cloud_fraction": None, "threshold": 0.0, "check": "off"} | opts
        gen_opts = GeneratorOptions(cloud=server.url, api_key=server.api_key, max_tokens=max_tokens, **o)
        with open_generator(gen_opts) as gen:
            return [gen.generate(chat(q), max_tokens=max_tokens) for q in questions]


@pytest.mark.slow
@pytest.mark.parametrize("check", ["off", "all"])
def test_flywheel_records_live_hard_tokens_that_fit_accepts(tmp_path, edge_info, cloud_info, check):
    """Hard tokens reach the recorder with their hidden state from `generate` (check off) and
    from the cloud's check (`verify` carries the flagged drafts' hidden states)."""
    record = tmp_path / "live"
    answer, answer2 = live_answers(
        record, ["set a timer for ten minutes", "what is the capital of france"], 10, check=check
    )
    n_cloud = answer.n_cloud_tokens + answer2.n_cloud_tokens
    assert n_cloud > 0
    rec = load_records([record])
    assert len(rec) == n_cloud, "one live row per hard token"
    assert rec.meta["sources"] == ["flywheel"]
    assert (
        rec.meta["edge_fingerprint"] == edge_info.fingerprint
        and rec.meta["cloud_fingerprint"] == cloud_info.fingerprint
    )
    assert (
        rec["hidden"].shape == (n_cloud, 576) and np.isnan(rec["logit_feats"]).all() and (rec["divergent"] == -1).all()
    )
    assert (rec["explored"] == 0).all()  # every one sent up by the router, none explored
    cloud_tokens = [t for a in (answer, answer2) for t, r in zip(a.tokens, a.routes) if r == "cloud"]
    assert sorted(rec["cloud_token"].tolist()) == sorted(cloud_tokens)
    assert np.array_equal(rec["mismatch"].astype(bool), rec["proposed"] != rec["cloud_token"])
    # fit accepts live shards (here on their own: too few rows to hold any out)
    if 0 < rec["mismatch"].sum() < len(rec):
        report = fit(
            FitOptions(
                train=[str(record)],
                val=[str(record)],
                out=tmp_path / "live.npz",
                label="mismatch",
                epochs=2,
                hidden_units=8,
                buckets=16,
            )
        )
        assert load_router(tmp_path / "live.npz", edge_info).meta["edge_fingerprint"] == edge_info.fingerprint
        assert report["data"]["sources"] == ["flywheel"]


@pytest.mark.slow
def test_the_flywheel_flags_explored_positions_and_fit_reports_their_mismatch_apart(tmp_path, edge_info, cloud_info):
    """A router that keeps every position (threshold 1), with exploration always on and no lookahead guesses:
    each cloud token is an explored position, an unbiased label of where the device writes, and its row
    says so (`explored` 1), so `fit` can tell it from the router's own biased choices and reports its
    mismatch apart; shards without the column read as -1."""
    from models.train.shards import read_shard, write_shard

    record = tmp_path / "live"
    # every position then goes to the cloud by exploration alone
    answers = live_answers(
        record,
        ["set a timer for ten minutes", "who wrote hamlet"],
        12,
        threshold=1.0,
        explore=1.0,
        explore_per_minute=1000.0,
        lookahead=False,
    )
    n_cloud = sum(a.n_cloud_tokens for a in answers)
    assert all(a.explored_positions and a.n_cloud_tokens == len(a.explored_positions) for a in answers)
    rec = load_records([record])
    assert len(rec) == n_cloud >= 10 and (rec["explored"] == 1).all()
    report = fit(
        FitOptions(
            train=[str(record)], val=[str(record)], out=tmp_path / "r.npz", label="mismatch", epochs=1, hidden_units=8
        )
    )
    rates = report["data"]["val_rates"]
    assert rates["explored_rows"] == len(rec) and rates["explored_mismatch"] == pytest.approx(
        rec["mismatch"].mean(), abs=1e-4
    )
    old = read_shard(next(record.glob("*.npz")))  # a shard written before the column: the fill is -1
    del old.columns["explored"]
    np.savez_compressed(tmp_path / "old.npz", meta=np.array("{}"), **old.columns)
    assert (read_shard(tmp_path / "old.npz")["explored"] == -1).all()
    write_shard(tmp_path / "again.npz", read_shard(tmp_path / "old.npz"))
    assert (read_shard(tmp_path / "again.npz")["explored"] == -1).all()


def test_a_tier_router_reuses_the_pair_routers_logit_features(edge_info):
    """A pool's tier router scores after the pair's (Turn.flag): `score_after` reuses the features the
    first computed, and gives the score the tier router computes on its own; a heuristic first router
    has no features to share, so the tier router computes its own."""
    from edge_client.generator import shipped_router
    from shared.learned_router import score_after

    pair = load_router(str(shipped_router(edge_info.name, DEFAULT_CLOUD_MODEL)), edge_info)
    top = load_router(str(shipped_router(edge_info.name, "gemma3-270m")), edge_info)
    alone = load_router(str(shipped_router(edge_info.name, "gemma3-270m")), edge_info)
    assert isinstance(pair, LearnedRouter) and isinstance(top, LearnedRouter)
    rng = np.random.default_rng(0)
    entropy = HeuristicRouter("entropy", 49152)
    for _ in range(5):
        hidden = rng.normal(size=pair.n_embd).astype(np.float32)
        logits = (rng.normal(size=49152) * 3).astype(np.float32)
        proposed = int(logits.argmax())
        pair.score(hidden, logits, proposed)
        want = alone.score(hidden, logits, proposed)
        assert score_after(top, pair, hidden, logits, proposed) == pytest.approx(want, abs=1e-6)
        entropy.score(hidden, logits, proposed)
        assert score_after(top, entropy, hidden, logits, proposed) == pytest.approx(want, abs=1e-6)
    assert sum(top.drift.counts) == 2 * sum(alone.drift.counts) == 10  # every score reaches its drift monitor
