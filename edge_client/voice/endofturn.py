"""End of turn: when has the person finished speaking?

Silence alone cannot tell a finished question from a pause mid-sentence ("set a timer for…
ten minutes"): a 250 ms stop delay cut off most of the pause benchmark's turns
(docs/voice.md). This module adds two more inputs and an adaptive wait:

- Smart Turn v3.2 (pipecat-ai's BSD-2 audio model, an 8 MB int8 ONNX file in the `pipecat-ai`
  wheel): the probability that the last up-to-8 s of audio is a finished turn, from intonation
  and rhythm; ~85 ms on one idle core of the 2-core VM, 150-250 ms on a busy one (docs/journal/voice.md).
- the transcript of the speculative final decode, read two ways: the device model's P(end of the
  message) after its last word (edge_client/message_end.py: ~0 after "set a timer for" or "text my
  sister that", 0.1-0.7 after a whole request; it comes from the prefill the answer needs anyway),
  and a rule for what that model cannot see: a last word that is a filler ("um") or a function word
  ("for"), or that sounds like one ("that" for "the") when Whisper was unsure of it (the audio cut
  at a hesitation often comes out so).

Decision: the wait is short only when the signals agree. A transcript that reads as unfinished
(the rule, or P(end) under `text_unfinished_below`) waits `max_wait_ms` whatever the audio says
(Smart Turn judged 30-50 % of hesitations finished, more in voices it was not tuned on); a question
Whisper closed and is sure of, with P(end) agreeing, ends after `min_wait_ms` without asking Smart
Turn; otherwise the wait grows with the largest doubt, the audio's (Smart Turn under its threshold),
the text's (P(end) under `text_finished_from`) and, opted in, the last word's (Whisper unsure of it:
likely misheard, so the transcript cannot say the request is over), from `min_wait_ms` to `max_wait_ms`. With
`mode="silence"` (or when the model file is missing and `on_missing="silence"`) the turn ends after
the stop delay, as before, and the decision says so.
"""

from __future__ import annotations

import importlib.util
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .assets import MissingModelError
from .blas import one_blas_thread

RATE = 16000
SMART_TURN_PACKAGE = "pipecat-ai==1.14.0"
SMART_TURN_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
MODES = ("smart", "silence")
JUDGE_AT = ("pause", "transcript", "first-clause")  # when Smart Turn runs in a pause: TurnOptions.judge_at


def smart_turn_path() -> Path:
    """The Smart Turn v3.2 ONNX file inside the installed `pipecat-ai` wheel (pipecat is never imported:
    its dependencies are heavy, the wheel is installed with --no-deps for this one file)."""
    install = f"pip install --no-deps {SMART_TURN_PACKAGE}"
    spec = importlib.util.find_spec("pipecat")
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelError(
            f"the end-of-turn model {SMART_TURN_FILE} is missing: the 'pipecat-ai' package is not installed; "
            f"run: {install} (or pass --turn-mode silence to end turns on silence alone)"
        )
    p = Path(list(spec.submodule_search_locations)[0]).parent / SMART_TURN_FILE
    if not p.is_file():
        raise MissingModelError(
            f"the end-of-turn model {p} is missing; reinstall: {install} (or pass --turn-mode silence)"
        )
    return p


# ---------------------------------------------------------------------------- features


def _mel_filters(n_fft: int = 400, n_mels: int = 80) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters, (n_fft // 2 + 1, n_mels): Whisper's filterbank."""

    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, np.float64)
        return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) * 27.0 / np.log(6.4), 3.0 * f / 200.0)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), 200.0 * m / 3.0)

    mels = np.linspace(hz_to_mel(np.array(0.0)), hz_to_mel(np.array(RATE / 2)), n_mels + 2)
    hz = mel_to_hz(mels)
    fft_hz = np.linspace(0, RATE // 2, n_fft // 2 + 1)
    slopes = hz[None, :] - fft_hz[:, None]
    down = -slopes[:, :-2] / np.diff(hz)[:-1]
    up = slopes[:, 2:] / np.diff(hz)[1:]
    return np.maximum(0.0, np.minimum(down, up)) * (2.0 / (hz[2:] - hz[:-2]))[None, :]


_FILTERS = _mel_filters()
_WINDOW = np.hanning(401)[:-1]  # periodic Hann, as torch.hann_window


def log_mel_8s(audio: np.ndarray) -> np.ndarray:
    """Whisper-style log-mel (80 x 800) of exactly 8 s of 16 kHz audio, the input Smart Turn v3 was trained on.

    The same as transformers' `WhisperFeatureExtractor(chunk_length=8)` with `do_normalize=True` (Apache-2.0;
    pipecat vendors it in numpy, BSD-2), which pipecat feeds it: zero-mean unit-variance waveform, centred
    400-point STFT with hop 160, power spectrum onto 80 Slaney mel bands, log10, floor at max - 8, (x + 4) / 4.
    """
    x = np.asarray(audio, np.float32)
    n = 8 * RATE
    x = np.pad(x, (0, n - len(x))) if len(x) < n else x[:n]
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), (200, 200), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, 400)[::160]
    power = np.abs(np.fft.rfft(frames * _WINDOW, axis=-1)) ** 2
    mel = np.log10(np.maximum(1e-10, power @ _FILTERS)).T[:, :-1]
    mel = np.maximum(mel, mel.max() - 8.0)
    return ((mel + 4.0) / 4.0).astype(np.float32)


