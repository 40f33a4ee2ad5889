"""Deciding that the person's turn is over (the judge itself is endofturn.py).

At each pause the speculative transcript is checked for a mid-phrase ending or a last word like
"that" that Whisper was unsure of (then the turn waits `turn.max_wait_ms`), else Smart Turn judges
the audio up to `turn.judge_after_ms` into the pause, once the transcript is in; a turn that sounds
finished ends after `turn.min_wait_ms` of silence. The speculative answer still starts at the first
silent frame; its audio stays held until the turn is judged over.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import numpy as np

from .asr import AsrResult
from .decodes import DecodeScheduler
from .dialogue import Dialogue
from .drafts import Drafts
from .endofturn import EndOfTurn
from .events import Event, Notice, TurnJudged
from .options import VoiceOptions
from .reply import ReplyContext, Turn
from .speaking import Speaking
from .state import PipelineState, Utterance
from .vad import Endpointer
from .worker import LatestJobWorker


class Endpointing:
    """Each pause judged (transcript, then Smart Turn on its own thread), its wait set, and the endpoint.

    Runs under `state.lock`, on the caller's thread (from the listener), the ASR thread (`on_final_decode`),
    or a UI thread (`VoicePipeline.end_utterance`); `judge_audio` (the end-of-turn thread) and
    `first_clause_synthesised` (a synthesis thread) take the lock themselves, and `text_end` (the ASR
    thread) runs outside it."""

    def __init__(
        self,
        state: PipelineState,
        opts: VoiceOptions,
        eot: EndOfTurn,
        endpointer: Endpointer,
        decodes: DecodeScheduler,
        drafts: Drafts,
        speaking: Speaking,
        reply: ReplyContext,
        emit: Callable[[Event], None],
    ) -> None:
        self.state = state
        self.opts = opts
        self.eot = eot
        self.endpointer = endpointer
        self.decodes = decodes
        self.drafts = drafts
        self.speaking = speaking
        self.reply = reply
        self.emit = emit
        # Smart Turn takes ~85 ms on one busy core here: on its own thread, so frames keep flowing.
        self._worker: LatestJobWorker[tuple[int, int, np.ndarray]] | None = (
            LatestJobWorker("end-of-turn", self.judge_audio) if eot.smart else None
        )

    def on_pause(self) -> None:
        """First silent frame: open this pause's end-of-turn judgement (Smart Turn on its own thread)."""
        u = self.state.utt
        if u is None:
            return
        u.pause_no += 1
        u.decision = self.eot.new_decision(u.pauses)
        u.judged, u.judge_frames = False, None
        if self.eot.smart:
            self.endpointer.stop_delay_ms = self.eot.opts.max_wait_ms  # until the judgement says otherwise
        else:  # after a pause, judged (its decision made at the pause)
            u.decision = u.decision or self.eot.new_decision(u.pauses)
            u.decision.wait_ms = self.endpointer.stop_delay_ms

    def maybe_judge(self) -> None:
        """Smart Turn on the audio up to `judge_after_ms` into the pause (not at a one-frame dip inside a word),
        once the transcript is in and only if it neither ends mid-phrase nor closes itself with Whisper sure of
        its last word (`TurnOptions.sure_end_prob`): then the transcript alone decides. Run
        beside the final Whisper decode (`TurnOptions.judge_at` "pause"), it delayed that decode and the whole
        answer on two cores. With "first-clause" it also waits for the speculative answer's first piece to be
        synthesised (measured slower to the first audio: docs/journal/voice.md)."""
        u = self.state.utt
        if u is None or u.judged or not self.eot.smart or self.state.silence_ms < self.eot.opts.judge_after_ms:
            return
        if u.judge_frames is None:
            u.judge_frames = len(u.audio)
        at = self.eot.opts.judge_at
        if at != "pause" and u.spec_text is None and self.opts.speculative and self.eot.opts.text_cue:
            return  # the final decode is still running
        t = u.spec_turn
        if at == "first-clause" and t is not None and not t.first_clause_done.is_set():
            return  # the speculative answer's first clause is being written and synthesised: that comes first
        u.judged = True
        if u.decision is not None and u.decision.text_decides:
            self._set_wait(u)
            return
        assert self._worker is not None
        self._worker.submit((self.state.utt_id, u.pause_no, np.concatenate(u.audio[: u.judge_frames])))

    def first_clause_synthesised(self, turn: Turn) -> None:
        """Synthesis thread: a turn's first clause has its audio (held, when speculative). If it is this
        pause's speculative answer, Smart Turn may run now (`TurnOptions.judge_at` "first-clause")."""
        if not self.state.lock.acquire(timeout=0.5):  # else the next frame's maybe_judge gets it
            return
        try:
            u = self.state.utt
            if u is not None and u.spec_turn is turn and self.endpointer.state == "pause":
                self.maybe_judge()
        finally:
            self.state.lock.release()

    def judge_audio(self, job: tuple[int, int, np.ndarray]) -> None:
        """End-of-turn thread: Smart Turn on the audio up to the pause."""
        utt_id, pause_no, audio = job
        with self.state.lock:
            u = self.state.utt
            if u is None or utt_id != self.state.utt_id or pause_no != u.pause_no or u.decision is None:
                return
            d = u.decision
        try:
            self.eot.judge_audio(d, audio)
        except Exception as e:  # keep listening: the turn then ends after the long wait
            self.emit(Notice("warning", f"end-of-turn model failed: {e}"))
            return
        with self.state.lock:
            if self.state.utt is u and u.pause_no == pause_no:
                self._set_wait(u)

    def _set_wait(self, u: Utterance) -> None:
        """Both inputs in (the audio's judgement and, with the text cue, the transcript): set the pause's wait."""
        if u.decision is None or u.endpointed or self.endpointer.state != "pause":
            return
        text_known = u.spec_text is not None or not self.opts.speculative
        wait = self.eot.wait_ms(u.decision, self.opts.vad.stop_delay_ms, text_known)
        if wait is not None and u.decision.wait_ms != wait:
            u.decision.wait_ms = wait
            self.endpointer.stop_delay_ms = wait
            self.emit(TurnJudged(replace(u.decision)))

    def endpoint(self, t: float, forced: str = "") -> None:
        """The turn is over: the final decode (or the speculative one's text) makes the answer. `forced`
        says why it ended without the end-of-turn wait (too long, or the person said so)."""
        u = self.state.utt
        if u is None:
            return
        ep = self.endpointer
        u.endpointed = True
        u.timings.speech_end = ep.last_voiced_t
        u.timings.endpoint_decided = time.monotonic()
        u.decision = u.decision or self.eot.new_decision(u.pauses)  # made at the pause, unless forced mid-speech
        if forced:
            u.decision.note, u.decision.wait_ms = forced, 0
        else:
            u.decision.wait_ms = ep.stop_delay_ms
        if u.spec_voiced_t == ep.last_voiced_t:
            if u.spec_text is not None:  # speculative decode done: its text is final
                self.speaking.answer(u, u.spec_text)
            return  # else the decode in flight finishes the turn in on_final_decode
        self.decodes.final(u, ep.last_voiced_t)

    def on_final_decode(self, u: Utterance, r: AsrResult, text_end: float | None) -> None:
        """ASR thread: a final decode of the current utterance. The transcript is judged, the speculative
        answer starts (held), and the turn is answered if the endpoint came first."""
        if r.job.upto_t != u.spec_voiced_t:  # speech resumed after this decode started
            return
        u.timings.asr_final = r.done_t
        u.spec_text = r.text
        if u.decision is not None:
            self.eot.judge_text(u.decision, r.text, r.last_word_prob, text_end)
            if text_end is None and self._wants_text_end(r.text):
                u.decision.note = "the device model's P(end) was not read: the word rule and Smart Turn alone"
        # No speculative answer to a transcript that ends mid-phrase, unless the turn is over: the
        # pause waits the long wait (or was a dip inside a word), and on two cores a wasted answer
        # slows the decodes that matter (the endpoint then starts the answer, as without speculation).
        mid_phrase = self.eot.unfinished(r.text, r.last_word_prob, text_end)
        wanted = u.endpointed or not (self.eot.smart and self.eot.opts.text_cue and mid_phrase)
        if wanted and r.text.strip() and not Dialogue.is_reset_command(r.text) and self.state.playing is None:
            u.spec_turn = self.drafts.take_draft(u, r.text) or Turn(self.reply, r.text, u.timings, held=True)
        else:
            self.drafts.give_up(u)
        if u.endpointed:
            self.speaking.answer(u, r.text)
            return
        self._set_wait(u)
        if self.endpointer.state == "pause":
            self.maybe_judge()

    def _wants_text_end(self, text: str) -> bool:
        return self.eot.smart and self.eot.opts.text_cue and self.eot.opts.text_model and bool(text.strip())

    def text_end(self, r: AsrResult) -> float | None:
        """ASR thread, outside the lock: the device model's P(end) for a final transcript. Reading it is
        the prefill of this transcript's prompt, which the answer needs anyway (RoutedGenerator.prefill)."""
        if not self._wants_text_end(r.text) or not self.decodes.wanted(r.job):
            return None
        try:
            return self.reply.gen.end_of_message(self.reply.messages(r.text))
        except Exception as e:  # the turn still ends: on the word rule and Smart Turn
            self.emit(Notice("warning", f"the device model could not read the transcript's end: {e}"))
            return None

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
