"""The KV pool: sequence slots and cells of one llama.cpp context shared by all sessions.

Why a pool rather than a context per session: switching a session in by
`llama_state_seq_set_data` costs a copy of its whole KV cache (measured in
docs/benchmarks.md), while sequences in one unified KV pool cost nothing to
switch and let one decode serve several sessions.

The pool is a budget: when its cells (or the sequence slots) run out, idle
sessions are evicted least recently used first, and rebuilt when they return:
their state is copied to host memory (`evict_mode` "save", bounded by
`max_saved_bytes`) or dropped and rebuilt by re-prefilling the token history
the engine keeps ("recompute"). docs/server.md gives the memory per session.

Eviction is fair between owners (API keys): a session that needs room evicts its own owner's
idle sessions first, and evicting a session in "recompute" mode charges the evicting owner's
`ChurnBudget` with the cells the victim must recompute. An owner whose budget is spent may not
evict any more until it refills: its request is refused (`ChurnLimited`, the device gets `busy`)
before its churn slows the others (docs/server.md, "KV memory budget and eviction").

The pool knows cells, not tokens: decoding is the model runner's (cloud_server/model_runner.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import llama_cpp as lc

from cloud_server.engine_api import ChurnLimited, EngineFull, Owner
from shared.llama_backend import LlamaContext, LlamaModel

EVICT_MODES = ("recompute", "save")


@dataclass(slots=True)
class EngineStats:
    """Counters the metrics endpoint reads."""

    evictions: int = 0
    restores_loaded: int = 0  # state copied back from host memory
    restores_recomputed: int = 0  # rebuilt by re-prefill from the token history
    recomputed_tokens: int = 0
    saved_bytes: int = 0  # host memory held by saved states now
    churn_refusals: int = 0  # requests refused because their owner's KV churn budget was spent


@dataclass(slots=True)
class Residency:
    """Where one session's KV lives. Invariant: neither resident nor saved means `n_decoded == 0`."""

    handle: int  # the session's id for callers: stable across eviction and restore
    owner: Owner = field(default_factory=Owner)  # whose budget pays for the evictions this session causes
    seq: int = -1  # llama.cpp sequence id while resident in the KV cache; -1 while evicted
    n_decoded: int = 0  # the first n_decoded history tokens are in the KV cache (or in `saved`)
    saved: bytes | None = None  # KV state kept in host memory while evicted (evict_mode "save")
    evicted: bool = False  # was evicted since its last decode (counts a restore)
    last_used: float = 0.0  # for least-recently-used eviction

    @property
    def resident(self) -> bool:
        return self.seq >= 0


