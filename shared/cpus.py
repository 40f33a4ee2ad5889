"""Pinning this process to a set of CPUs (Linux), named as `taskset -c` names them ("0,2-3").

Why: the voice benchmark's loopback cloud server shares the device's cores, which production's
cloud (another machine) does not. On a machine with cores to spare, pinning the device side to
two cores and the cloud server to others measures a two-core device with a remote cloud in one
run (`scripts/bench_voice.py --device-cpus 0,1 --cloud-cpus 2,3`; docs/voice.md).
"""

from __future__ import annotations

import os
from pathlib import Path


def parse_cpus(spec: str) -> set[int]:
    """CPU numbers from a list like "0,2-3"; ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{spec!r} is not a CPU list: write CPU numbers and ranges, like 0,2-3")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{spec!r}: the range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus


def pin_to_cpus(spec: str) -> set[int]:
    """Run this process on the CPUs `spec` names only: every thread it has (an import may already have
    started some, numpy's BLAS pool for one) and, by inheritance, every thread it starts later."""
    cpus = parse_cpus(spec)
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("pinning to CPUs needs Linux (os.sched_setaffinity)")
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)  # may widen an inherited mask: a loopback server started by a pinned benchmark
        missing = sorted(cpus - os.sched_getaffinity(0))  # the kernel keeps only the usable ones
    except OSError:
        missing = sorted(cpus)
    if missing:
        os.sched_setaffinity(0, before)
        raise ValueError(
            f"CPU {', '.join(map(str, missing))} is not available to this process (this machine has {_online()})"
        )
    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else []:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass  # it ended meanwhile
    return cpus


def _online() -> str:
    try:
        return Path("/sys/devices/system/cpu/online").read_text().strip()
    except OSError:
        return format_cpus(set(range(os.cpu_count() or 1)))


def format_cpus(cpus: set[int]) -> str:
    """The shortest list that `parse_cpus` reads back: {0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
