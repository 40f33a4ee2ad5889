"""The routing policies the harness compares, each behind one `answer(messages)` call.

Every policy is the product's RoutedGenerator with some options changed, so the
comparison measures the waiting strategy, not a second implementation of the
token loop (edge_client/strategies.py holds the strategies):

    edge            device only                          (policy edge)
    cloud           cloud only, streamed                 (policy cloud)
    router-sync     wait for the cloud at each hard token (per-token strategy)
    router-lookahead  router-sync plus the cloud's guess for the token after each hard one
    router-span     at a hard token the cloud writes up to --span tokens in one call
    router-verify   draft to the next clause boundary; send the flagged positions
                    in one verify; roll back to the first rejected one
    router-check    the cloud's check (--check all): like router-verify, but the cloud
                    also overrules any drafted token it finds more than --check-nats
                    less likely than its own choice, so every draft waits for its verdict
    router-check-after-first-clause
                    router-lookahead for the first clause, router-check for the rest
                    (the product's default)
    speculative     verify every drafted position (lossless with greedy decoding)
    query           one decision per query (router score at the first answer position)
    session         a whole conversation on the cloud, unless it asks for light mode

Router policies other than the router-check ones (whose every verify carries the clause)
take a suffix `:nosync` to turn eager sync off (device tokens then travel only
with the next cloud request); `:sync` is the default.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from edge_client.answer import Answer, TokenEvent
from edge_client.cloud_link import CloudLink
from edge_client.generator import RoutedGenerator
from edge_client.options import GeneratorOptions
from shared.llama_backend import LlamaModel

POLICY_KINDS = (
    "edge",
    "cloud",
    "query",
    "session",
    "router-sync",
    "router-lookahead",
    "router-span",
    "router-verify",
    "router-check",
    "router-check-after-first-clause",
    "speculative",
)
ROUTER_KINDS = ("router-sync", "router-lookahead", "router-span", "router-verify")
DEFAULT_POLICIES = ",".join(POLICY_KINDS)

# What each policy changes in the generator's options (the rest comes from the replay's command line).
_OPTIONS: dict[str, dict[str, object]] = {
    "edge": {"policy": "edge"},
    "cloud": {"policy": "cloud"},
    "query": {},
    "session": {},
    "router-sync": {},
    "router-lookahead": {"lookahead": True},
    "router-span": {"strategy": "span"},
    "router-verify": {"strategy": "verify"},
    "router-check": {"check": "all"},
    "router-check-after-first-clause": {"lookahead": True, "check": "after-first-clause"},
    "speculative": {"strategy": "speculative"},
}


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str  # as reported, e.g. "router-sync:nosync"
    kind: str  # one of POLICY_KINDS
    eager_sync: bool = True


def parse_policies(text: str) -> list[PolicySpec]:
    """ "edge,cloud,router-sync:nosync" -> specs; a clear error for anything unknown."""
    specs: list[PolicySpec] = []
    for raw in (p.strip() for p in text.split(",")):
        if not raw:
            continue
        kind, _, suffix = raw.partition(":")
        if kind not in POLICY_KINDS:
            raise ValueError(f"unknown policy {kind!r}; choose from {', '.join(POLICY_KINDS)}")
        if suffix and (kind not in ROUTER_KINDS or suffix not in ("sync", "nosync")):
            raise ValueError(f"policy {raw!r}: only {', '.join(ROUTER_KINDS)} take a ':sync' or ':nosync' suffix")
        name = kind if suffix in ("", "sync") else raw
        if any(s.name == name for s in specs):
            raise ValueError(f"policy {name!r} is listed twice")
        specs.append(PolicySpec(name, kind, eager_sync=suffix != "nosync"))
    if not specs:
        raise ValueError("no policies given; e.g. --policies edge,cloud,router-sync,router-verify")
    return specs


def replay_defaults(**changes: object) -> GeneratorOptions:
    """The generator options the harness starts from: the top1 heuristic at a fixed threshold,
    no lookahead and no check (each policy turns on what it measures), a 5 s cloud timeout
    (an emulated bad network is slow, not lost), and a base cloud model allowed (the harness measures
    routing; it writes no answers for a person)."""
    base = GeneratorOptions(
        allow_base_model=True,
        router="top1",
        threshold=0.83,
        cloud_fraction=None,
        lookahead=False,
        check="off",
        n_ctx=2048,
        cloud_timeout_s=5.0,
        max_tokens=48,
    )
    return replace(base, **changes)


class Runner:
    """One policy: a RoutedGenerator configured for it, plus the per-answer choice of the
    query and session policies."""

    def __init__(
        self,
        spec: PolicySpec,
        edge: LlamaModel,
        connect: Callable[[], CloudLink] | None,
        opts: GeneratorOptions,
        query_threshold: float | None = None,
        tier_connects: Sequence[Callable[[], CloudLink]] = (),
    ) -> None:
        """`tier_connects`: links to the tiers above the cloud (`--tier`), for the engine to send positions up."""
        self.spec = spec
        mine = replace(opts, **_OPTIONS[spec.kind])  # type: ignore[arg-type]
        if not spec.eager_sync:
            mine.sync_every = 0
        self.gen = RoutedGenerator(edge, mine, connect if mine.policy != "edge" else None, tier_connects=tier_connects)
        self.query_threshold = opts.threshold if query_threshold is None else query_threshold
        self.light_mode = False

    def start_session(self, light_mode: bool) -> None:
        self.light_mode = light_mode

    def answer(
        self,
        messages: list[dict],
        max_tokens: int,
        on_token: Callable[[TokenEvent], None] | None = None,
        stop: threading.Event | None = None,
    ) -> Answer:
        """One answer; `on_token` sees each token when it is released, `stop` interrupts (voice barge-in)."""
        decision = self._decide(messages)
        answer = self.gen.generate(messages, max_tokens=max_tokens, on_token=on_token, stop=stop, mode=decision)
        answer.decision = decision or ""
        return answer

    def _decide(self, messages: list[dict]) -> str | None:
        """query / session: which model writes the whole answer; None for the token-level policies."""
        if self.spec.kind == "session":
            return "edge" if self.light_mode else "cloud"
        if self.spec.kind == "query":
            limit = self.query_threshold if self.query_threshold is not None else 0.5
            return "cloud" if self.gen.prompt_score(messages) >= limit else "edge"
        return None

    def close(self) -> None:
        self.gen.close()
