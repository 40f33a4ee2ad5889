"""tokenrouter-replay end to end: real models, a real cloud server on loopback, every byte through the emulator.

Each policy answers the same 3 CLINC150 val queries; the report must match its
schema, speculative decoding must reproduce the cloud's greedy answer (up to
near-ties), and router-verify with one model on both sides must reproduce the
device's answer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edge_client.replay.cli import main
from edge_client.replay.metrics import SUMMARY_KEYS
from edge_client.replay.policies import POLICY_KINDS
from shared.cpus import online_cpus
from shared.decision import TIE_NATS
from shared.kernel_noise import KERNEL_NOISE_NATS
from shared.prompting import DEFAULT_SYSTEM_PROMPT
from tests.helpers import agree_up_to_a_tie

ALL = ",".join(POLICY_KINDS) + ",router-sync:nosync"


def _rows(out: Path) -> dict[str, dict[str, list[dict]]]:
    """session -> policy -> turn rows."""
    by: dict[str, dict[str, list[dict]]] = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for r in rec["rows"]:
            by.setdefault(rec["session"], {}).setdefault(r["policy"], []).append(r)
    return by


@pytest.fixture(scope="module")
def all_policies(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(
            [
                "--profile",
                "lan",
                "--policies",
                ALL,
                "--limit",
                "3",
                "--out",
                str(out),
                "--json",
                "--no-progress",
                "--max-tokens",
                "32",
            ]
        )
    assert rc == 0
    return out, json.loads(buf.getvalue())


def test_every_policy_reports_the_schema(all_policies):
    out, summary = all_policies
    assert set(summary["policies"]) == set(POLICY_KINDS) | {"router-sync:nosync"}
    for name, s in summary["policies"].items():
        assert set(s) == set(SUMMARY_KEYS), name
        assert s["ttft_ms_p50"] > 0 and s["per_token_ms_p50"] is not None, name
        assert 0.0 <= s["cloud_fraction"] <= 1.0 and s["cloud_nll"] > 0, name
    p = summary["policies"]
    assert (
        p["edge"]["cloud_fraction"] == 0
        and p["edge"]["round_trips_per_answer"] == 0
        and p["edge"]["cloud_compute_s_per_1k"] == 0
    )
    assert (
        p["cloud"]["cloud_fraction"] == 1
        and p["cloud"]["rouge_l_vs_cloud"] == 1.0
        and p["cloud"]["cloud_compute_s_per_1k"] > 0
    )
    report = json.loads((out / "report.json").read_text())
    assert report["sessions"] == 3 and report["machine"]["cpu_count"] and report["models"]["cloud"]
    assert report["network"]["up"]["chunks"] > 0 and report["network"]["down"]["overhead_ms_p50"] is not None
    assert set(report["goals"]) == {
        "router-sync",
        "router-sync:nosync",
        "router-lookahead",
        "router-span",
        "router-verify",
        "router-check",
        "router-check-after-first-clause",
        "speculative",
    }
    md = (out / "report.md").read_text()
    assert "| router-verify |" in md and "emulator's own delay" in md
    for png in ("latency_cdf.png", "compute_vs_quality.png", "stages.png"):
        assert (out / png).stat().st_size > 1000


def _messages(row: dict) -> list[dict]:
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": row["prompt"]}]


@pytest.mark.kernel
def test_speculative_equals_cloud_up_to_ties(all_policies, cloud_info):
    """Speculative decoding checks every draft: its answer is the cloud's greedy answer, except
    where a draft ties with the cloud's best (shared/decision.py: TIE_NATS), which llama.cpp's
    batch-dependent kernels break either way."""
    out, _ = all_policies
    for session, by in _rows(out).items():
        spec, cloud = by["speculative"][0], by["cloud"][0]
        assert agree_up_to_a_tie(
            cloud_info, _messages(spec), spec["tokens"], cloud["tokens"], TIE_NATS + KERNEL_NOISE_NATS
        ), session
        assert spec["traffic"]["round_trips"] >= 1


@pytest.mark.kernel
def test_eager_sync_changes_traffic_not_tokens(all_policies, cloud_info):
    """Eager sync changes when the cloud reads the device's tokens, not what it writes (up to a
    near-tie its kernels may break either way, as above)."""
    out, _ = all_policies
    for session, by in _rows(out).items():
        sync, nosync = by["router-sync"][0], by["router-sync:nosync"][0]
        assert agree_up_to_a_tie(
            cloud_info, _messages(sync), sync["tokens"], nosync["tokens"], TIE_NATS + KERNEL_NOISE_NATS
        ), session
        assert sync["traffic"]["bytes_up"] != nosync["traffic"]["bytes_up"] or sync["tokens"] != nosync["tokens"]


@pytest.mark.kernel
def test_router_verify_with_one_model_equals_edge_and_resumes(tmp_path):
    """Same GGUF on both sides and every position flagged: the cloud agrees everywhere, so nothing changes.

    Run twice: --limit 2 then --limit 3 on the same --out resumes (the first two sessions are kept, not redone).
    The loopback server runs pinned to the last CPU (--cloud-cpus), and the run records it.
    """
    cloud_cpu = str(max(os.sched_getaffinity(0)))
    args = [
        "--cloud-cpus",
        cloud_cpu,
        "--profile",
        "lan",
        "--policies",
        "edge,router-verify",
        "--edge-model",
        "smollm2-135m-q4_1",
        "--cloud-model",
        "smollm2-135m-q4_1",
        "--threshold",
        "0",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--no-plots",
        "--max-tokens",
        "24",
    ]
    assert main([*args, "--limit", "2"]) == 0
    first = (tmp_path / "results.jsonl").read_text().splitlines()
    assert main([*args, "--limit", "3"]) == 0
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 3 and lines[:2] == first
    assert json.loads((tmp_path / "run.json").read_text())["config"]["cloud_cpus"] == cloud_cpu
    for session, by in _rows(tmp_path).items():
        edge, verify = by["edge"][0], by["router-verify"][0]
        assert verify["tokens"] == edge["tokens"], session
        assert verify["traffic"]["round_trips"] >= 1 and set(verify["routes"]) == {"edge"}


def test_bad_input_is_refused_clearly(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--policies", "edge,warp"]) == 2
    assert "unknown policy 'warp'" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--limit", "0"]) == 2
    assert "--limit must be >= 1" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--cloud-cpus", "first"]) == 2
    assert "'first' is not a CPU list" in capsys.readouterr().err
    beyond = max(online_cpus()) + 1  # past the machine's CPUs (this worker may be pinned to one of them)
    assert main(["--out", str(tmp_path), "--device-cpus", str(beyond)]) == 2
    assert f"CPU {beyond} is not available to this process" in capsys.readouterr().err


@pytest.mark.serial  # real-time pace
def test_audio_mode_measures_end_of_speech_to_first_audio(tmp_path, capsys):
    """One CLINC150 query spoken with Piper (cached), through VAD, Whisper and TTS at real-time pace."""
    from edge_client.replay.audio import voice_unavailable

    why = voice_unavailable()
    if why is not None:
        pytest.skip(why)
    assert (
        main(
            [
                "--audio",
                "--profile",
                "lan",
                "--policies",
                "edge",
                "--limit",
                "1",
                "--out",
                str(tmp_path),
                "--no-progress",
                "--no-plots",
                "--max-tokens",
                "16",
                "--json",
            ]
        )
        == 0
    )
    capsys.readouterr()
    row = next(iter(_rows(tmp_path).values()))["edge"][0]
    assert row["transcript"] and row["tokens"]
    assert row["eos_to_first_audio_ms"] is not None and row["eos_to_first_audio_ms"] > 0
    assert row["prefilled_tokens"] > 0  # partial transcripts prefilled the prompt, as in the product
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["policies"]["edge"]["eos_to_first_audio_ms_p50"] == pytest.approx(
        row["eos_to_first_audio_ms"], abs=0.01
    )


def test_router_auto_finds_the_router_shipped_for_the_pair(edge_info):
    """`--router auto` must load the learned router shipped for (edge model, cloud model) in every
    router policy, not fall back to the entropy heuristic (it did while the cloud model was not
    passed down), and each policy runs the generator with the options it measures."""
    from edge_client.replay.policies import PolicySpec, Runner, replay_defaults
    from models.registry import DEFAULT_CLOUD_MODEL
    from shared.learned_router import LearnedRouter
    from shared.llama_backend import LlamaModel

    edge = LlamaModel(edge_info)
    opts = replay_defaults(router="auto", cloud_model=DEFAULT_CLOUD_MODEL)
    kinds = (
        "router-sync",
        "router-lookahead",
        "router-span",
        "router-verify",
        "router-check-after-first-clause",
        "speculative",
    )
    runners = [Runner(PolicySpec(k, k), edge, None, opts) for k in kinds]
    try:
        assert all(isinstance(r.gen.router, LearnedRouter) for r in runners)
        assert [r.gen.opts.lookahead for r in runners] == [False, True, False, False, True, False]
        assert [r.gen.opts.strategy for r in runners] == [
            "per-token",
            "per-token",
            "span",
            "verify",
            "per-token",
            "speculative",
        ]
        assert [r.gen.opts.check for r in runners] == ["off", "off", "off", "off", "after-first-clause", "off"]
    finally:
        for r in runners:
            r.close()
        edge.close()


def test_a_pool_replays_with_each_tier_priced_at_its_size(tmp_path):
    """`--tier gemma3-270m --tier-sizes 8/70.6`: a second server behind its own emulator; the `cost`
    engine sends positions to both tiers; each row records each tier's work, and the report's GPU-seconds
    price the cloud's work as an 8B's and Gemma's as a 70B's (recomputed here from the rows)."""
    from shared.gpu_cost import GpuCostModel
    from shared.protocol import WORK_FIELDS

    args = ["--profile", "lan", "--policies", "router-sync", "--router", "entropy", "--tier", "gemma3-270m"]
    args += ["--tier-sizes", "8/70.6", "--decision-engine", "cost:gpu_ms_per_token=30", "--limit", "3"]
    args += ["--out", str(tmp_path), "--no-progress", "--no-plots", "--max-tokens", "24"]
    assert main(args) == 0
    rows = [r for by in _rows(tmp_path).values() for r in by["router-sync"]]
    assert {t for r in rows for t in r["tiers"]} >= {1, 2}, [r["tiers"] for r in rows]
    kinds = [k for k in WORK_FIELDS if k.endswith("_tokens")]
    want = 0.0
    for r in rows:  # (a row whose answer never asked a tier may have no work there: the engine reads each tier's gain)
        device, cloud, top = r["tier_work"]
        assert device["passes"] == 0
        assert cloud["passes"] + top["passes"] == r["traffic"]["passes"]
        want += GpuCostModel.for_size(8).gpu_seconds(cloud["passes"], sum(cloud[k] for k in kinds))
        want += GpuCostModel.for_size(70.6).gpu_seconds(top["passes"], sum(top[k] for k in kinds))
    assert all(sum(r["tier_work"][t]["passes"] for r in rows) > 0 for t in (1, 2))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["tier_sizes"] == [8.0, 70.6] and report["config"]["tier"] == ["gemma3-270m"]
    n_tokens = sum(len(r["tokens"]) for r in rows)
    got = report["policies"]["router-sync"]["gpu_s_per_1k_model"]
    assert got == pytest.approx(want / (n_tokens / 1000.0), abs=0.002)
