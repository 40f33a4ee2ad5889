"""The app's loopback server: the page, its API and its WebSocket, behind a per-launch token.

Only 127.0.0.1 is bound. Every HTTP and WebSocket request must carry the launch's random token as
the first path segment (`/<token>/...`, compared in constant time), name this server in its Host
header (no DNS rebinding) and, for a WebSocket or a POST, come from the page's own origin. So
another local user's process, or a web page in the same browser, cannot drive the microphone.
The browser is opened on a one-time link (`/open/<nonce>`) that redirects to the tokened page:
the command line of the browser process, which other users can read, then holds nothing reusable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from edge_client.voice.resample import resample
from edge_client.voice.wavfile import AudioFileError, read_audio

from .core import AppCore
from .session import CLOSE_TAKEN_OVER, Session
from .settings import SettingsError

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
MAX_UPLOAD = 64 << 20  # a dropped audio file
NO_TOKEN = "missing or wrong token"


class Guard:
    """ASGI middleware: token, Host and Origin checks on every request, before any route runs."""

    def __init__(self, app: ASGIApp, server: AppServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        why = self.server.refusal(scope)
        if why is None:
            await self.app(scope, receive, send)
            return
        log.info("refused %s %s: %s", scope["type"], scope.get("path"), why)
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        if why == NO_TOKEN:  # a person who typed the bare address: say where the full one is
            why += (
                ". This is the TokenRouter assistant; its address ends with a secret token. Open the full "
                f"address printed in the terminal where `tokenrouter-edge app` runs "
                f"(http://127.0.0.1:{self.server.port}/<token>/)."
            )
        await PlainTextResponse(f"forbidden: {why}", status_code=403)(scope, receive, send)


class AppServer:
    """The HTTP/WebSocket server of one launch; `core` may still be loading when it starts."""

    def __init__(self, core: AppCore, port: int = 0, token: str | None = None) -> None:
        self.core = core
        self.token = token or secrets.token_urlsafe(24)
        self._nonce: str | None = secrets.token_urlsafe(16)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(("127.0.0.1", port))
        except OSError:
            if not port:
                raise
            log.warning("port %d is taken; using a free one", port)
            self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)  # connections wait in the backlog until the server runs: the printed address works at once
        self.port = self.sock.getsockname()[1]
        self.hosts = {f"127.0.0.1:{self.port}", f"localhost:{self.port}"}
        self.origins = {f"http://{h}" for h in self.hosts}
        self._attach = asyncio.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.app = self._build()

    @property
    def url(self) -> str:
        """The page, token included (printed for the person; never put on another process's command line)."""
        return f"http://127.0.0.1:{self.port}/{self.token}/"

    @property
    def launch_url(self) -> str:
        """A one-time link to the page, for the browser's command line."""
        return f"http://127.0.0.1:{self.port}/open/{self._nonce}"

    # ---------------------------------------------------------------- checks

    def refusal(self, scope: Scope) -> str | None:
        """Why this request is refused, or None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if headers.get("host") not in self.hosts:
            return "wrong Host header"
        path: str = scope.get("path", "")
        if scope["type"] == "http" and path.startswith("/open/") and scope.get("method") == "GET":
            return None  # the one-time launch link checks its own nonce
        seg = path[1:].split("/", 1)[0]
        if not secrets.compare_digest(seg.encode(), self.token.encode()):
            return NO_TOKEN
        origin = headers.get("origin")
        if scope["type"] == "websocket" and origin not in self.origins:
            return "WebSocket from another origin"
        if scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD") and origin not in self.origins:
            return "request from another origin"
        return None

    # ---------------------------------------------------------------- routes

    def _build(self) -> Starlette:
        t = self.token
        routes = [
            Route("/open/{nonce}", self._open),
            Route(f"/{t}", lambda r: RedirectResponse(f"/{t}/", status_code=303)),
            Route(f"/{t}/", self._index),
            Route(f"/{t}/static/{{name}}", self._static),
            Route(f"/{t}/api/settings", self._settings, methods=["GET", "POST"]),
            Route(f"/{t}/api/cloud-test", self._cloud_test, methods=["POST"]),
            Route(f"/{t}/api/file", self._file, methods=["POST"]),
            WebSocketRoute(f"/{t}/ws", self._ws),
        ]
        app = Starlette(routes=routes)
        app.add_middleware(Guard, server=self)  # type: ignore[arg-type]
        return app

    def _headers(self) -> dict[str, str]:
        ws = " ".join(f"ws://{h}" for h in sorted(self.hosts))
        return {
            "Cache-Control": "no-store",
            "Referrer-Policy": "no-referrer",
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": (
                f"default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self' {ws}; img-src 'self' data:; "
                "media-src 'self' blob:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
            ),
        }

    async def _open(self, request: Request) -> Response:
        nonce = request.path_params["nonce"]
        if self._nonce is not None and secrets.compare_digest(nonce.encode(), self._nonce.encode()):
            self._nonce = None  # one use
            return RedirectResponse(f"/{self.token}/", status_code=303, headers={"Referrer-Policy": "no-referrer"})
        log.warning("the one-time launch link was used twice (by another client?); open %s", self.url)
        return PlainTextResponse(
            "this launch link was already used: open the address printed in the terminal", status_code=403
        )

    async def _index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=self._headers())

    async def _static(self, request: Request) -> Response:
        name = request.path_params["name"]
        path = STATIC / name
        if "/" in name or name.startswith(".") or not path.is_file():
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(path, headers=self._headers())

    async def _settings(self, request: Request) -> Response:
        core = self.core
        if request.method == "GET":
            return JSONResponse(
                {"settings": core.settings.public(), "devices": core.devices() if core.audio == "device" else None}
            )
        try:
            changes = await request.json()
            if not isinstance(changes, dict):
                raise SettingsError("", "send a JSON object of settings")
        except (ValueError, json.JSONDecodeError):
            return JSONResponse({"error": "send a JSON object of settings", "field": ""}, status_code=400)
        except SettingsError as e:
            return JSONResponse({"error": str(e), "field": e.field}, status_code=400)
        if not core.ready.is_set() or core.gen is None:
            return JSONResponse({"error": "the assistant is still loading", "field": ""}, status_code=409)
        old = core.settings
        try:
            new = await asyncio.to_thread(core.apply, changes)
        except SettingsError as e:
            return JSONResponse({"error": str(e), "field": e.field}, status_code=400)
        except ValueError as e:  # refused by the generator (names the option)
            return JSONResponse({"error": str(e), "field": ""}, status_code=400)
        if core.active is not None:
            core.active.settings_changed(old, new)
        return JSONResponse({"settings": new.public(), "note": "applies from the next answer"})

    async def _cloud_test(self, request: Request) -> Response:
        core = self.core
        try:
            body = await request.json()
            cloud = str(body.get("cloud", core.settings.cloud)).strip()
            key = body.get("api_key")
            core.settings.updated({"cloud": cloud})  # validates the URL's form
        except (ValueError, AttributeError, json.JSONDecodeError) as e:
            return JSONResponse({"ok": False, "message": str(e) or "send a JSON object"}, status_code=400)
        if not core.ready.is_set() or core.gen is None:
            return JSONResponse({"ok": False, "message": "the assistant is still loading"}, status_code=409)
        result = await asyncio.to_thread(core.test_cloud, cloud, key if isinstance(key, str) and key else None)
        if core.active is not None:
            core.active.send(core.cloud_status())  # a test of the cloud in force updates the badge
        return JSONResponse(result)

    async def _file(self, request: Request) -> Response:
        """A dropped audio file: decoded, resampled and played into the pipeline as if spoken."""
        name = request.headers.get("x-filename", "the file")[:200]
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_UPLOAD:
                return JSONResponse({"error": f"{name}: larger than {MAX_UPLOAD >> 20} MB"}, status_code=413)
        session = self.core.active
        if session is None or session.gate is None:
            return JSONResponse({"error": "the assistant is not listening yet"}, status_code=409)
        try:
            x, rate = await asyncio.to_thread(read_audio, bytes(body), name)
        except AudioFileError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        audio = resample(x, rate, 16000)
        audio = np.concatenate([audio, np.zeros(int(0.5 * 16000), np.float32)])  # silence ends the turn
        session.inject_file(audio)
        return JSONResponse({"ok": True, "seconds": round(len(x) / rate, 2)})

    async def _ws(self, ws: WebSocket) -> None:
        await ws.accept()
        core = self.core
        session = Session(core, ws, asyncio.get_running_loop())
        sender = asyncio.create_task(session.sender())
        try:
            if not core.ready.is_set():
                session.send({"type": "loading", "message": "loading the models..."})
                while not core.ready.is_set():  # listening meanwhile, so a closed tab or a stopping server ends this
                    try:
                        msg = await asyncio.wait_for(ws.receive(), 0.2)
                    except asyncio.TimeoutError:
                        continue
                    if msg["type"] == "websocket.disconnect":
                        return
            if core.load_error is not None:
                session.send({"type": "fatal", "message": f"the assistant could not start: {core.load_error}"})
                return
            async with self._attach:
                old = core.active
                if old is not None:  # a second tab takes over; the first is told why
                    old.send({"type": "taken_over", "message": "the assistant is now in use in another tab"})
                    await old.shutdown(CLOSE_TAKEN_OVER, "taken over by another tab")
                core.active = session
            session.send(session.hello())
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                if msg.get("bytes") is not None:
                    session.on_audio(msg["bytes"])
                elif msg.get("text"):
                    try:
                        ctl = json.loads(msg["text"])
                    except ValueError:
                        continue
                    if isinstance(ctl, dict):
                        try:
                            await session.on_control(ctl)
                        except (TypeError, ValueError) as e:  # a malformed message: ignored, the session goes on
                            log.info("ignored control message %r: %s", ctl, e)
        except WebSocketDisconnect:
            pass
        finally:
            async with self._attach:
                if core.active is session:
                    core.active = None
            await session.shutdown()
            sender.cancel()

    # ---------------------------------------------------------------- running

    def config(self) -> Any:
        import uvicorn

        return uvicorn.Config(self.app, log_level="warning", lifespan="off", ws_max_size=1 << 20, ws_ping_interval=20)

    def run(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C)."""
        import uvicorn

        self._server = uvicorn.Server(self.config())
        self._server.run(sockets=[self.sock])

    def start(self) -> None:
        """Serve on a background thread (tests, benchmarks); returns once the socket accepts."""
        import uvicorn

        self._server = uvicorn.Server(self.config())
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self.sock]}, name="app-server", daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the app server did not start")
            threading.Event().wait(0.02)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=20)
