"""The pause benchmark: does the assistant wait out a pause mid-request, in voices and phrasings it
was never tuned on, and how long does it wait at the real end?

Each item is a CLINC150 query with one silent pause (500-900 ms) at a word boundary drawn from all
of them (not only after "for" or "in"), spoken two ways:

- halves: the two halves synthesised apart and joined by the pause, so the first one ends with
  the falling pitch of a finished sentence (what fools an audio-only judge);
- spliced: the whole query synthesised once, silence spliced in at the word boundary (found by
  aligning the sentence with its two halves spoken apart: tests/turn_audio.junction_span), which
  keeps the continuing intonation of a real hesitation;

in several voices: Piper (joe, the voice the project's other benchmarks use) and espeak-ng voices.
Fluent items (no pause) measure the wait at a real end.

Synthetic speech has none of the prosody of a person stopping to think, which Smart Turn reads (here it
tells an end from a pause no better than chance: `signal_auc` in the report). `--voices recorded:DIR`
runs people's recordings instead: `NAME.wav` with its words in `NAME.txt`, a "|" where the speaker
paused mid-request (a real hesitation; "recorded pause"); a fluent recording is a fluent item and, with
silence spliced in at a seeded word boundary, a "spliced" one. DIR/whole_first_halves.txt may list its
own whole first halves. Recordings are split into tune and test by their words, as the queries are.

The judges' inputs are computed as the pipeline computes them, once per pause: the VAD replayed
frame by frame (tests/voice_audio.replay_vad), the speculative final Whisper decode with its
last-word probability, the device model's P(end of request) (RoutedGenerator.end_of_message) and
Smart Turn. Then every judge is replayed on the same inputs, side by side: a pause the person
resumed from is a false cut-off when it lasts at least the wait the judge sets; at the true end,
the wait is the dead air the judge adds (plus the decodes, reported apart).

Cut-offs are also reported by kind of item: fragments ("convert fifty | miles to kilometers") and
first halves that are a request on their own ("what time does the store close | on sunday"), which
no signal here can tell from an end (scripts/whole_first_halves.txt, read as a person would); and
with the words heard right: the judge replayed with the device model's P(end) of the true words at
the pause, which shows what Whisper's mishearings cost.

Tune on `--split tune` (CLINC150 train + val); report on `--split test`, never tuned on.

    python scripts/bench_turns.py --split tune --n 40
    python scripts/bench_turns.py --split test --n 40 --grid   # + a grid of thresholds, read only
    python scripts/bench_turns.py --split tune --asr-model-dir DIR   # another CTranslate2 Whisper
    python scripts/bench_turns.py --split test --voices recorded:DIR  # people's own recordings

Writes build/turns_<split>.json (every pause's inputs, so judges can be replayed without audio).
CLINC150: Larson et al., EMNLP-IJCNLP 2019, CC BY 3.0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from turn_audio import (  # noqa: E402
    PAUSE_MS,
    Recording,
    WordAligner,
    boundary_items,
    halves_speech,
    read_recordings,
    spliced_recording,
    spliced_speech,
    split_tune_test,
    voices,
    with_silence,
)
from voice_audio import replay_vad  # noqa: E402

from edge_client.generator import RoutedGenerator  # noqa: E402
from edge_client.options import GeneratorOptions  # noqa: E402
from edge_client.voice.asr import AsrOptions, Transcriber, close_gaps  # noqa: E402
from edge_client.voice.endofturn import EndOfTurn, SmartTurn, TurnOptions  # noqa: E402
from edge_client.voice.resample import resample  # noqa: E402
from edge_client.voice.vad import FRAME_S, VadOptions  # noqa: E402
from models.registry import model_info  # noqa: E402
from models.train.features import auc  # noqa: E402
from shared.llama_backend import LlamaModel  # noqa: E402
from shared.prompting import DEFAULT_SYSTEM_PROMPT  # noqa: E402

DATA = Path("/work/shared/datasets/clinc150/data_full.json")
WHOLE_HALVES = ROOT / "scripts" / "whole_first_halves.txt"
SPLITS = {"tune": ("train", "val"), "test": ("test",)}
RATE = 16000
# The judges compared in one run: the rule before the device model's signal, and today's default.
JUDGES = {
    "before: words + Smart Turn": TurnOptions(text_model=False),
    "now: + device model P(end)": TurnOptions(),
    "device model, no word rule": TurnOptions(word_rule=False),
    "device model, no fast path for a sure '?'": TurnOptions(sure_end_prob=1.0),
    "now + the last word's doubt (0.5)": TurnOptions(misheard_word_prob=0.5),
}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


class Signals:
    """The pipeline's end-of-turn inputs at a pause: Whisper, the device model, Smart Turn."""

    def __init__(self, asr: AsrOptions) -> None:
        self.tx = Transcriber(asr)
        self.smart = SmartTurn()
        opts = GeneratorOptions(policy="edge", cloud="none")
        self.model = LlamaModel(model_info(opts.edge_model))
        self.gen = RoutedGenerator(self.model, opts, None)

    def text_end(self, text: str) -> float:
        """The device model's P(end of the message) after `text` as the user's message."""
        messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": text}]
        return self.gen.end_of_message(messages)

    def at(self, frames: list[np.ndarray], voiced: list[bool], k: int) -> dict:
        gap = max(1, int(AsrOptions().max_gap_ms / 1000 / FRAME_S))  # as the pipeline's DecodeScheduler.audio
        t0 = time.perf_counter()
        rec = self.tx.recognize(close_gaps(frames[:k], voiced[:k], gap), final=True)
        t1 = time.perf_counter()
        p_end = self.text_end(rec.text) if rec.text.strip() else None
        t2 = time.perf_counter()
        p_turn = self.smart(np.concatenate(frames[: k + 2]))  # judge_after_ms (64 ms) into the pause
        t3 = time.perf_counter()
        return {
            "text": rec.text,
            "p_word": rec.last_word_prob,
            "p_end": p_end,
            "p_turn": p_turn,
            "compute_ms": {"asr": 1000 * (t1 - t0), "text_end": 1000 * (t2 - t1), "smart_turn": 1000 * (t3 - t2)},
        }


