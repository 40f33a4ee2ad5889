"""Work ahead from partial transcripts while the person speaks: the prompt's prefill, or a drafted reply.

Prefill (`prefill_partials`, on): each partial's prompt is decoded in the background, so the turn
decodes only what the final transcript changed. Drafts (`draft`, off by default: measured not to pay
on two cores): each partial whose words changed starts a held draft of the answer (its first clause
generated and synthesised, then generation parks). If the speculative final transcript has the same
words, the draft becomes the turn; otherwise it is cancelled (the generator keeps the shared prefix).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Callable

from ..answer import Answer
from .dialogue import Dialogue
from .endofturn import unfinished_text
from .engines import VoiceGenerator
from .options import VoiceOptions
from .reply import ReplyContext, Turn
from .state import PipelineState, Utterance
from .timings import TurnTimings
from .worker import LatestJobWorker

log = logging.getLogger(__name__)


def same_words(a: str, b: str) -> bool:
    """Two transcripts say the same words (case and punctuation aside): a draft made from one answers the other."""
    return _words(a) == _words(b)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


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


class Drafts:
    """Partial transcripts -> prefill or a held draft; the speculative final transcript adopts a draft or not.

    `on_partial` and `take_draft` run on the ASR thread under `state.lock`; `count_wasted_draft` on a
    draft's generation thread, under its own lock."""

    def __init__(self, state: PipelineState, opts: VoiceOptions, reply: ReplyContext) -> None:
        self.state = state
        self.opts = opts
        self.reply = reply
        self.n_drafts = 0  # drafts started from partial transcripts (each a held first clause)
        # what the drafts that were not used cost: tokens generated for nothing, and those of them the cloud wrote
        self.wasted_draft_tokens = 0
        self.wasted_draft_cloud_tokens = 0
        self._count_lock = threading.Lock()
        self._prefiller = Prefiller(reply.gen, self.prefill_wanted) if opts.prefill_partials else None

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens decoded from partial transcripts while the person spoke (0 when off)."""
        return self._prefiller.n_prefilled if self._prefiller is not None else 0

    def on_partial(self, u: Utterance, text: str) -> None:
        """A partial transcript of two words or more, nothing playing: draft the reply from it, or prefill."""
        if self.opts.draft:
            self._draft(u, text)
        elif self._prefiller is not None:
            # The whole hypothesis, not just the stable words: a wrong guess costs only
            # the tokens after the first difference (generate keeps the common prefix).
            self._prefiller.submit(self.state.utt_id, self.reply.messages(text), complete=self.opts.prefill_complete)

    def _draft(self, u: Utterance, text: str) -> None:
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
        u.draft = Turn(self.reply, text, TurnTimings(), held=True, draft=True)
        self.n_drafts += 1

    def take_draft(self, u: Utterance, text: str) -> Turn | None:
        """The speculative final transcript is in: the draft becomes the turn if it has the same words."""
        d = u.draft
        if d is None:
            return None
        if same_words(d.user_text, text) and not d.stop.is_set():
            d.adopt(text, u.timings)  # before it stops being u.draft: a parked draft that is not live stops itself
            u.draft, u.draft_outcome = None, "hit"
            return d
        self.give_up(u)
        return None

    def give_up(self, u: Utterance) -> None:
        """The final transcript will not be answered by the utterance's draft: cancel it, a miss."""
        if u.draft is not None:
            u.draft.cancel()
            u.draft, u.draft_outcome = None, "miss"

    def count_wasted_draft(self, answer: Answer) -> None:
        """Generation thread: a draft ended without becoming the turn; its tokens were computed for nothing."""
        with self._count_lock:
            self.wasted_draft_tokens += answer.n_tokens
            self.wasted_draft_cloud_tokens += answer.n_cloud_tokens

    def prefill_wanted(self, utt_id: int) -> bool:
        """A prefill request is still useful: same utterance, still speaking, nothing generating."""
        with self.state.lock:
            u = self.state.utt
            return (
                u is not None
                and utt_id == self.state.utt_id
                and u.spec_voiced_t is None
                and not u.endpointed
                and self.state.playing is None
            )

    def close(self) -> None:
        if self._prefiller is not None:
            self._prefiller.close()
