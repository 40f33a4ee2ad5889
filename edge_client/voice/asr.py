"""Streaming recognition with faster-whisper's bundled tiny.en (CTranslate2, int8).

Why not `WhisperModel.transcribe`: it pads every call to 30 s of audio, so the
encoder costs ~0.4 s on a 2-core CPU however short the utterance. CTranslate2
accepts shorter mel inputs, so we feed the utterance plus `pad_s` of silence:
~0.09 s for a 3 s question. That makes it affordable to re-decode the whole
utterance every few hundred milliseconds while the person speaks (partials,
stabilised by local agreement) and to run the final decode the moment the
person pauses, before the endpoint is even decided.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .assets import whisper_model_dir
from .blas import one_blas_thread
from .worker import LatestJobWorker

RATE = 16000


@dataclass
class AsrOptions:
    language: str = "en"  # forced: tiny.en is English-only; no language detection pass
    # Greedy: CTranslate2 returns each step's distribution (the last word's probability, which the end-of-turn
    # judge reads) only for a greedy decode; with a beam, a final transcript's last-word probability is unknown.
    beam_size: int = 1
    compute_type: str = "int8"
    # One CTranslate2 thread: a final decode took ~105 ms on one thread against ~135 ms on two (the decoder's
    # small per-token products gain nothing from a second thread), and the other core stays free for Smart Turn,
    # the prompt prefill and the cloud. End of speech -> first audio paired median -50 ms, faster on 80 % of
    # queries (scripts/bench_voice.py --compare="--asr-threads 1", docs/journal/voice.md).
    cpu_threads: int = 1
    pad_s: float = 1.0  # silence appended before encoding; "full" context = 30 s if pad_s < 0
    # Silence put before the utterance. The VAD's pre-roll leaves ~0.2 s before the speech, and with so
    # little lead tiny.en heard the demo's last word "France" as "friends" in 7 of 24 syntheses; with
    # 0.2 s more, 24 of 24 right (docs/journal/voice.md).
    lead_s: float = 0.2
    partial_interval_ms: int = 300  # re-decode while speaking at most this often
    model_dir: str | None = None  # a CTranslate2 Whisper directory instead of the bundled tiny.en (measurements)
    max_gap_ms: int = 300  # longer silences inside an utterance are shortened to this before decoding


@dataclass
class Recognition:
    text: str
    last_word_prob: float | None = None  # Whisper's probability of the last word (its least likely token)


class Transcriber:
    """One-shot decoding of a short utterance (<= 29 s) with a context cut to its length."""

    def __init__(self, opts: AsrOptions | None = None) -> None:
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import Tokenizer

        self.opts = opts or AsrOptions()
        self.model = WhisperModel(
            self.opts.model_dir or str(whisper_model_dir()),
            device="cpu",
            compute_type=self.opts.compute_type,
            cpu_threads=self.opts.cpu_threads,
        )
        self.tokenizer = Tokenizer(
            self.model.hf_tokenizer, self.model.model.is_multilingual, task="transcribe", language=self.opts.language
        )
        self.prompt = self.model.get_prompt(self.tokenizer, [], without_timestamps=True)
        self.lock = threading.Lock()  # one decode at a time (CTranslate2 model shared)

    def transcribe(self, audio: np.ndarray) -> str:
        return self.recognize(audio).text

    def recognize(self, audio: np.ndarray, final: bool = False) -> Recognition:
        """The transcript. A `final` one also has Whisper's probability of its last word (the end-of-turn judge
        uses it: a function word cut off at a pause often comes out as a confident-looking other word), and
        a loop that `collapse_repeats` could not cut ("T- ya T- ya" for "See ya!") is decoded again whole,
        as offline (30 s context, temperature fallback): ~0.5 s more, on ~1 % of turns (docs/journal/voice.md)."""
        import ctranslate2

        dur = len(audio) / RATE
        if dur < 0.1:
            return Recognition("")
        if dur > 29.0 or self.opts.pad_s < 0:
            return Recognition(self._whole(audio))
        if self.opts.lead_s > 0:
            audio = np.concatenate([np.zeros(int(self.opts.lead_s * RATE), np.float32), audio.astype(np.float32)])
        with one_blas_thread():  # the same features whatever the process's BLAS threads (blas.py)
            feats = self.model.feature_extractor(audio)
        n = feats.shape[-1]
        target = min(3000, int(np.ceil((n + self.opts.pad_s * 100) / 100.0) * 100))
        feats = np.pad(feats, ((0, 0), (0, max(0, target - n))))[:, :target]
        sv = ctranslate2.StorageView.from_array(np.ascontiguousarray(feats[None], dtype=np.float32))
        with self.lock:
            res = self.model.model.generate(
                sv,
                [self.prompt],
                beam_size=self.opts.beam_size,
                max_length=int(16 + 10 * dur),
                suppress_blank=True,
                suppress_tokens=[-1],
                return_scores=False,
                return_logits_vocab=final and self.opts.beam_size == 1,
            )
        ids = [t for t in res[0].sequences_ids[0] if t < self.tokenizer.eot]
        text = collapse_repeats(self.tokenizer.decode(ids).strip())
        if not final:
            return Recognition(text)
        if still_loops(text):
            return Recognition(self._whole(audio))
        if self.opts.beam_size != 1:
            return Recognition(text)
        word, prob = self._last_word(self._kept(ids, text), res[0].logits[0])
        # the probability belongs to the transcript's last word only (a check: _kept found where it ends)
        tail = re.findall(r"[\w']+", text.lower())
        return Recognition(text, prob if word is not None and tail and tail[-1] == word else None)

    def _whole(self, audio: np.ndarray) -> str:
        """faster-whisper's own decode: 30 s context, temperature fallback on loops (the offline reference)."""
        with self.lock:  # the segments are decoded while they are read
            with one_blas_thread():  # only the features (computed before transcribe returns), not the decode
                segs, _ = self.model.transcribe(
                    audio,
                    language=self.opts.language,
                    beam_size=self.opts.beam_size,
                    without_timestamps=True,
                    condition_on_previous_text=False,
                    vad_filter=False,
                )
            return " ".join(s.text.strip() for s in segs).strip()

    def _kept(self, ids: list[int], text: str) -> list[int]:
        """The tokens of `ids` up to the last word of `text`: where collapse_repeats cut a loop ("Can you help
        me? Can you help me? Can you" -> "Can you help me?"), the word the transcript ends on is the one before
        the cut, not the loop's last (its probability, not None, then reaches the end-of-turn judge)."""
        want = _norm_words(text)
        if _norm_words(self.tokenizer.decode(ids)) == want:
            return ids
        for j in range(1, len(ids)):
            if _norm_words(self.tokenizer.decode(ids[:j])) == want:
                return ids[:j]
        return ids

    def _last_word(self, ids: list[int], logits: list) -> tuple[str | None, float | None]:
        """The decoded last word (lower case, punctuation aside) and the probability of its least likely token;
        `logits[j]` is the decoder's distribution at the step that chose `ids[j]` (greedy)."""
        pieces = [self.tokenizer.decode([t]) for t in ids]
        j = len(ids) - 1
        while j >= 0 and not re.search(r"\w", pieces[j]):  # trailing punctuation
            j -= 1
        if j < 0:
            return None, None
        k = j  # back to the token that starts the word (a leading space), within the word's characters
        while k > 0 and not pieces[k].startswith(" ") and re.search(r"\w", pieces[k - 1]):
            k -= 1
        logp = []
        for i in range(k, j + 1):
            x = np.asarray(logits[i], np.float64)
            x = x - x.max()
            logp.append(x[ids[i]] - np.log(np.exp(x).sum()))
        word = "".join(pieces[k : j + 1]).strip().lower()
        return "".join(re.findall(r"[\w']+", word)), float(np.exp(min(logp)))


