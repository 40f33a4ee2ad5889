"""A router file's check block, re-labelled on this machine, and the near-ties that excuse a change.

A router file records figures for its first validation prompts (`fit._check_block`): each
prompt's answer, and per position whether the two models' greedy tokens differ (`mismatch`) and
the router's score. Re-labelling those prompts along the recorded answers on any machine must
give the same figures, except where this machine's kernels may break a near-tie the other way:
a position where either model's two best tokens are within the kernels' noise
(shared/kernel_noise.py, KERNEL_NOISE_NATS) of each other. `recheck` returns both, so the test
(tests/test_train.py) holds every other position strictly, and `tokenrouter-train recheck`
writes the block anew (weights unchanged) for a router file made before it recorded positions.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.registry import model_info
from models.train.label import LabelOptions, chat, label
from models.train.shards import load_records
from shared.kernel_noise import KERNEL_NOISE_NATS
from shared.learned_router import LOGIT_FEATURES, LearnedRouter, RouterFile
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel

_LOG_RATIO12 = LOGIT_FEATURES.index("log_ratio12")  # the edge's top-2 margin in nats


@dataclass
class PromptCheck:
    """One check prompt re-labelled here, in answer order."""

    prompt: str
    mismatch: np.ndarray  # int8 [n]: the models' greedy tokens differ
    scores: np.ndarray  # float32 [n]: the router's score
    near_tie: np.ndarray  # bool [n]: either model's top-2 margin is within the kernels' noise


def recheck(router_path: Path, edge_model: str, cloud_model: str, threads: int = 1) -> list[PromptCheck]:
    """Re-label `router_path`'s check prompts along their recorded answers and score them."""
    rf = RouterFile.load(router_path)
    check = rf.meta["check"]
    prompts = [c["prompt"] for c in check["prompts"]]
    answers = [c["answer"] for c in check["prompts"]]
    with tempfile.TemporaryDirectory(prefix="recheck-") as work:
        label(
            prompts,
            LabelOptions(
                edge_model,
                cloud_model,
                Path(work),
                max_tokens=check["max_tokens"],
                prompts_per_shard=len(prompts),
                threads=threads,
                progress=False,
                answers=answers,
                system_prompt=check["system_prompt"],
            ),
        )
        rec = load_records([Path(work)])
    scores = LearnedRouter(rf).score_batch(rec["hidden"], rec["logit_feats"], rec["proposed"])
    cloud_margins = _teacher_forced_margins(cloud_model, check["system_prompt"], prompts, answers)
    out = []
    for k, text in enumerate(prompts):
        sel = rec["prompt_id"] == k
        order = np.argsort(rec["position"][sel], kind="stable")
        edge_margin = rec["logit_feats"][sel][order, _LOG_RATIO12]
        # the edge's margin is read on the labelling path itself; the cloud's on a teacher-forced
        # one, which differs from the labelling path by up to the noise once more
        near = (edge_margin < KERNEL_NOISE_NATS) | (cloud_margins[k][: len(order)] < 2 * KERNEL_NOISE_NATS)
        out.append(PromptCheck(text, rec["mismatch"][sel][order], scores[sel][order], near))
    return out


def _teacher_forced_margins(model_name: str, system: str, prompts: list[str], answers: list[list[int]]):
    """Each prompt's top-2 logit margin at every answer position, one token at a time."""
    model = LlamaModel(model_info(model_name))
    ctx = LlamaContext(model, n_ctx=2048, embeddings=False)
    try:
        out = []
        for prompt, answer in zip(prompts, answers):
            tokens = chat(model, system, prompt)
            ctx.clear(0)
            ctx.decode([DecodeItem(0, 0, tokens[:-1])])
            ctx.decode_one(0, len(tokens) - 1, tokens[-1])
            margins = []
            for pos, token in enumerate(answer, start=len(tokens)):
                top2 = np.partition(ctx.logits(0), -2)[-2:]
                margins.append(float(top2[1] - top2[0]))
                ctx.decode_one(0, pos, token)
            out.append(np.array(margins))
        return out
    finally:
        ctx.close()
        model.close()


def rerecord(router_path: Path, out: Path, edge_model: str, cloud_model: str) -> dict[str, Any]:
    """Write `router_path` to `out` with its check block's per-prompt figures measured here
    (weights and every other field unchanged); returns the new block."""
    rf = RouterFile.load(router_path)
    checks = recheck(router_path, edge_model, cloud_model)
    for block, c in zip(rf.meta["check"]["prompts"], checks):
        block["n_mismatch"] = int(c.mismatch.sum())
        block["mean_score"] = round(float(c.scores.mean()), 5)
        block["mismatch"] = [int(m) for m in c.mismatch]
        block["scores"] = [round(float(x), 4) for x in c.scores]
    rf.save(out)
    return rf.meta["check"]
