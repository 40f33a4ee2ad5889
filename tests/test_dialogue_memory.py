"""The dialogue's memory policy (issue 45): which earlier exchanges go into an answer's prompt.

The device's small model copies the words of whatever answer is in its prompt ("set a timer for ten minutes"
answered with the wifi router's settings), so by default only a follow-up carries the exchanges it follows."""

from __future__ import annotations

import pytest

from edge_client.voice.dialogue import Dialogue, DialogueOptions, is_follow_up

SYS = {"role": "system", "content": "sys"}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


# --------------------------------------------------------------------------- is_follow_up


@pytest.mark.parametrize(
    "request_, previous",
    [
        ("and what about italy", "what is the capital of france"),  # a connective
        ("And on Sunday?", "what time does the store close"),
        ("but is it open late", "where is the nearest pharmacy"),
        ("what about tomorrow", "what is the weather today"),
        ("how long does it take", "how do i cook rice"),  # a pronoun pointing back
        ("Is that true?", "tell me a fun fact about octopuses"),
        ("how do i get there", "where is the eiffel tower"),
        ("what time do they close", "where is the nearest pharmacy"),
        ("which one is bigger", "tell me about mars and venus"),
        ("what time is it there", "what is the capital of japan"),  # "there" still points back
        ("why?", "why is the sky blue"),  # a fragment without a verb
        ("In French.", "how do you say hello"),
    ],
)
def test_follow_ups_count(request_: str, previous: str) -> None:
    assert is_follow_up(request_, previous)


@pytest.mark.parametrize(
    "request_, previous",
    [
        ("set a timer for ten minutes", "how do i reset my wifi router"),
        ("what is two plus two", "tell me a story about a dragon"),
        ("What time is it?", "how do i cook rice"),  # "it" in a set phrase points at nothing
        ("is it going to rain tomorrow", "tell me a joke"),
        ("how cold is it outside", "tell me a joke"),
        ("is there a pharmacy near me", "what is the capital of france"),
        ("what is one plus one", "tell me a joke"),  # "one" as a number
        ("what's the weather this weekend", "tell me a joke"),
        ("play some jazz", "what is the capital of france"),  # short, with a verb of its own
        ("hello", "what is the capital of france"),
        ("explain how vaccines work", "why is the sky blue"),
    ],
)
def test_requests_of_their_own_do_not(request_: str, previous: str) -> None:
    assert not is_follow_up(request_, previous)


def test_nothing_follows_up_without_an_exchange_before_it() -> None:
    assert not is_follow_up("and what about italy", None)
    assert not is_follow_up("how long does it take", None)
    assert not is_follow_up("", "what is the capital of france")


# --------------------------------------------------------------------------- Dialogue.messages per mode


def conversation(memory: str = "follow-ups") -> Dialogue:
    """Four exchanges: one of its own, a chain of two follow-ups, then one of its own."""
    d = Dialogue(DialogueOptions(system_prompt="sys", memory=memory))
    d.add_exchange("tell me a story about a dragon", "Once upon a time a dragon slept.")
    d.add_exchange("what is the capital of france", "Paris.")
    d.add_exchange("and what about italy", "Rome.")
    d.add_exchange("how many people live there", "About three million.")
    return d


def test_follow_ups_memory_carries_the_chain_a_follow_up_belongs_to() -> None:
    d = conversation()
    assert d.follow_ups == [False, False, True, True]
    # an unrelated request: the system prompt and the request, nothing else
    assert d.messages("what is two plus two") == [SYS, user("what is two plus two")]
    # a follow-up of the last exchange, itself a follow-up of one: back to "what is the capital of france"
    assert d.messages("and is it old") == [
        SYS,
        user("what is the capital of france"),
        bot("Paris."),
        user("and what about italy"),
        bot("Rome."),
        user("how many people live there"),
        bot("About three million."),
        user("and is it old"),
    ]
    d.add_exchange("set a timer for ten minutes", "Timer set.")
    # the chain is broken: a follow-up now sees only the timer
    assert d.messages("and another one for five") == [
        SYS,
        user("set a timer for ten minutes"),
        bot("Timer set."),
        user("and another one for five"),
    ]


def test_turns_keep_the_whole_conversation_whatever_the_prompt_carries() -> None:
    d = conversation()
    d.add_exchange("what is two plus two", "Four.")
    assert d.turns[0] == user("tell me a story about a dragon") and d.turns[-1] == bot("Four.")
    assert len(d.turns) == 10 and d.messages() == [SYS, *d.turns]  # without a request: the whole history
    assert d.messages("what is two plus two") == [SYS, user("what is two plus two")]


def test_all_memory_carries_every_exchange_and_none_carries_none() -> None:
    everything = conversation("all")
    assert everything.messages("what is two plus two") == [SYS, *everything.turns, user("what is two plus two")]
    nothing = conversation("none")
    assert nothing.messages("and is it old") == [SYS, user("and is it old")]
    assert len(nothing.turns) == 8  # the history is still kept (and shown)


def test_a_bad_memory_mode_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="must be one of follow-ups, all, none, not 'recent'"):
        DialogueOptions(memory="recent")


