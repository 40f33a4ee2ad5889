"""The voice pipeline: frames in, events out, speech to the sink.

Stages and threads:
  caller thread   source frames -> Silero VAD -> endpointer -> utterance buffer, partial decode requests
  asr thread      Whisper decodes (partials while speaking; the final one at the first pause)
  prefill thread  decodes the prompt from the latest partial transcript while the person speaks
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

End of turn (endofturn.py): at each pause the speculative transcript is checked
for a mid-phrase ending, or a last word like "that" that Whisper was unsure of
(then the turn waits `turn.max_wait_ms`), else Smart
Turn judges the audio up to `turn.judge_after_ms` into the pause, once the
transcript is in; a turn that sounds finished ends after `turn.min_wait_ms` of
silence. The speculative answer still starts at the first silent frame; its
audio stays held until the turn is judged over.

Drafts (`draft`, off by default: measured not to pay on two cores): while the
person speaks, each partial transcript whose words changed starts a held draft
of the answer (its first clause generated and synthesised, then generation
parks). If the speculative final transcript has the same words, the draft
becomes the turn and its audio is released the moment the turn ends; otherwise
it is cancelled (the generator keeps the prompt prefix both share).

Barge-in (full duplex): speech onset during playback pauses the speaker at
once; `barge_in_min_ms` of speech confirms the interruption (generation stops,
history keeps only what was played); a shorter sound resumes playback.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import numpy as np

from ..answer import Answer, TokenEvent
from .asr import AsrJob, AsrOptions, AsrResult, AsrWorker, LocalAgreement, Transcriber, close_gaps
from .audio_io import FileSource, Frame, Playback
from .blas import limit_blas_threads
from .dialogue import Dialogue, DialogueOptions
from .endofturn import EndOfTurn, TurnDecision, TurnOptions, load_end_of_turn, unfinished_text
from .events import (
    AnswerToken,
    Event,
    FinalTranscript,
    Interruption,
    Listening,
    Notice,
    PartialTranscript,
    ReplyHeld,
    SpeechStarted,
    TurnDone,
    TurnJudged,
)
from .timings import TurnTimings, playback_gaps
from .tts import ClauseChunker, Synthesizer, TtsOptions
from .vad import FRAME, FRAME_S, Endpointer, Ev, SileroVad, VadOptions
from .worker import LatestJobWorker

log = logging.getLogger(__name__)


def same_words(a: str, b: str) -> bool:
    """Two transcripts say the same words (case and punctuation aside): a draft made from one answers the other."""
    return _words(a) == _words(b)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


class NoSpeechError(RuntimeError):
    """The input held no speech the VAD accepted."""


@dataclass
class VoiceOptions:
    vad: VadOptions = field(default_factory=VadOptions)
    asr: AsrOptions = field(default_factory=AsrOptions)
    tts: TtsOptions = field(default_factory=TtsOptions)
    dialogue: DialogueOptions = field(default_factory=DialogueOptions)
    max_tokens: int = 96
    full_duplex: bool = False  # listen while speaking (headphones); enables barge-in
    barge_in_min_ms: int = 300  # speech needed to interrupt; shorter sounds (cough, "mm") do not
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


class Sink(Protocol):
    buffer: Playback
    rate: int
    source_rate: int

    def put(self, audio: np.ndarray) -> int: ...
    def start(self) -> None: ...
    def close(self) -> None: ...


class Source(Protocol):
    def frames(self, stop: threading.Event): ...
    def start(self) -> None: ...
    def close(self) -> None: ...


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


class Prefiller:
    """Prefills the prompt from the latest partial transcript in the background.

    Latest request wins; a request is dropped if it went stale (the utterance
    moved on to its final decode) before the thread got to it. Runs on its own
    thread so neither recognition nor the audio loop waits for the ~40 ms decode.
    A `complete` request decodes the whole prompt (see `RoutedGenerator.prefill`).
    """

    def __init__(self, gen: VoiceGenerator, is_current: Callable[[int], bool]) -> None:
        self.gen = gen
        self.is_current = is_current
        self.n_prefilled = 0  # prompt tokens decoded ahead of time, over all requests
        self._worker: LatestJobWorker[tuple[int, list[dict], bool]] = LatestJobWorker("prefill", self._prefill)

    def submit(self, utt_id: int, messages: list[dict], complete: bool = False) -> None:
        self._worker.submit((utt_id, messages, complete))

    def close(self) -> None:
        self._worker.close()

    def _prefill(self, job: tuple[int, list[dict], bool]) -> None:
        utt_id, messages, complete = job
        if not self.is_current(utt_id):
            return
        try:
            self.n_prefilled += self.gen.prefill(messages, complete=complete)
        except Exception as e:  # an optimisation only: the turn decodes whatever is missing
            log.warning("prefill from the partial transcript failed (the turn will decode the prompt itself): %s", e)


class Turn:
    """One answer: generation -> clause chunks -> Piper -> (held or live) playback."""

    def __init__(
        self, p: "VoicePipeline", user_text: str, timings: TurnTimings, held: bool, draft: bool = False
    ) -> None:
        self.p = p
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
            p.sink.buffer.start_turn()
        self._gen_t = threading.Thread(
            target=self._generate, args=(p.dialogue.messages(user_text),), name="gen", daemon=True
        )
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
                if parked and not self.p.is_live(self):  # its utterance was dropped: never park forever
                    self.stop.set()  # (a parked draft holds the generator's lock)
                if not parked and time.monotonic() > deadline:
                    break

        try:
            self.answer = self.p.engines.gen.generate(
                messages, max_tokens=self.p.opts.max_tokens, on_token=on_token, stop=self.stop
            )
        except BaseException as e:  # reported by the tts thread; the app keeps running
            self.error = e
        if self.draft and not self._adopted.is_set() and self.answer is not None:
            self.p.count_wasted_draft(self.answer)
        self._tokq.put(None)

    # synthesis thread
    def _speak(self) -> None:
        chunker = ClauseChunker(self.p.opts.tts)
        synth = self.p.engines.synth
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
                    if self.p.opts.first_chunk_priority and not self.timings.first_piece_cached:
                        self._gen_may_run.clear()  # set again once this first piece is synthesised
                elif ahead < self.p.opts.synth_low_water_s:
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
                record = (len(piece.split()), ahead, t_done - t0, seg[1] / self.p.sink.rate, wait)
                self.timings.pieces.append(record)
                if self._adopted.is_set():
                    self._gen_may_run.set()
                else:  # a draft: park generation after the first clause
                    self._gen_may_run.clear()
                self._first_clause_out()
            if item is None:
                break
        if self.error is not None:
            self.p.emit(Notice("error", f"generation failed: {self.error}"))
        self._first_clause_out()  # no (more) audio is coming: nothing to wait for
        self.synth_done.set()

    def ahead_s(self) -> float:
        """Seconds of this reply's audio queued and not yet played (held audio counts: it all plays at release)."""
        with self._lock:
            if not self.released:
                return sum(len(a) for a in self._held_audio) / self.p.sink.source_rate
        return max(0, self.p.sink.buffer.pending) / self.p.sink.rate

    def _first_clause_out(self) -> None:
        if not self.first_clause_done.is_set():
            self.first_clause_done.set()
            self.p.first_clause_synthesised(self)

    def _token(self, ev: TokenEvent) -> None:
        with self._lock:
            if not self.released:
                self._held_tokens.append(ev)
                return
        self.p.emit(AnswerToken(ev))

    def _audio(self, audio: np.ndarray) -> int:
        with self._lock:
            if not self.released:
                self._held_audio.append(audio)
                return int(round(len(audio) * self.p.sink.rate / self.p.sink.source_rate))
        n = self.p.sink.put(audio)
        self._puts.append((time.monotonic(), n))
        return n

    def release(self) -> None:
        """The endpoint confirmed the turn: play what is held, stream the rest."""
        with self._lock:
            self.p.sink.buffer.start_turn()
            t = time.monotonic()
            for a in self._held_audio:
                self._puts.append((t, self.p.sink.put(a)))
            tokens, self._held_tokens, self._held_audio = self._held_tokens, [], []
            self.released = True
        for ev in tokens:
            self.p.emit(AnswerToken(ev))

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
        t0 = self.p.sink.buffer.first_out_t
        if t0 is not None:
            self.timings.playback_gaps, self.timings.playback_gap_ms = playback_gaps(
                self._puts, t0, self.p.sink.rate, self._playback_pauses, until
            )

    def playback_resumed(self, paused_at: float) -> None:
        """A possible barge-in held playback since `paused_at` and was not one: not a gap (measure_gaps)."""
        self._playback_pauses.append((paused_at, time.monotonic() - paused_at))

    def cancel(self) -> None:
        self.stop.set()
        self._gen_may_run.set()

    def finished(self) -> bool:
        return self.synth_done.is_set() and self.p.sink.buffer.pending <= 0

    def join(self, timeout: float = 10.0) -> None:
        self._gen_t.join(timeout)
        self._tts_t.join(timeout)

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


