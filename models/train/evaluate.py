"""`tokenrouter-train eval`: quality against cloud fraction, by real routed decoding.

For every prompt and configuration the edge model writes easy tokens and the
cloud model writes routed ones (greedy), exactly by the generator's rule:
proposed = edge greedy token, score = router.score(hidden, logits, proposed),
hard = the decision engine's choice (shared/decision_engine.py; the built-in one is
RoutingPolicy.decide(score)), token = cloud greedy token if hard. Both
models run in-process (no server), all configurations of a batch of prompts
stepped together (pair.py); the cloud's logits at every position also give
the primary measure for free:

    cloud_nll        the cloud model's mean negative log-likelihood per token of
                     the routed answer (token-weighted over all prompts; lower = the
                     large model agrees more with what was said)
    rouge_l          ROUGE-L F1 (words) against the cloud-only answer
    token_agreement  share of positions equal to the cloud-only answer

Methods: learned (thresholds from the router file's calibration table),
entropy (thresholds calibrated on the same validation positions), random
(threshold 1 - f on uniform scores), edge-only and cloud-only; with `also`,
more learned routers side by side ("learned:<file stem>"); with `lookahead`,
a method plus the cloud's guess after each routed token; with `verify`, a
method plus the cloud's check of every device token (the generator's
`--check`: a device token the cloud finds more than N nats less likely than
its own choice is rolled back and rewritten by the cloud), from the start or
after the first clause (which is then written with lookahead, as
`--check after-first-clause` does). Compare routers
within one run: llama.cpp's batched kernels are not batch-invariant, so even
the edge-only figure moves by a few hundredths of a nat between runs, while
within a run every method shares the same edge-only and cloud-only answers. Fractions 0 and
1 of each method are the edge-only and cloud-only runs. The x axis is the
*achieved* cloud fraction, which differs from the target because thresholds
are calibrated on the cloud's path and applied on the routed one.

With `cloud_engine` (`--cloud-engine URL`: an OpenAI-compatible completions
server of the cloud model, e.g. vLLM, or llama-cpp-python's with
`--cloud-engine-format text`), every lookahead and check method also runs as
"<method>@remote": there the remote engine takes the cloud's decisions (its
token, its guess, the tie rule and the check's verdicts on the views of its
top log-probabilities, as cloud_server/remote_engine.py does; one request
per position), while the in-process cloud model still scores the answer.

The cloud's work is counted per run (`passes_per_token`, `cloud_tokens_per_token`
and per kind): a model of what the embedded engine does for the generator's
messages (prompt prefill; a sync every 4 device tokens; a pass per hard token
that brings tokens, plus one for its lookahead guess; a pass per checked
clause over its drafts and the token before). It is not measured: a clause's
drafts after a rejected one are not counted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from models.registry import model_info
from models.train.gap import gap_interval as bootstrap_gap
from models.train.gap import pareto_front as front_of
from models.train.label import chat
from models.train.pair import PairStepper, log_softmax_row
from models.train.person_check import person_counts
from shared.completions import CompletionsClient, Position, VocabModel
from shared.decision import (
    CHECK_MAX_DRAFT,
    SYNC_EVERY,
    TIE_NATS,
    AnswerRule,
    ClauseEnds,
    NumberWatch,
    RepeatWatch,
    RuleOptions,
    Step,
    cloud_choice,
    draft_ends,
    judge_draft,
)
from shared.decision_engine import BUILTIN_ENGINE, DEVICE, DecisionEngine, EngineSetup, build_engine, engine_tier
from shared.decision_engine import Position as EnginePosition
from shared.gpu_cost import PRODUCTION_CLOUD
from shared.learned_router import LearnedRouter, RouterFile
from shared.llama_backend import LlamaModel
from shared.policy import PolicyConfig, RoutingPolicy
from shared.prompting import DEFAULT_SYSTEM_PROMPT
from shared.protocol import NEXT_TOP, SamplingParams, Work
from shared.router import HeuristicRouter, RandomRouter
from shared.sampling import Guess, Sampler
from shared.textmetrics import rouge_l_f1, token_agreement

METHODS = ("learned", "entropy", "random")
DEFAULT_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(11))


@dataclass(slots=True)
class EvalOptions:
    router_path: Path
    edge_model: str
    cloud_model: str
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    max_tokens: int = 48
    prompts_per_batch: int = 2
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    threads: int | None = 1  # one llama.cpp thread: a second one's barriers collapse throughput on a shared machine
    seed: int = 0
    progress: bool = True
    also: tuple[Path, ...] = ()  # more learned routers, evaluated side by side
    lookahead: tuple[
        str, ...
    ] = ()  # methods also run with the cloud's next-token guess, as "<method>+lookahead@<nats>"
    lookahead_nats: tuple[float, ...] = (
        1.0,
    )  # take a guess when the device's token is this much less likely to the cloud
    verify: tuple[
        str, ...
    ] = ()  # methods also run with the cloud's check of every device token, as "<method>+verify@<nats>"
    verify_nats: tuple[float, ...] = (1.0,)  # the check overrules a device token this much less likely to the cloud
    verify_from: tuple[str, ...] = (
        "all",
    )  # "all" and/or "after-first-clause" (then as "<method>+verify@<nats>:after-first-clause")
    tie_nats: float = (
        TIE_NATS  # a device token this close to the cloud's best counts as the cloud's choice (shared/decision.py)
    )
    cloud_engine: str | None = None  # a remote completions engine's URL: lookahead/check methods also run "@remote"
    cloud_engine_format: str = "ids"  # its prompt format: "ids", or "text" (llama-cpp-python's server)
    sync_every: int = SYNC_EVERY  # the generator's eager sync (GeneratorOptions.sync_every), for the work model
    # who decides the router's positions, as on the device (--decision-engine; shared/decision_engine.py): each
    # method's engine is built around that method's policy
    decision_engine: str = BUILTIN_ENGINE
    keep_answers: bool = False  # the result also lists every answer (text, tokens, per-position decisions)


@dataclass(slots=True)
class _Run:
    method: str
    target: float
    prompt: int
    policy: RoutingPolicy | None  # None: edge-only / cloud-only
    router: Any = None
    engine: DecisionEngine | None = None  # decides the positions the router scores (built around `policy`)
    position: EnginePosition = field(default_factory=EnginePosition)  # what the engine is shown, reused
    cloud_only: bool = False
    rule: AnswerRule | None = None  # the generator's per-position rule (shared/decision.py); None: the router alone
    guessed: int = 0  # cloud tokens taken from a lookahead guess (no round trip)
    overruled: int = 0  # cloud tokens written where the check rejected the device's token
    remote: bool = False  # the cloud's decisions come from the remote engine (`cloud_engine`)
    tokens: list[int] = field(default_factory=list)
    hard: list[bool | None] = field(default_factory=list)  # the engine's decision per position (None: not asked)
    proposed: list[int] = field(default_factory=list)  # the device model's greedy token per position
    routed: int = 0
    nll: float = 0.0
    done: bool = False
    loops: RepeatWatch = field(default_factory=RepeatWatch)  # the answer ends where it begins to loop
    work: CloudWork | None = None  # the work model (the module docstring); None for edge-only


def _runs_for(
    prompt: int,
    router_file: RouterFile,
    opts: EvalOptions,
    n_vocab: int,
    clause_ends: ClauseEnds,
    extra: dict[str, RouterFile] | None = None,
    numbers: NumberWatch | None = None,
) -> list[_Run]:
    runs = [_Run("edge-only", 0.0, prompt, None), _Run("cloud-only", 1.0, prompt, None, cloud_only=True)]
    learned = LearnedRouter(router_file)
    others = {name: LearnedRouter(rf) for name, rf in (extra or {}).items()}
    entropy = HeuristicRouter("entropy", n_vocab)
    ent_table = router_file.meta["entropy_calibration"]
    for f in opts.fractions:
        if f <= 0 or f >= 1:
            continue
        thresholds = {
            "learned": learned.threshold_for_fraction(f),
            "entropy": float(
                np.interp(f, [r["cloud_fraction"] for r in ent_table], [r["threshold"] for r in ent_table])
            ),
            "random": 1.0 - f,
        }
        routers = {
            "learned": learned,
            "entropy": entropy,
            "random": RandomRouter(seed=opts.seed * 100003 + prompt * 101 + int(f * 100)),
        }
        for name, r in others.items():
            thresholds[name], routers[name] = r.threshold_for_fraction(f), r

        def policy(m: str) -> RoutingPolicy:
            return RoutingPolicy(PolicyConfig("router", threshold=min(max(thresholds[m], 0.0), 1.0)))

        def rule(lookahead: bool = False, nats: float = 1.0, check: str = "off", check_nats: float = 1.0) -> AnswerRule:
            return AnswerRule(RuleOptions(lookahead, nats, check, check_nats, opts.tie_nats), clause_ends, numbers)

        runs += [_Run(m, f, prompt, policy(m), routers[m], rule=rule()) for m in thresholds]
        runs += [
            _Run(f"{m}+lookahead@{nats:g}", f, prompt, policy(m), routers[m], rule=rule(True, nats))
            for m in opts.lookahead
            for nats in opts.lookahead_nats
        ]
        runs += [
            _Run(f"{m}+verify@{nats:g}", f, prompt, policy(m), routers[m], rule=rule(check="all", check_nats=nats))
            for m in opts.verify
            for nats in opts.verify_nats
            if "all" in opts.verify_from
        ]
        runs += [
            _Run(
                f"{m}+verify@{nats:g}:after-first-clause",
                f,
                prompt,
                policy(m),
                routers[m],
                rule=rule(True, opts.lookahead_nats[0], "after-first-clause", nats),
            )
            for m in opts.verify
            for nats in opts.verify_nats
            if "after-first-clause" in opts.verify_from
        ]
    if opts.cloud_engine:  # the same rule with the remote engine's decisions
        runs += [
            _Run(f"{r.method}@remote", r.target, prompt, r.policy, r.router, rule=r.rule, remote=True)
            for r in list(runs)
            if r.rule is not None and ("+lookahead" in r.method or "+verify" in r.method)
        ]
        for r in runs:
            if r.remote:  # its own policy and rule state (the twin's are shared objects otherwise)
                r.policy = RoutingPolicy(r.policy.config) if r.policy is not None else None
                r.rule = AnswerRule(r.rule.options, clause_ends, numbers) if r.rule is not None else None
    for r in runs:  # each routed run's engine, around its own policy (as the device builds it)
        if r.policy is not None:
            r.engine = build_engine(opts.decision_engine, EngineSetup(r.policy, {}, opts.edge_model, opts.cloud_model))
    return runs


def evaluate(prompts: list[str], opts: EvalOptions, on_progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    rf = RouterFile.load(opts.router_path)
    edge_info, cloud_info = model_info(opts.edge_model), model_info(opts.cloud_model)
    if edge_info.fingerprint != rf.meta["edge_fingerprint"]:
        raise ValueError(
            f"{opts.router_path} was trained for edge model {rf.meta['edge_model']}, not {edge_info.name}; evaluate it with its own models"
        )
    extra = {f"learned:{Path(p).stem}": RouterFile.load(p) for p in opts.also}
    for p, other in zip(opts.also, extra.values()):
        if other.meta["edge_fingerprint"] != rf.meta["edge_fingerprint"]:
            raise ValueError(f"{p} was trained for edge model {other.meta['edge_model']}, not {edge_info.name}")
    if not prompts:
        raise ValueError("no prompts to evaluate")
    edge, cloud = LlamaModel(edge_info), LlamaModel(cloud_info)
    remote = None
    if opts.cloud_engine:
        remote = CompletionsClient(
            VocabModel(cloud_info), opts.cloud_engine, prompt_format=opts.cloud_engine_format, timeout_s=60.0
        )
    tokens = [chat(edge, opts.system_prompt, p) for p in prompts]
    per = opts.prompts_per_batch
    clause_ends, numbers = ClauseEnds(edge.token_bytes, edge.is_eog), NumberWatch(edge.token_bytes)
    n_cfg = len(_runs_for(0, rf, opts, edge.n_vocab, clause_ends, extra, numbers))
    longest = max(len(t) for t in tokens)
    stepper = PairStepper(
        edge, cloud, n_seq=per * n_cfg, n_ctx=per * (longest + n_cfg * (opts.max_tokens + 2)) + 64, threads=opts.threads
    )
    runs: list[_Run] = []
    try:
        for start in range(0, len(prompts), per):
            batch = [
                _runs_for(k, rf, opts, edge.n_vocab, clause_ends, extra, numbers)
                for k in range(start, min(start + per, len(prompts)))
            ]
            _decode(stepper, batch, [tokens[b[0].prompt] for b in batch], opts.max_tokens, opts.tie_nats, remote, opts)
            runs += [r for b in batch for r in b]
            if on_progress is not None:
                on_progress(len(batch))
        texts = [edge.detokenize(r.tokens) for r in runs]  # while the model (its vocabulary) is alive
    finally:
        stepper.close()
        edge.close()
        cloud.close()
        if remote is not None:
            remote.close()
            remote.model.close()
    result = summarise(runs, texts, prompts, opts)
    result["n_prompts"] = len(prompts)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["router"] = str(opts.router_path)
    if opts.also:
        result["also"] = [str(p) for p in opts.also]
    if opts.cloud_engine:
        result["cloud_engine"] = {"url": opts.cloud_engine, "prompt_format": opts.cloud_engine_format}
    result["edge_model"], result["cloud_model"] = edge_info.name, cloud_info.name
    result["decision_engine"] = opts.decision_engine
    if opts.keep_answers:  # for reading answers side by side, and for comparing decisions with the device's
        result["answers"] = [
            {
                "method": r.method,
                "target_fraction": r.target,
                "prompt": prompts[r.prompt],
                "text": t,
                "tokens": r.tokens,
                "proposed": r.proposed,
                "hard": r.hard,
            }
            for r, t in zip(runs, texts)
        ]
    return result


def _decode(
    stepper: PairStepper,
    batch: list[list[_Run]],
    prompts: list[list[int]],
    max_tokens: int,
    tie_nats: float,
    remote: CompletionsClient | None = None,
    opts: EvalOptions | None = None,
) -> None:
    """Routed greedy decoding of every run. Runs whose histories are equal share one llama
    sequence; when their next tokens differ the sequence is forked (KV cells shared), so
    e.g. edge-only and a 10% router run cost one sequence until the router first routes."""
    stepper.start([(p, [i]) for i, p in enumerate(prompts)])
    free = list(range(stepper.n_seq - 1, len(prompts) - 1, -1))
    seq_of: dict[int, int] = {}  # run -> the llama sequence it is on
    run_prompt: dict[int, int] = {}  # run -> index of its prompt in `prompts`
    runs = [r for b in batch for r in b]
    for i, b in enumerate(batch):
        for r in b:
            seq_of[id(r)] = i
            run_prompt[id(r)] = i
            _start_answer(r, len(prompts[i]), opts.sync_every if opts is not None else SYNC_EVERY)
    active = list(runs)
    for _ in range(max_tokens):
        views = {v.seq: v for v in stepper.views()}
        cache: dict[tuple[int, int], Any] = {}  # per-step values shared by runs on one sequence
        moves: dict[int, dict[int, list[_Run]]] = {}  # seq -> token -> runs
        for run in active:
            seq = seq_of[id(run)]
            tok = _write_token(run, views[seq], cache, seq, prompts[run_prompt[id(run)]], tie_nats, remote)
            if stepper.edge.is_eog(tok) or run.loops.said_again(run.tokens):  # as the device ends an answer
                run.done = True
            else:
                moves.setdefault(seq, {}).setdefault(tok, []).append(run)
            if run.work is not None and (run.done or len(run.tokens) >= max_tokens):
                run.work.finish()
        advance = _regroup(stepper, views, moves, free, seq_of)
        active = [r for r in active if not r.done]
        if not advance:
            break
        stepper.advance(advance)
    for seq in list(stepper.length):
        stepper.release(seq)


def _start_answer(run: _Run, n_prompt: int, sync_every: int) -> None:
    """Reset a run's per-answer state (policy, engine, rule) and start its work model."""
    if run.policy is not None:
        run.policy.start_answer()
    if run.engine is not None:
        run.engine.start_answer()
    if run.rule is not None:
        run.rule.start_answer()
    if run.rule is not None or run.cloud_only:
        run.work = CloudWork(n_prompt, sync_every)


