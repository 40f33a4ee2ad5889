"""The flake finder (scripts/find_flakes.py) reads real JUnit reports of real pytest runs and names what changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from find_flakes import compare, outcomes  # noqa: E402

TESTS = """
import os, pytest

def test_steady():
    assert True

def test_flips():
    assert os.environ["RUN"] == "1"

def test_always_broken():
    assert False

@pytest.mark.skipif(os.environ["RUN"] == "2", reason="only in run 1")
def test_skipped_once():
    pass

if os.environ["RUN"] == "1":
    def test_only_in_run_1():
        pass
"""


def run(tmp_path: Path, index: int) -> dict:
    """One pytest run of the little module above, its report in a folder of its own, as a part of the suite."""
    junit = tmp_path / f"run-{index}"
    junit.mkdir()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_little.py"),
         f"--junitxml={junit / 'parallel.xml'}"],
        cwd=tmp_path, env={"RUN": str(index), "PATH": "/usr/bin:/bin"}, capture_output=True, timeout=120,
    )  # fmt: skip
    return {"outcomes": outcomes(junit)}


def test_a_result_that_changed_is_named_and_a_steady_failure_is_not_called_flaky(tmp_path):
    (tmp_path / "test_little.py").write_text(TESTS)
    runs = [run(tmp_path, 1), run(tmp_path, 2)]
    first = runs[0]["outcomes"]
    assert first["parallel::test_little::test_steady"] == "passed"
    assert first["parallel::test_little::test_always_broken"] == "failed"
    found = compare(runs)
    changed = {row["test"].split("::")[-1]: row["results"] for row in found["changed"]}
    assert changed == {"test_flips": ["passed", "failed"], "test_skipped_once": ["passed", "skipped"]}
    assert [row["test"].split("::")[-1] for row in found["failed"]] == ["test_always_broken"]
    assert [row["test"].split("::")[-1] for row in found["missing"]] == ["test_only_in_run_1"]
    assert found["missing"][0]["results"] == ["passed", None]
