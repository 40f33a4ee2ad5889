"""Audio mode: replay spoken turns through the voice pipeline (edge_client/voice) under each policy.

Text turns are spoken once with the pipeline's own Piper voice and cached as
WAV (keyed by text and voice), so every run hears the same audio. Each turn
then goes WAV -> VAD -> ASR -> routed answer -> TTS at real-time pace through
`edge_client.voice.cli.run_file_turn`, with the policy's runner standing in
for the generator; the pipeline reports end of speech -> first audio.

Each spoken turn is replayed as its own one-turn conversation (the file-mode
API runs one turn per pipeline).
"""

from __future__ import annotations

import hashlib
import importlib.util
import tempfile
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from edge_client.answer import Answer, TokenEvent
from edge_client.replay.policies import Runner
from edge_client.replay.sessions import Turn
from edge_client.voice.cli import run_file_turn
from edge_client.voice.pipeline import Engines, VoiceOptions
from edge_client.voice.wavfile import write_wav
from models.registry import cache_dir

LEAD_S, TAIL_S = 0.3, 1.0  # silence around synthesised speech, so the VAD sees a clean onset and end
# what the voice pipeline loads lazily (the voice extra): VAD, ASR, TTS
VOICE_PACKAGES = ("onnxruntime", "faster_whisper", "piper")


def voice_unavailable() -> str | None:
    """None when the voice package's file-mode API can be used, else why not."""
    missing = [name for name in VOICE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return f"the voice pipeline needs {', '.join(missing)}; install the voice extra (`pip install -e .[voice]`)"
    return None


class GeneratorAdapter:
    """A policy runner as the generator the voice pipeline drives (pipeline.VoiceGenerator): its
    answers come from the runner's policy, and partial transcripts prefill its prompt as in the
    product (without that, audio mode measured every turn without the prefill)."""

    def __init__(self, runner: Runner, model) -> None:
        self.runner = runner
        self.model = model
        self.last: Answer | None = None
        self.last_messages: list[dict] = []

    def count_tokens(self, messages: list[dict]) -> int:
        return len(self.model.chat_tokens(messages))

    def prefill(self, messages: list[dict], complete: bool = False) -> int:
        return self.runner.gen.prefill(messages, complete=complete)

    def end_of_message(self, messages: list[dict]) -> float | None:
        return self.runner.gen.end_of_message(messages)

    def generate(
        self,
        messages: list[dict],
        max_tokens: int = 128,
        on_token: Callable[[TokenEvent], None] | None = None,
        stop: threading.Event | None = None,
    ) -> Answer:
        answer = self.runner.answer(messages, max_tokens, on_token=on_token, stop=stop)
        self.last, self.last_messages = answer, messages
        return answer


class AudioReplayer:
    """Loads ASR and TTS once; runs one spoken turn under a given runner."""

    def __init__(self, first: GeneratorAdapter, max_tokens: int) -> None:
        self.vopts = VoiceOptions()
        self.vopts.max_tokens = max_tokens
        self.engines = Engines(first, self.vopts.asr, self.vopts.tts, self.vopts.dialogue.system_prompt)
        self._tmp = tempfile.TemporaryDirectory(prefix="replay-audio-")

    def wav_for(self, turn: Turn) -> Path:
        """The turn's WAV: its own, or its text spoken once and cached."""
        if turn.wav is not None:
            return Path(turn.wav)
        synth = self.engines.synth
        key = hashlib.sha256(
            f"{getattr(synth.voice.config, 'espeak_voice', '')}|{synth.rate}|{turn.text}".encode()
        ).hexdigest()[:20]
        path = cache_dir() / "replay_audio" / f"{key}.wav"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            speech = synth.synthesize(turn.text or "")
            pad = lambda s: np.zeros(int(s * synth.rate), np.float32)  # noqa: E731
            write_wav(path, np.concatenate([pad(LEAD_S), speech, pad(TAIL_S)]), synth.rate)
        return path

    def run(self, adapter: GeneratorAdapter, wav: Path) -> tuple[dict, Answer | None, list[dict]]:
        """One spoken turn: (the pipeline's turn JSON, the answer's Answer, the messages it answered)."""
        self.engines.gen = adapter
        adapter.last, adapter.last_messages = None, []
        out = Path(self._tmp.name) / "reply.wav"
        obj = run_file_turn(adapter, str(wav), str(out), self.vopts, realtime=True, engines=self.engines)
        return obj, adapter.last, adapter.last_messages

    def close(self) -> None:
        self._tmp.cleanup()
