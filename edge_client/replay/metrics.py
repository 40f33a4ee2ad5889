"""Per-turn measurements and their per-policy summary.

Latency is measured when a token is *released to the user* (see driver.py),
so a policy that holds drafted tokens for a verdict pays for it here. Quality
is measured with the cloud model: its negative log-likelihood per token of
each answer (lower = closer to what the cloud would say) and ROUGE-L against
the cloud-only answer.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

import numpy as np

from shared.gpu_cost import PRODUCTION_CLOUD, GpuCostModel, default_tier_sizes
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel
from shared.textmetrics import rouge_l_f1 as rouge_l  # noqa: F401  (re-exported for the report)

CLAUSE_RE = re.compile(r"[.,;:!?\n]")
ANSWERED_WITHIN_MS = 150.0

# The cloud's work in units that carry over to a GPU (shared/protocol.py `Work`), and the cost model
# docs/server.md ("What it costs on a GPU") turns them into GPU-seconds with (shared/gpu_cost.py):
# a model, not a measurement.
WORK_KINDS = ("prefill_tokens", "generate_tokens", "verify_tokens", "guess_tokens")


def gpu_seconds(passes: float, tokens: float) -> float:
    """GPU-seconds of the production cloud's cost model (a 70B on 4 x H100, shared/gpu_cost.py)."""
    return PRODUCTION_CLOUD.gpu_seconds(passes, tokens)


def row_gpu_seconds(row: dict, sizes: list[float]) -> float:
    """One answer's GPU-seconds: each cloud tier's work (`tier_work`) priced at its size (`sizes`, lowest
    first); a row recorded before tiers had their own work is priced as the production cloud's."""
    tiers = row.get("tier_work") or []
    if len(tiers) < 2:
        t = row["traffic"]
        return gpu_seconds(t.get("passes", 0), sum(t.get(k, 0) for k in WORK_KINDS))
    return sum(
        GpuCostModel.for_size(size).gpu_seconds(w["passes"], sum(w[k] for k in WORK_KINDS))
        for w, size in zip(tiers[1:], sizes)
    )


# The `--json` summary's keys per policy (the contract).
SUMMARY_KEYS = (
    "ttft_ms_p50",
    "first_clause_ms_p50",
    "per_token_ms_p50",
    "per_token_ms_p95",
    "cloud_fraction",
    "cloud_compute_s_per_1k",
    "cloud_nll",
    "rouge_l_vs_cloud",
    "bytes_up_per_token",
    "round_trips_per_answer",
)


# --------------------------------------------------------------------------- quality


class CloudScorer:
    """The cloud model in-process: NLL of an answer, and a greedy reference answer when needed."""

    def __init__(self, model: LlamaModel, n_ctx: int = 2048, threads: int | None = 1) -> None:
        self.model = model
        self.ctx = LlamaContext(model, n_ctx=n_ctx, n_seq=1, threads=threads, embeddings=False)

    def nll_per_token(self, messages: list[dict], answer: list[int]) -> float | None:
        """Mean -log P_cloud(answer token | prompt, earlier answer tokens), one forward pass."""
        if not answer:
            return None
        prompt = self.model.chat_tokens(messages)
        rows = prompt + answer
        self.ctx.clear(0)
        start = len(prompt) - 1  # row r predicts rows[r + 1]
        outs = self.ctx.decode_outputs(DecodeItem(0, 0, rows[:-1]), list(range(start, len(rows) - 1)))
        total = 0.0
        for out, token in zip(outs, answer):
            logits = self.ctx.logits(out).astype(np.float64)
            m = logits.max()
            total += math.log(np.exp(logits - m).sum()) + m - logits[token]
        return float(total / len(answer))

    def greedy(self, messages: list[dict], max_tokens: int) -> list[int]:
        self.ctx.clear(0)
        return [tok for _, tok in self.ctx.greedy(self.model.chat_tokens(messages), max_tokens)]

    def close(self) -> None:
        self.ctx.close()


# --------------------------------------------------------------------------- latency


def first_clause_index(pieces: list[str]) -> int:
    """Index of the token that completes the first clause (the last token if there is no boundary)."""
    seen_text = False
    for i, piece in enumerate(pieces):
        if seen_text and CLAUSE_RE.search(piece):
            return i
        seen_text = seen_text or bool(piece.strip())
    return len(pieces) - 1


def turn_metrics(rec: dict) -> dict[str, Any]:
    """Latency and cost figures of one replayed turn (a TurnRecord as JSON)."""
    emit, n = rec["emit_ms"], len(rec["tokens"])
    traffic = rec["traffic"]
    ttft = emit[0] if n else None
    clause = emit[first_clause_index(rec["pieces"])] if n else None
    device = max(rec["total_ms"] - traffic["wait_ms"], 0.0)
    waited_compute = traffic["cloud_compute_ms"] - traffic.get("background_ms", 0.0)
    return {
        "n_tokens": n,
        "n_cloud": sum(1 for r in rec["routes"] if r == "cloud"),
        "ttft_ms": ttft,
        "first_clause_ms": clause,
        "gaps_ms": [b - a for a, b in zip(emit, emit[1:])],
        "total_ms": rec["total_ms"],
        "device_ms": device,
        # the wait splits into cloud compute and the rest (network, queueing); cloud work done in
        # the background (prefill after an eager sync) is not on the critical path and not counted here
        "network_ms": max(traffic["wait_ms"] - waited_compute, 0.0),
        "cloud_ms": min(waited_compute, traffic["wait_ms"]),
    }


