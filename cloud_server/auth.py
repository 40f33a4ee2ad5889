"""API keys: loaded from a file or the environment, kept only as sha256 digests."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

ENV_VAR = "TOKENROUTER_API_KEYS"


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def load_keys(path: str | None) -> list[str]:
    """Keys from FILE (one per line, '#' comments, plain or 'sha256:<hex>') and $TOKENROUTER_API_KEYS (comma-separated)."""
    keys: list[str] = []
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"cannot read API key file {path}: {exc.strerror}") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    keys += [k.strip() for k in os.environ.get(ENV_VAR, "").split(",") if k.strip()]
    return keys


class KeyChecker:
    def __init__(self, keys: list[str], insecure: bool = False) -> None:
        self.insecure = insecure
        self._digests = {k if k.startswith("sha256:") else digest(k) for k in keys}
        if not insecure and not self._digests:
            raise ValueError(
                f"no API keys configured: pass --api-keys FILE or set ${ENV_VAR}, or --insecure for local use"
            )

    def check(self, key: str) -> bool:
        if self.insecure:
            return True
        d = digest(key)
        return any(hmac.compare_digest(d, known) for known in self._digests)
