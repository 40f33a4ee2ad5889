"""The FastAPI application: the WebSocket endpoint plus health and info routes.

    GET  /healthz   liveness: {"status": "ok", "sessions": N}
    GET  /v1/info   model name, fingerprints, protocol version, limits
    WS   /v1/route  the routing protocol (shared/protocol.py, docs/protocol.md)
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from cloud_server.auth import KeyChecker
from cloud_server.config import ServerConfig
from cloud_server.engine import CloudEngine, EngineWorker
from cloud_server.session import Connection, ConnectionDone
from models.registry import model_info
from shared.protocol import PROTOCOL_VERSION, Error, ErrorCode, Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)

WS_PATH = "/v1/route"
POLICY_VIOLATION = 1008


def create_app(config: ServerConfig) -> FastAPI:
    """Load the model and build the app (the model loads once, before serving)."""
    keys = KeyChecker(config.api_keys, insecure=config.insecure)
    info = model_info(config.model)
    worker = EngineWorker(CloudEngine(info, n_ctx=config.n_ctx, max_sessions=config.max_sessions, threads=config.threads))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.shutdown()

    app = FastAPI(title="TokenRouter cloud", version=str(PROTOCOL_VERSION), lifespan=lifespan)
    app.state.worker = worker

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "sessions": worker.engine.n_sessions}

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
        }

    @app.websocket(WS_PATH)
    async def route(ws: WebSocket) -> None:
        await ws.accept()

        async def send(msg: Message) -> None:
            frame = encode(msg)
            if isinstance(frame, str):
                await ws.send_text(frame)
            else:
                await ws.send_bytes(frame)

        conn = Connection(worker, config, keys, info, send)
        try:
            while True:
                event = await ws.receive()
                if event["type"] == "websocket.disconnect":
                    break
                frame = event.get("bytes") if event.get("bytes") is not None else event.get("text", "")
                try:
                    await conn.on_message(decode(frame, config.max_message_bytes))
                except ProtocolError as exc:
                    conn.n_errors += 1
                    log.info("session %s: %s", conn.session_id or "-", exc)
                    await send(Error(code=exc.code, message=exc.message, request_id=_request_id(frame)))
                    if conn.n_errors >= config.max_errors_per_connection:
                        await ws.close(POLICY_VIOLATION, "too many protocol errors")
                        break
        except ConnectionDone:
            await _close_quietly(ws)
        except WebSocketDisconnect:
            pass
        except Exception:  # never let one session take the server down
            log.exception("session %s failed", conn.session_id or "-")
            try:
                await send(Error(code=ErrorCode.INTERNAL, message="internal server error; the session is closed"))
            except Exception:
                pass
            await _close_quietly(ws)
        finally:
            await conn.close()

    return app


async def _close_quietly(ws: WebSocket) -> None:
    try:
        await ws.close()
    except Exception:
        pass


def _request_id(frame: str | bytes) -> int | None:
    """Best-effort request id of a refused frame, so the device can match the error."""
    import json

    try:
        text = frame if isinstance(frame, str) else frame[4 : 4 + int.from_bytes(frame[:4], "big")]
        rid = json.loads(text).get("request_id")
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    except Exception:
        return None
