"""Test helpers for the voice pipeline: a private PulseAudio with virtual devices, and spoken test audio.

`virtual_devices()` starts a PulseAudio daemon of its own (private runtime dir,
so it never touches a desktop session) with two null sinks: "mic" (tests play
speech into it; the app records its monitor as the microphone) and "speaker"
(the app plays into it; tests record its monitor). PortAudio sees PulseAudio
through ALSA's pulse plugin, so an ALSA config names the two ends as devices
`tr_mic` and `tr_speaker`, which the app selects by name like real hardware.
If PulseAudio cannot start, the caller gets pytest.skip with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from edge_client.voice.asr import close_gaps
from edge_client.voice.resample import resample
from edge_client.voice.vad import FRAME, FRAME_S, Endpointer, Ev, SileroVad, VadOptions
from edge_client.voice.wavfile import write_wav

ASOUNDRC = """
pcm.tr_mic {
  type pulse
  device "mic.monitor"
  hint { show on description "TokenRouter test microphone (mic.monitor)" }
}
pcm.tr_speaker {
  type pulse
  device "speaker"
  hint { show on description "TokenRouter test speaker" }
}
"""


class VirtualDevices:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = dict(os.environ, XDG_RUNTIME_DIR=str(root / "run"), HOME=str(root / "home"))

    def pactl(self, *args: str) -> str:
        return subprocess.run(
            ["pactl", *args], env=self.env, check=True, capture_output=True, text=True, timeout=10
        ).stdout

    def play_into_mic(self, wav: Path) -> subprocess.Popen:
        """Start playing a WAV into the virtual microphone; returns at once."""
        return subprocess.Popen(["paplay", "--device=mic", str(wav)], env=self.env)

    @contextlib.contextmanager
    def record_speaker(self, rate: int = 16000) -> Iterator[dict]:
        """Record speaker.monitor; the dict gets "audio" (float32 at `rate`) and "t0" on exit."""
        out: dict = {}
        path = self.root / f"rec_{time.monotonic_ns()}.raw"
        with open(path, "wb") as f:
            p = subprocess.Popen(
                [
                    "parec",
                    "--device=speaker.monitor",
                    "--format=s16le",
                    f"--rate={rate}",
                    "--channels=1",
                    "--latency-msec=10",
                ],
                stdout=f,
                env=self.env,
            )
            out["t0"] = time.monotonic()
            try:
                yield out
            finally:
                time.sleep(0.2)
                p.terminate()
                p.wait(timeout=5)
        out["audio"] = np.frombuffer(path.read_bytes(), "<i2").astype(np.float32) / 32768.0
        out["rate"] = rate


@contextlib.contextmanager
def virtual_devices() -> Iterator[VirtualDevices]:
    """A private PulseAudio daemon with "mic" and "speaker" null sinks, visible to sounddevice."""
    for tool in ("pulseaudio", "pactl", "paplay", "parec"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (apt-get install pulseaudio)")
    root = Path(tempfile.mkdtemp(prefix="tr-pulse-"))
    (root / "run").mkdir()
    (root / "home").mkdir()
    (root / "home" / ".asoundrc").write_text(ASOUNDRC)
    dev = VirtualDevices(root)
    r = subprocess.run(
        [
            "pulseaudio",
            "--daemonize=yes",
            "--exit-idle-time=-1",
            "-n",
            "--load=module-native-protocol-unix",
            "--log-target=stderr",
            "--disallow-exit=no",
        ],
        env=dev.env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    if r.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"PulseAudio cannot start here: {r.stderr.strip()[-300:]}")
    saved = {k: os.environ.get(k) for k in ("XDG_RUNTIME_DIR", "HOME")}
    try:
        for _ in range(50):
            if subprocess.run(["pactl", "info"], env=dev.env, capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        dev.pactl("load-module", "module-null-sink", "sink_name=mic", "rate=16000", "channels=1")
        dev.pactl("load-module", "module-null-sink", "sink_name=speaker", "rate=22050", "channels=1")
        os.environ.update(XDG_RUNTIME_DIR=dev.env["XDG_RUNTIME_DIR"], HOME=dev.env["HOME"])
        import sounddevice as sd

        sd._terminate()  # re-read the ALSA configuration with the new devices
        sd._initialize()
        yield dev
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        subprocess.run(["pulseaudio", "--kill"], env=dev.env, capture_output=True, timeout=10)
        shutil.rmtree(root, ignore_errors=True)


@functools.cache
def speaker():
    """The person in the tests: the bundled Piper voice with its prosody sampling off, so a test hears the
    same audio on every run and machine. The assistant's own voice samples its prosody (as people vary
    theirs), which once made a test pass or fail by the draw; variety belongs in the benchmarks
    (scripts/bench_turns.py, several voices and many samples), not in pass/fail checks."""
    from edge_client.voice.tts import Synthesizer, TtsOptions

    # no cache and no warm-up: every phrase is synthesised afresh (and identically)
    return Synthesizer(TtsOptions(warm_openers=False, cache_max_words=0, noise_scale=0.0, noise_w_scale=0.0))


def spoken_wav(synth, text: str, path: Path, lead_s: float = 0.4, tail_s: float = 0.4, rate: int = 16000) -> Path:
    """Synthesise `text` with `synth` (usually `speaker()`) into a WAV at `rate` with silence around it."""
    a = resample(synth.synthesize(text), synth.rate, rate)
    z = lambda s: np.zeros(int(s * rate), np.float32)  # noqa: E731
    write_wav(path, np.concatenate([z(lead_s), 0.8 * a, z(tail_s)]), rate)
    return path


_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
} | {w: str(10 * i) for i, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split(), start=3)}


def words(text: str) -> list[str]:
    """Lower-case words without punctuation, a number word as its digits: Whisper writes "ten" as "10",
    and a person reading the transcript counts that as heard right."""
    return [_NUMBER_WORDS.get(w, w) for w in re.sub(r"[^a-z0-9' ]", " ", text.lower().replace("-", " ")).split()]


def wer(ref: str, hyp: str) -> float:
    """Word error rate (Levenshtein over words, normalised for case and punctuation)."""
    r, h = words(ref), words(hyp)
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            cur = min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
            prev, d[j] = d[j], cur
    return d[len(h)] / max(len(r), 1)


def speech_span(audio: np.ndarray, rate: int, thresh: float = 0.02) -> tuple[float, float] | None:
    """(first, last) time in seconds where |audio| exceeds `thresh`, or None if silent."""
    idx = np.nonzero(np.abs(audio) > thresh)[0]
    if len(idx) == 0:
        return None
    return idx[0] / rate, idx[-1] / rate


def heard_as(text: str, heard: str) -> float:
    """Similarity in [0, 1] of what was said and what tiny.en heard in the recording, by characters.

    Word error rate punishes one misheard short word too hard on a 7-word reply ("is Paris" heard
    as "prayers" is 43% WER); character similarity still separates the reply (~0.9) from other
    speech (~0.3) or silence (0).
    """
    import difflib

    return difflib.SequenceMatcher(None, " ".join(words(text)), " ".join(words(heard))).ratio()


def _quiet_runs(audio: np.ndarray, rate: int, min_ms: int = 120, thresh: float = 0.01) -> list[tuple[int, int]]:
    """(start, end) sample spans of at least `min_ms` whose 10 ms RMS stays under `thresh`."""
    hop = rate // 100
    rms = np.sqrt(np.convolve(audio.astype(np.float64) ** 2, np.ones(hop) / hop, mode="same"))[::hop]
    runs, start = [], None
    for i, q in enumerate(np.append(rms < thresh, False)):
        if q and start is None:
            start = i
        elif not q and start is not None:
            if (i - start) * 10 >= min_ms:
                runs.append((start * hop, i * hop))
            start = None
    return runs


def paused_speech(synth, text: str, pauses_ms: dict[int, int], rate: int = 16000) -> np.ndarray | None:
    """`text` spoken in one go with commas at word boundaries, the silence at some of them stretched.

    `pauses_ms` maps a comma's index (0-based, counting every comma in `text`) to the total silence
    wanted there. The whole text is synthesised at once so the prosody stays that of one sentence
    (a comma gives a continuing intonation and a ~250 ms pause in Piper); the comma pauses are found
    as the longest quiet runs, in order, and stretched with zeros in their middle. None when the
    pauses cannot be found (fewer long quiet runs than commas).
    """
    a = synth.synthesize(text)
    n_commas = text.count(",")
    runs = _quiet_runs(a[int(0.05 * synth.rate) :], synth.rate)  # skip the leading silence
    runs = [
        (s + int(0.05 * synth.rate), e + int(0.05 * synth.rate)) for s, e in runs if e < len(a) - int(0.1 * synth.rate)
    ]
    if len(runs) < n_commas:
        return None
    commas = sorted(sorted(runs, key=lambda r: r[0] - r[1])[:n_commas])  # the longest, in order
    out, last = [], 0
    for i, (s, e) in enumerate(commas):
        want = pauses_ms.get(i)
        if want is None:
            continue
        mid = (s + e) // 2
        extra = max(0, int(want / 1000 * synth.rate) - (e - s))
        out += [a[last:mid], np.zeros(extra, np.float32)]
        last = mid
    out.append(a[last:])
    return resample(np.concatenate(out), synth.rate, rate)


def spoken_wav_with_pauses(
    synth, text: str, pauses_ms: dict[int, int], path: Path, lead_s: float = 0.4, tail_s: float = 0.4, rate: int = 16000
) -> float | None:
    """Write `paused_speech` to a WAV with silence around it; returns the time (s) of its last word's end, or None."""
    a = paused_speech(synth, text, pauses_ms, rate)
    if a is None:
        return None
    z = lambda s: np.zeros(int(s * rate), np.float32)  # noqa: E731
    audio = np.concatenate([z(lead_s), 0.8 * a, z(tail_s)])
    write_wav(path, audio, rate)
    span = speech_span(audio, rate)
    return None if span is None else span[1]