def judge(opts: TurnOptions, pause: dict, words_right: bool = False) -> int:
    """The wait (ms) a judge with `opts` sets at a pause with these inputs; `words_right`: with the true words
    at the pause (no punctuation, so no sure "?"), where they are known, instead of Whisper's."""
    eot = EndOfTurn(opts, model=object())
    d = eot.new_decision()
    d.probability = pause["p_turn"]
    if words_right and "true_text" in pause:
        eot.judge_text(d, pause["true_text"], None, pause["true_p_end"])
    else:
        eot.judge_text(d, pause["text"], pause["p_word"], pause["p_end"])
    wait = eot.wait_ms(d, 250, text_known=True)
    assert wait is not None
    return wait


def replay(opts: TurnOptions, rows: list[dict], words_right: bool = False) -> dict:
    """Cut-offs and the wait at the real end for one judge over recorded rows."""
    cut, ends = 0, []
    for r in rows:
        for pz in r["pauses"]:
            wait = judge(opts, pz, words_right)
            if not pz["resumed"]:
                ends.append(wait)
                break
            if pz["ms"] >= wait:
                cut += 1
                break
    paused = [r for r in rows if r["pause_ms"]]
    return {
        "n": len(rows),
        "cut_off_pct": round(100 * cut / max(1, len(paused)), 1) if paused else None,
        "end_wait_ms": {"p50": pct(ends, 50), "p90": pct(ends, 90), "mean": round(float(np.mean(ends)), 1)}
        if ends
        else None,
    }