def _write_token(
    run: _Run,
    v: Any,
    cache: dict[tuple[int, int], Any],
    seq: int,
    prompt: list[int],
    tie_nats: float,
    remote: CompletionsClient | None,
) -> int:
    """Write a run's next token at the position its sequence's view `v` shows (the device's greedy
    token, the cloud's, or the rule's choice) and record what it costs; returns the token."""
    if (0, seq) not in cache:
        cache[(0, seq)] = (
            int(np.argmax(v.cloud_logits)),
            int(np.argmax(v.edge_logits)),
            log_softmax_row(v.cloud_logits)[1],
        )
    cloud_tok, proposed, lse = cache[(0, seq)]
    tok = cloud_tok if run.cloud_only else proposed
    run.routed += int(run.cloud_only)
    if run.cloud_only and run.work is not None:
        run.work.stream()
    if run.rule is not None and run.remote:
        assert remote is not None
        pos = _remote_position(remote, prompt + run.tokens)
        view = pos.view(remote.model.n_vocab)
        tok = _routed_token(run, v, view, pos.token, proposed, cache, seq, tie_nats, pos.guess())
    elif run.rule is not None:
        tok = _routed_token(run, v, v.cloud_logits, cloud_tok, proposed, cache, seq, tie_nats)
    run.nll += lse - float(v.cloud_logits[tok])
    run.tokens.append(tok)
    run.proposed.append(proposed)
    if len(run.hard) < len(run.tokens):  # not a routed run, or the rule did not ask the router
        run.hard.append(None)
    return tok


