"""Run the whole suite several times, some with a core kept busy, and list every test whose result changed.

Why: a flaky test is a broken test, and CI draws one ordering and one load per run. A test that reads
what another left (a shared server's counters, a shared folder, the clock) or that only passes on an
idle machine shows up here as a result that changed between runs, before CI finds it.

Each run is `make -k suite` (what `make test` runs: the parallel part, the serial part, the
kernel-sensitive tests under noise), its JUnit reports under build/flakes/run-N/. The busy runs
have `--busy-cores` processes spinning a Python loop beside the suite (shared/cpus.py), as a desktop
that is never idle has.

    python scripts/find_flakes.py                       # 2 quiet runs and 1 busy run (make flakes)
    python scripts/find_flakes.py --runs 1 --busy-runs 2 --busy-cores 1

The report (build/flakes/report.json and the lines printed) names:
- changed: tests whose outcome differed between runs (flaky: fix them);
- failed: tests that failed in every run (broken, not flaky);
- missing: tests that ran in some runs and not others (a collection that depends on the machine).
Exit status 1 if any list is not empty.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.cpus import BusyCores  # noqa: E402

OUT = ROOT / "build" / "flakes"


def outcomes(junit_dir: Path) -> dict[str, str]:
    """Each test's outcome in one run ("passed", "failed", "error", "skipped"), by its id; a test run in
    two parts of the suite (plain and under kernel noise) is one id per part, "<part>::<id>"."""
    out: dict[str, str] = {}
    for report in sorted(junit_dir.glob("*.xml")):
        part = report.stem
        for case in ET.parse(report).getroot().iter("testcase"):
            test_id = f"{part}::{case.get('classname', '')}::{case.get('name', '')}"
            kinds = {child.tag for child in case}
            outcome = "failed" if "failure" in kinds else "error" if "error" in kinds else "passed"
            if "skipped" in kinds:
                outcome = "skipped"
            if out.get(test_id) in ("failed", "error"):
                continue  # a test that failed and then errored in teardown stays failed
            out[test_id] = outcome
    return out


def run_suite(index: int, busy_cores: int, make: str) -> dict:
    """One `make -k suite` run, with `busy_cores` spinning beside it; its outcomes and wall time."""
    junit = OUT / f"run-{index}"
    junit.mkdir(parents=True, exist_ok=True)
    for old in junit.glob("*.xml"):
        old.unlink()
    cmd = [make, "--no-print-directory", "-k", "suite", f"JUNIT={junit}"]
    print(f"run {index}: {' '.join(cmd)}" + (f" beside {busy_cores} busy core(s)" if busy_cores else ""), flush=True)
    t0 = time.monotonic()
    with open(junit / "log.txt", "w") as log, BusyCores(busy_cores) as busy:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    got = outcomes(junit)
    bad = sum(o in ("failed", "error") for o in got.values())
    print(f"run {index}: exit {rc}, {len(got)} results, {bad} failed, {wall / 60:.1f} min", flush=True)
    return {
        "index": index,
        "busy_cores": busy_cores,
        "busy": busy.report,
        "exit": rc,
        "wall_s": round(wall, 1),
        "outcomes": got,
    }


def compare(runs: list[dict]) -> dict[str, list]:
    """What changed between runs, what failed in all of them, what ran in some only."""
    seen: dict[str, list[str | None]] = defaultdict(lambda: [None] * len(runs))
    for i, run in enumerate(runs):
        for test_id, outcome in run["outcomes"].items():
            seen[test_id][i] = outcome
    changed, failed, missing = [], [], []
    for test_id, results in sorted(seen.items()):
        if None in results:
            missing.append({"test": test_id, "results": results})
        elif len(set(results)) > 1:
            changed.append({"test": test_id, "results": results})
        elif results[0] in ("failed", "error"):
            failed.append({"test": test_id, "results": results})
    return {"changed": changed, "failed": failed, "missing": missing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="runs on a quiet machine (default 2)")
    ap.add_argument("--busy-runs", type=int, default=1, help="runs with --busy-cores kept busy (default 1)")
    ap.add_argument("--busy-cores", type=int, default=1, help="processes spinning beside a busy run (default 1)")
    ap.add_argument("--make", default="make", help="the make program (default: make)")
    args = ap.parse_args(argv)
    if args.runs < 0 or args.busy_runs < 0 or args.runs + args.busy_runs < 2:
        ap.error("at least two runs in all (--runs + --busy-runs >= 2): a change needs two results to compare")
    if args.busy_cores < 1 and args.busy_runs:
        ap.error("--busy-cores must be >= 1 for a busy run")
    plan = [0] * args.runs + [args.busy_cores] * args.busy_runs
    runs = [run_suite(i + 1, busy, args.make) for i, busy in enumerate(plan)]
    found = compare(runs)
    report = {
        "runs": [{k: v for k, v in r.items() if k != "outcomes"} for r in runs],
        "tests": len({t for r in runs for t in r["outcomes"]}),
        **found,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{report['tests']} results compared over {len(runs)} runs (build/flakes/report.json)")
    for what, rows in found.items():
        print(f"{what}: {len(rows)}")
        for row in rows:
            print(f"  {row['test']}: {' / '.join(str(r) for r in row['results'])}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
