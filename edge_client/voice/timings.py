"""Per-turn stage timestamps (monotonic seconds) and the derived latency table."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

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
    # Where synthesis fell behind playback, after the first audio: silences the person heard inside the reply
    # (each over GAP_MIN_S), and their total. See playback_gaps.
    playback_gaps: int = 0
    playback_gap_ms: float = 0.0
    # The first piece played from the synthesiser's cache (no Piper run: tts_first_audio ~ first_clause_ready)
    first_piece_cached: bool | None = None
    # Per piece of the reply: (words, audio queued ahead of it when its synthesis began (s), synthesis (s),
    # its audio (s), the wait for its tokens since the piece before it was synthesised (s)), where playback
    # gaps come from: a piece whose synthesis, or whose tokens, took longer than the audio ahead of it
    pieces: list[tuple[int, float, float, float, float]] = field(default_factory=list)

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
        """The latency fields of a turn's record (turn_record.py); each reply piece as `speech_pieces`."""
        return {
            "timings_ms": self.relative_ms(),
            "end_of_speech_to_first_audio_ms": _r(self.end_of_speech_to_first_audio_ms),
            "endpoint_to_first_audio_ms": _r(self.endpoint_to_first_audio_ms),
            "playback_gaps": self.playback_gaps,
            "playback_gap_ms": _r(self.playback_gap_ms),
            "first_piece_cached": self.first_piece_cached,
            "speech_pieces": [
                {"words": w, "ahead_ms": _ms(a), "synth_ms": _ms(t), "audio_ms": _ms(d), "token_wait_ms": _ms(g)}
                for w, a, t, d, g in self.pieces
            ],
        }

    def names(self) -> list[str]:
        return [f.name for f in fields(self)]


GAP_MIN_S = 0.02  # a device block: shorter lateness is the output's own granularity, not a heard gap


def playback_gaps(
    puts: Sequence[tuple[float, int]],
    first_out_t: float,
    rate: int,
    pauses: Sequence[tuple[float, float]] = (),
    until: float | None = None,
) -> tuple[int, float]:
    """How often and how long the output ran dry inside a reply: (gaps, total ms).

    `puts` are (when queued, samples) for each piece of the reply's audio, in order. Playback starts at
    `first_out_t` and plays on, except during `pauses` ((start, seconds): a possible barge-in held it), so
    a piece is due once everything queued before it has played; one queued later than that was heard as
    silence for the difference. Pieces queued after `until` (an interruption) are not counted.
    """
    gaps, late, queued = 0, 0.0, 0
    for t, n in puts:
        if until is not None and t > until:
            break
        due = first_out_t + queued / rate + late
        due += sum(d for start, d in pauses if start < due)
        if t - due > GAP_MIN_S:
            gaps += 1
            late += t - due
        queued += n
    return gaps, late * 1000


def playback_gap_line(gaps: int, gap_ms: float) -> str:
    """What the person heard of synthesis falling behind: for the terminal UI and `file`."""
    if not gaps:
        return "playback: no gaps"
    return f"playback: {gaps} gap{'s' if gaps > 1 else ''} ({gap_ms:.0f} ms of silence) where synthesis fell behind"


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)
