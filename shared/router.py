"""Routers: how hard is the next token? `score` in [0, 1], higher = harder.

The decoder calls `score(hidden, logits, proposed)` once per position, with the
device model's final hidden state, its next-token logits and the token it would
write. A router is anything that meets the `Router` protocol below (a score, a calibration
prior, a drift report); the learned router in `shared/learned_router.py` plugs in the same way.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np


class Router(Protocol):
    """A per-token difficulty score, and what the policy and each answer's stats ask of it."""

    name: str

    def score(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
        """Difficulty of the next token in [0, 1]."""
        ...

    def threshold_for(self, fraction: float) -> float:
        """The threshold expected to route `fraction` of tokens: where online calibration starts
        (shared/policy.py)."""
        ...

    def drift_report(self) -> dict[str, Any] | None:
        """This router's scores so far against its training's (copied into each answer's stats);
        None when it has no training distribution to compare with."""
        ...


LOGIT_FEATURES = ("entropy", "top1", "top2", "margin", "log_top1", "log_ratio12", "p_proposed", "log_p_proposed")
N_LOGIT_FEATURES = len(LOGIT_FEATURES)
_EPS = 1e-9


class LogitFeaturizer:
    """The LOGIT_FEATURES of one next-token distribution: one exp pass, one scratch buffer.

    With e = exp(x - m) (m = max logit) and Z = sum(e): P(top) = 1 / Z and
    H = log Z - (e . x / Z - m). Dotting with the logits themselves rather than a
    second shifted copy halves the scratch memory, which matters because each
    decode streams the weights through the cache and leaves scratch buffers cold.
    Training (`models/train/`) calls this same code, so a learned router scores on
    exactly the features it was fit on.
    """

    def __init__(self, n_vocab: int) -> None:
        self._exp = np.empty(max(n_vocab, 1), dtype=np.float32)
        self.out = np.empty(N_LOGIT_FEATURES, dtype=np.float32)

    def __call__(self, logits: np.ndarray, proposed: int = -1) -> np.ndarray:
        if logits.shape != self._exp.shape:  # a different model: resize once
            self.__init__(logits.shape[0])  # type: ignore[misc]
        e = self._exp
        top = int(np.argmax(logits))
        m = float(logits[top])
        np.subtract(logits, m, out=e)
        np.exp(e, out=e)
        z = float(e.sum())
        entropy = max(math.log(z) - (float(np.dot(e, logits)) / z - m), 0.0)
        p_prop = float(e[proposed]) / z if 0 <= proposed < len(e) else 0.0
        e[top] = 0.0
        top1, top2 = 1.0 / z, float(e.max()) / z
        o = self.out
        o[0], o[1], o[2], o[3] = entropy, top1, top2, top1 - top2
        o[4] = math.log(top1 + _EPS)
        o[5] = math.log(top1 + _EPS) - math.log(top2 + _EPS)
        o[6], o[7] = p_prop, math.log(p_prop + _EPS)
        return o


# Score quantiles of each heuristic for the default device model (SmolLM2-135M Q3_K_S, greedy,
# 40 CLINC150 train queries, 949 positions): PRIOR[kind][i] is the threshold above which a
# fraction i/10 of positions score. Seeds online calibration so the first answer is not off.
PRIOR_QUANTILES: dict[str, list[float]] = {
    "entropy": [1.0, 0.477, 0.406, 0.355, 0.302, 0.262, 0.2, 0.135, 0.075, 0.03, 0.0],
    "top1": [1.0, 0.869, 0.8, 0.722, 0.642, 0.529, 0.381, 0.227, 0.11, 0.04, 0.0],
    "margin": [1.0, 0.976, 0.944, 0.872, 0.774, 0.647, 0.449, 0.298, 0.142, 0.046, 0.0],
}


def threshold_from_quantiles(quantiles: list[float], fraction: float) -> float:
    """Interpolate a table of thresholds at fractions 0, 1/n, ..., 1."""
    xs = np.linspace(0.0, 1.0, len(quantiles))
    return float(np.interp(min(max(fraction, 0.0), 1.0), xs, quantiles))


class HeuristicRouter:
    """Training-free router on the next-token distribution.

    kind="entropy": H / ln(V), the entropy normalised by its maximum.
    kind="top1": 1 - P(top token) (BiLD's fallback rule).
    kind="margin": 1 - (P1 - P2).
    """

    KINDS = ("entropy", "top1", "margin")

    def __init__(self, kind: str = "entropy", n_vocab: int = 0) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown heuristic {kind!r}; choose one of {', '.join(self.KINDS)}")
        self.kind = kind
        self.name = f"heuristic-{kind}"
        self._features = LogitFeaturizer(n_vocab)
        self._max_entropy = math.log(max(n_vocab, 2))

    def score(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
        f = self._features(logits)
        if self.kind == "entropy":
            return min(float(f[0]) / self._max_entropy, 1.0)
        if self.kind == "top1":
            return 1.0 - float(f[1])
        return 1.0 - float(f[3])

    def threshold_for(self, fraction: float) -> float:
        """Starting threshold for a target cloud fraction (from PRIOR_QUANTILES)."""
        return threshold_from_quantiles(PRIOR_QUANTILES[self.kind], fraction)

    def drift_report(self) -> None:
        return None  # a fixed formula: no training distribution


class RandomRouter:
    """Uniform random scores: the baseline every router must beat, and a test of exact sync."""

    def __init__(self, seed: int = 0) -> None:
        self.name = "random"
        self._rng = np.random.default_rng(seed)

    def score(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
        return float(self._rng.random())

    def threshold_for(self, fraction: float) -> float:
        return 1.0 - fraction  # uniform scores

    def drift_report(self) -> None:
        return None
