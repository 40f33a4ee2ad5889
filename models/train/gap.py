"""The gap recovered, with its 95% bootstrap interval over prompts: one computation for both evals.

"Gap recovered at 30 %": how much of the NLL gap between the device alone and the cloud alone a
method closes when the cloud writes 30 % of the answer (tokens in the token eval, bytes in the text
eval), read off the method's curve over its targets. Why an interval: which queries are evaluated
moves the figure more than most router changes do, so a single figure needs its spread next to it.
"""

from __future__ import annotations

import numpy as np

EDGE = ("edge-only", 0.0)
CLOUD = ("cloud-only", 1.0)


def gap_interval(
    per_prompt: dict[tuple[str, float], np.ndarray],
    methods: list[str],
    at: float = 0.3,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, list[float]]:
    """95% bootstrap interval of the gap recovered at `at` cloud share, for each of `methods`.

    `per_prompt[(method, target)]` holds three rows over the prompts (the same prompt order in every
    entry): the answer's NLL, its size (tokens or bytes) and the cloud's part of that size. Prompts
    are resampled with replacement; each resample sums the rows, so a long answer weighs more."""
    n = per_prompt[EDGE].shape[1]
    counts = np.random.default_rng(seed).multinomial(n, [1 / n] * n, size=n_boot).T  # [prompts, n_boot]

    def boot(key: tuple[str, float]) -> tuple[np.ndarray, np.ndarray]:
        nll, size, cloud = per_prompt[key] @ counts
        size = np.maximum(size, 1)
        return nll / size, cloud / size

    edge, _ = boot(EDGE)
    cloud, _ = boot(CLOUD)
    out: dict[str, list[float]] = {}
    for m in methods:
        curves = [boot(k) for k in sorted(per_prompt) if k[0] == m]
        ys, xs = np.array([c[0] for c in curves]), np.array([c[1] for c in curves])  # [targets, n_boot]
        gaps = []
        for b in range(n_boot):
            if edge[b] - cloud[b] <= 0:
                continue
            x = np.concatenate([[0.0], xs[:, b], [1.0]])
            y = np.concatenate([[edge[b]], ys[:, b], [cloud[b]]])
            order = np.argsort(x, kind="stable")
            gaps.append((edge[b] - np.interp(at, x[order], y[order])) / (edge[b] - cloud[b]))
        out[m] = (
            [round(float(np.percentile(gaps, 2.5)), 4), round(float(np.percentile(gaps, 97.5)), 4)]
            if gaps
            else [float("nan")] * 2
        )
    return out


def pareto_front(points: dict[tuple[str, float], tuple[float, float]]) -> list[tuple[float, float, str, float]]:
    """The points no other beats on both cost and quality (both lower is better): `points[(method,
    target)] = (cost, NLL)`, returned as (cost, NLL, method, target), cheapest first. A point is dominated
    by one at most as costly and at most as bad, better in one. Both evals call it."""
    front = [
        (cost, nll, m, f)
        for (m, f), (cost, nll) in points.items()
        if not any(c <= cost and q <= nll and (c, q) != (cost, nll) for c, q in points.values())
    ]
    return sorted(front)
