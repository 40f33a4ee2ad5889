"""Sequence overlap measures used by labelling (re-convergence) and evaluation (ROUGE-L)."""

from __future__ import annotations

from typing import Sequence


def lcs_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)), fine for answers)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_f1(candidate: str, reference: str) -> float:
    """ROUGE-L F1 on lower-cased whitespace words."""
    c, r = candidate.lower().split(), reference.lower().split()
    if not c and not r:
        return 1.0
    lcs = lcs_len(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)


def token_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Share of positions (over the longer answer) where both answers hold the same token."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    return sum(1 for x, y in zip(a, b) if x == y) / n
