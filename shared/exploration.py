"""Exploration: the device asks the cloud, now and then, about a position its engine kept.

Why: the router's own choices bias every label the live traffic gives (the cloud only
sees what the router sent). An explored position was kept by the engine and asked
anyway, at random, so the cloud's answer there is an unbiased label: the server's
routing watch (cloud_server/routing_watch.py) reads how often the cloud would have
written something else, and the flywheel (`--record-dir`) records it.
"""

from __future__ import annotations

import random
import time


class Exploration:
    """ε-exploration: a position the engine kept on the device is asked of the cloud anyway, with
    probability `epsilon`, at most `per_minute` times a minute (a token bucket, full at the start).

    The draw comes from the operating system's randomness, not the answer's
    seed or text, so no input can steer which positions are explored. The cloud may decline an
    exploration request (its key's budget); the device then writes the position, as chosen."""

    def __init__(self, epsilon: float, per_minute: float, clock=time.monotonic) -> None:
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"explore (--explore) must be a probability within [0, 1], not {epsilon}")
        if not 0.0 <= per_minute < float("inf"):
            raise ValueError(f"explore_per_minute (--explore-per-minute) must be >= 0, not {per_minute}")
        self.epsilon = epsilon
        self.rate = per_minute / 60.0
        self.capacity = max(per_minute, 1.0)
        self.level = self.capacity
        self._clock = clock
        self._t = clock()
        self._random = random.SystemRandom()

    def pick(self) -> bool:
        """Explore this position? (cheap: one draw; the clock only when the draw says yes)"""
        if self.epsilon <= 0.0 or self._random.random() >= self.epsilon:
            return False
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._t) * self.rate)
        self._t = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True
