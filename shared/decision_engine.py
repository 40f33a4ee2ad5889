"""The token hook: who decides, at each position, whether the device keeps its token.

shared/decision.py fixes the order of things at a position (the check, a lookahead
guess, then the router); where the router is asked, a `DecisionEngine` gives the
answer. The built-in engine, `router`, is the routing policy (shared/policy.py):
the router's score against a threshold, fixed or calibrated to a cloud share. An
operator plugs in their own engine without editing this tree, as a Python package
that declares an entry point in the group `tokenrouter.decision_engines`:

    [project.entry-points."tokenrouter.decision_engines"]
    budget = "my_package:make_engine"

and selects it with `--decision-engine budget` (options after a colon:
`--decision-engine budget:max_cloud=4,share=0.5`). The entry point is a callable
taking an `EngineSetup` and returning a `DecisionEngine`; examples/budget-engine
is a complete one. docs/architecture.md ("The token hook") says what an engine may
and may not do.

A position's tier is an int: `DEVICE` (0) keeps the device's token, `CLOUD` (1)
asks the cloud's model, and 2, 3, ... the tiers above it where the pool has them
(`--tier`: e.g. an 8B cloud, then a 70B one). The built-in `escalate` engine uses
them: the policy says hard or easy as `router` does, and a hard position scoring at
least `above` (or, with `top_share`, a threshold calibrated to that share of the hard
positions) goes to the top tier. The built-in `cost` engine (shared/cost_engine.py) chooses, per
position, the tier whose expected gain best pays for its GPU cost under per-answer budgets.
"""

from __future__ import annotations

from dataclasses import replace
from importlib.metadata import entry_points
from typing import Callable

import numpy as np

from shared.cost_engine import make_cost_engine
from shared.decision_engine_api import (  # the types an engine is written against, importable from here too
    CLOUD,
    DEVICE,
    DecisionEngine,
    DecisionEngineError,
    EngineSetup,
    Position,
    option_number,
)
from shared.policy import RoutingPolicy, ScoreCalibrator

ENTRY_POINT_GROUP = "tokenrouter.decision_engines"
BUILTIN_ENGINE = "router"


class PolicyEngine:
    """The built-in engine: the routing policy decides from the router's score."""

    name = BUILTIN_ENGINE

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy

    def start_answer(self) -> None:
        pass  # the generator resets the policy itself, whichever engine runs

    def decide(self, position: Position) -> int:
        return CLOUD if self.policy.decide(position.score) else DEVICE


class EscalateEngine:
    """Built in, for a pool of tiers: the policy decides hard or easy (as `router`); a hard position
    scoring at least `above` goes to the top tier, the other hard ones to the first cloud tier.
    With `top_share` instead, `above` is calibrated online (as the policy calibrates its threshold
    to a cloud share) so that this share of the hard positions goes to the top tier. Where the
    policy targets a cloud share with the router's known score distribution, the calibration
    starts from it: the hard positions are the top `cloud_fraction` of scores, so their top
    `top_share` is the top `cloud_fraction * top_share` of all (a first answer's few hard
    positions once never moved the threshold off its start, and the top tier was never asked)."""

    name = "escalate"

    def __init__(self, policy: RoutingPolicy, above: float, top: int, top_share: float | None = None) -> None:
        self.policy = policy
        self.above = above
        self.top = top
        self.calibrator = None
        if top_share is not None:
            prior, share = policy.prior, policy.config.cloud_fraction
            hard_prior = None if prior is None or not share else (lambda f: prior(share * f))
            self.calibrator = ScoreCalibrator(top_share, initial_threshold=above, prior=hard_prior)
            self.above = self.calibrator.threshold

    def start_answer(self) -> None:
        pass

    def decide(self, position: Position) -> int:
        if not self.policy.decide(position.score):
            return DEVICE
        if self.calibrator is not None:
            self.above = self.calibrator.threshold  # the threshold before this score is observed
            self.calibrator.observe(position.score)
        return self.top if position.score >= self.above else CLOUD


