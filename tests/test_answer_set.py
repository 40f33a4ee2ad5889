"""The question set a person grades (models/train/answer_set.py) and its benchmark (scripts/bench_answers.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.train.answer_set import (
    KINDS,
    Question,
    first_glance,
    has_words,
    is_right,
    load_questions,
    load_sessions,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_set_has_sixty_questions_every_kind_in_both_splits_and_no_question_twice():
    both = load_questions()
    assert len(both) >= 60
    tune, test = load_questions("tune"), load_questions("test")
    assert len(tune) + len(test) == len(both)
    assert not {q.question for q in tune} & {q.question for q in test}
    for split in (tune, test):
        assert {q.kind for q in split} == set(KINDS)
    sessions = load_sessions()
    for split in ("tune", "test"):
        turns = [t for s in sessions if s.split == split for t in s.turns]
        assert any(t.follow_up for t in turns) and sum(not t.follow_up for t in turns) >= 5
    assert all(not s.turns[0].follow_up for s in sessions)  # a follow-up follows something


def test_needed_words_match_whole_words_numbers_without_separators_and_stems():
    assert has_words("A day has 24 hours.", (("24", "twenty-four"),))
    assert has_words("Twenty four hours.", (("24", "twenty-four"),))
    assert has_words("A kilogram is 1,000 grams.", (("1000", "thousand"),))
    assert not has_words("A kilogram is 1000 grams.", (("100", "hundred"),))  # 100 is not in 1000
    assert has_words("Boil it for ten minutes.", (("water", "boil*"), ("minute*",)))
    assert not has_words("Boil it for ten minutes.", (("water",), ("minute*",)))  # every group
    assert not has_words("It is colder today.", (("cold",),))


def test_a_right_answer_has_the_words_and_fails_no_first_glance_check():
    q = Question("what do bees make", (("honey",),))
    assert is_right(q, "Bees make honey.")
    looping = "bees make honey, they make honey, they make honey, they make honey"
    assert has_words(looping, q.need) and first_glance(q.question, looping) == ["loops"]
    assert not is_right(q, looping)
    assert first_glance(q.question, "What do bees make?") == ["says_question_back"]
    assert not is_right(q, "Bees make wax.")


def test_a_bad_split_is_named():
    with pytest.raises(ValueError, match="split must be one of tune, test"):
        load_questions("val")


@pytest.mark.slow
def test_the_benchmark_reports_each_configuration_and_lays_the_answers_side_by_side(tmp_path):
    """Two questions, the device alone and every default, with a loopback cloud: the report's counts are
    the answers' own, and the side-by-side file lists every answer under its question."""
    out = tmp_path / "answers"
    cmd = [sys.executable, str(ROOT / "scripts/bench_answers.py"), "--split", "tune", "--n", "2"]
    cmd += ["--configs", "device,default", "--no-sessions", "--max-tokens", "16", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    report = json.loads(out.with_suffix(".json").read_text())
    questions = [q.question for q in load_questions("tune")[:2]]
    for name in ("device", "default"):
        rows = report["answers"][name]
        assert [r["question"] for r in rows] == questions
        point = report["points"][name]
        assert point["answers"] == 2 and point["right"] == sum(r["right"] for r in rows)
        assert all(r["right"] == (r["words"] and not r["failed"]) for r in rows)
    assert report["points"]["device"]["cloud_token_share"] == 0.0
    assert report["points"]["default"]["cloud_token_share"] > 0.0
    side = out.with_suffix(".md").read_text()
    assert all(q in side for q in questions) and side.count("- **default**") == 2


def test_the_eval_counts_right_answers_on_the_question_set(tmp_path):
    """`tokenrouter-train eval --question-set tune`: each point counts the right answers of its own listed
    answers, and the cloud alone keeps all of its own."""
    from models.train.answer_set import load_questions as questions_of
    from models.train.cli import main

    out = tmp_path / "eval"
    main(
        ["eval", "--question-set", "tune", "--limit", "2", "--fraction", "0.3", "--max-tokens", "8", "--out", str(out)]
    )
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["split"] == "question-set:tune"
    by_question = {q.question: q for q in questions_of("tune")[:2]}
    for method, points in result["methods"].items():
        for point in points:
            f = point["target_fraction"]
            name = {0.0: "edge-only", 1.0: "cloud-only"}.get(f, method)
            listed = [a for a in result["answers"] if a["method"] == name and a["target_fraction"] == f]
            assert len(listed) == 2 and point["right"] == sum(
                is_right(by_question[a["prompt"]], a["text"]) for a in listed
            )
    cloud = result["methods"]["cloud-only"][0]
    assert cloud["keeps_cloud_right"] == (1.0 if cloud["right"] else None)
    with pytest.raises(SystemExit, match="replaces --split"):
        main(["eval", "--question-set", "tune", "--split", "val", "--out", str(out)])
