"""Routing policies: given a router score, does this position go to the cloud?

    edge     never route (device only)
    cloud    every token from the cloud, streamed (the cloud-only baseline)
    router   route when the score crosses a threshold, fixed (--threshold) or
             calibrated online to a target cloud-token fraction (--cloud-fraction)

Two rules keep `router` stable. Warm-up: the first `warmup` positions of each
answer stay on the device. Hysteresis: once routing, keep routing until the
score falls below threshold - hysteresis, so a run of hard tokens is not split
by one that scores just under the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

N_BINS = 256  # scores are calibrated at the routing log's 8-bit resolution


class ScoreCalibrator:
    """Online threshold for a target fraction of scores at or above it.

    Keeps an exponentially decayed 256-bin histogram of scores; the threshold is
    the lower edge of the lowest bin whose upper tail holds no more than the
    target fraction. Decay is applied by growing the weight of new scores (and
    rescaling rarely), so an update is O(1); the threshold is recomputed every
    `every` scores (256 adds).
    """

    def __init__(
        self,
        target_fraction: float,
        initial_threshold: float = 0.5,
        half_life: int = 2000,
        min_count: int = 16,
        every: int = 8,
        prior: Callable[[float], float] | None = None,
        prior_weight: int = 200,
    ) -> None:
        if not 0.0 <= target_fraction <= 1.0:
            raise ValueError("target cloud fraction must be within [0, 1]")
        self.target = target_fraction
        self.min_count = min_count
        self.every = every
        self._growth = 0.5 ** (-1.0 / half_life)
        self._weight = 1.0
        self._hist = np.zeros(N_BINS, dtype=np.float64)
        self._count = 0
        self.threshold = initial_threshold if 0 < target_fraction < 1 else (1.01 if target_fraction == 0 else 0.0)
        if prior is not None and 0 < target_fraction < 1:
            # pseudo-scores drawn from the router's known score distribution: calibrated from the start
            for i in range(100):
                self._hist[min(int(prior((i + 0.5) / 100) * N_BINS), N_BINS - 1)] += prior_weight / 100
            self._count = min_count - 1
            self.threshold = prior(target_fraction)

    def observe(self, score: float) -> None:
        self._hist[min(int(score * N_BINS), N_BINS - 1)] += self._weight
        self._weight *= self._growth
        if self._weight > 1e12:  # rescale before floats lose precision
            self._hist /= self._weight
            self._weight = 1.0
        self._count += 1
        if self._count >= self.min_count and self._count % self.every == 0 and 0.0 < self.target < 1.0:
            tail = np.cumsum(self._hist[::-1])[::-1] / self._hist.sum()  # tail[b] = share of scores in bins >= b
            ok = np.nonzero(tail <= self.target)[0]
            self.threshold = (ok[0] / N_BINS) if len(ok) else 1.01


@dataclass(slots=True)
class PolicyConfig:
    mode: str = "router"  # "edge" | "cloud" | "router"
    threshold: float | None = 0.5
    cloud_fraction: float | None = None  # overrides threshold when given
    warmup: int = 0
    hysteresis: float = 0.0

    @property
    def device_alone(self) -> bool:
        """Policy edge, or a router asked for a cloud share of 0: the device answers alone, with no cloud
        traffic at all (no check, no lookahead guess, no session). The one place this rule lives."""
        return self.mode == "edge" or (self.mode == "router" and self.cloud_fraction == 0)


class RoutingPolicy:
    """Per-position decision for one device; reset with `start_answer` for each answer."""

    def __init__(self, config: PolicyConfig, prior: Callable[[float], float] | None = None) -> None:
        """`prior` maps a cloud fraction to the router's expected threshold (Router.threshold_for)."""
        if config.mode not in ("edge", "cloud", "router"):
            raise ValueError(f"unknown policy {config.mode!r}; choose edge, cloud or router")
        if config.threshold is not None and not 0.0 <= config.threshold <= 1.0:
            raise ValueError("--threshold must be within [0, 1]")
        if config.hysteresis < 0 or config.warmup < 0:
            raise ValueError("warm-up and hysteresis must be >= 0")
        self.config = config
        self.prior = prior
        self.mode = "edge" if config.device_alone else config.mode
        self.calibrator: ScoreCalibrator | None = None
        if self.mode == "router" and config.cloud_fraction is not None:
            self.calibrator = ScoreCalibrator(
                config.cloud_fraction, initial_threshold=config.threshold or 0.5, prior=prior
            )
        self._position = 0
        self._routing = False

    @property
    def name(self) -> str:
        return self.mode

    @property
    def threshold(self) -> float:
        if self.calibrator is not None:
            return self.calibrator.threshold
        return 0.5 if self.config.threshold is None else self.config.threshold

    def share_taken_elsewhere(self, share: float) -> None:
        """Cloud tokens the router did not ask for (the cloud's check overruling the device)
        make up `share` of the answer: calibrate the router to the rest of --cloud-fraction,
        so the total stays on target. No effect with a fixed threshold."""
        if self.calibrator is not None and self.config.cloud_fraction is not None:
            self.calibrator.target = min(max(self.config.cloud_fraction - share, 0.01), self.config.cloud_fraction)

    def start_answer(self) -> None:
        self._position = 0
        self._routing = False

    def decide(self, score: float) -> bool:
        """True when this position should be written by the cloud."""
        if self.mode != "router":
            return self.mode == "cloud"
        threshold = self.threshold  # the threshold in force before this score is observed
        if self.calibrator is not None:
            self.calibrator.observe(score)
        position = self._position
        self._position += 1
        if position < self.config.warmup:
            return False
        limit = threshold - self.config.hysteresis if self._routing else threshold
        self._routing = bool(score >= limit)  # a numpy threshold would make it numpy.bool_ (not JSON)
        return self._routing


def replay_decisions(scores: list[float], threshold: float, warmup: int = 0, hysteresis: float = 0.0) -> list[bool]:
    """The decisions a fixed-threshold router policy makes for `scores` (for audits and tests)."""
    policy = RoutingPolicy(PolicyConfig("router", threshold=threshold, warmup=warmup, hysteresis=hysteresis))
    return [policy.decide(s) for s in scores]