def _escalate(setup: EngineSetup) -> DecisionEngine:
    unknown = set(setup.options) - {"above", "top_share"}
    if unknown or {"above", "top_share"} <= set(setup.options):
        raise DecisionEngineError(
            f"escalate takes above=SCORE or top_share=FRACTION, not {', '.join(sorted(setup.options))}"
        )
    above = option_number("escalate", "above", setup.options.get("above", "0.8"), high=1.0)
    share = setup.options.get("top_share")
    top_share = None if share is None else option_number("escalate", "top_share", share, high=1.0)
    return EscalateEngine(setup.policy, above, setup.tiers - 1, top_share)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`name` or `name:key=value,key=value` -> (name, options)."""
    name, _, rest = spec.partition(":")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise DecisionEngineError(f"--decision-engine option {item!r} is not key=value (in {spec!r})")
        options[key.strip()] = value.strip()
    if not name.strip():
        raise DecisionEngineError(f"--decision-engine {spec!r} names no engine")
    return name.strip(), options


def installed_engines() -> dict[str, Callable[[EngineSetup], DecisionEngine]]:
    """Engines by name: the built-in ones and every entry point of the group (loaded lazily)."""
    found = dict(_BUILTINS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            found[ep.name] = _lazy(ep)
    return found


def _builtin(setup: EngineSetup) -> DecisionEngine:
    if setup.options:
        raise DecisionEngineError(f"the built-in engine {BUILTIN_ENGINE!r} takes no options: {setup.options}")
    return PolicyEngine(setup.policy)


_BUILTINS: dict[str, Callable[[EngineSetup], DecisionEngine]] = {
    BUILTIN_ENGINE: _builtin,
    "escalate": _escalate,
    "cost": make_cost_engine,
}


def _lazy(ep) -> Callable[[EngineSetup], DecisionEngine]:
    def make(setup: EngineSetup) -> DecisionEngine:
        try:
            factory = ep.load()
        except Exception as exc:
            raise DecisionEngineError(
                f"decision engine {ep.name!r} ({ep.value}) failed to import: {exc}; reinstall its package"
            ) from exc
        return factory(setup)

    return make


def _factory(name: str) -> Callable[[EngineSetup], DecisionEngine]:
    """The factory of the engine `name` (a built-in one without reading the installed packages)."""
    if name in _BUILTINS:
        return _BUILTINS[name]
    known = installed_engines()
    if name not in known:
        raise DecisionEngineError(
            f"no decision engine {name!r} is installed (installed: {', '.join(sorted(known))}); "
            f"install a package with a {ENTRY_POINT_GROUP!r} entry point named {name!r}"
        )
    return known[name]


def engine_name(spec: str) -> str:
    """Check that `spec` names an installed engine (without building it); returns its name."""
    name, _ = parse_spec(spec)
    _factory(name)
    return name


def build_engine(spec: str, setup: EngineSetup) -> DecisionEngine:
    """The engine `spec` names, built for `setup` (its options filled from `spec`), and checked
    to have the protocol's methods."""
    name, options = parse_spec(spec)
    factory = _factory(name)
    try:
        engine = factory(replace(setup, options=options))
    except DecisionEngineError:
        raise
    except Exception as exc:
        raise DecisionEngineError(f"decision engine {name!r} refused its setup: {exc}") from exc
    missing = [m for m in ("start_answer", "decide") if not callable(getattr(engine, m, None))]
    if missing:
        raise DecisionEngineError(
            f"decision engine {name!r} lacks {', '.join(missing)} (see shared/decision_engine.py)"
        )
    return engine


def engine_tier(
    engine: DecisionEngine,
    at: Position,
    index: int,
    proposed: int,
    score: float,
    hidden: np.ndarray,
    logits: np.ndarray,
    tiers: int = 2,
    cloud_required: bool = False,
) -> int:
    """The tier that writes this position: `engine` decides, shown `at` (a reused Position, filled
    here), checked against the pool's `tiers` (the evals' pool: 2). A position the rule gives the
    cloud (`cloud_required`: shared/decision.py, `AnswerRule.cloud_required`) goes to the cloud at
    least, whatever the engine said. The one call the device's generator (edge_client/turn.py,
    `Turn.flag`) and the trainer's evals (models/train/) make."""
    at.index, at.proposed, at.score, at.hidden, at.logits = index, proposed, score, hidden, logits
    at.cloud_required = cloud_required
    tier = checked_tier(engine, engine.decide(at), tiers)
    return max(tier, CLOUD) if cloud_required else tier


def checked_tier(engine: DecisionEngine, tier: int, tiers: int = 2) -> int:
    """`tier` if this pool has it, else an error naming the engine (an engine bug must not pass as a route)."""
    if isinstance(tier, (int, np.integer)) and not isinstance(tier, bool) and 0 <= tier < tiers:
        return int(tier)
    raise DecisionEngineError(
        f"decision engine {getattr(engine, 'name', engine)!r} chose tier {tier!r}; this pool has tiers 0 (the "
        f"device) to {tiers - 1}" + (" (add tiers with --tier)" if isinstance(tier, int) and tier >= tiers else "")
    )