def close_gaps(frames: list[np.ndarray], voiced: list[bool], max_gap: int) -> np.ndarray:
    """The utterance with every silent run longer than `max_gap` frames cut to `max_gap` (half kept at each end).

    Why: with the context cut to the utterance, tiny.en often ends its transcript at a long pause
    inside it ("will I have enough to, [900 ms] get a new Roku" -> "Well I have enough to."); the
    pause benchmark lost the rest of 1 query in 4 that way. A trailing run is kept whole.
    """
    keep: list[np.ndarray] = []
    run: list[np.ndarray] = []
    for x, v in zip(frames, voiced):
        if not v:
            run.append(x)
            continue
        if len(run) > max_gap:
            run = run[: max_gap // 2] + run[len(run) - (max_gap - max_gap // 2) :]
        keep += run
        run = []
        keep.append(x)
    keep += run
    return np.concatenate(keep) if keep else np.zeros(0, np.float32)


def collapse_repeats(text: str) -> str:
    """Cut Whisper's loop: with a short context tiny.en sometimes repeats the utterance into the padding.

    The text is cut at the first sentence that repeats an earlier one (or starts like one, when the
    repeat was truncated at the end), or where a run of three or more words repeats without
    punctuation; a word said three or more times in a row is kept once ("Paris Paris Paris" -> "Paris").
    """
    runs: list[list[str]] = []
    for w in text.split():
        if runs and _norm(w) and _norm(w) == _norm(runs[-1][0]):
            runs[-1].append(w)
        else:
            runs.append([w])
    words = [w for run in runs for w in (run[:1] if len(run) >= 3 else run)]
    text = " ".join(words[: _first_repeat(words)])
    sents = re.findall(r"[^.!?]+[.!?]*", text)
    seen: list[str] = []
    out = ""
    for i, s in enumerate(sents):
        n = " ".join(_norm(w) for w in s.split())
        if n and any(n == p or (i == len(sents) - 1 and p.startswith(n)) for p in seen):
            break
        seen.append(n)
        out += s
    return out.strip()


def still_loops(text: str) -> bool:
    """A run of two or more words said again at once ("T- ya T- ya", "spell, desert, spel, desert"): a loop
    `collapse_repeats` left (it cuts whole-sentence and 3+ word repeats). Two streaming final decodes in
    200 looped so and cost 3.5 points of WER on 100 fluent queries; the offline decode got both right."""
    w = _norm_words(text)
    return any(
        w[i : i + n] == w[i + n : i + 2 * n] for n in range(2, len(w) // 2 + 1) for i in range(len(w) - 2 * n + 1)
    )


def _first_repeat(words: list[str]) -> int:
    """Index where a run of >= 3 words starts to repeat the run just before it (unpunctuated loops;
    a repeat cut short by the end counts when >= 2 words of it are there); len(words) if none."""
    norm = [_norm(w) for w in words]
    for i in range(3, len(norm)):
        for n in range(3, i + 1):
            tail = norm[i : i + n]
            if len(tail) >= 2 and tail == norm[i - n : i - n + len(tail)]:
                return i
    return len(words)


def _norm(w: str) -> str:
    return re.sub(r"[^\w']", "", w.lower())


def _norm_words(text: str) -> list[str]:
    """The words of `text`, lower case, punctuation aside (a word of punctuation only drops out)."""
    return [w for w in map(_norm, text.split()) if w]


class LocalAgreement:
    """Commit the words two consecutive hypotheses agree on (LocalAgreement-2).

    The committed prefix only grows, so what the person sees stops flickering;
    the rest is shown as the unstable tail.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.committed: list[str] = []
        self._prev: list[str] = []

    def update(self, hypothesis: str) -> tuple[str, str]:
        words = hypothesis.split()
        k = 0
        while k < min(len(words), len(self._prev)) and _norm(words[k]) == _norm(self._prev[k]):
            k += 1
        if k > len(self.committed) and all(_norm(a) == _norm(b) for a, b in zip(self.committed, words)):
            self.committed = words[:k]
        self._prev = words
        n = len(self.committed)
        return " ".join(self.committed), " ".join(words[n:])


@dataclass
class AsrJob:
    turn: int
    kind: str  # "partial" | "final"
    audio: np.ndarray
    upto_t: float  # capture time of the last sample included


@dataclass
class AsrResult:
    job: AsrJob
    text: str
    done_t: float
    last_word_prob: float | None = None  # final decodes only (the end-of-turn judge's input)


class AsrWorker:
    """Background decoder. Partial jobs replace each other (only the newest matters);
    a final job is never dropped by a later partial."""

    def __init__(
        self,
        transcriber: Transcriber,
        on_result: Callable[[AsrResult], None],
        wanted: Callable[[AsrJob], bool] | None = None,
    ) -> None:
        self.tx = transcriber
        self.on_result = on_result
        self.wanted = wanted  # checked just before a job runs: a stale one is skipped
        self.last_error: Exception | None = None
        self._worker: LatestJobWorker[AsrJob] = LatestJobWorker(
            "asr", self._decode, lambda waiting, new: waiting.kind == "final" and new.kind == "partial"
        )

    @property
    def busy(self) -> bool:
        return self._worker.busy

    def submit(self, job: AsrJob) -> None:
        self._worker.submit(job)

    def close(self) -> None:
        self._worker.close()

    def _decode(self, job: AsrJob) -> None:
        # A speculative final whose pause ended in more speech (a VAD dip mid-word) would cost ~100 ms
        # of both cores and delay the next partial; it is dropped unstarted.
        if self.wanted is not None and not self.wanted(job):
            return
        try:
            rec = self.tx.recognize(job.audio, final=job.kind == "final")
        except Exception as e:  # keep the long-running app alive; report as empty
            rec = Recognition("")
            self.last_error = e
        self.on_result(AsrResult(job, rec.text, time.monotonic(), rec.last_word_prob))
