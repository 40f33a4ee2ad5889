"""Fleet simulator: N concurrent streams of recorded turns against a cost model of a serving fleet.

Why: the replay measures one session at a time on this CPU; an operator asks how many GPUs N
voice streams need, cloud-only against routed, at a latency target. The simulator answers with
a discrete-event model of what the cloud server does (cloud_server/scheduler.py): each replica
runs continuous batching, one step at a time over every queued request (up to `max_seqs`
sequences and `max_batch_tokens` tokens, long prefills chunked), each step taking the cost
model's time for its sequences and tokens; a KV budget caps the streams a replica holds at
once (the others queue for it at the start of a turn); every request pays the network round
trip. Replicas are independent (sticky sessions, as the Helm chart's `sessionAffinity`), so a
fleet is one replica simulated with its share of the streams.

What it does not model: the device's own speed on other hardware (the trace's device time is
the replay machine's), failures, prefix caching across sessions, stragglers in tensor parallelism,
attention cost growing with context, and load imbalance between replicas.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterator

from edge_client.replay.traces import TurnTrace

# --------------------------------------------------------------------------- cost models


@dataclass(frozen=True)
class CostModel:
    """One replica: its step time against batch size, its limits. Times in ms."""

    name: str
    gpu: str
    model: str
    tp: int  # GPUs per replica (tensor parallel)
    curve: tuple[tuple[int, float], ...]  # (sequences in the step, step ms), each with curve_tokens_per_seq tokens
    curve_tokens_per_seq: int = 1
    per_extra_token_ms: float = 0.0  # each token beyond curve_tokens_per_seq per sequence (prefill, verify)
    max_seqs: int = 256  # sequences per step (vLLM's max_num_seqs)
    kv_tokens: int = 8192  # KV budget of the replica, in tokens
    max_batch_tokens: int = 512  # tokens per step; longer prefills are chunked
    request_overhead_ms: float = 0.0  # per request, besides the step (framing, parsing, scheduling)
    step_sigma: float = 0.0  # a step's time x lognormal(0, sigma): the spread measured on the machine
    overhead_sigma: float = 0.0  # the request overhead x lognormal(0, sigma)
    # A step that starts after the replica was idle for at least wake_after_ms takes one of wake_ms more
    # (drawn at random): on the CPU VM the engine step itself is slower once the CPU has gone idle (the
    # guest halts; caches and TLB go cold), not the threads' wake-up (the queue wait stays ~0.1 ms).
    # Measured by scripts/fit_cpu_cost.py; none on the GPU presets: not measured there
    wake_after_ms: float = 0.0
    wake_ms: tuple[float, ...] = ()
    source: str = ""

    def step_ms(self, n_seqs: int, n_tokens: int) -> float:
        """Piecewise-linear in sequences through the curve (linear past its last point), plus the extra tokens."""
        pts = self.curve
        if n_seqs <= pts[0][0]:
            base = pts[0][1]
        else:
            lo, hi = pts[-2], pts[-1]
            for a, b in zip(pts, pts[1:]):
                if n_seqs <= b[0]:
                    lo, hi = a, b
                    break
            base = lo[1] + (hi[1] - lo[1]) * (n_seqs - lo[0]) / (hi[0] - lo[0])
        extra = n_tokens - n_seqs * self.curve_tokens_per_seq
        return base + self.per_extra_token_ms * max(extra, 0)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "curve": [list(p) for p in self.curve]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CostModel:
        keep = {k: v for k, v in obj.items() if k in cls.__dataclass_fields__ and k != "gpus_per_replica"}
        keep["curve"] = tuple((int(b), float(ms)) for b, ms in obj["curve"])
        keep["wake_ms"] = tuple(float(ms) for ms in obj.get("wake_ms", ()))
        return cls(**keep)


# Llama-3.1-70B, bf16, vLLM, one replica = 4 x H100 SXM 80 GB (tensor parallel 4). Every number cited:
# - batch 1, 15 ms: docs/server.md's roofline (141 GB of weights / (4 x 3.35 TB/s) at ~70%); NVIDIA NIM's
#   published Llama-3.1-70B-Instruct ITL at concurrency 1 is 13.2 ms
#   (https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance, "Llama-3.1-70b-instruct", v1.3.0).
# - batch 8, 16.2 ms: vLLM's performance benchmark `latency_llama70B_tp4` (32 in / 128 out tokens, batch 8):
#   2077.5 ms mean / 128 steps, measured on H200 (https://buildkite.com/vllm/performance-benchmark/builds/9515);
#   an H100 is slower per step, so this point is optimistic by up to H200/H100 bandwidth (4.8/3.35).
# - batch 256, 63.5 ms: Lambda's vLLM v0.6.0 benchmark, Llama 3.1 70B, tp=4 on 4 x H100-80GB-SXM,
#   max-num-seqs 256, median ITL 63.54 ms, 2291 output tok/s
#   (https://github.com/LambdaLabsML/vllm-benchmark/blob/main/benchmark_v0.md, "vLLM v0.5.4 v.s. v0.6.0").
# - 0.071 ms per extra token: 2 x 70.6e9 FLOP at 50% of 4 x 989 TFLOPS bf16 (docs/server.md).
# - max_seqs 256: vLLM's max_num_seqs in the Lambda run above (and vLLM's default).
# - kv_tokens: (4 x 80 GB x 0.9 gpu_memory_utilization - 141 GB weights) / 327,680 B per token
#   (80 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 B) = 448k tokens.
# - request_overhead_ms 1: scheduling and detokenizing one request (vLLM v0.6.0 post above: CPU overhead is
#   what multi-step scheduling hides); an assumption, not a measurement.
H100_70B_TP4 = CostModel(
    name="h100-70b-tp4",
    gpu="4 x H100 SXM 80 GB",
    model="Llama-3.1-70B bf16 (vLLM)",
    tp=4,
    curve=((1, 15.0), (8, 16.2), (256, 63.5)),
    per_extra_token_ms=0.071,
    max_seqs=256,
    kv_tokens=448_000,
    max_batch_tokens=2048,
    request_overhead_ms=1.0,
    source="vLLM/Lambda and vLLM buildkite figures, docs/server.md roofline; see fleet.py",
)

# The same model on 8 x H100 (tensor parallel 8): Lambda's table (same page) gives 2572.8 tok/s at 33.71 ms
# against 2242.99 at 38.26 ms for 4 x H100 (FP8, 320 prompts): 0.88x the step time for 2x the GPUs.
H100_70B_TP8 = replace(
    H100_70B_TP4,
    name="h100-70b-tp8",
    gpu="8 x H100 SXM 80 GB",
    tp=8,
    curve=tuple((b, round(ms * 33.71 / 38.26, 2)) for b, ms in H100_70B_TP4.curve),
    kv_tokens=1_650_000,  # (8 x 80 GB x 0.9 - 141 GB) / 327,680 B
    source="h100-70b-tp4 scaled by Lambda's tp8/tp4 latency ratio (33.71 / 38.26 ms)",
)

PRESETS: dict[str, CostModel] = {m.name: m for m in (H100_70B_TP4, H100_70B_TP8)}


def load_cost_model(name_or_path: str) -> CostModel:
    """A preset name, or a JSON file (scripts/fit_cpu_cost.py writes one)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"no cost model {name_or_path!r}: a preset ({', '.join(PRESETS)}) or a JSON file")
    return CostModel.from_json(json.loads(path.read_text()))


