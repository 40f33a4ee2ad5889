"""Test helpers: build generators against real servers, and reference decodes without any routing code."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cloud_server.local import LocalCloudServer
from edge_client.answer import Answer
from edge_client.cloud_link import CloudLink
from edge_client.generator import RoutedGenerator
from edge_client.options import GeneratorOptions
from edge_client.turn import Turn
from edge_client.writer import AnswerWriter
from shared.decision import TIE_NATS, AnswerRule, ClauseEnds, OverruledShare
from shared.decision_engine import Position
from shared.kernel_noise import KERNEL_NOISE_NATS
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel
from shared.model_info import ModelInfo
from shared.policy import RoutingPolicy
from shared.protocol import PROTOCOL_VERSION, Hello
from shared.router import HeuristicRouter, Router
from shared.sampling import Sampler
from tests.conftest import ROOT, chat


def ask_cli(question: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`tokenrouter-edge ask QUESTION --json FLAGS...` as a user runs it (a child process)."""
    return subprocess.run(
        [sys.executable, "-m", "edge_client.cli", "ask", question, "--json", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def get(url: str) -> str:
    """The body of a GET on the test server's HTTP side (health, metrics, info)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def sessions(server: LocalCloudServer) -> int:
    """How many sessions the server holds, as /healthz reports them."""
    return json.loads(get(server.http_url + "/healthz"))["sessions"]


def metric(server: LocalCloudServer, prefix: str) -> float:
    """The first /metrics sample whose line starts with `prefix` (0 when absent)."""
    lines = [ln for ln in get(server.http_url + "/metrics").splitlines() if ln.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def hello(info: ModelInfo, api_key: str, question: str = "say hi", **fields: Any) -> Hello:
    """A device's first message for `info`'s model, asking `question`; `fields` set any other
    Hello field (version, tokenizer, text_mode, ...)."""
    return Hello(
        **{
            "version": PROTOCOL_VERSION,
            "api_key": api_key,
            "edge_model": info.fingerprint,
            "tokenizer": info.tokenizer_fingerprint,
            "messages": chat(question),
            **fields,
        }
    )


def hello_json(info: ModelInfo, api_key: str, question: str = "say hi", /, **fields: Any) -> str:
    """`hello` as the raw JSON frame, for tests that send what no `Hello` would hold (bad field
    values, unknown fields): `fields` are written as they are and override the defaults
    (`api_key=` too: the parameters before `/` are positional-only)."""
    return json.dumps(
        {
            "type": "hello",
            "version": PROTOCOL_VERSION,
            "api_key": api_key,
            "edge_model": info.fingerprint,
            "tokenizer": info.tokenizer_fingerprint,
            "messages": chat(question),
            **fields,
        }
    )


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, poll_s: float = 0.05) -> Any:
    """Poll `cond` until it returns something truthy or `timeout` passes; returns its last value
    (so `assert wait_for(...)` fails when time runs out)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    return cond()


def make_generator(
    edge: LlamaModel,
    server: LocalCloudServer | None,
    mode: str = "router",
    threshold: float = 0.5,
    router: Router | None = None,
    sync_every: int = 4,
    warmup: int = 0,
    hysteresis: float = 0.0,
    timeout_s: float = 5.0,
    url: str | None = None,
    policy: RoutingPolicy | None = None,
    tiers: Sequence[LocalCloudServer] = (),
    **options: object,
) -> RoutedGenerator:
    """A generator against `server` (None: device only) with a fixed-threshold policy, greedy,
    and neither lookahead nor the check unless `options` (GeneratorOptions fields) ask for them; `tiers`:
    servers of the tiers above `server` (a pool). A base model (the Gemma stand-in) may write: the
    refusal without `allow_base_model` is tested in test_base_models.py."""
    connect = None
    if server is not None:
        target = url or server.url
        connect = lambda: CloudLink(target, server.api_key, timeout_s=timeout_s)  # noqa: E731
    opts = GeneratorOptions(
        policy=mode,
        threshold=threshold,
        cloud_fraction=None,
        warmup=warmup,
        hysteresis=hysteresis,
        sync_every=sync_every,
        lookahead=False,
        check="off",
        cloud_timeout_s=timeout_s,
        allow_base_model=True,
        tiers=tuple(f"local:{t.model}" for t in tiers),  # as the CLI names them (each tier's shipped router)
    )
    opts = replace(opts, **options)  # type: ignore[arg-type]
    policy = policy or RoutingPolicy(opts.policy_config())
    tier_connects = [lambda t=t: CloudLink(t.url, t.api_key, timeout_s=timeout_s) for t in tiers]
    return RoutedGenerator(
        edge,
        opts,
        connect,
        router=router or HeuristicRouter("entropy", edge.n_vocab),
        policy=policy,
        tier_connects=tier_connects,
    )


def make_turn(gen: RoutedGenerator, prompt: list[int], messages: list[dict] | None = None) -> Turn:
    """A Turn as RoutedGenerator._generate builds it, for driving its parts directly (the text
    history's `take_text`, the alignment of the pool's sessions)."""
    edge = gen.edge
    return Turn(
        model=edge,
        decoder=gen.decoder,
        router=gen.router,
        policy=gen.policy,
        engine=gen.engine,
        rule=AnswerRule(gen.opts.rule(), ClauseEnds(edge.token_bytes, edge.is_eog)),
        cloud=gen.cloud,
        sampler=Sampler(gen.opts.sampling()),
        opts=gen.opts,
        out=AnswerWriter(edge, Answer(policy="router"), len(prompt)),
        clause_ends=ClauseEnds(edge.token_bytes, edge.is_eog),
        overruled=OverruledShare(),
        max_tokens=64,
        text=gen.answer_text,
        prompt_len=len(prompt),
        tiers=gen.tiers,
        messages=messages or [],
    )


@contextlib.contextmanager
def model_alone(info: ModelInfo, messages: list[dict]) -> Iterator[tuple[LlamaModel, LlamaContext, int]]:
    """A model on its own context with the chat prompt decoded (its last token on its own, as in
    token-by-token generation): yields (model, context, prompt length); logits(0) is then the
    first answer position's."""
    model = LlamaModel(info)
    ctx = LlamaContext(model, n_ctx=2048, embeddings=False)
    try:
        prompt = model.chat_tokens(messages)
        ctx.decode([DecodeItem(0, 0, prompt[:-1])])
        ctx.decode_one(0, len(prompt) - 1, prompt[-1])
        yield model, ctx, len(prompt)
    finally:
        ctx.close()
        model.close()


def reference_greedy(info: ModelInfo, messages: list[dict], max_tokens: int, prefix: list[int] = ()) -> list[int]:
    """Greedy decode straight on llama.cpp, token by token, as a model runs alone: the answer to
    `messages`, or its continuation after the answer tokens `prefix` (returned with them)."""
    with model_alone(info, messages) as (model, ctx, pos):
        for token in prefix:
            ctx.decode_one(0, pos, token)
            pos += 1
        out: list[int] = list(prefix)
        while len(out) < max_tokens:
            token = int(np.argmax(ctx.logits(0)))
            out.append(token)
            if model.is_eog(token):
                break
            ctx.decode_one(0, pos, token)
            pos += 1
        return out


def teacher_forced_logits(info: ModelInfo, messages: list[dict], answer: list[int]) -> list[np.ndarray]:
    """The model's logits at every position of `answer`, reading the answer's own tokens
    (teacher forcing), one decode per token as a model runs alone."""
    with model_alone(info, messages) as (_, ctx, start):
        out: list[np.ndarray] = []
        for pos, token in enumerate(answer, start=start):
            out.append(ctx.logits(0).copy())
            ctx.decode_one(0, pos, token)
        return out


def is_greedy_choice(logits: np.ndarray, token: int, tie: float = TIE_NATS + KERNEL_NOISE_NATS) -> bool:
    """`token` is the argmax of `logits`, or within `tie` of it: a token within TIE_NATS of the
    best counts as the model's own choice (shared/decision.py), and llama.cpp's kernels are not
    batch-invariant, so teacher forcing here reads a margin up to KERNEL_NOISE_NATS off the one
    the deciding side saw (shared/kernel_noise.py)."""
    return bool(logits[token] >= logits.max() - tie)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one ending counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agree_up_to_a_tie(
    info: ModelInfo, messages: list[dict], a: list[int], b: list[int], tie: float = KERNEL_NOISE_NATS
) -> bool:
    """Two answers of one model's choosing are the same, or first differ where that model (run
    alone, teacher-forced) finds both tokens within `tie` nats of its best: a near-tie that
    llama.cpp's batch-dependent kernels may break either way, after which the answers go apart."""
    i = first_difference(a, b)
    if i is None:
        return True
    if i >= min(len(a), len(b)):
        return False
    return both_near_best(info, messages, a[: i + 1], b[i], tie)


def both_near_best(info: ModelInfo, messages: list[dict], answer: list[int], other: int, tie: float) -> bool:
    """At the last position of `answer` the model (run alone, teacher-forced) finds both that
    position's token and `other` within `tie` nats of its best: a near-tie."""
    logits = teacher_forced_logits(info, messages, answer)[-1]
    return is_greedy_choice(logits, answer[-1], tie) and is_greedy_choice(logits, other, tie)


def follow_reference(
    info: ModelInfo, messages: list[dict], reference: list[int], served: list[int], tie: float = KERNEL_NOISE_NATS
) -> list[int]:
    """Check an answer a server wrote so far (`served`) against the model's own greedy `reference`,
    and return the reference to check its next tokens against.

    `served` must be the reference's start, or depart from it only at a near-tie
    (`agree_up_to_a_tie`): another engine (batched kernels, another CPU) may break a tie the
    other way, and from there both are right but different. Then the reference becomes `served`
    and the model's greedy continuation after it, as long as before."""
    want = reference[: len(served)]
    assert agree_up_to_a_tie(info, messages, served, want, tie), ("not a near-tie", served, want)
    if served == want:
        return reference
    return reference_greedy(info, messages, max(len(reference), len(served)), prefix=served)


def text_agrees_up_to_a_tie(
    info: ModelInfo,
    model: LlamaModel,
    messages: list[dict],
    answer: list[int],
    text: bytes,
    tie: float = KERNEL_NOISE_NATS,
) -> bool:
    """`text` spells `answer` (that model's greedy tokens), or departs from it where the model (run
    alone, teacher-forced) finds both its token and the text's own next token (the model's
    tokenization of the rest) within `tie` nats of its best: `agree_up_to_a_tie` for an answer
    that came back as text (a mixed pair shares text, not tokens). A text that stops inside the
    answer does not agree."""
    done = b""
    for i, token in enumerate(answer):
        piece = model.token_bytes(token)
        if text.startswith(done + piece):
            done += piece
            continue
        rest = text[len(done) :]
        if not rest:
            return False  # the text ended inside the answer
        other = model.tokenize(rest.decode("utf-8", errors="replace"), parse_special=False)[0]
        return both_near_best(info, messages, answer[: i + 1], other, tie)
    return text == done


def departs_where_the_text_retokenizes(model: LlamaModel, answer: list[int], text: bytes, within: int = 3) -> bool:
    """`text` departs from `answer` (a model's own tokens) within `within` tokens after the answer's tokens
    stop being what the tokenizer makes of their bytes (".", "\n", "\n" for ".\n\n"): a side that
    shares text, not tokens, reads a different context from there (text mode's seam), so both
    continuations are that model's own choices."""
    done, i = b"", 0
    while i < len(answer) and text.startswith(done + model.token_bytes(answer[i])):
        done += model.token_bytes(answer[i])
        i += 1
    if i == len(answer):
        return False  # no departure
    own = model.tokenize(done.decode("utf-8", errors="replace"), add_special=False, parse_special=False)
    k = first_difference(own, answer[:i])
    return k is not None and i - k <= within


def ask_json(*args: str, env: dict[str, str] | None = None) -> dict:
    """`tokenrouter-edge ask ... --json` as a user runs it (a child process): its answer object."""
    out = subprocess.run(
        [sys.executable, "-m", "edge_client.cli", "ask", *args, "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


class StandInEngine:
    """A stand-in decision engine whose tier depends only on the position's index (`choose`): for tests
    that need a decision no router gives on every CPU (an installed engine is tested in
    test_decision_engine.py)."""

    def __init__(self, name: str, choose: Callable[[int], int]) -> None:
        self.name = name
        self.choose = choose

    def start_answer(self) -> None:
        pass

    def decide(self, position: Position) -> int:
        return self.choose(position.index)
