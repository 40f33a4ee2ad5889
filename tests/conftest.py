"""Shared fixtures: the real bundled models and real cloud servers on loopback."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cloud_server.local import LocalCloudServer  # noqa: E402
from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, model_info  # noqa: E402
from shared.cpus import pin_to_cpus  # noqa: E402

GEMMA = "gemma3-270m"
SYSTEM = "You are a helpful voice assistant. Answer briefly, in one or two sentences."
QUESTIONS = [
    "how do you say hello in japanese",
    "what is the capital of france",
    "set a timer for ten minutes",
]
LONG_QUESTIONS = [
    "explain how vaccines work",
    "tell me a fun fact about octopuses",
    "how do you say hello in japanese",
    "how do i reset my wifi router",
    "describe how a bicycle works",
    "what should i pack for a beach holiday",
    "what is a good recipe for pancakes",
    "how does a refrigerator keep food cold",
    "why is the sky blue",
    "what are some tips for sleeping better",
]
"""Questions with long answers, for tests that need hundreds of positions: how long an answer is
depends on the CPU's kernels (one Xeon wrote 143 tokens to the first five, a Zen 3 196), so such
a test takes questions until it has its positions, and this list has room for that."""


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="session")
def edge_info():
    return model_info(DEFAULT_EDGE_MODEL)


@pytest.fixture(scope="session")
def edge_model(edge_info):
    """The device model's weights, loaded once for the session (each test makes its own contexts)."""
    from shared.llama_backend import LlamaModel

    model = LlamaModel(edge_info)
    yield model
    model.close()


@pytest.fixture(scope="session")
def cloud_info():
    return model_info(DEFAULT_CLOUD_MODEL)


@pytest.fixture(scope="session")
def cloud_server():
    """The default cloud model (SmolLM2 Q4_1) served on loopback, with an API key."""
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL) as server:
        yield server


@pytest.fixture(scope="session")
def gemma_info():
    return model_info(GEMMA)


@pytest.fixture(scope="session")
def gemma_server():
    """A cloud with another vocabulary (Gemma-3-270M base): the mixed pair, text mode."""
    with LocalCloudServer(model=GEMMA) as server:
        yield server


@pytest.fixture(scope="session")
def same_model_server(edge_info):
    """A cloud server running the very GGUF the device runs (for lossless checks)."""
    with LocalCloudServer(model=str(edge_info.path)) as server:
        yield server


# --------------------------------------------------------------------------- `make check`'s selection

SLOW_MODULES = {
    # a browser, audio devices or real-time playback
    "test_webapp_browser",
    "test_voice_e2e",
    # cloud servers on loopback (started by the module's own fixtures or tests)
    "test_server_abuse",
    "test_server_price",
    "test_exploration",
    "test_failover",  # two replicas behind haproxy
    "test_cloud_server",
    "test_cpus",
    "test_replay_e2e",
    "test_routed_decoding",
    "test_server_engine",
    "test_server_fuzz",
    "test_server_hostile",
    "test_server_connections",
    "test_server_loadtest",
    "test_server_production",
    "test_server_remote",
    "test_text_mode",
}
SERVER_FIXTURES = {"cloud_server", "same_model_server", "gemma_server", "openai_server", "llama_server"}


# --------------------------------------------------------------------------- `make test`'s serial part

SERIAL_MODULES = {
    # real-time audio through real (virtual) devices, and the browser
    "test_webapp_browser",
    "test_voice_e2e",
    # an honest device's time beside an attack against its time alone, or a timed window (drain, backoff,
    # failover, a load test, an emulated link's measured delay)
    "test_server_abuse",
    "test_server_hostile",
    "test_server_price",
    "test_server_connections",  # issue 47: a drain's deadline, connections before hello beside an honest device
    "test_server_production",
    "test_failover",
    "test_server_loadtest",
    "test_replay_netem",
}
"""Modules whose tests `make test` runs alone, after the parallel part (a single test elsewhere says so
with `@pytest.mark.serial`): what they measure is wall time on an otherwise quiet machine, which a
second worker on the same two cores would change."""


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test`'s parallel part), pin each worker to a core of its own, when the
    machine has one for each: two workers that each spin llama.cpp's two threads on both cores took
    1.4x less time than one worker, not 2x. Pinned, a worker's models and the servers and commands it
    starts (which inherit the mask) use that core's one thread (shared/llama_backend.default_threads)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if worker.startswith("gw") and 1 < workers <= len(cpus):
        pin_to_cpus(str(cpus[int(worker[2:]) % len(cpus)]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `slow` every test that needs a cloud server, a browser or an audio device, by its module
    or its fixtures: `make check` (-m "not slow") runs the rest, the quick loop. Mark `serial` every
    test of SERIAL_MODULES: `make test` runs the others on several workers first, then these alone."""
    for item in items:
        module = item.path.stem
        if module in SLOW_MODULES or SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if module in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