# --------------------------------------------------------------------------- options and results


@dataclass(frozen=True)
class SimOptions:
    """One replica's simulation. `think_ms`: pause between a stream's turns (added to the trace's)."""

    streams: int
    duration_s: float = 60.0
    warmup_s: float = 5.0
    rtt_ms: float = 2.0
    think_ms: float = 0.0
    device_jitter: float = 0.0  # each device segment x U(1 - j, 1 + j) (loadtest: 0.5)
    context_tokens: int = 512  # KV a stream holds during a turn
    seed: int = 0


@dataclass
class SimResult:
    """What the streams saw in the measured window (after warm-up)."""

    streams: int
    window_s: float
    turns: int = 0
    answer_tokens: int = 0
    requests: int = 0
    busy_ms: float = 0.0  # steps' time in the window
    steps: int = 0
    seqs_in_steps: int = 0
    request_ms: list[float] = field(default_factory=list)  # send -> reply, each waited request
    gaps_ms: list[float] = field(default_factory=list)  # between released tokens
    ttft_ms: list[float] = field(default_factory=list)
    first_clause_ms: list[float] = field(default_factory=list)
    kv_wait_ms: list[float] = field(default_factory=list)

    def summary(self, tp: int = 1) -> dict[str, Any]:
        tok = max(self.answer_tokens, 1)
        return {
            "streams": self.streams,
            "turns": self.turns,
            "hard_tokens_per_s": round(len(self.request_ms) / self.window_s, 3),
            "request_ms_p50": pct(self.request_ms, 50),
            "request_ms_p95": pct(self.request_ms, 95),
            "per_token_ms_p50": pct(self.gaps_ms, 50),
            "per_token_ms_p99": pct(self.gaps_ms, 99),
            "ttft_ms_p50": pct(self.ttft_ms, 50),
            "first_clause_ms_p50": pct(self.first_clause_ms, 50),
            "first_clause_ms_p99": pct(self.first_clause_ms, 99),
            "within_150ms": round(sum(1 for t in self.ttft_ms if t <= 150.0) / max(len(self.ttft_ms), 1), 4),
            "kv_wait_ms_p99": pct(self.kv_wait_ms, 99),
            "mean_batch": round(self.seqs_in_steps / max(self.steps, 1), 2),
            "utilization": round(self.busy_ms / (self.window_s * 1000.0), 4),
            "gpu_s_per_m_tokens": round(tp * self.window_s / tok * 1e6, 3),
            "busy_gpu_s_per_m_tokens": round(tp * self.busy_ms / 1000.0 / tok * 1e6, 3),
        }


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile, nearest rank (as scripts/loadtest.py computes it)."""
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(round(q / 100.0 * (len(v) - 1))))], 3)


# --------------------------------------------------------------------------- the replica


@dataclass(eq=False)
class Item:
    """One request in the replica's queue: `tokens` to process, then `stream_left` more one-token passes."""

    tokens: int
    on_done: Callable[[float], None]
    stream_left: int = 0
    on_token: Callable[[float], None] | None = None


