"""`tokenrouter-train fit`: train the router MLP with torch and export a numpy router file.

Model: x = [standardised hidden state, standardised logit features] and a
learned 8-dim embedding of the proposed token's hash bucket -> Linear(H) ->
ReLU -> Linear(1) -> P(hard). Class-weighted BCE (positives weighted by
negatives / positives), Adam, early stopping on validation AUC.

Export folds the standardisation into the first layer and pre-multiplies the
token embedding into a [buckets, H] table, so the device needs no torch and
does one mat-vec per token. The calibration table (target cloud fraction ->
threshold) and the metrics are computed with the exported numpy router on the
validation positions, so what is recorded is what the device will do.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from models.train.features import LABELS, Inputs, auc, build_inputs, entropy_scores, targets
from models.train.shards import Records, load_records
from shared.learned_router import FORMAT_VERSION, LOGIT_FEATURES, LearnedRouter, RouterFile

log = logging.getLogger(__name__)

CALIBRATION_FRACTIONS = [round(0.01 * i, 2) for i in range(101)]
HIST_BINS = 20


@dataclass(slots=True)
class FitOptions:
    train: list[str]
    val: list[str] = field(default_factory=list)  # empty: hold out 15% of training prompts
    out: Path = Path("router.npz")
    label: str = "regret"  # the shipped router's label: docs/router.md, "Which label"; runs: docs/journal/router.md
    regret_nats: float = 1.0
    hidden_units: int = 32
    buckets: int = 1024
    token_dim: int = 8
    epochs: int = 80
    patience: int = 10
    lr: float = 1e-3
    weight_decay: float = 1e-3
    dropout: float = 0.3
    batch_size: int = 256
    seed: int = 0
    threads: int = 2
    early_stop: str = (
        "auc"  # "auc": validation AUC; "regret": share of validation regret captured, mean over 10-50% cloud
    )


def split_holdout(rec: Records, share: float, seed: int) -> tuple[Records, Records]:
    """Hold out whole prompts (live rows, which have no prompt, are split by row)."""
    rng = np.random.default_rng(seed)
    pid = rec["prompt_id"]
    prompts = np.unique(pid[pid >= 0])
    held = (
        set(rng.choice(prompts, size=max(1, int(len(prompts) * share)), replace=False).tolist())
        if len(prompts) > 1
        else set()
    )
    mask = np.isin(pid, list(held)) | ((pid < 0) & (rng.random(len(pid)) < share))
    return rec.subset(~mask), rec.subset(mask)


def fit(opts: FitOptions) -> dict[str, Any]:
    """Train, export to opts.out, and return the training report."""
    import torch

    if opts.label not in LABELS:
        raise ValueError(f"unknown label {opts.label!r}; choose one of {', '.join(LABELS)}")
    t_start = time.perf_counter()
    torch.manual_seed(opts.seed)
    torch.set_num_threads(opts.threads)
    train_rec, val_rec = _load_split(opts)
    feats = train_rec["logit_feats"]
    feat_means = (
        np.nan_to_num(np.nanmean(feats, axis=0)) if not np.isnan(feats).all() else np.zeros(feats.shape[1], np.float32)
    )
    tr = build_inputs(train_rec, opts.label, opts.buckets, feat_means, opts.regret_nats)
    va = build_inputs(val_rec, opts.label, opts.buckets, feat_means, opts.regret_nats)
    mean = tr.x.mean(axis=0)
    std = tr.x.std(axis=0) + 1e-4

    net = _Net(tr.x.shape[1], opts.hidden_units, opts.buckets, opts.token_dim, opts.dropout)
    best_epoch, history = _train(net, tr, va, val_rec, mean, std, opts)
    rf = _export(net, mean, std, train_rec, opts)
    metrics = _record_validation(rf, va, val_rec, opts)
    rf.save(opts.out)
    return {
        "router_file": str(opts.out),
        "size_bytes": Path(opts.out).stat().st_size,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "edge_model": rf.meta["edge_model"],
        "cloud_model": rf.meta["cloud_model"],
        "data": {
            "train_positions": len(train_rec),
            "val_positions": len(val_rec),
            "train_prompts": int(len(np.unique(train_rec["prompt_id"]))),
            "val_prompts": int(len(np.unique(val_rec["prompt_id"]))),
            "sources": train_rec.meta.get("sources", []),
            "train_rates": _rates(train_rec, opts),
            "val_rates": _rates(val_rec, opts),
        },
        "best_epoch": best_epoch,
        "epochs_run": len(history),
        "history": history,
        "metrics": metrics,
        "calibration": rf.meta["calibration"][::10],
        "fit_seconds": round(time.perf_counter() - t_start, 1),
    }


def _load_split(opts: FitOptions) -> tuple[Records, Records]:
    """The training and validation positions (validation: its own shards, else held-out prompts),
    refused when too few or all of one label to learn from."""
    train_rec = load_records(opts.train)
    if opts.val:
        val_rec = load_records(opts.val)
        if val_rec.meta.get("edge_fingerprint") != train_rec.meta.get("edge_fingerprint"):
            raise ValueError("validation shards come from a different edge model than the training shards")
    else:
        train_rec, val_rec = split_holdout(train_rec, 0.15, opts.seed)
    if len(train_rec) < 8 or len(val_rec) < 2:
        raise ValueError(
            f"too little data: {len(train_rec)} training and {len(val_rec)} validation positions; label more prompts"
        )
    y_train = targets(train_rec, opts.label, opts.regret_nats)
    if y_train.min() == y_train.max():
        raise ValueError(
            f"every training position has the same {opts.label} label; label more (or more varied) prompts"
        )
    return train_rec, val_rec


def _train(
    net: Any, tr: Inputs, va: Inputs, val_rec: Records, mean: np.ndarray, std: np.ndarray, opts: FitOptions
) -> tuple[int, list[dict[str, Any]]]:
    """Adam on class-weighted BCE, early-stopped on the validation criterion; leaves `net` holding
    the best epoch's weights. Returns that epoch and every epoch's figures."""
    import torch

    pos = float(tr.y.sum())
    weight = 1.0 if opts.label == "gain" else (len(tr.y) - pos) / max(pos, 1.0)  # "gain": the mean, unskewed
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(weight))
    optim = torch.optim.Adam(net.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    xt = torch.from_numpy((tr.x - mean) / std)
    bt, yt = torch.from_numpy(tr.bucket), torch.from_numpy(tr.y)
    xv, bv = torch.from_numpy((va.x - mean) / std), torch.from_numpy(va.bucket)
    best_score, best_state, best_epoch, stale, history = -1.0, None, 0, 0, []
    gen = torch.Generator().manual_seed(opts.seed)
    for epoch in range(opts.epochs):
        net.train()
        perm = torch.randperm(len(yt), generator=gen)
        total = 0.0
        for start in range(0, len(perm), opts.batch_size):
            idx = perm[start : start + opts.batch_size]
            optim.zero_grad()
            loss = loss_fn(net(xt[idx], bt[idx]), yt[idx])
            loss.backward()
            optim.step()
            total += loss.item() * len(idx)
        net.eval()
        with torch.no_grad():
            val_scores = torch.sigmoid(net(xv, bv)).numpy()
        if opts.label == "gain":  # a soft target: how close the scores come to it (minus the squared error)
            val_score = -float(np.mean((val_scores - va.y) ** 2))
        elif opts.early_stop == "auc":
            val_score = auc(val_scores, va.y)
        else:
            val_score = regret_captured(val_scores, val_rec)
        if np.isnan(val_score):  # one class only in validation: no ranking signal, keep the latest model
            val_score = 0.5
        history.append(
            {"epoch": epoch, "train_loss": round(total / len(perm), 5), f"val_{opts.early_stop}": round(val_score, 5)}
        )
        if val_score > best_score + 1e-4:
            best_score, best_epoch, stale = val_score, epoch, 0
            best_state = {k: v.clone() for k, v in net.state_dict().items()}
        else:
            stale += 1
            if stale >= opts.patience:
                break
    assert best_state is not None
    net.load_state_dict(best_state)
    return best_epoch, history


def _record_validation(rf: RouterFile, va: Inputs, val_rec: Records, opts: FitOptions) -> dict[str, Any]:
    """Score the validation positions with the exported numpy router (what the device will run) and
    record in the file its calibration tables, reference histogram, metrics and check block."""
    router = LearnedRouter(rf)
    val_scores = router.score_batch(va.x[:, : router.n_embd], va.x[:, router.n_embd :], val_rec["proposed"])
    metrics = evaluate_scores(val_scores, val_rec, opts.label, opts.regret_nats)
    rf.meta["calibration"] = metrics.pop("calibration")
    rf.meta["entropy_calibration"] = metrics.pop("entropy_calibration")
    rf.meta["reference_histogram"] = np.histogram(val_scores, bins=HIST_BINS, range=(0.0, 1.0))[0].tolist()
    rf.meta["metrics"] = metrics
    rf.meta["check"] = _check_block(val_rec, val_scores)
    return metrics


def position_regret(rec: Records) -> np.ndarray:
    """What routing each position would save on the cloud-NLL measure: its regret where the models
    disagree (unknown regret, e.g. live rows, counts as 0), else 0."""
    return np.where(rec["mismatch"].astype(bool), np.nan_to_num(rec["regret"]), 0.0)


def regret_captured(
    scores: np.ndarray, rec: Records, fractions: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5)
) -> float:
    """Mean over `fractions` of the share of all regret on these positions that routing the
    top-scored fraction would remove: the validation proxy of the cloud-NLL measure."""
    regret = position_regret(rec)
    total = max(float(regret.sum()), 1e-9)
    order = np.argsort(-scores, kind="stable")
    cum = np.concatenate([[0.0], np.cumsum(regret[order])])
    return float(np.mean([cum[int(round(f * len(scores)))] / total for f in fractions]))


def _rates(rec: Records, opts: FitOptions) -> dict[str, float]:
    """Label rates; with live explored rows, their mismatch apart: positions the device's engine kept,
    asked at random, so an unbiased rate of the cloud disagreeing where the device writes."""
    div, explored = rec["divergent"], rec["explored"] == 1
    rates = {
        "mismatch": round(float(rec["mismatch"].mean()), 4),
        "divergent": round(float((div[div >= 0] > 0).mean()), 4)
        if (div >= 0).any()
        else float("nan"),  # of the rows that have the label
        "target": round(float(targets(rec, opts.label, opts.regret_nats).mean()), 4),
    }
    if explored.any():
        rates |= {
            "explored_rows": int(explored.sum()),
            "explored_mismatch": round(float(rec["mismatch"][explored].mean()), 4),
        }
    return rates


def evaluate_scores(scores: np.ndarray, rec: Records, label: str, regret_nats: float) -> dict[str, Any]:
    """AUCs, and per target cloud fraction: the threshold and the recall of hard tokens it gives."""
    mismatch = rec["mismatch"].astype(bool)
    y = targets(rec, "regret" if label == "gain" else label, regret_nats).astype(bool)  # "gain": the clear gains
    div = targets(rec, "divergent").astype(bool)
    regret = position_regret(rec)
    ent = entropy_scores(rec)
    calibration, ent_calibration = [], []
    for f in CALIBRATION_FRACTIONS:
        for sc, table in ((scores, calibration), (ent, ent_calibration)):
            th = 1.0 if f == 0 else (0.0 if f == 1 else float(np.quantile(sc, 1.0 - f)))
            routed = sc >= th
            table.append(
                {
                    "cloud_fraction": f,
                    "threshold": round(th, 6),
                    "routed": round(float(routed.mean()), 4),
                    "recall_divergent": round(float(routed[div].mean()), 4) if div.any() else None,
                    "recall_mismatch": round(float(routed[mismatch].mean()), 4) if mismatch.any() else None,
                    "regret_captured": round(float(regret[routed].sum() / max(regret.sum(), 1e-9)), 4),
                }
            )
    # quantiles of a monotone map are monotone, but ties in float rounding must not break the table
    for table in (calibration, ent_calibration):
        for a, b in zip(table, table[1:]):
            b["threshold"] = min(b["threshold"], a["threshold"])
    return {
        "label": label,
        "auc": round(auc(scores, y), 4),
        "auc_divergent": round(auc(scores, div), 4),
        "auc_mismatch": round(auc(scores, mismatch), 4),
        "entropy_auc_divergent": round(auc(ent, div), 4),
        "entropy_auc_mismatch": round(auc(ent, mismatch), 4),
        "recall_divergent_at": {f"{int(r['cloud_fraction'] * 100)}%": r["recall_divergent"] for r in calibration[::10]},
        "entropy_recall_divergent_at": {
            f"{int(r['cloud_fraction'] * 100)}%": r["recall_divergent"] for r in ent_calibration[::10]
        },
        "calibration": calibration,
        "entropy_calibration": ent_calibration,
    }


def _check_block(rec: Records, scores: np.ndarray, n_prompts: int = 3) -> dict[str, Any]:
    """Per-prompt figures for the first validation prompts, so a test can re-label them and compare.

    On the cloud's path of one vocabulary each prompt's answer (the cloud's tokens) is recorded
    too, so the re-labelling can follow it (`LabelOptions.answers`) rather than the cloud's
    greedy answer on another CPU, which a near-tie can send elsewhere; and so are each
    position's mismatch and score, so that the test can excuse exactly the positions where this
    CPU's kernels may break a near-tie the other way and hold every other one strictly."""
    prompts = rec.meta.get("prompts", [])[:n_prompts]
    first = int(rec.meta.get("first_prompt_id", 0))
    cloud_path = rec.meta.get("path", "cloud") == "cloud" and "label_space" not in rec.meta
    out = []
    for k, text in enumerate(prompts):
        sel = rec["prompt_id"] == first + k
        block: dict[str, Any] = {
            "prompt": text,
            "n_positions": int(sel.sum()),
            "n_mismatch": int(rec["mismatch"][sel].sum()),
            "mean_score": round(float(scores[sel].mean()), 5) if sel.any() else None,
        }
        if cloud_path:
            order = np.argsort(rec["position"][sel], kind="stable")
            block["answer"] = [int(t) for t in rec["cloud_token"][sel][order]]
            block["mismatch"] = [int(m) for m in rec["mismatch"][sel][order]]
            block["scores"] = [round(float(x), 4) for x in scores[sel][order]]
        out.append(block)
    return {"prompts": out, "max_tokens": rec.meta.get("max_tokens"), "system_prompt": rec.meta.get("system_prompt")}


class _Net:
    """Built lazily so importing this module does not import torch."""

    def __new__(cls, d_in: int, hidden: int, buckets: int, token_dim: int, dropout: float):  # type: ignore[no-untyped-def]
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(buckets, token_dim)
                nn.init.normal_(self.emb.weight, std=0.1)
                self.drop = nn.Dropout(dropout)
                self.l1 = nn.Linear(d_in + token_dim, hidden)
                self.l2 = nn.Linear(hidden, 1)

            def forward(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                h = torch.relu(self.l1(torch.cat([self.drop(x), self.emb(b)], dim=1)))
                return self.l2(h).squeeze(1)

        return Net()


def _export(net: Any, mean: np.ndarray, std: np.ndarray, rec: Records, opts: FitOptions) -> RouterFile:
    w1 = net.l1.weight.detach().numpy().astype(np.float64)
    b1 = net.l1.bias.detach().numpy().astype(np.float64)
    d = len(mean)
    w1x = w1[:, :d] / std  # W (x - m) / s = (W / s) x - (W / s) m
    b1f = b1 - w1x @ mean
    tok_table = net.emb.weight.detach().numpy().astype(np.float64) @ w1[:, d:].T
    meta = {
        "format_version": FORMAT_VERSION,
        "edge_model": rec.meta.get("edge_model"),
        "cloud_model": rec.meta.get("cloud_model"),
        "edge_fingerprint": rec.meta.get("edge_fingerprint"),
        "cloud_fingerprint": rec.meta.get("cloud_fingerprint"),
        "n_embd": int(rec.meta.get("n_embd", d - len(LOGIT_FEATURES))),
        "n_vocab": int(rec.meta.get("n_vocab", 1)),
        "logit_features": list(LOGIT_FEATURES),
        "feature_spec": {
            "inputs": ["hidden", "logit_features", "token_bucket"],
            "buckets": opts.buckets,
            "hidden_units": opts.hidden_units,
        },
        "label": opts.label,
        "label_space": rec.meta.get("label_space", "tokens"),  # "text": a mixed pair's labels (text_label.py)
        "label_rule": rec.meta.get("label_rule"),
        "judge_model": rec.meta.get("judge_model"),  # a pool's tier: labels in its top model's unit (label --judge)
        "judge_fingerprint": rec.meta.get("judge_fingerprint"),
        "system_prompt": rec.meta.get("system_prompt"),
        "reference_histogram": [1] * HIST_BINS,  # replaced by the validation scores' histogram
    }
    return RouterFile(
        w1=w1x.astype(np.float32),
        b1=b1f.astype(np.float32),
        tok_table=tok_table.astype(np.float32),
        w2=net.l2.weight.detach().numpy()[0].astype(np.float32),
        b2=float(net.l2.bias.detach().numpy()[0]),
        meta=meta,
    )
