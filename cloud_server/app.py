"""The FastAPI application: the WebSocket endpoint plus health, info and metrics routes.

    GET  /healthz   liveness: {"status": "ok" or "draining", "sessions": N}, 200 while the process serves
    GET  /readyz    readiness: 200 while it takes new sessions; 503 draining or full (a balancer sends none)
    GET  /v1/info   model name, fingerprints, protocol version, limits
    GET  /metrics   Prometheus text format (cloud_server/metrics.py)
    WS   /v1/route  the routing protocol (shared/protocol.py, docs/protocol.md)

FastAPI's /docs, /redoc and /openapi.json are served only with `--api-docs` (they describe the
server to anyone, key or not).

Limits enforced per connection here, before a message reaches the protocol
state machine: connections without a session (a deadline, caps in all and per
address: cloud_server/hello_gate.py), frame size (uvicorn's ws_max_size and our
own check), message rate (token bucket), idle time, slow readers: a send budget
(`_SendBudget`) in bytes and time closes a connection whose unread replies pass
max_send_queue_bytes, or whose oldest unread reply is older than send_timeout_s
(a send that blocks that long ends it too), so its output is never buffered
without bound.

Whatever ends a connection, the session is freed first (its KV cells at once),
then a farewell and a close frame are sent within CLOSE_GRACE_S, else the
connection is aborted. An unexpected exception closes only its own session
(close code 1011) and logs at most one traceback per TRACEBACK_EVERY_S, the
limit every logged traceback of the process shares (cloud_server/logs.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Response, WebSocket, WebSocketDisconnect

from cloud_server.audit import AuditLog, AuditOptions
from cloud_server.auth import KeyChecker
from cloud_server.config import ServerConfig
from cloud_server.drain import DRAIN_REASON, GOING_AWAY, Drain
from cloud_server.engine import CloudEngine
from cloud_server.engine_api import Worker
from cloud_server.flywheel import recorder_for
from cloud_server.hello_gate import TRY_AGAIN_LATER, HelloGate, HelloWait
from cloud_server.logs import ADMITTED, TRACEBACK_EVERY_S, TRACEBACKS, TracebackLimit
from cloud_server.metrics import ServerMetrics
from cloud_server.quotas import KeyPolicy, Quotas
from cloud_server.remote_engine import RemoteEngine, RemoteWorker
from cloud_server.routing_watch import RoutingWatch
from cloud_server.scheduler import EngineWorker
from cloud_server.services import Services
from cloud_server.session import Connection, ConnectionDone
from models.registry import model_info
from shared.model_info import ModelInfo
from shared.protocol import (
    MAX_REQUEST_ID,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Error,
    ErrorCode,
    Hello,
    Message,
    ProtocolError,
    Reject,
    decode,
    encode,
)

log = logging.getLogger(__name__)

try:  # the bytes a socket holds unacknowledged (Linux: SIOCOUTQ); elsewhere the transport's buffer alone
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover - not Linux
    _OUTQ = None

WS_PATH = "/v1/route"
POLICY_VIOLATION = 1008
INTERNAL_ERROR = 1011
MAX_CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's payload is at most 125 bytes, 2 of them the code
CLOSE_GRACE_S = 1.0  # how long a farewell and the close frame may wait for room in the send buffer


def build_worker(config: ServerConfig, metrics: ServerMetrics) -> Worker:
    """The embedded llama.cpp engine with its batch scheduler, or a remote completions engine."""
    info = model_info(config.model)
    if config.remote_url:
        remote = RemoteEngine(
            info,
            config.remote_url,
            model_name=config.remote_model,
            api_key=config.remote_api_key,
            prompt_format=config.remote_prompt_format,
            max_sessions=config.max_sessions,
            n_ctx=config.n_ctx,
            timeout_s=config.remote_timeout_s,
            verify=config.remote_verify,
        )
        remote.probe_until_up()  # what the engine can do: the capabilities every accept lists
        return RemoteWorker(remote, concurrency=config.remote_concurrency)
    engine = CloudEngine(
        info,
        n_ctx=config.n_ctx,
        max_sessions=config.max_sessions,
        threads=config.threads,
        kv_slots=config.kv_slots,
        evict_mode=config.evict_mode,
        max_saved_bytes=config.max_saved_bytes,
        n_batch=max(512, config.max_batch_tokens),
        kv_layout=config.kv_layout,
        n_gpu_layers=config.n_gpu_layers,
    )
    return EngineWorker(
        engine,
        max_batch_tokens=config.max_batch_tokens,
        observer=metrics,
        session_tokens=config.max_session_step_tokens,
    )


def create_app(config: ServerConfig) -> FastAPI:
    """Load the model and build the app (the model loads once, before serving)."""
    keys = _key_checker(config)
    info = model_info(config.model)
    metrics = ServerMetrics()
    services = _services(config, info, metrics)
    worker = build_worker(config, metrics)
    metrics.bind(
        lambda: worker.engine.n_sessions, worker.engine.pool if isinstance(worker.engine, CloudEngine) else None
    )

    recorder = recorder_for(config, info, lambda reason, n: metrics.flywheel_dropped.labels(reason).inc(n))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.shutdown()
        if recorder is not None:  # the rows the last sessions left, written before the process ends
            await asyncio.to_thread(recorder.close)

    docs = config.api_docs  # off by default: an API description is for the operator, not for anyone who asks
    app = FastAPI(
        title="TokenRouter cloud",
        version=str(PROTOCOL_VERSION),
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.worker = worker
    app.state.services = services

    drain = app.state.drain = Drain(on_drained=metrics.drained.inc)
    _add_http_routes(app, config, info, worker, metrics, drain)
    app.add_middleware(_TransportAccess)
    endpoint = _RouteEndpoint(config, keys, info, worker, services, drain)

    @app.websocket(WS_PATH)
    async def route(ws: WebSocket) -> None:
        await endpoint.serve(ws)

    return app


def _key_checker(config: ServerConfig) -> KeyChecker:
    """The API keys, each with the per-key limits of the configuration unless its key file sets its own."""
    default_key = KeyPolicy(
        max_sessions=config.key_max_sessions,
        tokens_per_minute=config.key_tokens_per_minute,
        max_cloud_fraction=config.key_max_cloud_fraction,
        kv_churn_per_minute=config.key_kv_churn_per_minute,
        explore_per_minute=config.key_explore_per_minute,
        engine_seconds_per_minute=config.key_engine_seconds_per_minute,
    )
    return KeyChecker(config.api_keys, insecure=config.insecure, default=default_key)


def _services(config: ServerConfig, info: ModelInfo, metrics: ServerMetrics) -> Services:
    """What every session shares besides the engine: quotas, metrics, the audit log, the routing watch."""
    audit = AuditLog(
        AuditOptions(config.audit_dir, config.audit_sample_rate, config.audit_retention_days, config.audit_token_ids),
        cloud_model=info.fingerprint,
    )
    return Services(
        quotas=Quotas(),
        metrics=metrics,
        audit=audit,
        abuse_warmup_tokens=config.abuse_warmup_tokens,
        watch=RoutingWatch(config.alarm_quantile, config.alarm_min_sessions, min_keys=config.alarm_min_keys),
    )


def _add_http_routes(
    app: FastAPI, config: ServerConfig, info: ModelInfo, worker: Worker, metrics: ServerMetrics, drain: Drain
) -> None:
    """GET /healthz, /readyz, /v1/info and /metrics (the module docstring)."""

    @app.get("/healthz")
    async def healthz() -> dict:
        """Liveness: 200 while the process serves, draining too (a failed liveness would kill a drain)."""
        return {"status": "draining" if drain.draining else "ok", "sessions": worker.engine.n_sessions}

    @app.get("/readyz")
    async def readyz() -> Response:
        """Readiness: 503 while draining or full, so a balancer (or Kubernetes) sends new sessions to
        another replica; the sessions here go on."""
        n, why = worker.engine.n_sessions, ""
        if drain.draining:
            why = "draining"
        elif n >= config.max_sessions:
            why = f"full: {n} of {config.max_sessions} sessions"
        body = json.dumps({"ready": not why, "why": why, "sessions": n})
        return Response(body, status_code=503 if why else 200, media_type="application/json")

    @app.get("/v1/info")
    async def server_info() -> dict:
        return {
            "model": info.name,
            "model_fingerprint": info.fingerprint,
            "tokenizer_fingerprint": info.tokenizer_fingerprint,
            "protocol_version": PROTOCOL_VERSION,
            "websocket_path": WS_PATH,
            "max_message_bytes": config.max_message_bytes,
            "max_sessions": config.max_sessions,
            "n_ctx": config.n_ctx,
            "auth_required": not config.insecure,
            "engine": "remote" if config.remote_url else "llama.cpp",
            "capabilities": worker.engine.capabilities().names(),
            "engine_detail": worker.engine.capabilities().how,
            "protocol_versions": list(SUPPORTED_VERSIONS),
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)


class _RouteEndpoint:
    """WS /v1/route: one routing session (a `Connection`) per WebSocket, behind the limits of the
    module docstring; whatever ends it, the session is freed before the socket is closed."""

    def __init__(
        self,
        config: ServerConfig,
        keys: KeyChecker,
        info: ModelInfo,
        worker: Worker,
        services: Services,
        drain: Drain,
    ) -> None:
        self.config, self.keys, self.info, self.worker = config, keys, info, worker
        self.services, self.metrics, self.drain = services, services.metrics, drain
        self.failures = _FailureLog(limit=TRACEBACKS)
        self.hello_gate = HelloGate(config.max_pre_hello, config.max_pre_hello_per_address)

    async def serve(self, ws: WebSocket) -> None:
        """One connection, from accept to close; counted by the hello gate until its hello."""
        address = ws.client.host if ws.client is not None else ""
        refused = self.hello_gate.enter(address)  # O(1), before anything else: no hello yet, no key
        await ws.accept()
        self.metrics.connections.inc()
        if refused:
            self.metrics.rejections.labels("pre_hello_cap").inc()
            await _close_socket(ws, TRY_AGAIN_LATER, refused, timeout_s=CLOSE_GRACE_S, linger=False)
            return
        hello = HelloWait(self.hello_gate, address, self.config.hello_timeout_s)
        try:
            await self._serve(ws, hello)
        finally:
            hello.done()

    async def _serve(self, ws: WebSocket, hello: HelloWait) -> None:
        config, drain = self.config, self.drain
        if drain.draining:  # accepted just before the listener closed: the device fails over at once
            await _close_socket(ws, GOING_AWAY, DRAIN_REASON, timeout_s=CLOSE_GRACE_S, linger=False)
            return
        key = id(ws)
        state = drain.register(key, lambda code, reason: _close_socket(ws, code, reason, timeout_s=CLOSE_GRACE_S))
        send = self._sender(ws)
        conn = Connection(self.worker, config, self.keys, self.info, send, self.services)
        close: tuple[int, str] | None = (1000, "")  # the close frame to send; None: the client is gone
        farewell: Message | None = None  # sent after the session is freed, before the close frame
        try:
            close = await self._converse(ws, conn, state, send, hello)
        except _SlowReader as slow:  # nothing more can be written: free the session now, then drop the socket
            close = (POLICY_VIOLATION, str(slow))
            await conn.demote()  # engine time for replies nobody reads: its key waits behind the others
        except ConnectionDone as done:
            close = (1000, str(done))
        except WebSocketDisconnect:
            close = None
        except Exception:  # never let one session take the server down, nor flood the log
            if _client_gone(ws):
                log.debug("session %s: the device went away", conn.session_id or "-")
                close = None
            else:
                self.failures.report(f"session {conn.session_id or '-'}")
                self.metrics.protocol_errors.labels(ErrorCode.INTERNAL).inc()
                farewell = Error(code=ErrorCode.INTERNAL, message="internal server error; the session is closed")
                close = (INTERNAL_ERROR, "internal server error")
        finally:
            drain.unregister(key)
            try:  # the session first: its KV cells are free at once, whatever the socket does next
                await conn.close()
            except Exception:
                self.failures.report(f"closing session {conn.session_id or '-'}")
            if close is not None:
                grace = min(config.send_timeout_s, CLOSE_GRACE_S)
                await _close_socket(ws, *close, farewell=farewell, timeout_s=grace, linger=not hello.waiting)

    def _sender(self, ws: WebSocket) -> Callable[[Message], Awaitable[None]]:
        """The session's `send`: each frame within the connection's send budget, else `_SlowReader`."""
        config, metrics = self.config, self.metrics
        budget = _SendBudget(ws.scope.get(_TRANSPORT), config.max_send_queue_bytes, config.send_timeout_s)

        async def send(msg: Message) -> None:
            frame = encode(msg)
            coro = ws.send_text(frame) if isinstance(frame, str) else ws.send_bytes(frame)
            try:
                await asyncio.wait_for(coro, config.send_timeout_s)
                # frames are ASCII JSON (or bytes): len is their size. A device behind waits here, its session too
                overdrawn = budget.sent(len(frame)) or await budget.settle()
            except asyncio.TimeoutError:
                overdrawn = f"slow reader: a send blocked for {config.send_timeout_s:g} s"
            if overdrawn:
                metrics.rejections.labels("slow_reader").inc()
                raise _SlowReader(overdrawn)

        return send

    async def _converse(
        self,
        ws: WebSocket,
        conn: Connection,
        state: Any,
        send: Callable[[Message], Awaitable[None]],
        hello: HelloWait,
    ) -> tuple[int, str] | None:
        """Hand the device's messages to the session until the conversation ends; returns the close
        frame to send (None: the device is gone). `state`: the drain's record of this connection;
        `hello`: its deadline and place in the hello gate until a hello arrives."""
        config, metrics = self.config, self.metrics
        limiter = _RateLimit(config.max_messages_per_s)
        while True:
            state.waiting = True  # between requests: a drain may close it now
            hello_due = hello.left()  # inf once a hello arrived
            try:
                event = await asyncio.wait_for(ws.receive(), min(config.idle_timeout_s, hello_due))
            except asyncio.TimeoutError:
                if hello_due <= config.idle_timeout_s:
                    metrics.rejections.labels("hello_timeout").inc()
                    return (POLICY_VIOLATION, f"no hello within {config.hello_timeout_s:g} s of connecting")
                metrics.rejections.labels("idle").inc()
                return (GOING_AWAY, f"idle for {config.idle_timeout_s:.0f} s")
            state.waiting = False
            if event["type"] == "websocket.disconnect":
                return None
            frame = event.get("bytes") if event.get("bytes") is not None else event.get("text", "")
            try:
                if not limiter.allow():
                    metrics.rejections.labels("message_rate").inc()
                    raise ProtocolError(
                        ErrorCode.BUSY, f"rate limit: at most {config.max_messages_per_s:g} messages per second"
                    )
                await conn.on_message(_decode(frame, config.max_message_bytes))
                if conn.seq is not None:  # a session: out of the hello gate (a refused hello closes)
                    hello.done()
            except ProtocolError as exc:
                refused = await self._answer_error(exc, conn, send, frame)
                if refused is not None:
                    return refused
            if self.drain.draining:  # the reply to this message is sent: the device fails over now
                self.drain.drained(state)
                return (GOING_AWAY, DRAIN_REASON)

    async def _answer_error(
        self, exc: ProtocolError, conn: Connection, send: Callable[[Message], Awaitable[None]], frame: str | bytes
    ) -> tuple[int, str] | None:
        """Tell the device what was wrong with its message; returns the close frame when that ends
        the connection (a broken hello, too many errors), else None."""
        conn.n_errors += exc.code != ErrorCode.EXPLORE_LIMITED  # a declined exploration is no fault
        self.metrics.protocol_errors.labels(exc.code).inc()
        log.info("session %s: %s", conn.session_id or "-", exc)
        if exc.mtype == Hello.type and conn.seq is None:  # a broken hello: refused like any other
            self.metrics.rejections.labels(exc.code).inc()
            await send(Reject(code=exc.code, reason=exc.message))
            return (POLICY_VIOLATION, exc.message)
        await send(Error(code=exc.code, message=exc.message, request_id=_request_id(frame)))
        if conn.n_errors >= self.config.max_errors_per_connection:
            return (POLICY_VIOLATION, "too many protocol errors")
        return None


class _RateLimit:
    """Token bucket: `rate` messages per second sustained, bursts of 2x."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.capacity = max(1.0, 2.0 * rate)
        self.level = self.capacity
        self.t = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now
        if self.level >= 1.0:
            self.level -= 1.0
            return True
        return False


