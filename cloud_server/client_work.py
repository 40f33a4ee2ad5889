"""Work whose size a client chooses (tokenizing its prompt or text, planning a text check), off the event loop.

Why a pool of its own: the event loop serves every connection, so nothing client-sized may run on
it; the engine thread's time is shared by every key, so what only reads the vocabulary stays off it
too. Asyncio's default executor would start up to 32 threads, letting a few clients take every core
with tokenization; this pool has `WORKERS` threads, so such work queues behind itself. Every job is
also priced before it gets here: the protocol's edge refuses text longer than a limit, so one job
is bounded (docs/security.md, "Every request priced before any work").
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

WORKERS = 2  # threads for client-sized work, whatever the machine's cores

_pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="client-work")


async def off_loop(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on the client-work pool, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_pool, fn, *args)