def test_a_joined_request_is_judged_whole() -> None:
    """The person went on after a pause: the request the prompt ends with is the joined one, and that is the
    one judged ("and what about" + "italy" -> a follow-up)."""
    d = Dialogue(DialogueOptions(system_prompt="sys"))
    d.add_exchange("what is the capital of france", "Paris.")
    d.continue_request("And what about")
    assert d.messages("Italy?") == [
        SYS,
        user("what is the capital of france"),
        bot("Paris."),
        user("And what about italy?"),
    ]
    d.add_exchange("Italy?", "Rome.")
    assert d.follow_ups == [False, True]


def test_reset_and_trim_keep_the_follow_up_marks_with_their_exchanges() -> None:
    """Trimming drops an exchange's mark with it: a chain whose first question was dropped reaches back only
    as far as the history kept."""
    d = Dialogue(
        DialogueOptions(system_prompt="sys", max_history_tokens=13),
        count_tokens=lambda m: sum(len(x["content"].split()) for x in m),  # a word for a token
    )
    d.add_exchange("what is the capital of france", "Paris.")  # 8 words with the system prompt
    d.add_exchange("and what about italy", "Rome.")  # 13: all kept
    assert d.follow_ups == [False, True] and len(d.turns) == 4
    d.add_exchange("and spain", "Madrid.")  # 16 > 13: the first exchange goes
    assert d.turns == [user("and what about italy"), bot("Rome."), user("and spain"), bot("Madrid.")]
    assert d.follow_ups == [True, True]
    assert d.messages("and portugal") == [SYS, *d.turns, user("and portugal")]
    d.add_exchange("tell me a joke", "No.")  # 14 > 13: italy goes
    assert d.turns == [user("and spain"), bot("Madrid."), user("tell me a joke"), bot("No.")]
    assert d.follow_ups == [True, False]
    assert d.messages("why is that") == [SYS, user("tell me a joke"), bot("No."), user("why is that")]
    d.reset()
    assert d.turns == [] and d.follow_ups == [] and d.messages("and then") == [SYS, user("and then")]
    d.add_exchange("and then", "Nothing.")
    assert d.follow_ups == [False]  # nothing before it to follow


def test_a_dialogue_built_with_turns_marks_them() -> None:
    d = Dialogue(
        DialogueOptions(system_prompt="sys"),
        turns=[user("what is the capital of france"), bot("Paris."), user("and italy"), bot("Rome.")],
    )
    assert d.follow_ups == [False, True]
    assert d.messages("and spain") == [SYS, *d.turns, user("and spain")]


def test_the_voice_flag_sets_the_memory() -> None:
    import argparse

    from edge_client.options_cli import add_generation_options
    from edge_client.voice.options_cli import add_voice_options, voice_options_from_args

    p = argparse.ArgumentParser()
    add_generation_options(p)
    add_voice_options(p)
    assert voice_options_from_args(p.parse_args([])).dialogue.memory == "follow-ups"
    assert voice_options_from_args(p.parse_args(["--memory", "all"])).dialogue.memory == "all"
    with pytest.raises(SystemExit):
        p.parse_args(["--memory", "recent"])


# --------------------------------------------------------------------------- the device model


def test_the_device_model_does_not_carry_an_unrelated_answer(edge_model) -> None:
    """Issue 45 on the real device model (SmolLM2-135M Q3_K_S, device only, greedy): after "how do i reset my
    wifi router", "set a timer for ten minutes" is answered without the router answer's words, as its prompt no
    longer carries them; under "all" it does (on the 2-core VM the device then answered "To set a timer for ten
    minutes on your wireless router, you'll need to connect it to your modem…"). A follow-up ("and what about
    italy") still carries the exchange it follows. The tests' short prompt (conftest.SYSTEM): under the voice
    prompt this model, alone, says the question back in a few words, too few to carry anything."""
    from models.train.person_check import CARRIED_WORDS, carries_earlier_answer
    from tests.conftest import SYSTEM
    from tests.helpers import make_generator

    assert edge_model.info.name == "smollm2-135m-q3_k_s"
    system = {"role": "system", "content": SYSTEM}
    gen = make_generator(edge_model, None, mode="edge", seed=0, temperature=0.0)
    default = Dialogue(DialogueOptions(system_prompt=SYSTEM), gen.count_tokens)  # memory="follow-ups"
    everything = Dialogue(DialogueOptions(system_prompt=SYSTEM, memory="all"), gen.count_tokens)

    def ask(question: str) -> str:
        """One turn through the default dialogue; "all" records the same exchange."""
        answer = gen.generate(default.messages(question), max_tokens=48).text
        default.add_exchange(question, answer)
        everything.add_exchange(question, answer)
        return answer

    try:
        router_q, timer_q = "how do i reset my wifi router", "set a timer for ten minutes"
        router = ask(router_q)
        assert len(router.split()) > CARRIED_WORDS, router  # an answer long enough to be carried
        assert default.messages(timer_q) == [system, user(timer_q)]
        assert everything.messages(timer_q) == [system, user(router_q), bot(router), user(timer_q)]
        timer = ask(timer_q)
        assert timer.strip() and not carries_earlier_answer(timer_q, timer, [router]), (router, timer)

        france_q, italy_q = "what is the capital of france", "and what about italy"
        france = ask(france_q)
        assert default.messages(italy_q) == [system, user(france_q), bot(france), user(italy_q)]
        assert ask(italy_q).strip()
    finally:
        gen.close()
    assert len(default.turns) == 8 and default.follow_ups == [False, False, False, True]
