"""The shared answer as text: the one rule for token routing across vocabularies (protocol v3, text mode).

When the device's and the cloud's models do not share a tokenizer (or the device asks for text
mode with `--text-mode always`), the two sides agree on the BYTES of the answer, not on token
ids. Each side renders the chat (`hello.messages`) with its own template and holds its own token
history: its prompt, then its own tokenization of the answer text. Both the device
(edge_client/shared_history.py, `TextHistory`) and the cloud (cloud_server/text_session.py) call
this module; no second copy of the rule exists.

**Histories are the truth, KV caches follow.** After any change of the answer text, a side
re-tokenizes the whole answer text with its own tokenizer (`AnswerText.tokens`, canonical: the
same text always gives the same tokens), keeps the longest common token prefix with what its
KV cache holds (`AnswerText.reconcile`) and decodes the rest. A token that the new text extends
or splits (the device wrote " Par", the cloud's text is "is") is thereby rolled back and
replaced by the canonical tokenization (" Paris"): no side ever continues from a partial token
that its own tokenizer would not have produced. Between changes a side appends its own tokens
as it writes them (greedy output of these models is canonical: measured on the test questions,
re-tokenizing SmolLM2's answers gives back the very tokens it wrote).

**The cloud's span** (`span_done`): at a hard position the cloud writes at least one of its own
tokens and goes on until the text it wrote is whole UTF-8 characters and either the token it
would write next starts a new word (begins with whitespace or ASCII punctuation, or ends the
answer), or it has written `max_tokens` (default `SPAN_TOKENS`, 4) tokens. Why: both
tokenizers split words at whitespace and punctuation (SmolLM2's GPT-2-style pre-tokenizer never
merges a letter with a following " word"; Gemma's SentencePiece starts words with "▁"), so text
that ends just before a new word ends on a token boundary of *any* such tokenizer: the device's
re-tokenization keeps every token of the cloud's text whole and the device model continues from
a clean word boundary, never from a piece it would have merged. Knowing the next token is free:
the cloud decodes its last token anyway (the next sync's prefill would), and the token it peeks
at is the one it writes next if it goes on. The cap keeps a span short where words are long or
text has no spaces (CJK); there the device re-tokenizes a word cut in the middle, which is
correct, just less natural. Text not yet whole UTF-8 after the cap gets up to `UTF8_EXTRA` more
tokens (byte-fallback tokens: a character may take up to four), and trailing partial bytes
after that are dropped (`complete_utf8`), so text on the wire is always whole characters.

**The cloud's check in text mode** (`text_verify`, `plan_check`): the device drafts a clause
and sends its text with the byte ranges its router flagged. The cloud tokenizes the shared text
plus the drafted text with its own tokenizer and judges, in one batched pass, each of its tokens
that holds drafted bytes, with shared/decision.py's `judge_draft` (exact string-level
verification, Timor et al., ICML 2025): a token that overlaps a flagged range stands only as the
cloud's own greedy choice (within `TIE_NATS`), the others within the tolerance. A token wholly in
the shared text is context, never judged. At the first rejected token the kept drafted bytes end
where that token starts (a token boundary of the cloud's tokenization), cut back to a whole
character and never before the drafted text (a token that began in the shared text keeps none);
the cloud then writes its span from there, as at a hard position. A drafted end of the answer
(`eog`) is judged as the cloud's end-of-generation token after the drafted text.

**The cloud's lookahead guess in text mode** (`TextGuess`): where a span stops before a new
word, the cloud has just looked at the logits of the position after it (the span rule's peek), so
its most likely next tokens come free with the reply (`text_reply.guess_texts`), as their text
("" for the end of the answer). At the device's next position the guess decides, as in token mode
(shared/decision.py, `take_guess`), without asking the router: the device's token stands if the
cloud finds its bytes at most `lookahead_nats` less likely than its best guess, else the device
takes the best guess's text. The device's bytes are judged string-level against the listed
pieces: their probability is at least the summed probability of the listed pieces that begin
with them (the device's " Par" is what the cloud's " Paris" and " Parliament" begin with), and a
device token no listed piece begins with counts as worse than all (as a token outside the top
list does in token mode). Exact in the common case here: the cloud's 262k-token vocabulary holds
whole words where the device's 49k splits them.

**Whole characters.** The device sends text only up to the last whole character and asks the
cloud only where its text ends on one (a hard position inside a multi-byte character, rare, is
written by the device); messages carry text as JSON strings and `byte_position` counts UTF-8
bytes.

**Special tokens.** The answer text is plain text: it is tokenized without parsing special
tokens (an answer that spells "<|im_end|>" is those ten characters, not an end-of-turn), and
control tokens read as nothing (`LlamaModel.token_bytes`). The end of the answer is a flag
(`eog`), never text. Each side's chat template (and its BOS) lives in its prompt tokens only.

**The seam.** A model without a chat template (a base model: its prompt is rendered
"...\\nAssistant:") reads the answer after a space, as its training text had it: its answer
tokens are those of " " + text (`AnswerText.seam`), and a space it writes first is not part of
the shared text (`AnswerText.join`). A chat model's template ends with a newline: no seam.

**The end of a transcript turn** (`AnswerText.stop`, `TRANSCRIPT_STOP`): such a base model has
no end-of-turn token of its own; it ends its line and goes on with the transcript ("\\nUser: …",
then an "Assistant:" line of its own). Gemma-3-270M base did so within 56 tokens on 17 of 20
CLINC150 val queries (the other three repeat a sentence); before this rule its routed answers
were 3x the device's length, and 31% of the hard positions the learned router was trained on
were the transcript's "\\n", "User", ":". So for
such a model the answer ends where its text starts the person's next line: the text is cut
before "\\nUser:" and the answer ends (`stop_cut`). A span does not stop on a word boundary
while its text ends with the start of that marker (`stop_pending`, e.g. "\\n" or "\\nUs"), so a
half-written marker never reaches the device. The labels and the eval apply the same cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

from shared.llama_backend import LlamaModel
from shared.sampling import Guess
from shared.sequences import common_prefix

SPAN_TOKENS = 4  # the most cloud tokens one hard position writes, unless a character is unfinished
UTF8_EXTRA = 4  # more tokens allowed to finish a multi-byte character after the cap
_PUNCT = frozenset(b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_SPACE = frozenset(b" \t\n\r\x0b\x0c")
TRANSCRIPT_STOP = b"\nUser:"  # a base model's answer ends where it starts the person's next line


def complete_utf8(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a multi-byte character.

    Only the last (at most three) bytes are looked at: earlier bytes are taken as they are (the
    text before them was whole characters when it was sent)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:  # ASCII: whole
            return n
        if b >= 0xC0:  # a lead byte: whole if its continuation bytes are all there
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if back >= need else n - back
    return n  # only continuation bytes in reach: leave it to the decoder


def valid_utf8(data: bytes) -> int:
    """Length of the longest prefix of `data` that is valid UTF-8 of whole characters. Unlike
    `complete_utf8` it reads every byte: for text a model wrote itself, whose byte-fallback tokens may
    form no character at all (a lead byte then a letter), which must never become shared text."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return len(data)