class KVPool:
    """`kv_slots` sequence slots over `ctx.n_ctx` cells; sessions hold a slot only while resident."""

    def __init__(
        self,
        ctx: LlamaContext,
        kv_slots: int,
        seq_cells: int,
        evict_mode: str = "recompute",
        max_saved_bytes: int = 256 << 20,
    ) -> None:
        if evict_mode not in EVICT_MODES:
            raise ValueError(f"evict_mode must be one of {EVICT_MODES}, got {evict_mode!r}")
        self.ctx = ctx
        self.kv_slots = kv_slots
        self.seq_cells = seq_cells  # cells one session may hold: the whole pool when unified, an equal share when split
        self.evict_mode = evict_mode
        self.max_saved_bytes = max_saved_bytes
        self.stats = EngineStats()
        self.churn = ChurnBudget()
        self.kv_bytes_per_cell = kv_bytes_per_cell(ctx.model)
        self._free = list(range(kv_slots - 1, -1, -1))
        self._members: dict[int, Residency] = {}
        self._cells_used = 0  # sum of n_decoded over resident sessions

    # ---------------------------------------------------------------- members

    def add(self, handle: int, owner: Owner | None = None) -> Residency:
        """A new member holding nothing yet (a slot and cells are taken at its first decode)."""
        r = self._members[handle] = Residency(handle, owner or Owner(), last_used=time.monotonic())
        return r

    def remove(self, r: Residency) -> None:
        self._members.pop(r.handle, None)
        self.release(r)
        self._drop_saved(r)

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    @property
    def n_resident(self) -> int:
        return self.kv_slots - len(self._free)

    @property
    def cells_used(self) -> int:
        return self._cells_used

    @property
    def kv_budget_bytes(self) -> int:
        return self.ctx.n_ctx * self.kv_bytes_per_cell

    @property
    def kv_bytes_used(self) -> int:
        return self._cells_used * self.kv_bytes_per_cell

    # ---------------------------------------------------------------- cells of one member

    def check_fits(self, n_cells: int) -> None:
        """A session of `n_cells` tokens can never be held: EngineFull (its context is full)."""
        if n_cells > self.seq_cells:
            raise EngineFull(f"session needs {n_cells} KV cells; a session may hold {self.seq_cells}")

    def decoded(self, r: Residency, end: int) -> None:
        """A decode wrote the member's cells up to `end`."""
        self._cells_used += end - r.n_decoded
        r.n_decoded = end
        r.last_used = time.monotonic()

    def discard_partial(self, r: Residency) -> None:
        """A decode failed: drop any cells it wrote past `n_decoded`."""
        if r.resident:
            self.ctx.truncate(r.seq, r.n_decoded)

    def truncate(self, r: Residency, n: int) -> None:
        """Keep the first `n` decoded tokens (a rollback or a rejected draft)."""
        if r.n_decoded <= n:
            return
        if r.resident:
            self.ctx.truncate(r.seq, n)
            self._cells_used -= r.n_decoded - n
            r.n_decoded = n
        else:
            self._drop_saved(r)  # a saved state past the cut is of no use: rebuilt on return

    def forget_last(self, r: Residency) -> None:
        """Drop the last decoded token so that decoding it again yields fresh logits."""
        if r.n_decoded > 0:
            self.truncate(r, r.n_decoded - 1)

    # ---------------------------------------------------------------- residency (the budget)

    def release(self, r: Residency) -> None:
        """Give back a member's sequence slot and cells (a saved state stays)."""
        if r.resident:
            self.ctx.clear(r.seq)
            self._free.append(r.seq)
            r.seq = -1
            self._cells_used -= r.n_decoded
            if r.saved is None:  # nothing kept: rebuilt from the history when it returns
                r.n_decoded = 0

    def ensure(self, r: Residency, cells: int, n_history: int = 0) -> None:
        """The member holds a slot and `cells` more free cells, evicting others if need be; else EngineFull."""
        if not self.make_room(r, cells, frozenset(), n_history=n_history):
            raise EngineFull(f"no KV room for {cells} more cells; the budget is {self.ctx.n_ctx} cells")

    def make_room(
        self,
        r: Residency,
        cells: int,
        protect: frozenset[int] | set[int],
        pending: frozenset[int] | set[int] = frozenset(),
        n_history: int = 0,
    ) -> bool:
        """Ensure `r` holds a slot (restoring its state) and `cells` more cells are free, evicting sessions
        outside `protect`: its own owner's first, then least recently used (those in `pending` last).
        False if it cannot; ChurnLimited if only evictions its owner's churn budget cannot pay would do."""
        need_slot = not r.resident
        restore = r.n_decoded if need_slot and r.saved is not None else 0
        victims = self._victims(r.handle, r.owner, protect, pending)
        while (need_slot and not self._free) or self.ctx.n_ctx - self._cells_used < cells + restore:
            if not victims:
                return False
            victim = victims.pop(0)
            forced = victim.n_decoded if self.evict_mode == "recompute" else 0
            if forced:
                wait = self.churn.wait_s(r.owner)
                if wait > 0:
                    self.stats.churn_refusals += 1
                    raise ChurnLimited(self.churn.refusal(r.owner, wait))
            self._evict(victim)
            self.churn.charge(r.owner, forced)
        if need_slot:
            r.seq = self._free.pop()
            self.ctx.clear(r.seq)
            if r.saved is not None:
                self.ctx.load_seq(r.seq, r.saved)
                self.stats.saved_bytes -= len(r.saved)
                r.saved = None
                self._cells_used += r.n_decoded
                self.stats.restores_loaded += 1
            elif r.evicted:
                self.stats.restores_recomputed += 1
                self.stats.recomputed_tokens += n_history
            r.evicted = False
        return True

    def _victims(
        self, handle: int, owner: Owner, protect: frozenset[int] | set[int], pending: frozenset[int] | set[int]
    ) -> list[Residency]:
        """Resident sessions that may be evicted: `owner`'s own first (a key's churn falls on the key),
        then idle ones before those with a request queued, least recently used first within each. While
        one of the owner's other sessions holds a slot for this very batch, none of another owner: the
        request waits a batch for its sibling rather than evict a stranger."""
        resident = [x for x in self._members.values() if x.resident and x.handle != handle]
        mine = [x for x in resident if owner.name and x.owner.name == owner.name]
        if any(x.handle in protect for x in mine):
            resident = mine
        cands = (x for x in resident if x.handle not in protect)
        return sorted(cands, key=lambda x: (x.owner.name != owner.name, x.handle in pending, x.last_used))

    def _evict(self, r: Residency) -> None:
        if self.evict_mode == "save" and r.n_decoded > 0:
            state = self.ctx.save_seq(r.seq)
            while self.stats.saved_bytes + len(state) > self.max_saved_bytes and self._drop_oldest_saved():
                pass
            if self.stats.saved_bytes + len(state) <= self.max_saved_bytes:
                r.saved = state
                self.stats.saved_bytes += len(state)
        self.release(r)
        r.evicted = True
        self.stats.evictions += 1

    def _drop_saved(self, r: Residency) -> None:
        if r.saved is not None:
            self.stats.saved_bytes -= len(r.saved)
            r.saved = None
            if not r.resident:
                r.n_decoded = 0

    def _drop_oldest_saved(self) -> bool:
        saved = [x for x in self._members.values() if x.saved is not None and not x.resident]
        if not saved:
            return False
        self._drop_saved(min(saved, key=lambda x: x.last_used))
        return True


