"""Several cloud replicas on loopback behind a real HAProxy: what an operator runs, in miniature.

The failover tests and `scripts/bench_failover.py` use it: devices connect to
the balancer's one URL, and a replica can be killed (SIGKILL, a crash),
drained (SIGTERM, a rolling update) or scaled in (taken out of the balancer,
then SIGTERM, as Kubernetes retires a pod). The HAProxy configuration is
`haproxy_config`, the one docs/server.md shows ("Failover"): WebSocket over
HTTP mode, health checks on /readyz (a draining or full replica answers 503;
a draining one then stops listening), client-IP affinity as the Helm chart's
`sessionAffinity: ClientIP`, and connection failures redispatched to another
replica, so a session whose replica died is rebuilt elsewhere at once.

Needs Debian's `haproxy` (scripts/setup.sh installs it).
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from cloud_server.local import LocalCloudServer

HAPROXY_PATHS = ("haproxy", "/usr/sbin/haproxy")


def haproxy_config(listen_port: int, replicas: list[int], admin_socket: str, host: str = "127.0.0.1") -> str:
    """HAProxy in front of cloud replicas (`replicas`: their ports on `host`)."""
    servers = "\n".join(f"    server r{i} {host}:{port} check" for i, port in enumerate(replicas))
    return f"""global
    stats socket {admin_socket} mode 600 level admin

defaults
    mode http
    timeout connect 500ms
    timeout client 10m
    timeout server 10m
    timeout tunnel 10m            # a WebSocket session is one long tunnel
    retries 3
    option redispatch 1           # a refused connection (dead or draining replica) goes to another at once

frontend route
    bind {host}:{listen_port}
    default_backend replicas

backend replicas
    balance source                # client-IP affinity, as the Helm chart's sessionAffinity: ClientIP
    hash-type consistent          # a replica's death moves only its own clients
    option httpchk GET /readyz    # 503 while draining or full: no new sessions there
    http-check expect status 200
    default-server inter 500ms fall 2 rise 2
{servers}
"""


def find_haproxy() -> str | None:
    for name in HAPROXY_PATHS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalFleet:
    """`with LocalFleet(3, model) as fleet: fleet.url, fleet.api_key, fleet.kill(fleet.holder())`."""

    def __init__(self, n_replicas: int = 2, model: str | None = None, extra_args: list[str] | None = None) -> None:
        self.model = model
        self.extra_args = extra_args or []
        self.api_key = secrets.token_urlsafe(16)  # one key, as one deployment's replicas share their key file
        self.replicas = [
            LocalCloudServer(model=model, api_key=self.api_key, extra_args=self.extra_args) for _ in range(n_replicas)
        ]
        self.port = 0
        self.url = ""
        self._dir = Path(tempfile.mkdtemp(prefix="tokenrouter-fleet-"))
        self._haproxy: subprocess.Popen[bytes] | None = None

    @property
    def admin_socket(self) -> str:
        return str(self._dir / "admin.sock")

    def start(self) -> LocalFleet:
        exe = find_haproxy()
        if exe is None:
            raise RuntimeError("haproxy is not installed: apt-get install haproxy (scripts/setup.sh does)")
        for r in self.replicas:
            r.start()
        self.port = _free_port()
        cfg = self._dir / "haproxy.cfg"
        cfg.write_text(haproxy_config(self.port, [r.port for r in self.replicas], self.admin_socket))
        self._haproxy = subprocess.Popen(
            [exe, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.url = f"ws://127.0.0.1:{self.port}/v1/route"
        self.wait_up(len(self.replicas))
        return self

    def wait_up(self, n: int, timeout_s: float = 30.0) -> None:
        """Wait until the balancer counts `n` replicas up (its health checks passed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._haproxy is not None and self._haproxy.poll() is not None:
                err = self._haproxy.stderr.read().decode(errors="replace") if self._haproxy.stderr else ""
                raise RuntimeError(f"haproxy exited: {err[-2000:]}")
            if len(self.up()) >= n:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the balancer did not see {n} replicas up within {timeout_s:.0f} s: {self.up()}")

    def admin(self, command: str) -> str:
        """One command on HAProxy's runtime API (its stats socket)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.admin_socket)
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def up(self) -> list[int]:
        """The replicas the balancer sends new sessions to: UP, or "UP 1/2" (a check failed, not yet enough
        to take it out); not DOWN, not in maintenance."""
        try:
            stat = self.admin("show stat")
        except OSError:
            return []
        out = []
        for line in stat.splitlines():
            cols = line.split(",")
            if len(cols) > 17 and cols[0] == "replicas" and cols[1].startswith("r") and cols[17].startswith("UP"):
                out.append(int(cols[1][1:]))
        return out

    def sessions(self, i: int) -> int:
        """Open sessions on replica `i` (its /healthz; 0 where it is gone)."""
        try:
            with urllib.request.urlopen(self.replicas[i].http_url + "/healthz", timeout=2) as resp:
                return int(json.loads(resp.read())["sessions"])
        except OSError:
            return 0

    def holder(self) -> int:
        """The replica holding the most sessions (the one a test's device is on)."""
        return max(range(len(self.replicas)), key=self.sessions)

    def kill(self, i: int) -> None:
        """A crash: SIGKILL, no goodbye."""
        self.replicas[i].kill()

    def drain(self, i: int) -> None:
        """A rolling update's SIGTERM: the replica drains and exits by itself."""
        self.replicas[i].terminate()

    def scale_in(self, i: int) -> None:
        """Kubernetes retiring a pod: out of the balancer first (no new sessions), then SIGTERM."""
        self.admin(f"set server replicas/r{i} state maint")
        self.replicas[i].terminate()

    def revive(self, i: int) -> None:
        """Start replica `i` again on its port (a replacement pod) and wait until the balancer uses it."""
        old = self.replicas[i]
        old.stop()
        self.replicas[i] = LocalCloudServer(
            model=self.model, api_key=self.api_key, extra_args=self.extra_args, port=old.port
        ).start()
        self.admin(f"set server replicas/r{i} state ready")
        self.wait_up(len(self.replicas))

    def stop(self) -> None:
        if self._haproxy is not None and self._haproxy.poll() is None:
            self._haproxy.terminate()
            self._haproxy.wait(timeout=10)
        for r in self.replicas:
            r.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalFleet:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
