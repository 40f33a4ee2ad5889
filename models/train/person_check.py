"""What a person notices first in an answer, counted per policy next to the likelihood measure.

The evals' quality measure is the cloud model's likelihood of the answer. With a base model in
the cloud (Gemma-3-270M continues a transcript) that measure rewards text a person would not
want: "how do i reset my wifi router" answered with "I have a question about my router." scores
well, because it is a likely next line of a chat. Two checks a reader makes at a glance:

- **speaks as the user**: the answer opens as the user's own line, not an assistant's: a role
  label ("User:"), a request in the first person ("I have a question...", "Can you..."), the
  speaker introducing themself as someone other than an assistant ("I am a customer of...",
  "I live in..."), a greeting that asks ("Hello, how are you?"), or a first sentence that is a
  question about the speaker's own things ("How do I...?", "What is my...?");
- **says the question back**: the first sentence is the question again (ROUGE-L F1 >= 0.8 of
  their words), rather than its answer;
- **continues the transcript**: a later line opens with a role label ("System: You are...",
  "Voice assistant:"): the model wrote the chat's next turns, not an answer;
- **recites the instructions**: the first sentence is a sentence of the system prompt again ("You are
  a helpful voice assistant."), which the likelihood of a model that reads the prompt rewards: it is
  the likeliest text in the context. Read in the pool's test answers, where it was 10 of 40 at the
  top spend (docs/journal/router.md, 2026-12-07).

- **loops**: the answer says the same run of words over and over ("tofu is a great way tofu, it's a
  great way tofu …"), or a sentence of it again;
- **carries an earlier answer**: in a conversation, the answer repeats a run of words of an earlier
  answer that the question does not ask for ("set a timer for ten minutes" answered with the
  router steps of the turn before).

Rules of thumb, checked against answers read side by side (docs/router.md, "Read side by side"):
a clarifying question without a first-person request ("Which router do you have?") is not
flagged; a yes that restates the question ("you can keep rice in the fridge for 3 days") is
counted as said back, though a reader takes it as an answer.
"""

from __future__ import annotations

import re
from typing import Iterable

from shared.prompting import DEFAULT_SYSTEM_PROMPT
from shared.textmetrics import rouge_l_f1

REPEAT_F1 = 0.8  # a first sentence this close to the question (ROUGE-L F1 of words) says it back

_ROLE_LABEL = re.compile(r"^(user|human|me|question|q|customer|caller)\s*:", re.I)
_FIRST_PERSON_REQUEST = re.compile(
    r"^(i\s+(have|had|want|wanted|need|needed|would like|'d like|am looking|'m looking|was wondering|wonder)\b"
    r"|i\s+live\b|(can|could|would|will)\s+you\b|(please|tell me|help me|show me|give me)\b)",
    re.I,
)
_NOT_AN_ASSISTANT = re.compile(r"^i\s*(am|'m)\s+(a|an)\b(?!.*\b(assistant|ai|help\w*|bot|model)\b)", re.I)
_ROLE_LINE = re.compile(r"\n\s*(system|user|human|assistant|voice assistant|ai|me|customer)\s*:", re.I)
_GREETING = re.compile(r"^(hi|hello|hey|good (morning|afternoon|evening))\b", re.I)
_MY_QUESTION = re.compile(r"^(how|what|where|when|why|who|which|is|are|do|does|should|can)\b.*\b(i|my|me|i'm)\b", re.I)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s|\n")
_PUNCTUATION = re.compile(r"[^\w\s']")


def first_sentence(text: str) -> str:
    """The answer's first sentence (up to its first ., ! or ? followed by a space, or a line end)."""
    text = text.strip()
    return _SENTENCE_END.split(text, maxsplit=1)[0].strip() if text else ""


def speaks_as_user(answer: str) -> bool:
    """The answer opens as the user's line rather than an assistant's (module docstring)."""
    first = first_sentence(answer)
    if not first:
        return False
    if _ROLE_LABEL.match(first) or _FIRST_PERSON_REQUEST.match(first) or _NOT_AN_ASSISTANT.match(first):
        return True
    asks = first.endswith("?")
    return asks and bool(_GREETING.match(first) or _MY_QUESTION.match(first))


