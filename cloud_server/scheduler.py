"""The engine thread: batches hard-token and sync requests of many sessions into one decode.

Why: one decode of 32 sequences costs far less than 32 decodes of one (the
weights are read once per batch), so a server that serves sessions one at a
time wastes its accelerator. Every session has at most one request in flight
(the connection awaits it), so each batch holds at most one item per session.

Fairness: requests are served oldest first among the sessions whose turn it
is (the engine decides: short work first, then fair queueing between keys; see
cloud_server/fair_share.py). Every generate in the queue gets
its token in the next batch unless the per-batch token budget is spent by
older requests; long prefills are cut into chunks of at most `session_tokens`
per session and step, so a 2000-token sync never holds back another session's
hard token by more than one chunk. A verify is served the same way: one chunk
per turn (`TURN` requests run a piece of work on this thread when granted).

Plain calls (`call(fn, *args)`, any engine method) run on the same thread,
between batches and in arrival order, so code written against
`await worker.call(engine.method, ...)` keeps working unchanged.

`EngineWorker` (the `Worker` of cloud_server/engine_api.py) puts a batching
engine behind this thread; the engine itself knows nothing of the scheduler
(both use the request types of cloud_server/batch.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, TypeVar

from cloud_server.batch import GENERATE, PREFILL, TURN, BatchEngine, BatchObserver, Request, VerifyJob
from cloud_server.engine_api import GenerateResult, VerifyResult

log = logging.getLogger(__name__)
T = TypeVar("T")


class BatchScheduler:
    """The engine thread and its queues (see the module docstring)."""

    def __init__(
        self,
        engine: BatchEngine,
        max_batch_tokens: int = 512,
        observer: BatchObserver | None = None,
        session_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_batch_tokens = max(1, min(max_batch_tokens, engine.n_batch))
        # the most tokens one session takes of a step (default: the whole batch)
        self.session_tokens = max(2, min(session_tokens or self.max_batch_tokens, self.max_batch_tokens))
        self.observer = observer
        self._cv = threading.Condition()
        self._calls: deque[tuple[Callable[..., Any], tuple, Any, asyncio.AbstractEventLoop | None]] = deque()
        self._new: list[Request] = []
        self._active: list[Request] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- submitting

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._push_call(fn, args, fut, loop)
        return await fut

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._push_call(fn, args, fut, None)
        return fut

    async def request(self, handle: int, kind: str, proposed: int = -1, work: Callable[[], Any] | None = None) -> Any:
        """Queue a prefill or generate for a session and wait for its batch (or a TURN: wait for the
        session's turn, then `work` runs on the engine thread and its result is returned)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._cv:
            if self._stop:
                raise RuntimeError("the engine is shutting down")
            self._new.append(Request(handle, kind, fut, loop, proposed, work))
            self._cv.notify()
        return await fut

    def _push_call(self, fn: Callable[..., Any], args: tuple, fut: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        with self._cv:
            if self._stop:
                raise RuntimeError("the engine is shutting down")
            self._calls.append((fn, args, fut, loop))
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._new) + len(self._active)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        stalled = False
        while True:
            with self._cv:
                while not self._stop and not self._calls and not self._new and (not self._active or stalled):
                    self._cv.wait(timeout=0.05 if stalled else None)
                    if stalled:
                        break  # retry the stalled requests now and then: sessions may have closed
                if self._stop:
                    calls, new = list(self._calls), self._new
                    self._calls.clear()
                    self._new = []
                    break
                calls, new = list(self._calls), self._new
                self._calls.clear()
                self._new = []
            for fn, args, fut, loop in calls:
                try:
                    _resolve(fut, loop, fn(*args), None)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    _resolve(fut, loop, None, exc)
            self._active.extend(new)
            if self._active:
                stalled = not self._step()
        shutdown_error = RuntimeError("the engine shut down")
        for fn, args, fut, loop in calls:
            _resolve(fut, loop, None, shutdown_error)
        for req in self._active + new:
            _resolve(req.future, req.loop, None, shutdown_error)

    def _step(self) -> bool:
        """One batch over the queued requests. Returns False when nothing could progress."""
        # hard tokens first (a device is waiting on each), then prefills; oldest first within each
        reqs = self._active = sorted(self._active, key=lambda r: r.kind == PREFILL)
        now = time.perf_counter()
        try:
            outcomes, n_items, n_tokens, decode_s = self.engine.step(reqs, self.max_batch_tokens, self.session_tokens)
        except BaseException as exc:  # noqa: BLE001 - step confines failures to their requests; this is a bug
            log.exception("batch failed")
            for req in reqs:
                _resolve(req.future, req.loop, None, exc)
            self._active = []
            return True
        if n_items and self.observer is not None:
            self.observer.on_batch(n_items, n_tokens, decode_s)
        keep: list[Request] = []
        turns: list[Request] = []
        progressed = False
        for req, out in zip(reqs, outcomes):
            if out.progressed and not req.started:
                req.started = True
                if self.observer is not None:
                    self.observer.on_queue_wait(now - req.t_enqueued)
            progressed |= out.progressed or out.done or out.error is not None
            if out.error is not None:
                _resolve(req.future, req.loop, None, out.error)
            elif out.done and req.kind == TURN:
                turns.append(req)
            elif out.done:
                _resolve(req.future, req.loop, out.result, None)
            else:
                keep.append(req)
        for req in turns:  # after every batched answer is out: a turn's work is the longest part of a step
            try:
                _resolve(req.future, req.loop, req.work() if req.work is not None else None, None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                _resolve(req.future, req.loop, None, exc)
        self._active = keep
        return progressed


class EngineWorker:
    """Runs a batching engine's work on one dedicated thread, awaitable from asyncio.

    `call(fn, *args)` runs any engine method there; `generate`/`prefill` go
    through the batch scheduler, which serves many sessions in one decode.
    """

    def __init__(
        self,
        engine: BatchEngine,
        max_batch_tokens: int = 512,
        observer: BatchObserver | None = None,
        session_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.scheduler = BatchScheduler(engine, max_batch_tokens, observer, session_tokens)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.scheduler.call(fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self.scheduler.submit(fn, *args)

    async def generate(self, handle: int, proposed: int = -1) -> GenerateResult:
        """The session's next token, batched with other sessions' (`proposed`: the device's, for the tie rule)."""
        result: GenerateResult = await self.scheduler.request(handle, GENERATE, proposed)
        return result

    async def prefill(self, handle: int) -> float:
        """Decode the session's pending tokens, batched, keeping the next position's logits. Returns compute seconds."""
        seconds: float = await self.scheduler.request(handle, PREFILL)
        return seconds

    async def verify(
        self, handle: int, tokens: list[int], check: list[int], bonus: bool = False, tolerance: float = 0.0
    ) -> VerifyResult:
        """The engine's verify, one bounded chunk per turn of the session (`BatchEngine.verify_step`):
        other sessions' batches run between the chunks. On an error the history is as before."""
        engine, rows = self.engine, self.scheduler.session_tokens
        job = VerifyJob(list(tokens), sorted(check), bonus, tolerance)
        try:
            while True:
                result = await self.scheduler.request(handle, TURN, work=lambda: engine.verify_step(handle, job, rows))
                if result is not None:
                    return result
        except Exception:
            if job.base >= 0:
                await self.call(engine.abandon_verify, handle, job)
            raise

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.engine.close_all()


def _resolve(fut: Any, loop: asyncio.AbstractEventLoop | None, result: Any, error: BaseException | None) -> None:
    """Complete an asyncio future from the engine thread (or a concurrent one directly)."""
    if loop is None:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
        return

    def done() -> None:
        if fut.done():  # the waiter was cancelled
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass
