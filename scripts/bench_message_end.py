"""The device model's text end-of-turn signal on CLINC150: whole requests against cuts after each word.

For each query the device model reads the chat prompt with the query as the user's message, and at
the last token of every word the probability that the message ends there (edge_client/message_end.py:
".", "?", "!" or the end-of-message token next). The whole query is an end; a cut after a word is
not, except where the cut is itself a whole CLINC150 query ("what time is it" in "what time is it in
tokyo"): those are reported apart and left out of the AUC. The transcript rule it is compared with is
today's function-word cue (`edge_client.voice.endofturn.unfinished_text`).

One decode per query reads every cut at once (the model is causal: the logits after word k are those
of the prompt cut there; `--check` verifies it against a separate read of each cut).

    python scripts/bench_message_end.py --split tune --n 1500          # train + val: choose thresholds
    python scripts/bench_message_end.py --split test --n 1500          # test: report, never tuned on

Each query is read as typed (lower case) and as Whisper writes it (capitalised first letter, its own
end punctuation left off, as the signal leaves it off). Writes build/message_end_<split>.json.
CLINC150: Larson et al., EMNLP-IJCNLP 2019, CC BY 3.0.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_client.message_end import MessageEnd  # noqa: E402
from edge_client.voice.endofturn import unfinished_text  # noqa: E402
from models.registry import DEFAULT_EDGE_MODEL, model_info  # noqa: E402
from models.train.features import auc  # noqa: E402
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel  # noqa: E402
from shared.prompting import DEFAULT_SYSTEM_PROMPT  # noqa: E402

DATA = Path("/work/shared/datasets/clinc150/data_full.json")
SPLITS = {"tune": ("train", "val"), "test": ("test",)}
THRESHOLDS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1)


def norm(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def messages(text: str) -> list[dict]:
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": text}]


def read_cuts(ends: MessageEnd, ctx: LlamaContext, words: list[str]) -> list[float] | None:
    """P(end) after each word 1..n of `words` (the last one: the whole query), in one decode; None
    when a cut tokenizes differently from the whole prompt's start (never seen on CLINC150)."""
    tokens, _ = ends.locate(messages(" ".join(words)))
    offsets = []
    for k in range(1, len(words) + 1):
        cut_tokens, at = ends.locate(messages(" ".join(words[:k])))
        if at is None or cut_tokens[: at + 1] != tokens[: at + 1]:
            return None
        offsets.append(at)
    ctx.clear(0)
    outs = ctx.decode_outputs(DecodeItem(0, 0, tokens), sorted(set(offsets)))
    by_offset = dict(zip(sorted(set(offsets)), outs))
    return [ends.probability(ctx.logits(by_offset[o])) for o in offsets]


def check_against_separate_reads(ends: MessageEnd, ctx: LlamaContext, words: list[str], got: list[float]) -> float:
    """The largest |difference| between the one-decode reads and a read of each cut's own prompt."""
    worst = 0.0
    for k in range(1, len(words) + 1):
        tokens, at = ends.locate(messages(" ".join(words[:k])))
        assert at is not None
        ctx.clear(0)
        out = ctx.decode_outputs(DecodeItem(0, 0, tokens), [at])
        worst = max(worst, abs(ends.probability(ctx.logits(out[0])) - got[k - 1]))
    return worst


