"""Questions a person would grade: plain voice-assistant requests with the words a right answer holds.

The likelihood measure (`tokenrouter-train eval`) said the default recovered 0.84 of the gap
between the device and the cloud; a reader found about 0.3. This set is the measure a reader
signs: each question (models/train/answers/questions.jsonl, written for this project) lists
groups of words, and a right answer holds a word of every group and trips none of the checks a
reader makes at a glance (models/train/person_check.py: it loops, says the question back,
recites the system prompt, speaks as the user, continues the transcript). Kinds: `fact`,
`unit`, `arith` (arithmetic), `howto` (steps) and `open` (requests with many right answers,
where the words are loose and reading decides).

The multi-turn sessions (answers/sessions.jsonl) mix follow-ups ("and what about italy"),
which must keep their context, with unrelated questions, which must not carry an earlier
answer's words.

Each file is split into `tune` (look at it, tune on it) and `test` (report on it, once):
tune and test alternate within each kind. A word group's alternatives match whole words,
case-insensitively, after hyphens become spaces and thousands separators go ("1,000" is
"1000"); a trailing `*` matches any ending ("minute*": "minutes").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.train.person_check import (
    continues_transcript,
    loops,
    recites_instructions,
    says_question_back,
    speaks_as_user,
)
from shared.prompting import DEFAULT_SYSTEM_PROMPT

ANSWERS_DIR = Path(__file__).with_name("answers")
SPLITS = ("tune", "test")
KINDS = ("fact", "unit", "arith", "howto", "open")


@dataclass(frozen=True)
class Question:
    question: str
    need: tuple[tuple[str, ...], ...]  # every group must be said, by one of its alternatives
    kind: str = "fact"
    split: str = "tune"
    follow_up: bool = False  # in a session: it needs the turns before it


@dataclass(frozen=True)
class Session:
    index: int
    split: str
    turns: tuple[Question, ...]


def _check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)} (or None for both), not {split!r}")


def _question(row: dict, where: str) -> Question:
    need = row.get("need")
    if not row.get("question") or not need or not all(isinstance(g, list) and g for g in need):
        raise ValueError(f"{where}: a row needs a question and non-empty word groups in `need`: {row}")
    return Question(
        question=row["question"],
        need=tuple(tuple(g) for g in need),
        kind=row.get("kind", "fact"),
        split=row.get("split", "tune"),
        follow_up=bool(row.get("follow_up", False)),
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_questions(split: str | None = None, path: Path | None = None) -> list[Question]:
    """The single questions of `split` (None: both), in file order."""
    _check_split(split)
    path = path or ANSWERS_DIR / "questions.jsonl"
    out = [_question(row, f"{path}:{i + 1}") for i, row in enumerate(_rows(path))]
    return [q for q in out if split is None or q.split == split]


def load_sessions(split: str | None = None, path: Path | None = None) -> list[Session]:
    """The multi-turn sessions of `split` (None: both), in file order."""
    _check_split(split)
    path = path or ANSWERS_DIR / "sessions.jsonl"
    out = []
    for i, row in enumerate(_rows(path)):
        turns = tuple(_question({**t, "split": row["split"]}, f"{path}:{i + 1}") for t in row["turns"])
        out.append(Session(int(row.get("session", i)), row["split"], turns))
    return [s for s in out if split is None or s.split == split]


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def normalise(text: str) -> str:
    """Lower case, hyphens as spaces, no thousands separators: what the word groups are matched in."""
    return _THOUSANDS.sub("", text.lower().replace("-", " "))


def _pattern(alternative: str) -> re.Pattern[str]:
    word = normalise(alternative)
    stem, star = (word[:-1], r"\w*") if word.endswith("*") else (word, "")
    return re.compile(r"(?<![\w])" + re.escape(stem) + star + r"(?![\w])")


def has_words(answer: str, need: tuple[tuple[str, ...], ...]) -> bool:
    """The answer says a word of every group."""
    text = normalise(answer)
    return all(any(_pattern(alt).search(text) for alt in group) for group in need)


def first_glance(question: str, answer: str, instructions: str = DEFAULT_SYSTEM_PROMPT) -> list[str]:
    """The checks a reader makes at a glance that this answer fails (person_check.py), by name."""
    checks = {
        "loops": loops(answer),
        "says_question_back": says_question_back(question, answer),
        "recites_instructions": recites_instructions(answer, instructions),
        "speaks_as_user": speaks_as_user(answer),
        "continues_transcript": continues_transcript(answer),
    }
    return [name for name, failed in checks.items() if failed]


def is_right(q: Question, answer: str, instructions: str = DEFAULT_SYSTEM_PROMPT) -> bool:
    """A reader would accept it: the needed words, and no first-glance failure."""
    return has_words(answer, q.need) and not first_glance(q.question, answer, instructions)


def add_right_answers(result: dict[str, Any], questions: list[Question]) -> None:
    """Into an eval's result (`tokenrouter-train eval --question-set`, its answers kept): each point's
    `right` answers and `keeps_cloud_right`, the share of the cloud alone's right answers it keeps."""
    by_question = {q.question: q for q in questions}

    def right(method: str, target: float) -> set[str]:
        return {
            a["prompt"]
            for a in result["answers"]
            if a["method"] == method
            and a["target_fraction"] == target
            and is_right(by_question[a["prompt"]], a["text"])
        }

    cloud = right("cloud-only", 1.0)
    for method, points in result["methods"].items():
        for point in points:
            target = point["target_fraction"]
            name = {0.0: "edge-only", 1.0: "cloud-only"}.get(target, method)
            mine = right(name, target)
            point["right"] = len(mine)
            point["keeps_cloud_right"] = round(len(mine & cloud) / len(cloud), 3) if cloud else None