def on_char_boundary(text: bytes, position: int) -> bool:
    """`position` (0 … len(text)) falls between two characters of `text` (valid UTF-8), not inside
    one: the only places the shared answer may be cut. Why a rule of its own: a cut inside a
    character leaves bytes no tokenizer can read (a `text_rollback` to byte 1 of "é"), so both
    sides refuse such a position where it enters (the cloud answers `bad_field`)."""
    return position == len(text) or (0 <= position < len(text) and not 0x80 <= text[position] < 0xC0)


def _whole_text(piece: bytes) -> bool:
    """`piece` is non-empty text of whole UTF-8 characters (a byte-fallback token is not)."""
    try:
        return bool(piece.decode("utf-8"))
    except UnicodeDecodeError:
        return False


def starts_word(piece: bytes) -> bool:
    """A token whose text begins with whitespace or ASCII punctuation starts a new word."""
    return bool(piece) and (piece[0] in _SPACE or piece[0] in _PUNCT)


def span_done(
    written: bytes,
    n_tokens: int,
    max_tokens: int,
    next_piece: bytes | None,
    at_word: bool = True,
    pending: bool = False,
) -> bool:
    """The cloud's span rule (module docstring): after writing `n_tokens` tokens whose text is
    `written`, stop here? `next_piece`: the text of the token it would write next (None: the
    answer ends there, or it is not known). `at_word` False (a stream: policy cloud): only the
    cap and whole characters count. `pending`: the answer ends with the start of the model's stop
    text (`AnswerText.stop_pending`): go on, as inside a character, so the next tokens decide."""
    if pending or complete_utf8(written) != len(written):
        return n_tokens >= max_tokens + UTF8_EXTRA
    if n_tokens >= max_tokens:
        return True
    return at_word and (next_piece is None or starts_word(next_piece))


