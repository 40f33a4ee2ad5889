"""Start a cloud server on loopback in a child process (for `--cloud local`, tests, the demo).

A real separate process, as in production: it can be killed to test failover.
"""

from __future__ import annotations

import collections
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from cloud_server.config import READY_LINE

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG_LINES_KEPT = 2000


class LocalCloudServer:
    """`with LocalCloudServer(model) as srv: srv.url, srv.api_key`."""

    def __init__(
        self,
        model: str | None = None,
        api_key: str | None = None,
        extra_args: list[str] | None = None,
        startup_timeout_s: float = 120.0,
        port: int = 0,
        cpus: str = "",
    ) -> None:
        """`cpus`: the CPUs the server runs on ("2,3"; "" = wherever the OS puts it): pinned away from
        the cores a device benchmark uses, it stands for a cloud on other hardware (shared/cpus.py)."""
        self.model = model
        self.cpus = cpus
        self.port = port
        self.api_key = api_key or secrets.token_urlsafe(16)
        self.extra_args = extra_args or []
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        self.http_url = ""
        self.proc: subprocess.Popen[str] | None = None
        self._log: collections.deque[str] = collections.deque(maxlen=LOG_LINES_KEPT)
        self._n_lines = 0  # lines read since start, kept or not: a `log_mark` counts from the first
        self._log_lock = threading.Lock()

    def start(self) -> "LocalCloudServer":
        cmd = [
            sys.executable,
            "-m",
            "cloud_server.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]
        if self.model:
            cmd += ["--model", str(self.model)]
        if "--threads" not in self.extra_args:
            cmd += ["--threads", "1"]  # it shares this machine with the device model
        if self.cpus:
            cmd += ["--cpus", self.cpus]
        env = dict(os.environ, TOKENROUTER_API_KEYS=self.api_key, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self._keep(line)
            if line.startswith(READY_LINE):
                fields = dict(part.split("=", 1) for part in line.split()[1:])
                self.url = fields["url"]
                self.port = int(fields["port"])
                self.http_url = f"{'https' if self.url.startswith('wss') else 'http'}://127.0.0.1:{self.port}"
                threading.Thread(target=self._drain, daemon=True).start()
                return self
        self.stop()
        raise RuntimeError("local cloud server did not start:\n" + "\n".join(self.log[-20:]))

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._keep(line)

    def _keep(self, line: str) -> None:
        with self._log_lock:
            self._log.append(line.rstrip())
            self._n_lines += 1

    @property
    def log(self) -> list[str]:
        """The server's last `LOG_LINES_KEPT` lines (for a failure's message; to count lines, `log_since`)."""
        with self._log_lock:
            return list(self._log)

    def log_mark(self) -> int:
        """A mark for `log_since`: how many lines the server has written so far."""
        return self._n_lines

    def log_since(self, mark: int) -> list[str]:
        """The lines written after `mark`, so that a caller reads only what happened since it looked,
        whatever ran before it. RuntimeError if some of them were already dropped (more than
        `LOG_LINES_KEPT` since the mark): counting what is left would undercount."""
        with self._log_lock:
            log, n = list(self._log), self._n_lines
        new = n - mark
        if new > len(log):
            raise RuntimeError(f"{new} lines since the mark, only the last {len(log)} kept: take the mark later")
        return log[len(log) - new :] if new else []

    def kill(self) -> None:
        """Abrupt death, as in a crash (SIGKILL)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM, as Kubernetes sends to a pod it retires: the server drains (cloud_server/drain.py)
        and exits by itself; `wait` for it."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()

    def wait(self, timeout_s: float) -> int | None:
        """The exit status once the server has exited within `timeout_s`, else None."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> "LocalCloudServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
