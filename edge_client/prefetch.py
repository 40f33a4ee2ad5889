"""Which tiers above the cloud to keep in step: the prefetch's forecast.

A tier above the cloud is brought up to date when it is asked, which costs its request a prefill
of what it lacks; kept in step (sent the device's tokens every `sync_every`, like the cloud), its
next request has little left to prefill, but every sync is a forward pass of that model. So only
the tiers likely to be asked soon are kept in step:

- `recent` (the default): a tier that wrote within the last `prefetch_window` positions;
- `forecast`: that, or a tier whose own router expects it soon: the running mean of its score
  (`Position.score_for`) over about the last `prefetch_window` positions has reached a share
  (`FORECAST_SHARE`) of the mean score at which the engine has asked it (learned across answers).

scripts/bench_tiers.py measures what each saves in wait and costs in GPU-seconds.
"""

from __future__ import annotations

import math

from shared.decision_engine import Position

PREFETCH_MODES = ("recent", "forecast")
FORECAST_SHARE = 0.8  # a tier is expected once its recent scores reach this share of its asking level
LEVEL_ALPHA = 0.1  # how fast the asking level follows the engine's asks


class TierForecast:
    """Per tier above the cloud: its router's recent scores and the level at which the engine asks it.
    One per generator (the levels carry over between answers); `observe` runs once per decided position."""

    def __init__(self, n_tiers: int, window: int) -> None:
        self.alpha = 2.0 / (max(window, 1) + 1)  # an EMA over about `window` positions
        self.level = [math.nan] * n_tiers  # mean score at the engine's asks of each tier (nan: never asked)
        self.recent = [0.0] * n_tiers

    def start_answer(self) -> None:
        self.recent = [0.0] * len(self.recent)

    def observe(self, position: Position, tier: int) -> None:
        """The engine sent `position` to `tier`: update each tier's recent score, and the asked tier's level."""
        for t in range(2, len(self.recent)):
            self.recent[t] += self.alpha * (position.score_for(t) - self.recent[t])
        if tier >= 2:
            s = position.score_for(tier)
            self.level[tier] = (
                s if math.isnan(self.level[tier]) else self.level[tier] + LEVEL_ALPHA * (s - self.level[tier])
            )

    def expects(self, tier: int) -> bool:
        """The router expects `tier` to be asked soon (never before the engine has asked it once)."""
        return not math.isnan(self.level[tier]) and self.recent[tier] >= FORECAST_SHARE * self.level[tier]
