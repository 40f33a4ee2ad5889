"""Labels for a mixed pair (different tokenizers): the cloud model's NLL of the TEXT.

The one module for the text label rule; `tokenrouter-train label` (label.py) calls it when the
device's and the cloud's tokenizers differ, and writes the same shard columns as for a
same-vocabulary pair, so `fit` runs unchanged.

The path is the cloud's, as in label.py: the cloud writes the reference answer greedily (its own
tokens after its own prompt), the answer is shared as text (shared/text_history.py), and the
device reads that text as its own canonical tokens (`AnswerText.tokens`, teacher forcing) after
its own prompt: what the device holds in text mode. At each device position j, with T the answer
text before it, we record exactly what the same-vocab labels record on the device side (hidden
state, LOGIT_FEATURES, proposed greedy token e) and, in the cloud's terms on text:

    cloud_token  c, the device's token of the cloud's text at j (the device's end-of-answer token
                 where the cloud's answer ends there)
    mismatch     e != c
    regret       the gain if the cloud wrote this position, in nats (0 where e == c):
                 with b_e, b_c the two tokens' bytes and NLL(b | T) the cloud's NLL of the extra
                 bytes b after T (both texts tokenized canonically by the cloud, the difference of
                 their summed NLLs: "score the extra bytes", the exact string-level rule)
                     regret = NLL(b_e | T) - NLL(b_c | T) * |b_e| / |b_c|
                 i.e. |b_e| times the excess cloud NLL per byte of the device's bytes over the
                 cloud's own continuation. The eval's measure is the cloud's NLL per byte of the
                 answer, so this is what the device's token adds to that sum over what the
                 cloud's own text of the same length would. Where exactly one of the two ends the
                 answer, the end's NLL is -log P_cloud(end-of-generation | T) and the two NLLs are
                 compared unscaled (a token vs the end, as label.py compares a token with EOG).
                 For a base model (no chat template) ending also means starting the person's
                 next line: P(end | T) = P(EOG | T) + P("\\nUser:" | T) (shared/text_history.py,
                 "The end of a transcript turn"), and its reference answer is cut there.
                 The same-vocab rule, log p(c) - log p(e) for one shared token, is the special
                 case |b_e| = |b_c| with both one cloud token.
    divergent    -1 (not labelled: the divergence rollouts are not run in text mode; `fit
                 --label divergent` then falls back to mismatch, as for live rows)

Judged by the top tier (`label --judge`): a pool needs each tier's gain in one unit, so every
tier is labelled by the top model (the top tier itself by the plain rule above). The path and the measure stay the judge's (its
greedy answer, its NLL of the text), the compared token c is the tier's own greedy token where it
reads the device's tokens of that answer (the tier shares the device's vocabulary), and
regret is the same rule with b_c the tier's bytes. Without `--judge` the judge is the cloud itself.

Bytes that are not whole UTF-8 characters (a byte-fallback token) are read by the cloud with the
replacement character, so a broken character costs what an unexpected symbol costs.

Cost: one greedy cloud answer, one teacher-forced device pass and one cloud pass per prompt, plus
short cloud branches (1-3 tokens each) where a text's canonical tokens leave the reference's,
batched over `n_branch` sequences that share the reference's KV cells.
"""

from __future__ import annotations

import math
from typing import Sequence

import llama_cpp as lc
import numpy as np

from shared.learned_router import LogitFeaturizer
from shared.llama_backend import DecodeItem, LlamaContext, LlamaModel
from shared.sequences import common_prefix
from shared.text_history import AnswerText, complete_utf8

LABEL_SPACE = "text"
LABEL_RULE = "regret = NLL_cloud(b_e|T) - NLL_cloud(b_c|T) * |b_e|/|b_c| (models/train/text_label.py)"
END = -1  # marks "the answer ends here" among texts


