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

The session never branches on how the answer is shared (tokens, or text in
protocol v3's text mode): what the cloud holds is the link's `held`
(edge_client/held_answer.py), and the requests themselves are the device's
per-mode strategies' (edge_client/shared_history.py), which hand them to
`request` as a function of the link.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from edge_client.answer import Traffic
from edge_client.cloud_link import (
    CloudDeclined,
    CloudError,
    CloudLink,
    CloudRejected,
    CloudTimeout,
    CloudUnavailable,
)
from edge_client.reconnect import Backoff
from shared.model_info import ModelInfo
from shared.protocol import SamplingParams
from shared.text_history import AnswerText

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
        self._prompt_len = 0  # where the answer starts in the device's history (a text session's rebuild)
        self.edge = edge
        self.sampling = sampling
        self.max_consecutive_timeouts = max_consecutive_timeouts  # then the cloud is lost for this answer
        self.link: CloudLink | None = None
        self.last_error = ""
        self.timeouts = 0  # cloud replies that did not come in time (Answer.cloud_timeouts)
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
        return self.link.held.covered if self.link is not None else 0

    @property
    def shared_history(self) -> str:
        """What the connected session shares: "tokens", "text", or "" (no cloud connected)."""
        return self.link.mode if self.link is not None else ""

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
        self._prompt_len = len(prompt)
        try:
            if self.link is not None and not self.link.connected:
                self.retire()  # closed after an interrupted stream, or lost
            if self.link is not None:
                try:
                    if not self.link.held.reuse(prompt, messages):
                        self.retire()  # text mode: each side renders the chat itself, so a new chat is a new session
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
                        answer_text=self.answer_text,
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
                answer_text=self.answer_text,
                prompt_len=self._prompt_len,  # text mode: the rebuilt session holds the answer's text so far
            )
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
        """Send what the cloud lacks of history[:end] (no reply awaited)."""
        self.once(lambda link: link.held.sync(history[:end]))

    def align(self, history: list[int]) -> None:
        """In a pool of tiers another tier may rewrite the device's history (a text tier re-tokenizes
        the answer): bring what this session holds back to the prefix it shares with `history`, so
        what it is sent next continues what it holds (Turn.align calls it after a rewrite)."""
        self.once(lambda link: link.held.align(history))

    def resync(self, history: list[int]) -> None:
        """Make the cloud hold `history` (a prefill ahead of time; nothing in text mode, where the
        answer text is shared, not the prompt)."""
        if self.link is not None and self.link.connected:
            self.once(lambda link: link.held.prefill(history))

    def request(self, request: Callable[[CloudLink], T], rebuild_at: list[int] | None = None) -> T | None:
        """`request` on the link, or None when the cloud could not answer. Where the link is lost,
        the session fails over (`lose`: rebuilt at `rebuild_at`, default the device's history) and the
        request is asked again on the new one: the reply lost with the old replica was never applied
        (the device applies only replies it has), so nothing is applied twice. A slow reply is not a
        lost link: the request was rolled back and the device goes on (and after `max_consecutive_timeouts`
        in a row, gives the link up). An exploration the
        cloud declines (its key's budget spent) is None too, counted in `explore_declined`."""
        asked_again, t0 = False, 0.0
        while (link := self.link) is not None:
            if asked_again:
                t0 = time.perf_counter()
            try:
                reply = request(link)
            except CloudTimeout as exc:  # slow, not gone: the link rolled the request back and stays
                self.timeouts += 1
                if link.consecutive_timeouts >= self.max_consecutive_timeouts:  # the next answer reconnects
                    self.retire()
                    self.last_error = f"{exc}, {link.consecutive_timeouts} times in a row"
                return None
            except CloudDeclined:
                self.explore_declined += 1
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

    def once(self, act: Callable[[CloudLink], T]) -> T | None:
        """`act` on the link once, or None when the link is down or lost doing it. Nothing is done again
        on another replica: a send is rebuilt with the session, and a lookahead guess was the lost one's."""
        link = self.link
        if link is None:
            return None
        try:
            return act(link)
        except LinkErrors as exc:
            self.lose(exc)
            return None
