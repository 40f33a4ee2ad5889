"""Test helpers: build generators against real servers, and reference decodes without any routing code."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from cloud_server.local import LocalCloudServer
from edge_client.cloud_link import CloudLink
from edge_client.generator import RoutedGenerator
from models.registry import ModelInfo
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel
from shared.policy import PolicyConfig, RoutingPolicy
from shared.protocol import SamplingParams
from shared.router import HeuristicRouter, Router


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
) -> RoutedGenerator:
    connect = None
    if server is not None:
        target = url or server.url
        connect = lambda: CloudLink(target, server.api_key, timeout_s=timeout_s)  # noqa: E731
    policy = RoutingPolicy(PolicyConfig(mode, threshold=threshold, warmup=warmup, hysteresis=hysteresis))
    return RoutedGenerator(edge, router or HeuristicRouter("entropy", edge.n_vocab), policy, SamplingParams(), connect=connect, sync_every=sync_every)


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


def reference_greedy(info: ModelInfo, messages: list[dict], max_tokens: int) -> list[int]:
    """Greedy decode straight on llama.cpp, token by token, as a model runs alone."""
    with model_alone(info, messages) as (model, ctx, pos):
        out: list[int] = []
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


def is_greedy_choice(logits: np.ndarray, token: int, tie: float = 0.25) -> bool:
    """`token` is the argmax of `logits`, or within `tie` of it: llama.cpp's kernels are not
    batch-invariant, so a near-tie can fall either way depending on how the history was batched."""
    return bool(logits[token] >= logits.max() - tie)
