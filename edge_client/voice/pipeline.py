"""The voice pipeline: frames in, events out, speech to the sink.

Stages (one module each), in the order a turn meets them:
  listener     source frames -> Silero VAD -> endpointer -> utterance buffer; schedules decodes (decodes)
  drafts       partial transcripts -> prompt prefill, or a held draft of the reply
  endpointing  each pause judged (transcript, Smart Turn), its wait, the endpoint
  speaking     the reply to the final transcript starts, plays, ends; barge-in
  reply        one answer (`Turn`): generation -> clause chunks -> Piper -> held or live playback
They share one `PipelineState` (state.py: the utterance in progress, the reply playing, the turns done,
and the one lock around them); `VoicePipeline` builds and wires them and keeps the public API.

Threads:
  caller thread   source frames -> listener (and the stages it calls), under the lock
  asr thread      Whisper decodes (partials while speaking; the final one at the first pause)
  prefill thread  decodes the prompt from the latest partial transcript while the person speaks
  end-of-turn     Smart Turn on the audio up to the pause
  gen thread      routed generation of one turn, tokens pushed to a queue
  tts thread      clause chunker -> Piper -> playback buffer (or held, while speculative)
  audio thread    the device callback (or the file pacer) drains the playback buffer

Speculation: at the first `speculate_after_ms` of silence the final decode runs
and, if it yields text, generation and synthesis start with their audio held.
When the endpoint confirms the pause, the held audio is released at once; if
the person resumes speaking, the speculative turn is cancelled and discarded.
So the endpoint's stop delay overlaps recognition, generation and synthesis.
Two more things shorten that speculative chain: the prompt is prefilled from
each partial transcript, template tail included (so the turn decodes only
what the final transcript changed, and nothing when it equals the last
partial, about one time in three), and generation pauses while Piper renders
the first clause (on a small CPU the two compete, and the first audio is what
the person waits for), and later pieces while little audio is queued ahead of
them (`synth_low_water_s`: a piece late is a gap the person hears).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..answer import Answer
from .asr import AsrResult, LocalAgreement
from .audio_io import Sink, Source
from .blas import limit_blas_threads
from .decodes import DecodeScheduler
from .dialogue import Dialogue
from .drafts import Drafts, same_words
from .endpointing import Endpointing
from .engines import Engines, VoiceGenerator
from .events import Event, Listening, Notice, TurnDone
from .listener import Listener, NoSpeechError
from .options import VoiceOptions
from .reply import ReplyContext, Turn
from .speaking import Speaking
from .state import PipelineState
from .vad import Endpointer, SileroVad

# Names callers import from here (the pipeline's module before its stages had their own).
__all__ = [
    "Engines",
    "NoSpeechError",
    "Sink",
    "Source",
    "Turn",
    "VoiceGenerator",
    "VoiceOptions",
    "VoicePipeline",
    "same_words",
]


class VoicePipeline:
    """Runs turns from a source to a sink; `run` returns when stopped or after `max_turns`."""

    def __init__(
        self,
        engines: Engines,
        source: Source,
        sink: Sink,
        opts: VoiceOptions | None = None,
        on_event: Callable[[Event], None] | None = None,
        dialogue: Dialogue | None = None,
    ) -> None:
        self.engines = engines
        self.source, self.sink = source, sink
        self.opts = opts or VoiceOptions()
        limit_blas_threads(self.opts.blas_threads)
        self.on_event = on_event
        self.dialogue = dialogue or Dialogue(self.opts.dialogue, engines.gen.count_tokens)
        self.vad = SileroVad()
        self.endpointer = Endpointer(self.opts.vad)
        self.agreement = LocalAgreement()
        self.events: list[Event] = []
        self.state = PipelineState()
        self.eot = engines.end_of_turn(self.opts.turn)
        # The stages, each handed the shared state and the stages it passes work to (downstream first).
        # A reply reports back through this object's methods: the stages that act on it come after it.
        s, o, emit = self.state, self.opts, self.emit
        reply = ReplyContext(
            opts=o,
            sink=sink,
            gen=engines.gen,
            synth=engines.synth,
            messages=self.dialogue.messages,
            emit=emit,
            is_live=s.is_live,
            on_first_clause=self.first_clause_synthesised,
            on_wasted_draft=self.count_wasted_draft,
        )
        self.decodes = DecodeScheduler(s, engines.transcriber, o.asr, on_result=self._on_asr)
        self.drafts = Drafts(s, o, reply)
        self.speaking = Speaking(s, o, sink, self.dialogue, reply, self.vad, self.endpointer, emit)
        self.endpointing = Endpointing(
            s, o, self.eot, self.endpointer, self.decodes, self.drafts, self.speaking, reply, emit
        )
        self.listener = Listener(
            s,
            o,
            source,
            self.vad,
            self.endpointer,
            self.agreement,
            self.decodes,
            endpointing=self.endpointing,
            drafts=self.drafts,
            speaking=self.speaking,
            emit=emit,
        )

    # ------------------------------------------------------------------ what callers read

    @property
    def turns(self) -> list[TurnDone]:
        return self.state.turns

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens decoded from partial transcripts while the person spoke (0 when off)."""
        return self.drafts.prefilled_tokens

    @property
    def n_drafts(self) -> int:
        """Drafts started from partial transcripts (each a held first clause)."""
        return self.drafts.n_drafts

    @property
    def wasted_draft_tokens(self) -> int:
        """Tokens the drafts that were not used generated for nothing."""
        return self.drafts.wasted_draft_tokens

    @property
    def wasted_draft_cloud_tokens(self) -> int:
        """Of `wasted_draft_tokens`, those the cloud wrote."""
        return self.drafts.wasted_draft_cloud_tokens

    # ------------------------------------------------------------------ plumbing

    def emit(self, ev: Event) -> None:
        self.events.append(ev)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # an observer must never take the pipeline down
                pass

    def run(
        self,
        stop: threading.Event | None = None,
        max_turns: int | None = None,
        reply_limit_s: float | None = None,
    ) -> list[TurnDone]:
        """Process frames until `stop`, or `max_turns` turns are done. `reply_limit_s` (benchmarks) ends
        each turn once that many seconds of its reply have played (0: once its first sample is out), so
        the reply is not played to the end."""
        stop = stop or threading.Event()
        self.speaking.reply_limit_s = reply_limit_s
        self.sink.start()
        self.source.start()
        if self.eot.fallback_note:
            self.emit(Notice("warning", self.eot.fallback_note))
        self.emit(Listening())
        try:
            for frame in self.source.frames(stop):
                with self.state.lock:
                    self.listener.feed(frame)
                    self.speaking.check_playing()
                    if max_turns is not None and len(self.turns) >= max_turns and self.state.playing is None:
                        break
                    self.listener.check_no_speech(frame)
        finally:
            self._shut_down()
        return self.turns

    def _shut_down(self) -> None:
        """The run is over: the replies under way stop, the streams close, the worker threads end."""
        with self.state.lock:
            u = self.state.utt
            for t in (self.state.playing, u.spec_turn if u else None, u.draft if u else None):
                if t is not None:
                    t.cancel()
        self.source.close()
        self.sink.close()
        self.decodes.close()
        self.drafts.close()
        self.endpointing.close()

    def _on_asr(self, r: AsrResult) -> None:
        """ASR thread: a decode's result goes to the stage that uses it, if its utterance is still current."""
        text_end = self.endpointing.text_end(r) if r.job.kind == "final" else None
        with self.state.lock:
            u = self.state.utt
            if u is None or r.job.turn != self.state.utt_id:
                return
            if r.job.kind == "partial":
                self.listener.on_partial(u, r.text)
            else:
                self.endpointing.on_final_decode(u, r, text_end)

    # ------------------------------------------------------------------ requests from the UI (any thread)

    def end_utterance(self) -> bool:
        """The person says the turn is over (push-to-talk released, a "done" button): end it now, with no
        end-of-turn wait. False when there is nothing to end (no speech under way, or already ended)."""
        with self.state.lock:
            u, ep = self.state.utt, self.endpointer
            if u is None or u.endpointed or ep.state not in ("speech", "pause"):
                return False
            ep.state = "idle"
            self.endpointing.endpoint(time.monotonic(), forced="ended by the person")
            return True

    def stop_reply(self) -> bool:
        """Stop the reply now, as a barge-in would (a stop button): generation and playback stop, the
        history keeps only what was played, and an Interruption follows. False when nothing is playing."""
        with self.state.lock:
            if self.state.playing is None:
                return False
            self.speaking.interrupt(self.state.playing, time.monotonic())
            return True

    # ------------------------------------------------------------------ what a reply reports (its threads)

    def is_live(self, turn: Turn) -> bool:
        """The turn is still wanted: playing, or the current utterance's draft or speculative turn."""
        return self.state.is_live(turn)

    def first_clause_synthesised(self, turn: Turn) -> None:
        """Synthesis thread: a turn's first clause has its audio; Smart Turn may be waiting for it."""
        self.endpointing.first_clause_synthesised(turn)

    def count_wasted_draft(self, answer: Answer) -> None:
        """Generation thread: a draft ended without becoming the turn; its tokens were computed for nothing."""
        self.drafts.count_wasted_draft(answer)
