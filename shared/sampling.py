"""Choosing a token from logits, identically on the device and in the cloud.

Greedy decoding is argmax. With a temperature, candidates are cut to the top-k
(an O(V) partition, never a full sort of the vocabulary) and then to the top-p
nucleus; draws come from a seeded generator so runs are reproducible.

Logits or probabilities that are not finite (NaN, +inf: a broken decode, or a
temperature so small that logits / temperature overflows) raise SamplingError
rather than drawing garbage: numpy's argmax would pick a NaN, its choice() a
ValueError nobody can name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.protocol import NEXT_TOP, SamplingParams


class SamplingError(ValueError):
    """No token can be chosen: the logits or the probabilities derived from them are not finite."""


class Sampler:
    """Stateful sampler: one per answer stream, so seeded draws replay exactly."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.temperature <= 0.0

    def sample(self, logits: np.ndarray) -> int:
        if self.greedy:
            token = int(np.argmax(logits))  # a NaN or +inf anywhere wins the argmax: one check covers them
            if not np.isfinite(logits[token]):
                raise SamplingError(f"the logits are not finite ({float(logits[token])} at token {token})")
            return token
        p = self.params
        k = min(p.top_k, logits.shape[0])
        top = np.argpartition(logits, -k)[-k:]
        with np.errstate(over="ignore", invalid="ignore"):
            scaled = logits[top].astype(np.float64) / p.temperature
            order = np.argsort(-scaled)
            top, scaled = top[order], scaled[order]
            probs = np.exp(scaled - scaled[0])
            probs /= probs.sum()
        if not np.all(np.isfinite(probs)):
            raise SamplingError(
                f"sampling probabilities are not finite at temperature {p.temperature:g} (logits up to "
                f"{float(np.max(logits[top]))}); use a larger temperature, or 0 for greedy decoding"
            )
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            top, probs = top[:keep], probs[:keep] / probs[:keep].sum()
        return int(top[self._rng.choice(len(top), p=probs)])


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """log P(token) under softmax(logits), computed stably."""
    m = float(np.max(logits))
    return float(logits[token]) - m - float(np.log(np.sum(np.exp(logits - m))))


def regret(logits: np.ndarray, token: int) -> float:
    """How much less likely `token` is than the most likely token, in nats (a difference of
    logits is one of log-probabilities): the cloud's check of a device token."""
    return float(np.max(logits)) - float(logits[token])


@dataclass(slots=True)
class Guess:
    """A model's choice at a position with its most likely tokens there (most likely first):
    what the cloud announces in a `next` message, and how the device judges its own token."""

    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]

    @classmethod
    def of(cls, logits: np.ndarray, token: int, top: int = NEXT_TOP) -> "Guess":
        """`token` chosen from `logits`, with the `top` most likely tokens (one partition, no sort
        of the vocabulary)."""
        ids = np.argpartition(logits, -top)[-top:]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        lse = float(np.logaddexp.reduce(logits, dtype=np.float64))
        return cls(token, float(logits[token]) - lse, [int(i) for i in ids], [float(logits[i]) - lse for i in ids])

    def regret(self, token: int) -> float:
        """How much less likely `token` is than the guess, in nats; infinite for a token outside
        the top list (unknown, and at least that list's spread)."""
        if token == self.token:
            return 0.0
        if token in self.top_ids:
            return self.logprob - self.top_logprobs[self.top_ids.index(token)]
        return float("inf")


NO_GUESS = Guess(-1, 0.0, [], [])
