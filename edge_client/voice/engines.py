"""The models a voice pipeline drives, loaded once: the generator it asks, Whisper, Piper, Smart Turn."""

from __future__ import annotations

import threading
from typing import Callable, Protocol

import numpy as np

from ..answer import Answer, TokenEvent
from .asr import AsrOptions, Transcriber
from .dialogue import DialogueOptions
from .endofturn import EndOfTurn, TurnOptions, load_end_of_turn
from .tts import Synthesizer, TtsOptions


class VoiceGenerator(Protocol):
    """What the pipeline asks of the generator it drives: the product's RoutedGenerator, or the
    replay harness's policy runner (edge_client/replay/audio.py), measured the same way."""

    def generate(
        self,
        messages: list[dict],
        max_tokens: int = 128,
        on_token: Callable[[TokenEvent], None] | None = None,
        stop: threading.Event | None = None,
    ) -> Answer: ...

    def prefill(self, messages: list[dict], complete: bool = False) -> int:
        """Decode the prompt of a partial transcript ahead of time (RoutedGenerator.prefill)."""
        ...

    def end_of_message(self, messages: list[dict]) -> float | None:
        """P(the user's message ends after its last word), read by the prefill of this prompt
        (RoutedGenerator.end_of_message): the text end-of-turn signal."""
        ...

    def count_tokens(self, messages: list[dict]) -> int: ...


class Engines:
    """The models, loaded once and shared by every pipeline run (VAD is per pipeline: it has state)."""

    def __init__(
        self,
        gen: VoiceGenerator,
        asr: AsrOptions | None = None,
        tts: TtsOptions | None = None,
        system_prompt: str | None = None,
        turn: TurnOptions | None = None,
    ) -> None:
        self.gen = gen
        self.transcriber = Transcriber(asr)
        self.synth = Synthesizer(tts)
        # The end-of-turn model (None when turns end on silence alone, or it fell back: see turn_note).
        self.smart_turn, self.turn_note = load_end_of_turn(turn or TurnOptions())
        self.transcriber.recognize(np.zeros(16000, np.float32), final=True)  # warm-up (the final decode's path)
        # Prefill the system prompt once (edge and cloud), so the first turn does not pay for it.
        prompt = system_prompt or DialogueOptions().system_prompt
        gen.generate([{"role": "system", "content": prompt}, {"role": "user", "content": "Hello."}], max_tokens=1)

    def end_of_turn(self, opts: TurnOptions) -> EndOfTurn:
        """The judge for a pipeline's options; loads the model now if these engines were built without it."""
        if opts.mode == "smart" and self.smart_turn is None and not self.turn_note:
            self.smart_turn, self.turn_note = load_end_of_turn(opts)
        return EndOfTurn(opts, self.smart_turn if opts.mode == "smart" else None, self.turn_note)