def last_8s(audio: np.ndarray) -> np.ndarray:
    """The last 8 s, zero-padded at the front when shorter (as pipecat does)."""
    n = 8 * RATE
    return audio[-n:] if len(audio) >= n else np.pad(audio, (n - len(audio), 0))


class SmartTurn:
    """Smart Turn v3.2 (int8 ONNX, CPU): probability that the audio so far ends a finished turn."""

    def __init__(self, path: Path | None = None, threads: int = 1) -> None:
        import onnxruntime

        self.path = path or smart_turn_path()
        so = onnxruntime.SessionOptions()
        so.inter_op_num_threads = 1
        so.intra_op_num_threads = threads
        so.log_severity_level = 4
        self._sess = onnxruntime.InferenceSession(str(self.path), sess_options=so, providers=["CPUExecutionProvider"])
        self(np.zeros(RATE, np.float32))  # warm-up: the first run initialises the kernels

    def __call__(self, audio: np.ndarray) -> float:
        with one_blas_thread():  # the same features whatever the process's BLAS threads (blas.py)
            feats = log_mel_8s(last_8s(np.asarray(audio, np.float32)))[None]
        out = self._sess.run(None, {"input_features": feats})
        return float(np.asarray(out[0]).reshape(-1)[0])


# ---------------------------------------------------------------------------- the transcript cue

# Words a finished request rarely ends on: fillers, conjunctions, articles, possessives, prepositions and
# modals ("set a timer for…", "what's the weather in, um,", "how long would…"). Of CLINC150's 18,000
# train/val queries 4% end on one ("where are you from"): those wait the long wait (docs/voice.md).
_OPEN_WORDS = frozenset(
    """um uh ah er erm hmm and or but because if than the a an my your our their of to for in on at with from
    about by into would could should will shall must""".split()
)


# What tiny.en writes for a function word cut off at a hesitation pause, measured on Piper speech (the pause
# benchmark's): "let me know the," -> "...that", "I need help to," -> "...too", "do I need to," -> "Do I need you?",
# "get my," -> "Get mine.", "your," -> "here", "a," -> "I" / "eh", "to," -> "2" / "two", "um," -> "up". Each is also a
# fine last word ("can you help me", "what is it"): 7.5 % of CLINC150's queries end on one. So such a word counts as
# mid-phrase only when Whisper itself was unsure of it (`TurnOptions.unsure_word_prob`): at the cut it gave
# these words p 0.2-0.85, while 3 in 4 real endings on them got > 0.9 (docs/journal/voice.md).
_SOUNDALIKES = frozenset(
    """that this them then there these those i eh mine me might you you're here year too two 2 do four 4 off it
    one end n are our well which up""".split()
)


def sure_ending(text: str, last_word_prob: float | None, sure_from: float) -> bool:
    """The transcript closes itself: it ends on a question mark and Whisper gave its last word a probability
    of at least `sure_from` (1: never). Not a full stop: at a comma pause after a complete clause ("I'm not
    sure if watermelon is on my shopping list, but...") Whisper writes "list." at 0.99, and Smart Turn is
    the one that hears the sentence go on (docs/journal/voice.md). Call it on text that is not mid-phrase."""
    if sure_from >= 1.0 or last_word_prob is None:
        return False
    return text.strip().endswith("?") and last_word_prob >= sure_from


