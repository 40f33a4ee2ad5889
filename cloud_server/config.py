"""Cloud server options, as one plain dataclass (the CLI fills it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.registry import DEFAULT_CLOUD_MODEL
from shared.protocol import MAX_MESSAGE_BYTES


@dataclass(slots=True)
class ServerConfig:
    model: str = DEFAULT_CLOUD_MODEL
    api_keys: list[str] = field(default_factory=list)  # plain keys or "sha256:<hex>" digests
    insecure: bool = False  # accept any key (local use only)
    n_ctx: int = 8192  # KV cells shared by all sessions: the KV memory budget
    max_sessions: int = 16
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_tokens_per_request: int = 512
    max_errors_per_connection: int = 32  # then the connection is closed
    idle_timeout_s: float = 300.0
    threads: int | None = None
