"""Going on after a cut-off, through the whole pipeline: is a paused request answered whole?

The pause benchmark (scripts/bench_turns.py) counts the pauses the end-of-turn judge takes for an
end. In full duplex the person is still heard while the reply starts, and speech that goes on
within `turn.max_wait_ms` of their last word joins the request it cut off
(`VoiceOptions.rejoin_cut_off`). This runs the pause benchmark's items (a CLINC150 query, one
500-900 ms pause at a word boundary, the halves spoken apart) through the real pipeline, file in
and file out at real-time pace, full duplex, every other option the default, and reports per item:

- waited: one turn, the pause waited out;
- rejoined: cut off, the reply stopped when the person went on, the whole request answered next;
- answered the half: cut off and answered as a request of its own (with `--no-rejoin`, every cut-off);

with the reply audio the person heard before going on, and the word error of the request answered
against the query. Nothing is tuned here (the window is the judge's longest wait).

    python scripts/bench_rejoin.py --split test --n 40 [--voices piper,espeak:en-us] [--no-rejoin]

CLINC150: Larson et al., EMNLP-IJCNLP 2019, CC BY 3.0.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_turns import DATA, SPLITS  # noqa: E402
from turn_audio import boundary_items, halves_speech, voices, wav_with_silence  # noqa: E402
from voice_audio import wer  # noqa: E402

from edge_client.generator import open_generator  # noqa: E402
from edge_client.options import GeneratorOptions  # noqa: E402
from edge_client.voice.audio_io import FileSink, FileSource  # noqa: E402
from edge_client.voice.events import Interruption, TurnDone  # noqa: E402
from edge_client.voice.pipeline import Engines, VoiceOptions, VoicePipeline  # noqa: E402

REPLY_S = 2.0  # each reply plays this long at most: longer than any pause, so a cut-off reply is still playing


def run_item(engines: Engines, wav: Path, opts: VoiceOptions) -> tuple[list[TurnDone], list[Interruption]]:
    """The file through the pipeline until two turns are done, or one is and the file has long ended."""
    src = FileSource(wav, realtime=True)
    pipe = VoicePipeline(engines, src, FileSink(engines.synth.rate, realtime=True), opts)
    stop, out = threading.Event(), {}
    th = threading.Thread(target=lambda: out.setdefault("turns", pipe.run(stop, max_turns=2, reply_limit_s=REPLY_S)))
    th.start()
    deadline = time.monotonic() + src.duration_s + 20
    while th.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
        if src.t0 is None:
            continue
        over = time.monotonic() > src.t0 + src.duration_s + 1.5
        with pipe.state.lock:
            idle = pipe.state.playing is None and pipe.state.utt is None
        if over and idle and pipe.turns:
            stop.set()
    stop.set()
    th.join(timeout=10)
    return list(pipe.turns), [e for e in pipe.events if isinstance(e, Interruption)]


def outcome(query: str, turns: list[TurnDone], cuts: list[Interruption]) -> dict:
    """What became of one paused request (module docstring)."""
    if not turns:
        return {"outcome": "no turn"}
    first, last = turns[0], turns[-1]
    row = {"turns": len(turns), "answered": last.request or last.transcript}
    if len(turns) == 1 and not first.interrupted:
        row["outcome"] = "waited"
    elif first.rejoined:
        row["outcome"] = "rejoined"
        played = first.timings.first_audio_out
        row["heard_ms"] = round(max(0.0, (cuts[0].t_stopped - played) * 1000), 1) if played and cuts else 0.0
    else:
        row["outcome"] = "answered the half"
    row["wer"] = round(wer(query, row["answered"]), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=tuple(SPLITS), default="test")
    ap.add_argument("--n", type=int, default=40, help="paused items per voice")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--voices", default="piper")
    ap.add_argument("--no-rejoin", action="store_true", help="speech over the reply is a new request")
    ap.add_argument("--out", default=None, help="default: build/rejoin_<split>.json")
    args = ap.parse_args()

    data = json.loads(DATA.read_text())
    pool = [q for s in SPLITS[args.split] for q, _ in data[s]]
    opts = VoiceOptions(full_duplex=True, rejoin_cut_off=not args.no_rejoin)
    rows: list[dict] = []
    t_start = time.perf_counter()
    with open_generator(GeneratorOptions(cloud="local", policy="router", max_tokens=48, seed=0)) as gen:
        engines = Engines(gen)
        tmp = Path(tempfile.mkdtemp(prefix="rejoin-"))
        for vi, (vname, synth) in enumerate(voices(args.voices.split(",")).items()):
            for i, (query, words, cut, pause_ms) in enumerate(boundary_items(pool, args.n, seed=args.seed * 100 + vi)):
                wav = tmp / f"{vi}_{i}.wav"
                wav_with_silence(halves_speech(synth, words, cut, pause_ms), wav, lead_s=0.3, tail_s=0.3)
                turns, cuts = run_item(engines, wav, opts)
                row = {"voice": vname, "query": query, "cut": cut, "pause_ms": pause_ms} | outcome(query, turns, cuts)
                rows.append(row)
                print(
                    f"{len(rows):3d} {vname:14s} {row['outcome']:18s} {pause_ms}ms {query!r} -> {row.get('answered')!r}"
                )
    report: dict = {
        "command": " ".join(["python", "scripts/bench_rejoin.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {platform.processor() or platform.platform()}",
        "rejoin": not args.no_rejoin,
        "elapsed_s": round(time.perf_counter() - t_start),
        "by_voice": {},
    }
    for v in sorted({r["voice"] for r in rows}):
        rs = [r for r in rows if r["voice"] == v]
        share = {k: round(100 * sum(r["outcome"] == k for r in rs) / len(rs), 1) for k in ("waited", "rejoined")}
        heard = [r["heard_ms"] for r in rs if r["outcome"] == "rejoined"]
        whole = [r for r in rs if r["outcome"] in ("waited", "rejoined")]
        report["by_voice"][v] = {
            "n": len(rs),
            "waited_pct": share["waited"],
            "rejoined_pct": share["rejoined"],
            "answered_the_half_pct": round(100 - share["waited"] - share["rejoined"], 1),
            "heard_before_going_on_ms_p50": float(np.median(heard)) if heard else None,
            "wer_of_the_request_answered": round(float(np.mean([r["wer"] for r in whole])), 3) if whole else None,
        }
    out = Path(args.out or ROOT / "build" / f"rejoin_{args.split}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report | {"rows": rows}, indent=1))
    print(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
