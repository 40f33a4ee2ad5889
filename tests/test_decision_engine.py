"""The token hook (shared/decision_engine.py): an operator's decision engine, installed as a
package with an entry point, chosen with --decision-engine, deciding each position the router
scores. The example package (examples/budget-engine) is really installed, with pip, into a
folder of this test's own, and run in-process and through the command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge_client.options import GeneratorOptions
from shared.decision_engine import (
    BUILTIN_ENGINE,
    CLOUD,
    DecisionEngineError,
    EngineSetup,
    PolicyEngine,
    Position,
    build_engine,
    engine_name,
    installed_engines,
    parse_spec,
)
from shared.policy import PolicyConfig, RoutingPolicy
from tests.conftest import QUESTIONS, chat
from tests.helpers import StandInEngine, ask_cli, make_generator

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "budget-engine"


@pytest.fixture(scope="module")
def budget_installed(tmp_path_factory) -> Path:
    """examples/budget-engine installed with pip into a folder of its own (a copy is built, so the
    checkout gains no build files); returns the folder to put on the import path."""
    work = tmp_path_factory.mktemp("budget")
    source = work / "src"
    shutil.copytree(EXAMPLE, source)
    target = work / "site"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return target


@pytest.fixture
def on_path(budget_installed, monkeypatch):
    monkeypatch.syspath_prepend(str(budget_installed))
    return budget_installed


def fixed_policy(threshold: float) -> RoutingPolicy:
    return RoutingPolicy(PolicyConfig("router", threshold=threshold, cloud_fraction=None))


def test_specs_and_unknown_engines_are_explained():
    assert parse_spec("budget") == ("budget", {})
    assert parse_spec("budget:max_cloud=4, share = 0.5") == ("budget", {"max_cloud": "4", "share": "0.5"})
    with pytest.raises(DecisionEngineError, match="not key=value"):
        parse_spec("budget:max_cloud")
    with pytest.raises(DecisionEngineError, match="names no engine"):
        parse_spec(":x=1")
    with pytest.raises(DecisionEngineError, match="no decision engine 'nosuch' is installed.*router"):
        engine_name("nosuch")
    with pytest.raises(ValueError, match="nosuch"):  # refused with the options, before any model loads
        GeneratorOptions(decision_engine="nosuch").validate()
    with pytest.raises(DecisionEngineError, match="takes no options"):
        build_engine("router:x=1", EngineSetup(fixed_policy(0.5), {}))


def test_the_builtin_engine_is_the_policy():
    """Same scores, same decisions: the hook changes nothing by default."""
    scores = [0.1, 0.7, 0.4, 0.9, 0.55, 0.2]
    engine = build_engine(BUILTIN_ENGINE, EngineSetup(fixed_policy(0.5), {}))
    assert isinstance(engine, PolicyEngine)
    reference = fixed_policy(0.5)
    got = [engine.decide(Position(index=i, score=s)) == CLOUD for i, s in enumerate(scores)]
    assert got == [reference.decide(s) for s in scores] == [False, True, False, True, True, False]


def test_the_example_package_is_found_and_checks_its_options(on_path):
    assert "budget" in installed_engines()
    engine = build_engine("budget:max_cloud=2", EngineSetup(fixed_policy(0.0), {}))
    assert engine.name == "budget"
    engine.start_answer()
    assert [engine.decide(Position(index=i, score=0.9)) for i in range(4)] == [1, 1, 0, 0]
    engine.start_answer()  # a new answer has its budget back
    assert engine.decide(Position(score=0.9)) == CLOUD
    with pytest.raises(DecisionEngineError, match="budget.*refused its setup.*unknown option.*colour"):
        build_engine("budget:colour=red", EngineSetup(fixed_policy(0.5), {}))
    with pytest.raises(DecisionEngineError, match="whole number"):
        build_engine("budget:max_cloud=-1", EngineSetup(fixed_policy(0.5), {}))


def test_an_engine_choosing_a_tier_the_pool_lacks_is_named(edge_model, cloud_server):
    """An engine's bug stops the answer with its name, rather than passing as a route."""
    gen = make_generator(edge_model, cloud_server, threshold=0.0)
    try:
        gen.engine = StandInEngine("wrong-tier", lambda i: 7)  # a broken engine cannot be installed on purpose
        with pytest.raises(DecisionEngineError, match="'wrong-tier' chose tier 7"):
            gen.generate(chat(QUESTIONS[1]), max_tokens=8)
    finally:
        gen.close()


