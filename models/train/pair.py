"""The edge and cloud models stepped together over many sequences in one batch per step.

Labelling and evaluation both need, at every position of many answers, the
edge's logits and hidden state and the cloud's logits for the same history,
then one chosen token appended to both. Doing this for all sequences in one
llama.cpp batch per model per step costs less per token than one sequence at
a time (one pass over the weights serves the whole batch) and far fewer
Python round trips.

Sequences share one unified KV pool; a prompt is prefilled once and copied to
sibling sequences with llama_memory_seq_cp (no cells are duplicated).
"""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp as lc
import numpy as np

from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel


@dataclass(slots=True)
class StepView:
    """Outputs for one sequence at the current step (views valid until the next step)."""

    seq: int
    edge_logits: np.ndarray
    edge_hidden: np.ndarray
    cloud_logits: np.ndarray


def log_softmax_row(logits: np.ndarray) -> tuple[float, float]:
    """(max, log-sum-exp) of a logit row, so log p(t) = logits[t] - lse."""
    m = float(logits.max())
    lse = m + float(np.log(np.exp(logits - m).sum()))
    return m, lse


class PairStepper:
    """Both models over `n_seq` sequences; each sequence holds prompt + accepted tokens."""

    def __init__(
        self,
        edge: LlamaModel,
        cloud: LlamaModel,
        n_seq: int,
        n_ctx: int = 8192,
        threads: int | None = None,
        extra_cloud_seqs: int = 0,
    ) -> None:
        self.edge, self.cloud = edge, cloud
        self.n_seq = n_seq
        self.ectx = LlamaContext(edge, n_ctx=n_ctx, n_seq=n_seq, threads=threads, embeddings=True)
        self.cctx = LlamaContext(cloud, n_ctx=n_ctx, n_seq=n_seq + extra_cloud_seqs, threads=threads, embeddings=False)
        self.length: dict[int, int] = {}
        self._out: dict[int, int] = {}

    def start(self, groups: list[tuple[list[int], list[int]]]) -> None:
        """groups: (prompt tokens, sequences that start from it). Clears and prefills all of them."""
        for ctx in (self.ectx, self.cctx):
            for s in range(ctx.n_seq):
                ctx.clear(s)
        self.length.clear()
        self._out.clear()
        heads = [(prompt, seqs[0]) for prompt, seqs in groups]
        for ctx in (self.ectx, self.cctx):
            # prefill all but the last token of each prompt once, copy it to the siblings, then
            # decode every sequence's last prompt token so each has its own output row
            body = [DecodeItem(seq, 0, prompt[:-1]) for prompt, seq in heads if len(prompt) > 1]
            for start in range(0, len(body), 8):
                ctx.decode(body[start : start + 8])
            for prompt, seqs in groups:
                for s in seqs[1:]:
                    lc.llama_memory_seq_cp(ctx.mem, seqs[0], s, 0, len(prompt) - 1)
        lasts = [(s, len(prompt) - 1, prompt[-1]) for prompt, seqs in groups for s in seqs]
        self._step_rows(lasts)
        for prompt, seqs in groups:
            for s in seqs:
                self.length[s] = len(prompt)

    def views(self) -> list[StepView]:
        return [
            StepView(s, self.ectx.logits(i), self.ectx.hidden(i), self.cctx.logits(i)) for s, i in self._out.items()
        ]

    def advance(self, tokens: dict[int, int]) -> None:
        """Append one token to each given sequence (others are finished and dropped from the batch)."""
        rows = [(s, self.length[s], t) for s, t in tokens.items()]
        for s in tokens:
            self.length[s] += 1
        self._step_rows(rows)

    def _step_rows(self, rows: list[tuple[int, int, int]]) -> None:
        self._out = {}
        if not rows:
            return
        if len(rows) > self.ectx.n_batch:
            raise ValueError(f"at most {self.ectx.n_batch} sequences per step")
        for ctx in (self.ectx, self.cctx):
            outs = ctx.decode([DecodeItem(s, p, [t]) for s, p, t in rows])
        self._out = {s: i for (s, _, _), i in zip(rows, outs)}

    def fork(self, src: int, dst: int) -> None:
        """Make sequence `dst` a copy of `src` (shared KV cells, no compute), to diverge from here."""
        for ctx in (self.ectx, self.cctx):
            ctx.clear(dst)
            lc.llama_memory_seq_cp(ctx.mem, src, dst, 0, self.length[src])
        self.length[dst] = self.length[src]

    def release(self, seq: int) -> None:
        for ctx in (self.ectx, self.cctx):
            ctx.clear(seq)
        self.length.pop(seq, None)

    def cloud_rollouts(self, starts: list[tuple[int, int, int]], n_tokens: int, first_seq: int) -> list[list[int]]:
        """Greedy cloud continuations: for each (source seq, position, token), copy the source's
        first `position` cells, append `token`, and let the cloud write `n_tokens` more (stops at EOG).
        Uses cloud sequences first_seq, first_seq+1, ... (must exist: see extra_cloud_seqs)."""
        ctx = self.cctx
        seqs = list(range(first_seq, first_seq + len(starts)))
        if seqs and seqs[-1] >= ctx.n_seq:
            raise ValueError(
                f"{len(starts)} rollouts need cloud sequences up to {seqs[-1]}; the context has {ctx.n_seq}"
            )
        for s, (src, pos, _) in zip(seqs, starts):
            ctx.clear(s)
            lc.llama_memory_seq_cp(ctx.mem, src, s, 0, pos)
        out: list[list[int]] = [[] for _ in starts]
        rows = [(s, pos, tok) for s, (_, pos, tok) in zip(seqs, starts)]
        for _ in range(n_tokens):
            if not rows:
                break
            idx = ctx.decode([DecodeItem(s, p, [t]) for s, p, t in rows])
            nxt = []
            for (s, p, _), i in zip(rows, idx):
                tok = int(np.argmax(ctx.logits(i)))
                out[s - first_seq].append(tok)
                if not self.cloud.is_eog(tok):
                    nxt.append((s, p + 1, tok))
            rows = nxt
        for s in seqs:
            ctx.clear(s)
        return out

    def close(self) -> None:
        self.ectx.close()
        self.cctx.close()
