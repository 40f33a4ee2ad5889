"""Load test: N simulated devices against one cloud server over loopback, bounded in time.

    python scripts/loadtest.py --sessions 32 --duration 20 [--json]

Two phases on the same server, so the ratios are side by side: one device
alone, then N devices at once. Each simulated device does what a real one
does on the wire: hello with a question (CLINC150 train queries), then
repeatedly sends its own `--edge-tokens` tokens with a hard-token `generate`
and waits for the cloud's token, "thinking" in between for as long as the
device model would take to write its tokens (`--think-ms`, default 7.7 ms a
token: SmolLM2-135M at ~130 tok/s). When its history passes `--max-history`
it rolls back to the prompt (a new answer).

Checked per request: the reply's request id and position (a missing reply is
a lost token, a second reply or a reused position a duplicated one).
Reported: hard-token latency p50/p95, aggregate hard tokens/s, server memory
(RSS and KV bytes from /metrics vs the budget), errors, lost/duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from websockets.asyncio.client import connect  # noqa: E402

from shared.protocol import PROTOCOL_VERSION, Accept, Error, Generate, Hello, Rollback, Tokens, decode, encode  # noqa: E402

CLINC = Path("/work/shared/datasets/clinc150/data_full.json")
FALLBACK_QUESTIONS = [
    "what is the capital of france",
    "set a timer for ten minutes",
    "how do you say hello in japanese",
    "what's the weather like",
]


@dataclass
class PhaseStats:
    """One phase. Measurement starts once every device has its first token (prompt prefills done)."""

    n_devices: int = 1
    duration: float = 10.0
    warmup_cap_s: float = 120.0
    t_start: float = field(default_factory=time.monotonic)
    ready: int = 0
    measure_from: float | None = None
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    error_codes: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    duplicated: int = 0
    sessions_opened: int = 0

    def mark_ready(self) -> None:
        self.ready += 1
        if self.ready == self.n_devices and self.measure_from is None:
            self.measure_from = time.monotonic()

    def running(self) -> bool:
        now = time.monotonic()
        if self.measure_from is None:
            if now - self.t_start > self.warmup_cap_s:  # some device never got going: measure anyway
                self.measure_from = now
            return True
        return now < self.measure_from + self.duration

    def measuring(self, t: float) -> bool:
        return self.measure_from is not None and t >= self.measure_from


def questions(n: int, seed: int) -> list[str]:
    try:
        train = json.loads(CLINC.read_text())["train"]
        pool = [q for q, _ in train]
    except (OSError, KeyError, ValueError):
        pool = FALLBACK_QUESTIONS
    rng = random.Random(seed)
    return [rng.choice(pool) for _ in range(n)]


async def device(
    url: str, key: str, info: dict, question: str, args: argparse.Namespace, st: PhaseStats, seed: int
) -> None:
    state = {"first": True}
    try:
        await _device(url, key, info, question, args, st, seed, state)
    finally:
        if state["first"]:  # never got going: do not hold the measurement back
            st.mark_ready()


async def _device(
    url: str, key: str, info: dict, question: str, args: argparse.Namespace, st: PhaseStats, seed: int, state: dict
) -> None:
    rng = random.Random(seed)
    async with connect(url, compression=None, open_timeout=30, max_size=1 << 22) as ws:
        hello = Hello(
            version=PROTOCOL_VERSION,
            api_key=key,
            edge_model=info["model_fingerprint"],
            tokenizer=info["tokenizer_fingerprint"],
            messages=[{"role": "user", "content": question}],
        )
        await ws.send(encode(hello))
        acc = decode(await asyncio.wait_for(ws.recv(), 60))
        if not isinstance(acc, Accept):
            st.errors += 1
            st.error_codes[getattr(acc, "code", acc.type)] = st.error_codes.get(getattr(acc, "code", acc.type), 0) + 1
            return
        st.sessions_opened += 1
        n_prompt = pos = acc.n_prompt
        rid = 0
        answered: set[int] = set()
        while st.running():
            if args.think_ms > 0:
                await asyncio.sleep(args.think_ms * args.edge_tokens / 1000.0 * rng.uniform(0.5, 1.5))
            if pos - n_prompt > args.max_history:
                await ws.send(encode(Rollback(position=n_prompt)))
                pos = n_prompt
            rid += 1
            mine = [rng.randrange(100, 40000) for _ in range(args.edge_tokens)]
            t0, counted = time.perf_counter(), st.measuring(time.monotonic())
            await ws.send(encode(Generate(request_id=rid, position=pos, tokens=mine)))
            expect = pos + len(mine)
            while True:
                try:
                    msg = decode(await asyncio.wait_for(ws.recv(), args.request_timeout_s))
                except asyncio.TimeoutError:
                    st.lost += 1  # no reply: the session state is unknown, give up on this device
                    return
                if isinstance(msg, Tokens):
                    if msg.request_id in answered or msg.request_id != rid or msg.position != expect:
                        st.duplicated += 1
                        continue
                    answered.add(rid)
                    if counted and st.running():
                        st.latencies_ms.append((time.perf_counter() - t0) * 1000.0)
                    if state["first"]:
                        state["first"] = False
                        st.mark_ready()
                    pos = expect + len(msg.ids)
                    break
                if isinstance(msg, Error):
                    st.errors += 1
                    st.error_codes[msg.code] = st.error_codes.get(msg.code, 0) + 1
                    pos = expect  # the device's tokens were appended before the refusal
                    if msg.code != "busy":
                        return
                    break


class Sampler:
    """Samples server RSS and KV bytes while a phase runs."""

    def __init__(self, http_url: str, pid: int | None) -> None:
        self.http_url = http_url
        self.pid = pid
        self.rss_peak = 0
        self.kv_peak = 0.0
        self.kv_budget = 0.0

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.http_url + "/metrics", timeout=5) as r:
            out = {}
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    name, _, value = line.rpartition(" ")
                    try:
                        out[name] = float(value)
                    except ValueError:
                        pass
            return out

    async def run(self, stop: asyncio.Event) -> None:
        proc = None
        if self.pid:
            import psutil

            proc = psutil.Process(self.pid)
        while not stop.is_set():
            try:
                m = await asyncio.to_thread(self.metrics)
                self.kv_peak = max(self.kv_peak, m.get("tokenrouter_kv_bytes_used", 0.0))
                self.kv_budget = m.get("tokenrouter_kv_budget_bytes", 0.0)
                if proc is not None:
                    self.rss_peak = max(self.rss_peak, proc.memory_info().rss)
            except Exception:
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass


async def phase(
    url: str, key: str, info: dict, n: int, duration: float, args: argparse.Namespace, sampler: Sampler
) -> tuple[PhaseStats, float]:
    st = PhaseStats(n_devices=n, duration=duration)
    qs = questions(n, args.seed + n)
    stop = asyncio.Event()
    mon = asyncio.create_task(sampler.run(stop))
    results = await asyncio.gather(
        *(device(url, key, info, qs[i], args, st, args.seed * 1000 + i) for i in range(n)), return_exceptions=True
    )
    elapsed = duration if st.measure_from is not None else float("nan")
    stop.set()
    await mon
    for r in results:
        if isinstance(r, BaseException):
            st.errors += 1
            st.error_codes[type(r).__name__] = st.error_codes.get(type(r).__name__, 0) + 1
    return st, elapsed


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100.0 * (len(v) - 1))))]


def machine() -> str:
    try:
        import psutil

        mem = f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    except ImportError:
        mem = "?"
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return f"{platform.machine()} {os.cpu_count()} cores, {mem}, {platform.python_implementation()} {platform.python_version()}, load avg {load:.1f}"


async def main_async(args: argparse.Namespace) -> dict:
    server = None
    if args.url:
        url, key, pid = args.url, args.api_key or os.environ.get("TOKENROUTER_API_KEY", ""), None
        http_url = url.replace("ws://", "http://").replace("wss://", "https://").rsplit("/v1/route", 1)[0]
    else:
        from cloud_server.local import LocalCloudServer

        extra = [
            "--max-sessions",
            str(max(args.sessions, 1) + 4),
            "--n-ctx",
            str(args.n_ctx),
            "--threads",
            str(args.server_threads),
            "--kv-layout",
            args.kv_layout,
            "--max-messages-per-s",
            "100000",
            *args.server_args,
        ]
        server = LocalCloudServer(model=args.model, extra_args=extra).start()
        url, key, pid, http_url = server.url, server.api_key, server.proc.pid, server.http_url  # type: ignore[union-attr]
    try:
        with urllib.request.urlopen(http_url + "/v1/info", timeout=10) as r:
            info = json.loads(r.read())
        sampler = Sampler(http_url, pid)
        m0 = sampler.metrics()
        single, t_single = await phase(url, key, info, 1, args.duration, args, sampler)
        m1 = sampler.metrics()
        multi, t_multi = await phase(url, key, info, args.sessions, args.duration, args, sampler)
        m2 = sampler.metrics()
    finally:
        if server is not None:
            server.stop()

    def batch_mean(a: dict, b: dict) -> float:
        n = b.get("tokenrouter_batch_items_count", 0) - a.get("tokenrouter_batch_items_count", 0)
        s = b.get("tokenrouter_batch_items_sum", 0) - a.get("tokenrouter_batch_items_sum", 0)
        return s / n if n else float("nan")

    return {
        "sessions": args.sessions,
        "duration_s": args.duration,
        "edge_tokens_per_hard_token": args.edge_tokens,
        "think_ms_per_token": args.think_ms,
        "throughput_tok_s": len(multi.latencies_ms) / t_multi,
        "single_session_throughput_tok_s": len(single.latencies_ms) / t_single,
        "p50_ms": pct(multi.latencies_ms, 50),
        "p95_ms": pct(multi.latencies_ms, 95),
        "single_session_p50_ms": pct(single.latencies_ms, 50),
        "single_session_p95_ms": pct(single.latencies_ms, 95),
        "hard_tokens": len(multi.latencies_ms),
        "sessions_opened": multi.sessions_opened,
        "errors": multi.errors + single.errors,
        "error_codes": {**single.error_codes, **multi.error_codes},
        "lost_tokens": multi.lost + single.lost,
        "duplicated_tokens": multi.duplicated + single.duplicated,
        "mean_batch_items_single": batch_mean(m0, m1),
        "mean_batch_items": batch_mean(m1, m2),
        "server_rss_mib_peak": sampler.rss_peak / 2**20 if sampler.rss_peak else None,
        "kv_bytes_peak": sampler.kv_peak,
        "kv_budget_bytes": sampler.kv_budget,
        "memory_within_budget": sampler.kv_peak <= sampler.kv_budget if sampler.kv_budget else None,
        "server_threads": args.server_threads if not args.url else None,
        "kv_layout": args.kv_layout if not args.url else None,
        "model": args.model if not args.url else info.get("model"),
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per phase (two phases)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--url", help="a running server (ws://host:port/v1/route); default: start one on loopback")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--model", default="smollm2-135m-q4_1")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument(
        "--kv-layout",
        choices=("unified", "split"),
        default="split",
        help="the started server's KV layout (docs/server.md)",
    )
    ap.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="passed to tokenrouter-cloud serve (must come last)"
    )
    ap.add_argument("--edge-tokens", type=int, default=3, help="device tokens sent with each hard token")
    ap.add_argument("--think-ms", type=float, default=7.7, help="device time per device token (0: closed loop)")
    ap.add_argument("--max-history", type=int, default=160, help="answer tokens before a device starts a new answer")
    ap.add_argument("--request-timeout-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.duration <= 0:
        ap.error("--sessions must be >= 1 and --duration > 0")
    out = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"machine: {out['machine']}")
    print(
        f"1 session : {out['single_session_throughput_tok_s']:.1f} hard tok/s, p50 {out['single_session_p50_ms']:.1f} ms, p95 {out['single_session_p95_ms']:.1f} ms"
    )
    print(
        f"{args.sessions} sessions: {out['throughput_tok_s']:.1f} hard tok/s, p50 {out['p50_ms']:.1f} ms, p95 {out['p95_ms']:.1f} ms, "
        f"mean batch {out['mean_batch_items']:.1f} sessions"
    )
    print(
        f"ratios    : throughput x{out['throughput_tok_s'] / out['single_session_throughput_tok_s']:.2f}, p95 x{out['p95_ms'] / out['single_session_p95_ms']:.2f}"
    )
    print(
        f"errors {out['errors']} {out['error_codes']}, lost {out['lost_tokens']}, duplicated {out['duplicated_tokens']}"
    )
    print(
        f"memory    : server RSS peak {out['server_rss_mib_peak']} MiB, KV peak {out['kv_bytes_peak'] / 2**20:.1f} MiB of {out['kv_budget_bytes'] / 2**20:.1f} MiB budget"
    )


if __name__ == "__main__":
    main()
