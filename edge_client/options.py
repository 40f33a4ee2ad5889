"""Everything that configures routed generation, as one plain dataclass.

One type travels from argparse to the generator: `tokenrouter-edge ask`, the
voice commands and the replay harness all fill a `GeneratorOptions` and hand
it to `RoutedGenerator`; the parts the shared rule and policy need are derived
from it here, so a default is written once.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_client.prefetch import PREFETCH_MODES
from models.registry import BASE_MODELS, DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL
from shared.cpus import parse_cpus
from shared.decision import CHECK_MAX_DRAFT, SYNC_EVERY, RuleOptions
from shared.decision_engine import BUILTIN_ENGINE, engine_name
from shared.exploration import Exploration
from shared.model_info import ALLOW_BASE_MODEL_HINT, BASE_MODEL_NOTE
from shared.policy import PolicyConfig
from shared.prompting import DEFAULT_SYSTEM_PROMPT
from shared.protocol import TEXT_MODES, SamplingParams

DEFAULT_CHECK = "after-first-clause"  # no first-audio cost, better answers (docs/voice.md, docs/router.md)
STRATEGIES = ("per-token", "span", "verify", "speculative")
"""How the per-token phase asks the cloud (edge_client/strategies.py): a `generate` per hard token
(the product), or the replay harness's alternatives: the cloud writes a span of tokens per hard
token, or the device drafts to a clause end and one `verify` checks the flagged (or all) drafts."""


@dataclass(slots=True)
class GeneratorOptions:
    """The options of one device's routed generation (the CLI flags in brackets)."""

    edge_model: str = DEFAULT_EDGE_MODEL
    cloud_model: str = DEFAULT_CLOUD_MODEL  # the model of a `--cloud local` server; names the shipped router
    cloud: str = "local"  # "local" (start a loopback server), "none", or a ws:// URL
    # More cloud tiers above that one (a pool: device -> cloud -> tier 2 -> ...), each "local:MODEL" (a loopback
    # server of that model) or a ws:// URL; a decision engine that chooses tiers sends positions up (docs/architecture.md)
    tiers: tuple[str, ...] = ()
    # Prefetch: a tier above the cloud that wrote a position within the last prefetch_window positions is kept
    # in step like the cloud (sync_every), so its next request has little left to prefill; 0: only when asked
    prefetch_window: int = 8
    # ... or also while its own router forecasts it ("forecast": edge_client/prefetch.py; "recent": recent use only)
    prefetch: str = "recent"
    # A base model (no chat template: models/registry.py BASE_MODELS, or a cloud whose accept says so) continues
    # text rather than answering; it is refused as an answer writer on either side unless this is set
    allow_base_model: bool = False
    # The CPUs a `local` server runs on ("2,3"; "" = the device's own): on a machine with cores to spare,
    # a loopback cloud off the device's cores stands for one on other hardware (bench_voice.py --cloud-cpus)
    cloud_cpus: str = ""
    api_key: str = ""  # for a remote cloud; default $TOKENROUTER_API_KEY
    policy: str = "router"  # edge | cloud | router
    threshold: float | None = 0.5  # used when cloud_fraction is None
    cloud_fraction: float | None = 0.3  # target share of cloud-written tokens (the check's overrules included)
    warmup: int = 0
    hysteresis: float = 0.0
    router: str = "auto"  # "auto" (shipped learned router for the pair, else entropy), a heuristic kind, or a .npz file
    router_on_mismatch: str = "error"  # a learned router trained for another edge model: "error" or "heuristic"
    # Who decides a position the router is asked about (shared/decision_engine.py, the token hook): the
    # built-in "router" (the policy above), or an installed engine's name, options after a colon
    decision_engine: str = BUILTIN_ENGINE
    # Exploration (shared/exploration.py): a position the engine kept is asked of the cloud anyway
    # with this probability (0: off), for unbiased labels and drift checks; at most explore_per_minute a minute
    explore: float = 0.0
    explore_per_minute: float = 6.0
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    sync_every: int = SYNC_EVERY  # send device tokens eagerly after this many (0 = only with hard tokens)
    cloud_timeout_s: float = 2.0
    # Failover (docs/server.md): a cloud lost mid-answer (its replica died, drained or was scaled in) is
    # reconnected through the same URL, the session rebuilt from the device's history and the request in
    # flight asked again; at most `reconnects` times an answer, each trying for `reconnect_wait_s`
    # (jittered backoff, edge_client/reconnect.py) while the answer waits. 0: finish on the device.
    reconnects: int = 2
    reconnect_wait_s: float = 1.0
    # After each hard token the cloud sends its guess for the next position; there the device
    # takes it (no round trip, no router) where its own token is over lookahead_nats worse to
    # the cloud (docs/architecture.md, "lookahead"). These cloud tokens come on top of the
    # router's cloud_fraction.
    lookahead: bool = True
    lookahead_nats: float = 1.0
    lookahead_wait_s: float = 0.1  # longest wait for that guess; then the router decides as usual
    # The cloud's check (docs/architecture.md, "check"): draft to a clause end, one verify per
    # clause; the cloud overrules a device token over check_nats worse than its own choice.
    # "all": the whole answer; "after-first-clause" (the default): the first clause goes out at
    # once and the check covers the rest while it is spoken (docs/voice.md: no first-audio cost).
    check: str = DEFAULT_CHECK
    check_nats: float = 1.0
    whole_numbers: bool = True  # a number is the cloud's, digit after digit (shared/decision.py, "Numbers")
    opening_tokens: int = 0  # the answer's first positions are the cloud's (shared/decision.py, "The opening")
    stop_loops: bool = True  # an answer ends where it says a run of tokens again (shared/decision.py, "Loops")
    check_max_draft: int = CHECK_MAX_DRAFT  # longest draft before a verify when no clause ends
    strategy: str = "per-token"  # STRATEGIES: how the per-token phase asks the cloud
    # Text mode (protocol v3, docs/protocol.md): share the answer as text with a cloud whose model
    # tokenizes differently ("auto"), always ("always": the text path's lossless test), or never
    # (a tokenizer mismatch is refused). Text mode asks the cloud per hard position only.
    text_mode: str = "auto"
    span: int = 4  # strategy "span": tokens the cloud writes per hard token
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    n_ctx: int = 4096
    # One llama.cpp thread: a 135M model is memory-bound, and a second thread's
    # barriers collapse throughput when ASR, TTS or a local cloud share the cores.
    threads: int = 1

    def rule(self) -> RuleOptions:
        """The per-position rule's options (validated there)."""
        return RuleOptions(
            lookahead=self.lookahead,
            lookahead_nats=self.lookahead_nats,
            check=self.check,
            check_nats=self.check_nats,
            whole_numbers=self.whole_numbers,
            opening_tokens=self.opening_tokens,
        )

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            self.policy,
            threshold=self.threshold,
            cloud_fraction=self.cloud_fraction,
            warmup=self.warmup,
            hysteresis=self.hysteresis,
        )

    def exploration(self) -> Exploration | None:
        """The exploration these options ask for (validated), or None when it is off."""
        e = Exploration(self.explore, self.explore_per_minute)
        return e if self.explore > 0 else None

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, seed=self.seed)

    def refuse_base_models(self) -> None:
        """A registered base model named as the device's model, the local cloud's or a local tier's is
        refused before anything loads (a remote cloud's is refused when its accept says so)."""
        if self.allow_base_model:
            return
        named = [("edge_model (--edge-model)", self.edge_model)]
        if self.cloud == "local" and not self.policy_config().device_alone:
            named.append(("cloud_model (--cloud-model)", self.cloud_model))
        named += [("a tier (--tier)", t[len("local:") :]) for t in self.tiers if t.startswith("local:")]
        for what, model in named:
            if model in BASE_MODELS:
                raise ValueError(f"{what} {model!r} is a base model: {BASE_MODEL_NOTE}; {ALLOW_BASE_MODEL_HINT}")

    def validate(self) -> None:
        """Refuse settings the generator cannot use, naming the flag."""
        self.rule()
        if self.text_mode not in TEXT_MODES:
            raise ValueError(f"text_mode (--text-mode) must be one of {', '.join(TEXT_MODES)}, not {self.text_mode!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {self.strategy!r}")
        engine_name(self.decision_engine)  # installed (its options are checked when it is built)
        self.exploration()
        if self.check_max_draft < 1:
            raise ValueError(f"check_max_draft (--draft-max) must be >= 1, not {self.check_max_draft}")
        if self.span < 1:
            raise ValueError(f"span (--span) must be >= 1, not {self.span}")
        if self.cloud_cpus:
            if self.cloud != "local":
                raise ValueError("cloud_cpus (--cloud-cpus) pins a loopback server: it needs cloud 'local'")
            parse_cpus(self.cloud_cpus)
        for tier in self.tiers:
            if not (tier.startswith(("ws://", "wss://")) or (tier.startswith("local:") and len(tier) > 6)):
                raise ValueError(f"a tier (--tier) is local:MODEL or a ws:// or wss:// URL, not {tier!r}")
        self.refuse_base_models()
        if self.prefetch not in PREFETCH_MODES:
            raise ValueError(f"prefetch (--prefetch) must be one of {', '.join(PREFETCH_MODES)}, not {self.prefetch!r}")
        if self.prefetch_window < 0:
            raise ValueError(f"prefetch_window (--prefetch-window) must be >= 0, not {self.prefetch_window}")
        if self.tiers and self.cloud == "none":
            raise ValueError("tiers (--tier) stand above the cloud: they need --cloud local or a URL, not none")
        if self.reconnects < 0:
            raise ValueError(f"reconnects (--reconnects) must be >= 0, not {self.reconnects}")
        if not 0 <= self.reconnect_wait_s < float("inf"):
            raise ValueError(f"--reconnect-wait must be a number of seconds >= 0, not {self.reconnect_wait_s}")
        if not 0 <= self.cloud_timeout_s < float("inf"):
            raise ValueError(f"--cloud-timeout must be a number of seconds >= 0, not {self.cloud_timeout_s}")
