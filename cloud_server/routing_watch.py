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

The band of each rate is calibrated on the fleet's own sessions, and no one key may move it:

* each key weighs as one device: its last `KEY_SESSIONS` sessions with at least
  `min_positions` positions each, weighted 1/n so that a key of 20 sessions weighs
  what a key of one does (one key's flood once made the band 0.00-0.01, and every
  honest session after it alarmed);
* a session is judged against the other keys' sessions, never its own key's: a key
  cannot widen the band that judges it, so every session may join the band, alarmed
  or not, and a band that moved (a fleet-wide drift, or a poisoned band) follows the
  fleet again once its keys' recent sessions do;
* nothing is judged before `min_keys` other keys and `min_sessions` of their sessions
  were seen (`min_keys` 0: a fleet behind one key, whose sessions judge each other).

The band is the [quantile, 1 - quantile] range of that weighted mass. Keys are
identified by their digest (cloud_server/auth.py), never the key; the `MAX_KEYS` most
recently seen are kept. A session is compared when it ends and every `min_positions`
positions; each of its rates alarms at most once: a metric
(`routing_alarms_total{signal,side}`), a log line, and its audit log kept
(cloud_server/audit.py) with the alarms named.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

SIGNALS = ("routed_share", "overrule_rate", "explore_disagreement")
N_BINS = 100
KEY_SESSIONS = 32  # a key's most recent sessions that shape its part of the band
MAX_KEYS = 4096  # keys kept in the band; the least recently seen are forgotten first


@dataclass(slots=True)
class SessionRouting:
    """One session's counts (the event loop is the only writer)."""

    key: str = ""  # its key's digest (cloud_server/auth.py): the band weighs each key as one
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


def _histogram(rates: deque[float]) -> np.ndarray:
    """A key's recent rates as a histogram of total weight 1 (one key weighs as one device)."""
    bins = np.minimum((np.asarray(rates) * N_BINS).astype(int), N_BINS - 1)
    return np.bincount(bins, minlength=N_BINS) / len(rates)


class RateBand:
    """One rate (0..1) over the fleet: each key's last `KEY_SESSIONS` sessions, a histogram of weight 1
    per key, and the sum of those histograms (kept up to date: a band costs O(bins), whatever the keys)."""

    def __init__(self) -> None:
        self.keys: OrderedDict[str, deque[float]] = OrderedDict()  # least recently seen first
        self.total = np.zeros(N_BINS)
        self.sessions = 0  # sessions held, every key's

    def add(self, key: str, rate: float) -> None:
        rates = self.keys.pop(key, None)
        if rates is None:
            rates = deque(maxlen=KEY_SESSIONS)
        else:
            self.total -= _histogram(rates)
            self.sessions -= len(rates)
        rates.append(min(max(rate, 0.0), 1.0))
        self.keys[key] = rates
        self.total += _histogram(rates)
        self.sessions += len(rates)
        while len(self.keys) > MAX_KEYS:
            _, old = self.keys.popitem(last=False)
            self.total -= _histogram(old)
            self.sessions -= len(old)

    def without(self, key: str | None) -> tuple[np.ndarray, int, int]:
        """The mass of every key but `key` (None: all), and how many keys and sessions it holds."""
        own = self.keys.get(key) if key is not None else None
        if own is None:
            return self.total, len(self.keys), self.sessions
        return np.maximum(self.total - _histogram(own), 0.0), len(self.keys) - 1, self.sessions - len(own)

    @staticmethod
    def band(mass: np.ndarray, quantile: float) -> tuple[float, float]:
        """[low, high]: the rates below `quantile` and above 1 - `quantile` of the mass lie outside."""
        cdf = np.cumsum(mass) / mass.sum()
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

    def __init__(
        self, quantile: float = 0.01, min_sessions: int = 20, min_positions: int = 64, min_keys: int = 5
    ) -> None:
        if not 0.0 < quantile < 0.5:
            raise ValueError(f"--alarm-quantile must be within (0, 0.5), not {quantile}")
        if min_keys < 0:
            raise ValueError(f"--alarm-min-keys must be 0 or more, not {min_keys}")
        self.quantile = quantile
        self.min_sessions = min_sessions
        self.min_positions = min_positions
        self.min_keys = min_keys
        self.bands = {s: RateBand() for s in SIGNALS}

    def band(self, signal: str, key: str | None = None) -> tuple[float, float] | None:
        """The band that judges a session of `key`: every other key's sessions (every key's with
        `min_keys` 0), or None until `min_keys` keys and `min_sessions` sessions are in it."""
        mass, n_keys, n_sessions = self.bands[signal].without(key if self.min_keys > 0 else None)
        if n_keys < max(self.min_keys, 1) or n_sessions < self.min_sessions or mass.sum() <= 0:
            return None
        return RateBand.band(mass, self.quantile)

    def check(self, routing: SessionRouting, final: bool = False) -> list[Alarm]:
        """New alarms for `routing` (every `min_positions` positions, and when `final`). At the
        session's end its rates join its key's part of the bands, alarmed or not (after the comparison:
        a key is never its own yardstick, and one key weighs as one however many sessions it opens)."""
        if not final and routing.positions < routing.next_check:
            return []
        routing.next_check = routing.positions + self.min_positions
        rates = routing.rates(self.min_positions)
        alarms = []
        for signal, rate in rates.items():
            band = self.band(signal, routing.key)
            if band is None or signal in routing.alarmed or band[0] <= rate <= band[1]:
                continue
            routing.alarmed.add(signal)
            alarms.append(Alarm(signal, "low" if rate < band[0] else "high", rate, band))
        if final:
            for signal, rate in rates.items():
                self.bands[signal].add(routing.key, rate)
        return alarms
