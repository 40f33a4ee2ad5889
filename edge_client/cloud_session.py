"""The device's keeper of its cloud session: connect, resync, reconnect, lose, timeouts, traffic.

The token path (edge_client/strategies.py) asks the cloud through this one
object and never handles a network error itself: every call here returns
None (or False) when the cloud could not answer. A lost link first fails
over (`lose`): a new session through the same URL, rebuilt from the device's
history, and the request in flight asked again (`_request`); where that fails
the answer continues on the device and is marked degraded, and the next
answer reconnects and rebuilds the session from the device's history. A slow cloud is not a lost cloud: a hard token that misses
its deadline is written by the device, a clause whose check misses it stands
as drafted, and the link rolls the abandoned request back and stays
(docs/architecture.md, "Failure and fallback").

In text mode (protocol v3: the cloud's model tokenizes differently, or the
options ask for it) the session turns the device's token history into the
answer's text (shared/text_history.py) and asks with the `text_*` messages
(`ask_text`, `stream_text`); the token calls still work where they make sense
(`sync`), and `resync` (a prefill ahead of time) does nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import numpy as np

from edge_client.answer import Traffic
from edge_client.cloud_link import (
    CloudDeclined,
    CloudError,
    CloudLink,
    CloudRejected,
    CloudText,
    CloudTimeout,
    CloudToken,
    CloudUnavailable,
)
from edge_client.reconnect import Backoff
from shared.model_info import ModelInfo
from shared.protocol import SamplingParams, TextVerdict, Verdict
from shared.sampling import Guess
from shared.sequences import common_prefix
from shared.text_history import SPAN_TOKENS, AnswerText, complete_utf8

log = logging.getLogger(__name__)

LinkErrors = (CloudUnavailable, CloudError)
T = TypeVar("T")


class CloudSession:
    """One device's cloud session across answers (at most one link at a time)."""

    def __init__(
        self,
        connect: Callable[[], CloudLink] | None,
        edge: ModelInfo,
        sampling: SamplingParams,
        *,
        text_mode: str,
        reconnects: int,
        reconnect_wait_s: float,
        max_consecutive_timeouts: int = 3,
        answer_text: AnswerText | None = None,
        allow_base_model: bool = False,
    ) -> None:
        """`text_mode` (protocol v3): "never", "auto" (text where the tokenizers differ) or
        "always", as the options say (GeneratorOptions.text_mode: the one default); `answer_text`:
        the device model's view of the answer text (needed unless never). `reconnects` and
        `reconnect_wait_s`: the failover (GeneratorOptions, the one default)."""
        self._connect = connect
        self.text_mode = text_mode
        self.allow_base_model = allow_base_model  # else a cloud whose accept says base_model is refused
        self.answer_text = answer_text
        self._prompt_len = 0  # text mode: where the answer starts in the device's history
        self._covered = 0  # text mode: how much of the device's history the cloud's text covers
        self.edge = edge
        self.sampling = sampling
        self.max_consecutive_timeouts = max_consecutive_timeouts  # then the cloud is lost for this answer
        self.link: CloudLink | None = None
        self.last_error = ""
        self.timeouts = 0  # hard tokens the device wrote because the cloud was slow
        self.explore_declined = 0  # exploration requests the cloud declined (its key's budget was spent)
        # Failovers per answer when the cloud is lost mid-answer (0: finish on the device): a new session,
        # on whichever replica the URL reaches, is rebuilt from the device's history, and the request that
        # was in flight is asked again. Each failover tries for at most reconnect_wait_s, backing off.
        self.reconnects = reconnects
        self.reconnect_wait_s = reconnect_wait_s
        self.backoff = Backoff()
        self._reconnects_left = 0
        self._retired = Traffic()  # totals of links already dropped
        self._messages: list[dict] | None = None
        self._history: Callable[[], list[int]] = list

    @property
    def configured(self) -> bool:
        """A cloud exists for this device at all (not `--cloud none`)."""
        return self._connect is not None

    @property
    def up(self) -> bool:
        return self.link is not None

    @property
    def cloud_model(self) -> str:
        return self.link.accept.cloud_model if self.link is not None and self.link.accept else ""

    @property
    def cloud_base_model(self) -> bool:
        """The connected cloud's model is a base model (its accept says so; protocol v3)."""
        return self.link is not None and self.link.accept is not None and self.link.accept.base_model

    @property
    def cloud_len(self) -> int:
        """How much of the device's history the cloud holds (text mode: covers with its text)."""
        if self.link is not None and self.link.mode == "text":
            return self._covered
        return self.link.cloud_len if self.link is not None else 0

    @property
    def shared_history(self) -> str:
        """What the connected session shares: "tokens", "text", or "" (no cloud connected)."""
        return self.link.mode if self.link is not None else ""

    @property
    def text(self) -> bool:
        return self.link is not None and self.link.mode == "text"

    @property
    def capabilities(self) -> list[str] | None:
        """What the connected server's engine can do (None: no cloud connected)."""
        return self.link.capabilities if self.link is not None else None

    # ---------------------------------------------------------------- the session's life

    def start_answer(self, messages: list[dict], prompt: list[int], history: Callable[[], list[int]]) -> bool:
        """Make the cloud hold `prompt`: reuse and resync the session, or open a new one.
        False: carry on without the cloud. Raises CloudRejected (a configuration error to report).
        `history` reads the device's history, for a rebuild mid-answer."""
        assert self._connect is not None
        self._messages, self._history, self._reconnects_left = None, history, self.reconnects
        self._prompt_len, self._covered = len(prompt), len(prompt)
        try:
            if self.link is not None and not self.link.connected:
                self.retire()  # closed after an interrupted stream, or lost
            if self.link is not None and self.link.mode == "text" and self.link.messages != messages:
                self.retire()  # text mode: each side renders the chat itself, so a new chat is a new session
            if self.link is not None:
                try:
                    if self.link.mode == "text":
                        if self.link.held_text:
                            self.link.text_rollback(0)  # the same chat answered again
                    else:
                        self.link.resync(prompt)
                except CloudUnavailable:  # gone between answers (a drain closes idle sessions): open anew
                    self.retire()
            if self.link is None:
                link = self._connect()
                try:
                    link.open(
                        self.edge,
                        messages,
                        prompt,
                        self.sampling,
                        self.text_mode,
                        refuse_base_model=not self.allow_base_model,
                    )
                finally:
                    self.link = link if link.connected else None
                    if self.link is None:
                        self._retired += link.stats
            self.last_error = ""
            ok = True
        except CloudRejected:
            raise
        except LinkErrors as exc:
            self.lose(exc)
            ok = False
        self._messages = messages  # from here on a lost cloud may fail over (`reconnects`)
        return ok

    def lose(self, exc: Exception, rebuild_at: list[int] | None = None) -> None:
        """The cloud is gone (or answered an error): drop the link, and fail over if allowed: rebuild
        the session at `rebuild_at` (default: the device's whole history) on another replica."""
        log.warning("cloud lost: %s", exc)
        self.last_error = str(exc)
        self.retire()
        if isinstance(exc, CloudUnavailable) and self._reconnects_left > 0 and self._messages is not None:
            self._reconnects_left -= 1
            self._fail_over(self._messages, self._history()[:] if rebuild_at is None else list(rebuild_at))

    def _fail_over(self, messages: list[dict], history: list[int]) -> None:
        """Open a new session through the same URL (a balancer sends it to a live replica) holding
        `history`, trying with jittered backoff (edge_client/reconnect.py) for `reconnect_wait_s`.
        The time it took and the count go in the traffic (`reconnects`, `failover_ms`)."""
        t0 = time.perf_counter()
        deadline = t0 + self.reconnect_wait_s
        for wait in self.backoff.waits():
            if time.perf_counter() + wait > deadline:
                break
            time.sleep(wait)
            try:
                self._reconnect(messages, history)
            except CloudRejected as exc:  # a configuration error (key, model): no replica will take it
                self.last_error = str(exc)
                break
            except LinkErrors as exc:  # this try failed (refused, full, lost again): back off, try again
                self.last_error = str(exc)
                continue
            took_ms = (time.perf_counter() - t0) * 1000.0
            self._retired += Traffic(reconnects=1, failover_ms=took_ms)
            log.info("cloud session rebuilt in %.0f ms", took_ms)
            return
        log.warning(
            "no cloud replica took the session in %.1f s; the device finishes the answer", self.reconnect_wait_s
        )

    def _reconnect(self, messages: list[dict], history: list[int]) -> None:
        """One try: a new session holding `history` (tokens, or in text mode the answer's text), or raise."""
        assert self._connect is not None
        link = self._connect()
        try:
            link.open(
                self.edge,
                messages,
                history,
                self.sampling,
                self.text_mode,
                resume=True,
                refuse_base_model=not self.allow_base_model,  # another replica may serve another model
            )
            if link.mode == "text":  # the rebuilt session holds the answer's text so far
                self.link, self._covered = link, self._prompt_len
                self._text_sync(history)
        except BaseException:
            self.link = None
            link.close_quietly()
            self._retired += link.stats
            raise
        self.link = link
        self.last_error = ""

    def retire(self) -> None:
        """Drop the link, keeping its traffic in the totals."""
        if self.link is not None:
            self._retired += self.link.stats
            self.link.close_quietly()
            self.link = None

    def close(self, reason: str = "device closed") -> None:
        if self.link is not None:
            self.link.close(reason)
        self.retire()

    def traffic(self) -> Traffic:
        """Traffic of every link this session has used (lost links included)."""
        return self._retired + (self.link.stats if self.link is not None else Traffic())

    # ---------------------------------------------------------------- requests

    def sync(self, history: list[int], end: int | None = None) -> None:
        """Send the device tokens history[cloud_len:end] the cloud lacks (no reply awaited)."""
        link = self.link
        if link is None:
            return
        try:
            if link.mode == "text":
                self._text_sync(history[:end])
            else:
                link.sync(history[link.cloud_len : end])
        except CloudUnavailable as exc:
            self.lose(exc)

    def align(self, history: list[int]) -> None:
        """In a pool of tiers another tier may rewrite the device's history (a text tier re-tokenizes
        the answer): roll this token session back to the prefix it shares with `history`, so what it
        is sent next continues what it holds (Turn.align calls it after a rewrite). A text session
        aligns by its text already."""
        link = self.link
        if link is None or link.mode == "text":
            return
        keep = common_prefix(link.held, history)
        if keep < link.cloud_len:
            try:
                link.rollback(keep)
            except CloudUnavailable as exc:
                self.lose(exc)

    def resync(self, history: list[int]) -> None:
        """Make the cloud hold `history` (a prefill ahead of time; not in text mode, where the
        answer text is shared, not the prompt)."""
        if self.link is not None and self.link.connected and self.link.mode != "text":
            try:
                self.link.resync(history)
            except CloudUnavailable as exc:
                self.lose(exc)

    def ask(
        self, history: list[int], proposed: int, hidden: np.ndarray, lookahead: bool, explore: bool = False
    ) -> CloudToken | None:
        """The cloud's token for the position after `history` (the device proposed `proposed`), or
        None: the device writes it (a fallback). One round trip; a slow reply is abandoned.
        `explore`: asked at random where the engine kept the device's token; the cloud may decline it
        (counted in `explore_declined`; None)."""

        def request(link: CloudLink) -> CloudToken | None:
            got = link.generate(
                history[link.cloud_len :],
                proposed=proposed,
                hidden=hidden,
                max_tokens=1,
                lookahead=lookahead,
                explore=explore,
            )
            return got[0] if got else None

        return self._declinable(request, history)

    def _declinable(self, request: Callable[[CloudLink], T], history: list[int]) -> T | None:
        """`_request`, where the cloud may decline an exploration (its key's budget spent): None."""
        try:
            return self._request(request, rebuild_at=history)
        except CloudDeclined:
            self.explore_declined += 1
            return None

    def _request(self, request: Callable[[CloudLink], T], rebuild_at: list[int] | None = None) -> T | None:
        """`request` on the link, or None when the cloud could not answer. Where the link is lost,
        the session fails over (`lose`: rebuilt at `rebuild_at`, default the device's history) and the
        request is asked again on the new one: the reply lost with the old replica was never applied
        (the device applies only replies it has), so nothing is applied twice. A slow reply is not a
        lost link: the request was rolled back and the device goes on (`_slow`)."""
        asked_again, t0 = False, 0.0
        while (link := self.link) is not None:
            if asked_again:
                t0 = time.perf_counter()
            try:
                reply = request(link)
            except CloudTimeout as exc:  # slow, not gone: the link rolled the request back
                self._slow(link, exc)
                return None
            except LinkErrors as exc:
                self.lose(exc, rebuild_at)  # fails over while this answer has failovers left
                asked_again = True
                continue
            if asked_again:  # what the lost request cost on the new replica: its wait, the history's prefill
                self._retired += Traffic(
                    resume_ms=(time.perf_counter() - t0) * 1000.0, resume_prefill_ms=link.stats.background_ms
                )
            return reply
        return None

    def _slow(self, link: CloudLink, exc: CloudTimeout) -> None:
        """A request missed its deadline (the link rolled it back and stays): count it, and give
        the link up after `max_consecutive_timeouts` in a row (the next answer reconnects)."""
        self.timeouts += 1
        if link.consecutive_timeouts >= self.max_consecutive_timeouts:
            self.retire()
            self.last_error = str(exc)

    def guess(self, wait_s: float) -> Guess | None:
        """The cloud's lookahead guess for this position, or None (late, none, or the cloud lost)."""
        link = self.link
        if link is None:
            return None
        try:
            return link.next_guess(wait_s)
        except LinkErrors as exc:
            self.lose(exc)
            return None

    def verify(
        self,
        history: list[int],
        drafts: list[int],
        check: list[int],
        tolerance: float = 0.0,
        bonus: bool = False,
        hidden: np.ndarray | None = None,
    ) -> Verdict | None:
        """The cloud's verdict on `drafts` (after `history`, which it may partly lack), or None.
        Tokens of `history` the cloud lacks are synced first, so only the drafts are judged and
        the verdict's `accepted` counts from the first draft."""

        def request(link: CloudLink) -> Verdict:
            link.sync(history[link.cloud_len :])
            return link.verify(drafts, check, bonus=bonus, tolerance=tolerance, hidden=hidden)

        return self._request(request, rebuild_at=history)  # lost: the drafts stand unless a failover re-asks

    # ---------------------------------------------------------------- text mode (protocol v3)

    def _pending_text(self, history: list[int]) -> bytes:
        """The answer text of `history` the cloud lacks, up to the last whole character. Where the
        device's text departs from the cloud's (a rollback on the device), the cloud's is cut first."""
        link = self.link
        assert link is not None and self.answer_text is not None
        answer = self.answer_text.text_of(history[self._prompt_len :])
        if not answer.startswith(link.held_text):
            keep = common_prefix(answer, link.held_text)
            link.text_rollback(complete_utf8(answer[:keep]))
        pending = answer[len(link.held_text) :]
        return pending[: complete_utf8(pending)]

    def _text_sync(self, history: list[int]) -> bool:
        """Send the answer text the cloud lacks; True when it now holds all of `history`'s text."""
        link = self.link
        assert link is not None
        link.text_sync(self._pending_text(history))
        whole = self.answer_text is not None and len(link.held_text) == len(
            self.answer_text.text_of(history[self._prompt_len :])
        )
        self._covered = len(history) if whole else max(self._covered, len(history) - 1)
        return whole

    def text_taken(self, history_len: int) -> None:
        """The device took the cloud's text: its history (of `history_len`) is what the cloud holds."""
        self._covered = history_len

    def ask_text(
        self, history: list[int], proposed: bytes, hidden: np.ndarray, lookahead: bool = False, explore: bool = False
    ) -> CloudText | None:
        """Text mode: the cloud's span for the position after `history` (its text joins the answer
        on both sides), or None: the device writes the position (a fallback). None also where the
        device's text ends inside a character (the cloud can only be asked on whole characters).
        `lookahead`: ask for the cloud's guess for the next position with the span."""
        assert self.answer_text is not None
        answer = self.answer_text.text_of(history[self._prompt_len :])
        if complete_utf8(answer) != len(answer):
            return None

        def request(link: CloudLink) -> CloudText:
            pending = self._pending_text(history)
            return link.text_generate(
                pending, proposed=proposed, hidden=hidden, max_tokens=SPAN_TOKENS, lookahead=lookahead, explore=explore
            )

        return self._declinable(request, history)

    def verify_text(
        self,
        history: list[int],
        start: int,
        flagged: list[bool],
        tolerance: float,
        eog: bool = False,
        hidden: np.ndarray | None = None,
    ) -> TextVerdict | None:
        """Text mode, the cloud's check: the drafts history[start:] (their `flagged` by the router;
        `eog`: the last one ends the answer) as text, with the flagged drafts' byte ranges. None:
        the cloud could not answer (lost, slow, or no whole character drafted); the drafts stand.
        The verdict's `byte_position + accepted_bytes` is where the kept answer text ends."""
        view = self.answer_text
        assert view is not None

        def request(link: CloudLink) -> TextVerdict | None:
            pending = self._pending_text(history)  # the text the cloud lacks, the drafts' included
            position = len(link.held_text)
            if not pending and not eog:
                return None
            answer = history[self._prompt_len :]
            first = start - self._prompt_len
            # each draft's bytes, from the cloud's end of text (the drafted text's start)
            ends = [len(view.text_of(answer[:n])) - position for n in range(first, len(answer) + 1)]
            ranges: list[tuple[int, int]] = []
            rows: list[int] = []  # which flagged draft each range is (its hidden row)
            for i, hard in enumerate(flagged):
                lo, hi = max(0, ends[i]), min(ends[i + 1], len(pending))
                if hard and lo < hi:
                    ranges.append((lo, hi))
                    rows.append(sum(flagged[:i]))
            verdict = link.text_verify(
                pending,
                ranges,
                tolerance,
                eog=eog,
                check_eog=eog and flagged[-1],
                hidden=hidden[rows] if hidden is not None and rows else None,
                max_tokens=SPAN_TOKENS,
            )
            if not verdict.text and len(link.held_text) == ends[-1] + position:
                self._covered = len(history)  # the cloud holds all of it (else the text that follows)
            return verdict

        return self._request(request, rebuild_at=history[:start])  # a failover re-asks from before the drafts

    def stream_text(self, history: list[int], max_tokens: int, on_text: Callable[[CloudText], bool]) -> bool:
        """Text mode, policy cloud: the cloud writes up to `max_tokens` of its tokens after
        `history`, streamed to `on_text` (False: stop listening). False when the cloud was lost.
        After a failover the stream goes on from what the device took (the rest of `max_tokens`)."""
        got = 0

        def counted(piece: CloudText) -> bool:
            nonlocal got
            got += piece.n_tokens
            return on_text(piece)

        def request(link: CloudLink) -> bool:
            now = history if got == 0 else self._history()
            link.text_generate(self._pending_text(now), max_tokens=max_tokens - got, at_word=False, on_text=counted)
            return True

        return self._request(request) is not None

    def stream(
        self, history: list[int], max_tokens: int, on_token: Callable[[CloudToken], bool], proposed: int = -1
    ) -> bool:
        """The cloud writes up to `max_tokens` tokens after `history`, streamed to `on_token`
        (which may return False to stop listening). False when the cloud was lost. After a
        failover the stream goes on from what the device took (the rest of `max_tokens`)."""
        got = 0

        def counted(tok: CloudToken) -> bool:
            nonlocal got
            got += 1
            return on_token(tok)

        def request(link: CloudLink) -> bool:
            now = history if got == 0 else self._history()
            first = proposed if got == 0 else -1
            link.generate(now[link.cloud_len :], proposed=first, max_tokens=max_tokens - got, on_token=counted)
            return True

        return self._request(request) is not None
