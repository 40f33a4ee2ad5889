"""numpy's BLAS kept to one thread while the voice pipeline runs.

Why: numpy's OpenBLAS wakes a worker thread for any matrix product big enough to split,
and that worker then busy-waits ~100 ms for more work. Every Whisper feature extraction
(faster-whisper's mel filterbank product: each partial and each final decode) and every
Smart Turn call (the same product in `endofturn.log_mel_8s`) did that, so on a 2-core
machine one core spun for ~100 ms right when the final decode, the answer's first tokens
and Piper needed both. Measured: a 4 ms feature extraction followed by 103 ms of the
process's CPU time while it slept, 0.1 ms with one thread (docs/journal/voice.md). The products
themselves are small (80 x 201 by 201 x T), so one thread costs nothing measurable.

Those products are also computed on one thread whatever the process-wide limit (`one_blas_thread`):
OpenBLAS splits a product's sums differently on two threads, and tiny.en heard espeak's "set a timer
for ten minutes" as "Center timer for 10 minutes." with two, right with one. What Whisper and Smart
Turn hear must not depend on what else ran in the process before them (a test, a benchmark, the app).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import numpy  # noqa: F401  (loads the BLAS this module limits, so that `_DEFAULT` below sees it)
from threadpoolctl import ThreadpoolController, threadpool_info, threadpool_limits


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


_controller = ThreadpoolController()  # the BLAS libraries loaded now (numpy's); ~0.02 ms a `limit`
_one_thread_lock = threading.Lock()  # the limit is process-wide: one section at a time restores it right


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the block with numpy's BLAS on one thread, then restore the limit in force before.

    For the audio front ends' small matrix products (Whisper's and Smart Turn's log-mel), whose results
    would otherwise depend on the thread count (see the module's docstring). Sections are serialised: a
    few milliseconds each."""
    with _one_thread_lock, _controller.limit(limits=1, user_api="blas"):
        yield
