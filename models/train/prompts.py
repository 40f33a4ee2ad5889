"""Prompt sets for labelling and evaluation: CLINC150 splits or a text file (one prompt per line).

CLINC150 (Larson et al., 2019, CC BY 3.0) lives in ../shared/datasets/clinc150
(or $TOKENROUTER_CLINC). Queries are picked at an even stride through a split
so a small limit still covers many intents; `offset` shifts the stride so two
selections from one split (e.g. early-stopping prompts and evaluation
prompts from `val`) mostly differ (strides of different limits can still meet:
val:64 at offset 1 and val:40 at offset 0 share one query).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CLINC = REPO_ROOT.parent / "shared" / "datasets" / "clinc150" / "data_full.json"


def clinc_path() -> Path:
    return Path(os.environ.get("TOKENROUTER_CLINC", DEFAULT_CLINC))


@lru_cache(maxsize=2)
def _clinc(path: Path) -> dict[str, list]:
    if not path.is_file():
        raise FileNotFoundError(
            f"CLINC150 not found at {path}; set $TOKENROUTER_CLINC to data_full.json or pass --prompts FILE"
        )
    return json.loads(path.read_text())


def clinc_prompts(split: str, limit: int | None = None, offset: int = 0) -> list[str]:
    data = _clinc(clinc_path())
    if split not in data:
        raise ValueError(f"unknown CLINC150 split {split!r}; choose one of {', '.join(sorted(data))}")
    items = [q for q, _ in data[split]]
    if limit is None or limit >= len(items):
        return items[offset:] if offset else items
    stride = max(1, len(items) // limit)
    return items[offset % stride :: stride][:limit]


def file_prompts(path: str | Path) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {p} does not exist (expected one prompt per line)")
    prompts = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {p} holds no prompts")
    return prompts


def parse_split_spec(spec: str) -> tuple[str, int | None]:
    """ "train:240" -> ("train", 240); "val" -> ("val", None)."""
    name, _, n = spec.partition(":")
    if n and not n.isdigit():
        raise ValueError(f"bad split spec {spec!r}: use NAME or NAME:COUNT, e.g. train:240")
    return name, int(n) if n else None
