"""Routers: how hard is the next token? `score` in [0, 1], higher = harder.

The decoder calls `score(hidden, logits, proposed)` once per position, with the
device model's final hidden state, its next-token logits and the token it would
write. Any object with that method is a router; the learned router in
`shared/learned_router.py` plugs in the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Router(Protocol):
    """Required: `name` and `score`. Optional: `threshold_for(fraction) -> float`, the
    threshold expected to route that fraction of tokens (seeds online calibration), and
    `drift_report() -> dict` (copied into each answer's stats)."""

    name: str

    def score(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
        """Difficulty of the next token in [0, 1]."""
        ...


@dataclass(slots=True)
class LogitFeatures:
    """Cheap summaries of the next-token distribution."""

    entropy: float  # nats
    top1_prob: float
    top2_prob: float

    @property
    def margin(self) -> float:
        return self.top1_prob - self.top2_prob


class LogitFeatureExtractor:
    """Computes LogitFeatures in a few vectorised passes with reused buffers.

    H = log Z - sum(e * s) / Z with s = logits - max, e = exp(s), Z = sum(e);
    top-1 probability is 1 / Z because e[argmax] = 1.
    """

    def __init__(self, n_vocab: int) -> None:
        self._shifted = np.empty(n_vocab, dtype=np.float32)
        self._exp = np.empty(n_vocab, dtype=np.float32)

    def __call__(self, logits: np.ndarray) -> LogitFeatures:
        if logits.shape != self._shifted.shape:  # a different model: resize once
            self.__init__(logits.shape[0])  # type: ignore[misc]
        top = int(np.argmax(logits))
        np.subtract(logits, logits[top], out=self._shifted)
        np.exp(self._shifted, out=self._exp)
        z = float(self._exp.sum())
        entropy = math.log(z) - float(np.dot(self._exp, self._shifted)) / z
        self._exp[top] = 0.0
        second = float(self._exp.max())
        return LogitFeatures(entropy=max(entropy, 0.0), top1_prob=1.0 / z, top2_prob=second / z)


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
        self._features = LogitFeatureExtractor(max(n_vocab, 1))
        self._max_entropy = math.log(max(n_vocab, 2))

    def score(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
        f = self._features(logits)
        if self.kind == "entropy":
            return min(f.entropy / self._max_entropy, 1.0)
        if self.kind == "top1":
            return 1.0 - f.top1_prob
        return 1.0 - f.margin

    def threshold_for(self, fraction: float) -> float:
        """Starting threshold for a target cloud fraction (from PRIOR_QUANTILES)."""
        return threshold_from_quantiles(PRIOR_QUANTILES[self.kind], fraction)


class RandomRouter:
    """Uniform random scores: the baseline every router must beat, and a test of exact sync."""

    def __init__(self, seed: int = 0) -> None:
        self.name = "random"
        self._rng = np.random.default_rng(seed)

    def score(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
        return float(self._rng.random())
