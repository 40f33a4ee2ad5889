"""Pinning to CPUs: the CPU lists, and a loopback cloud server kept off the device's cores.

The voice benchmark pins the pipeline to some cores and the loopback cloud to others
(`bench_voice.py --device-cpus/--cloud-cpus`) to stand for a cloud on other hardware; these
tests check that the server and every thread it starts (llama.cpp's, uvicorn's) really run
only where they were put, and that a bad list is refused with its reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from cloud_server.local import LocalCloudServer
from edge_client.options import GeneratorOptions
from models.registry import DEFAULT_CLOUD_MODEL
from shared.cpus import format_cpus, online_cpus, parse_cpus, pin_to_cpus

REPO = Path(__file__).resolve().parents[1]


def test_cpu_lists_read_as_taskset_writes_them_and_bad_ones_say_why() -> None:
    assert parse_cpus("0,2-3") == {0, 2, 3}
    assert parse_cpus(" 5 ") == {5}
    for cpus in ({0}, {0, 1}, {0, 1, 2, 5}, {1, 3, 4, 5, 9}):
        assert parse_cpus(format_cpus(cpus)) == cpus
    assert format_cpus({0, 1, 2, 5}) == "0-2,5"
    for bad, says in (("", "not a CPU list"), ("a", "not a CPU list"), ("1-", "not a CPU list"), ("3-1", "backwards")):
        with pytest.raises(ValueError, match=says):
            parse_cpus(bad)
    beyond = max(online_cpus()) + 1  # past the machine's CPUs (this worker may be pinned to one of them)
    with pytest.raises(ValueError, match=f"CPU {beyond} is not available to this process"):
        pin_to_cpus(str(beyond))
    with pytest.raises(ValueError, match="--cloud-cpus"):
        GeneratorOptions(cloud="none", cloud_cpus="0").validate()
    with pytest.raises(ValueError, match="not a CPU list"):
        GeneratorOptions(cloud="local", cloud_cpus="zero").validate()


def _allowed(pid: int) -> dict[int, str]:
    """Each thread of process `pid`: the CPUs it may run on."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out


def test_a_pinned_loopback_server_and_all_its_threads_run_on_its_cpus_only(cloud_server) -> None:
    cpu = max(os.sched_getaffinity(0))  # the last core: a benchmark gives the device the first ones
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL, cpus=str(cpu)) as server:
        assert server.proc is not None
        threads = _allowed(server.proc.pid)
        assert len(threads) > 1  # the model's and the server's threads, not just the main one
        assert set(threads.values()) == {str(cpu)}, threads
        with urllib.request.urlopen(server.http_url + "/healthz", timeout=10) as r:
            assert r.status == 200  # and it serves
    # without the option (the shared server) it may run anywhere this process may
    assert cloud_server.proc is not None
    assert set(_allowed(cloud_server.proc.pid).values()) == {format_cpus(os.sched_getaffinity(0))}


def test_the_server_refuses_a_cpu_it_cannot_use_before_loading_a_model() -> None:
    beyond = max(online_cpus()) + 1  # past the machine's CPUs (this worker may be pinned to one of them)
    proc = subprocess.run(
        [sys.executable, "-m", "cloud_server.cli", "serve", "--port", "0", "--insecure", "--cpus", str(beyond)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode != 0
    assert f"--cpus: CPU {beyond} is not available to this process" in proc.stderr


def test_a_benchmark_pinned_to_its_cores_starts_a_server_on_others() -> None:
    """The benchmark pins itself first, so the server inherits the device's mask and must widen it."""
    cpus = sorted(online_cpus())  # the machine's: the script pins itself, whatever this worker's mask
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    script = (
        "import sys; from shared.cpus import pin_to_cpus; from cloud_server.local import LocalCloudServer\n"
        "from tests.test_cpus import _allowed\n"
        f"pin_to_cpus('{cpus[0]}')\n"
        f"with LocalCloudServer(model=sys.argv[1], cpus='{cpus[-1]}') as s:\n"
        "    print(sorted(set(_allowed(s.proc.pid).values())), sorted(set(_allowed(__import__('os').getpid()).values())))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, DEFAULT_CLOUD_MODEL], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == f"['{cpus[-1]}'] ['{cpus[0]}']"