class Replica:
    """Continuous batching over a cost model (cloud_server/scheduler.py's loop, timed by the model)."""

    def __init__(self, sim: Simulator, cost: CostModel) -> None:
        self.sim, self.cost = sim, cost
        self.queue: deque[Item] = deque()
        self.busy = False
        self.kv_slots = max(1, cost.kv_tokens // max(sim.opts.context_tokens, 1))
        self.resident = 0
        self.kv_waiting: deque[Callable[[float], None]] = deque()
        self.idle_since = 0.0
        self.cold_ms = 0.0  # added to the next step: the replica was idle long enough to go cold

    def submit(self, item: Item) -> None:
        self.queue.append(item)
        if not self.busy:
            self.busy = True
            self.cold_ms = self._wake(self.sim.now)
            self.sim.at(self.sim.now, self._step)

    def _wake(self, now: float) -> float:
        """What the first step after an idle spell of at least `wake_after_ms` takes more (its busy time)."""
        if not self.cost.wake_ms or now - self.idle_since < self.cost.wake_after_ms:
            return 0.0
        return self.sim.rng.choice(self.cost.wake_ms)

    def _step(self, now: float) -> None:
        if not self.queue:
            self.busy = False
            self.idle_since = now
            return
        taken: list[tuple[Item, int]] = []
        left = self.cost.max_batch_tokens
        for item in self.queue:
            if len(taken) >= self.cost.max_seqs or left <= 0:
                break
            n = min(item.tokens, left)
            taken.append((item, n))
            left -= n
        dt = self.cost.step_ms(len(taken), sum(n for _, n in taken))
        if self.cost.step_sigma > 0:
            dt *= self.sim.rng.lognormvariate(0.0, self.cost.step_sigma)
        dt, self.cold_ms = dt + self.cold_ms, 0.0
        self.sim.account_step(now, dt, len(taken))
        self.sim.at(now + dt, lambda t: self._finish(t, taken))

    def _finish(self, now: float, taken: list[tuple[Item, int]]) -> None:
        done = []
        for item, n in taken:
            item.tokens -= n
            if item.tokens > 0:
                continue
            if item.stream_left > 0:  # a streamed answer: its token is out, the next one needs a pass
                if item.on_token is not None:
                    item.on_token(now)
                item.stream_left -= 1
                item.tokens = 1
                continue
            done.append(item)
        for item in done:
            self.queue.remove(item)
            item.on_done(now)
        self._step(now)

    def admit(self, granted: Callable[[float], None]) -> None:
        """KV room for a stream's turn: at once, or when another stream's turn ends."""
        if self.resident < self.kv_slots:
            self.resident += 1
            granted(self.sim.now)
        else:
            self.kv_waiting.append(granted)

    def release(self) -> None:
        if self.kv_waiting:
            self.kv_waiting.popleft()(self.sim.now)
        else:
            self.resident -= 1


# --------------------------------------------------------------------------- streams


@dataclass(frozen=True)
class Sleep:
    ms: float


@dataclass(frozen=True)
class Ask:
    """Send a request and (unless background) wait for its reply; the reply's time is sent back."""

    tokens: int
    stream_tokens: int = 0  # a streamed answer: one-token passes after the first token
    background: bool = False
    arrivals: list[float] | None = None  # a streamed answer: filled with each token's arrival at the device


@dataclass(frozen=True)
class Admit:
    pass


Op = Sleep | Ask | Admit
Proc = Generator[Op, float, None]


class Simulator:
    """The event loop: a heap of (time, order, callback), and stream processes as generators."""

    def __init__(self, cost: CostModel, traces: list[TurnTrace], opts: SimOptions) -> None:
        if not traces:
            raise ValueError("no traces to simulate")
        self.cost, self.traces, self.opts = cost, traces, opts
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = 0
        self.rng = random.Random(opts.seed)
        self.replica = Replica(self, cost)
        self.t_start = opts.warmup_s * 1000.0
        self.t_end = self.t_start + opts.duration_s * 1000.0
        self.result = SimResult(opts.streams, opts.duration_s)

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, self._order, fn))

    def measuring(self, t: float) -> bool:
        return self.t_start <= t < self.t_end

    def account_step(self, t: float, dt: float, n_seqs: int) -> None:
        lo, hi = max(t, self.t_start), min(t + dt, self.t_end)
        if hi > lo:
            self.result.busy_ms += hi - lo
        if self.measuring(t):
            self.result.steps += 1
            self.result.seqs_in_steps += n_seqs

    def run(self) -> SimResult:
        for i in range(self.opts.streams):
            self._resume(stream_proc(self, i), None)
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            if t > self.t_end:
                break
            self.now = t
            fn(t)
        return self.result

    def _resume(self, proc: Proc, value: float | None) -> None:
        try:
            op = proc.send(value) if value is not None else next(proc)
        except StopIteration:
            return
        wake: Callable[[float], None] = lambda t: self._resume(proc, t)  # noqa: E731
        if isinstance(op, Sleep):
            self.at(self.now + max(op.ms, 0.0), wake)
        elif isinstance(op, Admit):
            self.replica.admit(lambda t: self.at(t, wake))
        else:
            self._send(op, wake)

    def _send(self, op: Ask, wake: Callable[[float], None]) -> None:
        """The request crosses the network (half the RTT plus the server's overhead) into the queue."""
        half = self.opts.rtt_ms / 2.0
        overhead = self.cost.request_overhead_ms
        if self.cost.overhead_sigma > 0:
            overhead *= self.rng.lognormvariate(0.0, self.cost.overhead_sigma)
        arrive = self.now + half + overhead
        times = op.arrivals if op.arrivals is not None else []
        on_token = (lambda t: times.append(t + half)) if op.stream_tokens else None

        def done(t: float) -> None:
            if op.stream_tokens:
                times.append(t + half)
            if not op.background:
                self.at(t + half, wake)

        item = Item(max(op.tokens, 1), done, op.stream_tokens, on_token)
        self.at(arrive, lambda t: self.replica.submit(item))
        if op.background:
            self.at(self.now, wake)


