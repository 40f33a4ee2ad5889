"""The fleet simulator (edge_client/replay/fleet.py) and its trace format (traces.py).

Behaviour it must get right: one stream under a constant step time is charged exactly its trace's
passes; a flat batch curve makes more streams free; a KV budget smaller than the streams queues
them and raises the tail; GPUs needed never falls as streams grow; traces survive a round trip;
a real replay writes traces the simulator reads (one CLINC150 query, two policies, a real server:
~10 s, marked slow because it needs a cloud server).
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from dataclasses import replace

import pytest

from edge_client.replay.cli import main as replay_main
from edge_client.replay.fleet import (
    H100_70B_TP4,
    CostModel,
    SimOptions,
    Targets,
    gpus_needed,
    simulate,
    streams_per_replica,
)
from edge_client.replay.traces import (
    TRACE_VERSION,
    TurnTrace,
    loadtest_turn,
    read_traces,
    trace_from_row,
    write_traces,
)

FLAT = CostModel(name="flat", gpu="test", model="test", tp=1, curve=((1, 10.0), (256, 10.0)), kv_tokens=1 << 20)


def routed(n: int = 20, asks: tuple[int, ...] = (2, 7, 12), device_ms: float = 0.0) -> TurnTrace:
    """A per-token turn: the device waits at `asks`, one pass each, no background work."""
    return TurnTrace(
        policy="router-sync",
        session="s",
        turn=0,
        n_tokens=n,
        cloud_positions=list(asks),
        request_positions=list(asks),
        first_clause_index=5,
        passes=len(asks),
        prefill_tokens=0,
        generate_tokens=len(asks),
        verify_tokens=0,
        guess_tokens=0,
        bytes_up=0,
        bytes_down=0,
        device_ms=device_ms,
    )


def test_one_stream_under_a_constant_step_is_charged_exactly_its_passes():
    trace = routed()
    opts = SimOptions(streams=1, duration_s=20.0, warmup_s=1.0, rtt_ms=0.0)
    res = simulate(FLAT, [trace], opts)
    assert res.turns > 100
    assert min(res.request_ms) == pytest.approx(10.0) and max(res.request_ms) == pytest.approx(10.0)  # one step each
    per_turn_busy = res.busy_ms / (res.turns + 1)  # the window may hold part of one more turn
    assert per_turn_busy == pytest.approx(trace.passes * 10.0, rel=0.02)
    assert res.summary()["mean_batch"] == 1.0


def test_a_flat_batch_curve_makes_more_streams_free():
    trace = routed(device_ms=40.0)
    one = simulate(FLAT, [trace], SimOptions(streams=8, duration_s=10.0, warmup_s=1.0, rtt_ms=4.0)).summary()
    two = simulate(FLAT, [trace], SimOptions(streams=16, duration_s=10.0, warmup_s=1.0, rtt_ms=4.0)).summary()
    assert two["request_ms_p50"] == pytest.approx(one["request_ms_p50"], rel=0.25)
    assert two["per_token_ms_p99"] == pytest.approx(one["per_token_ms_p99"], rel=0.25)
    assert two["hard_tokens_per_s"] == pytest.approx(2 * one["hard_tokens_per_s"], rel=0.1)


def test_a_kv_budget_smaller_than_the_streams_queues_them_and_raises_p99():
    trace = routed(device_ms=40.0)
    opts = SimOptions(streams=16, duration_s=10.0, warmup_s=1.0, rtt_ms=2.0, context_tokens=100)
    roomy = simulate(FLAT, [trace], opts).summary()
    tight = simulate(replace(FLAT, kv_tokens=400), [trace], opts).summary()  # 4 streams fit of 16
    assert roomy["kv_wait_ms_p99"] == 0.0
    assert tight["kv_wait_ms_p99"] > 0.0
    assert tight["first_clause_ms_p99"] > roomy["first_clause_ms_p99"] * 2
    assert tight["hard_tokens_per_s"] < roomy["hard_tokens_per_s"]


def test_gpus_needed_grows_with_streams_and_tighter_targets():
    trace = routed(n=30, asks=(1, 9, 17, 25), device_ms=300.0)
    opts = SimOptions(streams=1, duration_s=5.0, warmup_s=2.0, rtt_ms=2.0, think_ms=2000.0)
    per, summary = streams_per_replica(H100_70B_TP4, [trace], opts, Targets(150.0, 1000.0))
    assert per > 1 and summary is not None
    counts = [gpus_needed(n, per, H100_70B_TP4.tp) for n in (1, 10, 100, 1000, 12000)]
    assert counts == sorted(counts) and counts[0] == H100_70B_TP4.tp
    tighter, _ = streams_per_replica(H100_70B_TP4, [trace], opts, Targets(40.0, 1000.0))
    assert tighter <= per
    assert gpus_needed(100, 0, 4) is None  # a target not met by one stream alone


def test_loadtest_workload_under_a_fitted_curve():
    """One stream of loadtest's device: hard tokens/s = 1 / (think + step), and batches form with more streams."""
    cost = replace(FLAT, curve=((1, 30.0), (32, 860.0)), curve_tokens_per_seq=4, request_overhead_ms=2.0)
    one = simulate(cost, [loadtest_turn()], SimOptions(streams=1, duration_s=30.0, warmup_s=1.0, rtt_ms=0.0))
    assert one.summary()["request_ms_p50"] == pytest.approx(32.0)
    assert one.summary()["hard_tokens_per_s"] == pytest.approx(1000.0 / (3 * 7.7 + 32.0), rel=0.02)
    many = simulate(cost, [loadtest_turn()], SimOptions(streams=8, duration_s=30.0, warmup_s=1.0, rtt_ms=0.0))
    assert many.summary()["mean_batch"] > 2


