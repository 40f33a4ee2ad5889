"""The generation options every generating command of `tokenrouter-edge` takes (ask, listen, file).

`add_generation_options` adds them to a parser; `options_from_args` turns the parsed
arguments into `GeneratorOptions`. Both the text CLI (edge_client/cli.py) and the voice
commands (edge_client/voice/cli.py) use them.
"""

from __future__ import annotations

import argparse

from edge_client.options import GeneratorOptions
from edge_client.prefetch import PREFETCH_MODES
from shared.decision import CHECK_MODES, LOOP_TOKENS
from shared.protocol import TEXT_MODES

D = GeneratorOptions()  # every flag's default is the option's: written once, in edge_client/options.py


def add_generation_options(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that generates (ask, and the voice commands)."""
    _add_cloud_options(p)
    _add_model_options(p)
    _add_routing_options(p)
    _add_sampling_options(p)
    _add_link_options(p)
    _add_cloud_help_options(p)
    p.add_argument(
        "--system-prompt",
        default=None,
        help="the system prompt (default: the generator's for `ask`; the voice dialogue's, written for speech, "
        "for `listen`, `file` and `app`)",
    )


def _add_cloud_options(p: argparse.ArgumentParser) -> None:
    """Where the cloud is: its URL, the tiers above it and which of them are kept in step, the API key."""
    p.add_argument(
        "--cloud", default=D.cloud, help="ws:// URL of a cloud server, 'local' (start one on loopback) or 'none'"
    )
    p.add_argument(
        "--tier",
        action="append",
        default=None,
        metavar="local:MODEL|URL",
        help="another cloud tier above --cloud (repeatable): a pool of models; an engine that chooses tiers "
        "(e.g. --decision-engine escalate:above=0.8) sends the hardest positions up (docs/architecture.md, 'Tiers')",
    )
    p.add_argument(
        "--prefetch-window",
        type=int,
        default=D.prefetch_window,
        help="keep a tier above the cloud in step while it wrote within the last N positions (0: only when asked)",
    )
    p.add_argument(
        "--prefetch",
        choices=PREFETCH_MODES,
        default=D.prefetch,
        help="which tiers above the cloud are kept in step: those that wrote recently, or also those their own "
        "router expects soon (forecast)",
    )
    p.add_argument("--api-key", default=D.api_key, help="API key for a remote cloud (default $TOKENROUTER_API_KEY)")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The device's model and the local cloud server's."""
    p.add_argument("--edge-model", default=D.edge_model, help="registered name or .gguf path")
    p.add_argument("--cloud-model", default=D.cloud_model, help="model of the local cloud server")
    p.add_argument(
        "--allow-base-model",
        action="store_true",
        default=D.allow_base_model,
        help="let a base model (no chat template; `tokenrouter-edge models` marks them) write answers: it "
        "continues text, so its answers may not read as answers (refused without this flag)",
    )


def _add_routing_options(p: argparse.ArgumentParser) -> None:
    """Which positions go to the cloud: the policy, its router and threshold, the decision engine, exploration."""
    p.add_argument("--policy", choices=["edge", "cloud", "router"], default=D.policy)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--threshold", type=float, default=None, help="route when the router score >= T (instead of a cloud fraction)"
    )
    g.add_argument(
        "--cloud-fraction",
        type=float,
        default=None,
        help=f"target fraction of cloud tokens, calibrated online (default {D.cloud_fraction})",
    )
    p.add_argument(
        "--router",
        default=D.router,
        help="auto (the shipped learned router for the model pair, else entropy), entropy, top1, margin, or a router file",
    )
    p.add_argument(
        "--router-on-mismatch",
        choices=["error", "heuristic"],
        default=D.router_on_mismatch,
        help="a router file trained for another device model: refuse, or warn and use entropy",
    )
    p.add_argument(
        "--decision-engine",
        default=D.decision_engine,
        metavar="NAME[:KEY=VALUE,...]",
        help="who decides each position the router scores: the built-in 'router' (the policy), or an installed "
        "engine (entry point group tokenrouter.decision_engines; docs/architecture.md, 'The token hook')",
    )
    p.add_argument(
        "--explore",
        type=float,
        default=D.explore,
        metavar="P",
        help="exploration: ask the cloud, with probability P, for a position the router kept on the device "
        "(unbiased labels for drift checks; 0: off)",
    )
    p.add_argument(
        "--explore-per-minute",
        type=float,
        default=D.explore_per_minute,
        help="at most this many explored positions a minute (the cloud's key may allow fewer)",
    )
    p.add_argument("--warmup", type=int, default=D.warmup, help="first N tokens of each answer stay on the device")
    p.add_argument(
        "--hysteresis", type=float, default=D.hysteresis, help="keep routing until the score drops below T - H"
    )


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    """How the answer is sampled, and how long it may be."""
    p.add_argument("--max-tokens", type=int, default=D.max_tokens)
    p.add_argument("--temperature", type=float, default=D.temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=D.top_p)
    p.add_argument("--seed", type=int, default=D.seed)