def _regroup(
    stepper: PairStepper,
    views: dict[int, Any],
    moves: dict[int, dict[int, list[_Run]]],
    free: list[int],
    seq_of: dict[int, int],
) -> dict[int, int]:
    """Release the sequences no run goes on with; fork a sequence whose runs chose different tokens
    (one new sequence per further token, KV cells shared). Returns each sequence's next token."""
    advance: dict[int, int] = {}
    for seq in views:
        if seq not in moves:
            stepper.release(seq)
            free.append(seq)
    for seq, by_tok in moves.items():
        for k, (tok, group) in enumerate(by_tok.items()):
            target = seq
            if k > 0:
                target = free.pop()
                stepper.fork(seq, target)
                for r in group:
                    seq_of[id(r)] = target
            advance[target] = tok
    return advance


def _routed_token(
    run: _Run,
    v: Any,
    cloud_logits: np.ndarray,
    cloud_tok: int,
    proposed: int,
    cache: dict,
    seq: int,
    tie_nats: float,
    remote_guess: Guess | None = None,
) -> int:
    """One position of a routed run, by the generator's rule (shared/decision.py) with both
    models' logits at hand: the cloud's guess, its `generate` and its check are evaluated here
    exactly as the cloud would. Greedy: the check's redrafting after a rejection follows the
    same path, so judging each draft where it stands gives the generator's answer. `cloud_logits`
    is the in-process cloud model's row, or a remote engine's view (then `remote_guess` is its guess)."""
    rule = run.rule
    assert rule is not None and run.policy is not None
    guess = None
    if rule.guess_due:  # the cloud sent its guess with its last token
        if remote_guess is not None:
            guess = remote_guess
        else:
            if (1, seq) not in cache:
                cache[(1, seq)] = Guess.of(cloud_logits, cloud_tok)
            guess = cache[(1, seq)]
    flagged = None
    if rule.router_asked(guess):
        key = (id(run.router), seq)
        if isinstance(run.router, RandomRouter) or key not in cache:
            cache[key] = run.router.score(v.edge_hidden, v.edge_logits, proposed)
        assert run.engine is not None
        required = rule.cloud_required(run.tokens, 0, proposed)
        tier = engine_tier(
            run.engine, run.position, len(run.tokens), proposed, cache[key], v.edge_hidden, v.edge_logits, 2, required
        )
        flagged = tier != DEVICE
        run.hard.append(flagged)
    step = rule.step(flagged, guess, proposed, guess is not None and rule.cloud_required(run.tokens, 0, proposed))
    tok = proposed
    if step is Step.GUESS_TAKE:
        tok = guess.token if guess is not None else cloud_tok
        run.guessed += 1
    elif step is Step.ASK:
        tok = cloud_choice(cloud_logits, _GREEDY, proposed, tie_nats)
    elif step is Step.DRAFT:
        verdict = judge_draft(cloud_logits, proposed, bool(flagged), rule.options.check_nats, _GREEDY, tie_nats)
        tok = proposed if verdict < 0 else verdict
        run.overruled += int(verdict >= 0 and not flagged)
    run.routed += int(
        step in (Step.ASK, Step.GUESS_TAKE) or (step is Step.DRAFT and (bool(flagged) or tok != proposed))
    )
    if run.work is not None:
        run.work.step(step, proposed, tok, rule)
    rule.written(tok, cloud_answered=step is Step.ASK)
    return tok


