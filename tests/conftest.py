"""Shared fixtures: the real bundled models and real cloud servers on loopback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cloud_server.local import LocalCloudServer  # noqa: E402
from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, model_info  # noqa: E402

SYSTEM = "You are a helpful voice assistant. Answer briefly, in one or two sentences."
QUESTIONS = [
    "how do you say hello in japanese",
    "what is the capital of france",
    "set a timer for ten minutes",
]


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="session")
def edge_info():
    return model_info(DEFAULT_EDGE_MODEL)


@pytest.fixture(scope="session")
def cloud_info():
    return model_info(DEFAULT_CLOUD_MODEL)


@pytest.fixture(scope="session")
def cloud_server():
    """The default cloud model (SmolLM2 Q4_1) served on loopback, with an API key."""
    with LocalCloudServer(model=DEFAULT_CLOUD_MODEL) as server:
        yield server


@pytest.fixture(scope="session")
def same_model_server(edge_info):
    """A cloud server running the very GGUF the device runs (for lossless checks)."""
    with LocalCloudServer(model=str(edge_info.path)) as server:
        yield server
