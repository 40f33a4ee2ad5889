"""scripts/loadtest.py runs end to end (tiny and short): its JSON has the promised fields and no token is lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_loadtest_json_report():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "loadtest.py"), "--sessions", "3", "--duration", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    for key in (
        "sessions",
        "throughput_tok_s",
        "single_session_throughput_tok_s",
        "p50_ms",
        "p95_ms",
        "single_session_p95_ms",
        "errors",
        "lost_tokens",
        "duplicated_tokens",
    ):
        assert key in report, key
    assert report["sessions"] == 3 and report["sessions_opened"] == 3
    assert report["errors"] == 0 and report["lost_tokens"] == 0 and report["duplicated_tokens"] == 0
    assert report["throughput_tok_s"] > 0 and report["p95_ms"] >= report["p50_ms"] > 0
    assert report["memory_within_budget"] is True