def _remote_position(client: CompletionsClient, history: list[int]) -> Position:
    """The remote engine's greedy choice after `history` with its top list (one request). Where it
    ended the answer without listing anything, its end token is its only listed choice."""
    reply = client.post(client.body(history, 1, SamplingParams(), NEXT_TOP))
    assert reply is not None
    pos = client.positions(reply, 1)[0]
    if not pos.listed:
        pos = Position(pos.token, 0.0)
    return pos


class CloudWork:
    """The embedded engine's passes and tokens for the generator's messages, replayed per run (a
    model: see the module docstring). States: device tokens the cloud lacks (`unsent`), its own
    written token not yet decoded (`own`), next-position logits kept by a prefill (`ready`)."""

    def __init__(self, n_prompt: int, sync_every: int = SYNC_EVERY, max_draft: int = CHECK_MAX_DRAFT) -> None:
        self.work = Work()
        self.sync_every, self.max_draft = sync_every, max_draft
        self.unsent = self.own = self.clause = 0
        self.ready, self.past_end = True, False
        self._pass("prefill_tokens", n_prompt)  # after hello

    def _pass(self, kind: str, n: int) -> None:
        if n > 0:
            self.work.passes += 1
            setattr(self.work, kind, getattr(self.work, kind) + n)

    def _sync(self) -> None:
        n = self.unsent + self.own
        if n:
            self._pass("prefill_tokens", n)
            self.unsent = self.own = 0
            self.ready = True

    def stream(self) -> None:
        """Policy cloud: each streamed token is one pass over the token before it."""
        self._pass("generate_tokens", 1)

    def step(self, step: Step, proposed: int, tok: int, rule: AnswerRule) -> None:
        if step is Step.ASK:
            n = self.unsent + self.own or int(not self.ready)  # kept logits: no pass
            self._pass("generate_tokens", n)
            self.unsent, self.own, self.ready = 0, 1, False
            if rule.options.lookahead:  # the guess: the written token decoded at once
                self._pass("guess_tokens", 1)
                self.own, self.ready = 0, True
        elif step is Step.DRAFT:
            if self.clause == 0:
                self._sync()  # the check sends the final tokens the cloud lacks first
            self.clause += 1
            rejected = tok != proposed
            if rejected or draft_ends(self.clause, self.past_end, self.max_draft):  # the device's draft rule
                self._verify(rejected)
            else:
                self.past_end = rule.clause_ends(proposed)
        else:  # a device token (kept, or the guess taken on the device): synced every `sync_every`
            self.unsent += 1
            if self.unsent >= self.sync_every:
                self._sync()

    def finish(self) -> None:
        """The answer ended: a clause still drafting is checked (the generator's last verify)."""
        if self.clause:
            self._verify(False)

    def _verify(self, rejected: bool) -> None:
        self._pass("verify_tokens", self.clause + 1)  # the drafts and the token before them
        self.clause, self.past_end = 0, False
        self.unsent, self.own, self.ready = 0, int(rejected), False