def _add_link_options(p: argparse.ArgumentParser) -> None:
    """How the device keeps the cloud in step and rides out a lost replica."""
    p.add_argument(
        "--sync-every",
        type=int,
        default=D.sync_every,
        help="send device tokens to the cloud after N (0 = only with hard tokens)",
    )
    p.add_argument(
        "--cloud-timeout",
        type=float,
        default=D.cloud_timeout_s,
        help="seconds to wait for a hard token before finishing on the device",
    )
    p.add_argument(
        "--reconnects",
        type=int,
        default=D.reconnects,
        help="failovers per answer when the cloud replica is lost mid-answer (0: finish on the device)",
    )
    p.add_argument(
        "--reconnect-wait",
        type=float,
        default=D.reconnect_wait_s,
        help="seconds one failover may try (jittered backoff) before the device finishes alone",
    )


def _add_cloud_help_options(p: argparse.ArgumentParser) -> None:
    """What the cloud adds beyond a routed token: its lookahead guess, its check, the answer shared as text."""
    p.add_argument(
        "--no-lookahead", action="store_true", help="do not use the cloud's guess for the token after each cloud token"
    )
    p.add_argument(
        "--lookahead-nats",
        type=float,
        default=D.lookahead_nats,
        help="take the cloud's guess where it finds the device's token this many nats less likely (0: wherever they differ)",
    )
    p.add_argument(
        "--check",
        nargs="?",
        const="all",
        default=D.check,
        choices=CHECK_MODES,
        help="the cloud's check: draft to each clause end, the cloud checks the clause in one round trip and "
        "overrules a device token over --check-nats worse than its own choice (better answers, a round trip per clause). "
        "Default 'after-first-clause': the first clause goes out at once (no first-audio delay); --check alone means "
        "'all'; 'off': router and lookahead only",
    )
    p.add_argument(
        "--split-numbers",
        action="store_true",
        help="let the device and the cloud write digits of one number (default: a number is the cloud's, "
        "digit after digit: spliced, '140,000,000' came out '140,760,000')",
    )
    p.add_argument(
        "--opening-tokens",
        type=int,
        default=D.opening_tokens,
        help="the cloud writes the answer's first N positions, whatever the router says (0: the router decides)",
    )
    p.add_argument(
        "--let-loops",
        action="store_true",
        help=f'let an answer say a run of {LOOP_TOKENS} tokens again (default: it ends there, finish_reason "loop": '
        "a small model's loops do not end by themselves)",
    )
    p.add_argument(
        "--check-nats",
        type=float,
        default=D.check_nats,
        help="with --check: how much less likely than the cloud's choice a device token may be",
    )
    p.add_argument(
        "--text-mode",
        choices=TEXT_MODES,
        default=D.text_mode,
        help="share the answer as text with the cloud (protocol v3): auto (where the models' tokenizers differ), "
        "always, never (a tokenizer mismatch is refused)",
    )


def options_from_args(args: argparse.Namespace) -> GeneratorOptions:
    return GeneratorOptions(
        edge_model=args.edge_model,
        cloud_model=args.cloud_model,
        cloud=args.cloud,
        tiers=tuple(args.tier or D.tiers),
        prefetch_window=args.prefetch_window,
        prefetch=args.prefetch,
        allow_base_model=args.allow_base_model,
        api_key=args.api_key,
        policy=args.policy,
        threshold=D.threshold if args.threshold is None else args.threshold,  # a threshold replaces the target
        cloud_fraction=None
        if args.threshold is not None
        else (D.cloud_fraction if args.cloud_fraction is None else args.cloud_fraction),
        warmup=args.warmup,
        hysteresis=args.hysteresis,
        router=args.router,
        router_on_mismatch=args.router_on_mismatch,
        decision_engine=args.decision_engine,
        explore=args.explore,
        explore_per_minute=args.explore_per_minute,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        sync_every=args.sync_every,
        cloud_timeout_s=args.cloud_timeout,
        reconnects=args.reconnects,
        reconnect_wait_s=args.reconnect_wait,
        lookahead=not args.no_lookahead,
        lookahead_nats=args.lookahead_nats,
        check=args.check,
        check_nats=args.check_nats,
        whole_numbers=not args.split_numbers,
        stop_loops=not args.let_loops,
        opening_tokens=args.opening_tokens,
        text_mode=args.text_mode,
        system_prompt=D.system_prompt if args.system_prompt is None else args.system_prompt,
    )
