"""Token-routed generation: the answer loop that decides who writes each token.

For each position the device model proposes a token and the router scores
it; shared/decision.py says who writes it (the one copy of the rule), and a
strategy (edge_client/strategies.py) carries that out over the network:
easy positions keep the device's token, hard ones are written by the cloud,
the cloud's lookahead guess decides the position after a hard token, and
with the cloud's check the device drafts each clause for one `verify`.
The cloud session's life (connect, resync, reconnect, loss, traffic) is kept
by edge_client/cloud_session.py. If the cloud is lost, unreachable or full
(`reject busy`), the answer continues on the device and is marked degraded,
with the reason (`Answer.degraded_reason`); the next answer tries to reconnect.
The device asks only for what the server's engine can do (its accept lists
it, protocol v2): without `verify` the check falls back to the per-token
phase, without `guess` lookahead is off (`negotiated`); the answer says which
mode it used (`cloud_mode`). Where the cloud's model tokenizes differently (or
`text_mode` is "always") the session shares the answer as text (protocol v3):
the same strategies carry it out through the text history (edge_client/
shared_history.py: hard positions get the cloud's text span, the check judges
each clause's text), and the answer says so (`shared_history`: "text").

    with open_generator(GeneratorOptions(cloud="local")) as gen:
        answer = gen.generate([{"role": "user", "content": "Hi"}], on_token=print)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from edge_client.answer import Answer, TokenEvent, Traffic
from edge_client.cloud_link import CloudLink
from edge_client.cloud_session import CloudSession
from edge_client.decoder import EdgeDecoder
from edge_client.local_cloud import loopback_cloud, tier_clouds
from edge_client.message_end import MessageEnd, user_message_start
from edge_client.options import GeneratorOptions
from edge_client.prefetch import TierForecast
from edge_client.strategies import ClauseCheck, CloudStream, DeviceOnly, DraftVerify, PerToken, Span, Strategy
from edge_client.turn import Turn
from edge_client.writer import AnswerWriter
from models.registry import ROUTERS_DIR, model_info
from shared.decision import AnswerRule, ClauseEnds, NumberWatch, OverruledShare, RuleOptions
from shared.decision_engine import DecisionEngine, EngineSetup, build_engine
from shared.learned_router import load_router
from shared.llama_backend import LlamaModel
from shared.model_info import ALLOW_BASE_MODEL_HINT, BASE_MODEL_NOTE, ModelInfo
from shared.policy import RoutingPolicy
from shared.protocol import CAP_GUESS, CAP_VERIFY, Work
from shared.router import HeuristicRouter, Router
from shared.sampling import Sampler
from shared.text_history import AnswerText

PER_TOKEN_STRATEGIES: dict[str, Strategy] = {
    "per-token": PerToken(),
    "span": Span(),
    "verify": DraftVerify(check_all=False),
    "speculative": DraftVerify(check_all=True),
}


class RoutedGenerator:
    """One device's routed generation: a decoder, a router and policy, a cloud session."""

    def __init__(
        self,
        edge: LlamaModel,
        opts: GeneratorOptions,
        connect: Callable[[], CloudLink] | None = None,
        router: Router | None = None,
        policy: RoutingPolicy | None = None,
        tier_connects: Sequence[Callable[[], CloudLink]] = (),
    ) -> None:
        """`router` and `policy` default to the ones `opts` names; `connect` opens a link to the
        cloud (None: device only); `tier_connects` to each tier above it (a pool of models)."""
        opts.validate()
        if not edge.info.chat and not opts.allow_base_model:  # a .gguf path the registry does not mark
            raise ValueError(
                f"the device model {edge.info.name} is a base model: {BASE_MODEL_NOTE}; {ALLOW_BASE_MODEL_HINT}"
            )
        self.edge = edge
        self.opts = opts
        self.router = router or build_router(
            opts.router, edge.n_vocab, edge.info, opts.router_on_mismatch, opts.cloud_model
        )
        self.policy = policy or RoutingPolicy(opts.policy_config(), prior=self.router.threshold_for)
        self.decoder = EdgeDecoder(edge, n_ctx=opts.n_ctx, threads=opts.threads)
        self.answer_text = AnswerText.for_model(edge)  # text mode: the answer as this model tokenizes it
        self.cloud, *self.tiers = (
            CloudSession(
                c,
                edge.info,
                opts.sampling(),
                text_mode=opts.text_mode,
                reconnects=opts.reconnects,
                reconnect_wait_s=opts.reconnect_wait_s,
                answer_text=self.answer_text,
                allow_base_model=opts.allow_base_model,
            )
            for c in (connect, *(tier_connects if connect is not None else ()))
        )
        self.tier_routers = self._tier_routers(opts) if self.tiers else []
        n_tiers = 2 + len(self.tiers)
        self.forecast = (
            TierForecast(n_tiers, opts.prefetch_window) if self.tiers and opts.prefetch == "forecast" else None
        )
        self.engine = self._engine(opts, self.policy)  # for this pool's tiers (above)
        self.exploration = opts.exploration()  # kept across answers: its budget is per minute
        self.rule = AnswerRule(opts.rule(), ClauseEnds(edge.token_bytes, edge.is_eog), NumberWatch(edge.token_bytes))
        self.overruled = OverruledShare()  # running share of tokens the check overruled (the router targets the rest)
        self._per_token = PER_TOKEN_STRATEGIES[opts.strategy]
        self.message_end = MessageEnd(edge)
        self._ends: dict[tuple[int, ...], float] = {}  # P(end of message) by prompt up to the last word
        self._lock = threading.Lock()

    def reconfigure(self, **changes: object) -> None:
        """Change options for the next answer (e.g. check="all", cloud_fraction=0.3); refused, naming the
        option, when the result is not valid. Waits for an answer in progress to finish. The router and
        cloud session stay; the policy is rebuilt (from the router's prior, as at start-up) when its own
        settings change, since a policy calibrates its threshold to one cloud fraction."""
        opts = replace(self.opts, **changes)  # type: ignore[arg-type]
        opts.validate()
        policy = None
        if opts.policy_config() != self.opts.policy_config():
            policy = RoutingPolicy(opts.policy_config(), prior=self.router.threshold_for)
        engine = None
        if policy is not None or opts.decision_engine != self.opts.decision_engine:
            engine = self._engine(opts, policy or self.policy)  # an engine may wrap the policy: built with it
        with self._lock:
            if policy is not None:
                self.policy = policy
            if engine is not None:
                self.engine = engine
            if (opts.explore, opts.explore_per_minute) != (self.opts.explore, self.opts.explore_per_minute):
                self.exploration = opts.exploration()
            self.opts = opts
            for session in (self.cloud, *self.tiers):
                session.reconnects, session.reconnect_wait_s = opts.reconnects, opts.reconnect_wait_s
                session.allow_base_model = opts.allow_base_model
            self.rule = AnswerRule(opts.rule(), self.rule.clause_ends, self.rule.numbers)
            self._per_token = PER_TOKEN_STRATEGIES[opts.strategy]

    def reconnect_next(self) -> None:
        """Drop the cloud link after the answer in progress (if any): the next answer connects anew,
        through `connect`, e.g. to a cloud URL or key the person just changed."""
        with self._lock:
            self.cloud.retire()
            self.cloud.last_error = ""  # an error of the old target says nothing about the new one

    def _tier_routers(self, opts: GeneratorOptions) -> list[Router | None]:
        """Per tier, the router that predicts its gain (`tier_routers`); a URL's model is not known here."""
        local = [t[len("local:") :] if t.startswith("local:") else "" for t in opts.tiers]
        return tier_routers(self.edge, [opts.cloud_model, *local])

    def _engine(self, opts: GeneratorOptions, policy: RoutingPolicy) -> DecisionEngine:
        """The decision engine the options name, built around `policy`, for this pool's tiers."""
        setup = EngineSetup(policy, {}, self.edge.info.name, opts.cloud_model, tiers=2 + len(self.tiers))
        return build_engine(opts.decision_engine, setup)

    @property
    def link(self) -> CloudLink | None:
        return self.cloud.link

    @property
    def cloud_configured(self) -> bool:
        """A cloud exists for this device at all: the generator was given a way to connect (not `--cloud none`)."""
        return self.cloud.configured

    @property
    def last_cloud_error(self) -> str:
        return self.cloud.last_error

    # ---------------------------------------------------------------- public API

    def count_tokens(self, messages: list[dict]) -> int:
        return len(self.edge.chat_tokens(messages))

    def generate(
        self,
        messages: list[dict],
        max_tokens: int | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
        stop: threading.Event | None = None,
        mode: str | None = None,
    ) -> Answer:
        """Answer the chat `messages`; blocking. Set `stop` to interrupt (barge-in).

        `mode` overrides the policy for this answer only ("edge" or "cloud": replay's
        per-query and per-session choices)."""
        with self._lock:
            return self._generate(
                messages, self.opts.max_tokens if max_tokens is None else max_tokens, on_token, stop, mode
            )

    def prompt_score(self, messages: list[dict]) -> float:
        """The router's score at the first answer position (replay's per-query choice)."""
        with self._lock:
            self.decoder.set_history(self.edge.chat_tokens(messages))
            logits, hidden = self.decoder.next_distribution()
            return self.router.score(hidden, logits, int(logits.argmax()))

    def prefill(self, messages: list[dict], complete: bool = False) -> int:
        """Decode the start of a prompt ahead of time; returns how many tokens it decoded now.

        The voice pipeline calls this with each partial transcript while the
        person is still speaking, so that when the turn starts only what the
        final transcript changed remains to decode. With `complete` (the
        pipeline's default) the whole prompt is decoded, template tail
        included, and the logits of its last position are kept: if the final
        transcript equals the guess, `generate` starts sampling at once; the
        same batch also reads `end_of_message` for this transcript.
        Without it the last user word is left out (it may still change or
        tokenize differently once more text follows). When the cloud is
        connected the same tokens are sent to it (not awaited) so it prefills
        in parallel. Skipped (returns 0) while an answer is being generated.
        `generate` later keeps whatever prefix both prompts share.
        """
        if complete:
            tokens, at = self.message_end.locate(messages)
        else:
            text, end = user_message_start(self.edge, messages, add_generation_prompt=False)
            user = messages[-1]["content"].rstrip()
            if end is None or not user:
                return 0
            cut = end + len(user.rsplit(None, 1)[0]) if len(user.split()) > 1 else end
            tokens, at = self.edge.prompt_tokens(text[:cut]), None
        if not self._lock.acquire(blocking=False):
            return 0  # an answer is being generated: it owns the caches
        try:
            return self._prefill(tokens, at)
        finally:
            self._lock.release()

    def end_of_message(self, messages: list[dict], wait_s: float = 0.2) -> float | None:
        """P(the person's message ends after its last word), as the device model reads the prompt
        (edge_client/message_end.py): the voice pipeline's text end-of-turn signal. Computed by the
        prefill of this prompt (so the answer then starts from the cache, nothing decoded twice) or
        remembered from it. None when there is no word to read after, or an answer in progress held
        the model past `wait_s`."""
        tokens, at = self.message_end.locate(messages)
        if at is None:
            return None
        key = tuple(tokens[: at + 1])
        if key not in self._ends:
            if not self._lock.acquire(timeout=wait_s):
                return None
            try:
                self._prefill(tokens, at)
            finally:
                self._lock.release()
        return self._ends.get(key)

    def _prefill(self, tokens: list[int], at: int | None) -> int:
        """Make `tokens` the history and decode it; with `at`, remember P(end of message) read there.
        Call with the lock held."""
        keep = self.decoder.set_history(tokens)
        key = tuple(tokens[: at + 1]) if at is not None else None
        if key is not None and key not in self._ends:
            self._ends[key] = self.message_end.probability(self.decoder.decode_reading(at))
            while len(self._ends) > 16:
                del self._ends[next(iter(self._ends))]
        elif keep < len(tokens):
            self.decoder.next_distribution()
        if self.policy.mode != "edge":
            self.cloud.resync(tokens)
        return len(tokens) - keep

    def close(self) -> None:
        for session in (self.cloud, *self.tiers):
            session.close()
        self.decoder.close()

    # ---------------------------------------------------------------- the loop

    def _generate(
        self,
        messages: list[dict],
        max_tokens: int,
        on_token: Callable[[TokenEvent], None] | None,
        stop: threading.Event | None,
        mode: str | None,
    ) -> Answer:
        t_start = time.perf_counter()
        mode = mode or self.policy.mode
        prompt = self.edge.chat_tokens(messages)
        self.decoder.set_history(prompt)
        self.policy.start_answer()
        self.engine.start_answer()
        if self.forecast is not None:
            self.forecast.start_answer()
        self.rule.start_answer()
        cloud = self.cloud
        use_cloud = mode != "edge" and cloud.configured
        degraded = use_cloud and not cloud.start_answer(messages, prompt, lambda: self.decoder.history)
        caps = cloud.capabilities if use_cloud else None
        rule_options, strategy = negotiated(self.opts.rule(), self.opts.strategy, caps)
        if rule_options != self.rule.options:  # this server cannot do all that was asked (or now can again)
            self.rule = AnswerRule(rule_options, self.rule.clause_ends, self.rule.numbers)
        self._per_token = PER_TOKEN_STRATEGIES[strategy]
        answer = Answer(
            policy=self.policy.name,
            decision_engine=self.engine.name,
            degraded=degraded,
            edge_model=self.edge.info.fingerprint,
            cloud_model=cloud.cloud_model if use_cloud else "",
            cloud_capabilities=caps,
            cloud_mode=cloud_mode(mode, use_cloud, rule_options, strategy),
            cloud_mode_asked=cloud_mode(mode, use_cloud, self.opts.rule(), self.opts.strategy),
            shared_history=cloud.shared_history if use_cloud else "",
        )
        sessions = [cloud, *self.tiers] if use_cloud else [cloud]
        before = _CloudCounters.read(sessions)
        turn = Turn(
            model=self.edge,
            decoder=self.decoder,
            router=self.router,
            policy=self.policy,
            engine=self.engine,
            exploration=self.exploration,
            rule=self.rule,
            cloud=cloud,
            sampler=Sampler(self.opts.sampling()),
            opts=self.opts,
            out=AnswerWriter(self.edge, answer, len(prompt), on_token, t_start),
            clause_ends=self.rule.clause_ends,
            overruled=self.overruled,
            max_tokens=max_tokens,
            stop=stop,
            text=self.answer_text,
            prompt_len=len(prompt),
            tiers=self.tiers if use_cloud else [],
            tier_routers=self.tier_routers if use_cloud else [],
            forecast=self.forecast if use_cloud else None,
            messages=messages,
        )
        while not turn.finished():
            self._strategy(turn, mode, use_cloud).run(turn)
        turn.out.finish(turn.stopped(), turn.router_ms)
        if turn.looped and not answer.interrupted:
            answer.finish_reason = "loop"  # ended where it began to say a run again (shared/decision.py, "Loops")
        self._complete_answer(answer, turn, sessions, before, use_cloud)
        return answer

    def _complete_answer(
        self, answer: Answer, turn: Turn, sessions: list[CloudSession], before: _CloudCounters, use_cloud: bool
    ) -> None:
        """Once the answer is written: what the cloud sessions cost it (counters since `before`), whether
        it was degraded, which tier wrote each token, the router's drift and the base-model warnings."""
        cloud = sessions[0]
        answer.cloud_timeouts = sum(s.timeouts for s in sessions) - before.timeouts
        answer.explore_declined = cloud.explore_declined - before.explore_declined
        answer.degraded = answer.degraded or (use_cloud and not cloud.up)
        answer.degraded_reason = (cloud.last_error or "the cloud was lost") if answer.degraded else ""
        spent = [s.traffic() - t0 for s, t0 in zip(sessions, before.traffic)]
        answer.traffic = sum(spent, Traffic())
        answer.tier_work = [Work(), *(t.work for t in spent)] if use_cloud else []
        answer.lost_tiers = turn.lost_tiers()
        answer.tiers = [0 if r == "edge" else 1 for r in answer.routes]
        for start, end, tier in turn.tier_writes:
            answer.tiers[start:end] = [tier] * (end - start)
        answer.drift = self.router.drift_report()  # learned routers: score distribution vs training (PSI)
        answer.warnings = base_model_warnings(
            self.edge.info, bool(answer.cloud_model) and any(s.cloud_base_model for s in sessions)
        )

    def _strategy(self, turn: Turn, mode: str, use_cloud: bool) -> Strategy:
        """The strategy for the next clause (or position)."""
        if mode == "edge" and self.policy.mode != "edge":
            return _DEVICE_ONLY  # a per-answer choice of the device: no router
        if not use_cloud or not turn.cloud.up:
            return self._per_token  # policy edge, or a lost cloud: the device finishes (fallbacks logged)
        if mode == "cloud":
            return _STREAM
        if turn.rule.checking:
            return _CHECK
        if (
            turn.cloud.shared_history == "text"
        ):  # replay's span and verify strategies share tokens only (docs/protocol.md)
            return PER_TOKEN_STRATEGIES["per-token"]
        return self._per_token


