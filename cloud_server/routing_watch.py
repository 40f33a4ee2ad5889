"""The routing watch: an alarm when a session routes unlike the fleet.

Devices calibrate their routers to a cloud share, so across honest sessions a few
rates sit in a narrow band. A session outside it is a sign of drift (the router no
longer fits the traffic) or of input crafted to keep hard tokens on the cheap
model. Three rates per session, all counted here from what the server serves:

    routed_share          hard positions the device asked for (generate, text_generate;
                          exploration left out) per position of the answer
    overrule_rate         drafts the cloud's check overruled per unflagged draft it judged
                          (token sessions): high when the router misses hard tokens
    explore_disagreement  explored positions (the device kept them; asked at random,
                          shared/exploration.py) where the cloud chose
                          another token (token sessions): an unbiased read of the same

The band of each rate is calibrated on the fleet's own sessions: a decayed
histogram of the rates of sessions with at least `min_positions` positions, and
the band is its [quantile, 1 - quantile] range once `min_sessions` were seen.
A session is compared when it ends and every `min_positions` positions; each of its
rates alarms at most once: a metric (`routing_alarms_total{signal,side}`), a log
line, and its audit log kept (cloud_server/audit.py) with the alarms named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SIGNALS = ("routed_share", "overrule_rate", "explore_disagreement")
N_BINS = 100


@dataclass(slots=True)
class SessionRouting:
    """One session's counts (the event loop is the only writer)."""

    positions: int = 0  # answer positions the session advanced by (device's and cloud's)
    asked: int = 0  # hard positions asked (not exploration)
    checked: int = 0  # unflagged drafts the cloud's check judged
    overruled: int = 0  # of those, the ones it replaced
    explored: int = 0  # exploration requests served
    disagreed: int = 0  # of those, where the cloud chose another token than the device's
    alarmed: set[str] = field(default_factory=set)  # signals that alarmed (once each)
    next_check: int = 0  # positions at which it is compared next

    def rates(self, min_events: int) -> dict[str, float]:
        """Each rate with enough events behind it (`min_events`)."""
        out: dict[str, float] = {}
        if self.positions >= min_events:
            out["routed_share"] = self.asked / self.positions
        if self.checked >= min_events:
            out["overrule_rate"] = self.overruled / self.checked
        if self.explored >= max(min_events // 8, 4):  # exploration is rare by design
            out["explore_disagreement"] = self.disagreed / self.explored
        return out


class RateBand:
    """A decayed histogram of one rate over sessions (0..1), and its central band."""

    def __init__(self, half_life_sessions: float = 500.0) -> None:
        self.hist = np.zeros(N_BINS)
        self.decay = 0.5 ** (1.0 / half_life_sessions)
        self.sessions = 0

    def add(self, rate: float) -> None:
        self.hist *= self.decay
        self.hist[min(int(rate * N_BINS), N_BINS - 1)] += 1.0
        self.sessions += 1

    def band(self, quantile: float) -> tuple[float, float]:
        """[low, high]: the rates below `quantile` and above 1 - `quantile` of sessions lie outside."""
        cdf = np.cumsum(self.hist) / self.hist.sum()
        low = int(np.searchsorted(cdf, quantile, side="left")) / N_BINS
        high = (int(np.searchsorted(cdf, 1.0 - quantile, side="left")) + 1) / N_BINS
        return low, min(high, 1.0)


@dataclass(frozen=True, slots=True)
class Alarm:
    signal: str
    side: str  # "low" or "high"
    rate: float
    band: tuple[float, float]

    def describe(self) -> str:
        return f"{self.signal} {self.rate:.2f} is {self.side} (fleet band {self.band[0]:.2f}-{self.band[1]:.2f})"


class RoutingWatch:
    """The fleet's bands, and the comparison of one session against them."""

    def __init__(self, quantile: float = 0.01, min_sessions: int = 20, min_positions: int = 64) -> None:
        if not 0.0 < quantile < 0.5:
            raise ValueError(f"--alarm-quantile must be within (0, 0.5), not {quantile}")
        self.quantile = quantile
        self.min_sessions = min_sessions
        self.min_positions = min_positions
        self.bands = {s: RateBand() for s in SIGNALS}

    def band(self, signal: str) -> tuple[float, float] | None:
        """The calibrated band of `signal`, or None until enough sessions were seen."""
        b = self.bands[signal]
        return b.band(self.quantile) if b.sessions >= self.min_sessions else None

    def check(self, routing: SessionRouting, final: bool = False) -> list[Alarm]:
        """New alarms for `routing` (every `min_positions` positions, and when `final`). At the
        session's end its rates join the fleet's bands (after the comparison: it is not its own yardstick),
        those that alarmed left out."""
        if not final and routing.positions < routing.next_check:
            return []
        routing.next_check = routing.positions + self.min_positions
        rates = routing.rates(self.min_positions)
        alarms = []
        for signal, rate in rates.items():
            band = self.band(signal)
            if band is None or signal in routing.alarmed or band[0] <= rate <= band[1]:
                continue
            routing.alarmed.add(signal)
            alarms.append(Alarm(signal, "low" if rate < band[0] else "high", rate, band))
        if final:  # an alarmed rate stays out: many odd sessions must not widen the band they break
            for signal, rate in rates.items():
                if signal not in routing.alarmed:
                    self.bands[signal].add(rate)
        return alarms
