"""Has the person finished their request? The device model's own answer, read from the prompt it prefills.

In the chat template the user's words are followed by the end of their message. After the last
word the device model predicts the next token: another word ("set a timer for" -> "ten"), or ".",
"?", "!" or the end-of-message token ("set a timer for ten minutes" -> "."). Their summed
probability is a text end-of-turn signal that knows phrasing, not a word list: ~0 after any
fragment, 0.1-0.7 after a whole request (SmolLM2-135M-Instruct zero-shot, docs/voice.md).

It costs no second model and no extra pass: the voice pipeline prefills the prompt of every
transcript anyway, and the logits at the last word's position are one more output of that same
batch (`EdgeDecoder.decode_reading`). This module only says where that position is and turns
its logits into the probability; `RoutedGenerator.end_of_message` runs it.
"""

from __future__ import annotations

import numpy as np

from shared.llama_backend import LlamaModel

END_TEXTS = (".", "?", "!")  # a request that ends here gets one of these, or the end of the message, next
# Left off the user's text before looking for its last word: Whisper's own punctuation at the end
# ("Set a timer for...", "Who wrote Hamlet?") is what the model is asked to predict, not evidence.
TRAILING = " \t\n.?!,;:…-—\"'"


class MessageEnd:
    """Where a chat prompt's last user message has its last word, and P(the message ends there)."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        ids = {model.eog_token}
        for text in END_TEXTS:
            toks = model.tokenize(text, add_special=False, parse_special=False)
            if len(toks) == 1:
                ids.add(toks[0])
        self.end_ids = np.array(sorted(ids), dtype=np.int64)

    def locate(self, messages: list[dict]) -> tuple[list[int], int | None]:
        """The whole prompt's tokens (generation prompt included, as an answer starts from it) and the
        index of the user's last word token in them; None when the message has no words or its words
        tokenize differently inside the prompt (then there is no position to read)."""
        text, start = user_message_start(self.model, messages)
        tokens = self.model.prompt_tokens(text)
        words = messages[-1]["content"].rstrip(TRAILING) if start is not None else ""
        if start is None or not words.strip():
            return tokens, None
        head = self.model.prompt_tokens(text[: start + len(words)])
        if len(head) > len(tokens) or tokens[: len(head)] != head:
            return tokens, None
        return tokens, len(head) - 1

    def probability(self, logits: np.ndarray) -> float:
        """P(next token is ".", "?", "!" or the end of the message) under the softmax of `logits`."""
        x = np.asarray(logits, np.float64)
        e = np.exp(x - x.max())
        return float(e[self.end_ids].sum() / e.sum())


def user_message_start(
    model: LlamaModel, messages: list[dict], add_generation_prompt: bool = True
) -> tuple[str, int | None]:
    """The rendered prompt and where the last (user) message's text starts in it, or None when it is
    not a user message or the template does not write it verbatim. Found by rendering a marker in its
    place: searching for the text itself finds "i" inside "assistant"."""
    text = model.render_chat(messages, add_generation_prompt)
    if not messages or messages[-1].get("role") != "user":
        return text, None
    marker = "\u2063TOKENROUTER-USER-TEXT\u2063"
    start = model.render_chat([*messages[:-1], {"role": "user", "content": marker}], add_generation_prompt).find(marker)
    user = messages[-1]["content"]
    return text, (start if start >= 0 and text[start : start + len(user)] == user else None)
