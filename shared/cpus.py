"""Pinning this process to a set of CPUs (Linux), named as `taskset -c` names them ("0,2-3").

Why: the voice benchmark's loopback cloud server shares the device's cores, which production's
cloud (another machine) does not. On a machine with cores to spare, pinning the device side to
two cores and the cloud server to others measures a two-core device with a remote cloud in one
run (`scripts/bench_voice.py --device-cpus 0,1 --cloud-cpus 2,3`; docs/voice.md).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
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
    return format_cpus(online_cpus())


def online_cpus() -> set[int]:
    """The machine's CPUs, whatever this process's mask (a test worker or a benchmark may be pinned to one)."""
    try:
        return parse_cpus(Path("/sys/devices/system/cpu/online").read_text().strip())
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def format_cpus(cpus: set[int]) -> str:
    """The shortest list that `parse_cpus` reads back: {0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class BusyCores:
    """Other work on the cores: `n` processes that each spin a Python loop, as a busy desktop has.

    For benchmarks (`scripts/bench_voice.py --busy-cores`) and the flake finder (`scripts/find_flakes.py`),
    which run what they measure beside it. `with BusyCores(1) as busy: ...`, then `busy.report`: for each
    process, whether it ran to the end and the share of a core it got. Killed at exit if left running.
    """

    LOOP = "while True:\n    pass\n"

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"busy cores must be >= 0, not {n}")
        self.n = n
        self.procs: list[subprocess.Popen] = []
        self.report: list[dict] = []
        self._t0 = 0.0

    def start(self) -> "BusyCores":
        self._t0 = time.monotonic()
        self.procs = [subprocess.Popen([sys.executable, "-c", self.LOOP]) for _ in range(self.n)]
        atexit.register(self.stop)
        return self

    def stop(self) -> list[dict]:
        """Kill them (once); for each, whether it was still running and its share of a core (Linux)."""
        out = []
        for p in self.procs:
            running = p.poll() is None
            cpu_s = None
            try:  # utime + stime, clock ticks (fields 14 and 15 of /proc/PID/stat)
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                pass
            if running:
                p.kill()
                p.wait()
            wall = time.monotonic() - self._t0
            out.append(
                {
                    "ran_to_the_end": running,
                    "wall_s": round(wall, 1),
                    "core_share": None if cpu_s is None else round(cpu_s / wall, 2),
                }
            )
        self.procs = []
        self.report = out or self.report
        return self.report

    def __enter__(self) -> "BusyCores":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