@dataclass(slots=True, frozen=True)
class _CloudCounters:
    """The cloud sessions' running counters at the start of an answer, so the answer reports its own share."""

    traffic: list[Traffic]
    timeouts: int
    explore_declined: int

    @classmethod
    def read(cls, sessions: list[CloudSession]) -> _CloudCounters:
        """`sessions`: the cloud's first, then the tiers above it."""
        return cls([s.traffic() for s in sessions], sum(s.timeouts for s in sessions), sessions[0].explore_declined)


_DEVICE_ONLY = DeviceOnly()
_STREAM = CloudStream()
_CHECK = ClauseCheck()


def base_model_warnings(edge: ModelInfo, cloud_is_base: bool) -> list[str]:
    """What a person should know when a base model (no chat template) writes any of an answer:
    shown by the CLI, the voice commands and the app (the registry marks such models)."""
    notes = []
    if not edge.chat:
        notes.append(f"the device model {edge.name} is a base model: {BASE_MODEL_NOTE}")
    if cloud_is_base:
        notes.append(f"the cloud's model is a base model: {BASE_MODEL_NOTE}")
    return notes


def negotiated(rule: RuleOptions, strategy: str, caps: list[str] | None) -> tuple[RuleOptions, str]:
    """The rule and per-token strategy this server's engine supports: the next best mode where it
    cannot do what was asked (check -> per-token with guess -> per-token). `caps` None: no cloud
    connected now (the options stand; a lost cloud falls back on its own)."""
    if caps is None:
        return rule, strategy
    if CAP_VERIFY not in caps:
        rule = replace(rule, check="off")
        if strategy in ("verify", "speculative"):  # draft-then-check strategies need verify too
            strategy = "per-token"
    if CAP_GUESS not in caps:
        rule = replace(rule, lookahead=False)
    return rule, strategy


