"""How the embedded engine shares its steps between keys: short work first, then fair queueing.

Each session's owner (its API key) has an account at the engine (`Usage`): the engine time its
sessions used (`vtime`), and whether it asked lately for work longer than one chunk (a prefill or
verify past the per-session tokens of a step: hundreds of drafts, a long text, a history to
recompute after churning the KV cache), or whose device left replies unread until it was dropped
(`demote`). Such a key is heavy for `HEAVY_HOLD_S`. While any light key is at work (a request
queued, or one within `ANTICIPATE_S`: a device between two hard tokens is thinking, not gone) only
light keys are served, and a heavy key at most once per `STARVE_S`, so it is slowed, never
stopped; among the keys served, those within `FAIR_SLICE_S` of engine time of the least-served go
first (fair queueing, as Linux's CFS does for CPU time; a key back from idle cannot bank the time
it was away, nor gain any by opening more sessions). A heavy key's sessions take a quarter of the
per-session tokens of a step (`Usage.chunk`), so a device that comes to the engine while they
have it waits a short chunk only.

**A budget per key** (`Usage.spend`, the key's `engine_seconds_per_minute`): everything the engine
does for a key's sessions is charged to it (every decode's share by tokens: prefills of hellos,
resumes and syncs, hard tokens; each piece of a verify), from a bucket of that many engine seconds
refilled at that rate per minute. A key in debt waits: none of its sessions is served, whoever
else is waiting or not, until the refill has paid the debt. Slowing down falls on its sessions only.

The batch stepper (cloud_server/batch_stepper.py) asks `FairShare.turns` whose turn it is.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

log = logging.getLogger(__name__)

FAIR_SLICE_S = 0.05  # engine seconds a key may run ahead of the least-served key at work
ANTICIPATE_S = 0.5  # a key that had work queued this recently still counts as at work (a device thinking)
HEAVY_HOLD_S = 10.0  # a key that asked for work longer than one chunk stays heavy this long
STARVE_S = 1.0  # a heavy key held back this long gets one turn anyway
HEAVY_CHUNK = 4  # a heavy key's sessions take 1/HEAVY_CHUNK of the per-session tokens of a step


class Usage:
    """One owner's (API key's) account at the engine, shared by its sessions (module docstring)."""

    def __init__(self, name: str = "", seconds_per_minute: float | None = None) -> None:
        self.name = name
        self.vtime = 0.0  # engine seconds charged (fair queueing)
        self.last_busy = -float("inf")  # when one of its sessions last had a request queued (monotonic)
        self.heavy_until = 0.0  # heavy (it asked for work longer than one chunk) until then
        self.served_at = 0.0  # when it was last given a turn
        self.sessions = 0
        self.per_minute = seconds_per_minute  # its engine-time budget (None: no limit)
        self.credit = seconds_per_minute or 0.0  # engine seconds it may still use; < 0: in debt, it waits
        self.credit_t = time.monotonic()
        self.debts = 0  # times it went into debt (each logged once)

    def spend(self, seconds: float) -> None:
        """`seconds` of engine time used by one of its sessions: charged to fair queueing and to its budget."""
        self.vtime += seconds
        if self.per_minute is not None:
            was = self._refill(time.monotonic())
            self.credit -= seconds
            if was >= 0 > self.credit:
                self.debts += 1
                log.warning(
                    "key %s used its %g engine seconds per minute; its sessions wait %.1f s",
                    self.name,
                    self.per_minute,
                    self.wait(time.monotonic()),
                )

    def wait(self, now: float) -> float:
        """Seconds until its debt is paid (0: within its budget; inf: a budget of 0 once spent)."""
        if self.per_minute is None or self._refill(now) >= 0:
            return 0.0
        return -self.credit * 60.0 / self.per_minute if self.per_minute > 0 else float("inf")

    def _refill(self, now: float) -> float:
        assert self.per_minute is not None
        self.credit = min(self.per_minute, self.credit + (now - self.credit_t) * self.per_minute / 60.0)
        self.credit_t = now
        return self.credit

    def heavy(self, now: float) -> bool:
        return now < self.heavy_until

    def long_work(self, now: float) -> None:
        """One of its requests needs more than one chunk: heavy for HEAVY_HOLD_S."""
        self.heavy_until = now + HEAVY_HOLD_S

    def chunk(self, limit: int, now: float) -> int:
        """How many tokens one of its sessions may decode in one step: `limit`, or for a heavy key a quarter
        of it, so a device coming to the engine while such a session has it waits a short chunk only."""
        return max(1, limit // HEAVY_CHUNK) if self.heavy(now) else limit


class FairShare:
    """The keys' accounts and the virtual clock of fair queueing (module docstring)."""

    def __init__(self) -> None:
        self._vclock = 0.0  # the least-served busy key's engine time, never decreasing (fair queueing)
        self._uses: dict[str, Usage] = {}  # by owner name (or "#handle" for a session without an owner)

    def join(self, owner_name: str, handle: int, seconds_per_minute: float | None = None) -> Usage:
        """Session `handle` of `owner_name` ("": nobody) opens: its key's account, at work from now
        (its prompt's prefill comes next). `seconds_per_minute`: the key's engine-time budget."""
        name = owner_name or f"#{handle}"  # no owner: the session alone
        use = self._uses.get(name)
        if use is None:
            use = self._uses[name] = Usage(name, seconds_per_minute)
        use.per_minute = seconds_per_minute  # the key file's latest word
        use.sessions += 1
        self.wake(use, time.monotonic())
        return use

    def leave(self, owner_name: str, handle: int, use: Usage) -> None:
        """Session `handle` closed; a key's usage outlives its sessions (it decays), a lone session's does not."""
        use.sessions -= 1
        if use.sessions <= 0 and not owner_name:
            self._uses.pop(f"#{handle}", None)

    def demote(self, owner: str) -> None:
        """`owner`'s device asked for work it does not read (a slow reader): its key is heavy for a while."""
        if owner in self._uses:
            self._uses[owner].long_work(time.monotonic())

    def wake(self, use: Usage, now: float) -> None:
        """`use`'s key is at work now; back from idle, it starts at most two slices behind the busiest (it is
        served first, but cannot bank the time it spent idle, as in Linux's CFS)."""
        if now - use.last_busy >= ANTICIPATE_S:
            use.vtime = max(use.vtime, self._vclock - 2 * FAIR_SLICE_S)
        use.last_busy = now

    def turns(self, busy: dict[int, Usage], open_uses: Iterable[Usage]) -> tuple[set[int], set[int]]:
        """Of the sessions with requests queued (`busy`: handle -> its key's account), those whose turn it
        is: the light keys' while any light key is at work (`open_uses`: the accounts of every open
        session), a heavy key's too once held back STARVE_S. Returns (served, first): all of those are
        served while the step's budget lasts (work-conserving: another session's token in the same
        decode costs little), and `first`, those within FAIR_SLICE_S of engine time of the
        least-served, take the budget before the others and alone may run a TURN (a verify's piece,
        which lengthens the step for everyone)."""
        now = time.monotonic()
        busy = {h: u for h, u in busy.items() if not u.wait(now)}  # a key in debt waits (module docstring)
        if not busy:
            return set(), set()
        for use in busy.values():
            self.wake(use, now)
        at_work = {id(u): u for u in open_uses if now - u.last_busy < ANTICIPATE_S}
        light = [u for u in at_work.values() if not u.heavy(now)]
        cohort = light or list(at_work.values())
        floor = min(u.vtime for u in cohort)
        self._vclock = max(self._vclock, floor)
        ids = {id(u) for u in cohort}
        starving = {h for h, u in busy.items() if now - u.served_at > STARVE_S}  # slowed, never stopped
        served = {h for h, u in busy.items() if id(u) in ids} | starving
        first = {h for h, u in busy.items() if id(u) in ids and u.vtime - floor < FAIR_SLICE_S} | starving
        for h, u in busy.items():
            if h in served:
                u.served_at = now
        return served, first
