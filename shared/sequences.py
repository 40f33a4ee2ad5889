"""Helpers on token (or byte) sequences that every layer uses."""

from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the prefix two sequences share (histories are the truth: a cache keeps this much)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
