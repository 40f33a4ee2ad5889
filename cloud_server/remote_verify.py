"""The remote engine's verify: drafts judged from the top log-probabilities a completions server returns.

Why apart from the engine (cloud_server/remote_engine.py, whose docstring says when each
strategy is used and how exact its verdicts are): the two strategies, one request over the
history and the drafts (prompt-logprobs, echo) or the engine's own streamed continuation
(generate), share only the rule that judges a draft: shared/decision.py's `judge_draft` on a
logits-like view of its position (`Position.view`: the listed tokens, every other one
infinitely unlikely).
"""

from __future__ import annotations

from cloud_server.engine_api import VerifyResult
from cloud_server.remote_requests import RemoteRequests, RemoteSession
from shared.completions import Position
from shared.decision import TIE_NATS, cloud_choice, judge_draft
from shared.llama_backend import LlamaModel
from shared.protocol import NEXT_TOP, SamplingParams


class RemoteVerifier:
    """Judges a session's drafts through `requests`, by the strategy the probe found (`mode`)."""

    def __init__(self, model: LlamaModel, requests: RemoteRequests) -> None:
        self.model = model
        self.requests = requests

    def verify(
        self, mode: str, s: RemoteSession, tokens: list[int], exact: set[int], bonus: bool, tolerance: float
    ) -> VerifyResult:
        """The verdict on `tokens` after the history (the history is not changed here)."""
        if mode == "generate":
            return self._by_continuation(s, tokens, exact, bonus, tolerance)
        return self._in_one_pass(mode, s, tokens, exact, bonus, tolerance)

    def _judge(self, s: RemoteSession, pos: Position, draft: int, exact: bool, tolerance: float) -> int:
        """shared/decision.py's verdict on `draft` at `pos` (-1: it stands); where nothing was listed,
        only the engine's own token stands."""
        if not pos.listed:
            return -1 if draft == pos.token or pos.token < 0 else pos.token
        return judge_draft(pos.view(self.model.n_vocab), draft, exact, tolerance, s.sampler, TIE_NATS)

    def _bonus(self, s: RemoteSession, pos: Position, at: int) -> VerifyResult:
        """The cloud's own token after `at` drafts that all stand."""
        token = cloud_choice(pos.view(self.model.n_vocab), s.sampler) if pos.listed else pos.token
        if token < 0:
            return VerifyResult(accepted=at)
        return VerifyResult(accepted=at, token=token, logprob=pos.logprob_of(token))

    def _in_one_pass(
        self, mode: str, s: RemoteSession, tokens: list[int], exact: set[int], bonus: bool, tolerance: float
    ) -> VerifyResult:
        """prompt-logprobs or echo: every draft's log-probability and top list from one request."""
        prompt = s.history + tokens
        positions = self.requests.request(
            s,
            prompt,
            1,
            SamplingParams(),
            NEXT_TOP,
            "verify_tokens",
            echo=mode == "echo",
            prompt_logprobs=mode == "prompt-logprobs",
            n_scored=len(tokens),
        )
        for i, draft in enumerate(tokens):
            if i not in exact and tolerance <= 0:
                continue  # unchecked: it stands unread
            token = self._judge(s, positions[i], draft, i in exact, tolerance)
            if token >= 0:
                return VerifyResult(accepted=i, token=token, logprob=positions[i].logprob_of(token))
        if bonus and len(positions) > len(tokens):
            return self._bonus(s, positions[len(tokens)], len(tokens))
        return VerifyResult(accepted=len(tokens))

    def _by_continuation(
        self, s: RemoteSession, tokens: list[int], exact: set[int], bonus: bool, tolerance: float
    ) -> VerifyResult:
        """generate: the engine's greedy continuation, streamed, with its top lists; each draft is
        judged where the context is the drafts' own, and the stream is closed (the engine stops)
        at the first draft off the engine's path (see the module docstring)."""
        start = 0  # drafts before this one are judged and stand: the next request's context
        while True:
            n = len(tokens) - start + int(bonus)
            if n <= 0:
                return VerifyResult(accepted=len(tokens))
            prompt = s.history + tokens[:start]
            steps = self.requests.stream(s, prompt, n)
            try:
                restart = False
                for k, pos in enumerate(steps):
                    i = start + k
                    if i == len(tokens):
                        return self._bonus(s, pos, i)
                    draft = tokens[i]
                    if i in exact or tolerance > 0:
                        token = self._judge(s, pos, draft, i in exact, tolerance)
                        if token >= 0:
                            return VerifyResult(accepted=i, token=token, logprob=pos.logprob_of(token))
                    if draft != pos.token:  # it stands, off the engine's path: continue from it
                        start, restart = i + 1, True
                        break
                    if self.model.is_eog(pos.token):
                        break
                if not restart:
                    return VerifyResult(accepted=len(tokens))
            finally:
                steps.close()
