"""Token-routed generation: the per-token loop that decides who writes each token.

For each position the device model proposes a token and the router scores
it. Easy positions keep the device's token. Hard ones send the device tokens
the cloud has not seen yet plus the hidden state in one `generate`, and the
cloud's token is accepted into the device's history. With lookahead the cloud
then sends its guess for the next position, which decides that position
instead of the router (docs/architecture.md). Device tokens are also sent
eagerly (`sync_every`) so the cloud prefills them before it is asked.

With the cloud's check (`check`) the device instead drafts to the end of a
clause and the cloud checks the whole clause in one `verify`: flagged tokens
exactly, the others within `check_nats`; the first rejected draft is replaced
by the cloud's token and the rest is redrafted. Tokens are released only once
checked, so a listener never hears one that is taken back. With
`check="after-first-clause"` the first clause is written as without the check
(released at once, so the first audio is not delayed) and the check covers
the rest of the answer, while the first clause is being spoken.

If the cloud is lost, the answer continues on the device and is marked
degraded; the next answer tries to reconnect.

    with open_generator(GeneratorOptions(cloud="local")) as gen:
        answer = gen.generate([{"role": "user", "content": "Hi"}], on_token=print)
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from edge_client.answer import Answer, Latency, Route, TokenEvent
from edge_client.cloud_link import CloudError, CloudLink, CloudRejected, CloudTimeout, CloudToken, CloudUnavailable, LinkStats, session_holding
from edge_client.decoder import ClauseEnds, EdgeDecoder
from models.registry import DEFAULT_CLOUD_MODEL, DEFAULT_EDGE_MODEL, ModelInfo, model_info
from shared.llama_backend import LlamaModel
from shared.policy import PolicyConfig, RoutingPolicy
from shared.protocol import SamplingParams
from shared.router import HeuristicRouter, Router
from shared.routing_log import RoutingLog
from shared.sampling import Guess, Sampler

log = logging.getLogger(__name__)

CHECK_MODES = ("off", "all", "after-first-clause")
DEFAULT_CHECK = "after-first-clause"  # no first-audio cost, better answers (docs/voice.md, docs/router.md)
OVERRULED_DECAY = 0.995  # per released token, for the running overruled share (half-life ~140 tokens)
DEFAULT_SYSTEM_PROMPT = "You are a helpful voice assistant. Answer briefly, in one or two sentences."


@dataclass(slots=True)
class GeneratorOptions:
    """Everything that configures routed generation (the CLI and the voice app fill it)."""

    edge_model: str = DEFAULT_EDGE_MODEL
    cloud_model: str = DEFAULT_CLOUD_MODEL  # used when cloud == "local"
    cloud: str = "local"  # "local" (start a loopback server), "none", or a ws:// URL
    api_key: str = ""  # for a remote cloud; default $TOKENROUTER_API_KEY
    policy: str = "router"  # edge | cloud | router
    threshold: float | None = 0.5  # used when cloud_fraction is None
    cloud_fraction: float | None = 0.3  # the one calibrated knob: target share of cloud-written tokens (the check's overrules included)
    warmup: int = 0
    hysteresis: float = 0.0
    router: str = "auto"  # "auto" (shipped learned router for the pair, else entropy), a heuristic kind, or a router file (.npz)
    router_on_mismatch: str = "error"  # learned router trained for another edge model: "error" or "heuristic" (warn, fall back)
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    sync_every: int = 4  # send device tokens eagerly after this many (0 = only with hard tokens)
    cloud_timeout_s: float = 2.0
    # After each hard token the cloud sends its guess for the next position; there the device
    # takes it (no round trip, no router) where its own token is over lookahead_nats worse to
    # the cloud (docs/architecture.md, "lookahead"). These cloud tokens come on top of the
    # router's cloud_fraction.
    lookahead: bool = True
    lookahead_nats: float = 1.0  # take the guess where the cloud finds the device's token this much less likely
    lookahead_wait_s: float = 0.1  # longest wait for that guess; then the router decides as usual
    # The cloud's check (docs/architecture.md, "check"): draft to a clause end, one verify per
    # clause; the cloud overrules a device token over check_nats worse than its own choice.
    # Better answers (docs/router.md) for a round trip per clause before it is released.
    # "all": the whole answer; "after-first-clause" (the default): the first clause goes out at
    # once and the check covers the rest while it is spoken (docs/voice.md: no first-audio cost).
    check: str = DEFAULT_CHECK
    check_nats: float = 1.0
    check_max_draft: int = 12  # longest draft before a verify when no clause ends
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    n_ctx: int = 4096
    # One llama.cpp thread: a 135M model is memory-bound, and a second thread's
    # barriers collapse throughput when ASR, TTS or a local cloud share the cores.
    threads: int = 1


class RoutedGenerator:
    def __init__(
        self,
        edge: LlamaModel,
        router: Router,
        policy: RoutingPolicy,
        sampling: SamplingParams,
        connect: Callable[[], CloudLink] | None = None,
        sync_every: int = 4,
        n_ctx: int = 4096,
        threads: int = 1,
        lookahead: bool = False,
        lookahead_nats: float = 1.0,
        lookahead_wait_s: float = 0.1,
        check: str = "off",
        check_nats: float = 1.0,
        check_max_draft: int = 12,
    ) -> None:
        self.edge = edge
        self.decoder = EdgeDecoder(edge, n_ctx=n_ctx, threads=threads)
        self.router = router
        self.policy = policy
        self.sampling = sampling
        self.sync_every = sync_every
        self.lookahead = lookahead
        self.lookahead_nats = lookahead_nats
        self.lookahead_wait_s = lookahead_wait_s
        if check not in CHECK_MODES:
            raise ValueError(f"check must be one of {', '.join(CHECK_MODES)}, not {check!r}")
        if check != "off" and not 0.0 < check_nats < float("inf"):
            raise ValueError(f"check_nats (--check-nats) must be a finite number of nats > 0, not {check_nats}")
        if check_max_draft < 1:
            raise ValueError(f"check_max_draft must be >= 1, not {check_max_draft}")
        self.check = check
        self.check_nats = check_nats
        self.check_max_draft = check_max_draft
        self._clause_ends = ClauseEnds(edge)
        self.overruled_share = 0.0  # running share of answer tokens the check overruled (the router targets the rest)
        self._connect = connect
        self.link: CloudLink | None = None
        self.last_cloud_error: str = ""
        self._retired = LinkStats()
        self.cloud_timeouts = 0  # hard tokens the device wrote because the cloud was slow
        self.max_consecutive_timeouts = 3  # then the cloud is treated as lost for this answer
        self._lock = threading.Lock()
        # Reconnect attempts per answer when the cloud is lost mid-answer (0: finish on the device).
        # A new session is rebuilt from the device's token history: hello + rollback(0) + sync(history).
        self.reconnect_mid_answer = 0
        self._reconnects_left = 0
        self._messages: list[dict] | None = None

    # ---------------------------------------------------------------- public API

    def count_tokens(self, messages: list[dict]) -> int:
        return len(self.edge.chat_tokens(messages))

    def generate(
        self,
        messages: list[dict],
        max_tokens: int = 128,
        on_token: Callable[[TokenEvent], None] | None = None,
        stop: threading.Event | None = None,
    ) -> Answer:
        """Answer the chat `messages`; blocking. Set `stop` to interrupt (barge-in)."""
        with self._lock:
            return self._generate(messages, max_tokens, on_token, stop)

    def prefill(self, messages: list[dict], complete: bool = False) -> int:
        """Decode the start of a prompt ahead of time; returns how many tokens it decoded now.

        The voice pipeline calls this with each partial transcript while the
        person is still speaking, so that when the turn starts only what the
        final transcript changed remains to decode. With `complete` (the
        pipeline's default) the whole prompt is decoded, template tail
        included, and the logits of its last position are kept: if the final
        transcript equals the guess, `generate` starts sampling at once.
        Without it the last user word is left out (it may still change or
        tokenize differently once more text follows). When the cloud is
        connected the same tokens are sent to it (not awaited) so it prefills
        in parallel. Skipped (returns 0) while an answer is being generated.
        `generate` later keeps whatever prefix both prompts share.
        """
        if complete:
            tokens = self.edge.chat_tokens(messages)
        else:
            text = self.edge.render_chat(messages, add_generation_prompt=False)
            user = messages[-1]["content"].rstrip()
            end = text.rfind(user)
            if end < 0 or not user:
                return 0
            cut = end + len(user.rsplit(None, 1)[0]) if len(user.split()) > 1 else end
            tokens = self.edge.prompt_tokens(text[:cut])
        if not self._lock.acquire(blocking=False):
            return 0  # an answer is being generated: it owns the caches
        try:
            previous = self.decoder.history[:]
            keep = self.decoder.set_history(tokens)
            if keep < len(tokens):
                self.decoder.next_distribution()
            link = self.link
            if link is not None and link.connected and self.policy.mode != "edge":
                try:
                    link.resync(previous, tokens)
                except CloudUnavailable as exc:
                    self._lose_cloud(exc)
        finally:
            self._lock.release()
        return len(tokens) - keep

    def close(self) -> None:
        if self.link is not None:
            self.link.close("device closed")
        self._retire_link()
        self.decoder.close()

    # ---------------------------------------------------------------- the loop

    def _generate(self, messages: list[dict], max_tokens: int, on_token: Callable[[TokenEvent], None] | None, stop: threading.Event | None) -> Answer:
        t_start = time.perf_counter()
        prompt = self.edge.chat_tokens(messages)
        previous = self.decoder.history[:]  # what the device (and the cloud, up to cloud_len) held
        self.decoder.set_history(prompt)
        self._messages, self._reconnects_left = None, self.reconnect_mid_answer
        self.policy.start_answer()
        sampler = Sampler(self.sampling)
        use_cloud = self.policy.mode != "edge" and self._connect is not None
        degraded = use_cloud and not self._ensure_cloud(messages, prompt, previous)
        self._messages = messages  # from here on a lost cloud may be reconnected (reconnect_mid_answer)

        answer = Answer(text="", tokens=[], routes=[], scores=[], policy=self.policy.name, degraded=degraded)
        answer.edge_model = self.edge.info.fingerprint
        answer.cloud_model = self.link.accept.cloud_model if self.link and self.link.accept else ""
        rlog = RoutingLog(edge_model=answer.edge_model, cloud_model=answer.cloud_model, start_position=len(prompt))
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces: list[str] = []
        token_ms: list[float] = []
        router_ms: list[float] = []
        stats0 = self._total_stats()
        timeouts0 = self.cloud_timeouts
        t_last = t_start

        def accept(token: int, route: Route, score: float | None, fallback: bool = False) -> None:
            """Record one accepted token and tell the listener."""
            nonlocal t_last
            now = time.perf_counter()
            token_ms.append((now - t_last) * 1000.0)
            t_last = now
            text = utf8.decode(self.edge.token_bytes(token))
            pieces.append(text)
            answer.tokens.append(token)
            answer.routes.append(route)
            answer.scores.append(score)
            rlog.append(route, score, token, fallback)
            if on_token is not None:
                on_token(TokenEvent(len(answer.tokens) - 1, token, text, route, score))

        def finished() -> bool:
            if answer.tokens and self.edge.is_eog(answer.tokens[-1]):
                return True
            return len(answer.tokens) >= max_tokens or (stop is not None and stop.is_set())

        guess_due = False  # the last token came from the cloud with a lookahead guess to follow
        checking = self.check == "all"  # drafts go to the cloud's check, clause by clause
        after_clause_end = False  # for "after-first-clause": the last token ended the first clause
        while not finished():
            if self.policy.mode == "cloud" and self.link is not None:
                self._stream_from_cloud(answer, max_tokens, accept, stop)
                continue  # finished, or the stream broke off and the device carries on
            if checking and self.link is not None:
                self._check_clause(sampler, answer, accept, max_tokens - len(answer.tokens), stop, router_ms)
                continue  # without a cloud, the per-token loop below finishes on the device
            logits, hidden = self.decoder.next_distribution()
            proposed = sampler.sample(logits)
            guess = self._take_guess() if guess_due else None
            guess_due = False
            token, route, fallback, score = proposed, "edge", False, None
            if guess is not None:  # the cloud's choice and how it ranks the device's token are known
                answer.lookahead_positions.append(len(answer.tokens))
                if guess.regret(proposed) > self.lookahead_nats:
                    token, route = guess.token, "cloud"
            else:
                t0 = time.perf_counter()
                score = self.router.score(hidden, logits, proposed)
                hard = self.policy.decide(score)
                router_ms.append((time.perf_counter() - t0) * 1000.0)
                if hard and self.link is not None:
                    cloud_token = self._ask_cloud(proposed, hidden)
                    if cloud_token is not None:
                        token, route = cloud_token.token, "cloud"
                        guess_due = self.lookahead
                fallback = hard and route == "edge" and use_cloud
            self.decoder.append(token)
            accept(token, route, score, fallback)
            self._maybe_sync()
            if self.check == "after-first-clause" and not checking:  # check from the token after the one past the clause end
                checking, after_clause_end = after_clause_end, self._clause_ends(token)

        ended = bool(answer.tokens) and self.edge.is_eog(answer.tokens[-1])
        interrupted = not ended and stop is not None and stop.is_set()
        answer.finish_reason = "stop" if ended else ("interrupted" if interrupted else "length")
        answer.interrupted = interrupted
        answer.cloud_timeouts = self.cloud_timeouts - timeouts0
        answer.degraded = answer.degraded or (use_cloud and self.link is None)
        tail = utf8.decode(b"", final=True)  # an unfinished multi-byte character
        if tail and pieces:
            pieces[-1] += tail
        answer.text = "".join(pieces)
        answer.pieces = pieces
        answer.latency = _latency(t_start, token_ms, router_ms)
        answer.routing_log = rlog.to_bytes()
        self._stats_into(answer, stats0)
        drift_report = getattr(self.router, "drift_report", None)
        if drift_report is not None:  # learned routers: score distribution vs training (PSI)
            answer.drift = drift_report()
        return answer

    def _stream_from_cloud(self, answer: Answer, max_tokens: int, accept: Callable[..., None], stop: threading.Event | None) -> None:
        """Cloud-only policy: the cloud writes the rest of the answer, streamed."""
        assert self.link is not None

        def take(tok: CloudToken) -> bool:
            self.decoder.append(tok.token)  # decoded lazily, only if the device must take over
            accept(tok.token, "cloud", None)
            return len(answer.tokens) < max_tokens and not tok.eog and not (stop is not None and stop.is_set())

        pending = self.decoder.history[self.link.cloud_len :]
        try:
            self.link.generate(pending, max_tokens=max_tokens - len(answer.tokens), on_token=take)
        except (CloudUnavailable, CloudError) as exc:
            self._lose_cloud(exc)
            answer.degraded = True

    def _check_clause(
        self, sampler: Sampler, answer: Answer, accept: Callable[..., None], room: int, stop: threading.Event | None, router_ms: list[float]
    ) -> None:
        """Draft to a clause end (at most `room` tokens), then one verify: the cloud's check.

        The draft takes one token past the clause end, so that a listener splitting clauses
        at "punctuation then a space" (the voice pipeline's TTS chunker) can cut the clause as
        soon as the verdict comes, not a whole clause later.

        Router-flagged drafts are checked exactly, the others within `check_nats`. The
        verdict keeps the drafts before the first rejected one (flagged ones count as the
        cloud's: it chose the same token) and, at the rejected one, gives the cloud's token;
        the device rolls its history back to there. Nothing is released before the verdict.
        If the cloud is lost, the drafts stand (flagged ones as fallbacks).
        """
        dec, link = self.decoder, self.link
        assert link is not None
        start = len(dec.history)
        try:
            link.sync(dec.history[link.cloud_len : start])  # final tokens not yet synced (after a verdict: none)
        except CloudUnavailable as exc:
            self._lose_cloud(exc)
            return
        flagged: list[bool] = []
        scores: list[float] = []
        hard_hidden: list[np.ndarray] = []  # the hidden state at each flagged draft: hard tokens travel with it
        after_clause_end = False
        while True:
            logits, hidden = dec.next_distribution()
            proposed = sampler.sample(logits)
            t0 = time.perf_counter()
            score = self.router.score(hidden, logits, proposed)
            flagged.append(self.policy.decide(score))
            router_ms.append((time.perf_counter() - t0) * 1000.0)
            if flagged[-1]:
                hard_hidden.append(hidden.astype(np.float16))  # a copy: the view dies with the next decode
            scores.append(score)
            dec.append(proposed)
            if stop is not None and stop.is_set():
                dec.truncate(start)  # interrupted: nothing of this clause is released
                return
            if after_clause_end or self.edge.is_eog(proposed) or len(scores) >= min(room, self.check_max_draft):
                break
            after_clause_end = self._clause_ends(proposed)
        drafts = dec.history[start:]
        check = [i for i, f in enumerate(flagged) if f]
        try:
            verdict = link.verify(drafts, check, tolerance=self.check_nats, hidden=np.stack(hard_hidden) if hard_hidden else None)
        except (CloudUnavailable, CloudError) as exc:
            self._lose_cloud(exc)
            for token, score, flag in zip(drafts, scores, flagged):
                accept(token, "edge", score, fallback=flag)
            return
        for token, score, flag in zip(drafts[: verdict.accepted], scores, flagged):
            accept(token, "cloud" if flag else "edge", score)
        at = verdict.accepted  # the rejected draft, where the cloud wrote its own token (if any)
        overruled = verdict.token >= 0 and at < len(drafts) and not flagged[at]
        if verdict.token >= 0:
            dec.truncate(start + at)
            dec.append(verdict.token)
            if overruled:
                answer.overruled_positions.append(len(answer.tokens))
            accept(verdict.token, "cloud", scores[at] if at < len(drafts) else None)
        self._track_overruled(verdict.accepted + (verdict.token >= 0), overruled)

    def _track_overruled(self, n_released: int, overruled: bool) -> None:
        """Fold one verdict into the running overruled share (a decayed mean, half-life ~140
        tokens) and tell the policy, so that flags plus overrules meet --cloud-fraction."""
        keep = OVERRULED_DECAY**n_released
        self.overruled_share = self.overruled_share * keep + (1.0 - OVERRULED_DECAY) * overruled
        self.policy.share_taken_elsewhere(self.overruled_share)

    def _ask_cloud(self, proposed: int, hidden: np.ndarray) -> CloudToken | None:
        """The cloud's token for this position, or None: the device writes it (fallback)."""
        assert self.link is not None
        pending = self.decoder.history[self.link.cloud_len :]
        try:
            return self.link.generate(pending, proposed=proposed, hidden=hidden, max_tokens=1, lookahead=self.lookahead)[0]
        except CloudTimeout as exc:  # slow, not gone: the link rolled the request back
            self.cloud_timeouts += 1
            if self.link is not None and self.link.consecutive_timeouts >= self.max_consecutive_timeouts:
                self._retire_link()
                self.last_cloud_error = str(exc)
            return None
        except (CloudUnavailable, CloudError, IndexError) as exc:
            self._lose_cloud(exc)
            if self.link is None:
                return None
            try:  # reconnected mid-answer: the rebuilt session holds the whole history
                return self.link.generate([], proposed=proposed, hidden=hidden, max_tokens=1, lookahead=self.lookahead)[0]
            except (CloudUnavailable, CloudError, IndexError) as exc2:
                self._lose_cloud(exc2)
                return None

    def _take_guess(self) -> Guess | None:
        """The cloud's lookahead guess for this position, or None (late, none, or the cloud lost)."""
        link = self.link
        if link is None:
            return None
        try:
            return link.next_guess(self.lookahead_wait_s)
        except (CloudUnavailable, CloudError) as exc:
            self._lose_cloud(exc)
            return None

    def _maybe_sync(self) -> None:
        link = self.link
        if link is None or self.sync_every <= 0:
            return
        if len(self.decoder.history) - link.cloud_len >= self.sync_every:
            try:
                link.sync(self.decoder.history[link.cloud_len :])
            except CloudUnavailable as exc:
                self._lose_cloud(exc)

    # ---------------------------------------------------------------- the cloud session

    def _ensure_cloud(self, messages: list[dict], prompt: list[int], previous: list[int]) -> bool:
        """Connect (or reuse the session) and make the cloud hold `prompt`. False = degraded."""
        assert self._connect is not None
        try:
            if self.link is not None and not self.link.connected:
                self._retire_link()  # closed after an interrupted stream, or lost
            self.link = session_holding(self.link, self._connect, self.edge.info, messages, prompt, previous, self.sampling)
            self.last_cloud_error = ""
            return True
        except CloudRejected:
            raise
        except (CloudUnavailable, CloudError) as exc:
            self._lose_cloud(exc)
            return False

    def _lose_cloud(self, exc: Exception) -> None:
        log.warning("cloud lost, continuing on the device: %s", exc)
        self.last_cloud_error = str(exc)
        self._retire_link()
        if isinstance(exc, CloudUnavailable) and self._reconnects_left > 0 and self._messages is not None:
            self._reconnects_left -= 1
            self._reconnect(self._messages)

    def _reconnect(self, messages: list[dict]) -> None:
        """Open a new session and rebuild it from the device's history (open() re-syncs when it differs from the prompt)."""
        assert self._connect is not None
        link = self._connect()
        try:
            link.open(self.edge.info, messages, self.decoder.history[:], self.sampling)
        except (CloudUnavailable, CloudError, CloudRejected) as exc:
            log.warning("reconnect failed, continuing on the device: %s", exc)
            link.close_quietly()
            return
        self.link = link
        self.last_cloud_error = ""

    # ---------------------------------------------------------------- accounting

    def _total_stats(self) -> tuple[int, int, int, float]:
        """Traffic of every link this generator has used (lost links included)."""
        r, s = self._retired, (self.link.stats if self.link is not None else LinkStats())
        return (r.bytes_up + s.bytes_up, r.bytes_down + s.bytes_down, r.round_trips + s.round_trips, r.cloud_compute_ms + s.cloud_compute_ms)

    def _stats_into(self, answer: Answer, before: tuple[int, int, int, float]) -> None:
        after = self._total_stats()
        answer.bytes_up, answer.bytes_down, answer.round_trips = after[0] - before[0], after[1] - before[1], after[2] - before[2]
        answer.cloud_compute_ms = after[3] - before[3]

    def _retire_link(self) -> None:
        if self.link is not None:
            s, r = self.link.stats, self._retired
            r.bytes_up += s.bytes_up
            r.bytes_down += s.bytes_down
            r.round_trips += s.round_trips
            r.cloud_compute_ms += s.cloud_compute_ms
            self.link.close_quietly()
            self.link = None


def _latency(t_start: float, token_ms: list[float], router_ms: list[float]) -> Latency:
    total = (time.perf_counter() - t_start) * 1000.0
    if not token_ms:
        return Latency(total=total)
    rest = np.array(token_ms[1:]) if len(token_ms) > 1 else np.array(token_ms)
    return Latency(
        first_token=token_ms[0],
        per_token_p50=float(np.percentile(rest, 50)),
        per_token_p95=float(np.percentile(rest, 95)),
        total=total,
        router_p50=float(np.median(router_ms)) if router_ms else 0.0,
    )


ROUTERS_DIR = Path(__file__).resolve().parents[1] / "models" / "routers"


def shipped_router(edge_model: str, cloud_model: str) -> Path | None:
    """The trained router shipped for this (device, cloud) model pair, if there is one."""
    path = ROUTERS_DIR / f"{edge_model}__{cloud_model}.npz"
    return path if path.is_file() else None


def build_router(spec: str, n_vocab: int, edge_info: ModelInfo | None = None, on_mismatch: str = "error", cloud_model: str = "") -> Router:
    """"auto" (the shipped learned router for the pair, else entropy), a heuristic kind
    ("entropy", "top1", "margin"), or a learned router file (checked against `edge_info`)."""
    if spec == "auto":
        path = shipped_router(edge_info.name, cloud_model) if edge_info is not None else None
        if path is None:
            return HeuristicRouter("entropy", n_vocab)
        spec, on_mismatch = str(path), "heuristic"
    if spec in HeuristicRouter.KINDS:
        return HeuristicRouter(spec, n_vocab)
    if spec.endswith(".npz") or os.path.isfile(spec):
        from shared.learned_router import load_router

        return load_router(spec, edge_info, on_mismatch=on_mismatch, n_vocab=n_vocab)
    raise ValueError(f"unknown router {spec!r}: use auto, one of {', '.join(HeuristicRouter.KINDS)} or a learned router file (.npz)")


@contextlib.contextmanager
def open_generator(opts: GeneratorOptions) -> Iterator[RoutedGenerator]:
    """Load the device model, start or reach the cloud, and yield a ready generator."""
    from cloud_server.local import LocalCloudServer

    edge = LlamaModel(model_info(opts.edge_model))
    router = build_router(opts.router, edge.n_vocab, edge.info, opts.router_on_mismatch, cloud_model=opts.cloud_model)
    policy = RoutingPolicy(
        PolicyConfig(opts.policy, threshold=opts.threshold, cloud_fraction=opts.cloud_fraction, warmup=opts.warmup, hysteresis=opts.hysteresis),
        prior=getattr(router, "threshold_for", None),
    )
    sampling = SamplingParams(temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed)
    server: LocalCloudServer | None = None
    connect: Callable[[], CloudLink] | None = None
    try:
        if opts.cloud == "local" and opts.policy != "edge":
            server = LocalCloudServer(model=opts.cloud_model).start()
            url, key = server.url, server.api_key
        elif opts.cloud not in ("none", "local"):
            url, key = opts.cloud, opts.api_key or os.environ.get("TOKENROUTER_API_KEY", "")
        if server is not None or opts.cloud not in ("none", "local"):
            connect = lambda: CloudLink(url, key, timeout_s=opts.cloud_timeout_s)  # noqa: E731
        gen = RoutedGenerator(
            edge,
            router,
            policy,
            sampling,
            connect=connect,
            sync_every=opts.sync_every,
            n_ctx=opts.n_ctx,
            threads=opts.threads,
            lookahead=opts.lookahead,
            lookahead_nats=opts.lookahead_nats,
            lookahead_wait_s=opts.lookahead_wait_s,
            check=opts.check,
            check_nats=opts.check_nats,
            check_max_draft=opts.check_max_draft,
        )
        try:
            yield gen
        finally:
            gen.close()
    finally:
        if server is not None:
            server.stop()
        edge.close()