class _SlowReader(ConnectionDone):
    """The device reads too little: its unread replies passed the send budget, or a send blocked."""


class _SendBudget:
    """What one connection has queued for the device and the device has not taken yet, in bytes and time.

    Why: a send only blocks once uvicorn's write buffer (64 KiB) and the kernel's send buffer are
    full, and Linux grows the latter to megabytes; a client that never reads while asking for long
    answers was streamed 300 KB and held for 40 s without any send blocking. So after each send the
    queue is measured (the transport's buffer plus the socket's unacknowledged bytes, SIOCOUTQ) and
    the connection closes once it passes `max_bytes`, or once its oldest frame still queued is older
    than `max_age_s`. Before that, past `PAUSE_BYTES` (or half the budget) the session waits for the
    device to catch up (`settle`): a device that reads nothing gets no more engine time for replies
    nobody reads. Cheap: one ioctl per reply, and a deque of the frames not yet delivered."""

    _HEADER = 10  # a WebSocket frame header's most bytes (server frames are not masked)
    PAUSE_BYTES = 16384  # unread bytes past which the session waits for the device (replies are ~150 bytes)
    POLL_S = 0.02

    def __init__(self, transport: Any, max_bytes: int, max_age_s: float) -> None:
        self.transport = transport
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        sock = transport.get_extra_info("socket") if transport is not None else None
        self._fd = sock.fileno() if sock is not None and _OUTQ is not None else -1
        self._total = 0  # bytes handed to the transport so far
        self._frames: deque[tuple[int, float]] = deque()  # (end offset, when sent) of frames maybe not delivered

    def queued(self) -> int:
        """Bytes handed over and not yet acknowledged by the device's TCP stack."""
        n = self.transport.get_write_buffer_size() if self.transport is not None else 0
        if self._fd >= 0:
            try:
                n += struct.unpack("i", fcntl.ioctl(self._fd, _OUTQ, b"\0\0\0\0"))[0]
            except OSError:  # not Linux, or the socket is gone: the transport's buffer alone
                pass
        return n

    def sent(self, n_bytes: int) -> str:
        """A frame of `n_bytes` was handed over: "" while within the budget, else why it is overdrawn."""
        self._total += n_bytes + self._HEADER
        self._frames.append((self._total, time.monotonic()))
        return self.overdrawn()

    async def settle(self) -> str:
        """Wait while the device has more than PAUSE_BYTES (or half the budget) unread: "" once it caught
        up, else why the budget ran out meanwhile."""
        pause = min(self.PAUSE_BYTES, self.max_bytes // 2)
        while (why := self.overdrawn()) == "" and self.queued() > pause:
            await asyncio.sleep(self.POLL_S)
        return why

    def overdrawn(self) -> str:
        """ "" while within the budget, else why not (the bytes unread, or the age of the oldest)."""
        now = time.monotonic()
        queued = self.queued()
        while self._frames and self._frames[0][0] <= self._total - queued:
            self._frames.popleft()
        if queued > self.max_bytes:
            return f"slow reader: {queued} bytes of replies unread, over the limit of {self.max_bytes}"
        if self._frames and now - self._frames[0][1] > self.max_age_s:
            return f"slow reader: a reply unread for {now - self._frames[0][1]:.0f} s (limit {self.max_age_s:g} s)"
        return ""


class _FailureLog:
    """At most one traceback per interval server-wide (a `TracebackLimit`, by default the process's own,
    which every logged traceback shares); the others are counted and the count is reported with the
    next one. Why: a client that can make its session fail must not be able to flood the log (50 such
    connections once wrote 44 KB of tracebacks in 0.2 s)."""

    def __init__(self, every_s: float | None = None, limit: TracebackLimit | None = None) -> None:
        self.limit = limit or TracebackLimit(every_s if every_s is not None else TRACEBACK_EVERY_S)

    def report(self, what: str) -> None:
        """Log the exception being handled, if the limit admits a traceback now."""
        n = self.limit.admit()
        if n is None:
            log.debug("%s failed (traceback not repeated)", what)
            return
        more = f" ({n} more failures since the last traceback)" if n else ""
        log.error("%s failed; the session is closed%s", what, more, exc_info=True, extra={ADMITTED: True})


_TRANSPORT = "tokenrouter.transport"


class _TransportAccess:
    """ASGI middleware: puts the connection's asyncio transport (uvicorn's) in the scope.

    Why: ASGI has no way to abort a connection, and its close waits for room in the send buffer,
    which a client that reads nothing never makes; its socket would stay open, buffer and all."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if transport is not None and hasattr(transport, "abort"):
                scope[_TRANSPORT] = transport
        await self.app(scope, receive, send)


def _client_gone(ws: WebSocket) -> bool:
    from starlette.websockets import WebSocketState

    return ws.client_state == WebSocketState.DISCONNECTED or ws.application_state == WebSocketState.DISCONNECTED


def close_reason(text: str) -> str:
    """A WebSocket close reason: valid UTF-8 of at most 123 bytes (RFC 6455), whatever the client
    sent (unpaired surrogates, long multi-byte text); websockets refuses to send any other."""
    return text.encode("utf-8", "replace")[:MAX_CLOSE_REASON_BYTES].decode("utf-8", "ignore")


async def _close_socket(
    ws: WebSocket,
    code: int,
    reason: str,
    farewell: Message | None = None,
    timeout_s: float = 1.0,
    linger: bool = True,
) -> None:
    """Send `farewell` (if any) and a close frame, each within `timeout_s`; if the socket cannot
    take them in time (the client reads nothing), abort the connection instead of leaving it open.
    `linger=False` (a connection without a session): the connection ends once the close frame is
    written, without waiting up to uvicorn's 10 s for the client to answer it, which a hostile
    client never does (each wait holds a file descriptor)."""
    transport = ws.scope.get(_TRANSPORT)
    try:
        if farewell is not None:
            frame = encode(farewell)
            await asyncio.wait_for(ws.send_text(frame) if isinstance(frame, str) else ws.send_bytes(frame), timeout_s)
        await asyncio.wait_for(ws.close(code, close_reason(reason)), timeout_s)
        if not linger and transport is not None:
            transport.close()  # the close frame is flushed first
        return
    except asyncio.TimeoutError:
        pass
    except Exception:  # already closed by the client
        return
    if transport is not None and not transport.is_closing():
        transport.abort()


def _decode(frame: str | bytes, max_bytes: int) -> Message:
    """decode(), with the parser's own failures (e.g. JSON nested thousands deep) turned into a bad_frame error."""
    try:
        return decode(frame, max_bytes)
    except (RecursionError, ValueError, TypeError, OverflowError, UnicodeError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"message cannot be parsed ({type(exc).__name__})") from None


def _request_id(frame: str | bytes) -> int | None:
    """Best-effort request id of a refused frame, so the device can match the error."""
    try:
        text = frame if isinstance(frame, str) else frame[4 : 4 + int.from_bytes(frame[:4], "big")]
        rid = json.loads(text).get("request_id")
        return (
            rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_REQUEST_ID else None
        )  # never echo an invalid id: the device would refuse the error carrying it
    except Exception:
        return None