def text_regret(nll_e: float, len_e: int, e_end: bool, nll_c: float, len_c: int, c_end: bool) -> float:
    """The label rule (module docstring): the gain, in nats, if the cloud wrote this position.
    nll_*: the cloud's NLL of each side's bytes after the shared text (of the end, where *_end)."""
    if e_end and c_end:
        return 0.0
    if e_end or c_end:
        return nll_e - nll_c
    return nll_e - nll_c * len_e / max(len_c, 1)


def _log_softmax_at(logits: np.ndarray, tokens: Sequence[int]) -> tuple[float, np.ndarray]:
    """(log-sum-exp of the row, logits at `tokens`)."""
    row = logits.astype(np.float64)
    m = float(row.max())
    lse = m + math.log(float(np.exp(row - m).sum()))
    return lse, row[list(tokens)]


class TextScorer:
    """The cloud model's summed NLL of answer texts after its prompt, many texts at once.

    One teacher-forced pass over a reference text serves every text whose canonical tokens
    share its prefix; the rest (a short tail each) is decoded on branch sequences that share the
    reference's KV cells (llama_memory_seq_cp), `n_branch` per batch."""

    def __init__(self, model: LlamaModel, n_ctx: int = 2048, n_branch: int = 32, threads: int | None = 1) -> None:
        self.model = model
        self.view = AnswerText.for_model(model)
        self.n_branch = n_branch
        self.ctx = LlamaContext(model, n_ctx=n_ctx, n_seq=1 + n_branch, threads=threads, embeddings=False)
        self.eog = [t for t in range(model.n_vocab) if model.is_eog(t)]

    def tokens(self, text: bytes) -> list[int]:
        """The cloud's canonical tokens of answer `text` (AnswerText.tokens; a partial character
        reads as U+FFFD)."""
        if not text:
            return []
        return self.model.tokenize(
            (self.view.seam + text).decode("utf-8", "replace"), add_special=False, parse_special=False
        )

    def answer(self, prompt: list[int], max_tokens: int) -> tuple[bytes, bool]:
        """The cloud's greedy answer text (whole characters) and whether it ended."""
        self.ctx.clear(0)
        out: list[int] = []
        ended = False
        stop = self.view.stop
        for _, tok in self.ctx.greedy(prompt, max_tokens):
            if self.model.is_eog(tok):
                ended = True
                break
            out.append(tok)
            if stop and stop in self.view.text_of(out[-len(stop) - 1 :]):
                break  # (cut below)
        self.ctx.clear(0)
        text = self.view.text_of(out)
        at = text.find(stop) if stop else -1
        if at >= 0:  # a base model began the person's next line: the answer ends there (AnswerText.stop_cut)
            text, ended = text[:at], True
        return text[: complete_utf8(text)], ended

    def score(
        self, prompt: list[int], reference: bytes, texts: list[bytes], ends: list[bool]
    ) -> list[tuple[float, float]]:
        """For each text: (the cloud's summed NLL of it after `prompt`, its NLL of ending there,
        NaN unless `ends`). `reference` should be the text most of them are prefixes of."""
        ref = self.tokens(reference)
        P = len(prompt)
        stop = self.view.stop  # a base model ends by starting the next line: score that text too
        with_stop = [t + stop for t, end in zip(texts, ends) if end] if stop else []
        n_texts = len(texts)
        texts, ends = list(texts) + with_stop, list(ends) + [False] * len(with_stop)
        toks = [self.tokens(t) for t in texts]
        # what to read: per row key (the answer tokens before it), the tokens whose log p is wanted
        want: dict[tuple[int, ...], set[int]] = {}
        for x, end in zip(toks, ends):
            for i in range(len(x) + (1 if end else 0)):
                want.setdefault(tuple(x[:i]), set()).update(self.eog if i == len(x) else (x[i],))
        got: dict[tuple[int, ...], tuple[float, dict[int, float]]] = {}

        def read(key: tuple[int, ...], out: int) -> None:
            ids = sorted(want[key])
            lse, vals = _log_softmax_at(self.ctx.logits(out), ids)
            got[key] = (lse, dict(zip(ids, vals.tolist())))

        # the reference pass: rows after prompt + ref[:i], i = 0..len(ref)
        self.ctx.clear(0)
        rows = self.ctx.decode_outputs(DecodeItem(0, 0, prompt + ref), list(range(P - 1, P + len(ref))))
        for i, out in enumerate(rows):
            key = tuple(ref[:i])
            if key in want:
                read(key, out)
        # branches: every wanted row the reference pass does not have
        todo = [k for k in want if k not in got]
        for start in range(0, len(todo), self.n_branch):
            group = todo[start : start + self.n_branch]
            items = []
            for s, key in enumerate(group, start=1):
                k = min(common_prefix(ref, key), len(key) - 1)
                self.ctx.clear(s)
                lc.llama_memory_seq_cp(self.ctx.mem, 0, s, 0, P + k)
                items.append(DecodeItem(s, P + k, list(key[k:])))
            outs = self.ctx.decode(items)
            for key, out in zip(group, outs):
                read(key, out)
            for s in range(1, len(group) + 1):
                self.ctx.clear(s)
        self.ctx.clear(0)

        def logp(key: tuple[int, ...], tok: int) -> float:
            lse, vals = got[key]
            return vals[tok] - lse

        nlls = [-sum(logp(tuple(x[:i]), x[i]) for i in range(len(x))) for x in toks]
        result = []
        stops = iter(nlls[n_texts:])
        for x, end, nll in zip(toks[:n_texts], ends, nlls):
            end_nll = float("nan")
            if end:
                lse, vals = got[tuple(x)]
                ids = np.array([vals[t] for t in self.eog])
                m = float(ids.max())
                end_nll = lse - (m + math.log(float(np.exp(ids - m).sum())))
                if stop:  # P(end) = P(end-of-generation) + P(the stop text)
                    end_nll = -float(np.logaddexp(-end_nll, -(next(stops) - nll)))
            result.append((float(nll), float(end_nll)))
        return result

    def close(self) -> None:
        self.ctx.close()


