"""Voice activity (Silero VAD, streaming) and endpointing.

Silero runs on 32 ms frames (512 samples at 16 kHz) with its recurrent state
kept between calls, so each frame costs ~0.1-0.3 ms. The endpointer turns
per-frame probabilities into onset / start / pause / resume / end decisions:
an utterance only starts after `min_speech_ms` of voiced audio, so clicks and
short noises never open a turn, and it ends after `stop_delay_ms` of silence.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from .assets import silero_vad_path

FRAME = 512  # samples per VAD frame at 16 kHz
FRAME_S = FRAME / 16000
_CONTEXT = 64


class SileroVad:
    """Streaming Silero VAD v6 (the ONNX model bundled with faster-whisper)."""

    def __init__(self) -> None:
        import onnxruntime

        so = onnxruntime.SessionOptions()
        so.inter_op_num_threads = 1
        so.intra_op_num_threads = 1
        so.log_severity_level = 4
        self._sess = onnxruntime.InferenceSession(
            str(silero_vad_path()), sess_options=so, providers=["CPUExecutionProvider"]
        )
        self.reset()

    def reset(self) -> None:
        self._h = np.zeros((1, 1, 128), np.float32)
        self._c = np.zeros((1, 1, 128), np.float32)
        self._ctx = np.zeros(_CONTEXT, np.float32)

    def __call__(self, frame: np.ndarray) -> float:
        """Speech probability of one 512-sample frame."""
        x = np.concatenate([self._ctx, frame.astype(np.float32, copy=False)])[None, :]
        p, self._h, self._c = self._sess.run(None, {"input": x, "h": self._h, "c": self._c})
        self._ctx = frame[-_CONTEXT:].astype(np.float32, copy=True)
        return float(p.reshape(-1)[0])


@dataclass
class VadOptions:
    threshold: float = 0.5  # probability that marks a voiced frame while idle
    neg_threshold: float = 0.35  # below this, a frame is silence while in speech (hysteresis)
    min_speech_ms: int = 200  # voiced time before an utterance counts (drops clicks, short noises)
    stop_delay_ms: int = 250  # silence after the last voiced frame that ends the turn
    onset_gap_ms: int = 96  # silence that cancels a not-yet-confirmed onset
    preroll_ms: int = 320  # audio kept before the onset for recognition


class Ev(enum.Enum):
    ONSET = "onset"  # first voiced frame of a candidate utterance
    FALSE_START = "false_start"  # the candidate died before min_speech_ms (click, cough)
    START = "start"  # confirmed speech
    PAUSE = "pause"  # first silent frame after speech
    RESUME = "resume"  # speech again before the endpoint
    END = "end"  # endpoint: silence reached stop_delay_ms


class Endpointer:
    """State machine over per-frame speech probabilities; times are the frames' capture times.

    `stop_delay_ms` is the silence that ends the current pause; it starts at the option's value at
    each pause, and the end-of-turn judge (endofturn.py) may change it while the pause lasts.
    """

    def __init__(self, opts: VadOptions) -> None:
        self.opts = opts
        self.min_speech_ms = opts.min_speech_ms
        self.stop_delay_ms = opts.stop_delay_ms
        self.reset()

    def reset(self) -> None:
        self.state = "idle"  # idle | pending | speech | pause
        self.onset_t = 0.0
        self.last_voiced_t = 0.0
        self._voiced_ms = 0.0
        self._silent_ms = 0.0

    def update(self, prob: float, t_end: float) -> Ev | None:
        o, ms = self.opts, FRAME_S * 1000
        if self.state == "idle":
            if prob >= o.threshold:
                self.state, self.onset_t, self.last_voiced_t = "pending", t_end - FRAME_S, t_end
                self._voiced_ms, self._silent_ms = ms, 0.0
                return Ev.ONSET
            return None
        voiced = prob >= o.neg_threshold
        if self.state == "pending":
            if voiced:
                self._voiced_ms += ms
                self._silent_ms = 0.0
                self.last_voiced_t = t_end
                if self._voiced_ms >= self.min_speech_ms:
                    self.state = "speech"
                    return Ev.START
                return None
            self._silent_ms += ms
            if self._silent_ms >= o.onset_gap_ms:
                self.reset()
                return Ev.FALSE_START
            return None
        if self.state == "speech":
            if voiced:
                self.last_voiced_t = t_end
                return None
            self.state, self._silent_ms = "pause", ms
            self.stop_delay_ms = o.stop_delay_ms
            return Ev.PAUSE
        # pause
        if voiced:
            self.state, self.last_voiced_t = "speech", t_end
            return Ev.RESUME
        self._silent_ms += ms
        if self._silent_ms >= self.stop_delay_ms:
            self.state = "idle"
            return Ev.END
        return None

    @property
    def silent_ms(self) -> float:
        """Silence so far in the current pause."""
        return self._silent_ms if self.state == "pause" else 0.0
