"""The desktop app's latency against `file` mode: the same spoken queries, both arms side by side in one run.

    python scripts/bench_app.py [--n 30] [--out build/app_bench.json] [--mic fake|pulse]

Arm "file": `run_file_turn` at real-time pace (as scripts/bench_voice.py runs it). Arm "page": the app's page
in a real headless Chromium (the app's server and pipeline in this process, with `reply_limit_s=0`): the
page captures the query (getUserMedia, echo cancellation, noise suppression and gain control on), streams it
over the WebSocket to the same pipeline, plays the reply with WebAudio and reports when it played the first
sample. Each turn stops once its first audio is out; arms alternate which goes first.

The page's microphone (`--mic`): "fake" (default), Chromium's fake capture device playing the query after a
2.5 s lead (a fresh browser per query; while the file arm runs, no browser runs); "pulse", a private
PulseAudio fed with paplay (one browser for the run; its null-sink monitor delivers the audio in bursts,
which the pipeline sees as capture jitter: a harness artefact), which also reports "played into the mic ->
first audio" from paplay's start, the capture path included.

Reported per arm: end of speech -> first audio from the true end of speech (the WAV's; for the page, the
sample the app received for it, found by aligning what the app received with what the fake microphone played),
the goal's measure, and from the end of speech the pipeline's VAD found (each arm's own audio: Chromium's
processing moves it), each p50/p95 and the paired per-query difference; endpoint -> first audio, the stage
p50s (and their paired differences), the WER; for the page, the frames' lateness (receipt minus estimated
capture time), sent -> played (the server sending the first reply audio to the page's player taking it, as
the page stamps it) and the browser's output latency. `--pool` pools earlier runs' output files. Queries: CLINC150 val
(Larson et al. 2019, CC BY 3.0), every len/n-th, synthesised with the bundled Piper voice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_webapp_browser import chromium, pulse_env, served_app  # noqa: E402
from voice_audio import speech_span, spoken_wav, virtual_devices, wer  # noqa: E402

from edge_client.voice.audio_io import PIPELINE_RATE  # noqa: E402
from edge_client.voice.cli import run_file_turn  # noqa: E402
from edge_client.voice.pipeline import VoiceOptions  # noqa: E402
from edge_client.voice.turn_record import turn_json  # noqa: E402
from edge_client.voice.wavfile import read_wav, write_wav  # noqa: E402
from edge_client.webapp.bridge import BrowserMicrophone  # noqa: E402
from edge_client.webapp.core import AppCore  # noqa: E402
from edge_client.webapp.server import AppServer  # noqa: E402

DATA = Path("/work/shared/datasets/clinc150/data_full.json")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def summary(rows: list[dict], key: str = "end_of_speech_to_first_audio_ms") -> dict:
    e2a = [r[key] for r in rows if r.get(key) is not None]
    ep = [r["endpoint_to_first_audio_ms"] for r in rows if r.get("endpoint_to_first_audio_ms") is not None]
    stages = (
        {
            k: round(pct([r["timings_ms"][k] for r in rows if r["timings_ms"].get(k) is not None], 50), 1)
            for k in rows[0]["timings_ms"]
        }
        if rows
        else {}
    )
    return {
        "n": len(e2a),
        "eos_to_first_audio_ms": {"p50": round(pct(e2a, 50), 1), "p95": round(pct(e2a, 95), 1)},
        "endpoint_to_first_audio_ms": {"p50": round(pct(ep, 50), 1), "p95": round(pct(ep, 95), 1)},
        "stage_p50_ms_after_speech_end": stages,
        "wer_mean": round(float(np.mean([r["wer"] for r in rows])), 3),
    }


CAPTURED: list[tuple[bytes, float]] = []  # the page's frames as the app got them: (int16 bytes, capture time)


def record_capture() -> None:
    """Keep every frame the app's microphone receives, with the capture time it stamps on it."""
    push = BrowserMicrophone.push

    def recording_push(self: BrowserMicrophone, data: bytes, t_recv: float | None = None) -> None:
        t_recv = time.monotonic() if t_recv is None else t_recv
        n = self.frames_in
        push(self, data, t_recv)
        if self.frames_in > n:
            CAPTURED.append((data, t_recv - self.lateness_ms[-1] / 1000))

    BrowserMicrophone.push = recording_push  # type: ignore[method-assign]