# what a span's loop (`SpanWriter.steps`) asks of the model that writes it
WRITE = "write"  # write the next token and send its id
PEEK = "peek"  # send the most likely next token's id (-1: not known) without writing it
FLUSH = "flush"  # a stream's piece is due: hand out `whole()`, then `flush` (send nothing)
DONE = "done"  # the span ended (`eog`: the answer with it)


class SpanWriter:
    """The cloud's span rule (`span_done`, the stop text, whole characters), token by token, in one
    place: the server's `TextSession.span` (awaiting its engine) and the text eval (calling a model)
    each drive its loop (`steps`), or feed it the tokens their model writes and do what it answers:

        "end"   the answer ended (an end-of-generation token, or the stop text: `written` is cut)
        "stop"  the span ends here
        "more"  write another token
        "peek"  look at the most likely next token first, then ask `after_peek`

    `at_word` False (a stream): only the cap and whole characters count, never a peek."""

    def __init__(self, view: AnswerText, text: bytes, max_tokens: int, at_word: bool = True) -> None:
        self.view, self.text, self.max_tokens, self.at_word = view, text, max_tokens, at_word
        self.written = bytearray()  # the span's bytes since the last `flush` (the seam not yet removed)
        self.n = 0  # tokens written
        self.eog = False
        self.pending = False  # the answer ends with the start of the stop text

    def add(self, token: int, is_eog: bool) -> str:
        """Take the token the model wrote."""
        self.n += 1
        if is_eog:
            self.eog = True
            return "end"
        self.written += self.view.token_bytes(token)
        if valid_utf8(self.written) < complete_utf8(self.written):  # bytes no later token makes a character
            return "stop"  # the span ends at its last whole character (`whole` drops the rest)
        cut = self.view.stop_cut(self.text, bytes(self.written))
        if cut is not None:  # a base model began the person's next line: the answer ends here
            del self.written[cut:]
            self.eog = True
            return "end"
        self.pending = self.view.stop_pending(self.text, bytes(self.written))
        if not self.at_word:
            return "stop" if span_done(bytes(self.written), self.n, self.max_tokens, None, at_word=False) else "more"
        if span_done(bytes(self.written), self.n, self.max_tokens, b"a", pending=self.pending):
            return "stop"  # the cap decides: no peek
        if complete_utf8(self.written) != len(self.written):
            return "more"  # finish the character first
        return "peek"

    def after_peek(self, next_piece: bytes | None, next_is_eog: bool) -> str:
        """The most likely next token's text (None: not known) and whether it ends the answer: "end"
        (it does: write it, then the answer ends), "stop" (it starts a new word) or "more"."""
        if next_is_eog:
            return "end"
        return (
            "stop"
            if span_done(bytes(self.written), self.n, self.max_tokens, next_piece, pending=self.pending)
            else "more"
        )

    def steps(self, is_eog: Callable[[int], bool]) -> Generator[str, int | None, None]:
        """The span's loop apart from how its model is called, so the server and the eval write the
        same span: yields what it needs next (`WRITE`, `PEEK`, `FLUSH`; `DONE` last), and is sent the
        token id a `WRITE` wrote or a `PEEK` saw. The token after a peek that did not stop the span
        is the peeked one (a greedy model writes what it peeked at)."""
        token = yield WRITE
        while True:
            assert token is not None
            step = self.add(token, is_eog(token))
            if step == "more" and not self.at_word and self.n % SPAN_TOKENS == 0 and not self.pending and self.whole():
                yield FLUSH  # a stream hands out its whole characters every SPAN_TOKENS tokens
            elif step == "peek":  # look at the next token: stop before a new word
                nxt = yield PEEK
                assert nxt is not None
                step = self.after_peek(self.view.token_bytes(nxt) if nxt >= 0 else None, nxt >= 0 and is_eog(nxt))
                if step == "end":  # the answer ends with that token: write it
                    end = yield WRITE
                    self.eog = end is not None and is_eog(end)
                    step = "stop"
            if step in ("end", "stop"):
                yield DONE
                return
            token = yield WRITE

    def whole(self) -> bytes:
        """The written bytes up to the last whole character (bytes of no whole character are dropped)."""
        return bytes(self.written[: valid_utf8(self.written)])

    def flush(self, text: bytes) -> bytes:
        """A stream hands out its whole characters so far; `text` is the answer with them joined."""
        out = self.whole()
        del self.written[: len(out)]
        self.text = text
        return out


