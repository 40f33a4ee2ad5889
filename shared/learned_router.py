"""The learned router on the device: numpy only, no torch at inference.

A router file (`.npz`, written by `tokenrouter-train fit`) holds a one-hidden-
layer MLP from [edge hidden state, logit features, hashed proposed-token
embedding] to P(hard), with the input standardisation folded into the first
layer and the token embedding pre-multiplied into a bucket table, so one score
costs one feature pass over the logits, one (H x D) mat-vec and a dot product.

The file is bound to the models it was trained for: if the edge model's
fingerprint differs, or the cloud model's where the caller names the cloud (a
mixed pair's router is labelled in its cloud model's NLL of the text), `load_router`
refuses (or, when asked, warns and falls back to the entropy heuristic). A drift monitor compares the running score
distribution with the one seen on the training validation set (PSI).

File layout (np.load with allow_pickle=False): arrays w1 [H, D], b1 [H],
tok_table [B, H], w2 [H], b2 [1], and `meta`, a JSON string holding
fingerprints, the feature spec, the calibration table, the metrics and the
reference score histogram.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# the logit features live beside the heuristics; re-exported here for the training code
from shared.router import LOGIT_FEATURES, N_LOGIT_FEATURES, HeuristicRouter, LogitFeaturizer, Router  # noqa: F401

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_HASH_MUL = 2654435761  # Knuth's multiplicative hash: spreads neighbouring token ids over buckets


class RouterFileError(ValueError):
    """A router file that cannot be used (missing, corrupt, wrong version)."""


class RouterMismatchError(RouterFileError):
    """The router was trained for a different edge (or cloud) model."""


def token_bucket(token: int | np.ndarray, n_buckets: int) -> Any:
    """Bucket of a token id for the hashed token embedding (works on arrays too)."""
    return ((np.asarray(token, dtype=np.uint64) * np.uint64(_HASH_MUL)) % np.uint64(1 << 32)) % np.uint64(n_buckets)


class DriftMonitor:
    """Population stability index of live router scores against the training scores.

    O(1) per score (one bin increment); PSI = sum (p - q) ln(p / q) over the bins,
    with both shares floored at 1e-4. Common reading: < 0.1 stable, 0.1-0.25
    moderate shift, > 0.25 the router no longer sees what it was trained on.
    """

    WARN, ALARM = 0.1, 0.25

    def __init__(self, reference_counts: np.ndarray, min_count: int = 50) -> None:
        ref = np.asarray(reference_counts, dtype=np.float64)
        if ref.ndim != 1 or ref.sum() <= 0:
            raise RouterFileError("the router file's reference score histogram is empty")
        self.n_bins = len(ref)
        self._ref = np.maximum(ref / ref.sum(), 1e-4)
        self.counts = [0] * self.n_bins  # a list: a per-token increment costs less than on an ndarray
        self.min_count = min_count

    def observe(self, score: float) -> None:
        self.counts[min(int(score * self.n_bins), self.n_bins - 1)] += 1

    def psi(self) -> float:
        n = sum(self.counts)
        if n == 0:
            return 0.0
        live = np.maximum(np.asarray(self.counts, dtype=np.float64) / n, 1e-4)
        return float(np.sum((live - self._ref) * np.log(live / self._ref)))

    def report(self) -> dict[str, Any]:
        n = sum(self.counts)
        psi = self.psi()
        if n < self.min_count:
            status = "insufficient"
        else:
            status = "drift" if psi > self.ALARM else ("shift" if psi > self.WARN else "stable")
        return {"psi": round(psi, 4), "n_scores": n, "status": status}


@dataclass(slots=True)
class RouterFile:
    """The arrays and metadata of a router file."""

    w1: np.ndarray
    b1: np.ndarray
    tok_table: np.ndarray
    w2: np.ndarray
    b2: float
    meta: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> "RouterFile":
        path = Path(path)
        if not path.is_file():
            raise RouterFileError(f"router file {path} does not exist; train one with `tokenrouter-train fit`")
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                arrays = {k: z[k].astype(np.float32) for k in ("w1", "b1", "tok_table", "w2", "b2")}
        except (OSError, KeyError, ValueError) as exc:
            raise RouterFileError(f"{path} is not a TokenRouter router file ({exc})") from None
        if meta.get("format_version") != FORMAT_VERSION:
            raise RouterFileError(
                f"{path} has router format {meta.get('format_version')}; this build reads {FORMAT_VERSION}: retrain it"
            )
        if tuple(meta.get("logit_features", ())) != LOGIT_FEATURES:
            raise RouterFileError(
                f"{path} was trained on logit features {meta.get('logit_features')}; this build computes {list(LOGIT_FEATURES)}"
            )
        return cls(arrays["w1"], arrays["b1"], arrays["tok_table"], arrays["w2"], float(arrays["b2"][0]), meta)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(
            tmp,
            w1=self.w1.astype(np.float32),
            b1=self.b1.astype(np.float32),
            tok_table=self.tok_table.astype(np.float32),
            w2=self.w2.astype(np.float32),
            b2=np.array([self.b2], dtype=np.float32),
            meta=np.array(json.dumps(self.meta)),
        )
        tmp.replace(path)


class LearnedRouter:
    """Router protocol implementation over a router file. Not thread-safe (reused buffers)."""

    def __init__(self, rf: RouterFile, name: str = "learned") -> None:
        self.file = rf
        self.meta = rf.meta
        self.name = name
        self.n_embd = int(rf.meta["n_embd"])
        self.n_buckets = rf.tok_table.shape[0]
        if rf.w1.shape[1] != self.n_embd + N_LOGIT_FEATURES:
            raise RouterFileError(
                f"router input width {rf.w1.shape[1]} != n_embd {self.n_embd} + {N_LOGIT_FEATURES} logit features"
            )
        self._w1h = np.ascontiguousarray(rf.w1[:, : self.n_embd])
        self._w1f = np.ascontiguousarray(rf.w1[:, self.n_embd :])
        self._b1 = rf.b1
        self._table = rf.tok_table
        self._table_b1 = rf.tok_table + rf.b1  # first-layer bias folded into the token table: one add less per token
        self._w2, self._b2 = rf.w2, rf.b2
        self._h = np.empty(len(rf.b1), dtype=np.float32)
        self._h2 = np.empty(len(rf.b1), dtype=np.float32)
        self._featurize = LogitFeaturizer(int(rf.meta.get("n_vocab", 1)))
        self.drift = DriftMonitor(np.asarray(rf.meta["reference_histogram"], dtype=np.float64))
        # trained on the signed `gain` label (models/train/features.py): a pool reads 2·score - 1 (score_tiers)
        self.signed = rf.meta.get("label") == "gain"

    @property
    def edge_fingerprint(self) -> str:
        return str(self.meta["edge_fingerprint"])

    @property
    def cloud_fingerprint(self) -> str:
        return str(self.meta["cloud_fingerprint"])

    def score(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
        s = self.score_features(hidden, self._featurize(logits, proposed), proposed)
        self.drift.observe(s)
        return s

    @property
    def features(self) -> np.ndarray:
        """The logit features of the last `score` call (a reused buffer: read it before the next call)."""
        return self._featurize.out

    def score_features(self, hidden: np.ndarray, feats: np.ndarray, proposed: int) -> float:
        """The score from precomputed logit features (training checks and benchmarks use it)."""
        h = self._h
        if hidden.dtype != np.float32:  # the cloud's float16 copy, or a test's float64
            hidden = hidden.astype(np.float32)
        np.dot(self._w1h, hidden, out=h)
        np.dot(self._w1f, feats, out=self._h2)
        h += self._h2
        h += self._table_b1[((int(proposed) * _HASH_MUL) & 0xFFFFFFFF) % self.n_buckets]  # token_bucket, in plain ints
        np.maximum(h, 0.0, out=h)
        z = float(np.dot(self._w2, h)) + self._b2
        return 1.0 / (1.0 + math.exp(-z)) if z > -60 else 0.0

    def score_batch(self, hidden: np.ndarray, feats: np.ndarray, proposed: np.ndarray) -> np.ndarray:
        """Scores of many rows at once (training reports, evaluation)."""
        h = hidden.astype(np.float32) @ self._w1h.T + feats.astype(np.float32) @ self._w1f.T + self._b1
        h += self._table[token_bucket(proposed, self.n_buckets).astype(np.int64)]
        np.maximum(h, 0.0, out=h)
        z = h @ self._w2 + self._b2
        return 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))

    def threshold_for_fraction(self, fraction: float) -> float:
        """Threshold that sent `fraction` of validation tokens to the cloud (linear in the table)."""
        table = self.meta["calibration"]
        fr = np.array([row["cloud_fraction"] for row in table])
        th = np.array([row["threshold"] for row in table])
        return float(np.interp(fraction, fr, th))

    def threshold_for(self, fraction: float) -> float:
        """Router.threshold_for: the prior the online calibrator starts from (shared/policy.py)."""
        return self.threshold_for_fraction(fraction)

    def drift_report(self) -> dict[str, Any]:
        return {"router": self.name, **self.drift.report()}


def cloud_mismatch(meta: dict[str, Any], cloud: Any) -> str | None:
    """Why a router file (its `meta`) does not fit cloud model `cloud`, or None when it does.

    `cloud`: a ModelInfo (compared by fingerprint), a fingerprint ("sha256:..."), or a model name
    (compared with the name the file records, for callers that cannot resolve the cloud's file).
    A file that records no cloud model (none written by `fit` does) fits any cloud."""
    if cloud is None or cloud == "":
        return None
    if hasattr(cloud, "fingerprint"):
        have, want, name = meta.get("cloud_fingerprint"), cloud.fingerprint, f"{cloud.name} ({cloud.fingerprint})"
    elif str(cloud).startswith("sha256:"):
        have, want, name = meta.get("cloud_fingerprint"), str(cloud), str(cloud)
    else:
        have, want, name = meta.get("cloud_model"), str(cloud), str(cloud)
    if have is None or have == want:
        return None
    return (
        f"was trained for cloud model {meta.get('cloud_model')} ({meta.get('cloud_fingerprint')}), "
        f"but the cloud runs {name}"
    )


def load_router(
    path: str | Path, edge_info: Any = None, on_mismatch: str = "error", n_vocab: int = 0, cloud: Any = None
) -> Any:
    """Load a router file for `edge_info` (a ModelInfo) and, when given, cloud model `cloud`
    (see `cloud_mismatch`); on a fingerprint mismatch of either raise or fall back.

    The labels are the cloud model's judgement (its tokens, or for a mixed pair its NLL of the
    text), so a router is bound to both models. `cloud` None skips the cloud check (callers that
    do not know the cloud; same-vocab routers loaded as before).

    on_mismatch: "error" raises RouterMismatchError; "heuristic" logs a warning and
    returns the entropy HeuristicRouter.
    """
    if on_mismatch not in ("error", "heuristic"):
        raise ValueError(f"router_on_mismatch must be 'error' or 'heuristic', not {on_mismatch!r}")
    rf = RouterFile.load(path)
    router = LearnedRouter(rf, name=f"learned:{Path(path).stem}")
    msg = None
    if edge_info is not None and edge_info.fingerprint != router.edge_fingerprint:
        msg = (
            f"router {path} was trained for edge model {router.meta.get('edge_model')} ({router.edge_fingerprint}), "
            f"but the device runs {edge_info.name} ({edge_info.fingerprint}); retrain it for this model with "
            "`tokenrouter-train label` + `fit`, or set router_on_mismatch='heuristic' to fall back"
        )
    elif (why := cloud_mismatch(rf.meta, cloud)) is not None:
        msg = (
            f"router {path} {why}; retrain it for this pair with `tokenrouter-train label` + `fit`, "
            "or set router_on_mismatch='heuristic' to fall back"
        )
    if msg is not None:
        if on_mismatch == "error":
            raise RouterMismatchError(msg)
        log.warning("%s; falling back to the entropy heuristic", msg)
        return HeuristicRouter("entropy", n_vocab or int(rf.meta.get("n_vocab", 1)))
    return router


def score_after(router: Router, first: Router, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
    """`router`'s score at the position `first` has just scored (a pool's tier routers after the pair's):
    where both are learned routers of one device model, `first`'s logit features are reused, so the
    position costs one pass over the logits, not one per router."""
    if isinstance(router, LearnedRouter) and isinstance(first, LearnedRouter):
        score = router.score_features(hidden, first.features, proposed)
        router.drift.observe(score)
        return score
    return router.score(hidden, logits, proposed)


def score_tiers(
    into: np.ndarray,
    routers: list[Router | None],
    first: Router,
    score: float,
    hidden: np.ndarray,
    logits: np.ndarray,
    proposed: int,
) -> None:
    """Each cloud tier's expected gain into `into` (index = tier): its own router's score after `first`
    scored `score` here (`score_after`), or `score` where the tier has none. A router trained on the
    signed `gain` label gives 2·score - 1, the expected saturated gain, which is negative where the
    tier's token is expected to be worse than the device's."""
    for tier in range(1, len(routers)):
        router = routers[tier]
        if router is None:
            into[tier] = score
            continue
        s = score_after(router, first, hidden, logits, proposed)
        into[tier] = 2.0 * s - 1.0 if getattr(router, "signed", False) else s
