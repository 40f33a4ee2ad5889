"""Voice pipeline parts that need no language model: chunking, agreement, resampling, WAV errors,
endpointing with the real Silero VAD on synthesised speech, dialogue bounds, device errors."""

from __future__ import annotations

import struct
import wave
from pathlib import Path

import numpy as np
import pytest

from edge_client.voice.asr import LocalAgreement
from edge_client.voice.audio_io import DeviceError, FileSource, resolve_device
from edge_client.voice.dialogue import Dialogue, DialogueOptions
from edge_client.voice.resample import StreamResampler, resample
from edge_client.voice.tts import ClauseChunker, TtsOptions, speakable
from edge_client.voice.vad import FRAME, Endpointer, Ev, SileroVad, VadOptions
from edge_client.voice.wavfile import AudioFileError, read_wav, write_wav


def feed_all(chunker: ClauseChunker, tokens: list[str]) -> list[str]:
    out = []
    for t in tokens:
        out += chunker.feed(t)
    return out + chunker.flush()


def test_first_chunk_cut_at_first_clause_then_by_sentence():
    toks = ["Sure", ",", " the", " capital", " is", " Paris", ",", " a", " big", " city", ".", " It", " has", " museums", "."]
    c = ClauseChunker()
    emitted = []
    for t in toks:
        emitted.append(c.feed(t))
    # "Sure," is released as soon as the next token shows the comma ends a clause
    assert emitted[2] == ["Sure,"]
    # later chunks are whole sentences, not clauses
    assert c.flush() == [" It has museums."] or emitted[11] == [" the capital is Paris, a big city."]
    assert "".join(feed_all(ClauseChunker(), toks)) == "".join(toks)


def test_run_on_text_is_cut_by_word_limit():
    toks = [" word"] * 30 + [" "]
    chunks = feed_all(ClauseChunker(), toks)
    assert len(chunks) >= 2 and len(chunks[0].split()) == TtsOptions().first_max_words
    assert all(len(c.split()) <= TtsOptions().max_words for c in chunks[1:])


def test_speakable_strips_markdown():
    assert speakable("**Paris** is `nice`\n- item") == "Paris is nice item"


def test_local_agreement_commits_only_agreed_prefix():
    la = LocalAgreement()
    assert la.update("what is") == ("", "what is")
    assert la.update("what is the wea") == ("what is", "the wea")
    assert la.update("What is the weather") == ("What is the", "weather")  # "the" agreed twice
    stable, _ = la.update("what is the weather like")
    assert stable.lower() == "what is the weather"
    stable, unstable = la.update("what was")  # a revision never takes back committed words
    assert la.committed == ["What", "is", "the", "weather"] or stable.lower().startswith("what is the weather")


def test_resample_preserves_tone_and_length():
    t = np.arange(48000) / 48000
    x = np.sin(2 * np.pi * 300 * t).astype(np.float32)
    y = resample(x, 48000, 16000)
    assert len(y) == 16000
    ref = np.sin(2 * np.pi * 300 * np.arange(16000) / 16000)
    assert np.abs(y[100:-100] - ref[100:-100]).max() < 0.05
    r = StreamResampler(48000, 16000)
    z = np.concatenate([r.process(x[i:i + 480]) for i in range(0, 48000, 480)])
    assert abs(len(z) - 16000) <= 2


