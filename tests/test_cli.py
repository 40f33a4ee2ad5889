"""The command-line entry points, run as a user runs them (child processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge_client.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.slow  # a loopback cloud server (`ask` starts one)
def test_ask_json_with_a_local_cloud(tmp_path):
    log_path = tmp_path / "routes.jsonl"
    p = run(
        "ask",
        "what is the capital of france",
        "--json",
        "--max-tokens",
        "24",
        "--threshold",
        "0.3",
        "--check",
        "off",
        "--routing-log",
        str(log_path),
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for key in (
        "text",
        "tokens",
        "routes",
        "scores",
        "n_tokens",
        "n_cloud_tokens",
        "policy",
        "degraded",
        "latency_ms",
        "bytes_up",
        "bytes_down",
        "edge_model",
        "cloud_model",
    ):
        assert key in out, key
    for key in ("first_token", "per_token_p50", "per_token_p95", "total", "router_p50"):
        assert out["latency_ms"][key] >= 0
    assert out["n_tokens"] == len(out["tokens"]) == len(out["routes"]) == len(out["scores"])
    assert out["n_cloud_tokens"] == out["routes"].count("cloud") > 0
    # lookahead (on by default; here without the check): right after a round-trip cloud token the cloud's guess decides (no score)
    guessed = set(out["lookahead_positions"])
    assert guessed == {i for i, s in enumerate(out["scores"]) if s is None}
    assert [s >= 0.3 for s in out["scores"] if s is not None] == [
        r == "cloud" for i, r in enumerate(out["routes"]) if i not in guessed
    ]
    assert all(i > 0 and out["routes"][i - 1] == "cloud" for i in guessed)
    assert out["lookahead_tokens"] == sum(1 for i in guessed if out["routes"][i] == "cloud")
    assert out["round_trips"] == out["n_cloud_tokens"] - out["lookahead_tokens"]
    assert out["policy"] == "router" and out["degraded"] is False and out["bytes_up"] > 0
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["writer"] for r in rows] == out["routes"]


@pytest.mark.slow  # a loopback cloud server (`ask` starts one)
def test_ask_with_the_clouds_check():
    """`--check`: one verify per clause instead of a round trip per hard token, no lookahead;
    every overruled position is a cloud token the router had not flagged."""
    p = run(
        "ask",
        "what is the capital of france",
        "--json",
        "--max-tokens",
        "24",
        "--threshold",
        "0.6",
        "--check",
        "--check-nats",
        "1",
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["lookahead_positions"] == [] and None not in out["scores"] and not out["degraded"]
    for i in out["overruled_positions"]:
        assert out["routes"][i] == "cloud" and out["scores"][i] < 0.6
    flagged = [s >= 0.6 for s in out["scores"]]
    assert all(r == "cloud" for r, f in zip(out["routes"], flagged) if f), (
        "a flagged draft is the cloud's, kept or replaced"
    )
    assert 1 <= out["round_trips"] <= out["n_tokens"] and out["n_cloud_tokens"] >= len(out["overruled_positions"])
    bad = run("ask", "hi", "--check", "--check-nats", "0", "--cloud", "none")
    assert bad.returncode != 0 and "--check-nats" in bad.stderr


@pytest.mark.slow  # a loopback cloud server (`ask` starts one)
def test_a_cloud_share_of_zero_sends_nothing_up():
    """`--cloud-fraction 0` with every other default (the check, lookahead, a local cloud): the device answers
    alone: no round trip, no byte, no cloud token, not degraded (no server was needed, none was started)."""
    p = run("ask", "what is the capital of france", "--json", "--max-tokens", "12", "--cloud-fraction", "0")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["round_trips"] == 0 and out["bytes_up"] == 0 and out["n_cloud_tokens"] == 0, out
    assert not out["degraded"] and out["n_tokens"] > 0 and out["policy"] == "edge"


@pytest.mark.slow  # a loopback cloud server (`ask` starts one)
def test_human_output_marks_cloud_tokens():
    p = run("ask", "what is the capital of france", "--max-tokens", "12", "--threshold", "0.0")
    assert p.returncode == 0, p.stderr
    assert "«" in p.stdout and "from the cloud" in p.stdout


def test_unreachable_cloud_degrades_and_bad_model_is_named(tmp_path):
    p = run("ask", "hello", "--json", "--max-tokens", "6", "--cloud", "ws://127.0.0.1:9/v1/route", "--threshold", "0.0")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["degraded"] is True and out["n_cloud_tokens"] == 0 and out["n_tokens"] > 0
    p = run("ask", "hello", "--edge-model", str(tmp_path / "missing.gguf"), "--cloud", "none")
    assert p.returncode != 0 and "missing.gguf" in p.stderr and "neither a registered name" in p.stderr


def test_a_run_of_cloud_tokens_is_marked_once():
    """`ask`'s human output (and scripts/bench_answers.py's side-by-side file) marks each run of
    cloud-written tokens once: «A day» is« 24.», not «A»« day» is« 24»«.»."""
    from edge_client.answer import Answer
    from edge_client.cli import marked_text, render_human

    a = Answer(
        policy="router", pieces=["A", " day", " is", " 24", "."], routes=["cloud", "cloud", "edge", "cloud", "cloud"]
    )
    assert marked_text(a) == "«A day» is« 24.»"
    assert render_human(a, color=False).startswith("«A day» is« 24.»\n")
    assert render_human(a, color=True).startswith("\x1b[1;36mA day\x1b[0m is\x1b[1;36m 24.\x1b[0m\n")