@dataclass
class _Utterance:
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
        self.turns: list[TurnDone] = []
        self.events: list[Event] = []
        self._lock = threading.RLock()
        self._utt: _Utterance | None = None
        self._utt_id = 0
        self._last_decision: tuple[TurnDecision | None, str] = (None, "off")
        self.n_drafts = 0  # drafts started from partial transcripts (each a held first clause)
        # what the drafts that were not used cost: tokens generated for nothing, and those of them the cloud wrote
        self.wasted_draft_tokens = 0
        self.wasted_draft_cloud_tokens = 0
        self._count_lock = threading.Lock()
        self._playing: Turn | None = None
        self._preroll: deque[np.ndarray] = deque(maxlen=max(1, int(self.opts.vad.preroll_ms / 1000 / FRAME_S)))
        self._pending = np.zeros(0, np.float32)
        self._pause_t: float | None = None
        self._onset_t: float | None = None
        self._silence_ms = 0.0
        self._reply_limit_s: float | None = None
        self._asr = AsrWorker(engines.transcriber, self._on_asr, self._asr_wanted)
        self._prefiller = Prefiller(engines.gen, self._prefill_wanted) if self.opts.prefill_partials else None
        self.eot = engines.end_of_turn(self.opts.turn)
        # Smart Turn takes ~85 ms on one busy core here: on its own thread, so frames keep flowing.
        self._eot_worker: LatestJobWorker[tuple[int, int, np.ndarray]] | None = (
            LatestJobWorker("end-of-turn", self._judge_audio) if self.eot.smart else None
        )

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens decoded from partial transcripts while the person spoke (0 when off)."""
        return self._prefiller.n_prefilled if self._prefiller is not None else 0

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
        self._reply_limit_s = reply_limit_s
        self.sink.start()
        self.source.start()
        if self.eot.fallback_note:
            self.emit(Notice("warning", self.eot.fallback_note))
        self.emit(Listening())
        try:
            for frame in self.source.frames(stop):
                with self._lock:
                    self._feed(frame)
                    self._check_playing()
                    if max_turns is not None and len(self.turns) >= max_turns and self._playing is None:
                        break
                    self._check_no_speech(frame)
        finally:
            with self._lock:
                for t in (
                    self._playing,
                    self._utt.spec_turn if self._utt else None,
                    self._utt.draft if self._utt else None,
                ):
                    if t is not None:
                        t.cancel()
            self.source.close()
            self.sink.close()
            self._asr.close()
            if self._prefiller is not None:
                self._prefiller.close()
            if self._eot_worker is not None:
                self._eot_worker.close()
        return self.turns

    def _check_no_speech(self, frame: Frame) -> None:
        src = self.source
        if not isinstance(src, FileSource) or src.t0 is None or self._utt is not None or self.turns or self._playing:
            return
        if (
            self.endpointer.state == "idle"
            and frame.t_end - src.t0 > src.duration_s + self.opts.vad.stop_delay_ms / 1000 + 0.5
        ):
            raise NoSpeechError(
                "no speech detected in the input (silence or noise only); "
                "speak closer to the microphone or check the file"
            )

    # ------------------------------------------------------------------ requests from the UI (any thread)

    def end_utterance(self) -> bool:
        """The person says the turn is over (push-to-talk released, a "done" button): end it now, with no
        end-of-turn wait. False when there is nothing to end (no speech under way, or already ended)."""
        with self._lock:
            u, ep = self._utt, self.endpointer
            if u is None or u.endpointed or ep.state not in ("speech", "pause"):
                return False
            ep.state = "idle"
            self._endpoint(time.monotonic(), forced="ended by the person")
            return True

    def stop_reply(self) -> bool:
        """Stop the reply now, as a barge-in would (a stop button): generation and playback stop, the
        history keeps only what was played, and an Interruption follows. False when nothing is playing."""
        with self._lock:
            if self._playing is None:
                return False
            self._interrupt(self._playing, time.monotonic())
            return True

    # ------------------------------------------------------------------ listening

    def _feed(self, frame: Frame) -> None:
        x = np.concatenate([self._pending, frame.samples]) if len(self._pending) else frame.samples
        n = len(x) // FRAME
        for i in range(n):
            t = frame.t_end - (len(x) - (i + 1) * FRAME) / 16000
            self._on_vad_frame(x[i * FRAME : (i + 1) * FRAME], t)
        self._pending = x[n * FRAME :].copy()

    def _on_vad_frame(self, x: np.ndarray, t: float) -> None:
        ep = self.endpointer
        if self._playing is not None and not self.opts.full_duplex:
            if ep.state != "idle":  # half duplex: the microphone is ignored while the assistant speaks
                ep.reset()
                self._discard_utterance()
            self._preroll.clear()
            return
        ep.min_speech_ms = self.opts.barge_in_min_ms if self._playing is not None else self.opts.vad.min_speech_ms
        prob = self.vad(x)
        self._preroll.append(x)
        if ep.state != "idle" and self._utt is not None:
            self._utt.audio.append(x)
            self._utt.voiced.append(prob >= self.opts.vad.neg_threshold)
        ev = ep.update(prob, t)
        if ev is Ev.ONSET:
            self._discard_utterance()  # one still waiting for its final decode is given up, as before
            self._utt = _Utterance(TurnTimings(), audio=list(self._preroll), voiced=[True] * len(self._preroll))
            self._onset_t = ep.onset_t
            if self._playing is not None and self.opts.pause_on_onset:
                self.sink.buffer.paused = True
                self._pause_t = time.monotonic()
                self.emit(ReplyHeld(ep.onset_t, held=True))
        elif ev is Ev.FALSE_START:
            self._utt = None
            if self._pause_t is not None:
                self.sink.buffer.paused = False
                if self._playing is not None:
                    self._playing.playback_resumed(self._pause_t)
                self._pause_t = None
                self.emit(ReplyHeld(t, held=False))
        elif ev is Ev.START:
            self._utt_id += 1
            self.agreement.reset()
            assert self._utt is not None
            self._utt.timings.speech_start = ep.onset_t
            if self._playing is not None:
                self._interrupt(self._playing, ep.onset_t)
            self.emit(SpeechStarted(ep.onset_t))
        elif ev is Ev.PAUSE:
            self._silence_ms = FRAME_S * 1000
            self._on_pause()
        elif ev is Ev.RESUME:
            if self._utt is not None:
                self._utt.pauses += 1
            self._drop_speculation()
        elif ev is Ev.END:
            self._endpoint(t)
        if ep.state == "pause" and ev is not Ev.PAUSE:
            self._silence_ms += FRAME_S * 1000
        if ep.state == "pause":
            self._maybe_judge()
        if ep.state in ("speech", "pause") and self._utt is not None:
            self._maybe_decode(t)

    def _maybe_decode(self, t: float) -> None:
        u, o = self._utt, self.opts
        assert u is not None
        n = len(u.audio) * FRAME
        if n / 16000 > o.max_utterance_s:
            self.endpointer.state = "idle"
            self._endpoint(t, forced="utterance too long")
            return
        if self.endpointer.state == "pause":
            if o.speculative and u.spec_voiced_t is None and self._silence_ms >= o.speculate_after_ms:
                u.spec_voiced_t = self.endpointer.last_voiced_t
                self._asr.submit(AsrJob(self._utt_id, "final", self._asr_audio(u), u.spec_voiced_t))
            return
        if (n - u.last_partial_samples) / 16000 * 1000 >= o.asr.partial_interval_ms and not self._asr.busy:
            u.last_partial_samples = n
            self._asr.submit(AsrJob(self._utt_id, "partial", self._asr_audio(u), t))

    def _on_pause(self) -> None:
        """First silent frame: open this pause's end-of-turn judgement (Smart Turn on its own thread)."""
        u = self._utt
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

    def _maybe_judge(self) -> None:
        """Smart Turn on the audio up to `judge_after_ms` into the pause (not at a one-frame dip inside a word),
        once the transcript is in and only if it neither ends mid-phrase nor closes itself with Whisper sure of
        its last word (`TurnOptions.sure_end_prob`): then the transcript alone decides. Run
        beside the final Whisper decode (`TurnOptions.judge_at` "pause"), it delayed that decode and the whole
        answer on two cores. With "first-clause" it also waits for the speculative answer's first piece to be
        synthesised (measured slower to the first audio: docs/journal/voice.md)."""
        u = self._utt
        if u is None or u.judged or not self.eot.smart or self._silence_ms < self.eot.opts.judge_after_ms:
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
        assert self._eot_worker is not None
        self._eot_worker.submit((self._utt_id, u.pause_no, np.concatenate(u.audio[: u.judge_frames])))

    def first_clause_synthesised(self, turn: Turn) -> None:
        """Synthesis thread: a turn's first clause has its audio (held, when speculative). If it is this
        pause's speculative answer, Smart Turn may run now (`TurnOptions.judge_at` "first-clause")."""
        if not self._lock.acquire(timeout=0.5):  # else the next frame's _maybe_judge gets it
            return
        try:
            u = self._utt
            if u is not None and u.spec_turn is turn and self.endpointer.state == "pause":
                self._maybe_judge()
        finally:
            self._lock.release()

    def _judge_audio(self, job: tuple[int, int, np.ndarray]) -> None:
        """End-of-turn thread: Smart Turn on the audio up to the pause."""
        utt_id, pause_no, audio = job
        with self._lock:
            u = self._utt
            if u is None or utt_id != self._utt_id or pause_no != u.pause_no or u.decision is None:
                return
            d = u.decision
        try:
            self.eot.judge_audio(d, audio)
        except Exception as e:  # keep listening: the turn then ends after the long wait
            self.emit(Notice("warning", f"end-of-turn model failed: {e}"))
            return
        with self._lock:
            if self._utt is u and u.pause_no == pause_no:
                self._set_wait(u)

    def _set_wait(self, u: _Utterance) -> None:
        """Both inputs in (the audio's judgement and, with the text cue, the transcript): set the pause's wait."""
        if u.decision is None or u.endpointed or self.endpointer.state != "pause":
            return
        text_known = u.spec_text is not None or not self.opts.speculative
        wait = self.eot.wait_ms(u.decision, self.opts.vad.stop_delay_ms, text_known)
        if wait is not None and u.decision.wait_ms != wait:
            u.decision.wait_ms = wait
            self.endpointer.stop_delay_ms = wait
            self.emit(TurnJudged(replace(u.decision)))

    def _asr_audio(self, u: _Utterance) -> np.ndarray:
        """The utterance for Whisper, long pauses inside it shortened (see asr.close_gaps)."""
        return close_gaps(u.audio, u.voiced, max(1, int(self.opts.asr.max_gap_ms / 1000 / FRAME_S)))

    def _drop_speculation(self) -> None:
        u = self._utt
        if u is None:
            return
        if u.spec_turn is not None:
            u.spec_turn.cancel()
        u.spec_turn, u.spec_text, u.spec_voiced_t = None, None, None
        # The cancelled turn may still mark stages on its way out: it keeps the old object, and the
        # utterance starts afresh, so its asr_final or first token never precede the real ones.
        u.timings = TurnTimings(speech_start=u.timings.speech_start)

    def _endpoint(self, t: float, forced: str = "") -> None:
        """The turn is over: the final decode (or the speculative one's text) makes the answer. `forced`
        says why it ended without the end-of-turn wait (too long, or the person said so)."""
        u = self._utt
        if u is None:
            return
        u.endpointed = True
        u.timings.speech_end = self.endpointer.last_voiced_t
        u.timings.endpoint_decided = time.monotonic()
        u.decision = u.decision or self.eot.new_decision(u.pauses)  # made at the pause, unless forced mid-speech
        if forced:
            u.decision.note, u.decision.wait_ms = forced, 0
        else:
            u.decision.wait_ms = self.endpointer.stop_delay_ms
        if u.spec_voiced_t == self.endpointer.last_voiced_t:
            if u.spec_text is not None:  # speculative decode done: its text is final
                self._final(u, u.spec_text)
            return  # else the decode in flight finishes the turn in _on_asr
        u.spec_voiced_t = self.endpointer.last_voiced_t
        self._asr.submit(AsrJob(self._utt_id, "final", self._asr_audio(u), u.spec_voiced_t))

    # ------------------------------------------------------------------ recognition results (asr thread)

    def _on_asr(self, r: AsrResult) -> None:
        text_end = self._text_end(r) if r.job.kind == "final" else None
        with self._lock:
            u = self._utt
            if u is None or r.job.turn != self._utt_id:
                return
            if r.job.kind == "partial":
                if not u.endpointed and u.spec_voiced_t is None:
                    stable, unstable = self.agreement.update(r.text)
                    self.emit(PartialTranscript(stable, unstable))
                    if len(r.text.split()) >= 2 and self._playing is None:
                        if self.opts.draft:
                            self._draft(u, r.text)
                        elif self._prefiller is not None:
                            # The whole hypothesis, not just the stable words: a wrong guess costs only
                            # the tokens after the first difference (generate keeps the common prefix).
                            self._prefiller.submit(
                                self._utt_id, self.dialogue.messages(r.text), complete=self.opts.prefill_complete
                            )
                return
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
            if wanted and r.text.strip() and not Dialogue.is_reset_command(r.text) and self._playing is None:
                u.spec_turn = self._take_draft(u, r.text) or Turn(self, r.text, u.timings, held=True)
            elif u.draft is not None:
                u.draft.cancel()
                u.draft, u.draft_outcome = None, "miss"
            if u.endpointed:
                self._final(u, r.text)
                return
            self._set_wait(u)
            if self.endpointer.state == "pause":
                self._maybe_judge()

    def _wants_text_end(self, text: str) -> bool:
        return self.eot.smart and self.eot.opts.text_cue and self.eot.opts.text_model and bool(text.strip())

    def _text_end(self, r: AsrResult) -> float | None:
        """ASR thread, outside the lock: the device model's P(end) for a final transcript. Reading it is
        the prefill of this transcript's prompt, which the answer needs anyway (RoutedGenerator.prefill)."""
        if not self._wants_text_end(r.text) or not self._asr_wanted(r.job):
            return None
        try:
            return self.engines.gen.end_of_message(self.dialogue.messages(r.text))
        except Exception as e:  # the turn still ends: on the word rule and Smart Turn
            self.emit(Notice("warning", f"the device model could not read the transcript's end: {e}"))
            return None

    def _draft(self, u: _Utterance, text: str) -> None:
        """A partial transcript: draft the reply from it unless the current draft has the same words.

        No draft from a partial that ends mid-phrase ("what is the capital city of"): the final
        transcript cannot match it, and on two cores a wasted draft slows the next partial."""
        if u.draft is not None:
            if same_words(u.draft.user_text, text):
                return
            u.draft.cancel()
            u.draft = None
        if len(_words(text)) < 3 or unfinished_text(text) or Dialogue.is_reset_command(text):
            return
        u.draft = Turn(self, text, TurnTimings(), held=True, draft=True)
        self.n_drafts += 1

    def count_wasted_draft(self, answer: Answer) -> None:
        """Generation thread: a draft ended without becoming the turn; its tokens were computed for nothing."""
        with self._count_lock:
            self.wasted_draft_tokens += answer.n_tokens
            self.wasted_draft_cloud_tokens += answer.n_cloud_tokens

    def _take_draft(self, u: _Utterance, text: str) -> Turn | None:
        """The speculative final transcript is in: the draft becomes the turn if it has the same words."""
        d = u.draft
        if d is None:
            return None
        if same_words(d.user_text, text) and not d.stop.is_set():
            d.adopt(text, u.timings)  # before it stops being u.draft: a parked draft that is not live stops itself
            u.draft, u.draft_outcome = None, "hit"
            return d
        d.cancel()
        u.draft, u.draft_outcome = None, "miss"
        return None

    def is_live(self, turn: Turn) -> bool:
        """The turn is still wanted: playing, or the current utterance's draft or speculative turn."""
        u = self._utt
        return self._playing is turn or (u is not None and (u.draft is turn or u.spec_turn is turn))

    def _discard_utterance(self) -> None:
        """Drop the utterance in progress with its draft and speculative turn."""
        u, self._utt = self._utt, None
        if u is not None:
            for t in (u.draft, u.spec_turn):
                if t is not None:
                    t.cancel()

    def _asr_wanted(self, job: AsrJob) -> bool:
        """A decode is still useful: its utterance is current and, for a final one, its pause still holds."""
        with self._lock:
            u = self._utt
            return (
                u is not None and job.turn == self._utt_id and (job.kind == "partial" or job.upto_t == u.spec_voiced_t)
            )

    def _prefill_wanted(self, utt_id: int) -> bool:
        """A prefill request is still useful: same utterance, still speaking, nothing generating."""
        with self._lock:
            u = self._utt
            return (
                u is not None
                and utt_id == self._utt_id
                and u.spec_voiced_t is None
                and not u.endpointed
                and self._playing is None
            )

    def _final(self, u: _Utterance, text: str) -> None:
        """The endpoint is decided and the transcript is final: answer (or reset)."""
        self._utt = None
        self._last_decision = (u.decision, u.draft_outcome if self.opts.draft else "off")
        if u.draft is not None:
            u.draft.cancel()
        text = text.strip()
        self.emit(FinalTranscript(text))
        if not text:
            self.emit(Notice("warning", "heard speech but could not recognise words; please repeat"))
            self.emit(Listening())
            return
        if Dialogue.is_reset_command(text):
            self.dialogue.reset()
            if u.spec_turn is not None:
                u.spec_turn.cancel()
            done = TurnDone(text, None, "", False, u.timings, reset=True, end_of_turn=u.decision)
            self.turns.append(done)
            self.emit(done)
            self.emit(Notice("info", "conversation reset"))
            self.emit(Listening())
            return
        turn = u.spec_turn
        if turn is None:
            turn = Turn(self, text, u.timings, held=False)
        else:
            turn.release()
        turn.end_of_turn, turn.draft_outcome = self._last_decision
        self._playing = turn

    # ------------------------------------------------------------------ playback and barge-in

    def _check_playing(self) -> None:
        turn = self._playing
        if turn is None:
            return
        buf = self.sink.buffer
        if buf.first_out_t is not None:
            turn.timings.mark("first_audio_out", buf.first_out_t)
            limit = self._reply_limit_s
            if limit is not None and buf.played >= limit * self.sink.rate and not turn.stop.is_set():
                turn.cancel()
                buf.flush()
        if not turn.finished():
            return
        turn.join()
        turn.measure_gaps()
        self._playing = None
        text = turn.full_text.strip()
        self.dialogue.add_exchange(turn.user_text, text)
        done = TurnDone(
            turn.user_text,
            turn.answer,
            text,
            False,
            turn.timings,
            end_of_turn=turn.end_of_turn,
            draft=turn.draft_outcome,
        )
        self.turns.append(done)
        self.vad.reset()
        self.endpointer.reset()
        self.emit(done)
        self.emit(Listening())

    def _interrupt(self, turn: Turn, onset_t: float) -> None:
        """Barge-in confirmed: stop generation and playback; keep only what was heard."""
        t_stopped = self._pause_t or time.monotonic()
        self.sink.buffer.paused = True
        turn.cancel()
        played = self.sink.buffer.flush()
        self.sink.buffer.paused = False
        self._pause_t = None
        if self.sink.buffer.first_out_t is not None:
            turn.timings.mark("first_audio_out", self.sink.buffer.first_out_t)
        heard = turn.heard_text(played)
        turn._gen_t.join(1.0)  # generation stops within a token
        turn.measure_gaps(until=t_stopped)
        self._playing = None
        self.dialogue.add_exchange(turn.user_text, heard)
        self.emit(Interruption(onset_t, t_stopped, heard))
        done = TurnDone(
            turn.user_text,
            turn.answer,
            heard,
            True,
            turn.timings,
            end_of_turn=turn.end_of_turn,
            draft=turn.draft_outcome,
        )
        self.turns.append(done)
        self.emit(done)
