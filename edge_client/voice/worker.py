"""A background thread that runs only the newest job.

Recognition partials and prompt prefills are both "latest wins": a job that
has not started yet is worthless once a newer one arrives. The caller's
thread (the audio loop) only hands a job over and never waits.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

J = TypeVar("J")


class LatestJobWorker(Generic[J]):
    """Runs `work(job)` on its own thread; a submitted job replaces the one still waiting,
    unless `keep_waiting(waiting, new)` says the waiting one must not be dropped."""

    def __init__(
        self, name: str, work: Callable[[J], None], keep_waiting: Callable[[J, J], bool] | None = None
    ) -> None:
        self._work = work
        self._keep_waiting = keep_waiting
        self._cv = threading.Condition()
        self._job: J | None = None
        self._closed = False
        self.busy = False  # a job is running now
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def submit(self, job: J) -> None:
        with self._cv:
            if self._job is not None and self._keep_waiting is not None and self._keep_waiting(self._job, job):
                return
            self._job = job
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._t.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job, self._job = self._job, None
                self.busy = True
            try:
                self._work(job)
            finally:
                with self._cv:
                    self.busy = False