def test_wav_round_trip_and_stereo_24bit(tmp_path: Path):
    p = tmp_path / "a.wav"
    write_wav(p, np.full(1600, 0.5, np.float32), 16000)
    x, sr = read_wav(p)
    assert sr == 16000 and abs(x.mean() - 0.5) < 1e-3
    q = tmp_path / "b.wav"
    with wave.open(str(q), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(3)
        w.setframerate(8000)
        w.writeframes(b"".join(struct.pack("<i", v)[:3] * 2 for v in [1 << 22] * 100))
    x, sr = read_wav(q)
    assert sr == 8000 and np.allclose(x, 0.5, atol=1e-3)


def test_bad_wavs_give_clear_messages(tmp_path: Path):
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(AudioFileError, match="not a readable WAV"):
        read_wav(corrupt)
    good = tmp_path / "good.wav"
    write_wav(good, np.zeros(16000, np.float32), 16000)
    trunc = tmp_path / "trunc.wav"
    trunc.write_bytes(good.read_bytes()[:30])
    with pytest.raises(AudioFileError, match="truncated"):
        read_wav(trunc)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(good.read_bytes()[:44])
    with pytest.raises(AudioFileError, match="no audio samples"):
        read_wav(empty)
    flt = tmp_path / "float.wav"  # IEEE float WAV (format 3)
    data = np.zeros(100, "<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 64000, 4, 32)
    flt.write_bytes(b"RIFF" + struct.pack("<I", 4 + 8 + 16 + 8 + len(data)) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
                    + b"data" + struct.pack("<I", len(data)) + data)
    with pytest.raises(AudioFileError, match="unsupported sample format.*sox"):
        read_wav(flt)
    with pytest.raises(AudioFileError, match="no such file"):
        FileSource(tmp_path / "missing.wav")


def test_missing_device_says_how_to_list():
    with pytest.raises(DeviceError, match="tokenrouter-edge devices"):
        resolve_device("no-such-microphone-xyz", "input")
    with pytest.raises(DeviceError, match="tokenrouter-edge devices"):
        resolve_device(9999, "output")


def _speech(text: str) -> np.ndarray:
    from edge_client.voice.tts import Synthesizer

    s = Synthesizer()
    return resample(s.synthesize(text), s.rate, 16000)


def _run_endpointer(audio: np.ndarray, opts: VadOptions) -> list[tuple[Ev, float]]:
    vad, ep, out = SileroVad(), Endpointer(opts), []
    for i in range(len(audio) // FRAME):
        t = (i + 1) * FRAME / 16000
        ev = ep.update(vad(audio[i * FRAME:(i + 1) * FRAME]), t)
        if ev is not None:
            out.append((ev, t, ep.last_voiced_t))
    return out


def test_endpointer_on_real_speech_and_clicks():
    speech = _speech("Please set a timer for ten minutes.")
    z = lambda s: np.zeros(int(16000 * s), np.float32)  # noqa: E731
    rng = np.random.default_rng(0)
    click = np.zeros(1600, np.float32)
    click[:40] = rng.uniform(-0.9, 0.9, 40)  # a 2.5 ms click
    audio = np.concatenate([z(0.5), click, z(0.5), 0.8 * speech, z(1.0)])
    opts = VadOptions(stop_delay_ms=250)
    evs = _run_endpointer(audio, opts)
    kinds = [e for e, _, _ in evs]
    assert kinds.count(Ev.START) == 1 and kinds.count(Ev.END) == 1  # the click never opened a turn
    speech_end_true = (0.5 + 0.1 + 0.5 + len(speech) / 16000)
    end = next(e for e in evs if e[0] is Ev.END)
    assert abs(end[2] - speech_end_true) < 0.3  # last voiced frame near the real end of speech
    assert 0.25 <= end[1] - end[2] <= 0.25 + 0.07  # decided stop_delay after it
    assert _run_endpointer(np.concatenate([z(0.5), click, z(1.0)]), opts) in ([], [(Ev.ONSET, pytest.approx(0.576, abs=0.1), pytest.approx(0.6, abs=0.1))]) or all(
        e[0] in (Ev.ONSET, Ev.FALSE_START) for e in _run_endpointer(np.concatenate([z(0.5), click, z(1.0)]), opts))


def test_dialogue_bounded_in_tokens_and_reset():
    d = Dialogue(DialogueOptions(system_prompt="sys", max_history_tokens=50), count_tokens=lambda m: sum(len(x["content"].split()) for x in m))
    for i in range(10):
        d.add_exchange(f"question {i} " + "w " * 5, f"answer {i} " + "w " * 5)
    msgs = d.messages("next")
    assert msgs[0] == {"role": "system", "content": "sys"} and msgs[-1]["content"] == "next"
    assert sum(len(x["content"].split()) for x in d.messages()) <= 50
    assert d.turns[-1]["content"].startswith("answer 9")
    assert Dialogue.is_reset_command("Start over.") and not Dialogue.is_reset_command("how do I start over a failed build in jenkins")
    d.reset()
    assert d.messages() == [{"role": "system", "content": "sys"}]


def test_whisper_repetition_loop_is_cut():
    from edge_client.voice.asr import collapse_repeats

    assert collapse_repeats("Where do you want to eat? Where do you want to eat?") == "Where do you want to eat?"
    assert collapse_repeats("Read my list. Read my list. Read") == "Read my list."
    assert collapse_repeats("Set a timer. For ten minutes.") == "Set a timer. For ten minutes."


def test_whisper_word_loops_are_cut():
    from edge_client.voice.asr import collapse_repeats

    heard = "the capital city of Francis Paris Paris Paris Paris Paris Paris"
    assert collapse_repeats(heard) == "the capital city of Francis Paris"
    assert collapse_repeats("Stop Stop Stop Stop what time is it") == "Stop what time is it"
    assert collapse_repeats("that is very very good") == "that is very very good"  # two in a row is speech


def test_unpunctuated_sentence_loops_are_cut():
    from edge_client.voice.asr import collapse_repeats

    heard = "The capital city of Friends is Paris The capital city of Friends is Paris"
    assert collapse_repeats(heard) == "The capital city of Friends is Paris"
    assert collapse_repeats("set a timer set a timer set a") == "set a timer"
    assert collapse_repeats("what is the date that my visa card expires") == "what is the date that my visa card expires"


def test_voice_flags_reach_the_pipeline_options():
    """`--no-prefill` (privacy: partial transcripts otherwise reach the cloud early) and
    `--no-speculative` turn the techniques off; by default both are on."""
    from edge_client.cli import build_parser
    from edge_client.voice.cli import voice_options_from_args

    on = voice_options_from_args(build_parser().parse_args(["file", "q.wav", "--out", "r.wav"]))
    off = voice_options_from_args(build_parser().parse_args(["file", "q.wav", "--out", "r.wav", "--no-prefill", "--no-speculative"]))
    assert on.prefill_partials and on.speculative
    assert not off.prefill_partials and not off.speculative
    from edge_client.cli import options_from_args

    checked = options_from_args(build_parser().parse_args(["file", "q.wav", "--out", "r.wav", "--check", "--check-nats", "2"]))
    assert checked.check == "all" and checked.check_nats == 2.0
    late = options_from_args(build_parser().parse_args(["file", "q.wav", "--out", "r.wav", "--check", "after-first-clause"]))
    assert late.check == "after-first-clause"
    assert options_from_args(build_parser().parse_args(["file", "q.wav", "--out", "r.wav"])).check == "after-first-clause"
    assert options_from_args(build_parser().parse_args(["file", "q.wav", "--out", "r.wav", "--check", "off"])).check == "off"


def test_a_dropped_speculation_leaves_no_stage_marks_behind():
    """The person paused, a speculative turn started and marked its first token, then speech
    resumed. The utterance must start its stage timings afresh (keeping speech_start), and the
    cancelled turn's late marks must not reach them, or asr_final would follow llm_first_token."""
    from types import SimpleNamespace

    from edge_client.voice.pipeline import VoicePipeline, _Utterance
    from edge_client.voice.timings import TurnTimings

    cancelled = []
    spec = SimpleNamespace(cancel=lambda: cancelled.append(True))
    u = _Utterance(TurnTimings(speech_start=1.0, asr_final=2.0, llm_first_token=2.1), spec_voiced_t=1.9, spec_text="hi", spec_turn=spec)
    old = u.timings
    VoicePipeline._drop_speculation(SimpleNamespace(_utt=u))
    assert cancelled == [True] and u.spec_turn is None and u.spec_voiced_t is None
    assert u.timings is not old and u.timings.speech_start == 1.0
    assert u.timings.asr_final is None and u.timings.llm_first_token is None
    old.mark("first_clause_ready", 2.2)  # the cancelled turn, on its way out
    assert u.timings.first_clause_ready is None