def cloud_mode(mode: str, use_cloud: bool, rule: RuleOptions, strategy: str) -> str:
    """How the cloud is asked, in words for `--json` and the summary: "none", "stream", or the
    per-token strategy with "+guess" (lookahead) and "+check" (the check after the first clause);
    "check" alone with `--check all`."""
    if not use_cloud:
        return "none"
    if mode == "cloud":
        return "stream"
    if rule.check == "all":
        return "check"
    return strategy + ("+guess" if rule.lookahead else "") + ("+check" if rule.check != "off" else "")


def shipped_router(edge_model: str, cloud_model: str, judge: str | None = None) -> Path | None:
    """The trained router shipped for this (device, cloud) model pair, if there is one; with `judge`,
    the one whose labels that model judged (a pool's tier: `tier_routers`, `label --judge`)."""
    name = f"{edge_model}__{cloud_model}" + (f"__judged-by__{judge}" if judge else "")
    path = ROUTERS_DIR / f"{name}.npz"
    return path if path.is_file() else None


def tier_routers(edge: LlamaModel, models: list[str]) -> list[Router | None]:
    """Per tier (index = tier; 0, the device, None), the learned router that predicts the gain of
    asking that tier's model (`models`, lowest cloud tier first; "" where not known), for engines
    such as `cost`; [] when no tier has one (every tier reads the pair's score).

    Gains must be in one unit to be compared, so each tier reads the router for the device and its
    model judged by the top tier's model (`tokenrouter-train label --judge`, fitted on the signed
    `gain` label), where one ships; else a tier above the first reads its own pair's router, and
    tier 1 the pair's score (None)."""
    top = models[-1]
    routers: list[Router | None] = [None]
    for tier, model in enumerate(models, start=1):
        path = shipped_router(edge.info.name, model, judge=top) if model and top else None
        if path is None and model and tier >= 2:
            path = shipped_router(edge.info.name, model)
        routers.append(None if path is None else build_router(str(path), edge.n_vocab, edge.info, "error", model))
    return routers if any(r is not None for r in routers) else []


