"""The voice pipeline's shared state: the utterance in progress, the reply playing, the turns done.

One object, owned by `VoicePipeline` and handed to each stage, in place of stages reaching into
each other. One re-entrant lock guards it, held:
  - by the caller's thread for each frame (`Listener.feed`, `Listener.check_no_speech`,
    `Speaking.check_playing`, and all they call);
  - by the ASR thread while it applies a result (`VoicePipeline._on_asr`: `Listener.on_partial`,
    `Endpointing.on_final_decode`), and briefly in `DecodeScheduler.wanted`;
  - by the end-of-turn thread around its reads and writes (`Endpointing.judge_audio`);
  - by the synthesis thread, if it gets it within 0.5 s (`Endpointing.first_clause_synthesised`);
  - by the prefill thread, briefly (`Drafts.prefill_wanted`);
  - by UI threads (`VoicePipeline.end_utterance`, `VoicePipeline.stop_reply`).
`is_live` alone reads without it (a reply's generation thread, deciding whether to stop parking).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from .endofturn import TurnDecision
from .events import TurnDone
from .reply import Turn
from .timings import TurnTimings


@dataclass
class Utterance:
    """What the listener knows about the utterance in progress."""

    timings: TurnTimings
    audio: list[np.ndarray] = field(default_factory=list)
    voiced: list[bool] = field(default_factory=list)  # per frame of `audio` (the pre-roll counts as voiced)
    last_partial_samples: int = 0
    spec_voiced_t: float | None = None  # last voiced frame the speculative decode covers
    spec_text: str | None = None
    spec_turn: Turn | None = None
    endpointed: bool = False
    decision: TurnDecision | None = None  # the end-of-turn judgement of the current pause
    pauses: int = 0  # pauses the person resumed from
    pause_no: int = 0  # numbers the pauses, so a late Smart Turn result for an earlier one is ignored
    judged: bool = False  # Smart Turn was asked about this pause (or the transcript made it unnecessary)
    judge_frames: int | None = None  # frames of `audio` Smart Turn judges: up to judge_after_ms into the pause
    draft: Turn | None = None  # the reply drafted from a partial transcript (held, parked after its first clause)
    draft_outcome: str = "none"

    def drop_speculation(self) -> None:
        """Speech resumed after a pause: the speculative decode and answer of that pause are given up."""
        if self.spec_turn is not None:
            self.spec_turn.cancel()
        self.spec_turn, self.spec_text, self.spec_voiced_t = None, None, None
        # The cancelled turn may still mark stages on its way out: it keeps the old object, and the
        # utterance starts afresh, so its asr_final or first token never precede the real ones.
        self.timings = TurnTimings(speech_start=self.timings.speech_start)

    def cancel_replies(self) -> None:
        """Stop the replies started for this utterance (its draft and speculative turn)."""
        for t in (self.draft, self.spec_turn):
            if t is not None:
                t.cancel()


@dataclass
class PipelineState:
    """The stages' shared mutable state; `lock` guards it (see the module docstring for who holds it)."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    utt: Utterance | None = None  # the utterance in progress (None once answered, dropped, or before speech)
    utt_id: int = 0  # numbers utterances at confirmed speech: a decode or prefill of an older one is stale
    playing: Turn | None = None  # the reply being played
    silence_ms: float = 0.0  # into the current pause
    turns: list[TurnDone] = field(default_factory=list)  # the turns done, in order

    def is_live(self, turn: Turn) -> bool:
        """The turn is still wanted: playing, or the current utterance's draft or speculative turn."""
        u = self.utt
        return self.playing is turn or (u is not None and (u.draft is turn or u.spec_turn is turn))

    def discard_utterance(self) -> None:
        """Drop the utterance in progress with its draft and speculative turn."""
        u, self.utt = self.utt, None
        if u is not None:
            u.cancel_replies()
