"""`tokenrouter-replay`: replay sessions against device and cloud under an emulated network.

    tokenrouter-replay --profile lte --policies edge,cloud,router-sync,router-verify --limit 30 --out DIR [--json]
    tokenrouter-replay simulate --traces DIR --fleet 12000     (the fleet simulator: fleet_cli.py)

The cloud server runs on loopback in a child process; the device talks to it
only through the network emulator. Policies are interleaved session by
session (the order rotates), so a change in machine load hits all of them.
Results are appended to DIR/results.jsonl after each session; rerunning with
the same options resumes where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

from edge_client.answer import Answer
from edge_client.cloud_link import CloudLink
from edge_client.local_cloud import loopback_server
from edge_client.options import GeneratorOptions
from edge_client.replay.audio import AudioReplayer, GeneratorAdapter, voice_unavailable
from edge_client.replay.fleet_cli import main as simulate_main
from edge_client.replay.metrics import CloudScorer, rouge_l
from edge_client.replay.netem import PROFILES, NetemProxy, NetProfile, get_profile
from edge_client.replay.policies import DEFAULT_POLICIES, Runner, parse_policies, replay_defaults
from edge_client.replay.report import json_summary, machine_info, markdown, write_report
from edge_client.replay.sessions import Session, SessionError, load_sessions
from edge_client.replay.traces import traces_from_rows, write_traces
from models.registry import model_info
from shared.cpus import parse_cpus, pin_to_cpus
from shared.gpu_cost import default_tier_sizes, parse_tier_sizes
from shared.llama_backend import LlamaModel
from shared.prompting import DEFAULT_SYSTEM_PROMPT

D = GeneratorOptions()  # the replay's flags that are the generator's options default as they do (written once)

log = logging.getLogger(__name__)
WARMUP_MESSAGES = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": "hello"}]


class ReplayError(RuntimeError):
    """A replay that cannot run as asked; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenrouter-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="lte", choices=list(PROFILES), help="emulated network (default lte)")
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated (default {DEFAULT_POLICIES}); router-*:nosync turns eager sync off",
    )
    p.add_argument("--sessions", default="clinc150", help="clinc150 or a JSONL file of sessions")
    p.add_argument("--split", default="val", help="CLINC150 split (val for development, test for final figures)")
    p.add_argument("--limit", type=int, default=30, help="number of sessions")
    p.add_argument("--seed", type=int, default=0, help="session sampling, network jitter and sampling seed")
    p.add_argument(
        "--out", required=True, type=Path, help="output directory (results.jsonl, report.json, report.md, plots)"
    )
    p.add_argument("--fresh", action="store_true", help="discard earlier results in --out instead of resuming")
    p.add_argument("--audio", action="store_true", help="spoken sessions through the voice pipeline")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--settle-ms",
        type=float,
        default=None,
        help="pause after each policy's turn so its in-flight traffic does not land in the next policy's (default: the profile's worst one-way delay)",
    )
    p.add_argument(
        "--report-only", action="store_true", help="rewrite the report from --out's results without replaying"
    )
    g = p.add_argument_group("models and routing")
    _add_model_options(g)
    _add_decoding_options(g)
    _add_cpu_options(g)
    n = p.add_argument_group("network overrides (applied to the profile)")
    n.add_argument("--rtt-ms", type=float)
    n.add_argument("--jitter-ms", type=float)
    n.add_argument("--stall-prob", type=float)
    n.add_argument("--stall-ms", type=float)
    n.add_argument("--up-mbps", type=float)
    n.add_argument("--down-mbps", type=float)
    return p


