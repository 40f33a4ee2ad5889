"""API keys: loaded from a file or the environment, kept only as sha256 digests."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from cloud_server.quotas import KeyPolicy

ENV_VAR = "TOKENROUTER_API_KEYS"
_LIMITS = (  # KeyPolicy's limits
    "max_sessions",
    "tokens_per_minute",
    "max_cloud_fraction",
    "kv_churn_per_minute",
    "explore_per_minute",
    "engine_seconds_per_minute",
)
_INT_LIMITS = ("max_sessions", "tokens_per_minute", "kv_churn_per_minute", "explore_per_minute")


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def load_keys(path: str | None) -> list[str]:
    """Keys from FILE (one per line, '#' comments, plain or 'sha256:<hex>', optional quota options) and $TOKENROUTER_API_KEYS (comma-separated)."""
    keys: list[str] = []
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"cannot read API key file {path}: {exc.strerror}") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    keys += [k.strip() for k in os.environ.get(ENV_VAR, "").split(",") if k.strip()]
    return keys


def _parse_line(line: str, default: KeyPolicy) -> tuple[str, KeyPolicy]:
    """'KEY [name=N] [max_sessions=N] [tokens_per_minute=N] [max_cloud_fraction=F] [kv_churn_per_minute=N]
    [explore_per_minute=N] [engine_seconds_per_minute=F]' -> (digest, policy)."""
    key, *opts = line.split()
    d = key if key.startswith("sha256:") else digest(key)
    fields: dict[str, object] = {"name": "key-" + d[7:15], "digest": d}
    for opt in opts:
        name, sep, value = opt.partition("=")
        try:
            if name == "name" and sep:
                fields["name"] = value
            elif name in _INT_LIMITS and sep:
                fields[name] = int(value)
            elif name in ("max_cloud_fraction", "engine_seconds_per_minute") and sep:
                fields[name] = float(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"API key entry {fields['name']}: bad option {opt!r}; use name=, max_sessions=, tokens_per_minute=, "
                "max_cloud_fraction=, kv_churn_per_minute=, explore_per_minute= or engine_seconds_per_minute="
            ) from None
    base = {f: getattr(default, f) for f in _LIMITS}
    base.update(fields)
    return d, KeyPolicy(**base)  # type: ignore[arg-type]


class KeyChecker:
    """Known keys, as digests, each with its quota policy (defaults from `default`)."""

    def __init__(self, keys: list[str], insecure: bool = False, default: KeyPolicy | None = None) -> None:
        self.insecure = insecure
        self.default = default or KeyPolicy()
        self._policies: dict[str, KeyPolicy] = dict(_parse_line(k, self.default) for k in keys if k.strip())
        self._digests = set(self._policies)
        if not insecure and not self._digests:
            raise ValueError(
                f"no API keys configured: pass --api-keys FILE or set ${ENV_VAR}, or --insecure for local use"
            )

    def check(self, key: str) -> bool:
        return self.identify(key) is not None

    def identify(self, key: str) -> KeyPolicy | None:
        """The key's policy, or None for an unknown key (compared in constant time)."""
        d = digest(key)
        found = None
        for known in self._digests:
            if hmac.compare_digest(d, known):
                found = self._policies[known]
        if found is None and self.insecure:
            return KeyPolicy(
                name="anonymous",
                digest=d,
                **{f: getattr(self.default, f) for f in _LIMITS},
            )
        return found
