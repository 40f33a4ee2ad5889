"""The assistant's turn to speak: the reply to a final transcript starts, plays, and ends.

It ends played out, cut at the benchmarks' limit, or interrupted. Barge-in (full duplex): speech
onset during playback pauses the speaker at once (`hold`); `barge_in_min_ms` of speech confirms the
interruption (`interrupt`: generation stops, history keeps only what was played; or, when the
person went on within the longest wait for a pause, the reply is dropped and their request goes on,
`VoiceOptions.rejoin_cut_off`); a shorter sound resumes playback (`resume`). Every method runs under
`state.lock`.
"""

from __future__ import annotations

import time
from typing import Callable

from .audio_io import Sink
from .dialogue import Dialogue
from .events import Event, FinalTranscript, Interruption, Listening, Notice, ReplyHeld, TurnDone
from .options import VoiceOptions
from .reply import ReplyContext, Turn
from .state import PipelineState, Utterance
from .vad import Endpointer, SileroVad


class Speaking:
    """Starts the answer, watches it play, and stops it when the person talks over it."""

    def __init__(
        self,
        state: PipelineState,
        opts: VoiceOptions,
        sink: Sink,
        dialogue: Dialogue,
        reply: ReplyContext,
        vad: SileroVad,
        endpointer: Endpointer,
        emit: Callable[[Event], None],
    ) -> None:
        self.state = state
        self.opts = opts
        self.sink = sink
        self.dialogue = dialogue
        self.reply = reply
        self.vad, self.endpointer = vad, endpointer  # reset once a reply has played: listening starts afresh
        self.emit = emit
        self.reply_limit_s: float | None = None  # see VoicePipeline.run
        self._pause_t: float | None = None  # when a possible barge-in held playback

    def answer(self, u: Utterance, text: str) -> None:
        """The endpoint is decided and the transcript is final: answer (or reset)."""
        self.state.utt = None
        decision = (u.decision, u.draft_outcome if self.opts.draft else "off")
        if u.draft is not None:
            u.draft.cancel()
        text = text.strip()
        self.emit(FinalTranscript(text))
        if not text and self.dialogue.continuing:  # went on with words Whisper could not make out
            self.emit(Notice("warning", "could not recognise what you added; answering your request as it was"))
        elif not text:
            self.emit(Notice("warning", "heard speech but could not recognise words; please repeat"))
            self.emit(Listening())
            return
        if Dialogue.is_reset_command(text):
            self.dialogue.reset()
            if u.spec_turn is not None:
                u.spec_turn.cancel()
            done = TurnDone(text, None, "", False, u.timings, reset=True, end_of_turn=u.decision)
            self.state.turns.append(done)
            self.emit(done)
            self.emit(Notice("info", "conversation reset"))
            self.emit(Listening())
            return
        turn = u.spec_turn
        if turn is None:
            turn = Turn(self.reply, text, u.timings, held=False)
        else:
            turn.release()
        turn.end_of_turn, turn.draft_outcome = decision
        self.state.playing = turn

    def check_playing(self) -> None:
        """Each frame: mark the first audio out, cut the reply at the limit, and close it once played."""
        turn = self.state.playing
        if turn is None:
            return
        buf = self.sink.buffer
        if buf.first_out_t is not None:
            turn.timings.mark("first_audio_out", buf.first_out_t)
            limit = self.reply_limit_s
            if limit is not None and buf.played >= limit * self.sink.rate and not turn.stop.is_set():
                turn.cancel()
                buf.flush()
        if not turn.finished():
            return
        turn.join()
        turn.measure_gaps()
        self.state.playing = None
        text = turn.full_text.strip()
        request = self.dialogue.add_exchange(turn.user_text, text)
        done = self._record(turn, request, text, interrupted=False)
        self.vad.reset()
        self.endpointer.reset()
        self.emit(done)
        self.emit(Listening())

    def hold(self, onset_t: float) -> None:
        """Speech onset: pause the reply playing (if any) until the speech is confirmed or dies."""
        if self.state.playing is not None and self.opts.pause_on_onset:
            self.sink.buffer.paused = True
            self._pause_t = time.monotonic()
            self.emit(ReplyHeld(onset_t, held=True))

    def resume(self, t: float) -> None:
        """The onset was a false start (a cough, "mm"): the held reply plays on."""
        if self._pause_t is None:
            return
        self.sink.buffer.paused = False
        if self.state.playing is not None:
            self.state.playing.playback_resumed(self._pause_t)
        self._pause_t = None
        self.emit(ReplyHeld(t, held=False))

    def interrupt(self, turn: Turn, onset_t: float) -> None:
        """Barge-in confirmed: stop generation and playback; keep only what was heard, or nothing when the
        person went on with the request (`_went_on`): then the next turn answers the whole of it."""
        t_stopped = self._pause_t or time.monotonic()
        self.sink.buffer.paused = True
        turn.cancel()
        played = self.sink.buffer.flush()
        self.sink.buffer.paused = False
        self._pause_t = None
        if self.sink.buffer.first_out_t is not None:
            turn.timings.mark("first_audio_out", self.sink.buffer.first_out_t)
        heard = turn.heard_text(played)
        turn.join_generation(1.0)  # generation stops within a token
        turn.measure_gaps(until=t_stopped)
        self.state.playing = None
        rejoined = self._went_on(turn, onset_t)
        if rejoined:
            request = self.dialogue.continue_request(turn.user_text)
        else:
            request = self.dialogue.add_exchange(turn.user_text, heard)
        self.emit(Interruption(onset_t, t_stopped, heard, rejoined))
        # what went into the history: what was played, or nothing when the person went on
        self.emit(self._record(turn, request, "" if rejoined else heard, interrupted=True, rejoined=rejoined))

    def _went_on(self, turn: Turn, onset_t: float) -> bool:
        """The interrupting speech goes on with the turn's request: it began within the longest wait for a
        pause (`turn.max_wait_ms`) after the person's last word, so a longer wait would have made it one turn."""
        end = turn.timings.speech_end
        window_s = self.opts.turn.max_wait_ms / 1000
        return self.opts.rejoin_cut_off and end is not None and onset_t - end <= window_s

    def _record(self, turn: Turn, request: str, text: str, interrupted: bool, rejoined: bool = False) -> TurnDone:
        """The turn's record, added to the turns done."""
        done = TurnDone(
            turn.user_text,
            turn.answer,
            text,
            interrupted,
            turn.timings,
            end_of_turn=turn.end_of_turn,
            draft=turn.draft_outcome,
            request=request,
            rejoined=rejoined,
        )
        self.state.turns.append(done)
        return done