def table(rows: list[dict], judges: dict[str, TurnOptions]) -> dict:
    out: dict = {}
    groups = sorted({(r["voice"], r["construction"]) for r in rows})
    for name, opts in judges.items():
        out[name] = {
            f"{v} / {c}": replay(opts, [r for r in rows if (r["voice"], r["construction"]) == (v, c)])
            for v, c in groups
        }
        out[name]["all paused"] = replay(opts, [r for r in rows if r["pause_ms"]])
        out[name]["all fluent"] = replay(opts, [r for r in rows if not r["pause_ms"]])
    return out


def by_kind(rows: list[dict]) -> dict:
    """Cut-offs of fragments and of whole first halves apart, for today's rule and the one before, and
    for today's with the words heard right: per voice and construction; and the wait at fluent ends."""
    judges = {
        "before": (JUDGES["before: words + Smart Turn"], False),
        "now": (JUDGES["now: + device model P(end)"], False),
        "now, words heard right": (JUDGES["now: + device model P(end)"], True),
    }
    out: dict = {}
    groups = sorted({(r["voice"], r["construction"]) for r in rows if r["pause_ms"]}) + [("all", "paused")]
    for v, c in groups:
        mine = [r for r in rows if r["pause_ms"] and (v == "all" or (r["voice"], r["construction"]) == (v, c))]
        for kind in ("fragment", "whole"):
            these = [r for r in mine if r["kind"] == kind]
            out[f"{v} / {c} / {kind} ({len(these)})"] = {
                name: replay(opts, these, right)["cut_off_pct"] for name, (opts, right) in judges.items()
            }
    for v in sorted({r["voice"] for r in rows}):
        fluent = [r for r in rows if not r["pause_ms"] and r["voice"] == v]
        out[f"{v} / fluent: wait at the end, ms"] = {
            name: replay(opts, fluent, right)["end_wait_ms"] for name, (opts, right) in judges.items()
        }
    return out


def signal_auc(rows: list[dict]) -> dict:
    """How well each input alone tells a real end from the made pause (AUC; 0.5 is chance), per voice and
    kind of pause: P(end) and Smart Turn should be higher at an end, Whisper's last-word probability too."""
    out: dict = {}
    for v in sorted({r["voice"] for r in rows}) + ["all"]:
        mine = [r for r in rows if v == "all" or r["voice"] == v]
        ends = [r["pauses"][-1] for r in mine if not r["pause_ms"] and r["pauses"] and not r["pauses"][-1]["resumed"]]
        for kind in ("fragment", "whole"):
            made = [made_pause(r) for r in mine if r["kind"] == kind]
            made = [p for p in made if p is not None]
            y = np.r_[np.ones(len(ends)), np.zeros(len(made))]
            out[f"{v} / end vs {kind} pause ({len(ends)}, {len(made)})"] = {
                name: None if not (ends and made) else round(auc(np.array([p[key] or 0.0 for p in ends + made]), y), 2)
                for name, key in (("P(end)", "p_end"), ("Smart Turn", "p_turn"), ("last word p", "p_word"))
            }
    return out


def made_pause(row: dict) -> dict | None:
    """The pause the item was made with: the longest the person resumed from."""
    return max((p for p in row["pauses"] if p["resumed"]), key=lambda p: p["ms"], default=None)


