"""Voice latency benchmark: spoken CLINC150 queries through the file pipeline at real-time pace.

    python scripts/bench_voice.py [--n 30] [--out build/voice_bench.json]
    python scripts/bench_voice.py --compare="--no-complete-prefill"   # A/B, query by query
    python scripts/bench_voice.py --pauses --n 30    # turn-taking: queries with mid-utterance pauses, and the
                                                     # fluent ones, each run with the defaults and silence-only
    python scripts/bench_voice.py --recognition --n 100 [--whisper-dir DIR]   # streaming final vs offline WER
    python scripts/bench_voice.py --turn-study --n 50 --seeds 4   # the end-of-turn judge replayed offline

Queries come from CLINC150 (Larson et al. 2019, CC BY 3.0), synthesised with
the bundled Piper voice. Each query is one fresh single-turn dialogue with the
local loopback cloud server and the router policy. Reports end-of-speech ->
first audio and endpoint -> first audio (p50, p95, % under 150 ms), the stage
breakdown (p50 of each stage after end of speech) and the recognition WER.
Piper samples its prosody, so each run speaks every query anew and only paired, within-run figures
compare; `--same-speech` speaks them without sampling (the same audio in every run). Each turn stops
once its first audio is out (the rest of the reply is not played); with
`--reply-s S` it plays the first S seconds of each reply and also reports the playback gaps (where
synthesis fell behind playback, so the person heard silence inside the reply); each turn's `speech_pieces`
say where (per piece: words, audio queued ahead when its synthesis began, synthesis time, token wait).
`--busy-cores N` runs N processes spinning a Python loop for the whole run (other work on the cores,
as in the desktop app); the report's `busy_cores` says whether they ran to the end and what share
of a core each got:

    python scripts/bench_voice.py --n 30 --reply-s 6 --busy-cores 1 \
        --compare="--piece-growth 0 --synth-low-water-s 0"     # playback gaps, before/after issue 32

`--recognition` needs no language model: for n fluent and n paused queries it compares the
offline transcript of the whole WAV (faster-whisper's `transcribe`, 30 s context) with the one
the pipeline's final decode makes when the turn is not cut off (the utterance from the VAD's
pre-roll to the first silent frame of its last pause, long pauses shortened, context cut to the
utterance), replayed frame by frame; `--whisper-dir` adds a second CTranslate2 model.

`--pauses` adds queries with natural hesitations: CLINC150 train/val queries spoken in one go
with a 300-900 ms pause after a word that needs the next one ("set a timer for, ten minutes"),
sometimes with a filler ("in, um, Boston"); two pauses in queries of 10+ words. For each set
and config it reports the false cut-off rate (the reply's first audio starts before the
person's last word ends), end of speech -> first audio measured from the true end of the
utterance (p50/p95 over the turns not cut off), the WER and how often the drafted reply hit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from voice_audio import (  # noqa: E402
    pause_query,
    replay_vad,
    speech_span,
    spoken_wav,
    spoken_wav_with_pauses,
    streaming_final,
    wer,
    without_fillers,
)

from edge_client.generator import open_generator  # noqa: E402
from edge_client.options import DEFAULT_CHECK, GeneratorOptions  # noqa: E402
from edge_client.voice.asr import AsrOptions, Transcriber  # noqa: E402
from edge_client.voice.cli import run_file_turn  # noqa: E402
from edge_client.voice.endofturn import JUDGE_AT, TurnDecision, TurnOptions  # noqa: E402
from edge_client.voice.pipeline import Engines, VoiceGenerator, VoiceOptions  # noqa: E402
from edge_client.voice.tts import Synthesizer, TtsOptions  # noqa: E402
from edge_client.voice.vad import VadOptions  # noqa: E402
from edge_client.voice.wavfile import read_wav  # noqa: E402
from shared.cpus import BusyCores, format_cpus, pin_to_cpus  # noqa: E402
from shared.decision import CHECK_MODES  # noqa: E402

DATA = Path("/work/shared/datasets/clinc150/data_full.json")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


WHOLE_RUN = ("policy", "cloud_cpus", "device_cpus", "busy_cores")  # options of the run, never of one --compare side


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_run_options(ap)
    add_answer_options(ap)
    add_speech_options(ap)
    add_turn_options(ap)
    add_machine_options(ap)
    return ap


def add_run_options(ap: argparse.ArgumentParser) -> None:
    """What is measured: which queries, the A/B comparison, the offline studies, where the report goes."""
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", default=str(ROOT / "build" / "voice_bench.json"))
    ap.add_argument(
        "--compare",
        metavar="FLAGS",
        default=None,
        help='also run every query with these pipeline flags (e.g. "--no-complete-prefill"), '
        "alternating which goes first; "
        "reports both and the per-query difference",
    )
    ap.add_argument(
        "--pauses",
        action="store_true",
        help='queries with mid-utterance pauses and the fluent ones; B defaults to --compare="--turn-mode silence"',
    )
    ap.add_argument("--seed", type=int, default=0, help="picks the pause queries, their pauses and fillers")
    ap.add_argument(
        "--same-speech",
        action="store_true",
        help="speak the queries without Piper's prosody sampling: every run hears the same audio, so runs "
        "compare across sessions (flatter prosody than the default, which speaks every query anew)",
    )
    ap.add_argument(
        "--recognition", action="store_true", help="offline vs streaming-final WER only (no language model)"
    )
    ap.add_argument("--whisper-dir", default=None, help="with --recognition: also this CTranslate2 Whisper directory")
    ap.add_argument(
        "--turn-study",
        action="store_true",
        help="no language model: the end-of-turn judge replayed at every pause, transcript cue with and without "
        "Whisper's word probability (seeds --seed.. --seed+k-1 for --n paused queries each)",
    )
    ap.add_argument("--seeds", type=int, default=1, help="with --turn-study: how many seeds of --n paused queries")


def add_answer_options(ap: argparse.ArgumentParser) -> None:
    """How the answer starts early: recognition, speculation and prefill from partial transcripts, the cloud."""
    ap.add_argument("--no-speculative", action="store_true")
    ap.add_argument("--no-prefill", action="store_true", help="do not prefill the prompt from partial transcripts")
    ap.add_argument(
        "--no-complete-prefill",
        action="store_true",
        help="prefill partials only up to their last word (no template tail)",
    )
    ap.add_argument(
        "--no-priority", action="store_true", help="let generation run while the first clause is synthesised"
    )
    ap.add_argument("--speculate-after-ms", type=int, default=None)
    ap.add_argument("--stop-delay-ms", type=int, default=None)
    ap.add_argument("--no-lookahead", action="store_true", help="do not use the cloud's guess after each cloud token")
    ap.add_argument(
        "--check",
        nargs="?",
        const="all",
        default=DEFAULT_CHECK,
        choices=CHECK_MODES,
        help="the cloud's check (default: the generator's): one verify per clause, tokens spoken only once checked",
    )
    ap.add_argument(
        "--asr-threads",
        type=int,
        default=None,
        help="CTranslate2 threads for Whisper",
    )
    ap.add_argument(
        "--blas-threads", type=int, default=None, help="numpy's BLAS threads (0: the library's default, one per core)"
    )
    ap.add_argument("--draft", action="store_true", help="draft the reply from partial transcripts")
    ap.add_argument("--partial-interval-ms", type=int, default=None)


def add_speech_options(ap: argparse.ArgumentParser) -> None:
    """How the reply is spoken: Piper, the pieces it is cut into, how much of it plays."""
    ap.add_argument("--tts-spin", action="store_true", help="let Piper's onnxruntime threads busy-wait (its default)")
    ap.add_argument("--first-max-words", type=int, default=None)
    ap.add_argument(
        "--piece-growth",
        type=float,
        default=TtsOptions().piece_growth,
        help="a piece after the first has at most this many times the words already cut (0: up to max_words, "
        "as before; default %(default)s)",
    )
    ap.add_argument(
        "--synth-low-water-s",
        type=float,
        default=VoiceOptions().synth_low_water_s,
        help="pause generation while a later piece is synthesised with less audio than this queued ahead "
        "(0: only for the first piece, as before; default %(default)s)",
    )
    ap.add_argument(
        "--no-tts-cache", action="store_true", help="synthesise every piece (no cache of short pieces, no openers)"
    )
    ap.add_argument(
        "--reply-s",
        type=float,
        default=0.0,
        help="play this many seconds of each reply (0: stop at its first audio) and report the playback gaps",
    )


def add_turn_options(ap: argparse.ArgumentParser) -> None:
    """The end-of-turn judge: its mode, waits and signals."""
    ap.add_argument("--turn-mode", choices=("smart", "silence"), default=None)
    ap.add_argument("--min-wait-ms", type=int, default=None)
    ap.add_argument("--max-wait-ms", type=int, default=None)
    ap.add_argument("--turn-threshold", type=float, default=None)
    ap.add_argument("--no-text-cue", action="store_true")
    ap.add_argument("--no-text-model", action="store_true", help="no device-model P(end) in the end-of-turn judge")
    ap.add_argument("--judge-after-ms", type=int, default=None, help="silence before Smart Turn may run")
    ap.add_argument(
        "--judge-at",
        choices=JUDGE_AT,
        default=None,
        help="when Smart Turn runs in a pause: beside the final decode, once the transcript is in (default), "
        "or once the speculative answer's first piece is synthesised",
    )
    ap.add_argument(
        "--unsure-word-prob",
        type=float,
        default=None,
        help="a last word like 'that' or 'too' under this Whisper probability is mid-phrase (0: off)",
    )
    ap.add_argument(
        "--sure-end-prob",
        type=float,
        default=None,
        help="a transcript ending on ? with its last word at least this sure ends the turn without Smart Turn "
        "(1: always ask Smart Turn)",
    )


def add_machine_options(ap: argparse.ArgumentParser) -> None:
    """Where the run happens and what else runs beside it (WHOLE_RUN: never a --compare flag)."""
    ap.add_argument(
        "--device-cpus",
        metavar="LIST",
        help="run the pipeline on these CPUs only (0,1; Linux): with --cloud-cpus on a machine with cores to spare, "
        "a two-core device and a cloud on other hardware (docs/voice.md)",
    )
    ap.add_argument(
        "--cloud-cpus", metavar="LIST", help="run the loopback cloud server on these CPUs only (2,3; Linux)"
    )
    ap.add_argument(
        "--policy",
        choices=("router", "edge"),
        default="router",
        help="edge: the device model answers alone and no cloud server runs (a diagnosis: what the cloud's "
        "work costs the chain on these cores); for the whole run, not a --compare flag",
    )
    ap.add_argument(
        "--busy-cores",
        type=int,
        default=0,
        help="run this many competing processes, each spinning a Python loop (a core kept busy, as the desktop "
        "app's browser or other work does), for the whole run; the report says so (for the whole run, not a "
        "--compare flag)",
    )


def voice_options(args: argparse.Namespace) -> VoiceOptions:
    vopts = VoiceOptions(
        speculative=not args.no_speculative,
        prefill_partials=not args.no_prefill,
        first_chunk_priority=not args.no_priority,
        prefill_complete=not args.no_complete_prefill,
    )
    if args.speculate_after_ms is not None:
        vopts.speculate_after_ms = args.speculate_after_ms
    if args.first_max_words is not None:
        vopts.tts.first_max_words = args.first_max_words
    vopts.tts.spin_wait = args.tts_spin
    vopts.tts.piece_growth = args.piece_growth
    vopts.synth_low_water_s = args.synth_low_water_s
    if args.no_tts_cache:
        vopts.tts.cache_max_words = 0
    if args.stop_delay_ms is not None:
        vopts.vad.stop_delay_ms = args.stop_delay_ms
    if args.asr_threads is not None:
        vopts.asr.cpu_threads = args.asr_threads
    if args.partial_interval_ms is not None:
        vopts.asr.partial_interval_ms = args.partial_interval_ms
    t = vopts.turn
    t.mode = args.turn_mode or t.mode
    t.min_wait_ms = args.min_wait_ms or t.min_wait_ms
    t.max_wait_ms = args.max_wait_ms or t.max_wait_ms
    t.threshold = t.threshold if args.turn_threshold is None else args.turn_threshold
    t.text_cue = not args.no_text_cue
    t.text_model = not args.no_text_model
    t.unsure_word_prob = t.unsure_word_prob if args.unsure_word_prob is None else args.unsure_word_prob
    t.judge_at = args.judge_at or t.judge_at
    t.judge_after_ms = args.judge_after_ms or t.judge_after_ms
    t.sure_end_prob = t.sure_end_prob if args.sure_end_prob is None else args.sure_end_prob
    vopts.draft = args.draft
    vopts.blas_threads = vopts.blas_threads if args.blas_threads is None else args.blas_threads
    return vopts


def generation_flags(args: argparse.Namespace) -> dict[str, object]:
    """The generator settings a config changes (set on the one shared generator before each turn)."""
    return {"lookahead": not args.no_lookahead, "check": args.check}


def summarise(rows: list[dict], vopts: VoiceOptions) -> dict:
    e2a = [r["end_of_speech_to_first_audio_ms"] for r in rows if r["end_of_speech_to_first_audio_ms"] is not None]
    ep2a = [r["endpoint_to_first_audio_ms"] for r in rows if r["endpoint_to_first_audio_ms"] is not None]
    stages = {
        k: pct([r["timings_ms"][k] for r in rows if r["timings_ms"][k] is not None], 50) for k in rows[0]["timings_ms"]
    }
    by_judge: dict[str, list[float]] = {}  # the p50 falls between these clusters: report each
    for r in rows:
        if r["endpoint_to_first_audio_ms"] is not None and r.get("end_of_turn") is not None:
            judge = TurnDecision(**r["end_of_turn"]).judged_by
            by_judge.setdefault(judge, []).append(r["endpoint_to_first_audio_ms"])
    return {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "n": len(rows),
        "options": {
            "speculative": vopts.speculative,
            "prefill_partials": vopts.prefill_partials,
            "prefill_complete": vopts.prefill_complete,
            "first_chunk_priority": vopts.first_chunk_priority,
            "speculate_after_ms": vopts.speculate_after_ms,
            "first_max_words": vopts.tts.first_max_words,
            "piece_growth": vopts.tts.piece_growth,
            "synth_low_water_s": vopts.synth_low_water_s,
            "tts_spin_wait": vopts.tts.spin_wait,
            "tts_cache_max_words": vopts.tts.cache_max_words,
            "stop_delay_ms": vopts.vad.stop_delay_ms,
            "asr_threads": vopts.asr.cpu_threads,
            "partial_interval_ms": vopts.asr.partial_interval_ms,
            "blas_threads": vopts.blas_threads,
        },
        "eos_to_first_audio_ms": {
            "p50": pct(e2a, 50),
            "p95": pct(e2a, 95),
            "under_150_pct": 100 * np.mean(np.array(e2a) < 150),
        },
        "endpoint_to_first_audio_ms": {
            "p50": pct(ep2a, 50),
            "p95": pct(ep2a, 95),
            "under_150_pct": 100 * np.mean(np.array(ep2a) < 150),
            "by_judge": {k: {"n": len(v), "p50": pct(v, 50)} for k, v in sorted(by_judge.items())},
        },
        "stage_p50_ms_after_speech_end": stages,
        "playback_gaps": {
            "turns_with_gap_pct": 100 * float(np.mean([r["playback_gaps"] > 0 for r in rows])),
            "gaps_per_turn": float(np.mean([r["playback_gaps"] for r in rows])),
            "gap_ms_per_turn_p50": pct([r["playback_gap_ms"] for r in rows], 50),
            "gap_ms_per_turn_p95": pct([r["playback_gap_ms"] for r in rows], 95),
            "reply_s_played_mean": float(np.mean([r["reply_seconds"] for r in rows])),
        },
        "drafts": {  # drafts started per turn, and the tokens of those not used (all, and the cloud's)
            "per_turn": float(np.mean([r["drafts"] for r in rows])),
            "wasted_tokens_per_turn": float(np.mean([r["wasted_draft_tokens"] for r in rows])),
            "wasted_cloud_tokens_per_turn": float(np.mean([r["wasted_draft_cloud_tokens"] for r in rows])),
        },
        "first_piece_cached_pct": 100 * float(np.mean([bool(r["first_piece_cached"]) for r in rows])),
        "wer_mean": float(np.mean([r["wer"] for r in rows])),
        "cloud_token_share": cloud_token_share([r["answer"] for r in rows]),
    }


def cloud_token_share(answers: list[dict | None]) -> float:
    """The cloud's share of all the answers' tokens (a turn with no answer counts none)."""
    answers = [a for a in answers if a is not None]
    return float(sum(a["n_cloud_tokens"] for a in answers) / max(1, sum(a["n_tokens"] for a in answers)))


def offline_transcript(tx: Transcriber, audio: np.ndarray) -> str:
    """The whole WAV decoded offline, the reference streaming recognition is held to: faster-whisper's own
    `transcribe` (30 s context, no VAD), the same tiny.en model."""
    segs, _ = tx.model.transcribe(
        audio, language="en", beam_size=1, without_timestamps=True, condition_on_previous_text=False, vad_filter=False
    )
    return " ".join(s.text.strip() for s in segs).strip()


def query_voice(args: argparse.Namespace) -> Synthesizer:
    """The voice that speaks the queries: Piper sampling its prosody, or with `--same-speech` without
    sampling, so that the audio is the same in every run. A synthesiser of its own without a cache: the
    queries never fill the cache of a synthesiser that speaks the replies."""
    if args.same_speech:
        return Synthesizer(TtsOptions(noise_scale=0.0, noise_w_scale=0.0, warm_openers=False, cache_max_words=0))
    return Synthesizer(TtsOptions(warm_openers=False, cache_max_words=0))


def recognition(args: argparse.Namespace, data: dict) -> None:
    """Offline vs streaming-final WER (and decode time) on the same WAVs, no language model."""

    synth = query_voice(args)
    models = {"tiny.en": Transcriber(AsrOptions()), "tiny.en, no lead silence": Transcriber(AsrOptions(lead_s=0.0))}
    if args.whisper_dir:
        models[Path(args.whisper_dir).name] = Transcriber(AsrOptions(model_dir=args.whisper_dir))
    items = query_items(data, args.n, args.seed, pauses=True)
    tmp = Path(tempfile.mkdtemp(prefix="voice-asr-"))
    out: dict = {"command": " ".join(["python", "scripts/bench_voice.py", *sys.argv[1:]]), "models": {}}
    rows: list[dict] = []
    for i, (kind, q, text, pauses) in enumerate(items):
        wav = tmp / f"q{i}.wav"
        if (spoken_wav_with_pauses(synth, text, pauses, wav) if pauses else spoken_wav(synth, text, wav)) is None:
            continue
        audio, _ = read_wav(wav)
        row: dict = {"set": kind, "query": q, "spoken": text}
        for name, tx in models.items():
            t = time.perf_counter()
            off = offline_transcript(tx, audio)
            t_off = time.perf_counter() - t
            t = time.perf_counter()
            stream = streaming_final(tx, audio, VadOptions(), AsrOptions().max_gap_ms)
            t_stream = time.perf_counter() - t
            ref = without_fillers(q)
            row[name] = {
                "offline": off,
                "streaming": stream,
                "wer_offline": wer(ref, without_fillers(off)),
                "wer_streaming": wer(ref, without_fillers(stream)),
                "offline_s": t_off,
                "streaming_s": t_stream,
            }
        rows.append(row)
        print(
            f"{i:3d} {kind:6s} "
            + "  ".join(f"{n}: off {row[n]['wer_offline']:.2f} str {row[n]['wer_streaming']:.2f}" for n in models)
            + f"  {text!r} -> {row['tiny.en']['streaming']!r}",
            flush=True,
        )
    for name in models:
        out["models"][name] = {
            kind: {
                "n": len(rs),
                "wer_offline": float(np.mean([r[name]["wer_offline"] for r in rs])),
                "wer_streaming": float(np.mean([r[name]["wer_streaming"] for r in rs])),
                "offline_decode_ms_p50": 1000 * pct([r[name]["offline_s"] for r in rs], 50),
                "streaming_replay_ms_p50": 1000 * pct([r[name]["streaming_s"] for r in rs], 50),
            }
            for kind in ("fluent", "pauses", "all")
            for rs in [[r for r in rows if kind == "all" or r["set"] == kind]]
        }
    out["rows"] = rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["models"], indent=1))


def turn_study(args: argparse.Namespace, data: dict) -> None:
    """The end-of-turn judge replayed offline at every pause of paused and fluent syntheses: the speculative
    final decode (text, Whisper's last-word probability) and Smart Turn 64 ms into the pause, as the pipeline
    makes them; a turn is cut off when a pause the person resumed from lasts at least the wait the judge sets.
    Compares the transcript cue with and without the word probability (docs/journal/voice.md)."""
    from edge_client.voice.asr import close_gaps
    from edge_client.voice.endofturn import EndOfTurn, SmartTurn

    synth, tx, st = query_voice(args), Transcriber(AsrOptions()), SmartTurn()
    judges = {
        "before (function words)": TurnOptions(unsure_word_prob=0.0, sure_end_prob=1.0),
        "+ unsure sound-alikes": TurnOptions(sure_end_prob=1.0),
        "now (+ a sure question skips Smart Turn)": TurnOptions(),
    }
    val = data["val"]
    step = max(1, len(val) // args.n)
    items = [("fluent", val[i * step][0], {}) for i in range(args.n)]
    for seed in range(args.seed, args.seed + args.seeds):
        items += [("pauses", text, p) for _, text, p in pause_set(data, args.n, seed)]
    tmp = Path(tempfile.mkdtemp(prefix="voice-turn-"))
    rows = []
    for i, (kind, text, pauses) in enumerate(items):
        wav = tmp / f"q{i}.wav"
        if (spoken_wav_with_pauses(synth, text, pauses, wav) if pauses else spoken_wav(synth, text, wav)) is None:
            continue
        frames, voiced, found = replay_vad(read_wav(wav)[0], VadOptions())
        judged = []
        for pz in found:
            if pz["resumed"] and pz["ms"] < TurnOptions().min_wait_ms:
                continue  # a dip that no judgement could end the turn at
            k = pz["frames"]
            rec = tx.recognize(close_gaps(frames[:k], voiced[:k], 9), final=True)
            judged.append(
                pz | {"text": rec.text, "p_word": rec.last_word_prob, "p_turn": st(np.concatenate(frames[: k + 1]))}
            )
        rows.append({"set": kind, "spoken": text, "pauses": judged})
        print(
            f"{i:3d} {kind:6s} " + " | ".join(f"{j['ms']:.0f} ms {j['text']!r} p={j['p_turn']:.2f}" for j in judged),
            flush=True,
        )
    out: dict = {"command": " ".join(["python", "scripts/bench_voice.py", *sys.argv[1:]]), "judges": {}}
    for name, topts in judges.items():
        eot = EndOfTurn(topts, model=object())
        out["judges"][name] = {}
        for kind in ("fluent", "pauses"):
            rs, cut, ends = [r for r in rows if r["set"] == kind], 0, []
            for r in rs:
                for j in r["pauses"]:
                    d = eot.new_decision()
                    d.probability = j["p_turn"]
                    eot.judge_text(d, j["text"], j["p_word"])
                    wait = eot.wait_ms(d, 250, text_known=True)
                    if not j["resumed"]:
                        ends.append(wait)
                        break
                    if j["ms"] >= wait:
                        cut += 1
                        break
            out["judges"][name][kind] = {
                "n": len(rs),
                "cut_off_pct": 100 * cut / max(1, len(rs)),
                "end_wait_ms": {"p50": pct(ends, 50), "p75": pct(ends, 75), "mean": float(np.mean(ends))},
                "long_wait_at_end_pct": 100 * float(np.mean(np.array(ends) > TurnOptions().min_wait_ms)),
            }
    out["rows"] = rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["judges"], indent=1))


def pause_set(data: dict, n: int, seed: int) -> list[tuple[str, str, dict[int, int]]]:
    """n (query, text to speak, pauses) from CLINC150 train + val, seeded."""
    rng = np.random.default_rng(seed)
    pool = [q for q, _ in data["train"] + data["val"]]
    out = []
    for i in rng.permutation(len(pool)):
        pq = pause_query(pool[i], rng)
        if pq is not None:
            out.append((pool[i], pq[0], pq[1]))
        if len(out) >= n:
            break
    return out


def paired(rows_a: list[dict], rows_b: list[dict], key: str) -> dict:
    diff = [b[key] - a[key] for a, b in zip(rows_a, rows_b) if a.get(key) is not None and b.get(key) is not None]
    return {
        "median": pct(diff, 50),
        "mean": float(np.mean(diff)) if diff else float("nan"),
        "b_slower_pct": 100 * float(np.mean(np.array(diff) > 0)) if diff else float("nan"),
    }


def turn_taking(rows: list[dict]) -> dict:
    """Cut-offs, latency from the true end of the utterance, WER and drafts, for the --pauses report."""
    cut = [r for r in rows if r["cut_off"]]
    true_e2a = [
        r["true_eos_to_first_audio_ms"]
        for r in rows
        if not r["cut_off"] and r["true_eos_to_first_audio_ms"] is not None
    ]
    ep2a = [r["endpoint_to_first_audio_ms"] for r in rows if r["endpoint_to_first_audio_ms"] is not None]
    eot = [r["end_of_turn"] for r in rows if r.get("end_of_turn")]
    return {
        "n": len(rows),
        "false_cut_off_pct": 100 * len(cut) / max(1, len(rows)),
        "ended_early_pct": 100
        * float(np.mean([r["ended_early"] for r in rows])),  # the turn was judged over before the last word
        "true_eos_to_first_audio_ms": {"p50": pct(true_e2a, 50), "p95": pct(true_e2a, 95), "n": len(true_e2a)},
        "endpoint_to_first_audio_ms": {"p50": pct(ep2a, 50), "p95": pct(ep2a, 95)},
        "wer_mean": float(np.mean([r["wer"] for r in rows])),
        "wer_offline_mean": float(
            np.mean([r["wer_offline"] for r in rows])
        ),  # the same audio decoded whole, 30 s context
        "draft_hit_pct": 100 * float(np.mean([r["draft"] == "hit" for r in rows])),
        "judged_finished_pct": 100 * float(np.mean([bool(e["finished"]) for e in eot])) if eot else float("nan"),
        "smart_turn_ms_p50": pct([e["model_ms"] for e in eot if e.get("model_ms") is not None], 50),
    }


def ab_configs(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[tuple], str | None]:
    """The configs to run, (name, voice options, generation flags): "a" from the command line, and "b" with
    the --compare flags on top (with --pauses, silence-only turns by default); and those flags."""
    configs = [("a", voice_options(args), generation_flags(args))]
    compare = args.compare or ("--turn-mode silence" if args.pauses else None)
    if compare:
        args_b = ap.parse_args(sys.argv[1:] + compare.split())
        if any(getattr(args_b, k) != getattr(args, k) for k in WHOLE_RUN):
            ap.error(
                "--policy, --cloud-cpus, --device-cpus and --busy-cores apply to the whole run: give them outside --compare"
            )
        configs.append(("b", voice_options(args_b), generation_flags(args_b)))
    return configs, compare


def query_items(data: dict, n: int, seed: int, pauses: bool) -> list[tuple[str, str, str, dict[int, int]]]:
    """(set, query, text spoken, pauses): n fluent val queries, then with `pauses` n paused ones."""
    val = data["val"]
    step = max(1, len(val) // n)
    items = [("fluent", val[i * step][0], val[i * step][0], {}) for i in range(n)]
    if pauses:
        items += [("pauses", q, text, p) for q, text, p in pause_set(data, n, seed)]
    return items


def generator_options(ap: argparse.ArgumentParser, args: argparse.Namespace, vopts: VoiceOptions) -> GeneratorOptions:
    """The one generator every config shares (the loopback cloud), checked; the pipeline pinned to its CPUs."""
    gen_opts = GeneratorOptions(
        cloud="local", cloud_cpus=args.cloud_cpus or "", policy=args.policy, max_tokens=vopts.max_tokens, seed=0
    )
    try:
        gen_opts.validate()
        if args.device_cpus:
            pin_to_cpus(args.device_cpus)
    except ValueError as exc:
        ap.error(str(exc))
    return gen_opts


def config_engines(gen: VoiceGenerator, configs: list[tuple]) -> tuple[Engines, dict, dict]:
    """The shared engines, and each config's synthesiser and recogniser, warmed up."""
    first = configs[0][1]
    eng = Engines(gen, first.asr, first.tts, first.dialogue.system_prompt, TurnOptions())
    # Every config has a synthesiser of its own, so its own cache of short pieces: with one shared, the
    # config that spoke a query's reply second found its first piece cached (~80 ms sooner). A config with
    # other recogniser options gets its own recogniser (a recogniser keeps nothing between decodes).
    synths = {name: eng.synth if name == configs[0][0] else Synthesizer(v.tts) for name, v, _ in configs}
    recognisers = {name: eng.transcriber if v.asr == first.asr else Transcriber(v.asr) for name, v, _ in configs}
    for tx in recognisers.values():
        tx.recognize(np.zeros(16000, np.float32), final=True)  # warm-up, as Engines does
    return eng, synths, recognisers


def speak_query(speaker: Synthesizer, text: str, pauses: dict[int, int], wav: Path) -> float | None:
    """Speak the query into `wav`; the true end of its speech in seconds (None: no pause found to make)."""
    if pauses:
        return spoken_wav_with_pauses(speaker, text, pauses, wav)
    spoken_wav(speaker, text, wav)
    return speech_span(*read_wav(wav))[1]


def against_the_query(obj: dict, q: str, true_end: float, offline: str) -> dict:
    """How a turn did against what was said: WER (and the offline decode's), cut off or ended before the
    last word, and end of speech -> first audio from the true end."""
    first_audio = obj.get("input_first_audio_s")
    return {
        "wer": wer(without_fillers(q), without_fillers(obj["transcript"])),
        "true_end_s": round(float(true_end), 4),
        "offline_transcript": offline,
        "wer_offline": wer(without_fillers(q), without_fillers(offline)),
        "cut_off": bool(first_audio is not None and first_audio < true_end),
        "ended_early": bool(obj.get("input_endpoint_s") is not None and obj["input_endpoint_s"] < true_end),
        "true_eos_to_first_audio_ms": None if first_audio is None else round((first_audio - true_end) * 1000, 1),
    }


def row_line(i: int, name: str, kind: str, obj: dict, reply_s: float) -> str:
    """The progress line of one config's turn: its latency from the true end, how the turn ended, its WER."""
    e = obj["end_of_turn"] or {}
    return (
        f"{i:2d}{name} {kind:6s} "
        f"eos->audio {obj['true_eos_to_first_audio_ms']:7.1f} ms (true end)  "
        f"endpoint->audio {obj['endpoint_to_first_audio_ms']:7.1f} ms  "
        f"{'CUT OFF ' if obj['cut_off'] else ('ENDED EARLY ' if obj['ended_early'] else '')}"
        f"p={e.get('probability')} last word p={e.get('last_word_prob')} wait={e.get('wait_ms')} "
        f"draft={obj['draft']}  wer {obj['wer']:.2f}  "
        f"{'gaps %d (%.0f ms)  ' % (obj['playback_gaps'], obj['playback_gap_ms']) if reply_s else ''}"
        f"{obj['spoken']!r} -> {obj['transcript']!r}"
    )


def run_queries(
    args: argparse.Namespace, configs: list[tuple], items: list[tuple], gen_opts: GeneratorOptions
) -> tuple[dict[str, list[dict]], list[dict]]:
    """Every query through every config (the order alternating), one turn each: the rows per config, and
    the busy processes' report."""
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    tmp = Path(tempfile.mkdtemp(prefix="voice-bench-"))
    with open_generator(gen_opts) as gen:
        eng, synths, recognisers = config_engines(gen, configs)
        speaker = query_voice(args)
        busy = BusyCores(args.busy_cores).start()  # once the models are loaded: the turns run beside it
        for i, (kind, q, text, pauses) in enumerate(items):
            wav = tmp / f"q{i}.wav"
            true_end = speak_query(speaker, text, pauses, wav)
            if true_end is None:
                print(f"{i:2d} skipped: no pause found in the synthesised {text!r}")
                continue
            offline = offline_transcript(recognisers["a"], read_wav(wav)[0])
            order = configs if i % 2 == 0 else configs[::-1]  # alternate: neither always runs on a warmer cache
            for name, vopts, flags in order:
                gen.reconfigure(lookahead=flags["lookahead"], check=flags["check"])
                eng.synth, eng.transcriber = synths[name], recognisers[name]
                t = time.monotonic()
                out = str(tmp / f"r{i}{name}.wav")
                obj = run_file_turn(gen, str(wav), out, vopts, realtime=True, engines=eng, reply_limit_s=args.reply_s)
                obj.update(set=kind, query=q, spoken=text, pauses_ms=list(pauses.values()))
                obj.update(wall_s=time.monotonic() - t, **against_the_query(obj, q, true_end, offline))
                rows[name].append(obj)
                print(row_line(i, name if len(configs) > 1 else "", kind, obj, args.reply_s), flush=True)
        busy_report = busy.stop()
    return rows, busy_report


def report(
    args: argparse.Namespace, configs: list[tuple], compare: str | None, rows: dict[str, list[dict]], busy: list[dict]
) -> dict:
    """The run's report: where it ran, each config's summary and turn-taking, the paired differences."""
    result: dict = {
        "command": " ".join(["python", "scripts/bench_voice.py", *sys.argv[1:]]),
        "policy": args.policy,
        # competing processes that each spun a Python loop for the whole run (--busy-cores)
        "busy_cores": busy,
        "cpus": {"device": format_cpus(os.sched_getaffinity(0)), "cloud": args.cloud_cpus or "the device's"},
        "configs": {},
    }
    for name, vopts, flags in configs:
        fluent = [r for r in rows[name] if r["set"] == "fluent"]
        result["configs"][name] = {
            "flags": "" if name == "a" else compare,
            "summary": summarise(fluent, vopts) | flags | {"turn": vars(vopts.turn), "draft": vopts.draft},
            "turn_taking": {
                kind: turn_taking([r for r in rows[name] if r["set"] == kind])
                for kind in ("fluent", "pauses")
                if any(r["set"] == kind for r in rows[name])
            },
        }
    if compare:
        result["paired_b_minus_a_ms"] = {
            kind: {
                key: paired([r for r in rows["a"] if r["set"] == kind], [r for r in rows["b"] if r["set"] == kind], key)
                for key in ("end_of_speech_to_first_audio_ms", "true_eos_to_first_audio_ms")
            }
            for kind in ("fluent", "pauses")
            if any(r["set"] == kind for r in rows["a"])
        }
    result["rows"] = rows
    return result


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    configs, compare = ab_configs(ap, args)
    data = json.load(open(args.data))
    if args.recognition:
        return recognition(args, data)
    if args.turn_study:
        return turn_study(args, data)
    items = query_items(data, args.n, args.seed, pauses=args.pauses)
    gen_opts = generator_options(ap, args, configs[0][1])
    rows, busy = run_queries(args, configs, items, gen_opts)
    result = report(args, configs, compare, rows, busy)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