def build_router(
    spec: str, n_vocab: int, edge_info: ModelInfo | None = None, on_mismatch: str = "error", cloud_model: str = ""
) -> Router:
    """ "auto" (the shipped learned router for the pair, else entropy), a heuristic kind
    ("entropy", "top1", "margin"), or a learned router file (checked against `edge_info`)."""
    if spec == "auto":
        path = shipped_router(edge_info.name, cloud_model) if edge_info is not None else None
        if path is None:
            return HeuristicRouter("entropy", n_vocab)
        spec, on_mismatch = str(path), "heuristic"
    if spec in HeuristicRouter.KINDS:
        return HeuristicRouter(spec, n_vocab)
    if spec.endswith(".npz") or os.path.isfile(spec):
        return load_router(spec, edge_info, on_mismatch=on_mismatch, n_vocab=n_vocab, cloud=cloud_model or None)
    raise ValueError(
        f"unknown router {spec!r}: use auto, one of {', '.join(HeuristicRouter.KINDS)} or a learned router file (.npz)"
    )


@contextlib.contextmanager
def open_generator(opts: GeneratorOptions) -> Iterator[RoutedGenerator]:
    """Load the device model, start or reach the cloud, and yield a ready generator."""
    opts.validate()
    edge = LlamaModel(model_info(opts.edge_model))
    try:
        with loopback_cloud(opts) as connect, tier_clouds(opts) as tier_connects:
            gen = RoutedGenerator(edge, opts, connect, tier_connects=tier_connects)
            try:
                yield gen
            finally:
                gen.close()
    finally:
        edge.close()