def whole_halves(path: Path) -> set[str]:
    """The items whose first half is a request on its own, as "first half | rest" (WHOLE_HALVES's form;
    a recordings folder may have its own)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


Job = tuple[str, tuple[str, list[str], int, int], Callable[[], "np.ndarray | None"]]


def synthesized_jobs(synth, pool: list[str], constructions: list[str], n: int, seed: int) -> list[Job]:
    """A synthetic voice's items: `n` queries with a pause in each construction, and `n` fluent ones. Each
    voice gets its own queries and cuts (seeded), so no query's cut is learned for all voices."""
    items = boundary_items(pool, n, seed=seed)
    fluent = boundary_items(pool, n, seed=seed + 50)

    def make(construction: str, words: list[str], cut: int, pause_ms: int) -> Callable[[], np.ndarray | None]:
        if construction == "fluent":
            return lambda: resample(synth.synthesize(" ".join(words)), synth.rate, RATE)
        if construction == "halves":
            return lambda: halves_speech(synth, words, cut, pause_ms, RATE)
        # no Whisper check of the splice: it would keep only the items Whisper hears well
        return lambda: spliced_speech(synth, None, words, cut, pause_ms, RATE)

    jobs = [(c, it, make(c, it[1], it[2], it[3])) for c in constructions for it in items]
    return jobs + [("fluent", (q, w, cut, 0), make("fluent", w, cut, 0)) for q, w, cut, _ in fluent]


def recorded_jobs(recs: list[Recording], split: str, n: int, seed: int, tx: Transcriber) -> list[Job]:
    """A folder of recordings' items, those of `split` (by a hash of the words, as the queries are split):
    a recording with a "|" is a real pause ("recorded pause"); one without is a fluent item and, with silence
    spliced in at a seeded word boundary (Whisper's word timestamps), a "spliced" one. At most `n` of each."""
    tune, test = split_tune_test([r.text for r in recs])
    mine = set(tune if split == "tune" else test)
    recs = [r for r in recs if r.text in mine]
    rng, aligner = random.Random(seed), WordAligner(tx.model)
    paused = [r for r in recs if r.pause_after is not None][:n]
    fluent = [r for r in recs if r.pause_after is None and len(r.words) >= 3][:n]
    jobs: list[Job] = [("recorded pause", (r.text, r.words, r.pause_after, 1), lambda r=r: r.audio) for r in paused]
    for r in fluent:
        cut, pause_ms = rng.randint(2, len(r.words) - 1), rng.randint(*PAUSE_MS)
        jobs.append(
            (
                "spliced",
                (r.text, r.words, cut, pause_ms),
                lambda r=r, c=cut, p=pause_ms: spliced_recording(r, aligner, c, p),
            )
        )
        jobs.append(("fluent", (r.text, r.words, cut, 0), lambda r=r: r.audio))
    return jobs


def spoken(words: list[str]) -> str:
    """Words as Whisper writes a transcript's start: capitalised, no final punctuation (a pause, not an end)."""
    text = " ".join(words)
    return text[:1].upper() + text[1:]


def grid(rows: list[dict]) -> list[dict]:
    """Thresholds around the defaults, each replayed: cut-offs (paused) against the fluent end wait."""
    out = []
    for lo, hi, max_wait in itertools.product((0.003, 0.005, 0.01, 0.02), (0.03, 0.05, 0.1), (1200, 1500)):
        if lo > hi:
            continue
        opts = replace(TurnOptions(), text_unfinished_below=lo, text_finished_from=hi, max_wait_ms=max_wait)
        p, f = replay(opts, [r for r in rows if r["pause_ms"]]), replay(opts, [r for r in rows if not r["pause_ms"]])
        out.append(
            {
                "below": lo,
                "from": hi,
                "max_wait_ms": max_wait,
                "cut_off_pct": p["cut_off_pct"],
                "fluent_end_wait": f["end_wait_ms"],
            }
        )
    return out


