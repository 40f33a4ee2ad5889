"""`tokenrouter-train eval` for a pair of models with different tokenizers (text mode, protocol v3).

The token-level eval (evaluate.py) needs one vocabulary. For a mixed pair (SmolLM2-135M on the
device, Gemma-3-270M in the cloud) this replays the generator's text-mode path in-process, one
answer at a time, with the same rule as the device and the server (shared/text_history.py):
the device proposes its greedy token and the router scores it; an easy position appends the
device's token to the answer text; a hard one (on a whole character) hands the text to the
cloud model, which re-tokenizes it with its own tokenizer and writes its span (its greedy tokens,
the device's proposal standing where it ties: shared/decision.py's `cloud_choice`), and the
device re-tokenizes the answer with the span. Both KV caches follow the text (keep the common
token prefix, decode the rest).

Quality is the cloud model's negative log-likelihood **per byte** of the answer text, each
answer read by the cloud model (teacher-forced over its own tokens of the text, after its own
prompt), summed over prompts and divided by their bytes: per token would favour whichever
tokenizer cuts finer. The x axis is the share of answer bytes the cloud wrote. The gap recovered
at 30% cloud bytes is (edge-only − method) / (edge-only − cloud-only), with each method's curve
interpolated at 0.3.

Methods: learned (the router file trained for this pair by `tokenrouter-train label` + `fit`,
labels in the cloud's NLL of the text: text_label.py; skipped when no file is given) and entropy,
both with thresholds at quantiles of their own scores along the edge-only answers of the same
prompts (one calibration rule for both), and random (threshold 1 − f on uniform scores);
edge-only and cloud-only (every position asked: the cloud's own text, up to ties). With
`lookahead`, methods also run with the cloud's text guess after each span deciding the next
position ("<method>+lookahead@<nats>", shared/text_history.py `TextGuess`), as the generator does
by default. The gap
recovered comes with a 95% bootstrap interval over prompts (models/train/gap.py, as the token eval's).

Cost: each point's `gpu_s_per_1k_bytes` prices the cloud model's decode passes for the answers (its
prompt's prefill at hello, the device's text it re-tokenizes and prefills at each ask, one pass per
token of a span, peek or guess) by the GPU cost model (shared/gpu_cost.py, the production 70B), per
1,000 answer bytes; `pareto_front` lists the points no other beats on both that cost and NLL per
byte. The device's syncs are folded into the next ask (one pass), so passes are a lower bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from models.registry import model_info
from models.train.gap import gap_interval, pareto_front
from models.train.person_check import person_counts
from shared.decision import AnswerRule, RuleOptions, Step, cloud_choice
from shared.decision_engine import BUILTIN_ENGINE, DEVICE, DecisionEngine, EngineSetup, build_engine, engine_tier
from shared.decision_engine import Position as EnginePosition
from shared.gpu_cost import PRODUCTION_CLOUD
from shared.learned_router import LearnedRouter, load_router
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel
from shared.policy import PolicyConfig, RoutingPolicy
from shared.prompting import DEFAULT_SYSTEM_PROMPT
from shared.protocol import SamplingParams
from shared.router import HeuristicRouter, RandomRouter, Router
from shared.sampling import Guess, Sampler
from shared.sequences import common_prefix
from shared.text_history import DONE, PEEK, SPAN_TOKENS, AnswerText, SpanWriter, TextGuess, complete_utf8, device_pieces

TEXT_METHODS = ("learned", "entropy", "random")
DEFAULT_TEXT_FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4)  # of positions asked: a span takes more in bytes


@dataclass(slots=True)
class TextEvalOptions:
    edge_model: str
    cloud_model: str
    fractions: tuple[float, ...] = DEFAULT_TEXT_FRACTIONS
    max_tokens: int = 48  # device tokens per answer
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    threads: int | None = 1
    seed: int = 0
    router: Path | None = None  # the learned router for this pair (None: entropy and random only)
    lookahead: tuple[str, ...] = ()  # methods also run with the cloud's text guess, as "<method>+lookahead@<nats>"
    lookahead_nats: float = 1.0
    decision_engine: str = BUILTIN_ENGINE  # who decides the router's positions (shared/decision_engine.py)
    keep_answers: bool = False  # the result also lists every answer's text (for reading side by side)


class TextSide:
    """One model's history over the shared text: its prompt, then its tokens of the answer."""

    def __init__(self, model: LlamaModel, n_ctx: int, threads: int | None, embeddings: bool) -> None:
        self.model = model
        self.view = AnswerText.for_model(model)
        self.ctx = LlamaContext(model, n_ctx=n_ctx, n_seq=1, threads=threads, embeddings=embeddings)
        self.n_prompt = 0
        self.history: list[int] = []
        self.n_decoded = 0
        self.passes = self.tokens = 0  # decode passes and their tokens for answers (not for `nll`): the work model

    def start(self, prompt: list[int]) -> None:
        keep = common_prefix(self.history, prompt)
        self.truncate(keep)
        self.history = list(prompt)
        self.n_prompt = len(prompt)

    def truncate(self, n: int) -> None:
        del self.history[n:]
        if self.n_decoded > n:
            self.ctx.truncate(0, n)
            self.n_decoded = n

    def follow(self, text: bytes) -> list[int]:
        """Bring the history to prompt + tokens(text) (shared/text_history.py); the tokens appended."""
        keep, add = self.view.reconcile(self.history[self.n_prompt :], text)
        self.truncate(self.n_prompt + keep)
        self.history += add
        return add

    def next(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(logits, hidden) after the history (views until the next decode)."""
        n = len(self.history)
        if self.n_decoded == n:  # outputs not kept: decode the last token again
            self.ctx.truncate(0, n - 1)
            self.n_decoded = n - 1
        pending = self.history[self.n_decoded :]
        out = self.ctx.decode([DecodeItem(0, self.n_decoded, pending)])[0]
        self.passes, self.tokens = self.passes + 1, self.tokens + len(pending)
        self.n_decoded = n
        return self.ctx.logits(out), (self.ctx.hidden(out) if self.ctx.embeddings else None)

    def nll(self, text: bytes) -> float:
        """The model's summed negative log-likelihood of answer `text` after its prompt."""
        prompt = self.history[: self.n_prompt]
        answer = self.view.tokens(text)
        self.truncate(0)
        self.history = prompt + answer
        if not answer:
            return 0.0
        rows = self.history
        outs = self.ctx.decode_outputs(DecodeItem(0, 0, rows), list(range(len(prompt) - 1, len(rows) - 1)))
        self.n_decoded = len(rows)
        total = 0.0
        for o, token in zip(outs, answer):
            logits = self.ctx.logits(o).astype(np.float64)
            m = logits.max()
            total += m + np.log(np.exp(logits - m).sum()) - logits[token]
        self.truncate(0)
        self.history = prompt
        return float(total)

    def close(self) -> None:
        self.ctx.close()


@dataclass(slots=True)
class _Answer:
    text: bytes = b""
    cloud_bytes: int = 0
    guessed: int = 0  # positions where the cloud's lookahead guess was taken
    scores: list[float] = field(default_factory=list)
    also: list[float] = field(default_factory=list)  # a second router's scores (calibration)
    passes: int = 0  # the cloud's decode passes for this answer, its prompt's prefill included (the work model)
    tokens: int = 0  # the tokens those passes carried


def _cloud_span(cloud: TextSide, text: bytes, proposed: bytes, sampler: Sampler) -> tuple[bytes, bool]:
    """The cloud's span after `text` by the server's rule and loop (`SpanWriter.steps`, greedy as
    the server is by default): (its text, answer ended)."""
    cloud.follow(text)
    logits, _ = cloud.next()
    token = cloud_choice(logits, sampler, cloud.view.proposal(text, proposed))  # the first, as the server's
    w = SpanWriter(cloud.view, text, SPAN_TOKENS)
    steps = w.steps(cloud.model.is_eog)
    ask = next(steps)
    while ask != DONE:
        if ask == PEEK:  # the server peeks at the same greedy next token (and writes it if it goes on)
            token = int(np.argmax(cloud.next()[0]))
            ask = steps.send(token)
            continue
        if token < 0:  # WRITE, with no token chosen yet
            token = int(np.argmax(cloud.next()[0]))
        if not cloud.model.is_eog(token):
            cloud.history.append(token)
        ask, token = steps.send(token), -1
    return w.whole(), w.eog


def _take_cloud_text(a: _Answer, edge: TextSide, added: bytes, room: int) -> int:
    """The cloud's text joins the answer, as `TextHistory.take_text` does on the device: cut to the
    answer's room in device tokens (whole characters: `device_pieces`), counted as cloud bytes, the
    device's history re-tokenized. Returns the device positions it took (at least one)."""
    pieces, added = device_pieces(edge.model, added, False, room)
    a.cloud_bytes += len(added)
    a.text += added
    edge.follow(a.text)
    return max(len(pieces), 1)


def _cloud_guess(cloud: TextSide, text: bytes) -> TextGuess:
    """The cloud's guess for the position after answer `text` (its lookahead, as the server's
    span sends it: shared/text_history.py `TextGuess`)."""
    cloud.follow(text)
    logits, _ = cloud.next()
    return TextGuess.of(Guess.of(logits, int(np.argmax(logits))), cloud.view, cloud.model.is_eog)


def _routed(
    edge: TextSide,
    cloud: TextSide,
    eprompt: list[int],
    cprompt: list[int],
    router: Router | None,
    engine: DecisionEngine | None,
    max_tokens: int,
    always: bool = False,
    also: Router | None = None,
    lookahead_nats: float | None = None,
) -> _Answer:
    """One answer by the text-mode rule (the module docstring). `router` None: the device alone
    (`always`: the cloud at every position); `engine` decides the router's positions, as on the device. `lookahead_nats`: after each span the cloud's text
    guess decides the next position (shared/decision.py's rule, as the generator's PerToken over the text history)."""
    sampler = Sampler(SamplingParams())
    edge.start(eprompt)
    cloud.start(cprompt)
    passes0, tokens0 = cloud.passes, cloud.tokens
    if engine is not None:
        engine.start_answer()
    at = EnginePosition()
    rule = AnswerRule(RuleOptions(lookahead_nats is not None, lookahead_nats or 0.0, "off"), lambda _: False)
    text_guess: TextGuess | None = None
    a = _Answer()
    n = 0
    while n < max_tokens:
        logits, hidden = edge.next()
        proposed = int(np.argmax(logits))
        guess, text_guess = text_guess, None
        if guess is not None:  # the cloud's guess decides this position, not the router
            step = rule.step(None, guess.for_tokens(edge.model.token_bytes, edge.model.is_eog), proposed)
            rule.written(proposed)
            if step is Step.GUESS_TAKE:
                a.guessed += 1
                if not guess.best:
                    break  # the cloud's guess ends the answer
                n += _take_cloud_text(a, edge, guess.best, max_tokens - n)
                continue
        else:
            score = router.score(hidden, logits, proposed) if router is not None else 0.0
            a.scores.append(score)
            if also is not None:
                a.also.append(also.score(hidden, logits, proposed))
            hard = always or (
                engine is not None and engine_tier(engine, at, n, proposed, score, hidden, logits) != DEVICE
            )
            if hard and complete_utf8(a.text) == len(a.text):
                span, eog = _cloud_span(cloud, a.text, edge.model.token_bytes(proposed), sampler)
                n += _take_cloud_text(a, edge, cloud.view.join(a.text, span)[len(a.text) :], max_tokens - n)
                if eog:
                    break
                rule.written(proposed, cloud_answered=True)
                if rule.guess_due and n < max_tokens:
                    text_guess = _cloud_guess(cloud, a.text)
                continue
            rule.written(proposed)
        if edge.model.is_eog(proposed):
            break
        edge.history.append(proposed)
        a.text += edge.model.token_bytes(proposed)
        n += 1
    a.text = a.text[: complete_utf8(a.text)]
    if engine is not None or always:  # a session with the cloud: its prompt prefilled at hello, then what it decoded
        a.passes, a.tokens = 1 + cloud.passes - passes0, len(cprompt) + cloud.tokens - tokens0
    return a


def evaluate_text(
    prompts: list[str], opts: TextEvalOptions, on_progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """The mixed pair's curve: per method and target fraction, the achieved share of cloud bytes
    and the cloud model's NLL per byte; the gap recovered at 30% cloud bytes (module docstring)."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    t0 = time.perf_counter()
    edge_info, cloud_info = model_info(opts.edge_model), model_info(opts.cloud_model)
    learned: LearnedRouter | None = None
    if opts.router is not None:  # refuses a router trained for another device or cloud model
        learned = load_router(opts.router, edge_info, cloud=cloud_info)
    runs = _text_runs(opts, learned is not None)
    em, cm = LlamaModel(edge_info), LlamaModel(cloud_info)
    edge = TextSide(em, 2048, opts.threads, embeddings=True)
    cloud = TextSide(cm, 2048, opts.threads, embeddings=False)
    try:
        messages = [
            [{"role": "system", "content": opts.system_prompt}, {"role": "user", "content": p}] for p in prompts
        ]
        pair = _Pair(edge, cloud, [em.chat_tokens(m) for m in messages], [cm.chat_tokens(m) for m in messages])
        answers = _answer_all(pair, runs, learned, opts, on_progress)
        points, per_prompt = _points(pair, prompts, answers)
    finally:
        edge.close()
        cloud.close()
        em.close()
        cm.close()
    methods = [name for name, _, _ in runs]
    result = {
        "mode": "text",
        "measure": "cloud model NLL per byte of the answer text (lower is better)",
        "edge_model": edge_info.name,
        "cloud_model": cloud_info.name,
        "decision_engine": opts.decision_engine,
        "n_prompts": len(prompts),
        "max_tokens": opts.max_tokens,
        "points": points,
        "gap_recovered_at_30_bytes": _gap_at_30(points, methods),
        "pareto_front": [  # NLL per byte against the work model's GPU-seconds per 1k answer bytes, every point
            {"method": m, "target": f, "gpu_s_per_1k_bytes": cost, "nll_per_byte": nll}
            for cost, nll, m, f in pareto_front(
                {(m, p["target"]): (p["gpu_s_per_1k_bytes"], p["nll_per_byte"]) for m, ps in points.items() for p in ps}
            )
        ],
        "gap_recovered_at_30_bytes_ci95": gap_interval(per_prompt, methods, seed=opts.seed),
        "router": str(opts.router) if learned is not None else None,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if opts.keep_answers:
        result["answers"] = [
            {"method": method, "target_fraction": f, "prompt": p, "text": a.text.decode("utf-8", "replace")}
            for (method, f), got in answers.items()
            for p, a in zip(prompts, got)
        ]
    return result


@dataclass(slots=True)
class _Pair:
    """The two models, each with its own tokens of every prompt."""

    edge: TextSide
    cloud: TextSide
    eprompts: list[list[int]]
    cprompts: list[list[int]]


def _text_runs(opts: TextEvalOptions, have_learned: bool) -> list[tuple[str, str, float | None]]:
    """(name, method, lookahead nats or None) for every routed curve the options ask for."""
    methods = [m for m in TEXT_METHODS if m != "learned" or have_learned]
    for m in opts.lookahead:
        if m not in methods:
            raise ValueError(f"--lookahead {m}: choose one of {', '.join(methods)}")
    return [(m, m, None) for m in methods] + [
        (f"{m}+lookahead@{opts.lookahead_nats:g}", m, opts.lookahead_nats) for m in opts.lookahead
    ]


def _answer_all(
    pair: _Pair,
    runs: list[tuple[str, str, float | None]],
    learned: LearnedRouter | None,
    opts: TextEvalOptions,
    on_progress: Callable[[int], None] | None,
) -> dict[tuple[str, float], list[_Answer]]:
    """Every prompt's answer, per (method, target fraction): edge-only and cloud-only first, then each
    run at thresholds set at quantiles of its scores along the edge-only answers (one rule for all)."""
    prompts = list(zip(pair.eprompts, pair.cprompts))
    entropy = HeuristicRouter("entropy", pair.edge.model.n_vocab)
    answers: dict[tuple[str, float], list[_Answer]] = {}
    answers[("edge-only", 0.0)] = [
        _routed(pair.edge, pair.cloud, e, c, entropy, None, opts.max_tokens, also=learned) for e, c in prompts
    ]
    answers[("cloud-only", 1.0)] = [
        _routed(pair.edge, pair.cloud, e, c, None, None, opts.max_tokens, always=True) for e, c in prompts
    ]
    scores = np.array([s for a in answers[("edge-only", 0.0)] for s in a.scores])
    lscores = np.array([s for a in answers[("edge-only", 0.0)] for s in a.also])
    for f in opts.fractions:
        thresholds = {"entropy": float(np.quantile(scores, 1.0 - f)), "random": 1.0 - f}
        if learned is not None:
            thresholds["learned"] = float(np.quantile(lscores, 1.0 - f))
        for name, method, nats in runs:
            got = []
            for k, (e, c) in enumerate(prompts):
                router: Router
                if method == "learned" and learned is not None:
                    router = learned
                elif method == "entropy":
                    router = entropy
                else:
                    router = RandomRouter(seed=opts.seed * 100003 + k * 101 + int(f * 100))
                policy = RoutingPolicy(PolicyConfig("router", threshold=thresholds[method]))
                engine = build_engine(opts.decision_engine, EngineSetup(policy, {}, opts.edge_model, opts.cloud_model))
                got.append(_routed(pair.edge, pair.cloud, e, c, router, engine, opts.max_tokens, lookahead_nats=nats))
            answers[(name, f)] = got
        if on_progress is not None:
            on_progress(1)
    return answers


def _points(
    pair: _Pair, prompts: list[str], answers: dict[tuple[str, float], list[_Answer]]
) -> tuple[dict[str, list[dict[str, float]]], dict[tuple[str, float], np.ndarray]]:
    """Per method, a point per target fraction (each answer read by the cloud model), and the
    per-prompt table [3, prompts] (NLL, bytes, cloud bytes) the bootstrap resamples."""
    points: dict[str, list[dict[str, float]]] = {}
    per_prompt: dict[tuple[str, float], np.ndarray] = {}
    for (method, f), got in answers.items():
        table = np.zeros((3, len(got)))
        for k, (a, c) in enumerate(zip(got, pair.cprompts)):
            pair.cloud.start(c)
            table[:, k] = pair.cloud.nll(a.text), len(a.text), a.cloud_bytes
        per_prompt[(method, f)] = table
        nll, total, cbytes = table.sum(axis=1)
        points.setdefault(method, []).append(
            {
                "target": f,
                "cloud_bytes": round(cbytes / max(total, 1), 4),
                "nll_per_byte": round(nll / max(total, 1), 5),
                "bytes": int(total),
                "guesses_taken": int(sum(a.guessed for a in got)),
                "gpu_s_per_1k_bytes": round(
                    1000
                    * PRODUCTION_CLOUD.gpu_seconds(sum(a.passes for a in got), sum(a.tokens for a in got))
                    / max(total, 1),
                    3,
                ),
                **person_counts((p, a.text.decode("utf-8", "replace")) for p, a in zip(prompts, got)),
            }
        )
    return points, per_prompt


def _gap_at_30(points: dict[str, list[dict[str, float]]], methods: list[str]) -> dict[str, float]:
    """Per method, (edge-only - method) / (edge-only - cloud-only) at 30% cloud bytes, interpolated."""
    e0, c1 = points["edge-only"][0]["nll_per_byte"], points["cloud-only"][0]["nll_per_byte"]
    gap = {}
    for method in methods:
        curve = sorted([(0.0, e0)] + [(p["cloud_bytes"], p["nll_per_byte"]) for p in points[method]] + [(1.0, c1)])
        at30 = float(np.interp(0.3, [x for x, _ in curve], [y for _, y in curve]))
        gap[method] = round((e0 - at30) / (e0 - c1), 4) if e0 != c1 else float("nan")
    return gap
