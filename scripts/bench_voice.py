"""Voice latency benchmark: spoken CLINC150 `val` queries through the file pipeline at real-time pace.

    python scripts/bench_voice.py [--n 30] [--out build/voice_bench.json]
    python scripts/bench_voice.py --compare="--no-complete-prefill"   # A/B, query by query

Queries come from CLINC150 (Larson et al. 2019, CC BY 3.0), synthesised with
the bundled Piper voice. Each query is one fresh single-turn dialogue with the
local loopback cloud server and the router policy. Reports end-of-speech ->
first audio and endpoint -> first audio (p50, p95, % under 150 ms), the stage
breakdown (p50 of each stage after end of speech) and the recognition WER.
Each turn stops once its first audio is out (the rest of the reply is not played).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from voice_audio import spoken_wav, wer  # noqa: E402

from edge_client.generator import open_generator  # noqa: E402
from edge_client.options import DEFAULT_CHECK, GeneratorOptions  # noqa: E402
from shared.decision import CHECK_MODES  # noqa: E402
from edge_client.voice.cli import run_file_turn  # noqa: E402
from edge_client.voice.pipeline import Engines, VoiceOptions  # noqa: E402

DATA = Path("/work/shared/datasets/clinc150/data_full.json")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", default=str(ROOT / "build" / "voice_bench.json"))
    ap.add_argument("--compare", metavar="FLAGS", default=None,
                    help='also run every query with these pipeline flags (e.g. "--no-complete-prefill"), alternating which goes first; '
                         "reports both and the per-query difference")
    ap.add_argument("--no-speculative", action="store_true")
    ap.add_argument("--no-prefill", action="store_true", help="do not prefill the prompt from partial transcripts")
    ap.add_argument("--no-complete-prefill", action="store_true", help="prefill partials only up to their last word (no template tail)")
    ap.add_argument("--no-priority", action="store_true", help="let generation run while the first clause is synthesised")
    ap.add_argument("--speculate-after-ms", type=int, default=None)
    ap.add_argument("--first-max-words", type=int, default=None)
    ap.add_argument("--stop-delay-ms", type=int, default=None)
    ap.add_argument("--no-lookahead", action="store_true", help="do not use the cloud's guess after each cloud token")
    ap.add_argument("--check", nargs="?", const="all", default=DEFAULT_CHECK, choices=CHECK_MODES,
                    help="the cloud's check (default: the generator's): one verify per clause, tokens spoken only once checked")
    ap.add_argument("--asr-threads", type=int, default=None, help="CTranslate2 threads for Whisper (not with --compare: one recogniser serves both)")
    return ap


def voice_options(args: argparse.Namespace) -> VoiceOptions:
    vopts = VoiceOptions(speculative=not args.no_speculative, prefill_partials=not args.no_prefill, first_chunk_priority=not args.no_priority,
                         prefill_complete=not args.no_complete_prefill)
    if args.speculate_after_ms is not None:
        vopts.speculate_after_ms = args.speculate_after_ms
    if args.first_max_words is not None:
        vopts.tts.first_max_words = args.first_max_words
    if args.stop_delay_ms is not None:
        vopts.vad.stop_delay_ms = args.stop_delay_ms
    if args.asr_threads is not None:
        vopts.asr.cpu_threads = args.asr_threads
    return vopts


def generation_flags(args: argparse.Namespace) -> dict[str, object]:
    """The generator settings a config changes (set on the one shared generator before each turn)."""
    return {"lookahead": not args.no_lookahead, "check": args.check}


def summarise(rows: list[dict], vopts: VoiceOptions) -> dict:
    e2a = [r["end_of_speech_to_first_audio_ms"] for r in rows if r["end_of_speech_to_first_audio_ms"] is not None]
    ep2a = [r["endpoint_to_first_audio_ms"] for r in rows if r["endpoint_to_first_audio_ms"] is not None]
    stages = {k: pct([r["timings_ms"][k] for r in rows if r["timings_ms"][k] is not None], 50) for k in rows[0]["timings_ms"]}
    return {
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores, {platform.platform()}",
        "n": len(rows),
        "options": {"speculative": vopts.speculative, "prefill_partials": vopts.prefill_partials, "prefill_complete": vopts.prefill_complete,
                    "first_chunk_priority": vopts.first_chunk_priority, "speculate_after_ms": vopts.speculate_after_ms,
                    "first_max_words": vopts.tts.first_max_words, "stop_delay_ms": vopts.vad.stop_delay_ms, "asr_threads": vopts.asr.cpu_threads},
        "eos_to_first_audio_ms": {"p50": pct(e2a, 50), "p95": pct(e2a, 95), "under_150_pct": 100 * np.mean(np.array(e2a) < 150)},
        "endpoint_to_first_audio_ms": {"p50": pct(ep2a, 50), "p95": pct(ep2a, 95), "under_150_pct": 100 * np.mean(np.array(ep2a) < 150)},
        "stage_p50_ms_after_speech_end": stages,
        "wer_mean": float(np.mean([r["wer"] for r in rows])),
        "cloud_token_share": float(sum(r["n_cloud_tokens"] for r in rows) / max(1, sum(r["n_tokens"] for r in rows))),
    }


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    configs = [("a", voice_options(args), generation_flags(args))]
    if args.compare:
        args_b = ap.parse_args(sys.argv[1:] + args.compare.split())
        configs.append(("b", voice_options(args_b), generation_flags(args_b)))
    val = json.load(open(args.data))["val"]
    step = max(1, len(val) // args.n)
    queries = [val[i * step][0] for i in range(args.n)]
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    tmp = Path(tempfile.mkdtemp(prefix="voice-bench-"))
    first = configs[0][1]
    with open_generator(GeneratorOptions(cloud="local", policy="router", max_tokens=first.max_tokens, seed=0)) as gen:
        eng = Engines(gen, first.asr, first.tts, first.dialogue.system_prompt)
        for i, q in enumerate(queries):
            wav = spoken_wav(eng.synth, q, tmp / f"q{i}.wav")
            order = configs if i % 2 == 0 else configs[::-1]  # alternate, so neither config always runs on a warmer cache
            for name, vopts, flags in order:
                gen.lookahead, gen.check = flags["lookahead"], flags["check"]
                t = time.monotonic()
                obj = run_file_turn(gen, str(wav), str(tmp / f"r{i}{name}.wav"), vopts, realtime=True, engines=eng, first_audio_only=True)
                obj["query"], obj["wer"], obj["wall_s"] = q, wer(q, obj["transcript"]), time.monotonic() - t
                rows[name].append(obj)
                print(f"{i:2d}{name if len(configs) > 1 else ''} eos->audio {obj['end_of_speech_to_first_audio_ms']:7.1f} ms  endpoint->audio "
                      f"{obj['endpoint_to_first_audio_ms']:7.1f} ms  wer {obj['wer']:.2f}  {q!r} -> {obj['transcript']!r}", flush=True)
    result: dict = {"summary": summarise(rows["a"], configs[0][1]) | configs[0][2], "rows": rows["a"]}
    if args.compare:
        result["compare_flags"] = args.compare
        result["summary_b"] = summarise(rows["b"], configs[1][1]) | configs[1][2]
        result["rows_b"] = rows["b"]
        diff = [b["end_of_speech_to_first_audio_ms"] - a["end_of_speech_to_first_audio_ms"] for a, b in zip(rows["a"], rows["b"])
                if a["end_of_speech_to_first_audio_ms"] is not None and b["end_of_speech_to_first_audio_ms"] is not None]
        result["paired_b_minus_a_ms"] = {"median": pct(diff, 50), "mean": float(np.mean(diff)) if diff else float("nan"),
                                         "b_slower_pct": 100 * float(np.mean(np.array(diff) > 0)) if diff else float("nan")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("rows")}, indent=1))


if __name__ == "__main__":
    main()
