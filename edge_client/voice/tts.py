"""Speech out: the clause chunker (text stream -> speakable pieces) and Piper.

The first piece is cut at the first clause boundary (, ; : . ! ? or a line
break), or after `first_max_words` words, so speech can start after a couple
of tokens. Until the first sentence ends, the next pieces end at clause
boundaries too (the rest of the first clause is ready while the first words
play; a whole sentence, which the cloud checks first, could leave the speaker
dry); later pieces are whole sentences, which Piper renders with better
prosody. A piece that grows past `max_words` without punctuation is cut at a
space so a run-on answer cannot stall the voice. Pieces after the first also
grow gradually: each has at most `piece_growth` times the words already cut
(2, 4, 12, ... words), cut at its last clause end within that if it has one,
so each is written and synthesised while the audio before it plays.

Piper's audio for short pieces is cached by phonemes, and the openings most
replies start with are rendered at start-up, so a first piece is often ready
with no synthesis at all.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .assets import piper_voice_path

# The reply openings rendered at start-up (scripts/make_openers.py writes it): one per line, a tab and its count.
OPENERS_FILE = Path(__file__).with_name("openers.txt")


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
    # A piece after the first has at most this many times the words already cut (at least first_max_words,
    # at most max_words; cut at its last clause end within that, else at a space; 0: no such limit). Piper
    # cannot play a piece's first sample before it has synthesised its first sentence, and the next piece's
    # tokens and synthesis must fit in the audio ahead of it: after a two-word first piece (~0.6 s of audio) a
    # 9-14-word clause took 350-580 ms to synthesise beside a busy core, with 150-270 ms of audio left. With 2
    # (and VoiceOptions.synth_low_water_s) turns with a gap over 200 ms fell from 9 to 1 of 30 (12 to 5 on a
    # more loaded machine), first audio unchanged (`scripts/bench_voice.py --reply-s 6 --busy-cores 1
    # --compare="--piece-growth 0 --synth-low-water-s 0"`, docs/journal/voice.md). The price: more seams.
    piece_growth: float = 2.0
    min_first_chars: int = 2  # do not speak a lone "A," as a chunk
    # onnxruntime's threads busy-wait between operators by default. On 2 cores, with anything else running
    # (Smart Turn, the desktop app's browser), a spinning thread waits on a preempted one: a first clause
    # took 129-148 ms instead of 90-97 beside a process busy a full core, for +1 to +12 ms idle
    # (scripts/bench_tts_spin.py, docs/voice.md). So they sleep between operators unless this is set.
    spin_wait: bool = False
    # Pieces of up to this many words are kept once synthesised (keyed by Piper's phonemes, so "I'm sorry" and
    # "i'm sorry" are one), up to `cache_entries`, least recently used dropped; 0 words: no cache. A reply's first
    # piece is most often one of a few openings ("I'm sorry", "You can"): found here, it plays with no synthesis
    # (53 % of turns on the voice benchmark: end of speech -> first audio paired median -40 ms, docs/voice.md).
    cache_max_words: int = 3
    cache_entries: int = 256
    # Render the openings in openers.txt at start-up (~50 ms each), so the first reply that opens with one is fast too
    warm_openers: bool = True


_CLAUSE_END = re.compile(r"[,;:.!?](?=\s)|\n")
_SENTENCE_END = re.compile(r"[.!?](?=\s)|\n")
_WORD = re.compile(r"\S+")


class ClauseChunker:
    """Feed token texts; get back speakable chunks as soon as they are complete."""

    def __init__(self, opts: TtsOptions | None = None) -> None:
        self.opts = opts or TtsOptions()
        self.buf = ""
        self.n_emitted = 0
        self.words_emitted = 0
        self._in_first_sentence = True  # pieces end at clause boundaries until a sentence has ended

    def word_limit(self) -> int:
        """The most words the next piece may have: see TtsOptions.first_max_words, max_words, piece_growth."""
        o = self.opts
        if self.n_emitted == 0:
            return o.first_max_words
        if o.piece_growth <= 0:
            return o.max_words
        return min(o.max_words, max(o.first_max_words, int(o.piece_growth * self.words_emitted)))

    def feed(self, text: str) -> list[str]:
        self.buf += text
        out = []
        while True:
            pat = _CLAUSE_END if self._in_first_sentence else _SENTENCE_END
            limit = self.word_limit()
            cut = None
            for m in pat.finditer(self.buf):
                if len(self.buf[: m.end()].strip()) >= self.opts.min_first_chars:
                    cut = m.end()
                    break
            if cut is None or len(self.buf[:cut].split()) > limit:
                words = list(_WORD.finditer(self.buf))
                if len(words) > limit:  # the limit-th word is complete once the next one starts
                    cut = self._last_clause_end(words[limit - 1].end()) or words[limit - 1].end()
            if cut is None:
                return out
            piece, self.buf = self.buf[:cut], self.buf[cut:]
            if piece.strip():
                out.append(piece)
                self.n_emitted += 1
                self.words_emitted += len(piece.split())
                if _SENTENCE_END.match(piece.rstrip(" ")[-1:] + " "):  # the piece ends a sentence
                    self._in_first_sentence = False

    def _last_clause_end(self, end: int) -> int | None:
        """Where the last clause of buf[:end] ends (a piece cut at the word limit ends there if it can)."""
        last = None
        for m in _CLAUSE_END.finditer(self.buf, 0, min(len(self.buf), end + 1)):
            if m.end() <= end and len(self.buf[: m.end()].strip()) >= self.opts.min_first_chars:
                last = m.end()
        return last

    def flush(self) -> list[str]:
        piece, self.buf = self.buf, ""
        if piece.strip():
            self.n_emitted += 1
            self.words_emitted += len(piece.split())
            return [piece]
        return []


_MARKUP = re.compile(r"[*_#`>|~]+|^\s*[-+]\s+|^\s*\d+\.\s+", re.MULTILINE)


def speakable(text: str) -> str:
    """Strip markdown the voice would read out literally."""
    return re.sub(r"\s+", " ", _MARKUP.sub(" ", text)).strip()


def read_openers(path: Path = OPENERS_FILE) -> list[str]:
    """The openings listed in `path` (comments and counts aside), most frequent first."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [ln.split("\t")[0].strip() for ln in lines if ln.strip() and not ln.startswith("#")]


