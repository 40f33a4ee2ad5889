"""The voice pipeline's options, one field per knob; each stage reads the ones it needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from .asr import AsrOptions
from .dialogue import DialogueOptions
from .endofturn import TurnOptions
from .tts import TtsOptions
from .vad import VadOptions


@dataclass
class VoiceOptions:
    vad: VadOptions = field(default_factory=VadOptions)
    asr: AsrOptions = field(default_factory=AsrOptions)
    tts: TtsOptions = field(default_factory=TtsOptions)
    dialogue: DialogueOptions = field(default_factory=DialogueOptions)
    max_tokens: int = 96
    full_duplex: bool = False  # listen while speaking (headphones); enables barge-in
    barge_in_min_ms: int = 300  # speech needed to interrupt; shorter sounds (cough, "mm") do not
    # Barge-in within `turn.max_wait_ms` of the end of the person's own speech (the longest pause a request is
    # waited out for) goes on with that request: a first half that is a whole request ("what time does the
    # store close | on Sunday") is taken for an end by every signal here, and the reply then starts. With
    # this, that reply stops, is not kept, and the whole request is answered (full duplex only: half
    # duplex does not hear the person while the assistant speaks).
    rejoin_cut_off: bool = True
    pause_on_onset: bool = True  # pause playback at the first voiced frame, resume if it was noise
    speculative: bool = True  # decode + generate at the first pause, release at the endpoint
    speculate_after_ms: int = 32  # one silent VAD frame
    prefill_partials: bool = True  # prefill the prompt from the stable partial transcript while the person speaks
    prefill_complete: bool = (
        True  # prefill each partial's whole prompt, template tail included (not just up to its last word)
    )
    first_chunk_priority: bool = True  # pause generation while the first clause is synthesised
    # ... and while a later piece is synthesised with less than this many seconds of the reply's audio queued
    # ahead of it (0: only the first piece): on 2 cores generation, Piper and anything else running share them,
    # and a piece whose synthesis outlasts the audio ahead is heard as a gap; the next piece's tokens have this
    # piece's playing time to catch up. Beside a busy core such pieces were synthesised 14 ms sooner (paired
    # median, 32 pieces), with no more pieces waiting for tokens and first audio unchanged; the gaps, a tie
    # (`scripts/bench_voice.py --reply-s 6 --busy-cores 1 --compare="--synth-low-water-s 0"`, docs/journal/voice.md).
    # TtsOptions.piece_growth is what removed most gaps.
    synth_low_water_s: float = 1.0
    turn: TurnOptions = field(default_factory=TurnOptions)  # end of turn: Smart Turn + transcript, adaptive wait
    # Draft the reply's first piece from partial transcripts while the person speaks. Off by default: it hits
    # 37 % of fluent turns, a tie on first audio (paired median -5 and 0 ms in two runs), and each turn's misses
    # wasted 17 tokens, 4.9 of them the cloud's (docs/journal/voice.md).
    draft: bool = False
    max_utterance_s: float = 28.0
    # numpy's BLAS threads (0: the library's default, one per core). One, because OpenBLAS's worker spins
    # ~100 ms after each mel filterbank product (Whisper's and Smart Turn's), a core lost on 2 (blas.py).
    blas_threads: int = 1