def summarise(rows: list[dict], variant: str) -> dict:
    ends = np.array([r[variant][-1] for r in rows])
    cuts, rule_cuts, complete = [], [], []
    for r in rows:
        for k, p in enumerate(r[variant][:-1]):
            (complete if r["complete_cuts"][k] else cuts).append(p)
            if not r["complete_cuts"][k]:
                rule_cuts.append(r["rule"][k])
    cuts_a, rule_ends = np.array(cuts), np.array([r["rule"][-1] for r in rows])
    y = np.r_[np.ones(len(ends)), np.zeros(len(cuts_a))]
    # the rule's score: 1 where it lets the turn end (not mid-phrase), 0 where it says unfinished
    rule = np.r_[1.0 - rule_ends, 1.0 - np.array(rule_cuts, np.float64)]
    q = lambda xs, p: float(np.percentile(xs, p)) if len(xs) else float("nan")  # noqa: E731
    return {
        "n_queries": len(rows),
        "n_cuts": len(cuts),
        "n_complete_cuts": len(complete),
        "auc_p_end": round(auc(np.r_[ends, cuts_a], y), 4),
        "auc_function_word_rule": round(auc(rule, y), 4),
        "rule_flags_ends_pct": round(100 * float(rule_ends.mean()), 2),
        "rule_flags_cuts_pct": round(100 * float(np.mean(rule_cuts)), 2),
        "ends_p_end_pct": {p: round(q(ends, p), 4) for p in (1, 5, 10, 25, 50)},
        "cuts_p_end_pct": {p: round(q(cuts_a, p), 4) for p in (50, 75, 90, 95, 99)},
        "complete_cuts_p_end_median": round(q(complete, 50), 4),
        "by_threshold": {
            str(t): {
                "ends_below_pct": round(100 * float(np.mean(ends < t)), 2),
                "cuts_at_or_above_pct": round(100 * float(np.mean(cuts_a >= t)), 2),
                "rule_or_below_ends_pct": round(100 * float(np.mean((ends < t) | rule_ends.astype(bool))), 2),
            }
            for t in THRESHOLDS
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=tuple(SPLITS), default="tune")
    ap.add_argument("--n", type=int, default=1500, help="queries (seeded sample of the split)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=DEFAULT_EDGE_MODEL)
    ap.add_argument("--check", type=int, default=20, help="queries whose cuts are also read one prompt each")
    ap.add_argument("--out", default=None, help="default: build/message_end_<split>.json")
    args = ap.parse_args()

    data = json.loads(DATA.read_text())
    everything = {norm(q) for split in ("train", "val", "test") for q, _ in data[split]}
    pool = [q for s in SPLITS[args.split] for q, _ in data[s]]
    rng = np.random.default_rng(args.seed)
    picked = [pool[i] for i in rng.permutation(len(pool))]
    picked = [q for q in picked if len(norm(q).split()) >= 2][: args.n]

    model = LlamaModel(model_info(args.model))
    ends = MessageEnd(model)
    ctx = LlamaContext(model, n_ctx=512, threads=1, embeddings=False)
    rows, skipped, worst, t0 = [], 0, 0.0, time.perf_counter()
    for i, q in enumerate(picked):
        words = norm(q).split()
        variants = {"typed": words, "transcribed": [words[0].capitalize(), *words[1:]]}
        row: dict = {"query": q, "complete_cuts": [" ".join(words[:k]) in everything for k in range(1, len(words))]}
        for name, w in variants.items():
            got = read_cuts(ends, ctx, w)
            if got is None:
                break
            row[name] = got
            if i < args.check:
                worst = max(worst, check_against_separate_reads(ends, ctx, w, got))
        else:
            row["rule"] = [unfinished_text(" ".join(words[:k])) for k in range(1, len(words) + 1)]
            rows.append(row)
            continue
        skipped += 1
    elapsed = time.perf_counter() - t0
    report = {
        "command": " ".join(["python", "scripts/bench_message_end.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {platform.processor() or platform.platform()}",
        "model": args.model,
        "split": args.split,
        "skipped_queries": skipped,
        "one_decode_vs_separate_reads_max_abs_diff": round(worst, 5),
        "ms_per_query": round(1000 * elapsed / max(1, len(picked)), 1),
        "typed": summarise(rows, "typed"),
        "transcribed": summarise(rows, "transcribed"),
    }
    out = Path(args.out or ROOT / "build" / f"message_end_{args.split}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report | {"rows": rows}, indent=1))
    print(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