def stream_proc(sim: Simulator, index: int) -> Proc:
    """One device: its turns in order (starting at a different trace per stream), forever."""
    opts = sim.opts
    rng = random.Random(opts.seed * 100_003 + index)
    k = index % len(sim.traces)
    yield Sleep(rng.uniform(0.0, max(opts.think_ms + sim.traces[k].think_ms, 50.0)))  # streams do not start in step
    while True:
        trace = sim.traces[k]
        k = (k + 1) % len(sim.traces)
        t_ask = sim.now
        yield Admit()
        t0 = sim.now
        if sim.measuring(t0):
            sim.result.kv_wait_ms.append(t0 - t_ask)
        releases = yield from (streamed_turn(sim, trace) if trace.streamed else routed_turn(sim, trace, rng))
        sim.replica.release()
        record_turn(sim, trace, t_ask, releases)  # from the ask: a wait for KV room is the person's wait too
        yield Sleep(opts.think_ms + trace.think_ms)


def streamed_turn(sim: Simulator, trace: TurnTrace) -> Generator[Op, float, list[float]]:
    """The cloud writes the answer: the prompt's prefill and first token in one request, then one pass a token."""
    yield Sleep(trace.device_ms)
    first = trace.prefill_tokens + max(trace.generate_tokens - trace.n_tokens, 0) + 1
    t_send = sim.now
    times: list[float] = []
    t_last = yield Ask(first, stream_tokens=max(trace.n_tokens - 1, 0), arrivals=times)
    if sim.measuring(t_send):
        sim.result.request_ms.append(t_last - t_send)
    return times[: trace.n_tokens]


