"""Speech out: the clause chunker (text stream -> speakable pieces) and Piper.

The first piece is cut at the first clause boundary (, ; : . ! ? or a line
break), or after `first_max_words` words, so speech can start after a couple
of tokens. Until the first sentence ends, the next pieces end at clause
boundaries too (the rest of the first clause is ready while the first words
play; a whole sentence, which the cloud checks first, could leave the speaker
dry); later pieces are whole sentences, which Piper renders with better
prosody. A piece that grows past `max_words` without punctuation is cut at a
space so a run-on answer cannot stall the voice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .assets import piper_voice_path


@dataclass
class TtsOptions:
    length_scale: float | None = None  # < 1 speaks faster
    noise_scale: float | None = None  # Piper samples its prosody; 0 and noise_w_scale 0: the same audio every time
    noise_w_scale: float | None = None
    # The first chunk is cut here when no clause has ended yet. 2 words: end of speech -> first audio 40-65 ms
    # sooner (paired median, five runs) than 4, with no more gaps in playback (scripts/bench_voice.py --reply-s 4,
    # docs/voice.md); the seam after two words ("I'm sorry | for any confusion,") is the price
    first_max_words: int = 2
    max_words: int = 40
    min_first_chars: int = 2  # do not speak a lone "A," as a chunk
    # onnxruntime's threads busy-wait between operators by default. On 2 cores, with anything else running
    # (Smart Turn, the desktop app's browser), a spinning thread waits on a preempted one: a first clause
    # took 129-148 ms instead of 90-97 beside a process busy a full core, for +1 to +12 ms idle
    # (scripts/bench_tts_spin.py, docs/voice.md). So they sleep between operators unless this is set.
    spin_wait: bool = False


_CLAUSE_END = re.compile(r"[,;:.!?](?=\s)|\n")
_SENTENCE_END = re.compile(r"[.!?](?=\s)|\n")


class ClauseChunker:
    """Feed token texts; get back speakable chunks as soon as they are complete."""

    def __init__(self, opts: TtsOptions | None = None) -> None:
        self.opts = opts or TtsOptions()
        self.buf = ""
        self.n_emitted = 0
        self._in_first_sentence = True  # pieces end at clause boundaries until a sentence has ended

    def feed(self, text: str) -> list[str]:
        self.buf += text
        out = []
        while True:
            first = self.n_emitted == 0
            pat = _CLAUSE_END if self._in_first_sentence else _SENTENCE_END
            cut = None
            for m in pat.finditer(self.buf):
                if len(self.buf[: m.end()].strip()) >= self.opts.min_first_chars:
                    cut = m.end()
                    break
            if cut is None:
                limit = self.opts.first_max_words if first else self.opts.max_words
                words = list(re.finditer(r"\S+", self.buf))
                if len(words) > limit:  # the limit-th word is complete once the next one starts
                    cut = words[limit - 1].end()
            if cut is None:
                return out
            piece, self.buf = self.buf[:cut], self.buf[cut:]
            if piece.strip():
                out.append(piece)
                self.n_emitted += 1
                if _SENTENCE_END.match(piece.rstrip(" ")[-1:] + " "):  # the piece ends a sentence
                    self._in_first_sentence = False

    def flush(self) -> list[str]:
        piece, self.buf = self.buf, ""
        if piece.strip():
            self.n_emitted += 1
            return [piece]
        return []


_MARKUP = re.compile(r"[*_#`>|~]+|^\s*[-+]\s+|^\s*\d+\.\s+", re.MULTILINE)


def speakable(text: str) -> str:
    """Strip markdown the voice would read out literally."""
    return re.sub(r"\s+", " ", _MARKUP.sub(" ", text)).strip()


class Synthesizer:
    """Piper with the bundled en_US-joe-medium voice, loaded once and warmed up."""

    def __init__(self, opts: TtsOptions | None = None) -> None:
        import json

        import onnxruntime
        from piper import PiperVoice, SynthesisConfig
        from piper.config import PiperConfig

        self.opts = opts or TtsOptions()
        path = piper_voice_path()
        so = onnxruntime.SessionOptions()
        if not self.opts.spin_wait:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        config = json.loads(Path(f"{path}.json").read_text(encoding="utf-8"))
        self.voice = PiperVoice(
            session=onnxruntime.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"]),
            config=PiperConfig.from_dict(config),
        )
        self.rate = int(self.voice.config.sample_rate)
        self._cfg = SynthesisConfig(
            length_scale=self.opts.length_scale,
            noise_scale=self.opts.noise_scale,
            noise_w_scale=self.opts.noise_w_scale,
        )
        self.synthesize("Ready.")  # first run initialises onnxruntime kernels

    def chunks(self, text: str) -> Iterator[np.ndarray]:
        """Float32 audio, one array per sentence Piper finds in `text`."""
        t = speakable(text)
        if not t:
            return
        for c in self.voice.synthesize(t, syn_config=self._cfg):
            yield c.audio_float_array

    def synthesize(self, text: str) -> np.ndarray:
        parts = list(self.chunks(text))
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)
