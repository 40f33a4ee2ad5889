"""The reply stage: one answer, generation -> clause chunks -> Piper -> (held or live) playback.

A `Turn` runs on two threads of its own: generation pushes tokens to a queue, synthesis cuts them
into clauses, renders them with Piper and queues the audio to the sink (or holds it, while the turn is
speculative or a draft, until `release`). Generation pauses while Piper renders the first clause, and
later pieces while little audio is queued ahead of them (`VoiceOptions.synth_low_water_s`). What the
turn needs from the pipeline around it is one `ReplyContext`, not the pipeline itself.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..answer import Answer, TokenEvent
from .audio_io import Sink
from .endofturn import TurnDecision
from .engines import VoiceGenerator
from .events import AnswerToken, Event, Notice
from .options import VoiceOptions
from .timings import TurnTimings, playback_gaps
from .tts import ClauseChunker, Synthesizer


@dataclass(frozen=True)
class ReplyContext:
    """What a reply needs from the pipeline around it: the options, where its audio goes, the models, and
    the callbacks through which it reports (each called from the reply's own threads)."""

    opts: VoiceOptions
    sink: Sink
    gen: VoiceGenerator
    synth: Synthesizer
    messages: Callable[[str], list[dict]]  # the prompt for the person's words, history included
    emit: Callable[[Event], None]
    is_live: Callable[["Turn"], bool]  # still wanted (a parked draft that is not stops itself)
    on_first_clause: Callable[["Turn"], None]  # its first clause has audio (or none will come)
    on_wasted_draft: Callable[[Answer], None]  # a draft ended without becoming the turn


class Turn:
    """One answer: generation -> clause chunks -> Piper -> (held or live) playback.

    Two threads of its own (generation, synthesis); it reaches the pipeline only through its `ReplyContext`."""

    def __init__(
        self, ctx: ReplyContext, user_text: str, timings: TurnTimings, held: bool, draft: bool = False
    ) -> None:
        self.ctx = ctx
        self.user_text = user_text
        self.timings = timings
        # A draft parks its generation once the first clause is cut, until adopted (or cancelled):
        # only the first clause is worth computing before the transcript is known to be final.
        self.draft = draft
        self._adopted = threading.Event()
        if not draft:
            self._adopted.set()
        self.stop = threading.Event()
        self.answer: Answer | None = None
        self.error: BaseException | None = None
        self.segments: list[list[Any]] = []  # [text, samples queued in sink rate]
        self.synth_done = threading.Event()
        # Set once the first clause is synthesised (or nothing will be): see TurnOptions.judge_at
        self.first_clause_done = threading.Event()
        self.released = not held
        self.end_of_turn: TurnDecision | None = None
        self.draft_outcome = "off"
        self._held_audio: list[np.ndarray] = []
        self._puts: list[tuple[float, int]] = []  # (when queued to the sink, samples): see measure_gaps
        self._playback_pauses: list[tuple[float, float]] = []  # (start, seconds) a possible barge-in held it
        self._held_tokens: list[TokenEvent] = []
        self._lock = threading.Lock()
        self._tokq: queue.SimpleQueue = queue.SimpleQueue()
        # Cleared while the first clause is synthesised: on a small CPU, generation
        # competing with Piper delays the first audio more than it gains.
        self._gen_may_run = threading.Event()
        self._gen_may_run.set()
        if self.released:
            ctx.sink.buffer.start_turn()
        self._gen_t = threading.Thread(target=self._generate, args=(ctx.messages(user_text),), name="gen", daemon=True)
        self._tts_t = threading.Thread(target=self._speak, name="tts", daemon=True)
        self._gen_t.start()
        self._tts_t.start()

    # generation thread
    def _generate(self, messages: list[dict]) -> None:
        def on_token(ev: TokenEvent) -> None:
            self.timings.mark("llm_first_token", time.monotonic())
            self._tokq.put(ev)
            deadline = time.monotonic() + 0.5
            while not self._gen_may_run.wait(0.05) and not self.stop.is_set():
                parked = self.segments and not self._adopted.is_set()
                if parked and not self.ctx.is_live(self):  # its utterance was dropped: never park forever
                    self.stop.set()  # (a parked draft holds the generator's lock)
                if not parked and time.monotonic() > deadline:
                    break

        try:
            self.answer = self.ctx.gen.generate(
                messages, max_tokens=self.ctx.opts.max_tokens, on_token=on_token, stop=self.stop
            )
        except BaseException as e:  # reported by the tts thread; the app keeps running
            self.error = e
        if self.draft and not self._adopted.is_set() and self.answer is not None:
            self.ctx.on_wasted_draft(self.answer)
        self._tokq.put(None)

    # synthesis thread
    def _speak(self) -> None:
        chunker = ClauseChunker(self.ctx.opts.tts)
        synth = self.ctx.synth
        t_done = time.monotonic()  # when the piece before was synthesised (the turn's start for the first)
        while not self.stop.is_set():
            item = self._tokq.get()
            if item is None:
                pieces = chunker.flush()
            else:
                self._token(item)
                pieces = chunker.feed(item.text)
            for piece in pieces:
                if self.stop.is_set():
                    break
                t_cut = time.monotonic()
                self.timings.mark("first_clause_ready", t_cut)
                ahead = self.ahead_s()
                if not self.segments:
                    self.timings.first_piece_cached = synth.is_cached(piece)
                    if self.ctx.opts.first_chunk_priority and not self.timings.first_piece_cached:
                        self._gen_may_run.clear()  # set again once this first piece is synthesised
                elif ahead < self.ctx.opts.synth_low_water_s:
                    self._gen_may_run.clear()  # the audio ahead is short: this piece first (set again below)
                seg = [piece, 0]
                self.segments.append(seg)
                t0 = time.monotonic()
                for audio in synth.chunks(piece):
                    if self.stop.is_set():
                        break
                    self.timings.mark("tts_first_audio", time.monotonic())
                    seg[1] += self._audio(audio)
                wait, t_done = t_cut - t_done, time.monotonic()
                record = (len(piece.split()), ahead, t_done - t0, seg[1] / self.ctx.sink.rate, wait)
                self.timings.pieces.append(record)
                if self._adopted.is_set():
                    self._gen_may_run.set()
                else:  # a draft: park generation after the first clause
                    self._gen_may_run.clear()
                self._first_clause_out()
            if item is None:
                break
        if self.error is not None:
            self.ctx.emit(Notice("error", f"generation failed: {self.error}"))
        self._first_clause_out()  # no (more) audio is coming: nothing to wait for
        self.synth_done.set()

    def ahead_s(self) -> float:
        """Seconds of this reply's audio queued and not yet played (held audio counts: it all plays at release)."""
        with self._lock:
            if not self.released:
                return sum(len(a) for a in self._held_audio) / self.ctx.sink.source_rate
        return max(0, self.ctx.sink.buffer.pending) / self.ctx.sink.rate

    def _first_clause_out(self) -> None:
        if not self.first_clause_done.is_set():
            self.first_clause_done.set()
            self.ctx.on_first_clause(self)

    def _token(self, ev: TokenEvent) -> None:
        with self._lock:
            if not self.released:
                self._held_tokens.append(ev)
                return
        self.ctx.emit(AnswerToken(ev))

    def _audio(self, audio: np.ndarray) -> int:
        with self._lock:
            if not self.released:
                self._held_audio.append(audio)
                return int(round(len(audio) * self.ctx.sink.rate / self.ctx.sink.source_rate))
        n = self.ctx.sink.put(audio)
        self._puts.append((time.monotonic(), n))
        return n

    def release(self) -> None:
        """The endpoint confirmed the turn: play what is held, stream the rest."""
        with self._lock:
            self.ctx.sink.buffer.start_turn()
            t = time.monotonic()
            for a in self._held_audio:
                self._puts.append((t, self.ctx.sink.put(a)))
            tokens, self._held_tokens, self._held_audio = self._held_tokens, [], []
            self.released = True
        for ev in tokens:
            self.ctx.emit(AnswerToken(ev))

    def adopt(self, user_text: str, timings: TurnTimings) -> None:
        """A draft becomes the turn: the final transcript has its words. Its stage marks (made while the
        person was still speaking) move to the turn's timings, and generation resumes, still held."""
        with self._lock:
            for stage in ("llm_first_token", "first_clause_ready", "tts_first_audio"):
                t = getattr(self.timings, stage)
                if t is not None:
                    timings.mark(stage, t)
            timings.first_piece_cached = self.timings.first_piece_cached
            timings.pieces[:0] = self.timings.pieces
            self.timings = timings
            self.user_text = user_text
        self._adopted.set()
        self._gen_may_run.set()

    def measure_gaps(self, until: float | None = None) -> None:
        """The turn is over (played, cut at the benchmarks' limit, or interrupted at `until`): record where
        the output ran dry inside the reply because synthesis fell behind (TurnTimings.playback_gaps)."""
        t0 = self.ctx.sink.buffer.first_out_t
        if t0 is not None:
            self.timings.playback_gaps, self.timings.playback_gap_ms = playback_gaps(
                self._puts, t0, self.ctx.sink.rate, self._playback_pauses, until
            )

    def playback_resumed(self, paused_at: float) -> None:
        """A possible barge-in held playback since `paused_at` and was not one: not a gap (measure_gaps)."""
        self._playback_pauses.append((paused_at, time.monotonic() - paused_at))

    def cancel(self) -> None:
        self.stop.set()
        self._gen_may_run.set()

    def finished(self) -> bool:
        return self.synth_done.is_set() and self.ctx.sink.buffer.pending <= 0

    def join(self, timeout: float = 10.0) -> None:
        self._gen_t.join(timeout)
        self._tts_t.join(timeout)

    def join_generation(self, timeout: float) -> None:
        """Wait for the generation thread alone (after `cancel`, it stops within a token)."""
        self._gen_t.join(timeout)

    def heard_text(self, played: int) -> str:
        """The answer text the person heard: whole chunks played, plus the played share of the current one."""
        out, left = "", played
        for text, n in self.segments:
            if left >= n:
                out += text
                left -= n
                continue
            if n and left > 0:
                words = text.split()
                out += " " + " ".join(words[: int(len(words) * left / n)])
            break
        return " ".join(out.split())

    @property
    def full_text(self) -> str:
        return self.answer.text if self.answer is not None else "".join(s[0] for s in self.segments)