def test_a_request_that_finds_the_replica_idle_pays_its_wake_up_and_a_busy_replica_does_not():
    """The wake-up cost (fitted on a CPU: threads that slept) goes to a request arriving after at least
    `wake_after_ms` of idle, never to one that finds the replica busy or idle for less."""
    woken = replace(FLAT, wake_after_ms=20.0, wake_ms=(5.0,))
    opts = SimOptions(streams=1, duration_s=10.0, warmup_s=1.0, rtt_ms=0.0)
    idle_long = simulate(woken, [routed(device_ms=300.0)], opts)  # the device thinks ~100 ms between asks
    assert min(idle_long.request_ms) == pytest.approx(15.0) and max(idle_long.request_ms) == pytest.approx(15.0)
    idle_short = simulate(woken, [routed(asks=tuple(range(20)), device_ms=0.0)], opts)  # asks back to back
    assert min(idle_short.request_ms) == pytest.approx(10.0) and max(idle_short.request_ms) == pytest.approx(10.0)
    assert CostModel.from_json(woken.to_json()) == woken


def test_traces_round_trip(tmp_path):
    traces = [routed(), replace(routed(n=5, asks=(0,)), streamed=True, policy="cloud", measured={"ttft_ms": 3.5})]
    path = tmp_path / "traces.jsonl"
    assert write_traces(path, traces) == 2
    assert read_traces(path) == traces
    bad = tmp_path / "old.jsonl"
    bad.write_text(json.dumps({**traces[0].to_json(), "version": TRACE_VERSION + 1}) + "\n")
    with pytest.raises(ValueError, match="version"):
        read_traces(bad)


def _row(policy: str, routes: list[str], emit: list[float], trips: int, lookahead: list[int] | None = None) -> dict:
    traffic = {"round_trips": trips, "wait_ms": 10.0, "bytes_up": 1, "bytes_down": 2, "cloud_compute_ms": 5.0}
    return {
        "policy": policy,
        "session": "q1",
        "turn": 0,
        "tokens": list(range(len(routes))),
        "routes": routes,
        "emit_ms": emit,
        "lookahead_positions": lookahead or [],
        "total_ms": emit[-1],
        "traffic": traffic | {"passes": trips, "generate_tokens": trips},
    }


def test_a_row_becomes_a_trace_with_its_waits():
    sync = trace_from_row(_row("router-sync", ["edge", "cloud", "edge", "cloud"], [5, 30, 35, 60], 2), 2)
    assert sync.request_positions == [1, 3] and not sync.streamed and sync.holds_from is None
    verify = trace_from_row(_row("router-verify", ["edge"] * 4 + ["cloud"], [50, 50, 50, 90, 95], 2), 3)
    assert verify.request_positions == [0, 3] and verify.holds_from == 0  # released after the two longest pauses
    cloud = trace_from_row(_row("cloud", ["cloud"] * 3, [40, 45, 50], 1), 1)
    assert cloud.streamed and cloud.request_positions == [0] and cloud.device_first_ms == 0.0


@pytest.mark.slow
def test_a_real_replay_writes_traces_the_simulator_reads(tmp_path):
    out = tmp_path / "replay"
    args = ["--profile", "lan", "--limit", "1", "--policies", "cloud,router-sync", "--no-plots", "--no-progress"]
    with redirect_stdout(io.StringIO()):
        assert replay_main([*args, "--max-tokens", "16", "--out", str(out)]) == 0
    traces = read_traces(out / "traces.jsonl")
    assert {t.policy for t in traces} == {"cloud", "router-sync"}
    for t in traces:
        assert len(t.request_positions) <= t.n_tokens and t.passes >= len(t.request_positions)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = replay_main(["simulate", "--traces", str(out), "--fleet", "1000", "--duration", "5", "--json"])
    assert rc == 0
    report = json.loads(buf.getvalue())
    assert set(report["policies"]) == {"cloud", "router-sync"}
    for p in report["policies"].values():
        assert p["gpus_needed"] is None or p["gpus_needed"] % H100_70B_TP4.tp == 0