def _add_model_options(g: argparse._ArgumentGroup) -> None:
    """The model pair, the router and its threshold, the decision engine, the tiers above the cloud."""
    g.add_argument("--edge-model", default=D.edge_model)
    g.add_argument("--cloud-model", default=D.cloud_model)
    g.add_argument(
        "--router",
        default="top1",
        help="heuristic router (entropy, top1, margin), a learned router file (.npz), or auto (the learned router shipped for the model pair)",
    )
    g.add_argument(
        "--threshold",
        type=float,
        default=0.83,
        help="router threshold (0.83 with top1 flags ~20%% of the edge model's tokens)",
    )
    g.add_argument(
        "--cloud-fraction", type=float, default=None, help="calibrate the router threshold to this token fraction"
    )
    g.add_argument(
        "--decision-engine",
        default=D.decision_engine,
        help="who decides the router's positions in the router policies: the built-in 'router', or an installed "
        "engine, NAME[:KEY=VALUE,...] (docs/architecture.md, 'The token hook')",
    )
    g.add_argument(
        "--tier",
        action="append",
        default=None,
        metavar="MODEL",
        help="a cloud tier above --cloud-model (repeatable): a loopback server of MODEL behind its own network "
        "emulator; an engine that chooses tiers (e.g. --decision-engine cost) sends positions up",
    )
    g.add_argument(
        "--tier-sizes",
        default=None,
        metavar="B/B/...",
        help="the GPU cost model's size of each cloud tier, the cloud first, in billions (default: 70.6 for the "
        "cloud alone; with --tier, 8 below a 70.6 top)",
    )


def _add_decoding_options(g: argparse._ArgumentGroup) -> None:
    """The policies' own knobs (query, span, drafts, check, sync) and how answers are sampled."""
    g.add_argument("--query-threshold", type=float, default=None, help="query policy threshold (default --threshold)")
    g.add_argument("--span", type=int, default=D.span, help="router-span: tokens per cloud call")
    g.add_argument(
        "--draft-max", type=int, default=D.check_max_draft, help="router-verify/router-check/speculative: longest draft"
    )
    g.add_argument(
        "--check-nats",
        type=float,
        default=D.check_nats,
        metavar="NATS",
        help="router-check: the cloud checks every drafted token and overrules one it finds more than NATS "
        "less likely than its own choice (docs/router.md)",
    )
    g.add_argument(
        "--sync-every", type=int, default=D.sync_every, help="eager sync after this many final device tokens"
    )
    g.add_argument("--max-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=D.temperature)


def _add_cpu_options(g: argparse._ArgumentGroup) -> None:
    """Threads, and the CPUs each side runs on."""
    g.add_argument("--threads", type=int, default=D.threads, help="llama.cpp threads on each side (device, cloud)")
    g.add_argument(
        "--device-cpus",
        metavar="LIST",
        help="run the device side (this process) on these CPUs only (0,1; Linux): with --cloud-cpus on a machine "
        "with cores to spare, the cloud's decodes stop taking the device's cores, as on other hardware",
    )
    g.add_argument("--cloud-cpus", metavar="LIST", help="run the loopback cloud server on these CPUs only (2,3; Linux)")


def check_audio_available() -> None:
    """Audio mode needs the voice package's file-mode API (edge_client/voice)."""
    why = voice_unavailable()
    if why is not None:
        raise ReplayError(f"--audio is not available: {why}; run text sessions without --audio")


@contextlib.contextmanager
def emulated_cloud(
    cloud_model: str, profile, seed: int, threads: int, cpus: str = ""
) -> Iterator[tuple[str, str, NetemProxy]]:
    """A loopback cloud server behind the network emulator: yields (device URL, API key, proxy).
    `cpus`: the CPUs the server runs on ("" = the device's)."""
    with loopback_server(cloud_model, threads, cpus) as (url, key):
        target = urlparse(url)
        with NetemProxy(target.hostname or "127.0.0.1", target.port or 0, profile, seed=seed) as proxy:
            yield f"ws://127.0.0.1:{proxy.port}{target.path}", key, proxy


def _config(args: argparse.Namespace, profile) -> dict:
    keep = (
        "policies",
        "sessions",
        "split",
        "limit",
        "seed",
        "edge_model",
        "cloud_model",
        "router",
        "threshold",
        "cloud_fraction",
        "query_threshold",
        "span",
        "draft_max",
        "check_nats",
        "sync_every",
        "max_tokens",
        "temperature",
        "threads",
        "audio",
        "settle_ms",
    )
    cfg = {k: getattr(args, k) for k in keep}
    # the CPU lists only when set: unset, the digest stays as it was, so earlier runs still resume
    cfg.update({k: getattr(args, k) for k in ("device_cpus", "cloud_cpus") if getattr(args, k) is not None})
    if args.decision_engine != D.decision_engine:  # (likewise: the built-in engine leaves the digest as it was)
        cfg["decision_engine"] = args.decision_engine
    if args.tier or args.tier_sizes:  # a pool, or the cloud priced at another size (likewise)
        cfg["tier"] = list(args.tier or [])
        n_cloud = 1 + len(cfg["tier"])
        cfg["tier_sizes"] = (
            parse_tier_sizes(args.tier_sizes, n_cloud) if args.tier_sizes else default_tier_sizes(n_cloud)
        )
    cfg["profile"] = profile.to_json()
    return cfg


def _load_done(out: Path, config: dict, fresh: bool) -> list[dict]:
    """Earlier results of the same configuration (resume), or none."""
    digest = hashlib.sha256(
        json.dumps({k: v for k, v in config.items() if k != "limit"}, sort_keys=True).encode()
    ).hexdigest()[:16]
    run_file, results = out / "run.json", out / "results.jsonl"
    if fresh or not run_file.exists():
        results.unlink(missing_ok=True)
        run_file.write_text(json.dumps({"config": config, "digest": digest}, indent=2))
        return []
    if json.loads(run_file.read_text()).get("digest") != digest:
        raise ReplayError(f"{out} holds a run with other options; pass --fresh to start over or choose another --out")
    rows = []
    if results.exists():
        for line in results.read_text().splitlines():
            if line.strip():
                rows.extend(json.loads(line)["rows"])
    return rows


def settle_seconds(profile, settle_ms: float | None) -> float:
    """How long a message may still be in flight after a turn: one-way delay + 3 sigma of jitter + a stall."""
    if settle_ms is not None:
        return max(settle_ms, 0.0) / 1000.0
    worst = profile.rtt_ms / 2 + 3 * profile.jitter_ms / 2**0.5 + (profile.stall_ms if profile.stall_prob > 0 else 0.0)
    return worst / 1000.0


def replay_session(
    session: Session, runners: list[Runner], order: list[int], max_tokens: int, voice=None, settle_s: float = 0.0
) -> dict[str, list]:
    """All turns of one session under each policy; returns policy -> [(messages, Answer, voice JSON or None)].

    Before each policy the harness waits `settle_s` (not measured): otherwise an eager sync still
    crossing the emulated network is served while the next policy runs, and the server batches it
    with that policy's work, which changes both its timing and (batch-dependent numerics) its tokens.
    """
    if voice is not None:
        return _replay_spoken(session, runners, order, voice)
    out: dict[str, list] = {}
    for i in order:
        time.sleep(settle_s)
        runner = runners[i]
        runner.start_session(session.wants_light_mode)
        messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}]
        turns = []
        for turn in session.turns:
            if turn.text is None:
                raise ReplayError(f"session {session.id} has a spoken turn; replay it with --audio")
            messages = [*messages, {"role": "user", "content": turn.text}]
            rec = runner.answer(messages, max_tokens)
            turns.append((messages, rec, None))
            messages = [*messages, {"role": "assistant", "content": rec.text}]
        out[runner.spec.name] = turns
    return out


