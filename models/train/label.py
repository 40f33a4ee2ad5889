"""`tokenrouter-train label`: run both models over prompts and write labelled shards.

The cloud writes the reference answer greedily; the edge reads it (teacher
forcing). Both models step together over a batch of prompts (see pair.py). At
every answer position we record the edge's hidden state, logit features and
proposed (greedy) token, the cloud's token, and labels:

    mismatch   edge argmax != cloud token
    regret     cloud log p(cloud token) - cloud log p(edge token), in nats
    divergent  a mismatch that materially changes the answer:
               regret > REGRET_NATS (the cloud finds the edge's token at least
               ~20x less likely than its own), or exactly one of the two tokens
               ends the answer, or the cloud, continuing greedily for WINDOW
               tokens after the edge's token, re-uses less than half of its own
               reference continuation (LCS of the two windows / reference
               length < RECONVERGE).

The rollouts (one short greedy continuation per mismatch whose regret alone
does not decide) are batched across mismatches; they cost about WINDOW cloud
tokens per mismatch, i.e. roughly 2-3x the cost of the reference answers.
Labelling CLINC150 at 48 answer tokens runs at ~1-3 s per prompt on 2 cores.

Routed paths (`route_with`, DAgger-style): the cloud's path is not where the
router works. On the device an early edge-written token changes every later
position, so the router meets states it never saw in training. With a router
file given, each prompt is instead decoded as the generator would route it at
one of `route_fractions` (the router's calibrated threshold; the fraction
cycles over prompts), and every position visited is labelled the same way
(mismatch and regret against the cloud's token there). The divergence label
needs the cloud's own continuation as reference, which a routed path does not
have, so those rows carry -1 (unknown), like live flywheel rows.

Recorded answers (`answers`, one token list per prompt): both models read those
tokens instead of the cloud's greedy ones, so a re-labelling visits the same
positions as the recording did. A router file records its check prompts'
answers for that: llama.cpp's kernels differ between CPUs, and a near-tie the
cloud breaks the other way would send its greedy answer elsewhere (one prompt
went from 27 positions to 12 on a Zen 3 VM). The labels still compare the
edge's token with the cloud's argmax at each position.

A mixed pair (the two models' tokenizers differ): the answer is shared as text,
so the labels are the cloud model's NLL of the text at each device position
(text_label.py, the one module for that rule), in the same shard columns; the
cloud's path only (no `route_with`), no divergence rollouts (divergent -1).

A tier of a pool (`judge`, the pool's top model): its labels are in the judge's
unit, so that every tier's router predicts the same thing (the tier's gain in the
judge's NLL of the text; fit them with `--label gain`): the text rule again, on
the judge's path, comparing the device's token with the tier's (text_label.py,
"Judged by the top tier").
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from models.registry import model_info
from models.train.pair import PairStepper
from models.train.shards import COLUMNS, OPTIONAL, make_records, read_shard, write_shard
from models.train.text_label import LABEL_RULE, LABEL_SPACE, TextLabeller
from shared.learned_router import LearnedRouter, LogitFeaturizer, load_router
from shared.llama_backend import LlamaModel
from shared.prompting import DEFAULT_SYSTEM_PROMPT
from shared.textmetrics import lcs_len

log = logging.getLogger(__name__)

REGRET_NATS = 3.0
WINDOW = 8
RECONVERGE = 0.5


@dataclass(slots=True)
class LabelOptions:
    edge_model: str
    cloud_model: str
    out_dir: Path
    max_tokens: int = 48
    prompts_per_shard: int = 8  # also the batch: prompts stepped together
    window: int = WINDOW
    regret_nats: float = REGRET_NATS
    reconverge: float = RECONVERGE
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    threads: int | None = 1  # one llama.cpp thread: a second one's barriers collapse throughput on a shared machine
    progress: bool = True
    route_with: Path | None = None  # a router file: label the paths it routes (see the module docstring)
    route_fractions: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5)
    answers: list[list[int]] | None = None  # one recorded answer per prompt: follow it (see the module docstring)
    judge: str | None = None  # a pool's top model: its path and its NLL of the text judge this tier (a pool's labels)


def chat(model: LlamaModel, system: str, prompt: str) -> list[int]:
    return model.chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": prompt}])


def is_divergent(
    edge_tok: int,
    cloud_tok: int,
    regret: float,
    alt: list[int],
    ref: list[int],
    is_eog: Callable[[int], bool],
    opts: LabelOptions,
) -> bool:
    """The divergence rule (see the module docstring)."""
    if edge_tok == cloud_tok:
        return False
    if regret > opts.regret_nats or is_eog(edge_tok) != is_eog(cloud_tok):
        return True
    if not ref:
        return False
    return lcs_len(alt, ref) / len(ref) < opts.reconverge


def label(prompts: list[str], opts: LabelOptions) -> list[Path]:
    """Label `prompts` into shards of `prompts_per_shard` prompts; existing shards are kept (resume)."""
    edge_info, cloud_info = model_info(opts.edge_model), model_info(opts.cloud_model)
    judge_name = opts.judge if opts.judge != opts.cloud_model else None  # a cloud judging itself: a plain pair
    mixed = judge_name is not None or edge_info.tokenizer_fingerprint != cloud_info.tokenizer_fingerprint
    if mixed and opts.route_with is not None:
        raise ValueError(
            "--routed-by needs one vocabulary; a mixed pair or a judged tier is labelled along the cloud's path only"
        )
    if opts.answers is not None and (mixed or opts.route_with is not None or len(opts.answers) != len(prompts)):
        raise ValueError("recorded answers need one vocabulary, the cloud's path and one answer per prompt")
    router, routed_by = None, None
    if opts.route_with is not None:
        router = load_router(opts.route_with, edge_info)
        sha = hashlib.sha256(Path(opts.route_with).read_bytes()).hexdigest()[:16]
        routed_by = {"router": str(opts.route_with), "router_sha256": sha, "fractions": list(opts.route_fractions)}
    per = opts.prompts_per_shard
    n_shards = (len(prompts) + per - 1) // per
    paths = [opts.out_dir / f"shard-{i:05d}.npz" for i in range(n_shards)]
    todo = [i for i, p in enumerate(paths) if not p.is_file()]
    if len(todo) < len(paths):  # resuming: the finished shards must have followed the same paths
        old = read_shard(next(p for p in paths if p.is_file())).meta
        if old.get("routed_by", {}).get("router_sha256") != (routed_by or {}).get("router_sha256"):
            raise ValueError(
                f"{opts.out_dir} holds shards labelled along other paths ({old.get('path', 'cloud')}"
                f"{', router ' + old['routed_by']['router'] if 'routed_by' in old else ''}); use another --out or delete them"
            )
    edge, cloud = LlamaModel(edge_info), LlamaModel(cloud_info)
    try:
        meta = {
            "source": "label",
            "edge_model": edge_info.name,
            "cloud_model": cloud_info.name,
            "edge_fingerprint": edge_info.fingerprint,
            "cloud_fingerprint": cloud_info.fingerprint,
            "n_embd": edge.n_embd,
            "n_vocab": edge.n_vocab,
            "max_tokens": opts.max_tokens,
            "label_rule": {"regret_nats": opts.regret_nats, "window": opts.window, "reconverge": opts.reconverge},
            "system_prompt": opts.system_prompt,
            "path": "cloud" if router is None else "routed",
        }
        if mixed:  # labels in the cloud model's (or the judge's) NLL of the text (text_label.py)
            meta["label_space"] = LABEL_SPACE
            meta["label_rule"] = {"rule": LABEL_RULE, "max_tokens": opts.max_tokens}
            judge = LlamaModel(model_info(judge_name)) if judge_name is not None else None
            if judge is not None:
                meta.update(judge_model=judge.info.name, judge_fingerprint=judge.info.fingerprint)
            try:
                return _label_text(prompts, opts, edge, cloud, paths, todo, meta, judge)
            finally:
                if judge is not None:
                    judge.close()
        if routed_by is not None:
            meta["routed_by"] = routed_by
        return _label_tokens(prompts, opts, edge, cloud, paths, todo, meta, router)
    finally:
        edge.close()
        cloud.close()


def _label_tokens(
    prompts: list[str],
    opts: LabelOptions,
    edge: LlamaModel,
    cloud: LlamaModel,
    paths: list[Path],
    todo: list[int],
    meta: dict,
    router: LearnedRouter | None,
) -> list[Path]:
    """One vocabulary: the pair decoded side by side, a batch of prompts per shard (_label_batch)."""
    per = opts.prompts_per_shard
    tokens = [chat(edge, opts.system_prompt, p) for p in prompts]
    longest = max((len(t) for t in tokens), default=1)
    n_ctx = per * (longest + opts.max_tokens + 2) + 64 * (opts.window + 4)
    stepper = PairStepper(edge, cloud, n_seq=per, n_ctx=n_ctx, threads=opts.threads, extra_cloud_seqs=64)

    def label_shard(i: int) -> dict[str, list]:
        forced = None if opts.answers is None else opts.answers[i * per : (i + 1) * per]
        return _label_batch(stepper, tokens[i * per : (i + 1) * per], i * per, opts, router, forced)

    try:
        return _write_shards(prompts, opts, paths, todo, meta, label_shard)
    finally:
        stepper.close()


def _label_text(
    prompts: list[str],
    opts: LabelOptions,
    edge: LlamaModel,
    cloud: LlamaModel,
    paths: list[Path],
    todo: list[int],
    meta: dict,
    judge: LlamaModel | None = None,
) -> list[Path]:
    """A mixed pair: each prompt labelled on text in the cloud's terms (text_label.py); with a
    `judge` (a pool's top model), the cloud is a tier compared with the device in the judge's terms."""
    per = opts.prompts_per_shard
    scorer = judge or cloud
    labeller = TextLabeller(edge, scorer, threads=opts.threads, proposer=cloud if judge is not None else None)

    def label_shard(i: int) -> dict[str, list]:
        rows: dict[str, list] = {c: [] for c in COLUMNS if c not in OPTIONAL}  # every position labelled: none explored
        for k, p in enumerate(prompts[i * per : (i + 1) * per]):
            eprompt, sprompt = chat(edge, opts.system_prompt, p), chat(scorer, opts.system_prompt, p)
            pprompt = chat(cloud, opts.system_prompt, p) if judge is not None else None
            got = labeller.label_prompt(eprompt, sprompt, i * per + k, opts.max_tokens, pprompt)
            for key, col in got.items():
                rows[key].extend(col)
        return rows

    try:
        return _write_shards(prompts, opts, paths, todo, meta, label_shard)
    finally:
        labeller.close()


def _write_shards(
    prompts: list[str],
    opts: LabelOptions,
    paths: list[Path],
    todo: list[int],
    meta: dict,
    label_shard: Callable[[int], dict[str, list]],
) -> list[Path]:
    """Label and write the shards not written yet (`todo`), one at a time: `label_shard(i)` gives
    shard i's columns. Each shard is written as soon as it is done, so a stopped run resumes."""
    per = opts.prompts_per_shard
    bar = _progress(len(todo) * per, opts.progress)
    try:
        for i in todo:
            chunk = prompts[i * per : (i + 1) * per]
            t0 = time.perf_counter()
            rows = label_shard(i)
            write_shard(paths[i], make_records(rows, dict(meta, prompts=chunk, first_prompt_id=i * per)))
            log.debug("shard %d: %d positions in %.1fs", i, len(rows["proposed"]), time.perf_counter() - t0)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return paths


def _label_batch(
    stepper: PairStepper,
    prompts: list[list[int]],
    first_id: int,
    opts: LabelOptions,
    router: LearnedRouter | None = None,
    forced: list[list[int]] | None = None,
) -> dict[str, list]:
    """Label one batch of prompts. Without a router the cloud's token is appended at every step
    (the cloud's path); with one, the token the router would let through (the routed path);
    with `forced` answers, theirs (a recorded path)."""
    featurize = LogitFeaturizer(stepper.edge.n_vocab)
    thresholds = (
        [
            router.threshold_for_fraction(opts.route_fractions[(first_id + k) % len(opts.route_fractions)])
            for k in range(len(prompts))
        ]
        if router
        else []
    )
    stepper.start([(p, [k]) for k, p in enumerate(prompts)])
    rows: dict[str, list] = {k: [] for k in COLUMNS if k not in OPTIONAL}
    answers: list[list[int]] = [[] for _ in prompts]
    where: list[list[int]] = [[] for _ in prompts]  # row index of each answer position
    for step in range(opts.max_tokens):
        chosen: dict[int, int] = {}
        for v in stepper.views():
            e = int(np.argmax(v.edge_logits))
            c = int(np.argmax(v.cloud_logits))
            regret = float(v.cloud_logits[c] - v.cloud_logits[e])  # log p(c) - log p(e): the normaliser cancels
            where[v.seq].append(len(rows["proposed"]))
            rows["hidden"].append(np.array(v.edge_hidden, dtype=np.float16))
            rows["logit_feats"].append(featurize(v.edge_logits, e).copy())
            rows["proposed"].append(e)
            rows["cloud_token"].append(c)
            rows["position"].append(step)
            rows["prompt_id"].append(first_id + v.seq)
            rows["mismatch"].append(int(e != c))
            rows["divergent"].append(0)
            rows["regret"].append(regret)
            token = c
            if router is not None:
                feats = rows["logit_feats"][-1]
                token = c if router.score_features(v.edge_hidden, feats, e) >= thresholds[v.seq] else e
                rows["divergent"][-1] = -1  # no cloud reference continuation on a routed path
            if forced is not None:
                token = forced[v.seq][step]
            answers[v.seq].append(token)
            if not stepper.cloud.is_eog(token) and (forced is None or step + 1 < len(forced[v.seq])):
                chosen[v.seq] = token
        if not chosen:
            break
        stepper.advance(chosen)
    if router is None:
        _label_divergence(stepper, prompts, answers, where, rows, opts)
    return rows


def _label_divergence(
    stepper: PairStepper,
    prompts: list[list[int]],
    answers: list[list[int]],
    where: list[list[int]],
    rows: dict[str, list],
    opts: LabelOptions,
) -> None:
    is_eog = stepper.cloud.is_eog
    pending: list[tuple[int, int, int]] = []  # (row, source seq, position in answer)
    for seq, answer in enumerate(answers):
        for j, r in enumerate(where[seq]):
            e, c, regret = rows["proposed"][r], rows["cloud_token"][r], rows["regret"][r]
            if e == c:
                continue
            ref = answer[j + 1 : j + 1 + opts.window]
            if regret > opts.regret_nats or is_eog(e) != is_eog(c) or not ref:  # decided without a rollout
                rows["divergent"][r] = int(is_divergent(e, c, regret, [], ref, is_eog, opts))
            else:
                pending.append((r, seq, j))
    per_batch = stepper.cctx.n_seq - stepper.n_seq
    for start in range(0, len(pending), per_batch):
        group = pending[start : start + per_batch]
        starts = [(seq, len(prompts[seq]) + j, rows["proposed"][r]) for r, seq, j in group]
        alts = stepper.cloud_rollouts(starts, opts.window, first_seq=stepper.n_seq)
        for (r, seq, j), alt in zip(group, alts):
            ref = answers[seq][j + 1 : j + 1 + opts.window]
            rows["divergent"][r] = int(
                is_divergent(rows["proposed"][r], rows["cloud_token"][r], rows["regret"][r], alt, ref, is_eog, opts)
            )


def _progress(total: int, enabled: bool):  # type: ignore[no-untyped-def]
    if not enabled or total == 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="prompt", desc="label")
