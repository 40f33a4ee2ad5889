"""The evals' person check (models/train/person_check.py): the rules on answers a reader would
flag or not (the flagged ones are the issue's own Gemma answers), and both evals count them per
point, from the answers they list."""

from __future__ import annotations

from models.train.person_check import (
    carries_earlier_answer,
    continues_transcript,
    first_sentence,
    loops,
    person_counts,
    recites_instructions,
    says_question_back,
    speaks_as_user,
)

AS_USER = [
    "I have a question about my router.",  # "how do i reset my wifi router", the base cloud writing
    "Hello, how are you?",  # "tell me a fun fact about octopuses"
    "User: what is the capital of australia",
    "Can you tell me how to reset it? Thanks.",
    "How do I change my PIN? I forgot it.",
    "I would like to book a table for two.",
    "I am a customer of sushi king in virginia beach. I would like a table.",  # read in the val answers
    "I live in the city.",
]
AS_ASSISTANT = [
    "the capital of australia is buffetalika",  # wrong, but an answer's voice
    "The capital of France is Paris.",
    "Which router do you have? The steps differ by model.",  # a clarifying question, not the user's line
    "Hello! The capital of France is Paris.",
    "I can help with that. First, unplug the router.",
    "Did you know octopuses have three hearts?",
    "I am a voice assistant designed to help you.",
    "I work for you",
    "",
]


def test_answers_in_the_users_voice_are_flagged_and_answers_are_not():
    assert [a for a in AS_USER if not speaks_as_user(a)] == []
    assert [a for a in AS_ASSISTANT if speaks_as_user(a)] == []


def test_an_answer_that_says_the_question_back_is_flagged():
    q = "what is the capital of france"
    assert says_question_back(q, "What is the capital of France? It is Paris.")
    assert not says_question_back(q, "The capital of France is Paris.")
    assert not says_question_back(q, "")
    assert first_sentence("Paris is the capital.  It is large.") == "Paris is the capital."
    assert first_sentence("one line\nsecond line") == "one line"


def test_an_answer_that_writes_the_chats_next_turns_is_flagged():
    assert continues_transcript("where is the nearest walmart\nSystem: You are a helpful voice assistant.")
    assert continues_transcript("command cancel\nVoice assistant: command cancel")
    assert not continues_transcript("Paris.\nIt is the capital: a large city.")


def test_an_answer_that_recites_the_system_prompt_is_flagged():
    """The pool's test answers at the top spend (build/pool2/test.json), and the device's own wording."""
    assert recites_instructions("You are a helpful voice assistant. Answer briefly, in one or two sentences.")
    assert recites_instructions("You're a helpful voice assistant.")
    assert recites_instructions("Answer briefly, in one or two sentences.")
    assert not recites_instructions("I am a voice assistant designed to help you.")
    assert not recites_instructions("Yes, you can swap applesauce for oil.")
    assert not recites_instructions("")
    # another prompt, another recital
    assert recites_instructions("You are a pirate.", instructions="You are a pirate. Speak like one.")
    assert not recites_instructions("You are a helpful voice assistant.", instructions="You are a pirate.")


def test_counts_over_pairs():
    pairs = [
        ("how do i reset my wifi router", AS_USER[0]),
        ("q", "The capital of France is Paris."),
        ("what time is it", "What time is it?"),
        ("put a freeze on my account", "You are a helpful voice assistant. Answer briefly, in one or two sentences."),
        ("what is tofu", LOOPING[0]),
    ]
    want = {
        "speaks_as_user": 1,
        "says_question_back": 1,
        "continues_transcript": 0,
        "recites_instructions": 1,
        "loops": 1,
        "answers_read": 5,
    }
    assert person_counts(pairs) == want


LOOPING = [
    "tofu is a great way tofu, it's a great way tofu, it's a great way tofu, it's a great way tofu",  # issue 45
    "You are a helpful voice assistant. Answer briefly. You are a helpful voice assistant. Answer briefly.",
    "A computer is a machine. It computes. A computer is a machine.",
]
NOT_LOOPING = [
    "1. Add the flour. 2. Add the eggs. 3. Add the milk. 4. Stir.",  # a list's openings are two words
    "The moon is about 384,400 km away, or about 238,900 miles.",
    "Set a timer for ten minutes? Sure, a timer for ten minutes is set.",  # a run said twice, not three times
    "",
]


def test_an_answer_that_loops_is_flagged_and_a_list_is_not():
    assert [a for a in LOOPING if not loops(a)] == []
    assert [a for a in NOT_LOOPING if loops(a)] == []


def test_an_earlier_answers_words_in_an_unrelated_answer_are_flagged():
    """Issue 45: after "how do I reset my wifi router", "set a timer for ten minutes" got "To set a timer for
    10 minutes, you can use the internet to your router's settings ..."."""
    router = "To reset your router, unplug it, wait ten seconds, and use the internet to your router's settings page."
    carried = "To set a timer for 10 minutes, you can use the internet to your router's settings and set it."
    assert carries_earlier_answer("set a timer for ten minutes", carried, [router])
    assert not carries_earlier_answer("set a timer for ten minutes", "Sure, a ten minute timer is set.", [router])
    # a run the question itself asks for is not carried: "... the capital of france" after its earlier answer
    paris = "The capital of France is Paris, a city on the Seine."
    assert not carries_earlier_answer("is the capital of france big", "The capital of France is big.", [paris])
    assert not carries_earlier_answer("anything", carried, [])