# Where people hesitate mid-sentence: after a word that needs the next one ("set a timer for… ten
# minutes", "what's the weather in, um, Boston"), often with a filler.
_PAUSE_AFTER = frozenset("the a an my your our to for in on at of with from about and or".split())
FILLERS = ("um", "uh")


def pause_query(
    query: str, rng: np.random.Generator, pause_ms: tuple[int, int] = (300, 900), filler_p: float = 0.35
) -> tuple[str, dict[int, int], float] | None:
    """A CLINC-style query with one natural mid-utterance pause (two in queries of 10+ words).

    Returns (text to speak, with a comma at each pause and maybe a filler, the pauses for
    `paused_speech`, the longest pause in ms), or None when the query has no phrase boundary.
    """
    words = query.replace(",", "").split()
    if len(words) < 4:
        return None
    cands = [i for i in range(2, len(words)) if words[i - 1].lower() in _PAUSE_AFTER]
    if not cands:
        return None
    k = 2 if len(words) >= 10 and len(cands) >= 2 else 1
    cuts = sorted(rng.choice(cands, size=k, replace=False).tolist())
    out, pauses, n_comma = [], {}, 0
    for i, w in enumerate(words):
        if i in cuts:
            out[-1] += ","
            if rng.random() < filler_p:
                out.append(str(rng.choice(FILLERS)) + ",")
                n_comma += 1  # the comma before the filler keeps Piper's own short pause
            pauses[n_comma] = int(rng.integers(pause_ms[0], pause_ms[1] + 1))
            n_comma += 1
        out.append(w)
    return " ".join(out), pauses, float(max(pauses.values()))


