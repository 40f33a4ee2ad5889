"""The device model's text end-of-turn signal (edge_client/message_end.py) on the real bundled model,
and the end-of-turn rule that fuses it with Smart Turn (edge_client/voice/endofturn.py)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.message_end import MessageEnd, user_message_start
from edge_client.voice.endofturn import EndOfTurn, TurnOptions
from tests.conftest import chat
from tests.helpers import make_generator

# P(end) read from logits: run again under kernel noise (`make test-noise`); the margins below are 10x or more.
pytestmark = pytest.mark.kernel

# The issue's own examples (#30): each fragment is a request cut before its end; P(end) after the
# fragment is ~0.001, after the whole request 0.1-0.5 (margins far above kernel noise, 0.6 nats).
FRAGMENTS = ["Set a timer for", "Text my sister that", "How many ounces are", "Who wrote", "Play some"]
WHOLE = ["Set a timer for ten minutes", "Text my sister that I'm running late", "How many ounces are in a pound?"]
WHOLE += ["Who wrote Hamlet?", "Play some jazz"]


@pytest.fixture(scope="module")
def gen(edge_model):
    g = make_generator(edge_model, None, mode="edge")
    yield g
    g.close()


def test_the_device_model_reads_fragments_as_unfinished_and_whole_requests_as_ends(gen):
    """With the default thresholds every fragment is unfinished and every whole request is not: the
    word rule alone misses three of the five fragments ("that", "are", "some")."""
    eot = EndOfTurn(TurnOptions(word_rule=False), model=object())
    o = TurnOptions()
    for frag, whole in zip(FRAGMENTS, WHOLE):
        p_frag, p_whole = gen.end_of_message(chat(frag)), gen.end_of_message(chat(whole))
        assert p_frag is not None and p_frag < o.text_unfinished_below, (frag, p_frag)
        assert p_whole is not None and p_whole >= o.text_finished_from, (whole, p_whole)
        assert eot.unfinished(frag, None, p_frag) and not eot.unfinished(whole, None, p_whole)


def test_reading_the_end_is_the_prefill_nothing_is_decoded_twice(gen, edge_model):
    """`end_of_message` decodes the whole prompt (the answer's own start): a prefill of the same prompt
    then has nothing to decode, and a second read is remembered. Reading a cut of a prompt already in
    the cache rolls back to it. The read equals a fresh context's read of that prompt (up to kernels)."""
    q = chat("What is the capital city of France?")
    p = gen.end_of_message(q)
    assert gen.prefill(q, complete=True) == 0, "end_of_message prefilled the whole prompt"
    assert gen.end_of_message(q) == p
    cut = chat("What is the capital city of")
    p_cut = gen.end_of_message(cut)  # its last word is inside the cached prompt: read again
    assert p_cut is not None and p_cut < p
    fresh = make_generator(edge_model, None, mode="edge")
    try:
        for m, got in ((q, p), (cut, p_cut)):
            again = fresh.end_of_message(m)
            assert again is not None and abs(np.log(again) - np.log(got)) < 0.6, (m, again, got)
    finally:
        fresh.close()


def test_the_user_text_is_found_in_the_prompt_even_when_it_is_one_letter(edge_model):
    """A search for the text itself finds "i" inside "assistant"; the marker render does not."""
    ends = MessageEnd(edge_model)
    for text in ("i", "is", "a", "Hi!"):
        rendered, start = user_message_start(edge_model, chat(text))
        assert start is not None and rendered[start : start + len(text)] == text
        tokens, at = ends.locate(chat(text))
        word = text.rstrip("!")
        assert edge_model.detokenize(tokens[: at + 1]).endswith(word), (text, at)
    assert ends.locate(chat("?!"))[1] is None, "no word: nothing to read"
    assert user_message_start(edge_model, [{"role": "system", "content": "x"}])[1] is None


def test_the_wait_is_short_only_when_audio_and_text_agree():
    """The fused rule: text P(end) under `text_unfinished_below` waits the longest even when Smart Turn says
    finished; between the two thresholds the wait grows as P(end) falls; a sure "?" Whisper put after a
    fragment does not take the fast path; with the device model's signal off the old rule stands."""
    opts = TurnOptions(min_wait_ms=200, max_wait_ms=1200, threshold=0.5)
    eot = EndOfTurn(opts, model=object())
    mid = float(np.sqrt(opts.text_unfinished_below * opts.text_finished_from))  # halfway on the log scale
    cases = [  # (Smart Turn p, text P(end), wait, finished)
        (0.9, 0.3, 200, True),
        (0.9, 0.001, 1200, False),  # the audio says finished, the text says "set a timer for"
        (0.9, mid, 700, False),
        (0.2, 0.3, 800, False),  # the audio's doubt alone, as before
        (0.2, mid, 800, False),  # the larger doubt sets the wait
        (0.0, 0.3, 1200, False),
    ]
    for p_audio, p_text, wait, finished in cases:
        d = eot.new_decision()
        eot.judge_text(d, "Set a timer for ten minutes", 0.99, p_text)
        d.probability = p_audio
        assert eot.wait_ms(d, 250, text_known=True) == wait and d.finished is finished, (p_audio, p_text)
    fragment_closed = eot.new_decision()
    eot.judge_text(fragment_closed, "How many ounces are?", 0.99, 0.0004)
    assert not fragment_closed.text_sure_end and fragment_closed.text_unfinished
    assert eot.wait_ms(fragment_closed, 250, text_known=True) == 1200 and "P(end)=0.000" in fragment_closed.summary()
    sure = eot.new_decision()
    eot.judge_text(sure, "Who wrote Hamlet?", 0.99, 0.2)
    assert sure.text_sure_end and eot.wait_ms(sure, 250, text_known=True) == 200
    off = EndOfTurn(TurnOptions(text_model=False), model=object())
    d = off.new_decision()
    off.judge_text(d, "How many ounces are?", 0.99, 0.0004)
    assert d.text_end is None and d.text_sure_end and off.wait_ms(d, 250, text_known=True) == 200
    with pytest.raises(ValueError, match="text_unfinished_below"):
        TurnOptions(text_unfinished_below=0.5, text_finished_from=0.1).validate()


def test_a_fragment_whisper_closed_with_a_question_mark_does_not_take_the_fast_path(gen):
    """Whisper writes "How many ounces are?" for the audio cut at a pause: Whisper is sure of its words,
    the word rule sees a complete-looking question, and before the device model's signal the turn ended
    after the short wait without asking Smart Turn. The device model reads the fragment as unfinished."""
    eot, before = EndOfTurn(TurnOptions(), model=object()), EndOfTurn(TurnOptions(text_model=False), model=object())
    for fragment in ("How many ounces are?", "Text my sister that?", "Do you want?"):
        p = gen.end_of_message(chat(fragment))
        d, old = eot.new_decision(), before.new_decision()
        eot.judge_text(d, fragment, 0.99, p)
        before.judge_text(old, fragment, 0.99, p)
        assert old.text_sure_end and before.wait_ms(old, 250, text_known=True) == 200, "the old fast path"
        assert not d.text_sure_end and d.text_unfinished, (fragment, p)
        assert eot.wait_ms(d, 250, text_known=True) == TurnOptions().max_wait_ms
    whole = "How many ounces are in a pound?"
    d = eot.new_decision()
    eot.judge_text(d, whole, 0.99, gen.end_of_message(chat(whole)))
    assert d.text_sure_end and eot.wait_ms(d, 250, text_known=True) == TurnOptions().min_wait_ms
