"""Benchmark of the routing foundation, side by side in one run.

    python scripts/bench_routing.py [--tokens 128] [--hard-tokens 100] [--json]

Reports, on this machine:
  1. router decision time per token (logit features + score + policy), in the real loop and isolated;
  2. device tokens/s with and without reading the hidden state (embeddings on/off);
  3. the loopback round trip of one hard token against the cloud's own compute for it;
  4. switching a session by saving/restoring its KV state vs keeping a sequence per session;
  5. the decision per position with a pool of three tiers (the `cost` engine reading a second learned
     router, Gemma's tier) against the pair's (the built-in engine), alternating in the real loop.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llama_cpp
import numpy as np

from cloud_server.local import LocalCloudServer
from edge_client.cloud_link import CloudLink
from edge_client.decoder import EdgeDecoder
from edge_client.generator import build_router, tier_routers
from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, model_info
from shared.decision_engine import EngineSetup, Position, build_engine, engine_tier
from shared.learned_router import score_tiers
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel
from shared.policy import PolicyConfig, RoutingPolicy
from shared.prompting import DEFAULT_SYSTEM_PROMPT
from shared.protocol import SamplingParams
from shared.router import HeuristicRouter

PROMPT = [
    {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
    {"role": "user", "content": "Tell me a long story about a dragon who learns to cook."},
]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import os

    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
    }


def bench_router(edge: LlamaModel, n_tokens: int) -> dict:
    """Router + policy time per token. In the loop, even positions run the real router and odd
    ones a null router (reads one logit): every decode streams ~90 MB of weights through the
    caches, so the first Python work after it pays a refill that the null router measures."""
    dec = EdgeDecoder(edge, n_ctx=2048)
    dec.set_history(edge.chat_tokens(PROMPT))
    router = HeuristicRouter("entropy", edge.n_vocab)
    policy = RoutingPolicy(PolicyConfig("router", cloud_fraction=0.3))
    real, null = [], []
    for i in range(2 * n_tokens):
        logits, hidden = dec.next_distribution()
        token = int(np.argmax(logits))
        t0 = time.perf_counter()
        score = router.score(hidden, logits, token) if i % 2 == 0 else 0.5 * float(logits[token] > 0)
        policy.decide(score)
        (real if i % 2 == 0 else null).append((time.perf_counter() - t0) * 1e6)
        dec.append(token)
    x = np.array(logits, copy=True)
    isolated, decide = [], []
    for _ in range(500):
        t0 = time.perf_counter()
        s = router.score(hidden, x, 0)
        t1 = time.perf_counter()
        policy.decide(s)
        isolated.append((t1 - t0) * 1e6)
        decide.append((time.perf_counter() - t1) * 1e6)
    dec.close()
    return {
        "router_plus_policy_us_p50_in_loop": pct(real, 50),
        "router_plus_policy_us_p95_in_loop": pct(real, 95),
        "null_router_plus_policy_us_p50_in_loop": pct(null, 50),
        "router_score_us_p50_warm": pct(isolated, 50),
        "policy_decide_us_p50_warm": pct(decide, 50),
    }


def bench_tiers(edge: LlamaModel, n_tokens: int, top: str = "gemma3-270m") -> dict:
    """The whole decision at a position as Turn.flag makes it: the pair's router and the built-in engine,
    against three tiers (the pair's router, each tier's own router as the generator loads them:
    `tier_routers`, the `cost` engine), alternating position by position in the real decode loop."""
    dec = EdgeDecoder(edge, n_ctx=2048)
    dec.set_history(edge.chat_tokens(PROMPT))
    router = build_router("auto", edge.n_vocab, edge.info, "error", DEFAULT_CLOUD_MODEL)
    routers = tier_routers(edge, [DEFAULT_CLOUD_MODEL, top]) or [None, None, None]  # as the generator loads them
    policy = RoutingPolicy(PolicyConfig("router", cloud_fraction=0.3), prior=router.threshold_for)
    pair = build_engine("router", EngineSetup(policy, {}, tiers=2))
    pool = build_engine("cost", EngineSetup(policy, {}, tiers=3))
    at_pair, at_pool = Position(), Position(tier_scores=np.zeros(3, np.float32))
    times: dict[str, list[float]] = {"pair": [], "three_tiers": []}
    for i in range(2 * n_tokens):
        logits, hidden = dec.next_distribution()
        token = int(np.argmax(logits))
        t0 = time.perf_counter()
        score = router.score(hidden, logits, token)
        if i % 2 == 0:
            engine_tier(pair, at_pair, i, token, score, hidden, logits, 2)
        else:
            score_tiers(at_pool.tier_scores, routers, router, score, hidden, logits, token)  # as Turn.flag
            engine_tier(pool, at_pool, i, token, score, hidden, logits, 3)
        times["pair" if i % 2 == 0 else "three_tiers"].append((time.perf_counter() - t0) * 1e6)
        dec.append(token)
    dec.close()
    return {
        "routers": " + ".join([router.name, *(r.name for r in routers if r is not None)]),
        "pair_decision_us_p50_in_loop": pct(times["pair"], 50),
        "three_tier_decision_us_p50_in_loop": pct(times["three_tiers"], 50),
        "three_tier_decision_us_p95_in_loop": pct(times["three_tiers"], 95),
    }


def bench_decode(edge: LlamaModel, n_tokens: int, rounds: int = 3) -> dict:
    """Tokens/s with the hidden state computed and read (embeddings on) vs logits only;
    the two alternate over several rounds and the median is reported (this VM is noisy)."""
    prompt = edge.chat_tokens(PROMPT)
    rates: dict[str, list[float]] = {"with_hidden": [], "logits_only": []}
    ctxs = {
        "with_hidden": LlamaContext(edge, n_ctx=2048, embeddings=True, threads=1),
        "logits_only": LlamaContext(edge, n_ctx=2048, embeddings=False, threads=1),
    }
    for _ in range(rounds):
        for label, ctx in ctxs.items():
            ctx.clear(0)
            ctx.decode([DecodeItem(0, 0, prompt)])
            pos, idx = len(prompt), len(prompt) - 1
            t0 = time.perf_counter()
            for _ in range(n_tokens):
                token = int(np.argmax(ctx.logits(idx)))
                if ctx.embeddings:
                    ctx.hidden(idx).astype(np.float16)  # what a hard-token request sends
                ctx.decode_one(0, pos, token)
                pos, idx = pos + 1, 0
            rates[label].append(n_tokens / (time.perf_counter() - t0))
    for ctx in ctxs.values():
        ctx.close()
    out = {f"tok_s_{k}": float(np.median(v)) for k, v in rates.items()}
    out["hidden_state_cost_pct"] = 100.0 * (out["tok_s_logits_only"] / out["tok_s_with_hidden"] - 1.0)
    return out


def bench_round_trip(edge: LlamaModel, n_hard: int) -> dict:
    prompt = edge.chat_tokens(PROMPT)
    hidden = np.zeros(edge.n_embd, dtype=np.float32)
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL) as server:
        link = CloudLink(server.url, server.api_key, timeout_s=10)
        link.open(edge.info, PROMPT, prompt, SamplingParams(), "never")
        link.tokens.generate([], hidden=hidden)  # warm-up (first decode allocates buffers)
        rtt, compute = [], []
        for _ in range(n_hard):
            before = link.stats.cloud_compute_ms
            t0 = time.perf_counter()
            link.tokens.generate([], proposed=0, hidden=hidden, max_tokens=1)
            rtt.append((time.perf_counter() - t0) * 1000.0)
            compute.append(link.stats.cloud_compute_ms - before)
        link.close()
    extra = [r - c for r, c in zip(rtt, compute)]
    return {
        "hard_token_rtt_ms_p50": pct(rtt, 50),
        "hard_token_rtt_ms_p95": pct(rtt, 95),
        "cloud_compute_ms_p50": pct(compute, 50),
        "extra_over_compute_ms_p50": pct(extra, 50),
        "extra_over_compute_ms_p95": pct(extra, 95),
        "bytes_up_per_hard_token": link.stats.bytes_up / (n_hard + 1),
    }


def bench_session_switch(cloud: LlamaModel, n_prompt: int = 200) -> dict:
    ctx = LlamaContext(cloud, n_ctx=4096, n_seq=4, embeddings=False)
    tokens = cloud.tokenize("The quick brown fox jumps over the lazy dog. " * 40)[:n_prompt]
    ctx.decode([DecodeItem(0, 0, tokens)])
    saves, loads = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        state = ctx.save_seq(0)
        t1 = time.perf_counter()
        ctx.clear(1)
        ctx.load_seq(1, state)
        t2 = time.perf_counter()
        saves.append((t1 - t0) * 1000)
        loads.append((t2 - t1) * 1000)
    one_token = []
    for i in range(20):  # the cost a shared context pays instead: nothing to switch, one decode per token
        t0 = time.perf_counter()
        ctx.decode_one(0, n_prompt + i, tokens[i])
        one_token.append((time.perf_counter() - t0) * 1000)
    ctx.close()
    return {
        "session_tokens": n_prompt,
        "state_bytes": len(state),
        "kv_bytes_per_token": len(state) / n_prompt,
        "save_ms_p50": pct(saves, 50),
        "restore_ms_p50": pct(loads, 50),
        "decode_one_token_ms_p50": pct(one_token, 50),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hard-tokens", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    edge = LlamaModel(model_info(DEFAULT_EDGE_MODEL))
    cloud = LlamaModel(model_info(DEFAULT_CLOUD_MODEL))
    result = {
        "machine": machine(),
        "router": bench_router(edge, args.tokens),
        "decode": bench_decode(edge, args.tokens),
        "round_trip": bench_round_trip(edge, args.hard_tokens),
        "session_switch": bench_session_switch(cloud),
        "tiers": bench_tiers(edge, args.tokens),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    m = result["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, llama-cpp-python {m['llama_cpp_python']}")
    for section in ("router", "decode", "round_trip", "session_switch", "tiers"):
        print(f"\n[{section}]")
        for k, v in result[section].items():
            print(f"  {k:36s} {v:10.3f}" if isinstance(v, float) else f"  {k:36s} {v:>10}")


if __name__ == "__main__":
    main()
