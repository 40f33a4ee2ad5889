"""The turn-taking benchmark's audio (tests/turn_audio.py), checked with real espeak-ng, Piper and Whisper."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from turn_audio import (
    EspeakVoice,
    Recording,
    WordAligner,
    boundary_items,
    halves_speech,
    parse_wav_bytes,
    read_recordings,
    spliced_recording,
    spliced_speech,
    split_tune_test,
    trim_silence,
    voices,
    wav_with_silence,
)
from voice_audio import _quiet_runs, wer
from voice_audio import words as norm_words

from edge_client.voice.asr import AsrOptions, Transcriber
from edge_client.voice.resample import resample
from edge_client.voice.wavfile import read_audio

RATE = 16000
SENTENCE = "what is the weather like in boston today".split()
CUT = 5  # "what is the weather like | in boston today"


@pytest.fixture(scope="module")
def synths() -> dict[str, object]:
    return voices(["piper:fixed", "espeak:en-us", "espeak:en-gb-x-rp"])


@pytest.fixture(scope="module")
def tx() -> Transcriber:
    return Transcriber(AsrOptions())


@pytest.fixture(scope="module")
def aligner(tx: Transcriber) -> WordAligner:
    return WordAligner(tx.model)


def inner_pause(audio: np.ndarray, min_ms: int) -> tuple[int, int]:
    """The one quiet run of at least `min_ms` with speech on both sides (samples)."""
    runs = [(s, e) for s, e in _quiet_runs(audio, RATE, min_ms=min_ms) if s > 0 and e < len(audio) - RATE // 20]
    assert len(runs) == 1, f"expected one pause of >= {min_ms} ms inside the speech, got {runs}"
    return runs[0]


@pytest.mark.parametrize("voice", ["en-us", "en-gb-x-rp"])
def test_espeak_speech_transcribes_back(synths, tx, voice):
    s = synths[f"espeak:{voice}"]
    text = "set a timer for ten minutes"
    a = s.synthesize(text)
    assert s.rate == 22050 and s.name == f"espeak:{voice}"
    assert a.dtype == np.float32 and 0.2 < np.abs(a).max() <= 1.0 and len(a) / s.rate > 1.0
    heard = tx.transcribe(resample(a, s.rate, RATE))
    assert wer(text, heard) <= 0.34, heard


def test_what_whisper_hears_does_not_depend_on_the_process_blas_threads(synths, tx):
    """Issue 44: with numpy's BLAS on two threads (the library's default, before anything limits it) tiny.en
    heard this phrase as "Center timer for 10 minutes.", on one thread (the voice pipeline's) right. The
    log-mel products now run on one thread whatever the process-wide limit, which they leave as it was."""
    from edge_client.voice.blas import blas_threads, limit_blas_threads, one_blas_thread

    s = synths["espeak:en-gb-x-rp"]
    audio = resample(s.synthesize("set a timer for ten minutes"), s.rate, RATE)
    before = blas_threads()
    heard = {}
    try:
        for n in (2, 1):
            limit_blas_threads(n)
            heard[n] = tx.recognize(audio, final=True)
            assert blas_threads() == n
            with one_blas_thread():
                assert blas_threads() == 1
            assert blas_threads() == n  # restored
    finally:
        limit_blas_threads(before)
    assert heard[1] == heard[2], heard
    assert wer("set a timer for ten minutes", heard[1].text) <= 0.2, heard


def test_wer_reads_number_words_as_their_digits():
    assert norm_words("Set a timer for ten minutes, twenty-one") == "set a timer for 10 minutes 20 1".split()
    assert wer("set a timer for ten minutes", "Set a timer for 10 minutes.") == 0.0
    assert wer("set a timer for ten minutes", "Center timer for 10 minutes.") == 2 / 6


def test_espeak_stdout_parses_like_a_file(tmp_path):
    """The piped WAV's header has placeholder sizes; its samples must still be those of the file espeak-ng writes."""
    path = tmp_path / "e.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "165", "-w", str(path), "hello there"], check=True, timeout=30)
    ref, rate = read_audio(path)
    got = EspeakVoice("en-us").synthesize("hello there")
    assert rate == 22050
    n = len(ref)
    assert len(got) >= n and np.abs(got[:n] - ref).max() < 1e-4 and not np.any(got[n:])
    with pytest.raises(ValueError, match="not a WAV"):
        parse_wav_bytes(b"not audio at all")


def test_espeak_errors_say_what_to_do(monkeypatch):
    with pytest.raises(RuntimeError, match="nosuchvoice"):
        EspeakVoice("nosuchvoice")
    with pytest.raises(ValueError, match="unknown voice"):
        voices(["festival"])
    monkeypatch.setattr("turn_audio.shutil.which", lambda _: None)
    with pytest.raises(RuntimeError, match="apt-get install espeak-ng"):
        EspeakVoice("en-us")


def test_piper_samples_its_prosody_unless_fixed(synths):
    sampling, fixed = voices(["piper"])["piper"], synths["piper:fixed"]
    text = "what is the weather like"
    assert not np.array_equal(sampling.synthesize(text), sampling.synthesize(text))
    assert np.array_equal(fixed.synthesize(text), fixed.synthesize(text))


def test_trim_silence_keeps_a_short_margin(synths):
    s = synths["espeak:en-us"]
    a = trim_silence(s.synthesize("hello"), s.rate)
    padded = np.concatenate([np.zeros(s.rate, np.float32), a, np.zeros(s.rate, np.float32)])
    t = trim_silence(padded, s.rate)
    assert len(a) <= len(t) <= len(a) + int(0.07 * s.rate)  # each side: ~30 ms, not the second padded
    assert len(trim_silence(np.zeros(1000, np.float32), s.rate)) == 0


@pytest.mark.parametrize("voice", ["piper:fixed", "espeak:en-us"])
def test_halves_speech_pauses_at_the_cut(synths, tx, voice):
    a = halves_speech(synths[voice], SENTENCE, CUT, 700)
    s, e = inner_pause(a, 300)
    assert abs((e - s) / RATE * 1000 - 700) <= 60
    before, after = tx.transcribe(a[:s]), tx.transcribe(a[e:])
    assert wer(" ".join(SENTENCE[:CUT]), before) <= 0.2, before
    assert wer(" ".join(SENTENCE[CUT:]), after) <= 0.34, after


@pytest.mark.parametrize("voice", ["piper:fixed", "espeak:en-us"])
def test_spliced_speech_pauses_between_the_right_words(synths, tx, aligner, voice):
    pause = 700
    a = spliced_speech(synths[voice], aligner, SENTENCE, CUT, pause)
    assert a is not None
    s, e = inner_pause(a, pause - 60)
    assert (e - s) / RATE * 1000 <= pause + 60
    before, after = norm_words(tx.transcribe(a[:s])), norm_words(tx.transcribe(a[e:]))
    assert before[-1:] == [SENTENCE[CUT - 1]], before
    assert after[:1] == [SENTENCE[CUT]], after


def test_spliced_speech_is_one_sentence_with_silence_put_in(synths):
    """Before the pause, the audio is the whole sentence's own (espeak-ng is deterministic), not a half's."""
    s = synths["espeak:en-us"]
    whole = resample(s.synthesize(" ".join(SENTENCE)), s.rate, RATE)
    first = resample(s.synthesize(" ".join(SENTENCE[:CUT])), s.rate, RATE)
    a = spliced_speech(s, None, SENTENCE, CUT, 600)
    start, _ = inner_pause(a, 540)
    n = start - RATE // 50  # clear of the fade and the resampler's reach
    assert np.abs(a[:n] - whole[:n]).max() < 1e-3
    assert np.abs(a[:n] - first[:n]).max() > 0.05  # the half said alone differs (its own prosody)
    assert abs((len(a) - len(whole)) / RATE - 0.6) < 0.25  # the silence was added, not taken from the words


def test_spliced_speech_gives_up_when_whisper_does_not_hear_the_words(synths, aligner):
    # the words asked for are not those spoken: no alignment can place the cut
    class Mumbler:
        rate = synths["espeak:en-us"].rate

        def synthesize(self, text: str) -> np.ndarray:
            return synths["espeak:en-us"].synthesize("the quick brown fox jumps over the lazy dog")

    assert spliced_speech(Mumbler(), aligner, SENTENCE, CUT, 600) is None


QUERIES = [
    "what is the weather like in boston today",
    "set a timer for ten minutes",
    "how do i say thank you in french",
    "can you tell me my account balance",
    "please add milk to my shopping list",
    "when is my next dentist appointment",
    "play some jazz music in the kitchen",
    "how long does it take to boil an egg",
    "what's the exchange rate between dollars and euros",
    "remind me to call mom tomorrow morning",
    "book a table for two at seven",
    "is it going to rain this weekend",
    "who won the game last night",
    "turn off the lights in the bedroom",
    "what time does the pharmacy close",
    "find me a cheap flight to denver",
    "Hi!",
    "thanks",
    "ok, got it",
]
FUNCTION_WORDS = frozenset("the a an to for in on at of with from about and or my your".split())


def test_boundary_items_are_seeded_and_cut_anywhere():
    items = boundary_items(QUERIES, 240, seed=7)
    assert items == boundary_items(QUERIES, 240, seed=7)
    assert items != boundary_items(QUERIES, 240, seed=8)
    assert len(items) == 240
    cuts_seen: dict[str, set[int]] = {}
    for query, words, cut, pause in items:
        assert len(words) >= 4 and query in QUERIES and "," not in " ".join(words)
        assert 2 <= cut <= len(words) - 1 and 500 <= pause <= 900
        cuts_seen.setdefault(query, set()).add(cut)
    assert "Hi!" not in cuts_seen and "ok, got it" not in cuts_seen  # too short
    # every boundary of a short query is used, and a third or more of cuts follow a content word
    assert cuts_seen["set a timer for ten minutes"] == {2, 3, 4, 5}
    after_content = sum(words[cut - 1].lower() not in FUNCTION_WORDS for _, words, cut, _ in items)
    assert after_content >= len(items) / 3


def test_split_tune_test_is_stable_and_disjoint():
    qs = [f"query number {i}" for i in range(400)]
    tune, test = split_tune_test(qs, seed=0)
    assert not set(tune) & set(test) and sorted(tune + test) == sorted(qs)
    assert 0.4 < len(test) / len(qs) < 0.6
    tune2, test2 = split_tune_test(qs + [f"another query {i}" for i in range(100)], seed=0)
    assert [q for q in tune2 if q in set(qs)] == tune and [q for q in test2 if q in set(qs)] == test
    assert split_tune_test(qs, seed=1) != (tune, test)
    assert len(split_tune_test(qs, seed=0, test_share=0.2)[1]) < len(test)


def test_wav_with_silence_reports_the_end_of_speech(synths, tmp_path):
    s = synths["espeak:en-us"]
    a = trim_silence(resample(s.synthesize("good morning"), s.rate, RATE), RATE)
    end = wav_with_silence(a, tmp_path / "q.wav", lead_s=0.4, tail_s=0.6)
    audio, rate = read_audio(tmp_path / "q.wav")
    assert rate == RATE and abs(len(audio) / RATE - (0.4 + len(a) / RATE + 0.6)) < 0.002
    assert 0.4 + len(a) / RATE - 0.1 < end < 0.4 + len(a) / RATE
    assert np.abs(audio[int((end + 0.01) * RATE) :]).max() < 0.02


def _record(folder, name: str, audio: np.ndarray, text: str, rate: int = 22050) -> None:
    from edge_client.voice.wavfile import write_wav

    write_wav(folder / f"{name}.wav", resample(audio, RATE, rate), rate)
    (folder / f"{name}.txt").write_text(text + "\n")


def test_recordings_are_read_with_their_words_and_the_pause_marked(synths, tmp_path):
    """People's recordings for the pause benchmark (`--voices recorded:DIR`). No recording of a person is
    on this machine, so Piper's fixed voice stands in for one; what is checked is the reading: any rate
    to 16 kHz, the words, the "|" as the word the speaker paused after, and errors that say what to do."""
    s = synths["piper:fixed"]
    a = resample(s.synthesize("set a timer for ten minutes"), s.rate, RATE)
    _record(tmp_path, "b", a, "Set a timer for | ten minutes.")
    _record(tmp_path, "a", a, "set a timer for ten minutes")
    recs = read_recordings(tmp_path)
    assert [r.name for r in recs] == ["a", "b"]
    assert recs[0].pause_after is None and recs[1].pause_after == 4
    assert recs[0].words == recs[1].words == "set a timer for ten minutes".split()
    assert abs(len(recs[1].audio) - len(a)) <= RATE // 100  # resampled from 22.05 kHz back to 16 kHz
    (tmp_path / "a.txt").write_text("set a | timer for | ten minutes")
    with pytest.raises(ValueError, match="more than one '|'"):
        read_recordings(tmp_path)
    (tmp_path / "a.txt").unlink()
    with pytest.raises(ValueError, match=r"a\.wav: no transcript; write its words to a\.txt"):
        read_recordings(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no recordings"):
        read_recordings(tmp_path / "empty")


def test_a_recorded_request_is_spliced_between_the_right_words(synths, tx, aligner):
    """Silence put into a fluent recording at Whisper's word boundary (its word times run late; the quiet
    before the next word is found). Piper's fixed voice stands in for a person, as above."""
    s = synths["piper:fixed"]
    rec = Recording("q", resample(s.synthesize(" ".join(SENTENCE)), s.rate, RATE), SENTENCE)
    a = spliced_recording(rec, aligner, CUT, 700)
    assert a is not None
    start, end = inner_pause(a, 640)
    assert (end - start) / RATE * 1000 <= 760
    before, after = norm_words(tx.transcribe(a[:start])), norm_words(tx.transcribe(a[end:]))
    assert before[-1:] == [SENTENCE[CUT - 1]], before
    assert after[:1] == [SENTENCE[CUT]], after
    other = Recording("q", rec.audio, "the quick brown fox jumps over the lazy dog".split())
    assert spliced_recording(other, aligner, CUT, 700) is None  # Whisper does not hear these words
