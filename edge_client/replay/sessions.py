"""Sessions to replay: CLINC150 queries, or the user's own multi-turn JSONL.

CLINC150 (Larson et al., 2019; CC BY 3.0) gives short, real assistant
queries; each becomes a one-turn session. A JSONL file gives one session per
line:

    {"id": "s1", "turns": ["set a timer", {"text": "make it ten minutes"}], "light_mode": false}
    {"id": "s2", "turns": [{"wav": "audio/q1.wav"}]}

Sampling is seeded, so `--limit N --seed S` always picks the same sessions.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

CLINC150_PATH = Path("/work/shared/datasets/clinc150/data_full.json")
CLINC_SPLITS = ("train", "val", "test", "oos_train", "oos_val", "oos_test")
LIGHT_MODE_PHRASE = "light mode"


class SessionError(ValueError):
    """A session source that cannot be read; the message says what to fix."""


@dataclass(slots=True)
class Turn:
    text: str | None = None
    wav: str | None = None  # a spoken turn (audio mode)


@dataclass(slots=True)
class Session:
    id: str
    turns: list[Turn]
    light_mode: bool = False  # the `session` policy keeps such a conversation on the device
    meta: dict = field(default_factory=dict)

    @property
    def wants_light_mode(self) -> bool:
        return self.light_mode or any(LIGHT_MODE_PHRASE in (t.text or "").lower() for t in self.turns)


def clinc_sessions(
    split: str = "val", limit: int | None = None, seed: int = 0, path: Path = CLINC150_PATH
) -> list[Session]:
    if split not in CLINC_SPLITS:
        raise SessionError(f"unknown CLINC150 split {split!r}; choose one of {', '.join(CLINC_SPLITS)}")
    if not path.is_file():
        raise SessionError(f"CLINC150 not found at {path}; pass --sessions FILE.jsonl with your own sessions")
    rows = json.loads(path.read_text())[split]
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    if limit is not None:
        order = order[:limit]
    return [Session(id=f"clinc-{split}-{i}", turns=[Turn(text=rows[i][0])], meta={"intent": rows[i][1]}) for i in order]


def jsonl_sessions(path: Path, limit: int | None = None) -> list[Session]:
    if not path.is_file():
        raise SessionError(f"session file {path} does not exist")
    sessions: list[Session] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SessionError(f"{path}:{n}: not valid JSON ({exc})") from None
        sessions.append(_session(obj, f"{path}:{n}", path.parent, default_id=f"{path.stem}-{n}"))
        if limit is not None and len(sessions) >= limit:
            break
    if not sessions:
        raise SessionError(f"{path} holds no sessions")
    return sessions


def _session(obj: object, where: str, base: Path, default_id: str) -> Session:
    if not isinstance(obj, dict) or not isinstance(obj.get("turns"), list) or not obj["turns"]:
        raise SessionError(f'{where}: each line must be an object with a non-empty "turns" list')
    turns: list[Turn] = []
    for t in obj["turns"]:
        if isinstance(t, str):
            turns.append(Turn(text=t))
        elif isinstance(t, dict) and isinstance(t.get("text"), str):
            turns.append(Turn(text=t["text"]))
        elif isinstance(t, dict) and isinstance(t.get("wav"), str):
            wav = Path(t["wav"])
            turns.append(Turn(wav=str(wav if wav.is_absolute() else base / wav)))
        else:
            raise SessionError(f'{where}: a turn must be a string, {{"text": ...}} or {{"wav": ...}}')
    light = obj.get("light_mode", False)
    if not isinstance(light, bool):
        raise SessionError(f'{where}: "light_mode" must be true or false')
    return Session(id=str(obj.get("id", default_id)), turns=turns, light_mode=light)


def load_sessions(source: str, split: str = "val", limit: int | None = None, seed: int = 0) -> list[Session]:
    """`clinc150` (the default) or a path to a JSONL file of sessions."""
    if limit is not None and limit < 1:
        raise SessionError("--limit must be >= 1")
    if source == "clinc150":
        return clinc_sessions(split, limit, seed)
    return jsonl_sessions(Path(source), limit)