def unfinished_text(text: str, last_word_prob: float | None = None, unsure_below: float = 0.0) -> bool:
    """The transcript ends mid-phrase: on a filler, a function word, a comma, a dash or an ellipsis; or on a
    word that sounds like a function word ("that" for "the", "too" for "to") that Whisper gave a probability
    under `unsure_below` (the last word of a transcript cut at a hesitation)."""
    t = text.strip()
    if not t:
        return True
    if t.endswith(("...", "…", ",", "-", "—", ";", ":")):
        return True
    words = re.findall(r"[a-z0-9']+", t.lower())
    if not words:
        return False
    if words[-1] in _OPEN_WORDS:
        return True
    return words[-1] in _SOUNDALIKES and last_word_prob is not None and last_word_prob < unsure_below


# ---------------------------------------------------------------------------- the decision


@dataclass
class TurnOptions:
    mode: str = "smart"  # "smart": Smart Turn + transcript + adaptive wait; "silence": stop delay only
    min_wait_ms: int = 200  # silence that ends a turn that sounds finished
    max_wait_ms: int = 1200  # silence that ends a turn that sounds unfinished
    threshold: float = 0.5  # Smart Turn probability at or above which the audio sounds finished
    judge_after_ms: int = 64  # silence before Smart Turn runs: one silent frame is often a dip inside a word
    # When Smart Turn runs in a pause (once it is judge_after_ms old): "transcript" (the default), once the final
    # decode is in and only if the transcript does not decide alone; "pause", at once, beside the final decode;
    # "first-clause", once the speculative answer's first piece is synthesised (held), so the audio is ready
    # the moment the turn is judged over, but the first audio came later (paired median +97 ms fluent, +81 ms
    # paused). Measured in docs/journal/voice.md.
    judge_at: str = "transcript"
    text_cue: bool = True  # the transcript counts: the function-word rule and the device model's P(end)
    # The device model's P(end of the message) after the transcript's last word (edge_client/message_end.py):
    # under `text_unfinished_below` the request reads as unfinished (the long wait, whatever the audio says);
    # at or over `text_finished_from` the text agrees with a finished turn; between them the wait grows as
    # P(end) falls (log scale). Chosen on CLINC150 train + val cuts and the pause benchmark's tuning split
    # (scripts/bench_message_end.py, scripts/bench_turns.py; docs/voice.md).
    text_model: bool = True
    text_unfinished_below: float = 0.02
    text_finished_from: float = 0.05
    word_rule: bool = True  # the function-word rule (below) as well: a transcript ending on "for" is unfinished
    # A last word that sounds like a function word ("that", "too", "you") and that Whisper gave a probability
    # under this counts as mid-phrase (0: never)
    unsure_word_prob: float = 0.9
    # A last word Whisper gave a probability under this is likely misheard: a fragment cut at a pause can come out
    # as a finished-looking phrase ("convert fifty" as "Inburg 50.", "what are the" as "Well done, mate."), so
    # the transcript cannot say the request is over. The wait grows as the probability falls under this, on a
    # log scale, to `max_wait_ms` at a tenth of it (0: never, the default). An opt-in trade: at 0.5 (chosen on the
    # pause benchmark's tune split) its test split cut off 5.4 % of paused fragments against 7.5 %, but the wait
    # at fluent ends grew past the dead-air goal (espeak en-gb mean +63 ms, p50 200 -> 678 ms): Whisper is as
    # unsure of real last words it mishears ("insurance wheel" for "insurance bill") (docs/journal/voice.md).
    misheard_word_prob: float = 0.0
    # A transcript that ends on "?" with Whisper at least this sure of its last word ends the turn after the
    # short wait without asking Smart Turn (1: always ask). Smart Turn doubts the real end of hesitant speech
    # (p < 0.1 after an "um" on many paused questions); over 550 syntheses this took paused ends waiting
    # long from 49 to 42 % and spared Smart Turn at 27-38 % of fluent ends, with no more cut-offs. A full
    # stop is left out: it cut off fluent questions at a comma after a complete clause (docs/journal/voice.md).
    sure_end_prob: float = 0.95
    on_missing: str = (
        "error"  # the model file is missing: "error" (say what to install) or "silence" (fall back, visibly)
    )

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"turn mode must be one of {MODES}, not {self.mode!r}")
        for name in ("sure_end_prob", "unsure_word_prob", "misheard_word_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be within [0, 1], not {getattr(self, name)}")
        if not 0 < self.min_wait_ms <= self.max_wait_ms:
            raise ValueError(f"need 0 < min wait ({self.min_wait_ms} ms) <= max wait ({self.max_wait_ms} ms)")
        if self.judge_at not in JUDGE_AT:
            raise ValueError(f"judge_at must be one of {JUDGE_AT}, not {self.judge_at!r}")
        if not 0 < self.text_unfinished_below <= self.text_finished_from <= 1:
            raise ValueError(
                "need 0 < text_unfinished_below <= text_finished_from <= 1, not "
                f"{self.text_unfinished_below} and {self.text_finished_from}"
            )
        if self.on_missing not in ("error", "silence"):
            raise ValueError(f"on_missing must be 'error' or 'silence', not {self.on_missing!r}")


