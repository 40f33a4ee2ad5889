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


class HeuristicRouter:
    """Training-free router on the next-token distribution.

    kind="entropy": 1 - exp(-H), i.e. 1 - 1/perplexity: 0.5 means "two equally
    likely choices". kind="top1": 1 - P(top token) (BiLD's fallback rule).
    kind="margin": 1 - (P1 - P2).
    """

    KINDS = ("entropy", "top1", "margin")

    def __init__(self, kind: str = "entropy", n_vocab: int = 0) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown heuristic {kind!r}; choose one of {', '.join(self.KINDS)}")
        self.kind = kind
        self.name = f"heuristic-{kind}"
        self._features = LogitFeatureExtractor(max(n_vocab, 1))

    def score(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
        f = self._features(logits)
        if self.kind == "entropy":
            return 1.0 - math.exp(-f.entropy)
        if self.kind == "top1":
            return 1.0 - f.top1_prob
        return 1.0 - f.margin


class RandomRouter:
    """Uniform random scores: the baseline every router must beat, and a test of exact sync."""

    def __init__(self, seed: int = 0) -> None:
        self.name = "random"
        self._rng = np.random.default_rng(seed)

    def score(self, hidden: np.ndarray, logits: np.ndarray, proposed: int) -> float:
        return float(self._rng.random())
