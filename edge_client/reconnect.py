"""When the device tries again after losing its cloud replica mid-answer: jittered exponential backoff.

Why jitter: when a replica dies, every device it served notices within the same
millisecond. Reconnecting at once, together, they would all land on the load
balancer (and the next replica's prefill queue) at the same instant; spreading
each wait uniformly over [0, cap] ("full jitter", AWS Architecture Blog,
"Exponential Backoff And Jitter", 2015) spreads them out, and doubling the cap
after each failed try backs off from a fleet that is still recovering. The
first wait is short (its cap is `first_s`) because the usual case is one dead
replica behind a balancer that redispatches at once: the session is back in
well under a second (docs/server.md, "Failover").

The caller bounds the whole retry in time (GeneratorOptions.reconnect_wait_s):
the answer waits for it (the device writes no token meanwhile), and past it the
device finishes alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator


@dataclass(slots=True)
class Backoff:
    """Waits before each reconnect try: uniform in [0, cap], the cap doubling from `first_s` up to `max_s`."""

    first_s: float = 0.05
    max_s: float = 1.0
    rng: random.Random = field(default_factory=random.Random)

    def waits(self) -> Iterator[float]:
        """The wait before each try, without end; the first try's too (a stampede's first wave is the one
        to spread). The caller stops when its time is up."""
        cap = self.first_s
        while True:
            yield self.rng.uniform(0.0, cap)
            cap = min(cap * 2.0, self.max_s)