@dataclass
class TurnDecision:
    """Why a turn ended when it did (reported in the turn's JSON and the terminal UI)."""

    mode: str  # "smart" | "silence" | "silence-fallback" (model file missing)
    finished: bool | None = None  # judged finished (short wait) or not (long wait); None: silence only
    probability: float | None = None  # Smart Turn's probability of a finished turn at the pause
    model_ms: float | None = None  # Smart Turn's compute time
    text_unfinished: bool | None = None  # the transcript ended mid-phrase (function-word rule or device model)
    text_end: float | None = None  # the device model's P(the request ends after the transcript's last word)
    text_sure_end: bool | None = None  # a question Whisper closed, sure of its last word: Smart Turn not asked
    text_misheard: bool | None = None  # Whisper was unsure of the last word (likely misheard): its doubt grows the wait
    last_word_prob: float | None = None  # Whisper's probability of the transcript's last word
    wait_ms: int | None = None  # the silence that ended the turn
    pauses: int = 0  # pauses the person resumed from (each judged unfinished or too short)
    note: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        if d["probability"] is not None:
            d["probability"] = round(d["probability"], 3)
        if d["model_ms"] is not None:
            d["model_ms"] = round(d["model_ms"], 1)
        for key in ("last_word_prob", "text_end"):
            if d[key] is not None:
                d[key] = round(d[key], 4)
        return d

    @property
    def text_decides(self) -> bool:
        """The transcript settles the wait alone, so Smart Turn is not asked: mid-phrase (the long wait) or a
        question Whisper closed and is sure of (the short one)."""
        return bool(self.text_unfinished or self.text_sure_end)

    @property
    def judged_by(self) -> str:
        """What set the wait: "transcript" (it decided alone), "smart-turn", or the silence mode. The
        reply's readiness differs by far between the first two (docs/journal/voice.md)."""
        if self.mode != "smart":
            return self.mode
        return "transcript" if self.text_decides else "smart-turn"

    def summary(self) -> str:
        if self.mode != "smart":
            return f"end of turn: {self.mode} ({self.wait_ms} ms)" + (f" - {self.note}" if self.note else "")
        p = "-" if self.probability is None else f"{self.probability:.2f}"
        verdict = {True: "finished", False: "unfinished", None: "undecided"}[self.finished]
        text = "" if self.text_end is None else f", text P(end)={self.text_end:.3f}"
        text += " (transcript unfinished)" if self.text_unfinished else ""
        text += " (last word likely misheard)" if self.text_misheard else ""
        if self.text_sure_end:
            p, text = "not asked", " (the transcript closed itself)"
        return (
            f"end of turn: {verdict}, Smart Turn p={p}{text}, waited {self.wait_ms} ms, {self.pauses} pause(s) before"
        )