def test_the_installed_engine_decides_over_a_real_cloud(on_path, edge_model, cloud_server):
    """Every position is hard to the policy (threshold 0); the budget engine sends only 3 up,
    the first three, and the built-in engine sends them all. The cloud (on loopback, over its
    WebSocket) writes exactly those."""
    for spec, expect in (("budget:max_cloud=3", 3), (BUILTIN_ENGINE, None)):
        gen = make_generator(edge_model, cloud_server, threshold=0.0, decision_engine=spec)
        try:
            answer = gen.generate(chat(QUESTIONS[1]), max_tokens=12)
        finally:
            gen.close()
        assert answer.decision_engine == spec.split(":")[0]
        assert answer.n_tokens > 3 and not answer.degraded
        n_cloud = expect if expect is not None else answer.n_tokens
        assert answer.routes == ["cloud"] * n_cloud + ["edge"] * (answer.n_tokens - n_cloud)
        assert answer.traffic.round_trips == n_cloud


@pytest.mark.slow
def test_the_command_line_runs_an_installed_engine(budget_installed):
    """`tokenrouter-edge ask --decision-engine budget:max_cloud=2` with every other default
    (the calibrated share, lookahead, the check): the engine decides what the router is asked,
    and the JSON says which engine ran. A misspelt engine is refused before any model loads."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(budget_installed), str(ROOT)]))

    def ask(*flags: str) -> subprocess.CompletedProcess[str]:
        return ask_cli("why is the sky blue", *flags, env=env)

    p = ask("--decision-engine", "budget:max_cloud=2", "--max-tokens", "32")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["decision_engine"] == "budget" and not out["degraded"]
    router_cloud = [
        i
        for i, (route, score) in enumerate(zip(out["routes"], out["scores"]))
        if route == "cloud" and score is not None and i not in out["overruled_positions"]
    ]
    assert len(router_cloud) <= 2  # the rest came from lookahead guesses or the check, not the router
    p = ask("--decision-engine", "budgit")
    assert p.returncode != 0 and "no decision engine 'budgit' is installed" in p.stderr
    assert "budget" in p.stderr  # the installed ones are listed


def test_the_eval_asks_the_same_engine(on_path):
    """`tokenrouter-train eval --decision-engine`: every routed method's engine is built around its
    policy, as on the device, so an operator's engine is evaluated offline on the same prompts.
    The budget engine capped at one cloud position per answer routes at most that many per prompt
    at every target, and the result names the engine; the built-in one routes more at 50 %."""
    from models.train.cli import DEFAULT_ROUTER
    from models.train.evaluate import EvalOptions, evaluate

    prompts = ["how do i reset my wifi router", "what is the capital of france"]
    results = {}
    for spec in ("budget:max_cloud=1", BUILTIN_ENGINE):
        opts = EvalOptions(
            DEFAULT_ROUTER,
            "smollm2-135m-q3_k_s",
            "smollm2-135m-q4_1",
            fractions=(0.5,),
            max_tokens=16,
            progress=False,
            decision_engine=spec,
        )
        results[spec] = evaluate(prompts, opts)
        assert results[spec]["decision_engine"] == spec
    for method in ("learned", "entropy", "random"):
        capped = next(p for p in results["budget:max_cloud=1"]["methods"][method] if p["target_fraction"] == 0.5)
        free = next(p for p in results[BUILTIN_ENGINE]["methods"][method] if p["target_fraction"] == 0.5)
        assert round(capped["cloud_fraction"] * capped["n_tokens"]) <= len(prompts), (method, capped)  # (rounded share)
        assert free["cloud_fraction"] > capped["cloud_fraction"], (method, free, capped)
