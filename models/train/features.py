"""From shard records to model inputs and targets.

The inputs are exactly what the device computes per token (shared/learned_router.py):
the edge hidden state, the LOGIT_FEATURES (by the same LogitFeaturizer) and
the hashed bucket of the proposed token.

Targets (`--label`):
    divergent  the divergence label; rows without one (live traffic
               from the flywheel, where no rollout is possible) use mismatch
    mismatch   edge argmax != cloud token
    regret     (default) mismatch with regret > --regret-nats (the cloud finds the edge's
               token that much less likely than its own)
    soft-regret  a soft target in [0, 1): 1 - exp(-regret / --regret-nats) on
               mismatches, 0 elsewhere; BCE's minimiser is then the expected
               saturated regret, so ranking by score ranks by what routing a
               position saves on the cloud-NLL measure
    gain       a signed soft target for a pool's tiers (a tier whose token can be worse than
               the device's, judged by the top model: `label --judge`): sigmoid(regret /
               --regret-nats) on mismatches, 1/2 where the tokens agree. Unweighted BCE's
               minimiser is its expectation, so 2·score - 1 is the expected saturated gain,
               tanh(regret / 2·nats), in (-1, 1): losses count against gains
               (`score_tiers` in shared/learned_router.py, what the `cost` engine reads)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.train.shards import Records
from shared.learned_router import token_bucket

LABELS = ("divergent", "mismatch", "regret", "soft-regret", "gain")


@dataclass(slots=True)
class Inputs:
    x: np.ndarray  # float32 [N, n_embd + F]: hidden state then logit features
    bucket: np.ndarray  # int64 [N]
    y: np.ndarray  # float32 [N] in {0, 1}


def targets(rec: Records, label: str, regret_nats: float = 1.0) -> np.ndarray:
    if label not in LABELS:
        raise ValueError(f"unknown label {label!r}; choose one of {', '.join(LABELS)}")
    mismatch = rec["mismatch"].astype(bool)
    if label == "mismatch":
        return mismatch.astype(np.float32)
    if label in ("regret", "soft-regret", "gain"):
        if np.isnan(rec["regret"][mismatch]).any():
            raise ValueError(f"--label {label} needs labelled shards (live-traffic shards carry no regret)")
        if label == "gain":
            signed = 1.0 / (1.0 + np.exp(-np.clip(rec["regret"] / regret_nats, -60, 60)))
            return np.where(mismatch, signed, 0.5).astype(np.float32)
        if label == "soft-regret":
            return np.where(mismatch, 1.0 - np.exp(-np.maximum(rec["regret"], 0.0) / regret_nats), 0.0).astype(
                np.float32
            )
        return (mismatch & (rec["regret"] > regret_nats)).astype(np.float32)
    div = rec["divergent"].astype(np.int64)
    return np.where(div < 0, mismatch, div > 0).astype(np.float32)


def fill_missing_features(feats: np.ndarray, means: np.ndarray) -> np.ndarray:
    """Live-traffic rows carry no logit features (the cloud never sees the edge's logits):
    they get the training means, so such rows teach the hidden-state and token parts only."""
    feats = feats.astype(np.float32, copy=True)
    bad = np.isnan(feats)
    if bad.any():
        feats[bad] = np.broadcast_to(means, feats.shape)[bad]
    return feats


def build_inputs(
    rec: Records, label: str, n_buckets: int, feature_means: np.ndarray | None = None, regret_nats: float = 1.0
) -> Inputs:
    feats = rec["logit_feats"]
    if feature_means is None:
        feature_means = (
            np.nanmean(feats, axis=0)
            if len(feats) and not np.isnan(feats).all()
            else np.zeros(feats.shape[1], np.float32)
        )
    feats = fill_missing_features(feats, np.nan_to_num(feature_means))
    x = np.concatenate([rec["hidden"].astype(np.float32), feats], axis=1)
    bucket = token_bucket(rec["proposed"], n_buckets).astype(np.int64)
    return Inputs(x, bucket, targets(rec, label, regret_nats))


def auc(scores: np.ndarray, y: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties averaged; NaN if one class is absent."""
    y = y.astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    s = scores[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def entropy_scores(rec: Records) -> np.ndarray:
    """shared.router.HeuristicRouter("entropy")'s score, H / ln(V), from the stored entropy.

    tests/test_train.py checks this equals the heuristic itself, so the entropy
    thresholds calibrated here are the heuristic's."""
    n_vocab = int(rec.meta.get("n_vocab", 0)) or 49152
    return np.minimum(rec["logit_feats"][:, 0].astype(np.float64) / np.log(max(n_vocab, 2)), 1.0)