class Synthesizer:
    """Piper with the bundled en_US-joe-medium voice, loaded once and warmed up.

    Short pieces are cached by their phonemes (`TtsOptions.cache_max_words`): Piper takes ~50 ms for a
    two-word first piece on the 2-core VM, the largest stage between the first token and the first audio,
    and a few openings start most replies. The cached audio is read-only and shared between turns.
    """

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
        self._cache: OrderedDict[tuple[str, ...], list[np.ndarray]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.cache_hits = self.cache_misses = 0  # pieces short enough to cache, found or not
        for _ in self.voice.synthesize("Ready.", syn_config=self._cfg):  # initialises onnxruntime's kernels
            pass
        if self.opts.warm_openers and self.opts.cache_max_words > 0:
            for opener in read_openers():
                self.synthesize(opener)
        self.cache_hits = self.cache_misses = 0  # the counts are the turns' (not the warm-up's)

    def chunks(self, text: str) -> Iterator[np.ndarray]:
        """Float32 audio, one array per sentence Piper finds in `text` (from the cache when short and seen)."""
        t = speakable(text)
        if not t:
            return
        key = self._cache_key(t)
        cached = self._lookup(key)
        if cached is not None:
            yield from cached
            return
        audio = []
        for c in self.voice.synthesize(t, syn_config=self._cfg):
            a = c.audio_float_array
            a.flags.writeable = False  # a cached piece is shared by every turn that says it
            audio.append(a)
            yield a
        if key is not None:  # only once synthesised whole (a turn cancelled mid-piece stops above)
            self._store(key, audio)

    def _lookup(self, key: tuple[str, ...] | None) -> list[np.ndarray] | None:
        if key is None:
            return None
        with self._cache_lock:
            audio = self._cache.get(key)
            if audio is None:
                self.cache_misses += 1
                return None
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return audio

    def _store(self, key: tuple[str, ...], audio: list[np.ndarray]) -> None:
        with self._cache_lock:
            self._cache[key] = audio
            while len(self._cache) > self.opts.cache_entries:
                self._cache.popitem(last=False)  # the least recently used

    def is_cached(self, text: str) -> bool:
        """`text` would play from the cache (the turn timings report it for the first piece)."""
        key = self._cache_key(speakable(text))
        with self._cache_lock:
            return key is not None and key in self._cache

    def _cache_key(self, text: str) -> tuple[str, ...] | None:
        """Piper's phonemes of a piece short enough to cache (what decides its audio), else None."""
        if not text or len(text.split()) > self.opts.cache_max_words:
            return None
        return tuple("".join(p) for p in self.voice.phonemize(text))

    def synthesize(self, text: str) -> np.ndarray:
        parts = list(self.chunks(text))
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)
