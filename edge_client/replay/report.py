"""Writing a replay's results: report.json, report.md and PNG plots.

The summary is computed from results.jsonl (one line per session, all
policies), so a resumed run reports everything it has, not only its last part.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from edge_client.replay.metrics import SUMMARY_KEYS, quality_gap_recovered, summarize, turn_metrics

REPORT_VERSION = 1


def machine_info() -> dict[str, Any]:
    """What the figures were measured on, so they are never quoted without it."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions: dict[str, str] = {"python": platform.python_version()}
    for mod in ("llama_cpp", "numpy", "websockets", "uvicorn", "fastapi"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError:
            pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": versions,
        "argv": sys.argv,
    }


def build_report(rows: list[dict], policies: list[str], meta: dict[str, Any]) -> dict[str, Any]:
    """rows: one per (session, turn, policy) -> the whole report object."""
    sizes = meta.get("config", {}).get("tier_sizes")  # a pool's cost-model sizes (None: the production cloud)
    per_policy = {p: summarize([r for r in rows if r["policy"] == p], sizes) for p in policies}
    edge, cloud = per_policy.get("edge"), per_policy.get("cloud")
    for name, s in per_policy.items():
        s["quality_gap_recovered"] = quality_gap_recovered(
            edge and edge["cloud_nll"], cloud and cloud["cloud_nll"], s["cloud_nll"]
        )
        s["first_clause_vs_edge"] = _ratio(s["first_clause_ms_p50"], edge and edge["first_clause_ms_p50"])
        s["cloud_compute_vs_cloud"] = _ratio(s["cloud_compute_s_per_1k"], cloud and cloud["cloud_compute_s_per_1k"])
        s["passes_vs_cloud"] = _ratio(s["passes_per_token"], cloud and cloud["passes_per_token"])
    return {"report_version": REPORT_VERSION, **meta, "policies": per_policy, "goals": goals(per_policy)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def goals(per_policy: dict[str, dict]) -> dict[str, Any]:
    """The issue's goal for router policies: first clause <= 1.3x edge, <= 35% of cloud's compute, >= 80% of the quality gap."""
    out: dict[str, Any] = {}
    for name, s in per_policy.items():
        if not name.startswith(("router", "speculative")):
            continue
        checks = {
            "first_clause_within_1.3x_edge": _le(s["first_clause_vs_edge"], 1.3),
            "compute_at_most_35pct_of_cloud": _le(s["cloud_compute_vs_cloud"], 0.35),
            "recovers_80pct_of_quality_gap": None
            if s["quality_gap_recovered"] is None
            else s["quality_gap_recovered"] >= 0.8,
        }
        out[name] = {**checks, "all": all(v is True for v in checks.values())}
    return out


def _le(x: float | None, limit: float) -> bool | None:
    return None if x is None else x <= limit


def json_summary(report: dict) -> dict:
    """The `--json` object: policies -> name -> the SUMMARY_KEYS."""
    return {
        "profile": report["network"]["profile"]["name"],
        "sessions": report["sessions"],
        "policies": {p: {k: s[k] for k in SUMMARY_KEYS} for p, s in report["policies"].items()},
    }


# --------------------------------------------------------------------------- markdown


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown(report: dict) -> str:
    """report.md: the run's setting, then a table per section."""
    pol = report["policies"]
    lines = [
        *_setting(report),
        *_latency_section(pol),
        *_cost_section(pol),
        *_cloud_work_section(pol),
        *_stages_section(pol),
        *_goals_section(report["goals"]),
        *_emulator_section(report["network"]),
    ]
    return "\n".join(lines)


def _setting(report: dict) -> list[str]:
    """What was replayed, over which network, on which machine, with which models and router."""
    prof = report["network"]["profile"]
    return [
        f"# Replay report: profile `{prof['name']}`",
        "",
        f"{report['sessions']} sessions, {report['turns']} turns per policy; policies interleaved session by session.",
        f"Network: RTT {prof['rtt_ms']} ms +- {prof['jitter_ms']} ms, stalls {prof['stall_prob']:.0%} x {prof['stall_ms']} ms, "
        f"up {prof['up_mbps'] or 'unlimited'} / down {prof['down_mbps'] or 'unlimited'} Mbit/s.",
        f"Machine: {report['machine']['cpu']} ({report['machine']['cpu_count']} CPUs), {report['machine']['platform']}.",
        f"Models: edge `{report['models']['edge']}`, cloud `{report['models']['cloud']}`; router `{report['config']['router']}` "
        + (
            f"calibrated online to {report['config']['cloud_fraction']:.0%} cloud tokens."
            if report["config"].get("cloud_fraction") is not None
            else f"threshold {report['config']['threshold']}."
        ),
    ]


def _latency_section(pol: dict[str, dict]) -> list[str]:
    lines = [
        "",
        "## Latency",
        "",
        "| policy | TTFT p50 | TTFT p95 | first clause p50 | first clause p95 | per-token p50 | per-token p95 | tok/s | within 150 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p, s in pol.items():
        lines.append(
            f"| {p} | {_fmt(s['ttft_ms_p50'])} | {_fmt(s['ttft_ms_p95'])} | {_fmt(s['first_clause_ms_p50'])} | {_fmt(s['first_clause_ms_p95'])} "
            f"| {_fmt(s['per_token_ms_p50'])} | {_fmt(s['per_token_ms_p95'])} | {_fmt(s['tokens_per_s'])} | {_fmt(s['answered_within_150ms'], 2)} |"
        )
    if any(s["eos_to_first_audio_ms_p50"] is not None for s in pol.values()):  # spoken sessions (--audio)
        lines += ["", "| policy | end of speech -> first audio p50 | p95 |", "|---|---|---|"]
        lines += [
            f"| {p} | {_fmt(s['eos_to_first_audio_ms_p50'])} | {_fmt(s['eos_to_first_audio_ms_p95'])} |"
            for p, s in pol.items()
        ]
    return [*lines, "", "Times in ms, measured when a token is released to the user."]


def _cost_section(pol: dict[str, dict]) -> list[str]:
    lines = [
        "",
        "## Cost and quality",
        "",
        "| policy | cloud tokens | cloud s / 1k tokens | vs cloud | bytes up / tok | bytes down / tok | round trips / answer | cloud NLL / tok | gap recovered | ROUGE-L vs cloud |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, s in pol.items():
        lines.append(
            f"| {p} | {_fmt(s['cloud_fraction'], 3)} | {_fmt(s['cloud_compute_s_per_1k'], 3)} | {_fmt(s['cloud_compute_vs_cloud'], 2)} "
            f"| {_fmt(s['bytes_up_per_token'])} | {_fmt(s['bytes_down_per_token'])} | {_fmt(s['round_trips_per_answer'], 2)} "
            f"| {_fmt(s['cloud_nll'], 3)} | {_fmt(s['quality_gap_recovered'], 2)} | {_fmt(s['rouge_l_vs_cloud'], 3)} |"
        )
    return lines


def _cloud_work_section(pol: dict[str, dict]) -> list[str]:
    lines = [
        "",
        "## The cloud's work (units that carry over to a GPU)",
        "",
        "| policy | passes / tok | vs cloud | tokens processed / tok | prefill | generate | verify | guess "
        "| engine requests / answer | GPU-s / 1k tok (model) | cloud s / 1k tok (this machine) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, s in pol.items():
        k = s["cloud_tokens_by_kind_per_token"]
        lines.append(
            f"| {p} | {_fmt(s['passes_per_token'], 3)} | {_fmt(s['passes_vs_cloud'], 2)} "
            f"| {_fmt(s['cloud_tokens_per_token'], 3)} | {_fmt(k['prefill'], 3)} | {_fmt(k['generate'], 3)} "
            f"| {_fmt(k['verify'], 3)} | {_fmt(k['guess'], 3)} | {_fmt(s['engine_requests_per_answer'], 2)} "
            f"| {_fmt(s['gpu_s_per_1k_model'], 2)} | {_fmt(s['cloud_compute_s_per_1k'], 3)} |"
        )
    return [
        *lines,
        "",
        "A pass reads the cloud model's weights once, whatever its number of tokens; counts come from the "
        "server's replies. GPU-seconds: the cost model of docs/server.md (70B on 4 x H100; with `--tier`, each tier "
        "at its `--tier-sizes`), not a measurement.",
    ]


def _stages_section(pol: dict[str, dict]) -> list[str]:
    lines = [
        "",
        "## Where the time goes (mean ms per answer)",
        "",
        "| policy | device | network + queueing | cloud compute waited for | degraded turns |",
        "|---|---|---|---|---|",
    ]
    for p, s in pol.items():
        st = s["stage_ms_mean"]
        lines.append(
            f"| {p} | {_fmt(st['device_ms'])} | {_fmt(st['network_ms'])} | {_fmt(st['cloud_ms'])} | {s['degraded_turns']} |"
        )
    return lines


def _goals_section(goals: dict[str, dict]) -> list[str]:
    """The router policies' goals (`goals`); none without a router policy."""
    if not goals:
        return []
    lines = [
        "",
        "## Goals (router policies)",
        "",
        "| policy | first clause <= 1.3x edge | compute <= 35% of cloud | >= 80% of quality gap | all |",
        "|---|---|---|---|---|",
    ]
    for p, g in goals.items():
        lines.append(
            f"| {p} | {_fmt(g['first_clause_within_1.3x_edge'])} | {_fmt(g['compute_at_most_35pct_of_cloud'])} | {_fmt(g['recovers_80pct_of_quality_gap'])} | {_fmt(g['all'])} |"
        )
    return lines


def _emulator_section(net: dict) -> list[str]:
    """How closely the network emulator kept to its plan: its own delay on top of the profile's."""
    lines = [
        "",
        "## The emulator's own delay",
        "",
        "| direction | chunks | stalls | planned mean | achieved mean | achieved p95 | overhead p50 | overhead p95 | overhead max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, d in (("up", net["up"]), ("down", net["down"])):
        lines.append(
            f"| {name} | {d['chunks']} | {d['stalls']} | {_fmt(d['planned_ms_mean'], 2)} | {_fmt(d['achieved_ms_mean'], 2)} | {_fmt(d['achieved_ms_p95'], 2)} "
            f"| {_fmt(d['overhead_ms_p50'], 2)} | {_fmt(d['overhead_ms_p95'], 2)} | {_fmt(d['overhead_ms_max'], 2)} |"
        )
    return [
        *lines,
        "",
        "Overhead = time a chunk was written after its scheduled release (the proxy's own added delay).",
        "",
    ]


# --------------------------------------------------------------------------- plots


def plots(rows: list[dict], report: dict, out: Path) -> list[str]:
    """latency_cdf.png, compute_vs_quality.png, stages.png; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pol = report["policies"]
    written: list[str] = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for p in pol:
        ms = [turn_metrics(r) for r in rows if r["policy"] == p]
        for ax, values in (
            (axes[0], [m["first_clause_ms"] for m in ms if m["first_clause_ms"] is not None]),
            (axes[1], [g for m in ms for g in m["gaps_ms"]]),
        ):
            if values:
                xs = np.sort(values)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=p)
    axes[0].set(xlabel="time to first clause (ms)", ylabel="share of turns", title="First clause")
    axes[1].set(
        xlabel="gap between released tokens (ms)", ylabel="share of tokens", title="Per-token latency", xscale="symlog"
    )
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)
    plt.close(fig)
    written.append("latency_cdf.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "osD^v<>Pp*Xh"
    for k, (p, s) in enumerate(pol.items()):
        if s["cloud_nll"] is not None:
            ax.scatter(s["cloud_compute_s_per_1k"], s["cloud_nll"], marker=markers[k % len(markers)], label=p)
    ax.legend(fontsize=7)
    ax.set(
        xlabel="cloud compute (s per 1k answer tokens)",
        ylabel="cloud-model NLL per token (lower is better)",
        title="Cloud compute against quality",
    )
    fig.tight_layout()
    fig.savefig(out / "compute_vs_quality.png", dpi=110)
    plt.close(fig)
    written.append("compute_vs_quality.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(pol)
    bottom = np.zeros(len(names))
    for stage, label in (
        ("device_ms", "device"),
        ("network_ms", "network + queueing"),
        ("cloud_ms", "cloud compute waited for"),
    ):
        vals = np.array([pol[p]["stage_ms_mean"][stage] or 0.0 for p in names])
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom += vals
    ax.set(ylabel="mean ms per answer", title="Where the time goes (wall time of an answer)")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "stages.png", dpi=110)
    plt.close(fig)
    written.append("stages.png")
    return written


def write_report(
    rows: list[dict], policies: list[str], meta: dict[str, Any], out: Path, make_plots: bool = True
) -> dict:
    report = build_report(rows, policies, meta)
    if make_plots:
        try:
            report["plots"] = plots(rows, report, out)
        except ImportError:
            print(
                "tokenrouter-replay: matplotlib is not installed; no plots (pip install 'matplotlib>=3.8')",
                file=sys.stderr,
            )
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    return report
