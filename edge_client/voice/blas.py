"""numpy's BLAS kept to one thread while the voice pipeline runs.

Why: numpy's OpenBLAS wakes a worker thread for any matrix product big enough to split,
and that worker then busy-waits ~100 ms for more work. Every Whisper feature extraction
(faster-whisper's mel filterbank product: each partial and each final decode) and every
Smart Turn call (the same product in `endofturn.log_mel_8s`) did that, so on a 2-core
machine one core spun for ~100 ms right when the final decode, the answer's first tokens
and Piper needed both. Measured: a 4 ms feature extraction followed by 103 ms of the
process's CPU time while it slept, 0.1 ms with one thread (docs/journal/voice.md). The products
themselves are small (80 x 201 by 201 x T), so one thread costs nothing measurable.
"""

from __future__ import annotations

import numpy  # noqa: F401  (loads the BLAS this module limits, so that `_DEFAULT` below sees it)
from threadpoolctl import threadpool_info, threadpool_limits


def limit_blas_threads(n: int) -> None:
    """Limit numpy's BLAS to `n` threads for the whole process (0: the library's own default, all cores).

    Process-wide, as BLAS thread pools are; the pipeline calls it when it is built, so the option
    of the pipeline that runs is the one in force (the benchmark's A/B switches it per turn).
    """
    if n < 0:
        raise ValueError(f"BLAS threads must be >= 0 (0: the library's default), not {n}")
    threadpool_limits(limits=n if n > 0 else _DEFAULT, user_api="blas")


def blas_threads() -> int:
    """Threads numpy's BLAS would use now (the largest over loaded BLAS libraries; 0 if none is loaded)."""
    return max((i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"), default=0)


_DEFAULT = blas_threads() or None  # at import, before any limit: what 0 restores