def _replay_spoken(session: Session, runners: list[Runner], order: list[int], voice) -> dict[str, list]:
    """Audio mode: each turn spoken (cached WAV) through the voice pipeline, one turn per pipeline run."""
    replayer, adapters = voice
    wavs = [replayer.wav_for(t) for t in session.turns]
    out: dict[str, list] = {}
    for i in order:
        runners[i].start_session(session.wants_light_mode)
        turns = []
        for wav in wavs:
            obj, rec, messages = replayer.run(adapters[i], wav)
            if rec is None:  # nothing was heard: no answer to measure
                rec, messages = (
                    Answer(policy=runners[i].spec.name, decision="no-speech"),
                    [{"role": "user", "content": ""}],
                )
            turns.append((messages, rec, obj))
        out[runners[i].spec.name] = turns
    return out


def score_session(session: Session, results: dict[str, list], scorer, max_tokens: int) -> list[dict]:
    """Quality of every answer: cloud-model NLL, ROUGE-L against the cloud-only answer."""
    rows = []
    reference: list[str] = []
    if "cloud" in results:
        reference = [rec.text for _, rec, _ in results["cloud"]]
    for policy, turns in results.items():
        for k, (messages, rec, spoken) in enumerate(turns):
            if len(reference) <= k:  # no cloud policy in this run: the cloud model's greedy answer
                reference.append(scorer.model.detokenize(scorer.greedy(messages, max_tokens)))
            row = {
                **rec.to_json(),
                "session": session.id,
                "turn": k,
                "policy": policy,
                "prompt": messages[-1]["content"],
            }
            row["cloud_nll"] = scorer.nll_per_token(messages, rec.tokens)
            row["rouge_l_vs_cloud"] = round(rouge_l(rec.text, reference[k]), 4)
            if spoken is not None:
                row["transcript"] = spoken.get("transcript")
                row["eos_to_first_audio_ms"] = spoken.get("end_of_speech_to_first_audio_ms")
                row["voice_timings_ms"] = spoken.get("timings_ms")
                row["prefilled_tokens"] = spoken.get("prefilled_tokens")  # prompt tokens decoded from partials
            rows.append(row)
    return rows