_GREEDY = Sampler(SamplingParams())


def summarise(runs: list[_Run], texts: list[str], prompts: list[str], opts: EvalOptions) -> dict[str, Any]:
    by_prompt_cloud = {r.prompt: (r, t) for r, t in zip(runs, texts) if r.method == "cloud-only"}
    groups: dict[tuple[str, float], list[tuple[_Run, str]]] = {}
    for r, t in zip(runs, texts):
        groups.setdefault((r.method, r.target), []).append((r, t))

    def point(items: list[tuple[_Run, str]], target: float) -> dict[str, float]:
        n = sum(len(r.tokens) for r, _ in items)
        return {
            "target_fraction": target,
            "cloud_fraction": round(sum(r.routed for r, _ in items) / max(n, 1), 4),
            "lookahead_fraction": round(
                sum(r.guessed for r, _ in items) / max(n, 1), 4
            ),  # cloud tokens that needed no round trip
            "overruled_fraction": round(
                sum(r.overruled for r, _ in items) / max(n, 1), 4
            ),  # cloud tokens from the check of device tokens
            "cloud_nll": round(sum(r.nll for r, _ in items) / max(n, 1), 4),
            "rouge_l": round(float(np.mean([rouge_l_f1(t, by_prompt_cloud[r.prompt][1]) for r, t in items])), 4),
            "token_agreement": round(
                float(np.mean([token_agreement(r.tokens, by_prompt_cloud[r.prompt][0].tokens) for r, t in items])), 4
            ),
            "n_tokens": n,
            **_work_point(items, n),
            **person_counts((prompts[r.prompt], t) for r, t in items),  # what a reader sees (person_check.py)
        }

    edge_pt, cloud_pt = point(groups[("edge-only", 0.0)], 0.0), point(groups[("cloud-only", 1.0)], 1.0)
    methods: dict[str, list[dict[str, float]]] = {"edge-only": [edge_pt], "cloud-only": [cloud_pt]}
    names = list(METHODS) + sorted({r.method for r in runs} - set(METHODS) - {"edge-only", "cloud-only"})
    for m in names:
        pts = [dict(edge_pt, target_fraction=0.0)]
        pts += [point(groups[(m, f)], f) for f in opts.fractions if 0 < f < 1]
        pts.append(dict(cloud_pt, target_fraction=1.0))
        methods[m] = pts
    gap = {m: round(gap_recovered(methods[m], edge_pt["cloud_nll"], cloud_pt["cloud_nll"], 0.3), 4) for m in names}
    nll_at = {
        m: {f"{int(f * 100)}%": round(interp_nll(methods[m], f), 4) for f in (0.1, 0.2, 0.3, 0.4, 0.5)} for m in names
    }
    beats = all(nll_at["learned"][k] < nll_at["entropy"][k] for k in nll_at["learned"])
    return {
        "methods": methods,
        "pareto_front": pareto_front(methods),  # quality against the work model's GPU-seconds, over every point
        "gap_recovered_at_30": gap,
        "gap_recovered_at_30_ci95": gap_interval(runs, names, seed=opts.seed),
        "cloud_nll_at": nll_at,
        "learned_beats_entropy_10_to_50": beats,
    }