def capture_time(captured: list[tuple[bytes, float]], played: np.ndarray, at_s: float) -> tuple[float, float]:
    """When the app got the sample `at_s` seconds into `played` (what the fake microphone played), and how
    well the two align (normalised correlation peak): the page's audio (echo cancellation, noise
    suppression and gain control on) is aligned with the file by cross-correlation."""
    x = np.concatenate([np.frombuffer(d, "<i2") for d, _ in captured]).astype(np.float32) / 32768.0
    ends = np.cumsum([len(d) // 2 for d, _ in captured])  # the sample index after each frame
    nfft = 1 << (len(x) + len(played)).bit_length()
    corr = np.fft.irfft(np.fft.rfft(played, nfft) * np.conj(np.fft.rfft(x, nfft)), nfft)
    lag = int(np.argmax(corr))  # x[i] ~ played[i + lag]
    if lag > nfft // 2:
        lag -= nfft
    seg = played[max(0, lag) : max(0, lag) + len(x)]
    peak = float(corr[lag] / (np.linalg.norm(seg) * np.linalg.norm(x) + 1e-9))
    i = int(round(at_s * PIPELINE_RATE)) - lag
    f = min(int(np.searchsorted(ends, i, side="right")), len(ends) - 1)
    return captured[f][1] - (ends[f] - 1 - i) / PIPELINE_RATE, peak


def page_minus_file(rows: dict[str, list[dict]], key: str) -> dict:
    """Page minus file for one measure: at p50, and paired per query (turns with a value in both arms),
    with a bootstrap 95 % interval for the paired median."""
    pairs = zip(rows["file"], rows["page"])
    diffs = [b[key] - a[key] for a, b in pairs if a.get(key) is not None and b.get(key) is not None]
    f = [r[key] for r in rows["file"] if r.get(key) is not None]  # (runs before a measure existed lack it)
    p = [r[key] for r in rows["page"] if r.get(key) is not None]
    rng = np.random.default_rng(0)
    boot = [np.median(rng.choice(diffs, len(diffs))) for _ in range(2000)] if diffs else []
    return {
        "p50_difference": round(pct(p, 50) - pct(f, 50), 1) if f and p else None,
        "paired_median": round(pct(diffs, 50), 1) if diffs else None,
        "paired_median_95pct": [round(float(x), 1) for x in np.percentile(boot, [2.5, 97.5])] if boot else None,
        "paired_mean": round(float(np.mean(diffs)), 1) if diffs else None,
        "page_slower_pct": round(100 * float(np.mean(np.array(diffs) > 0)), 1) if diffs else None,
        "n_paired": len(diffs),
    }


def pool(paths: list[str]) -> None:
    """Page minus file over the rows of several runs (each run's pairs stay pairs)."""
    rows: dict[str, list[dict]] = {"file": [], "page": []}
    for path in paths:
        run = json.loads(Path(path).read_text())["rows"]
        n = min(len(run["file"]), len(run["page"]))
        rows["file"] += run["file"][:n]
        rows["page"] += run["page"][:n]
    out: dict = {"runs": paths, "queries": len(rows["file"])}
    for key in ("true_eos_to_first_audio_ms", "end_of_speech_to_first_audio_ms"):
        out[key] = page_minus_file(rows, key)
    print(json.dumps(out, indent=1))


def page_turn(
    core: AppCore,
    srv: AppServer,
    d,
    dev,
    wav: Path,
    eos_offset: float,
    got: threading.Event,
    done: list,
    lead_wav: Path,
    lead_s: float = 2.5,
) -> dict | None:
    """One query through the page: a fresh Chromium whose fake microphone plays the query after `lead_s`
    (while it settles), or, with PulseAudio (`dev`), the open page reloaded and the query played with paplay."""
    if dev is None:
        x, rate = read_wav(wav)
        write_wav(
            lead_wav,
            np.concatenate([np.zeros(int(lead_s * rate), np.float32), x, np.zeros(3 * rate, np.float32)]),
            rate,
        )
        CAPTURED.clear()
        with chromium(srv.url, lead_wav) as page:
            ok = got.wait(60)
            out_latency = page.execute_script("return S.playCtx && S.playCtx.outputLatency") or 0
            browser_play_ms = page.execute_script("return window.trStats.firstPlayDelayMs")
            session = core.active
        t_play = None
    else:
        d.get(srv.url)
        t_end = time.monotonic() + 30
        while not (core.active is not None and core.active.pipe is not None and core.active.mic.frames_in > 100):
            if time.monotonic() > t_end:
                raise RuntimeError("the page did not start")
            time.sleep(0.05)
        got.clear()
        done.clear()
        t_play = time.monotonic()
        subprocess.run(["paplay", "--device=mic", "--latency-msec=10", str(wav)], env=dev.env, check=True, timeout=30)
        ok = got.wait(30)
        out_latency = d.execute_script("return S.playCtx.outputLatency") or 0
        browser_play_ms = d.execute_script("return window.trStats.firstPlayDelayMs")
        session = core.active
        d.get("about:blank")
    if not ok:
        return None
    t = done[0]
    obj = turn_json(t)
    fa = t.timings.first_audio_out
    obj["played_eos_to_first_audio_ms"] = (
        None if fa is None or t_play is None else round((fa - t_play - eos_offset) * 1000, 1)
    )
    obj["true_eos_to_first_audio_ms"] = obj["played_eos_to_first_audio_ms"]  # PulseAudio: from paplay's start
    obj["alignment"] = None
    if dev is None and CAPTURED:  # the fake microphone: from the WAV's true end of speech
        t_end, peak = capture_time(CAPTURED, read_wav(lead_wav)[0], lead_s + eos_offset)
        obj["alignment"] = round(peak, 3)
        obj["true_eos_to_first_audio_ms"] = None if fa is None else round((fa - t_end) * 1000, 1)
    late = list(session.mic.lateness_ms) if session is not None and session.mic is not None else []
    buf = session.sink.buffer if session is not None else None
    obj["sent_to_played_ms"] = (
        round((buf.first_out_t - buf.first_sent_t) * 1000, 1)
        if buf is not None and buf.first_out_t and buf.first_sent_t
        else None
    )
    obj["browser_chunk_to_played_ms"] = browser_play_ms
    obj["frame_lateness_ms"] = {"p50": round(pct(late, 50), 1), "p95": round(pct(late, 95), 1)}
    obj["output_latency_ms"] = round(1000 * out_latency, 1)
    time.sleep(0.3)
    return obj


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", default=str(ROOT / "build" / "app_bench.json"))
    ap.add_argument(
        "--lead", type=float, default=2.5, help="--mic fake: seconds of silence before the query (the browser settles)"
    )
    ap.add_argument(
        "--mic",
        choices=["fake", "pulse"],
        default="fake",
        help="the page's microphone: Chromium's fake capture device playing the query (a fresh browser per "
        "query), or a private PulseAudio fed with paplay (one browser; its null-sink buffering adds latency)",
    )
    ap.add_argument(
        "--pool",
        nargs="+",
        metavar="JSON",
        help="no run: page minus file pooled over the rows of earlier runs' --out files (a single run of 30 "
        "scatters by tens of ms), with a bootstrap interval for the paired median",
    )
    return ap


def file_turn(core: AppCore, wav: Path, out: Path, eos_offset: float) -> dict:
    """One query through `run_file_turn` on the app's own engines, from the WAV's true end of speech too."""
    obj = run_file_turn(
        core.gen, str(wav), str(out), VoiceOptions(), realtime=True, engines=core.engines, reply_limit_s=0.0
    )
    fa = obj.get("input_first_audio_s")
    obj["true_eos_to_first_audio_ms"] = None if fa is None else round((fa - eos_offset) * 1000, 1)
    return obj


def row_line(i: int, arm: str, obj: dict) -> str:
    """The progress line of one arm's turn (the page's with what only it measures)."""
    extra = ""
    if arm == "page":
        extra = (
            f"  (frame lateness p50/p95 {obj['frame_lateness_ms']['p50']}/{obj['frame_lateness_ms']['p95']} ms,"
            f" sent -> played {obj['sent_to_played_ms']} ms"
        )
        if obj.get("alignment") is not None:
            extra += f", alignment {obj['alignment']}"
        if obj.get("played_eos_to_first_audio_ms") is not None:
            extra += f", played into the mic -> audio {obj['played_eos_to_first_audio_ms']} ms"
        extra += ")"
    return (
        f"{i:2d} {arm:4s} eos->audio {obj['end_of_speech_to_first_audio_ms']} ms"
        f" (true end {obj['true_eos_to_first_audio_ms']} ms){extra}"
        f"  wer {obj['wer']:.2f}  {obj['transcript']!r}"
    )


def run_arms(args: argparse.Namespace, queries: list[str]) -> dict[str, list[dict]]:
    """Every query through both arms, alternating which goes first: the rows per arm."""
    tmp = Path(tempfile.mkdtemp(prefix="app-bench-"))
    rows: dict[str, list[dict]] = {"file": [], "page": []}
    record_capture()
    with contextlib.ExitStack() as stack:
        dev = stack.enter_context(virtual_devices()) if args.mic == "pulse" else None
        env = pulse_env(dev) if dev is not None else None
        core, srv = served_app(stack, tmp / "app.json", reply_limit_s=0.0)  # each turn stops at first audio
        done: list = []
        got = threading.Event()
        core.turn_listeners.append(lambda t: (done.append(t), got.set()))
        d = stack.enter_context(chromium("about:blank", env=env, fake_mic=False)) if dev is not None else None
        for i, q in enumerate(queries):
            wav = spoken_wav(core.engines.synth, q, tmp / f"q{i}.wav")
            eos_offset = speech_span(*read_wav(wav))[1]
            for arm in ("file", "page") if i % 2 == 0 else ("page", "file"):
                if arm == "file":
                    obj = file_turn(core, wav, tmp / f"r{i}.wav", eos_offset)
                else:
                    core.dialogue.reset()
                    got.clear()
                    done.clear()
                    obj = page_turn(core, srv, d, dev, wav, eos_offset, got, done, tmp / f"p{i}.wav", args.lead)
                    if obj is None:
                        raise RuntimeError(f"no turn for query {i}: {q!r}")
                obj["wer"] = wer(q, obj["transcript"])
                obj["query"] = q
                rows[arm].append(obj)
                print(row_line(i, arm, obj), flush=True)
    return rows


def page_summary(rows: dict[str, list[dict]]) -> dict:
    """The page arm's summary: the file arm's measures, the stages' paired differences from the file arm,
    and what only the page has (frame lateness, sent -> played, the browser's output latency, alignment)."""
    page = summary(rows["page"])
    if any(r.get("played_eos_to_first_audio_ms") is not None for r in rows["page"]):
        page["played_into_mic_to_first_audio_ms"] = summary(rows["page"], "played_eos_to_first_audio_ms")[
            "eos_to_first_audio_ms"
        ]
    stages = rows["file"][0]["timings_ms"].keys() if rows["file"] else []
    page["paired_stage_minus_file_median_ms"] = {
        k: round(
            pct(
                [
                    b["timings_ms"][k] - a["timings_ms"][k]
                    for a, b in zip(rows["file"], rows["page"])
                    if a["timings_ms"].get(k) is not None and b["timings_ms"].get(k) is not None
                ],
                50,
            ),
            1,
        )
        for k in stages
    }
    page["frame_lateness_ms_p50"] = pct([r["frame_lateness_ms"]["p50"] for r in rows["page"]], 50)
    page["frame_lateness_ms_p95"] = pct([r["frame_lateness_ms"]["p95"] for r in rows["page"]], 50)
    page["sent_to_played_ms_p50"] = pct(
        [r["sent_to_played_ms"] for r in rows["page"] if r["sent_to_played_ms"] is not None], 50
    )
    page["browser_chunk_to_played_ms_p50"] = pct(
        [r["browser_chunk_to_played_ms"] for r in rows["page"] if r["browser_chunk_to_played_ms"] is not None], 50
    )
    page["output_latency_ms_p50"] = pct([r["output_latency_ms"] for r in rows["page"]], 50)
    page["true_eos_to_first_audio_ms"] = summary(rows["page"], "true_eos_to_first_audio_ms")["eos_to_first_audio_ms"]
    page["alignment_min"] = min((r["alignment"] for r in rows["page"] if r.get("alignment") is not None), default=None)
    return page


def report(rows: dict[str, list[dict]]) -> dict:
    """Both arms' summaries and page minus file, from the true end of speech and from the pipeline's."""
    page = page_summary(rows)
    file = summary(rows["file"])
    file["true_eos_to_first_audio_ms"] = summary(rows["file"], "true_eos_to_first_audio_ms")["eos_to_first_audio_ms"]
    true_end = page_minus_file(rows, "true_eos_to_first_audio_ms")
    return {
        "command": " ".join(["python", "scripts/bench_app.py", *sys.argv[1:]]),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores, {platform.platform()}",
        "file": file,
        "page": page,
        "page_minus_file_ms": {
            "from_the_true_end": true_end,
            "from_the_pipelines_end_of_speech": page_minus_file(rows, "end_of_speech_to_first_audio_ms"),
        },
        "goal_within_60ms": true_end["p50_difference"] is not None and true_end["p50_difference"] <= 60,
        "rows": rows,
    }


def main() -> None:
    args = build_parser().parse_args()
    if args.pool:
        return pool(args.pool)
    val = json.load(open(args.data))["val"]
    step = max(1, len(val) // args.n)
    result = report(run_arms(args, [val[i * step][0] for i in range(args.n)]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