def report_only(args: argparse.Namespace) -> dict:
    """Rebuild report.json/md and the plots from an earlier run's files."""
    files = [args.out / n for n in ("run.json", "meta.json", "results.jsonl")]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ReplayError(f"--report-only needs a finished run in {args.out}; missing {', '.join(missing)}")
    config = json.loads(files[0].read_text())["config"]
    meta = json.loads(files[1].read_text())
    rows = [r for line in files[2].read_text().splitlines() if line.strip() for r in json.loads(line)["rows"]]
    names = [s.name for s in parse_policies(config["policies"])]
    meta["sessions"] = len({r["session"] for r in rows})
    meta["turns"] = len([r for r in rows if r["policy"] == names[0]])
    write_traces(args.out / "traces.jsonl", traces_from_rows(rows))
    return write_report(rows, names, meta, args.out, make_plots=not args.no_plots)


def run(args: argparse.Namespace) -> dict:
    """Replay what the command line asks (resuming an earlier run of the same options) and write the
    report; returns the report object."""
    if args.report_only:
        return report_only(args)
    if args.audio:
        check_audio_available()
    specs = parse_policies(args.policies)
    profile = _profile(args)
    _check_options(args)
    sessions = load_sessions(args.sessions, args.split, args.limit, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    config = _config(args, profile)
    rows = _load_done(args.out, config, args.fresh)
    settle = settle_seconds(profile, args.settle_ms)
    done = {r["session"] for r in rows}
    todo = [s for s in sessions if s.id not in done]
    opts = _generator_options(args)
    edge_info, cloud_info = model_info(args.edge_model), model_info(args.cloud_model)
    meta = {
        "machine": machine_info(),
        "config": config,
        "models": {
            "edge": edge_info.name,
            "edge_fingerprint": edge_info.fingerprint,
            "cloud": cloud_info.name,
            "cloud_fingerprint": cloud_info.fingerprint,
        },
    }
    edge = LlamaModel(edge_info)
    cloud_model = LlamaModel(cloud_info)
    scorer = CloudScorer(cloud_model, threads=args.threads)
    runners: list[Runner] = []
    voice = None
    try:
        with _emulated_clouds(args, profile) as (url, key, proxy, tiers):
            connect, tier_connects = _connectors(url, key, tiers, opts.cloud_timeout_s)
            for spec in specs:
                runners.append(
                    Runner(spec, edge, connect, opts, query_threshold=args.query_threshold, tier_connects=tier_connects)
                )
            for r in runners:  # open connections and warm caches; not measured
                r.start_session(False)
                r.answer(WARMUP_MESSAGES, 2)
            if args.audio:
                adapters = [GeneratorAdapter(r, edge) for r in runners]
                voice = (AudioReplayer(adapters[0], args.max_tokens), adapters)
            proxy.reset_stats()
            _replay_remaining(todo, runners, voice, scorer, settle, args, rows)
            meta["network"] = proxy.summary()
            (args.out / "meta.json").write_text(json.dumps(meta, indent=2))
    finally:
        if voice is not None:
            voice[0].close()
        for r in runners:
            r.close()
        scorer.close()
        cloud_model.close()
        edge.close()
    wanted = {s.id for s in sessions}
    rows = [r for r in rows if r["session"] in wanted]
    meta["sessions"] = len({r["session"] for r in rows})
    meta["turns"] = len([r for r in rows if r["policy"] == specs[0].name])
    write_traces(args.out / "traces.jsonl", traces_from_rows(rows))  # for `tokenrouter-replay simulate`
    return write_report(rows, [s.name for s in specs], meta, args.out, make_plots=not args.no_plots)


def _profile(args: argparse.Namespace) -> NetProfile:
    """The emulated network: the named profile with the command line's overrides."""
    return get_profile(
        args.profile,
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        stall_prob=args.stall_prob,
        stall_ms=args.stall_ms,
        up_mbps=args.up_mbps,
        down_mbps=args.down_mbps,
    )


def _check_options(args: argparse.Namespace) -> None:
    """Refuse impossible options before any work; pin the device side to its CPUs."""
    if args.max_tokens < 1 or args.span < 1 or args.draft_max < 1:
        raise ReplayError("--max-tokens, --span and --draft-max must be >= 1")
    if not 0.0 < args.check_nats < float("inf"):
        raise ReplayError("--check-nats must be a finite number of nats > 0")
    if args.cloud_cpus:
        parse_cpus(args.cloud_cpus)  # a bad list is refused before any work, not when the server starts
    if args.device_cpus:
        pin_to_cpus(args.device_cpus)


def _generator_options(args: argparse.Namespace) -> GeneratorOptions:
    """The options every policy's generator starts from (each policy then sets its own)."""
    return replay_defaults(
        router=args.router,
        decision_engine=args.decision_engine,
        threshold=args.threshold,
        cloud_fraction=args.cloud_fraction,
        sync_every=args.sync_every,
        span=args.span,
        check_max_draft=args.draft_max,
        check_nats=args.check_nats,
        temperature=args.temperature,
        seed=args.seed,
        threads=args.threads,
        edge_model=args.edge_model,
        cloud_model=args.cloud_model,
        tiers=tuple(f"local:{m}" for m in args.tier or ()),  # names each tier's shipped router
        max_tokens=args.max_tokens,
    )


@contextlib.contextmanager
def _emulated_clouds(
    args: argparse.Namespace, profile: NetProfile
) -> Iterator[tuple[str, str, NetemProxy, list[tuple[str, str, NetemProxy]]]]:
    """The cloud and each tier above it (`--tier`): its own loopback server behind its own network
    emulator, on the same profile. Yields the cloud's (URL, API key, proxy) and the tiers' such triples."""
    cpus = args.cloud_cpus or ""
    cloud = emulated_cloud(args.cloud_model, profile, args.seed, args.threads, cpus)
    with cloud as (url, key, proxy), contextlib.ExitStack() as stack:
        tiers = [
            stack.enter_context(emulated_cloud(m, profile, args.seed + k, args.threads, cpus))
            for k, m in enumerate(args.tier or (), 1)
        ]
        yield url, key, proxy, tiers


def _connectors(
    url: str, key: str, tiers: list[tuple[str, str, NetemProxy]], timeout_s: float
) -> tuple[Callable[[], CloudLink], list[Callable[[], CloudLink]]]:
    """How a runner opens its link to the cloud, and to each tier above it."""
    connect = lambda: CloudLink(url, key, timeout_s=timeout_s)  # noqa: E731
    tier_connects = [lambda u=u, k=k: CloudLink(u, k, timeout_s=timeout_s) for u, k, _ in tiers]
    return connect, tier_connects


def _replay_remaining(
    todo: list[Session],
    runners: list[Runner],
    voice: tuple | None,
    scorer: CloudScorer,
    settle_s: float,
    args: argparse.Namespace,
    rows: list[dict],
) -> None:
    """Replay and score the sessions not done yet, each appended to results.jsonl as it ends (what a
    rerun resumes from) and to `rows`. The policies' order rotates session by session."""
    with _progress(len(todo), args.no_progress) as advance:
        with (args.out / "results.jsonl").open("a") as fh:
            for idx, session in enumerate(todo):
                order = [(idx + j) % len(runners) for j in range(len(runners))]
                results = replay_session(session, runners, order, args.max_tokens, voice, settle_s)
                new = score_session(session, results, scorer, args.max_tokens)
                fh.write(json.dumps({"session": session.id, "rows": new}) + "\n")
                fh.flush()
                rows.extend(new)
                advance()


@contextlib.contextmanager
def _progress(total: int, quiet: bool) -> Iterator:
    if quiet or total == 0:
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True
    ) as prog:
        task = prog.add_task("replay", total=total)
        yield lambda: prog.advance(task)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:
        return simulate_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = run(args)
    except (ReplayError, SessionError, ValueError) as exc:
        print(f"tokenrouter-replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(json_summary(report), indent=2))
    else:
        print(markdown(report))
        print(
            f"written: {args.out / 'report.json'}, {args.out / 'report.md'}"
            + (", plots" if report.get("plots") else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