def _work_point(items: list[tuple[_Run, str]], n: int) -> dict[str, Any]:
    """The work model's passes and tokens per answer token (zero for edge-only)."""
    total = Work()
    for r, _ in items:
        if r.work is not None:
            total.add(r.work.work)
    n = max(n, 1)
    return {
        "passes_per_token": round(total.passes / n, 4),
        "cloud_tokens_per_token": round(total.tokens / n, 4),
        "cloud_tokens_by_kind_per_token": {
            k: round(getattr(total, f"{k}_tokens") / n, 4) for k in ("prefill", "generate", "verify", "guess")
        },
        "gpu_s_per_1k_tokens": round(1000 * PRODUCTION_CLOUD.gpu_seconds(total.passes, total.tokens) / n, 3),
    }


def pareto_front(methods: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The points no other point beats on both cost and quality: (method, target, GPU-seconds per 1k answer
    tokens in the work model, cloud NLL), cheapest first (models/train/gap.py)."""
    points = {
        (m, p["target_fraction"]): (p["gpu_s_per_1k_tokens"], p["cloud_nll"]) for m, pts in methods.items() for p in pts
    }
    return [
        {"method": m, "target_fraction": f, "gpu_s_per_1k_tokens": cost, "cloud_nll": nll}
        for cost, nll, m, f in front_of(points)
    ]


def gap_interval(runs: list[_Run], names: list[str], seed: int = 0) -> dict[str, list[float]]:
    """95% bootstrap interval of `gap_recovered_at_30` over prompts (models/train/gap.py, on tokens)."""
    prompts = sorted({r.prompt for r in runs})
    index = {p: i for i, p in enumerate(prompts)}
    per_prompt: dict[tuple[str, float], np.ndarray] = {}
    for r in runs:
        rows = per_prompt.setdefault((r.method, r.target), np.zeros((3, len(prompts))))
        rows[:, index[r.prompt]] = r.nll, len(r.tokens), r.routed
    return bootstrap_gap(per_prompt, names, seed=seed)


def interp_nll(points: list[dict[str, float]], fraction: float) -> float:
    pts = sorted(points, key=lambda p: p["cloud_fraction"])
    return float(np.interp(fraction, [p["cloud_fraction"] for p in pts], [p["cloud_nll"] for p in pts]))


def gap_recovered(points: list[dict[str, float]], edge_nll: float, cloud_nll: float, fraction: float) -> float:
    """Share of the edge-only -> cloud-only cloud-NLL gap recovered at `fraction` (interpolated)."""
    gap = edge_nll - cloud_nll
    if gap <= 0:
        return float("nan")
    return (edge_nll - interp_nll(points, fraction)) / gap


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in zip(
        axes,
        ("cloud_nll", "rouge_l", "token_agreement"),
        ("cloud NLL / token (lower is better)", "ROUGE-L F1 vs cloud-only", "token agreement vs cloud-only"),
    ):
        others = [m for m in result["methods"] if m.startswith("learned:") or "+lookahead" in m or "+verify" in m]
        for m, style in (("learned", "o-"), ("entropy", "s--"), ("random", "^:"), *((m, "d-") for m in others)):
            pts = sorted(result["methods"][m], key=lambda p: p["cloud_fraction"])
            ax.plot([100 * p["cloud_fraction"] for p in pts], [p[key] for p in pts], style, label=m)
        for m, color in (("edge-only", "grey"), ("cloud-only", "black")):
            ax.axhline(result["methods"][m][0][key], color=color, linewidth=0.8, linestyle="-.", label=m)
        ax.set_xlabel("cloud tokens (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(
        f"{result.get('split', 'prompts')}: {result.get('n_prompts')} prompts, {result.get('edge_model')} + {result.get('cloud_model')}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