class ChurnBudget:
    """KV cells per minute each owner's sessions may force others to recompute (a token bucket per owner).

    Why: in "recompute" mode an eviction costs the victim a re-prefill of its whole history, engine time
    every session waits for. A client that syncs and rolls back in a loop over few KV slots could make
    that cost without bound while staying within its token quotas. The bucket may go into debt by one
    eviction (a victim larger than the budget would otherwise never be evictable); while it is in debt
    the owner evicts nothing. Used on the engine thread only, like the pool."""

    def __init__(self) -> None:
        self._level: dict[str, tuple[float, float]] = {}  # owner name -> (cells left, when)

    def _now_level(self, owner: Owner) -> float:
        limit = owner.kv_churn_per_minute
        assert limit is not None
        level, t = self._level.get(owner.name, (float(limit), time.monotonic()))
        now = time.monotonic()
        return min(float(limit), level + (now - t) * limit / 60.0)

    def wait_s(self, owner: Owner) -> float:
        """0 when `owner` may evict now, else the seconds until its budget is out of debt."""
        limit = owner.kv_churn_per_minute
        if limit is None:
            return 0.0
        if limit <= 0:
            return float("inf")
        level = self._now_level(owner)
        return 0.0 if level > 0 else (1.0 - level) * 60.0 / limit

    def charge(self, owner: Owner, cells: int) -> None:
        if owner.kv_churn_per_minute is None:
            return
        self._level[owner.name] = (self._now_level(owner) - cells, time.monotonic())

    @staticmethod
    def refusal(owner: Owner, wait_s: float) -> str:
        when = "later" if wait_s == float("inf") else f"in {wait_s:.1f} s"
        return (
            f"KV churn: the sessions of {owner.name!r} made other sessions recompute more than their budget of "
            f"{owner.kv_churn_per_minute} KV cells per minute (evicted by syncs and rollbacks beyond the free "
            f"KV slots); retry {when}, or keep fewer sessions open at once"
        )


def kv_bytes_per_cell(model: LlamaModel) -> int:
    """Bytes one token takes in the KV cache (f16 keys and values, every layer)."""
    n_layer = int(lc.llama_model_n_layer(model.ptr))
    n_head = max(1, int(lc.llama_model_n_head(model.ptr)))
    n_head_kv = int(lc.llama_model_n_head_kv(model.ptr))
    head_dim = model.n_embd // n_head
    return 2 * n_layer * n_head_kv * head_dim * 2