def measure(
    signals: Signals, audio: np.ndarray, construction: str, words: list[str], cut: int, whole: set[str]
) -> dict:
    """One item's pauses, each with the pipeline's inputs (and the true words' P(end) at the made pause and
    at the end), and its kind: "fragment" or "whole" (first half a request on its own), None when fluent."""
    frames, voiced, found = replay_vad(with_silence(audio, tail_s=1.6), VadOptions())
    pauses = []
    for pz in found:
        if pz["resumed"] and pz["ms"] < TurnOptions().min_wait_ms:
            continue  # a dip no judge could end the turn at
        pauses.append(pz | signals.at(frames, voiced, pz["frames"]))
        if not pz["resumed"]:
            break
    made = made_pause({"pauses": pauses})
    known = [] if construction == "fluent" or made is None else [(made, words[:cut])]
    if pauses and not pauses[-1]["resumed"]:
        known.append((pauses[-1], words))
    for p, truth in known:
        p["true_text"] = spoken(truth)
        p["true_p_end"] = signals.text_end(p["true_text"])
    kind = None if construction == "fluent" else "fragment"
    if kind and f"{' '.join(words[:cut])} | {' '.join(words[cut:])}" in whole:
        kind = "whole"
    out: dict = {"kind": kind, "pauses": pauses}
    if construction == "recorded pause":  # the speaker's own pause; one too short to hear cannot cut off
        out["pause_ms"] = round(made["ms"]) if made else 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=tuple(SPLITS), default="tune")
    ap.add_argument("--n", type=int, default=40, help="paused items per voice and construction (and fluent ones)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--voices",
        default="piper,espeak:en-us,espeak:en-gb-x-rp",
        help="piper, piper:fixed, espeak:<voice>, or recorded:DIR (people's recordings: NAME.wav + NAME.txt)",
    )
    ap.add_argument("--constructions", default="halves,spliced")
    ap.add_argument("--asr-model-dir", default=None, help="a CTranslate2 Whisper directory (default: bundled tiny.en)")
    ap.add_argument("--grid", action="store_true", help="also replay a grid of text thresholds")
    ap.add_argument("--out", default=None, help="default: build/turns_<split>.json")
    args = ap.parse_args()

    data = json.loads(DATA.read_text())
    pool = [q for s in SPLITS[args.split] for q, _ in data[s]]
    signals = Signals(AsrOptions(model_dir=args.asr_model_dir))
    constructions = args.constructions.split(",")
    rows: list[dict] = []
    whole = whole_halves(WHOLE_HALVES)
    t_start = time.perf_counter()
    for vi, vname in enumerate(args.voices.split(",")):
        if vname.startswith("recorded:"):
            folder = Path(vname.split(":", 1)[1])
            whole |= whole_halves(folder / WHOLE_HALVES.name)
            jobs = recorded_jobs(read_recordings(folder), args.split, args.n, args.seed * 100 + vi, signals.tx)
        else:
            jobs = synthesized_jobs(voices([vname])[vname], pool, constructions, args.n, args.seed * 100 + vi)
        for construction, (query, words, cut, pause_ms), make_audio in jobs:
            audio = make_audio()
            if audio is None:
                continue
            row = {"voice": vname, "construction": construction, "query": query, "cut": cut, "pause_ms": pause_ms}
            rows.append(row | measure(signals, audio, construction, words, cut, whole))
            pauses = rows[-1]["pauses"]
            shown = " | ".join(
                f"{p['ms']:.0f}ms {p['text']!r} end={p['p_end'] or 0:.3f} turn={p['p_turn']:.2f}" for p in pauses
            )
            print(f"{len(rows):4d} {vname:18s} {construction:8s} {shown}", flush=True)
    report = {
        "command": " ".join(["python", "scripts/bench_turns.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {platform.processor() or platform.platform()}",
        "split": args.split,
        "asr_model_dir": args.asr_model_dir,
        "elapsed_s": round(time.perf_counter() - t_start),
        "decode_ms_p50": {
            k: pct([p["compute_ms"][k] for r in rows for p in r["pauses"]], 50)
            for k in ("asr", "text_end", "smart_turn")
        },
        "judges": table(rows, JUDGES),
        "cut_off_pct_by_kind": by_kind(rows),
        "signal_auc": signal_auc(rows),
    }
    if args.grid:
        report["grid"] = grid(rows)
    out = Path(args.out or ROOT / "build" / f"turns_{args.split}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report | {"rows": rows}, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "grid"}, indent=1))
    for g in report.get("grid", []):
        print(g)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
