"""Fit the fleet simulator's CPU cost model from a micro-measurement of the real cloud engine.

    python scripts/fit_cpu_cost.py [--out build/fleet/cpu_fit.json] [--batches 1,2,4,8,16,24,32]

Two measurements, neither of them `scripts/loadtest.py` (which the fit is validated against):

1. **Step time against batch size.** `CloudEngine.step` (the very call the server's batch
   scheduler makes) is timed on the loadtest's item shape: each of b sessions appends its
   `--edge-tokens` device tokens and asks for a hard token, so an item decodes the previous
   cloud token, the device tokens and writes one. Median over `--steps` steps per batch size.
2. **What a round trip costs besides the step.** A real `tokenrouter-cloud` server on loopback,
   one WebSocket session, closed loop (no think time): the median hard-token latency minus the
   step time of one item is the per-request overhead (framing, JSON, two event loops, loopback).
   Then the same after a fixed idle gap (5 and 50 ms, not loadtest's think times): a step that
   starts once the CPU has gone idle is slower (a halted guest CPU's cold caches; the queue wait
   stays ~0.1 ms), each such excess kept (`wake_ms`).

Writes a JSON preset for `edge_client.replay.fleet.CostModel.from_json` (the fitted curve, the
overhead, the machine and the date), which `tokenrouter-replay simulate --cost FILE` reads.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import os
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cloud_server.batch import GENERATE, Request  # noqa: E402
from cloud_server.engine import CloudEngine  # noqa: E402
from models.registry import model_info  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402

QUESTION = [{"role": "user", "content": "how do you say hello in japanese"}]


def time_steps(engine: CloudEngine, batch: int, steps: int, edge_tokens: int, rng: random.Random) -> list[float]:
    """Milliseconds of `steps` engine steps with `batch` sessions, each asking for a hard token."""
    prompt = engine.chat_tokens(QUESTION)
    handles = [engine.open(prompt, SamplingParams()) for _ in range(batch)]
    try:
        for h in handles:  # the prompts' prefill, as after a hello (not timed)
            engine.prefill(h)
        out = []
        for _ in range(steps):
            reqs = []
            for h in handles:
                if len(engine.history(h)) - len(prompt) > 160:  # loadtest's --max-history: a new answer
                    engine.rollback(h, len(prompt))
                engine.append(h, [rng.randrange(100, 40000) for _ in range(edge_tokens)])
                reqs.append(Request(h, GENERATE, concurrent.futures.Future(), None))
            t0 = time.perf_counter()
            report = engine.step(reqs, engine.n_batch, None)
            out.append((time.perf_counter() - t0) * 1000.0)
            assert all(o.done for o in report.outcomes), "a step left a hard token unwritten"
        return out
    finally:
        for h in handles:
            engine.close(h)


async def closed_loop_ms(url: str, key: str, n: int, edge_tokens: int, idle_ms: float = 0.0) -> list[float]:
    """Hard-token round trips of one session on a real server, no think time (or a fixed `idle_ms` before
    each request: what a request pays when it finds the server idle)."""
    from websockets.asyncio.client import connect

    from shared.protocol import PROTOCOL_VERSION, Accept, Generate, Hello, Rollback, Tokens, decode, encode

    info_url = url.replace("ws://", "http://").rsplit("/v1/route", 1)[0] + "/v1/info"
    import urllib.request

    with urllib.request.urlopen(info_url, timeout=10) as r:
        info = json.loads(r.read())
    rng = random.Random(1)
    async with connect(url, compression=None, max_size=1 << 22) as ws:
        hello = Hello(
            version=PROTOCOL_VERSION,
            api_key=key,
            edge_model=info["model_fingerprint"],
            tokenizer=info["tokenizer_fingerprint"],
            messages=QUESTION,
        )
        await ws.send(encode(hello))
        acc = decode(await ws.recv())
        assert isinstance(acc, Accept), acc
        n_prompt = pos = acc.n_prompt
        out = []
        for rid in range(1, n + 1):
            if pos - n_prompt > 160:
                await ws.send(encode(Rollback(position=n_prompt)))
                pos = n_prompt
            mine = [rng.randrange(100, 40000) for _ in range(edge_tokens)]
            if idle_ms:
                await asyncio.sleep(idle_ms / 1000.0)
            t0 = time.perf_counter()
            await ws.send(encode(Generate(request_id=rid, position=pos, tokens=mine)))
            while not isinstance(msg := decode(await ws.recv()), Tokens):
                pass
            out.append((time.perf_counter() - t0) * 1000.0)
            pos += len(mine) + len(msg.ids)
        return out[10:]  # the first requests warm caches


IDLE_MS = (5.0, 50.0)  # the idle gaps measured: one short (no wake-up cost here), one long


def measure_overhead(model: str, n: int, edge_tokens: int) -> tuple[list[float], dict[float, list[float]]]:
    """Closed-loop round trips, and round trips after each of IDLE_MS of idle (not loadtest's think times)."""
    from cloud_server.local import LocalCloudServer

    extra = ["--threads", "1", "--kv-layout", "split", "--max-messages-per-s", "100000", "--max-sessions", "8"]
    with LocalCloudServer(model=model, extra_args=extra) as server:
        closed = asyncio.run(closed_loop_ms(server.url, server.api_key, n, edge_tokens))
        idle = {g: asyncio.run(closed_loop_ms(server.url, server.api_key, n, edge_tokens, g)) for g in IDLE_MS}
    return closed, idle


def wake_cost(closed: list[float], idle: dict[float, list[float]]) -> tuple[float, list[float]]:
    """(wake_after_ms, wake_ms): what a round trip after a long idle pays over the closed loop's median,
    each request's excess; paid past the midpoint of the shortest gap with no excess at p95 and the long one."""
    base = statistics.median(closed)
    short, long_ = IDLE_MS
    excess = sorted(round(max(0.0, r - base), 2) for r in idle[long_])
    after = (short + long_) / 2 if _p95(idle[short]) <= _p95(closed) * 1.1 else short
    return after, excess


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-q4_1")
    ap.add_argument("--batches", default="1,2,4,8,16,24,32")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per batch size")
    ap.add_argument("--edge-tokens", type=int, default=3, help="device tokens per hard token (loadtest's default)")
    ap.add_argument("--round-trips", type=int, default=150, help="closed-loop round trips for the overhead")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "fleet" / "cpu_fit.json")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    engine = CloudEngine(
        model_info(args.model), n_ctx=8192, max_sessions=max(batches) + 4, threads=1, kv_layout="split"
    )
    rng = random.Random(0)
    points = []
    one_p95 = 0.0
    spreads = []  # ln(p95 / p50) of each batch size's steps: the step time's spread
    try:
        time_steps(engine, 1, 5, args.edge_tokens, rng)  # warm-up
        for b in batches:
            ms = time_steps(engine, b, args.steps, args.edge_tokens, rng)
            points.append([b, round(statistics.median(ms), 3)])
            spreads.append(math.log(_p95(ms) / statistics.median(ms)))
            if b == 1:
                one_p95 = _p95(ms)
            print(f"batch {b:3d}: step p50 {statistics.median(ms):7.2f} ms", file=sys.stderr)
    finally:
        engine.close_all()
    rt, idle = measure_overhead(args.model, args.round_trips, args.edge_tokens)
    wake_after, wake = wake_cost(rt, idle)
    for g, r in idle.items():
        print(f"after {g:.0f} ms idle: p50 {statistics.median(r):.2f} ms, p95 {_p95(r):.2f} ms", file=sys.stderr)
    overhead = max(statistics.median(rt) - points[0][1], 0.0)
    overhead_p95 = max(_p95(rt) - one_p95, overhead)  # what the round trip's tail adds to the step's
    print(
        f"closed loop, 1 session: p50 {statistics.median(rt):.2f} ms, p95 {_p95(rt):.2f} ms -> overhead {overhead:.2f} ms",
        file=sys.stderr,
    )
    preset = {
        "name": "cpu-fit",
        "gpu": "none (CPU: " + _cpu() + ")",
        "model": args.model,
        "tp": 1,
        "gpus_per_replica": 1,
        "curve": points,
        "curve_tokens_per_seq": args.edge_tokens + 1,
        "per_extra_token_ms": 0.0,
        "max_seqs": 256,
        "kv_tokens": 8192,
        "max_batch_tokens": 512,
        "request_overhead_ms": round(overhead, 3),
        # lognormal spread of a step's time: the median of ln(p95/p50) over batch sizes, / 1.645
        "step_sigma": round(statistics.median(spreads) / 1.645, 4),
        "overhead_sigma": round(math.log(max(overhead_p95, 1e-3) / max(overhead, 1e-3)) / 1.645, 4),
        "wake_after_ms": wake_after,
        "wake_ms": wake,
        "source": f"scripts/fit_cpu_cost.py on {date.today().isoformat()}: CloudEngine.step medians "
        f"({args.steps} steps per batch, {args.edge_tokens}+1 tokens per item); overhead = closed-loop "
        f"round trip p50 minus the 1-item step; load avg {os.getloadavg()[0]:.2f} at the end",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(preset, indent=2))
    print(json.dumps(preset, indent=2))


def _p95(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(0.95 * (len(v) - 1))))]


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


if __name__ == "__main__":
    main()
