"""Honest tiers: a base model (no chat template) continues text rather than answering, so the
registry marks it and every surface that shows an answer warns when one wrote any of it.
Real models, a real cloud on loopback (Gemma-3-270M base, text mode), the real commands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from edge_client.generator import base_model_warnings
from models.registry import BASE_MODELS, available_models, model_info
from shared.llama_backend import LlamaModel
from tests.conftest import GEMMA, QUESTIONS, ROOT, chat
from tests.helpers import make_generator


def test_the_registry_marks_base_models_as_their_files_say():
    for name in available_models():
        info = model_info(name)
        assert (name in BASE_MODELS) == (not info.chat) == (info.kind == "base"), name
    p = subprocess.run(
        [sys.executable, "-m", "edge_client.cli", "models"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    lines = {line.split()[0]: line for line in p.stdout.splitlines()}
    assert "base model" in lines[GEMMA]
    assert "base model" not in lines["smollm2-135m-q4_1"] and "base model" not in lines["smollm2-135m-q3_k_s"]


def test_an_answer_the_base_cloud_wrote_in_says_so(edge_model, edge_info, gemma_server, cloud_server):
    """Every position hard: the Gemma base cloud writes, its accept says it is a base model, and
    the answer carries the warning; the chat cloud's answer carries none."""
    for server, base in ((gemma_server, True), (cloud_server, False)):
        gen = make_generator(edge_model, server, threshold=0.0)
        try:
            answer = gen.generate(chat(QUESTIONS[1]), max_tokens=6)
            assert gen.link is not None and gen.link.accept.base_model is base
        finally:
            gen.close()
        assert answer.n_cloud_tokens > 0 and not answer.degraded
        assert answer.warnings == base_model_warnings(edge_info, base)
        assert ("the cloud's model is a base model" in " ".join(answer.warnings)) is base
        assert answer.to_json()["warnings"] == answer.warnings


def test_a_base_device_model_is_named(gemma_info):
    gemma = LlamaModel(gemma_info)
    try:
        gen = make_generator(gemma, None, mode="edge")
        try:
            answer = gen.generate(chat(QUESTIONS[0]), max_tokens=4)
        finally:
            gen.close()
    finally:
        gemma.close()
    assert answer.warnings == base_model_warnings(gemma_info, False)
    assert len(answer.warnings) == 1 and f"the device model {GEMMA} is a base model" in answer.warnings[0]


@pytest.mark.slow
def test_the_command_warns_when_the_cloud_model_is_a_base_model():
    p = subprocess.run(
        [sys.executable, "-m", "edge_client.cli", "ask", "what is the capital of france", "--json"]
        + ["--cloud-model", GEMMA, "--threshold", "0", "--max-tokens", "6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "warning: the cloud's model is a base model" in p.stderr
