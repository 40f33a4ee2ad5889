"""Per-turn traces: what one answer asked of the cloud, in a form a fleet simulator can replay.

A replay (tokenrouter-replay) writes `traces.jsonl` into its --out directory: one `TurnTrace` per
(session, turn, policy), from the answer's own record (routes, release times, traffic and the
cloud's work). The fleet simulator (fleet.py) replays thousands of streams of these traces
against a cost model of a GPU fleet. Why a format of its own rather than the replay's rows:
the simulator needs only the cloud's share of the work and where the device waited, and
`scripts/loadtest.py`'s synthetic workload is written in the same format (`loadtest_turn`),
so the simulator is validated on exactly what it later extrapolates from.

What a trace cannot say (the answer record does not hold it): the size of each request. The
simulator spreads the turn's tokens evenly over its round trips and background passes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

from edge_client.replay.metrics import first_clause_index

TRACE_VERSION = 1
HOLDING_POLICIES = ("router-verify", "router-check", "speculative")  # every draft waits for its verdict
CHECK_AFTER_FIRST = "router-check-after-first-clause"  # drafts wait from the second clause on


@dataclass(slots=True)
class TurnTrace:
    """One answer: where the device waited on the cloud and what the cloud processed.

    Positions are answer token indices. `request_positions`: one per round trip the device waited
    for (the token released when its reply came). `holds_from`: drafted tokens from this index on
    are released only with the next reply (verify/check policies); None: released when written."""

    policy: str
    session: str
    turn: int
    n_tokens: int
    cloud_positions: list[int]
    request_positions: list[int]
    first_clause_index: int
    passes: int
    prefill_tokens: int
    generate_tokens: int
    verify_tokens: int
    guess_tokens: int
    bytes_up: int
    bytes_down: int
    device_ms: float  # device compute of the turn (wall time minus the waits on the cloud)
    device_first_ms: float = 0.0  # the part of device_ms before the first token (the prompt's prefill)
    think_ms: float = 0.0  # the pause before this turn (the person speaking, listening); 0: unknown
    streamed: bool = False  # the cloud wrote the whole answer in one streamed request (policy cloud)
    holds_from: int | None = None
    measured: dict[str, float | None] = field(default_factory=dict)  # the replay's own figures, for comparison
    version: int = TRACE_VERSION

    @property
    def n_cloud(self) -> int:
        return len(self.cloud_positions)

    @property
    def waited_tokens(self) -> int:
        """Tokens the cloud processed on the way to a reply the device waited for."""
        return self.generate_tokens + self.verify_tokens

    @property
    def background_tokens(self) -> int:
        """Tokens processed while the device went on (eager syncs, prompt prefill, lookahead guesses)."""
        return self.prefill_tokens + self.guess_tokens

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TurnTrace:
        version = obj.get("version", 0)
        if version != TRACE_VERSION:
            raise ValueError(
                f"trace version {version} is not {TRACE_VERSION}; re-record it with this tokenrouter-replay"
            )
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in names})


def write_traces(path: Path, traces: Iterable[TurnTrace]) -> int:
    """JSONL, one trace a line; returns how many were written."""
    n = 0
    with path.open("w") as fh:
        for t in traces:
            fh.write(json.dumps(t.to_json()) + "\n")
            n += 1
    return n


def read_traces(path: Path) -> list[TurnTrace]:
    return [TurnTrace.from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- from a replay


def _request_positions(row: dict[str, Any], streamed: bool) -> list[int]:
    """Where the device waited: the cloud-written positions that were not lookahead guesses when
    they account for every round trip (per-token policies); otherwise the tokens released after
    the longest pauses (a verify's verdict releases its clause at once after a wait)."""
    n, trips = len(row["tokens"]), int(row["traffic"]["round_trips"])
    if n == 0 or trips == 0:
        return []
    if streamed:
        return [0]
    guessed = set(row.get("lookahead_positions") or [])
    asked = [i for i, r in enumerate(row["routes"]) if r == "cloud" and i not in guessed]
    if len(asked) == trips:
        return asked
    emit = row["emit_ms"]
    gaps = [emit[0], *(b - a for a, b in zip(emit, emit[1:]))]
    longest = sorted(range(n), key=lambda i: gaps[i], reverse=True)[: min(trips, n)]
    return sorted(longest)


def trace_from_row(row: dict[str, Any], first_clause_index: int, think_ms: float = 0.0) -> TurnTrace:
    """A replay row (Answer.to_json plus session, turn, policy) -> its trace."""
    traffic, n = row["traffic"], len(row["tokens"])
    streamed = row.get("cloud_mode") == "stream" or (row["policy"] in ("cloud", "session") and n > 0)
    streamed = streamed and all(r == "cloud" for r in row["routes"])
    requests = _request_positions(row, streamed)
    device_ms = max(float(row["total_ms"]) - float(traffic["wait_ms"]), 0.0)
    first = 0.0 if (not n or (requests and requests[0] == 0)) else min(float(row["emit_ms"][0]), device_ms)
    policy = row["policy"]
    base = policy.split(":")[0]
    holds = 0 if base in HOLDING_POLICIES else (first_clause_index + 2 if base == CHECK_AFTER_FIRST else None)
    return TurnTrace(
        policy=policy,
        session=str(row["session"]),
        turn=int(row["turn"]),
        n_tokens=n,
        cloud_positions=[i for i, r in enumerate(row["routes"]) if r == "cloud"],
        request_positions=requests,
        first_clause_index=first_clause_index,
        passes=int(traffic.get("passes", 0)),
        prefill_tokens=int(traffic.get("prefill_tokens", 0)),
        generate_tokens=int(traffic.get("generate_tokens", 0)),
        verify_tokens=int(traffic.get("verify_tokens", 0)),
        guess_tokens=int(traffic.get("guess_tokens", 0)),
        bytes_up=int(traffic["bytes_up"]),
        bytes_down=int(traffic["bytes_down"]),
        device_ms=round(device_ms, 3),
        device_first_ms=round(first, 3),
        think_ms=think_ms,
        streamed=streamed,
        holds_from=holds,
        measured={
            "ttft_ms": row["emit_ms"][0] if n else None,
            "first_clause_ms": row["emit_ms"][first_clause_index] if n else None,
            "total_ms": row["total_ms"],
            "wait_ms": traffic["wait_ms"],
            "cloud_compute_ms": traffic["cloud_compute_ms"],
        },
    )


def traces_from_rows(rows: Iterable[dict[str, Any]]) -> list[TurnTrace]:
    """Every replayed answer's trace, in the rows' order."""
    out = []
    for row in rows:
        idx = first_clause_index(row["pieces"]) if row["tokens"] else 0
        out.append(trace_from_row(row, idx))
    return out


# --------------------------------------------------------------------------- loadtest's workload


def loadtest_turn(edge_tokens: int = 3, think_ms: float = 7.7, max_history: int = 160) -> TurnTrace:
    """scripts/loadtest.py's device as one trace: `edge_tokens` device tokens ("thinking"
    `think_ms` each), then a hard token the device waits for, until the history passes
    `max_history` and the device rolls back to the prompt (a new answer; the rollback costs the
    cloud nothing). Each generate carries the device tokens and the previous cloud token."""
    per = edge_tokens + 1
    hard = max_history // per + 1  # loadtest rolls back once pos - n_prompt > max_history
    n = hard * per
    positions = [i * per + edge_tokens for i in range(hard)]
    return TurnTrace(
        policy="loadtest",
        session="loadtest",
        turn=0,
        n_tokens=n,
        cloud_positions=positions,
        request_positions=positions,
        first_clause_index=positions[0],
        passes=hard,
        prefill_tokens=0,  # loadtest measures after every prompt's prefill
        generate_tokens=hard * per,
        verify_tokens=0,
        guess_tokens=0,
        bytes_up=0,
        bytes_down=0,
        device_ms=think_ms * edge_tokens * hard,
    )