def routed_turn(sim: Simulator, trace: TurnTrace, rng: random.Random) -> Generator[Op, float, list[float]]:
    """The device writes, waits at each request position, and syncs in the background."""
    n, asks = trace.n_tokens, set(trace.request_positions)
    per_ask = max(1, round(trace.waited_tokens / max(len(asks), 1)))
    bg_passes = max(trace.passes - len(asks), 0)
    bg_at = spread(bg_passes, n)
    per_bg = max(1, round(trace.background_tokens / max(bg_passes, 1)))
    per_pos = (trace.device_ms - trace.device_first_ms) / max(n, 1)
    pending_device = trace.device_first_ms
    releases: list[float] = [0.0] * n
    held: list[int] = []
    jitter = sim.opts.device_jitter
    owed = 0.0  # device time of tokens already released, slept at the next yield (one event, not one a token)
    for i in range(n):
        if bg_at.get(i, 0):
            if owed:
                yield Sleep(owed)
                owed = 0.0
            for _ in range(bg_at[i]):
                yield Ask(per_bg, background=True)
        pending_device += per_pos
        if i in asks:
            yield Sleep(owed + pending_device * (rng.uniform(1 - jitter, 1 + jitter) if jitter else 1.0))
            owed = pending_device = 0.0
            t_send = sim.now
            t_reply = yield Ask(per_ask)
            if sim.measuring(t_send):
                sim.result.request_ms.append(t_reply - t_send)
            for j in [*held, i]:
                releases[j] = t_reply
            held = []
        elif trace.holds_from is not None and i >= trace.holds_from:
            held.append(i)
        else:
            owed += pending_device
            pending_device = 0.0
            releases[i] = sim.now + owed
    if owed or pending_device or held:
        yield Sleep(owed + pending_device)
        for j in held:
            releases[j] = sim.now
    return releases