def without_fillers(text: str) -> str:
    return " ".join(w for w in words(text) if w not in FILLERS)


def replay_vad(audio: np.ndarray, vad_opts: VadOptions) -> tuple[list[np.ndarray], list[bool], list[dict]]:
    """The VAD run over `audio` frame by frame as the pipeline's Listener._on_vad_frame runs it, with no endpoint:
    the utterance's frames (the pre-roll first), their voiced flags, and each pause (`frames`: the frames
    up to its first silent one, what the speculative final decode gets; `ms`: its length; `resumed`:
    speech came again after it)."""
    vad, ep = SileroVad(), Endpointer(VadOptions(**{**vars(vad_opts), "stop_delay_ms": 10**6}))
    preroll: deque[np.ndarray] = deque(maxlen=max(1, int(vad_opts.preroll_ms / 1000 / FRAME_S)))
    frames: list[np.ndarray] = []
    voiced: list[bool] = []
    pauses: list[dict] = []
    for i in range(len(audio) // FRAME):
        x = audio[i * FRAME : (i + 1) * FRAME]
        prob = vad(x)
        preroll.append(x)
        if ep.state != "idle":
            frames.append(x)
            voiced.append(prob >= vad_opts.neg_threshold)
        ev = ep.update(prob, (i + 1) * FRAME_S)
        if ev is Ev.ONSET:
            frames, voiced = list(preroll), [True] * len(preroll)
        elif ev is Ev.PAUSE:
            pauses.append({"frames": len(frames), "ms": FRAME_S * 1000, "resumed": False})
        elif ev is Ev.RESUME:
            pauses[-1]["resumed"] = True
        elif ep.state == "pause":
            pauses[-1]["ms"] += FRAME_S * 1000
    return frames, voiced, pauses


def streaming_final(tx, audio: np.ndarray, vad_opts: VadOptions, max_gap_ms: int) -> str:
    """The pipeline's final transcript of `audio` when its last pause ends the turn: the frames up to the
    first silent one of the last pause, long pauses shortened; decoded with `tx` (a Transcriber)."""
    frames, voiced, pauses = replay_vad(audio, vad_opts)
    if not pauses or pauses[-1]["resumed"]:
        return ""
    spec = pauses[-1]["frames"]
    return tx.recognize(
        close_gaps(frames[:spec], voiced[:spec], max(1, int(max_gap_ms / 1000 / FRAME_S))), final=True
    ).text


def utterance_at_pause(audio: np.ndarray, vad_opts: VadOptions, max_gap_ms: int, min_pause_ms: int = 200) -> np.ndarray:
    """What the pipeline's speculative final decode gets at the first pause of at least `min_pause_ms`: the
    pre-roll and the frames up to that pause's first silent frame, long pauses before it shortened."""
    frames, voiced, pauses = replay_vad(audio, vad_opts)
    spec = next((p["frames"] for p in pauses if p["ms"] >= min_pause_ms), None)
    if spec is None:
        raise ValueError("no pause that long in the audio")
    return close_gaps(frames[:spec], voiced[:spec], max(1, int(max_gap_ms / 1000 / FRAME_S)))