def device_pieces(model: LlamaModel, text: bytes, eog: bool, room: int) -> tuple[list[int], bytes]:
    """The cloud's text as the device's own tokens (its end of turn after, when `eog`), cut to the
    answer's `room` in device tokens: whole characters only, as the device alone would stop there.
    Returns (the tokens, the text they keep). The device (`TextHistory.take_text`) and the text eval both cut here."""
    # (text on the wire is whole characters; "ignore" only matters for the device's own kept text of a
    # check, which may start inside a character its previous token left unfinished)
    pieces = model.tokenize(text.decode("utf-8", "ignore"), parse_special=False) if text else []
    if eog:
        pieces.append(model.eog_token)
    if len(pieces) > room:
        pieces = pieces[:room]
        text = b"".join(model.token_bytes(t) for t in pieces)
        text = text[: complete_utf8(text)]  # the answer ends here: its history only needs whole characters
    return pieces, text


class AnswerText:
    """One side's view of the shared answer: text -> its own tokens, and back."""

    def __init__(
        self,
        tokenize: Callable[[str], list[int]],
        token_bytes: Callable[[int], bytes],
        seam: bytes = b"",
        stop: bytes = b"",
        max_token_bytes: int = 0,
    ):
        self._tokenize = tokenize
        self.token_bytes = token_bytes
        self.seam = seam
        self.stop = stop  # text that ends this model's answer (module docstring); b"": none
        self.max_token_bytes = max_token_bytes  # the longest token's bytes (0: not known)

    @classmethod
    def for_model(cls, model: LlamaModel, bounded: bool = False) -> AnswerText:
        """The view of `model`: plain-text tokenization (no special tokens parsed, no BOS), and the
        seam and the transcript's stop text of a model without a chat template. `bounded`: also
        measure the longest token (reads the whole vocabulary once), for `fewest_tokens`."""
        chat = model.has_chat_template
        return cls(
            lambda s: model.tokenize(s, add_special=False, parse_special=False),
            model.token_bytes,
            b"" if chat else b" ",
            b"" if chat else TRANSCRIPT_STOP,
            max(len(model.token_bytes(t)) for t in range(model.n_vocab)) if bounded else 0,
        )

    def fewest_tokens(self, text: bytes) -> int:
        """A lower bound on the tokens of answer `text`, from its length alone (no token spells more
        than `max_token_bytes`): what a side can refuse without tokenizing (0 when not known)."""
        if not text or self.max_token_bytes <= 0:
            return 0
        return -(-(len(self.seam) + len(text)) // self.max_token_bytes)

    def tokens(self, text: bytes) -> list[int]:
        """The canonical tokens of answer `text` (whole UTF-8 characters), after the prompt."""
        if not text:
            return []
        return self._tokenize((self.seam + text).decode("utf-8"))

    def text_of(self, tokens: Sequence[int]) -> bytes:
        """The answer text that answer `tokens` spell (the seam left out)."""
        data = b"".join(self.token_bytes(t) for t in tokens)
        return data[len(self.seam) :] if self.seam and data.startswith(self.seam) else data

    def join(self, text: bytes, written: bytes) -> bytes:
        """The answer after this side wrote `written` (its tokens' bytes) at the end of `text`."""
        if not text and self.seam and written.startswith(self.seam):
            written = written[len(self.seam) :]
        return text + written

    def stop_cut(self, text: bytes, written: bytes) -> int | None:
        """This side wrote `written` after answer `text`: if the answer now holds its stop text,
        how many bytes of `written` stand (the text before the stop; 0 when the stop began in
        `text`); None if it does not (module docstring, "The end of a transcript turn")."""
        if not self.stop:
            return None
        head, answer = self._tail(text, written)
        at = answer.find(self.stop)
        if at < 0:
            return None
        return max(0, len(written) - (len(answer) - max(at, len(head))))

    def stop_pending(self, text: bytes, written: bytes) -> bool:
        """The answer (`written` after `text`) ends with the start of this side's stop text: the
        next tokens decide whether the answer ends there, so a span goes on."""
        if not self.stop:
            return False
        _, answer = self._tail(text, written)
        return any(answer.endswith(self.stop[:k]) for k in range(1, len(self.stop)))

    def _tail(self, text: bytes, written: bytes) -> tuple[bytes, bytes]:
        """(the end of `text` a stop text begun there could still reach, that end joined with
        `written`): the stop rule's window, not a copy of the whole answer per token. (`join` only
        asks whether `text` is empty, so its last bytes stand in for it.)"""
        head = text[len(text) - len(self.stop) + 1 :] if len(text) >= len(self.stop) else text
        return head, self.join(head, written)

    def proposal(self, text: bytes, proposed: bytes) -> int:
        """The other side's next token (its text `proposed`, after answer `text`) as one token of
        this side, or -1 when it is none or several (then there is nothing to tie with)."""
        if not proposed or complete_utf8(proposed) != len(proposed):
            return -1
        if self.max_token_bytes and len(proposed) > self.max_token_bytes:
            return -1  # longer than any token of this side: not one token, whatever it says (nothing read)
        ids = self._tokenize(((b"" if text else self.seam) + proposed).decode("utf-8"))
        return ids[0] if len(ids) == 1 else -1

    def reconcile(self, held: Sequence[int], text: bytes) -> tuple[int, list[int]]:
        """Bring answer tokens `held` (what a KV cache holds) to `text`: (how many of them to keep,
        the tokens to append after those). The rollback of a partial last token is the keep."""
        target = self.tokens(text)
        keep = common_prefix(held, target)
        return keep, target[keep:]


@dataclass(slots=True)
class TextCheck:
    """The cloud's tokens over a drafted text (`plan_check`): what its check judges, and how a
    verdict on those tokens maps back to drafted bytes."""

    keep: int  # answer tokens of the cloud's history that stand (the common prefix with the new tokens)
    context: list[int]  # tokens after those lying wholly in the shared text: history, not judged
    drafts: list[int]  # the tokens that hold drafted bytes (then the end-of-generation token, if drafted)
    exact: list[int]  # offsets in `drafts` judged exactly: they overlap a flagged byte range
    starts: list[int]  # where each draft begins, in bytes from the drafted text's start (< 0: in the shared text)
    drafted: bytes

    def accepted_bytes(self, accepted: int) -> int:
        """Drafted bytes kept when the first `accepted` drafts stand: all of them if none was
        rejected, else up to where the rejected one starts, never before the drafted text, cut
        back to a whole character."""
        if accepted >= len(self.drafts):
            return len(self.drafted)
        cut = max(0, self.starts[accepted])
        return complete_utf8(self.drafted[:cut])

    def continues(self, accepted: int) -> bool:
        """The cloud's token at the rejected draft may open its span: the kept bytes end exactly
        where that token starts (else the cloud writes again from the cut)."""
        start = self.starts[accepted]
        return start >= 0 and self.accepted_bytes(accepted) == start


class TooManyDrafts(ValueError):
    """A check would judge more of the cloud's tokens than one check may carry (`plan_check`'s `max_drafts`)."""


def plan_check(
    view: AnswerText,
    held: Sequence[int],
    shared: bytes,
    drafted: bytes,
    flagged: Sequence[tuple[int, int]],
    eog_token: int = -1,
    eog_exact: bool = False,
    max_drafts: int = 0,
) -> TextCheck:
    """The cloud's tokens of `shared` + `drafted` (module docstring, "The cloud's check"). `held`:
    the answer tokens the cloud's history holds (they spell `shared`); `flagged`: [start, end)
    byte ranges of `drafted` the device's router flagged, ascending and not overlapping;
    `eog_token` >= 0: the device drafted the answer's end after the text (judged as that token,
    exactly with `eog_exact`). ValueError if the tokens do not spell the text back (then no byte
    of it can be placed); TooManyDrafts as soon as more than `max_drafts` (> 0) would be judged.

    One pass over the tokens and the ranges together (both ascending), so a check costs the
    length of its text plus its ranges, never their product."""
    target = view.tokens(shared + drafted)
    keep = common_prefix(held, target)
    pieces = [view.token_bytes(t) for t in target]
    if b"".join(pieces) != (view.seam + shared + drafted if target else b""):
        raise ValueError("the model's tokens do not spell the answer text back")
    boundary = len(view.seam) + len(shared)  # where the drafted text starts in the tokens' bytes
    end = sum(len(p) for p in pieces[:keep])
    context: list[int] = []
    drafts: list[int] = []
    exact: list[int] = []
    starts: list[int] = []
    r = 0  # the first flagged range that may still overlap a token from here on
    for token, piece in zip(target[keep:], pieces[keep:]):
        begin, end = end, end + len(piece)
        if end <= boundary and not drafts:
            context.append(token)
            continue
        lo, hi = begin - boundary, end - boundary
        while r < len(flagged) and flagged[r][1] <= lo:
            r += 1
        if r < len(flagged) and flagged[r][0] < hi:
            exact.append(len(drafts))
        starts.append(lo)
        drafts.append(token)
        if max_drafts and len(drafts) + (eog_token >= 0) > max_drafts:
            raise TooManyDrafts(f"at most {max_drafts} of the cloud's tokens per check")
    if eog_token >= 0:
        if eog_exact:
            exact.append(len(drafts))
        starts.append(len(drafted))
        drafts.append(eog_token)
    return TextCheck(keep, context, drafts, exact, starts, drafted)


@dataclass(frozen=True, slots=True)
class TextGuess:
    """The cloud's most likely next pieces after its span, as text (module docstring, "The cloud's
    lookahead guess in text mode"): most likely first; b"" is the end of the answer."""

    pieces: list[bytes]
    logprobs: list[float]

    @classmethod
    def of(cls, guess: Guess, view: AnswerText, is_eog: Callable[[int], bool]) -> TextGuess:
        """The cloud's token guess as text: pieces that are not whole characters (byte-fallback
        tokens) and control tokens that read as nothing are left out."""
        pieces: list[bytes] = []
        logprobs: list[float] = []
        for token, logprob in zip(guess.top_ids, guess.top_logprobs):
            ends = is_eog(token)
            piece = b"" if ends else view.token_bytes(token)
            if not ends and not _whole_text(piece):
                continue
            pieces.append(piece)
            logprobs.append(logprob)
        return cls(pieces, logprobs)

    @property
    def best(self) -> bytes:
        return self.pieces[0]

    def regret(self, piece: bytes, ends: bool = False) -> float:
        """How much less likely the device's next `piece` (or its end of the answer, `ends`) is than
        the best guess, in nats: infinite when no listed piece begins with it."""
        if not self.pieces:
            return math.inf
        if ends:
            mass = [lp for p, lp in zip(self.pieces, self.logprobs) if not p]
        else:
            mass = [lp for p, lp in zip(self.pieces, self.logprobs) if p and p.startswith(piece)] if piece else []
        if not mass:
            return math.inf
        top = max(mass)
        return self.logprobs[0] - (top + math.log(sum(math.exp(lp - top) for lp in mass)))

    def for_tokens(self, token_bytes: Callable[[int], bytes], is_eog: Callable[[int], bool]) -> TokenView:
        """This guess judged per device token (what shared/decision.py's `take_guess` asks)."""
        return TokenView(self, token_bytes, is_eog)


@dataclass(frozen=True, slots=True)
class TokenView:
    """A text guess seen from the device's vocabulary: `regret(token)` as `Guess.regret`."""

    guess: TextGuess
    token_bytes: Callable[[int], bytes]
    is_eog: Callable[[int], bool]

    def regret(self, token: int) -> float:
        ends = self.is_eog(token)
        return self.guess.regret(b"" if ends else self.token_bytes(token), ends)
