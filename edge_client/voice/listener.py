"""The listening stage: source frames -> Silero VAD -> endpointer -> the utterance buffer and its decodes.

Runs on the caller's thread under `state.lock` (VoicePipeline.run holds it for each frame). The
endpointer's events go to the stage that acts on them: an onset or confirmed speech during a reply
to `speaking` (barge-in), a pause and the endpoint to `endpointing`. While the person speaks, partial
decodes are asked for every `asr.partial_interval_ms`; at the first `speculate_after_ms` of silence,
the pause's final decode (speculation: the answer can start before the endpoint confirms the pause).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from .asr import LocalAgreement
from .audio_io import FileSource, Frame, Source
from .decodes import DecodeScheduler
from .drafts import Drafts
from .endpointing import Endpointing
from .events import Event, PartialTranscript, SpeechStarted
from .options import VoiceOptions
from .speaking import Speaking
from .state import PipelineState, Utterance
from .timings import TurnTimings
from .vad import FRAME, FRAME_S, Endpointer, Ev, SileroVad


class NoSpeechError(RuntimeError):
    """The input held no speech the VAD accepted."""


class Listener:
    """Cuts frames into VAD frames, tracks the utterance in progress, and schedules its Whisper decodes."""

    def __init__(
        self,
        state: PipelineState,
        opts: VoiceOptions,
        source: Source,
        vad: SileroVad,
        endpointer: Endpointer,
        agreement: LocalAgreement,
        decodes: DecodeScheduler,
        endpointing: Endpointing,
        drafts: Drafts,
        speaking: Speaking,
        emit: Callable[[Event], None],
    ) -> None:
        self.state = state
        self.opts = opts
        self.source = source
        self.vad, self.endpointer, self.agreement = vad, endpointer, agreement
        self.decodes = decodes
        self.endpointing, self.drafts, self.speaking = endpointing, drafts, speaking  # where its events go
        self.emit = emit
        self._preroll: deque[np.ndarray] = deque(maxlen=max(1, int(opts.vad.preroll_ms / 1000 / FRAME_S)))
        self._pending = np.zeros(0, np.float32)

    def feed(self, frame: Frame) -> None:
        x = np.concatenate([self._pending, frame.samples]) if len(self._pending) else frame.samples
        n = len(x) // FRAME
        for i in range(n):
            t = frame.t_end - (len(x) - (i + 1) * FRAME) / 16000
            self._on_vad_frame(x[i * FRAME : (i + 1) * FRAME], t)
        self._pending = x[n * FRAME :].copy()

    def _on_vad_frame(self, x: np.ndarray, t: float) -> None:
        ep, s = self.endpointer, self.state
        if s.playing is not None and not self.opts.full_duplex:
            if ep.state != "idle":  # half duplex: the microphone is ignored while the assistant speaks
                ep.reset()
                s.discard_utterance()
            self._preroll.clear()
            return
        ep.min_speech_ms = self.opts.barge_in_min_ms if s.playing is not None else self.opts.vad.min_speech_ms
        prob = self.vad(x)
        self._preroll.append(x)
        if ep.state != "idle" and s.utt is not None:
            s.utt.audio.append(x)
            s.utt.voiced.append(prob >= self.opts.vad.neg_threshold)
        ev = ep.update(prob, t)
        self._on_endpointer_event(ev, t)
        if ep.state == "pause" and ev is not Ev.PAUSE:
            s.silence_ms += FRAME_S * 1000
        if ep.state == "pause":
            self.endpointing.maybe_judge()
        if ep.state in ("speech", "pause") and s.utt is not None:
            self._maybe_decode(t)

    def _on_endpointer_event(self, ev: Ev | None, t: float) -> None:
        """One endpointer event (or none) at the VAD frame ending at `t`, passed to the stage it concerns."""
        ep, s = self.endpointer, self.state
        if ev is Ev.ONSET:
            s.discard_utterance()  # one still waiting for its final decode is given up, as before
            s.utt = Utterance(TurnTimings(), audio=list(self._preroll), voiced=[True] * len(self._preroll))
            self.speaking.hold(ep.onset_t)
        elif ev is Ev.FALSE_START:
            s.utt = None
            self.speaking.resume(t)
        elif ev is Ev.START:
            s.utt_id += 1
            self.agreement.reset()
            assert s.utt is not None
            s.utt.timings.speech_start = ep.onset_t
            if s.playing is not None:
                self.speaking.interrupt(s.playing, ep.onset_t)
            self.emit(SpeechStarted(ep.onset_t))
        elif ev is Ev.PAUSE:
            s.silence_ms = FRAME_S * 1000
            self.endpointing.on_pause()
        elif ev is Ev.RESUME:
            if s.utt is not None:
                s.utt.pauses += 1
                s.utt.drop_speculation()
        elif ev is Ev.END:
            self.endpointing.endpoint(t)

    def _maybe_decode(self, t: float) -> None:
        u, o = self.state.utt, self.opts
        assert u is not None
        n = len(u.audio) * FRAME
        if n / 16000 > o.max_utterance_s:
            self.endpointer.state = "idle"
            self.endpointing.endpoint(t, forced="utterance too long")
            return
        if self.endpointer.state == "pause":
            if o.speculative and u.spec_voiced_t is None and self.state.silence_ms >= o.speculate_after_ms:
                self.decodes.final(u, self.endpointer.last_voiced_t)
            return
        if (n - u.last_partial_samples) / 16000 * 1000 >= o.asr.partial_interval_ms and not self.decodes.busy:
            u.last_partial_samples = n
            self.decodes.partial(u, t)

    def on_partial(self, u: Utterance, text: str) -> None:
        """ASR thread, under the lock: a partial transcript of the current utterance, while it is spoken."""
        if u.endpointed or u.spec_voiced_t is not None:
            return
        stable, unstable = self.agreement.update(text)
        self.emit(PartialTranscript(stable, unstable))
        if len(text.split()) >= 2 and self.state.playing is None:
            self.drafts.on_partial(u, text)

    def check_no_speech(self, frame: Frame) -> None:
        """A file that ended with no speech heard: say so rather than wait for ever."""
        src, s = self.source, self.state
        if not isinstance(src, FileSource) or src.t0 is None or s.utt is not None or s.turns or s.playing:
            return
        if (
            self.endpointer.state == "idle"
            and frame.t_end - src.t0 > src.duration_s + self.opts.vad.stop_delay_ms / 1000 + 0.5
        ):
            raise NoSpeechError(
                "no speech detected in the input (silence or noise only); "
                "speak closer to the microphone or check the file"
            )