def spread(k: int, n: int) -> dict[int, int]:
    """k background passes over n positions: the first at the turn's start (the prompt's prefill), the rest evenly."""
    out: dict[int, int] = {}
    for j in range(k):
        pos = 0 if j == 0 else min(n - 1, (j * n) // k) if n else 0
        out[pos] = out.get(pos, 0) + 1
    return out


def record_turn(sim: Simulator, trace: TurnTrace, t0: float, releases: list[float]) -> None:
    """A turn counts if it began in the measured window (its tokens are then all produced in it or just after)."""
    if not sim.measuring(t0) or not releases:
        return
    r = sim.result
    r.turns += 1
    r.answer_tokens += trace.n_tokens
    rel = [t - t0 for t in releases]
    r.ttft_ms.append(rel[0])
    r.first_clause_ms.append(rel[min(trace.first_clause_index, len(rel) - 1)])
    r.gaps_ms.extend(b - a for a, b in zip(rel, rel[1:]))


def simulate(cost: CostModel, traces: list[TurnTrace], opts: SimOptions) -> SimResult:
    return Simulator(cost, traces, opts).run()


# --------------------------------------------------------------------------- sizing a fleet


@dataclass(frozen=True)
class Targets:
    """The latency a fleet must keep, at the 99th percentile."""

    per_token_ms_p99: float = 150.0
    first_clause_ms_p99: float = 1500.0
    within_150ms: float = 0.0  # the least share of turns whose reply starts within 150 ms (0: no target)


def meets(summary: dict[str, Any], targets: Targets) -> bool:
    tok, clause = summary["per_token_ms_p99"], summary["first_clause_ms_p99"]
    if tok is None or clause is None or summary["within_150ms"] < targets.within_150ms:
        return False
    return tok <= targets.per_token_ms_p99 and clause <= targets.first_clause_ms_p99


def streams_per_replica(
    cost: CostModel, traces: list[TurnTrace], opts: SimOptions, targets: Targets, limit: int = 1 << 16
) -> tuple[int, dict[str, Any] | None]:
    """The most streams one replica serves within the targets (0: not even one), and its summary.
    Doubling then bisection; assumes latency grows with streams (true of a FIFO batch queue)."""

    def at(s: int) -> dict[str, Any]:
        return simulate(cost, traces, replace(opts, streams=s)).summary(cost.tp)

    lo_summary = at(1)
    if not meets(lo_summary, targets):
        return 0, lo_summary
    lo, hi = 1, 2
    while hi <= limit and meets(s := at(hi), targets):
        lo, lo_summary, hi = hi, s, hi * 2
    while hi - lo > max(1, lo // 50):  # 2% resolution
        mid = (lo + hi) // 2
        s = at(mid)
        if meets(s, targets):
            lo, lo_summary = mid, s
        else:
            hi = mid
    return lo, lo_summary


def gpus_needed(n_streams: int, per_replica: int, tp: int) -> int | None:
    """GPUs for N streams at `per_replica` streams a replica (None: the targets cannot be met)."""
    return None if per_replica <= 0 else math.ceil(n_streams / per_replica) * tp


def by_policy(traces: list[TurnTrace]) -> Iterator[tuple[str, list[TurnTrace]]]:
    """Traces grouped by policy, in first-seen order."""
    seen: dict[str, list[TurnTrace]] = {}
    for t in traces:
        seen.setdefault(t.policy, []).append(t)
    yield from seen.items()
