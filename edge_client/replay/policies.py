"""The routing policies the harness compares, each behind one `answer(messages)` call.

    edge            device only                          (RoutedGenerator, policy edge)
    cloud           cloud only, streamed                 (RoutedGenerator, policy cloud)
    router-sync     wait for the cloud at each hard token (RoutedGenerator, policy router)
    router-lookahead  router-sync plus the cloud's guess for the token after each hard one
                    (RoutedGenerator with lookahead, without the check)
    router-span     at a hard token the cloud writes up to --span tokens in one call
    router-verify   draft to the next clause boundary; send the flagged positions
                    in one verify; roll back to the first rejected one
    router-check    the cloud's check (RoutedGenerator with check): like router-verify,
                    but the cloud also overrules any drafted token it finds more than
                    --check-nats less likely than its own choice, so every draft waits
                    for its verdict
    router-check-after-first-clause
                    router-lookahead for the first clause, router-check for the rest
                    (the product's default)
    speculative     verify every drafted position (lossless with greedy decoding)
    query           one decision per query (router score at the first answer position)
    session         a whole conversation on the cloud, unless it asks for light mode

Router policies other than the router-check ones (whose every verify carries the clause)
take a suffix `:nosync` to turn eager sync off (device tokens then travel only
with the next cloud request); `:sync` is the default.
The last five are implemented by `ReplayDriver` (driver.py), which reuses
EdgeDecoder, CloudLink, Router and RoutingPolicy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from edge_client.answer import TokenEvent
from edge_client.generator import RoutedGenerator, build_router
from edge_client.replay.turn import Emitter, LinkFactory, TurnRecord
from shared.llama_backend import LlamaModel
from shared.policy import PolicyConfig, RoutingPolicy
from shared.protocol import SamplingParams

POLICY_KINDS = ("edge", "cloud", "query", "session", "router-sync", "router-lookahead", "router-span", "router-verify", "router-check", "router-check-after-first-clause", "speculative")
ROUTER_KINDS = ("router-sync", "router-lookahead", "router-span", "router-verify")
DEFAULT_POLICIES = "edge,cloud,query,session,router-sync,router-lookahead,router-span,router-verify,router-check,router-check-after-first-clause,speculative"


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str  # as reported, e.g. "router-sync:nosync"
    kind: str  # one of POLICY_KINDS
    eager_sync: bool = True


def parse_policies(text: str) -> list[PolicySpec]:
    """"edge,cloud,router-sync:nosync" -> specs; a clear error for anything unknown."""
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


@dataclass(slots=True)
class RouterOptions:
    """How hard tokens are found and handed over; shared by every router policy."""

    router: str = "top1"  # "auto": the learned router shipped for (edge model, cloud_model)
    cloud_model: str = ""
    threshold: float = 0.83
    cloud_fraction: float | None = None  # calibrate the threshold online to this fraction instead
    warmup: int = 0
    sync_every: int = 4  # eager sync: send final device tokens after this many
    span: int = 4  # router-span: tokens the cloud writes per hard token
    draft_max: int = 12  # router-verify / router-check / speculative: longest draft before a verify
    check_nats: float = 1.0  # router-check: the cloud overrules a drafted token over this many nats worse than its choice
    query_threshold: float | None = None  # query policy; default: threshold
    temperature: float = 0.0
    seed: int = 0
    n_ctx: int = 2048
    threads: int | None = 1
    cloud_timeout_s: float = 5.0


class Runner(Protocol):
    spec: PolicySpec

    def start_session(self, light_mode: bool) -> None: ...

    def answer(
        self, messages: list[dict], max_tokens: int, on_token: Callable[[TokenEvent], None] | None = None, stop: threading.Event | None = None
    ) -> TurnRecord: ...

    def close(self) -> None: ...


def make_policy(opts: RouterOptions, mode: str) -> RoutingPolicy:
    return RoutingPolicy(PolicyConfig(mode, threshold=opts.threshold, cloud_fraction=opts.cloud_fraction, warmup=opts.warmup))


class GeneratorRunner:
    """edge, cloud, router-sync, router-lookahead and the router-check ones: the project's RoutedGenerator, unchanged."""

    MODES = {"edge": "edge", "cloud": "cloud", "router-sync": "router", "router-lookahead": "router", "router-check": "router",
             "router-check-after-first-clause": "router"}
    CHECKS = {"router-check": "all", "router-check-after-first-clause": "after-first-clause"}

    def __init__(self, spec: PolicySpec, edge: LlamaModel, links: LinkFactory | None, opts: RouterOptions) -> None:
        self.spec = spec
        self.links = links
        self.model = edge
        mode = self.MODES[spec.kind]
        self.gen = RoutedGenerator(
            edge,
            build_router(opts.router, edge.n_vocab, edge_info=edge.info, cloud_model=opts.cloud_model),
            make_policy(opts, mode),
            SamplingParams(temperature=opts.temperature, seed=opts.seed),
            connect=links if mode != "edge" else None,
            sync_every=opts.sync_every if spec.eager_sync else 0,
            n_ctx=opts.n_ctx,
            threads=opts.threads,
            lookahead=spec.kind in ("router-lookahead", "router-check-after-first-clause"),
            check=self.CHECKS.get(spec.kind, "off"),
            check_nats=opts.check_nats,
            check_max_draft=opts.draft_max,
        )

    def start_session(self, light_mode: bool) -> None:
        pass

    def answer(
        self, messages: list[dict], max_tokens: int, on_token: Callable[[TokenEvent], None] | None = None, stop: threading.Event | None = None
    ) -> TurnRecord:
        record = TurnRecord()
        before = self.links.totals() if self.links else None
        t0 = time.perf_counter()
        emit = Emitter(self.model, record, t0, on_token)

        def take(ev: TokenEvent) -> None:
            emit(ev.token_id, ev.route)

        ans = self.gen.generate(messages, max_tokens=max_tokens, on_token=take, stop=stop)
        emit.finish()
        record.pieces = list(ans.pieces) or record.pieces
        record.degraded, record.finish_reason = ans.degraded, ans.finish_reason
        if self.links and before is not None:
            record.traffic = self.links.totals() - before
        return record

    def close(self) -> None:
        self.gen.close()


def make_runner(spec: PolicySpec, edge: LlamaModel, links: LinkFactory, opts: RouterOptions) -> Runner:
    if spec.kind in GeneratorRunner.MODES:
        return GeneratorRunner(spec, edge, links, opts)
    from edge_client.replay.driver import ReplayDriver

    return ReplayDriver(spec, edge, links, opts)
