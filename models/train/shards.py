"""Training shards: compact, self-describing `.npz` files of per-position records.

One shard holds N positions:

    hidden       float16 [N, n_embd]   edge model's final hidden state
    logit_feats  float32 [N, F]        LOGIT_FEATURES (NaN where unknown, e.g. live traffic)
    proposed     int32   [N]           edge token
    cloud_token  int32   [N]           cloud token (the reference)
    position     int32   [N]           position within the answer (live: within the session's history)
    prompt_id    int32   [N]           index of the prompt in its labelling run (-1: live); load_records
                                       shifts each directory's ids past the previous one's
    mismatch     int8    [N]           proposed != cloud_token
    divergent    int8    [N]           1/0, or -1 when not labelled (live traffic, routed paths)
    regret       float32 [N]           cloud log p(cloud token) - log p(edge token), NaN if unknown
    explored     int8    [N]           live: 1 asked at random where the device's engine kept the position
                                       (exploration: an unbiased label), 0 sent up by the engine; -1 not
                                       applicable (offline labelling, every position) or not recorded
                                       (a shard older than the column)
    meta         JSON string           edge/cloud fingerprints, source, label rule

Live rows (the cloud's flywheel) also name where they came from, so that one client's rows can be
found and dropped (`drop_rows`, `tokenrouter-train drop-rows`); `fit` does not read them:

    key_digest   str     [N]           "sha256:<hex>" of the API key that sent the row (as the audit
                                       log and `tokenrouter-cloud hash-key` write it); "" unknown
    session_id   str     [N]           the cloud session that sent it; "" unknown

Both `tokenrouter-train label` and the cloud's flywheel write this format, so
`fit` reads either. Writes are atomic (temp file, then rename): a shard that
exists is complete, which is what makes labelling resumable.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.learned_router import N_LOGIT_FEATURES

COLUMNS = (
    "hidden",
    "logit_feats",
    "proposed",
    "cloud_token",
    "position",
    "prompt_id",
    "mismatch",
    "divergent",
    "regret",
    "explored",
)
OPTIONAL = {"explored": -1}  # columns a writer may leave out and older shards lack: their fill
_DTYPES = {
    "hidden": np.float16,
    "logit_feats": np.float32,
    "proposed": np.int32,
    "cloud_token": np.int32,
    "position": np.int32,
    "prompt_id": np.int32,
    "mismatch": np.int8,
    "divergent": np.int8,
    "regret": np.float32,
    "explored": np.int8,
}


ORIGIN = ("key_digest", "session_id")  # live rows' origin: read where present ("" where not), never concatenated


class ShardError(ValueError):
    """Shards that cannot be read or do not belong together."""


@dataclass(slots=True)
class Records:
    """Columns of many positions (one shard, or several concatenated)."""

    columns: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.columns["proposed"])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def subset(self, mask: np.ndarray) -> "Records":
        return Records({k: v[mask] for k, v in self.columns.items()}, dict(self.meta))

    @classmethod
    def empty(cls, n_embd: int, meta: dict[str, Any] | None = None) -> "Records":
        cols = {k: np.zeros((0,), dtype=_DTYPES[k]) for k in COLUMNS}
        cols["hidden"] = np.zeros((0, n_embd), dtype=np.float16)
        cols["logit_feats"] = np.zeros((0, N_LOGIT_FEATURES), dtype=np.float32)
        return cls(cols, meta or {})


def make_records(rows: dict[str, list | np.ndarray], meta: dict[str, Any]) -> Records:
    """Columns from lists, cast to the shard dtypes and checked for equal length; an OPTIONAL column left
    out is filled."""
    n = len(rows["proposed"])
    cols = {k: np.asarray(rows[k] if k in rows else np.full(n, OPTIONAL[k]), dtype=_DTYPES[k]) for k in COLUMNS}
    cols.update({k: np.asarray(rows[k], dtype=str) for k in ORIGIN if k in rows})
    bad = [k for k, v in cols.items() if len(v) != n]
    if bad:
        raise ShardError(f"columns {bad} do not have {n} rows")
    return Records(cols, meta)


def write_shard(path: Path, records: Records) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, meta=np.array(json.dumps(records.meta)), **records.columns)
    tmp.replace(path)


def read_shard(path: Path) -> Records:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            n = len(z["proposed"])
            cols = {
                k: z[k] if k in z.files or k not in OPTIONAL else np.full(n, OPTIONAL[k], _DTYPES[k]) for k in COLUMNS
            }
            cols.update({k: z[k] if k in z.files else np.full(n, "") for k in ORIGIN})
    except (OSError, KeyError, ValueError) as exc:
        raise ShardError(f"{path} is not a training shard ({exc})") from None
    return Records(cols, meta)


def drop_rows(sources: list[str | Path], key: str | None = None, session: str | None = None) -> tuple[int, int]:
    """Remove the rows of one key (a key or its "sha256:<hex>" digest) and/or one session from the shards in
    `sources`: each shard that held some is rewritten without them (atomically), or deleted when none are
    left. Returns (rows dropped, shards changed). Shards without origin columns hold no such rows."""
    if key is None and session is None:
        raise ShardError("name the rows to drop: a key (--key) or a session (--session)")
    digest = key if key is None or key.startswith("sha256:") else "sha256:" + hashlib.sha256(key.encode()).hexdigest()
    dropped = changed = 0
    for path in shard_paths(sources):
        records = read_shard(path)
        hit = np.ones(len(records), dtype=bool)
        if digest is not None:
            hit &= records["key_digest"] == digest
        if session is not None:
            hit &= records["session_id"] == session
        if not hit.any():
            continue
        if hit.all():
            path.unlink()
        else:
            write_shard(path, records.subset(~hit))
        dropped, changed = dropped + int(hit.sum()), changed + 1
    return dropped, changed


def shard_paths(sources: list[str | Path]) -> list[Path]:
    """Shard files from files and directories (directories: every *.npz inside, sorted)."""
    out: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            out += sorted(q for q in p.glob("*.npz") if not q.name.endswith(".tmp.npz"))
        elif p.is_file():
            out.append(p)
        else:
            raise ShardError(f"no shard file or directory at {p}")
    if not out:
        raise ShardError(f"no shards found in {', '.join(map(str, sources))}; run `tokenrouter-train label` first")
    return out


def load_records(sources: list[str | Path]) -> Records:
    """All shards from `sources`, concatenated; they must share the edge and cloud models."""
    parts = [read_shard(p) for p in shard_paths(sources)]
    first = parts[0].meta
    for p, r in zip(shard_paths(sources), parts):
        for key in ("edge_fingerprint", "cloud_fingerprint", "judge_fingerprint"):
            if r.meta.get(key) != first.get(key):
                raise ShardError(
                    f"{p} has {key} {r.meta.get(key)}, but other shards have {first.get(key)}: train one router per model pair"
                    " (and judge)"
                )
    # prompt ids count from 0 in every labelling run (one directory each): shift them apart, so that
    # prompts of two runs are never taken for one (the hold-out split, per-prompt counts)
    paths = shard_paths(sources)
    top: dict[Path, int] = {}
    for p, r in zip(paths, parts):
        ids = r.columns["prompt_id"]
        top[p.parent] = max(top.get(p.parent, -1), int(ids.max()) if len(ids) else -1)
    offset, start = {}, 0
    for d, hi in top.items():
        offset[d], start = start, start + hi + 1
    cols = {k: np.concatenate([r.columns[k] for r in parts]) for k in COLUMNS}
    ids = [
        np.where(r.columns["prompt_id"] >= 0, r.columns["prompt_id"] + offset[p.parent], -1)
        for p, r in zip(paths, parts)
    ]  # -1: live rows
    cols["prompt_id"] = np.concatenate(ids).astype(cols["prompt_id"].dtype)
    meta = dict(first)
    meta["sources"] = sorted({r.meta.get("source", "?") for r in parts})
    return Records(cols, meta)