class EndOfTurn:
    """Per-utterance judge: fed the audio at each pause and the speculative transcript, it sets the wait."""

    def __init__(self, opts: TurnOptions, model: SmartTurn | None, fallback_note: str = "") -> None:
        self.opts = opts
        self.model = model
        self.mode = opts.mode if (opts.mode == "silence" or model is not None) else "silence-fallback"
        self.fallback_note = fallback_note

    @property
    def smart(self) -> bool:
        return self.mode == "smart"

    def new_decision(self, pauses: int = 0) -> TurnDecision:
        return TurnDecision(
            self.mode, pauses=pauses, note=self.fallback_note if self.mode == "silence-fallback" else ""
        )

    def judge_audio(self, d: TurnDecision, audio: np.ndarray) -> None:
        assert self.model is not None
        t = time.perf_counter()
        d.probability = self.model(audio)
        d.model_ms = (time.perf_counter() - t) * 1000

    def judge_text(
        self, d: TurnDecision, text: str, last_word_prob: float | None = None, text_end: float | None = None
    ) -> None:
        """The transcript's part: mid-phrase or not, and a question closed with Whisper sure of it.
        `text_end` is the device model's P(end of the message) for it (None: not read)."""
        d.last_word_prob = last_word_prob
        d.text_end = text_end if self.opts.text_model else None
        if self.opts.text_cue:
            d.text_unfinished = self.unfinished(text, last_word_prob, d.text_end)
            d.text_misheard = not d.text_unfinished and self.word_doubt(d) > 0
            d.text_sure_end = (
                not d.text_unfinished
                and sure_ending(text, last_word_prob, self.opts.sure_end_prob)
                # a "?" Whisper put after a fragment ("...do you want?") is not a closed question
                and (d.text_end is None or d.text_end >= self.opts.text_finished_from)
            )

    def unfinished(self, text: str, last_word_prob: float | None = None, text_end: float | None = None) -> bool:
        """The transcript reads as unfinished with these options: it ends mid-phrase (the function-word
        rule) or the device model finds its end unlikely."""
        o = self.opts
        if o.word_rule and unfinished_text(text, last_word_prob, o.unsure_word_prob):
            return True
        return o.text_model and text_end is not None and text_end < o.text_unfinished_below

    def text_doubt(self, d: TurnDecision) -> float:
        """How unfinished the transcript reads, 0 (a whole request) to 1 (mid-phrase): 1 when it ends
        mid-phrase, 0 at or over `text_finished_from`, and on a log scale of P(end) between."""
        o = self.opts
        if not o.text_cue:
            return 0.0
        if d.text_unfinished:
            return 1.0
        if d.text_end is None or d.text_end >= o.text_finished_from:
            return 0.0
        lo, hi = np.log(o.text_unfinished_below), np.log(o.text_finished_from)
        return float(np.clip((hi - np.log(max(d.text_end, 1e-12))) / (hi - lo), 0.0, 1.0))

    def word_doubt(self, d: TurnDecision) -> float:
        """How likely the last word was misheard, 0 to 1: 0 when Whisper gave it `misheard_word_prob` or more,
        1 at a tenth of that or less, on a log scale between."""
        x, p = self.opts.misheard_word_prob, d.last_word_prob
        if not self.opts.text_cue or x <= 0 or p is None or p >= x:
            return 0.0
        return float(np.clip(np.log(x / max(p, 1e-12)) / np.log(10.0), 0.0, 1.0))

    def wait_ms(self, d: TurnDecision, stop_delay_ms: int, text_known: bool) -> int | None:
        """The silence that ends the turn, or None while an input is still missing.

        The wait is short only when the signals agree: it grows with the largest of three doubts, the
        audio's (Smart Turn under its threshold), the text's (`text_doubt`) and the last word's
        (`word_doubt`), from `min_wait_ms` to `max_wait_ms`. A transcript that decides alone (mid-phrase,
        or a sure closed question) is not sent to Smart Turn."""
        if not self.smart:
            return stop_delay_ms
        o = self.opts
        if o.text_cue and text_known and d.text_decides:
            d.finished = not d.text_unfinished  # the transcript decides alone, Smart Turn is not asked
            return o.max_wait_ms if d.text_unfinished else o.min_wait_ms
        if d.probability is None or (o.text_cue and not text_known):
            return None
        # Smart Turn says unfinished at the end of ~15% of fluent questions here (p < 0.1), so its doubt
        # grows the wait gradually instead of jumping to the longest.
        audio = max(0.0, (o.threshold - d.probability) / o.threshold)
        doubt = max(audio, self.text_doubt(d), self.word_doubt(d))
        d.finished = doubt == 0.0
        return int(round(o.min_wait_ms + (o.max_wait_ms - o.min_wait_ms) * doubt))


def load_end_of_turn(opts: TurnOptions) -> tuple[SmartTurn | None, str]:
    """The model for `opts` (None for silence-only), and a note when it fell back because the file is missing."""
    opts.validate()
    if opts.mode == "silence":
        return None, ""
    try:
        return SmartTurn(), ""
    except MissingModelError as e:
        if opts.on_missing == "error":
            raise
        return None, f"end-of-turn model missing, ending turns on silence alone: {e}"