class TextLabeller:
    """Labels prompts of a mixed pair one at a time (module docstring).

    `proposer`: a tier judged by another model (a pool's labels in one unit, "Judged by the top
    tier" in the module docstring). It shares the device's vocabulary and reads the device's tokens
    of the judge's answer; its greedy token is the one compared with the device's, and `cloud` (the
    judge) only writes the path and scores both. None: the judge's own token is compared."""

    def __init__(
        self,
        edge: LlamaModel,
        cloud: LlamaModel,
        threads: int | None = 1,
        n_ctx: int = 2048,
        proposer: LlamaModel | None = None,
    ) -> None:
        self.edge, self.cloud, self.threads, self.n_ctx = edge, cloud, threads, n_ctx
        if proposer is not None and proposer.info.tokenizer_fingerprint != edge.info.tokenizer_fingerprint:
            raise ValueError(
                f"a judged tier must share the device's vocabulary: {proposer.info.name} does not read "
                f"{edge.info.name}'s tokens (label it as its own pair, or judge it by itself)"
            )
        self._ectx = LlamaContext(self.edge, n_ctx=self.n_ctx, n_seq=1, threads=self.threads, embeddings=True)
        self._pctx = (
            None if proposer is None else LlamaContext(proposer, n_ctx=self.n_ctx, n_seq=1, threads=self.threads)
        )
        self._scorer = TextScorer(self.cloud, n_ctx=self.n_ctx, threads=self.threads)
        self._eview = AnswerText.for_model(self.edge)
        self._featurize = LogitFeaturizer(self.edge.n_vocab)

    def label_prompt(
        self, eprompt: list[int], cprompt: list[int], prompt_id: int, max_tokens: int, pprompt: list[int] | None = None
    ) -> dict[str, list]:
        """One prompt's rows. `pprompt`: the proposer's prompt (its chat template), where there is one."""
        rows: dict[str, list] = {k: [] for k in ("hidden", "logit_feats", "proposed", "cloud_token", "position")}
        rows.update({k: [] for k in ("prompt_id", "mismatch", "divergent", "regret")})
        # the cloud's answer, as the device's tokens (room for max_tokens device tokens and one more)
        answer, ended = self._scorer.answer(cprompt, max_tokens + 8)
        dev = self._eview.tokens(answer)
        if len(dev) > max_tokens:
            dev, ended = dev[:max_tokens], False
        n_pos = len(dev) + (1 if ended else 0)
        if n_pos == 0:
            return rows
        ref = dev + ([self.edge.eog_token] if ended else [])
        proposed = self._device_pass(eprompt, dev, n_pos, rows)
        compared = ref if self._pctx is None else self._proposer_pass(pprompt or eprompt, dev, n_pos)
        regrets = self._regrets(cprompt, dev, ref, proposed, compared)
        for j, (e, c) in enumerate(zip(proposed, compared)):
            rows["proposed"].append(e)
            rows["cloud_token"].append(c)
            rows["position"].append(j)
            rows["prompt_id"].append(prompt_id)
            rows["mismatch"].append(int(e != c))
            rows["divergent"].append(-1)
            rows["regret"].append(regrets[j])
        return rows

    def _device_pass(self, eprompt: list[int], dev: list[int], n_pos: int, rows: dict[str, list]) -> list[int]:
        """The device reads the answer: its state (into `rows`) and greedy token before each position."""
        P = len(eprompt)
        self._ectx.clear(0)
        outs = self._ectx.decode_outputs(DecodeItem(0, 0, eprompt + dev), list(range(P - 1, P - 1 + n_pos)))
        proposed = []
        for out in outs:
            logits = self._ectx.logits(out)
            e = int(np.argmax(logits))
            proposed.append(e)
            rows["hidden"].append(np.array(self._ectx.hidden(out), dtype=np.float16))
            rows["logit_feats"].append(self._featurize(logits, e).copy())
        self._ectx.clear(0)
        return proposed

    def _proposer_pass(self, pprompt: list[int], dev: list[int], n_pos: int) -> list[int]:
        """The judged tier reads the same tokens: its greedy token before each position."""
        assert self._pctx is not None
        P = len(pprompt)
        self._pctx.clear(0)
        outs = self._pctx.decode_outputs(DecodeItem(0, 0, pprompt + dev), list(range(P - 1, P - 1 + n_pos)))
        tokens = [int(np.argmax(self._pctx.logits(out))) for out in outs]
        self._pctx.clear(0)
        return tokens

    def _regrets(
        self, cprompt: list[int], dev: list[int], ref: list[int], proposed: list[int], compared: list[int]
    ) -> list[float]:
        """Per position, `text_regret` of the device's token against the compared one, both scored by
        the cloud (the judge) after the answer text before the position."""
        edge = self.edge
        prefix = [self._eview.text_of(dev[:j]) for j in range(len(dev) + 1)]
        texts, ends = list(prefix), [False] * len(prefix)
        where: dict[tuple[int, int], int] = {}  # (position, token) -> its text, where it is not the path's

        def want(j: int, tok: int) -> None:
            if edge.is_eog(tok):
                ends[j] = True
            elif tok != ref[j] and (j, tok) not in where:
                where[(j, tok)] = len(texts)
                texts.append(prefix[j] + edge.token_bytes(tok))
                ends.append(False)

        for j, (e, c) in enumerate(zip(proposed, compared)):
            if e != c:
                want(j, e)
                want(j, c)
        scores = self._scorer.score(cprompt, prefix[-1], texts, ends)

        def nll(j: int, tok: int) -> float:
            if edge.is_eog(tok):
                return scores[j][1]
            return scores[j + 1 if tok == ref[j] else where[(j, tok)]][0] - scores[j][0]

        out = []
        for j, (e, c) in enumerate(zip(proposed, compared)):
            if e == c:
                out.append(0.0)
                continue
            b_e, b_c = edge.token_bytes(e), edge.token_bytes(c)
            out.append(text_regret(nll(j, e), len(b_e), edge.is_eog(e), nll(j, c), len(b_c), edge.is_eog(c)))
        return out

    def close(self) -> None:
        self._ectx.close()
        if self._pctx is not None:
            self._pctx.close()
        self._scorer.close()
