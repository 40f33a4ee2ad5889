"""Honest tiers: a base model (no chat template) continues text rather than answering, so the
registry marks it, it is refused as an answer writer unless `--allow-base-model`, and where it is
allowed every surface that shows an answer warns when it wrote any of it.
Real models, a real cloud on loopback (Gemma-3-270M base, text mode), the real commands."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from edge_client.cloud_link import CloudLink, CloudRejected
from edge_client.generator import RoutedGenerator, base_model_warnings
from edge_client.options import GeneratorOptions
from models.registry import BASE_MODELS, available_models, model_info
from shared.llama_backend import LlamaModel
from shared.router import HeuristicRouter
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
    """Refused by its file's header (a .gguf path is not in the registry's marks), then allowed and warned."""
    gemma = LlamaModel(gemma_info)
    try:
        with pytest.raises(ValueError, match=f"the device model {GEMMA} is a base model"):
            make_generator(gemma, None, mode="edge", allow_base_model=False)
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
def test_the_command_refuses_a_base_model_unless_allowed_and_then_warns():
    """Without --allow-base-model the command exits before any model loads, naming the model and the
    flag; with it, the answer comes and stderr carries the warning."""

    def ask(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "edge_client.cli", "ask", "what is the capital of france", "--json"]
            + ["--cloud-model", GEMMA, "--threshold", "0", "--max-tokens", "6", *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    p = ask()
    assert p.returncode != 0 and p.stdout == ""
    assert f"cloud_model (--cloud-model) {GEMMA!r} is a base model" in p.stderr and "--allow-base-model" in p.stderr
    p = ask("--allow-base-model")
    assert p.returncode == 0, p.stderr
    assert "warning: the cloud's model is a base model" in p.stderr


def test_options_refuse_every_registered_base_model_they_name():
    """The device's model, the local cloud's and a local tier's; a cloud the device does not start
    (policy edge, or a URL) is not refused here (a URL's accept is, below)."""
    for opts, flag in (
        (GeneratorOptions(edge_model=GEMMA), "edge_model (--edge-model)"),
        (GeneratorOptions(cloud_model=GEMMA), "cloud_model (--cloud-model)"),
        (GeneratorOptions(tiers=(f"local:{GEMMA}",)), "a tier (--tier)"),
    ):
        with pytest.raises(ValueError, match="is a base model") as err:
            opts.validate()
        assert flag in str(err.value) and "--allow-base-model" in str(err.value)
        replace(opts, allow_base_model=True).validate()
    GeneratorOptions(cloud_model=GEMMA, policy="edge").validate()  # no cloud starts
    GeneratorOptions(cloud_model=GEMMA, cloud="ws://127.0.0.1:1/v1/session").validate()  # not the local server's model


def test_a_remote_base_cloud_is_refused_by_its_accept(edge_model, gemma_server, cloud_server):
    """A cloud URL serving the Gemma base model: the accept says base_model, so the session is
    refused (CloudRejected, code base_model, naming the flag) and no token is asked of
    it; a tier above the cloud is refused the same way; with allow_base_model it writes."""
    gen = make_generator(edge_model, gemma_server, threshold=0.0, allow_base_model=False)
    try:
        with pytest.raises(CloudRejected) as err:
            gen.generate(chat(QUESTIONS[1]), max_tokens=4)
        assert err.value.code == "base_model" and "is a base model" in str(err.value)
        assert "--allow-base-model" in str(err.value)
        assert gen.link is None
        gen.reconfigure(allow_base_model=True)
        answer = gen.generate(chat(QUESTIONS[1]), max_tokens=4)
        assert answer.n_cloud_tokens > 0 and answer.warnings
    finally:
        gen.close()
    with pytest.raises(ValueError, match=f"a tier .--tier. '{GEMMA}' is a base model"):  # named local: refused at once
        make_generator(edge_model, cloud_server, tiers=[gemma_server], allow_base_model=False)
    opts = GeneratorOptions(  # the same tier behind a URL: its model is known from its accept only
        threshold=0.0,
        cloud_fraction=None,
        lookahead=False,
        check="off",
        tiers=(gemma_server.url,),
        decision_engine="escalate:above=0",
    )
    links = [lambda s=s: CloudLink(s.url, s.api_key, timeout_s=5.0) for s in (cloud_server, gemma_server)]
    gen = RoutedGenerator(
        edge_model, opts, links[0], router=HeuristicRouter("entropy", edge_model.n_vocab), tier_connects=links[1:]
    )
    try:
        with pytest.raises(CloudRejected, match="base_model"):
            gen.generate(chat(QUESTIONS[1]), max_tokens=4)
    finally:
        gen.close()
