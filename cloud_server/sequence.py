"""One session of the embedded engine: its token history, its sampler, and the logits a prefill kept.

A prefill (the background work after a `sync`) decodes the whole history and keeps a copy of the
next position's logits (`SeqState.ready`). A hard-token request that brings no new tokens, the
common case once the device syncs eagerly, then samples from that copy without a decode: the
device waits for a round trip, not for the model. Any other change of the history (new tokens, a
rollback, a verify) drops the copy.

Who writes a token is decided by shared/decision.py: `write` writes `cloud_choice` (a proposed
token within TIE_NATS of the best stands under greedy decoding, since llama.cpp's batched and
one-token kernels differ bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cloud_server.fair_share import Usage
from cloud_server.kv_pool import Residency
from shared.decision import cloud_choice
from shared.protocol import Work
from shared.sampling import Sampler, log_softmax_at


@dataclass(slots=True)
class SeqState:
    """One session: its token history (the truth), its sampler, and where its KV lives (`kv`)."""

    kv: Residency
    history: list[int]
    sampler: Sampler
    compute_s: float = 0.0
    ready: np.ndarray | None = None  # next position's logits kept by a prefill; valid while ready_len == len(history)
    ready_len: int = -1
    guess: int = -1  # the token announced for the next position (a `next` message), written if asked there
    guess_logprob: float = 0.0
    work: Work = field(default_factory=Work)  # passes and tokens since the session last took them (take_work)
    use: Usage = field(default_factory=Usage)  # its owner's account at the engine (shared by its sessions)

    def charge(self, seconds: float) -> None:
        """`seconds` of engine time used by this session, charged to its owner."""
        self.use.spend(seconds)

    def count_pass(self, kind: str, n_tokens: int) -> None:
        """One forward pass that processed `n_tokens` of this session's tokens for `kind` (a Work field)."""
        if n_tokens > 0:
            self.work.passes += 1
            setattr(self.work, kind, getattr(self.work, kind) + n_tokens)

    @property
    def has_ready(self) -> bool:
        """Kept next-position logits exist and still describe the history."""
        return self.ready is not None and self.ready_len == len(self.history)

    def take_ready(self) -> np.ndarray | None:
        """The kept next-position logits if they still describe the history (then forgotten)."""
        logits = self.ready if self.has_ready else None
        if logits is None:
            self.guess = -1
        self.ready, self.ready_len = None, -1
        return logits

    def keep_ready(self, logits: np.ndarray) -> None:
        self.ready = logits.copy()
        self.ready_len = len(self.history)
        self.guess = -1

    def drop_ready(self) -> None:
        self.ready, self.ready_len, self.guess = None, -1, -1

    def write(self, logits: np.ndarray, proposed: int) -> tuple[int, float]:
        """Append the cloud's choice where the device proposed `proposed` (the tie rule)."""
        if not 0 <= proposed < logits.shape[0]:
            proposed = -1
        token = cloud_choice(logits, self.sampler, proposed)
        logprob = log_softmax_at(logits, token)
        self.history.append(token)
        return token, logprob

    def write_ready(self, logits: np.ndarray, proposed: int) -> tuple[int, float]:
        """Write the next token from kept logits: the announced guess if there is one (it was promised)."""
        if self.guess < 0:
            return self.write(logits, proposed)
        token, logprob, self.guess = self.guess, self.guess_logprob, -1
        self.history.append(token)
        return token, logprob
