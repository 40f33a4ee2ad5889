"""A replay-specific decoding driver for the policies RoutedGenerator does not have.

router-span, router-verify, speculative, query and session are built here
from the project's parts (EdgeDecoder, CloudLink, Router, RoutingPolicy,
Sampler) rather than by forking the generator, so the comparison measures the
waiting strategy, not a different implementation of the same loop.

Tokens reach the user (`emit`) only once they are final: in router-verify a
drafted token after a flagged position waits for the verdict; in speculative
every drafted token does. That is the latency each strategy really costs.
(router-check, where every draft waits, is the generator's own loop.)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from edge_client.answer import TokenEvent
from edge_client.cloud_link import CloudError, CloudLink, CloudRejected, CloudToken, CloudUnavailable, session_holding
from edge_client.decoder import ClauseEnds, EdgeDecoder
from edge_client.generator import build_router
from edge_client.replay.policies import PolicySpec, RouterOptions, make_policy
from edge_client.replay.turn import Emitter, LinkFactory, TurnRecord
from shared.llama_backend import LlamaModel
from shared.protocol import SamplingParams
from shared.sampling import Sampler

log = logging.getLogger(__name__)

class ReplayDriver:
    def __init__(self, spec: PolicySpec, edge: LlamaModel, links: LinkFactory, opts: RouterOptions) -> None:
        self.spec = spec
        self.model = edge
        self.links = links
        self.opts = opts
        self.decoder = EdgeDecoder(edge, n_ctx=opts.n_ctx, threads=opts.threads)
        self.router = build_router(opts.router, edge.n_vocab, edge_info=edge.info, cloud_model=opts.cloud_model)
        self.policy = make_policy(opts, "router")
        self.sampling = SamplingParams(temperature=opts.temperature, seed=opts.seed)
        self.link: CloudLink | None = None
        self.light_mode = False
        self._stop: threading.Event | None = None
        self._is_clause_end = ClauseEnds(edge)

    # ---------------------------------------------------------------- Runner API

    def start_session(self, light_mode: bool) -> None:
        self.light_mode = light_mode

    def answer(
        self, messages: list[dict], max_tokens: int, on_token: Callable[[TokenEvent], None] | None = None, stop: threading.Event | None = None
    ) -> TurnRecord:
        """One answer; `on_token` sees each token when it is released, `stop` interrupts (voice barge-in)."""
        record = TurnRecord()
        before = self.links.totals()
        t0 = time.perf_counter()
        emit = Emitter(self.model, record, t0, on_token)
        self._stop = stop
        prompt = self.model.chat_tokens(messages)
        previous = self.decoder.history[:]
        self.decoder.set_history(prompt)
        self.policy.start_answer()
        self._sampler = Sampler(self.sampling)
        self._prompt_len = len(prompt)
        self._max = max_tokens
        kind = self.spec.kind
        if kind == "session":
            record.decision = "edge" if self.light_mode else "cloud"
            self._run_whole(record.decision, messages, prompt, previous, emit, record)
        elif kind == "query":
            logits, hidden = self.decoder.next_distribution()
            score = self.router.score(hidden, logits, int(logits.argmax()))
            limit = self.opts.query_threshold if self.opts.query_threshold is not None else self.opts.threshold
            record.decision = "cloud" if score >= limit else "edge"
            self._run_whole(record.decision, messages, prompt, previous, emit, record)
        else:
            if not self._ensure_cloud(messages, prompt, previous):
                record.degraded = True
            if kind == "router-span":
                self._span(emit)
            else:
                self._draft_and_verify(emit, check_all=kind == "speculative")
        record.degraded = record.degraded or (record.decision != "edge" and self.link is None)  # the cloud was needed but lost
        emit.finish()
        record.finish_reason = self._finish_reason()
        record.traffic = self.links.totals() - before
        return record

    def close(self) -> None:
        if self.link is not None:
            self.link.close("replay done")
            self.link = None
        self.decoder.close()

    # ---------------------------------------------------------------- shared steps

    def _n_answer(self) -> int:
        return len(self.decoder.history) - self._prompt_len

    def _done(self) -> bool:
        h = self.decoder.history
        return self._n_answer() >= self._max or (self._n_answer() > 0 and self.model.is_eog(h[-1])) or self._stopped()

    def _stopped(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _finish_reason(self) -> str:
        h = self.decoder.history
        if self._n_answer() > 0 and self.model.is_eog(h[-1]):
            return "stop"
        return "interrupted" if self._stopped() else "length"

    def _propose(self, score: bool = True) -> tuple[int, float]:
        """Device token and router score (1.0 when not asked) for the next position; not appended."""
        logits, hidden = self.decoder.next_distribution()
        token = self._sampler.sample(logits)
        return token, (self.router.score(hidden, logits, token) if score else 1.0)

    def _maybe_sync(self, final_end: int) -> None:
        """Eager sync: send device tokens known to be final (history[:final_end])."""
        link = self.link
        if link is None or not self.spec.eager_sync or self.opts.sync_every <= 0:
            return
        if final_end - link.cloud_len >= self.opts.sync_every:
            try:
                link.sync(self.decoder.history[link.cloud_len : final_end])
            except CloudUnavailable as exc:
                self._lose_cloud(exc)

    def _run_whole(self, who: str, messages: list[dict], prompt: list[int], previous: list[int], emit: Emitter, record: TurnRecord) -> None:
        """query / session: the whole answer on one model."""
        if who == "cloud" and self._ensure_cloud(messages, prompt, previous):
            self._stream(emit)
        elif who == "cloud":
            record.degraded = True
        while not self._done():  # device answer, or the rest of a broken stream
            token, _ = self._propose(score=False)
            self.decoder.append(token)
            emit(token, "edge")

    def _stream(self, emit: Emitter) -> None:
        assert self.link is not None

        def take(tok: CloudToken) -> bool:
            self.decoder.append(tok.token)
            emit(tok.token, "cloud")
            return not self._stopped()  # False closes the link: the cloud is still writing

        try:
            self.link.generate(self.decoder.history[self.link.cloud_len :], max_tokens=self._max, on_token=take)
        except (CloudUnavailable, CloudError) as exc:
            self._lose_cloud(exc)

    # ---------------------------------------------------------------- router-span

    def _span(self, emit: Emitter) -> None:
        """At a hard token the cloud writes up to `span` tokens, streamed, in one call."""
        while not self._done():
            token, score = self._propose()
            if self.policy.decide(score) and self.link is not None:
                n = min(self.opts.span, self._max - self._n_answer())

                def take(tok: CloudToken) -> bool:
                    self.decoder.append(tok.token)
                    emit(tok.token, "cloud")
                    return True

                link = self.link
                try:
                    got = link.generate(self.decoder.history[link.cloud_len :], proposed=token, max_tokens=n, on_token=take)
                    if got:
                        continue
                except (CloudUnavailable, CloudError) as exc:
                    self._lose_cloud(exc)
            self.decoder.append(token)
            emit(token, "edge")
            self._maybe_sync(len(self.decoder.history))

    # ---------------------------------------------------------------- router-verify / speculative

    def _draft_and_verify(self, emit: Emitter, check_all: bool) -> None:
        """Draft to a clause boundary; verify the flagged positions in one round trip."""
        dec = self.decoder
        while not self._done():
            first_flag = -1
            flags: list[int] = []
            n_draft = 0
            while True:
                token, score = self._propose(score=not check_all)
                flagged = check_all or self.policy.decide(score)
                dec.append(token)
                n_draft += 1
                if flagged:
                    flags.append(len(dec.history) - 1)
                    if first_flag < 0:
                        first_flag = len(dec.history) - 1
                if first_flag < 0:  # nothing before it is in doubt: the token is final
                    emit(token, "edge")
                    self._maybe_sync(len(dec.history))
                if self._done() or self._is_clause_end(token) or n_draft >= self.opts.draft_max:
                    break
            if not flags:
                continue
            held_from = first_flag
            link = self.link
            if link is None:  # no cloud: the drafts stand
                for t in dec.history[held_from:]:
                    emit(t, "edge")
                continue
            base = link.cloud_len
            tokens = dec.history[base:]
            bonus = check_all and self._n_answer() < self._max and not self.model.is_eog(tokens[-1])
            try:
                verdict = link.verify(tokens, [f - base for f in flags], bonus=bonus)
            except (CloudUnavailable, CloudError) as exc:
                self._lose_cloud(exc)
                for t in dec.history[held_from:]:
                    emit(t, "edge")
                continue
            cut = base + verdict.accepted
            for t in dec.history[held_from:cut]:
                emit(t, "edge")
            if verdict.token >= 0:
                dec.truncate(cut)
                dec.append(verdict.token)
                emit(verdict.token, "cloud")

    # ---------------------------------------------------------------- the cloud session

    def _ensure_cloud(self, messages: list[dict], prompt: list[int], previous: list[int]) -> bool:
        """Connect (or reuse the session) so the cloud holds `prompt`. False: carry on without it."""
        try:
            self.link = session_holding(self.link, self.links, self.model.info, messages, prompt, previous, self.sampling)
            return True
        except CloudRejected:
            raise
        except (CloudUnavailable, CloudError) as exc:
            self._lose_cloud(exc)
            return False

    def _lose_cloud(self, exc: Exception) -> None:
        log.warning("%s: cloud lost, continuing on the device: %s", self.spec.name, exc)
        if self.link is not None:
            self.link.close_quietly()
        self.link = None