def says_question_back(question: str, answer: str) -> bool:
    """The answer's first sentence is the question again (ROUGE-L F1 of words >= REPEAT_F1)."""
    first = first_sentence(answer)
    return bool(first) and rouge_l_f1(_PUNCTUATION.sub(" ", first), _PUNCTUATION.sub(" ", question)) >= REPEAT_F1


def continues_transcript(answer: str) -> bool:
    """A later line of the answer opens with a role label: the chat's next turns, not an answer."""
    return bool(_ROLE_LINE.search(answer))


def recites_instructions(answer: str, instructions: str = DEFAULT_SYSTEM_PROMPT) -> bool:
    """The answer's first sentence is one of the system prompt's sentences again (ROUGE-L F1 of words >=
    REPEAT_F1): "You're a helpful voice assistant." answers nothing."""
    words = lambda t: re.sub(r"[^\w\s]", " ", t)  # noqa: E731  ("you're" is "you re", a word off "you are")
    first = words(first_sentence(answer))
    said = (words(s) for s in _SENTENCE_END.split(instructions.strip()) if s.strip())
    return bool(first.strip()) and any(rouge_l_f1(first, s) >= REPEAT_F1 for s in said)


LOOP_WORDS = 3  # a run of this many words ...
LOOP_TIMES = 3  # ... said this many times is a loop


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def loops(answer: str) -> bool:
    """The answer repeats itself: a run of LOOP_WORDS words LOOP_TIMES times, or a sentence of at least
    LOOP_WORDS words twice. A list's shared openings ("1. Add the flour. 2. Add the eggs.") are two
    words, so they do not count."""
    words = _words(answer)
    runs: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - LOOP_WORDS + 1):
        run = tuple(words[i : i + LOOP_WORDS])
        runs[run] = runs.get(run, 0) + 1
        if runs[run] >= LOOP_TIMES:
            return True
    sentences = [tuple(_words(x)) for x in _SENTENCE_END.split(answer)]
    long = [x for x in sentences if len(x) >= LOOP_WORDS]
    return len(set(long)) < len(long)


CARRIED_WORDS = 5  # a run of this many words of an earlier answer, not in the question, is carried over


def carries_earlier_answer(question: str, answer: str, earlier_answers: Iterable[str]) -> bool:
    """The answer repeats a run of CARRIED_WORDS words of an earlier answer in the conversation, other than
    a run of the question's own words. For an unrelated question (a follow-up may rightly say the earlier
    answer's words again: the conversation set says which questions are unrelated)."""
    asked = set(_words(question))
    words = _words(answer)
    mine = {tuple(words[i : i + CARRIED_WORDS]) for i in range(len(words) - CARRIED_WORDS + 1)}
    for earlier in earlier_answers:
        said = _words(earlier)
        for i in range(len(said) - CARRIED_WORDS + 1):
            run = tuple(said[i : i + CARRIED_WORDS])
            if run in mine and not set(run) <= asked:
                return True
    return False


def person_counts(pairs: Iterable[tuple[str, str]], instructions: str = DEFAULT_SYSTEM_PROMPT) -> dict[str, int]:
    """Over (question, answer) pairs: how many answers speak as the user, say the question back,
    continue the transcript, recite the system prompt (`instructions`) or loop, and how many were read;
    the evals add these to each point."""
    n = user = back = more = recited = looped = 0
    for question, answer in pairs:
        n += 1
        user += speaks_as_user(answer)
        back += says_question_back(question, answer)
        more += continues_transcript(answer)
        recited += recites_instructions(answer, instructions)
        looped += loops(answer)
    return {
        "speaks_as_user": user,
        "says_question_back": back,
        "continues_transcript": more,
        "recites_instructions": recited,
        "loops": looped,
        "answers_read": n,
    }
