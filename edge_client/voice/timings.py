"""Per-turn stage timestamps (monotonic seconds) and the derived latency table."""

from __future__ import annotations

from dataclasses import dataclass, fields

STAGES = (
    "speech_end",  # capture time of the last voiced frame
    "endpoint_decided",  # the endpointer saw stop_delay of silence
    "asr_final",  # final transcript available
    "llm_first_token",
    "first_clause_ready",  # first speakable chunk cut by the chunker
    "tts_first_audio",  # Piper returned the first chunk's audio
    "first_audio_out",  # first sample reached the device (or the WAV, in file mode at real-time pace)
)


@dataclass
class TurnTimings:
    speech_start: float | None = None
    speech_end: float | None = None
    endpoint_decided: float | None = None
    asr_final: float | None = None
    llm_first_token: float | None = None
    first_clause_ready: float | None = None
    tts_first_audio: float | None = None
    first_audio_out: float | None = None

    def mark(self, stage: str, t: float) -> None:
        """Record a stage once (the first time it happens)."""
        if getattr(self, stage) is None:
            setattr(self, stage, t)

    @property
    def end_of_speech_to_first_audio_ms(self) -> float | None:
        if self.speech_end is None or self.first_audio_out is None:
            return None
        return (self.first_audio_out - self.speech_end) * 1000

    @property
    def endpoint_to_first_audio_ms(self) -> float | None:
        if self.endpoint_decided is None or self.first_audio_out is None:
            return None
        return (self.first_audio_out - self.endpoint_decided) * 1000

    def relative_ms(self) -> dict[str, float | None]:
        """Each stage in ms after speech_end (negative = before the person finished)."""
        base = self.speech_end
        return {
            s: None if base is None or getattr(self, s) is None else round((getattr(self, s) - base) * 1000, 1)
            for s in STAGES
        }

    def to_json(self) -> dict:
        return {
            "timings_ms": self.relative_ms(),
            "end_of_speech_to_first_audio_ms": _r(self.end_of_speech_to_first_audio_ms),
            "endpoint_to_first_audio_ms": _r(self.endpoint_to_first_audio_ms),
        }

    def names(self) -> list[str]:
        return [f.name for f in fields(self)]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)