def _pct(xs: Iterable[float], q: float) -> float | None:
    arr = [x for x in xs if x is not None]
    return round(float(np.percentile(arr, q)), 3) if arr else None


def _mean(xs: Iterable[float | None]) -> float | None:
    arr = [x for x in xs if x is not None]
    return round(float(np.mean(arr)), 4) if arr else None


def summarize(rows: list[dict], sizes: list[float] | None = None) -> dict[str, Any]:
    """All turns of one policy -> its summary (the SUMMARY_KEYS plus supporting figures); `sizes`: the
    cost model's size of each cloud tier (default: the production cloud alone)."""
    ms = [turn_metrics(r) for r in rows]
    n_tok = sum(m["n_tokens"] for m in ms) or 1
    gaps = [g for m in ms for g in m["gaps_ms"]]
    total_s = sum(m["total_ms"] for m in ms) / 1000.0
    compute_ms = sum(r["traffic"]["cloud_compute_ms"] for r in rows)
    nll_num = sum(r["cloud_nll"] * len(r["tokens"]) for r in rows if r.get("cloud_nll") is not None)
    nll_den = sum(len(r["tokens"]) for r in rows if r.get("cloud_nll") is not None)
    return {
        "turns": len(rows),
        "tokens": sum(m["n_tokens"] for m in ms),
        "ttft_ms_p50": _pct((m["ttft_ms"] for m in ms), 50),
        "ttft_ms_p95": _pct((m["ttft_ms"] for m in ms), 95),
        "first_clause_ms_p50": _pct((m["first_clause_ms"] for m in ms), 50),
        "first_clause_ms_p95": _pct((m["first_clause_ms"] for m in ms), 95),
        "per_token_ms_p50": _pct(gaps, 50),
        "per_token_ms_p95": _pct(gaps, 95),
        "tokens_per_s": round(sum(m["n_tokens"] for m in ms) / total_s, 2) if total_s > 0 else None,
        "cloud_fraction": round(sum(m["n_cloud"] for m in ms) / n_tok, 4),
        "cloud_compute_s_per_1k": round(compute_ms / 1000.0 / (n_tok / 1000.0), 4),
        "cloud_nll": round(nll_num / nll_den, 4) if nll_den else None,
        "rouge_l_vs_cloud": _mean(r.get("rouge_l_vs_cloud") for r in rows),
        "bytes_up_per_token": round(sum(r["traffic"]["bytes_up"] for r in rows) / n_tok, 2),
        "bytes_down_per_token": round(sum(r["traffic"]["bytes_down"] for r in rows) / n_tok, 2),
        "round_trips_per_answer": round(sum(r["traffic"]["round_trips"] for r in rows) / max(len(rows), 1), 3),
        "answered_within_150ms": round(
            sum(1 for m in ms if m["ttft_ms"] is not None and m["ttft_ms"] <= ANSWERED_WITHIN_MS) / max(len(ms), 1), 4
        ),
        "eos_to_first_audio_ms_p50": _pct((r.get("eos_to_first_audio_ms") for r in rows), 50),
        "eos_to_first_audio_ms_p95": _pct((r.get("eos_to_first_audio_ms") for r in rows), 95),
        "stage_ms_mean": {k: _mean(m[k] for m in ms) for k in ("device_ms", "network_ms", "cloud_ms")},
        "degraded_turns": sum(1 for r in rows if r.get("degraded")),
        "cloud_decisions": sum(1 for r in rows if r.get("decision") == "cloud"),
        **work_summary(rows, n_tok, sizes or default_tier_sizes(1)),
    }


def work_summary(rows: list[dict], n_tok: int, sizes: list[float]) -> dict[str, Any]:
    """The cloud's work per answer token (passes, tokens processed by kind), remote engine requests per
    answer, and the cost model's GPU-seconds per 1k answer tokens (each tier at its size); 0 where a
    server reports none (v1)."""
    total = {k: sum(r["traffic"].get(k, 0) for r in rows) for k in ("passes", "engine_requests", *WORK_KINDS)}
    tokens = sum(total[k] for k in WORK_KINDS)
    return {
        "passes_per_token": round(total["passes"] / n_tok, 4),
        "cloud_tokens_per_token": round(tokens / n_tok, 4),
        "cloud_tokens_by_kind_per_token": {k.removesuffix("_tokens"): round(total[k] / n_tok, 4) for k in WORK_KINDS},
        "engine_requests_per_answer": round(total["engine_requests"] / max(len(rows), 1), 3),
        "gpu_s_per_1k_model": round(sum(row_gpu_seconds(r, sizes) for r in rows) / (n_tok / 1000.0), 3),
    }


def quality_gap_recovered(edge_nll: float | None, cloud_nll: float | None, nll: float | None) -> float | None:
    """Share of the edge -> cloud NLL gap a policy closes (1 = as good as the cloud)."""
    if None in (edge_nll, cloud_nll, nll) or abs(edge_nll - cloud_nll) < 1e-9:  # type: ignore[operator]
        return None
    return round((edge_nll - nll) / (edge_nll - cloud_nll), 4)  # type: ignore[operator]
