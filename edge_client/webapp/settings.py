"""The app's settings: validated, and kept in the user's config file with owner-only permissions.

The cloud key lives here and nowhere else (never in the page's URL, never sent back to the page);
the file is written atomically with mode 0600 so another local user cannot read the key.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from edge_client.options import DEFAULT_CHECK
from shared.decision import CHECK_MODES

log = logging.getLogger(__name__)

TALK_MODES = ("hands-free", "push-to-talk")
BUNDLED_VOICE = "en_US-joe-medium"  # the Piper voice the voice extra ships (edge_client/voice/assets.py)


class SettingsError(ValueError):
    """A setting the app cannot use; `field` names it so the page can point at it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class AppSettings:
    cloud: str = "local"  # "local" (a loopback server started by the app), "none" (device only) or a ws(s):// URL
    api_key: str = ""  # for a remote cloud; never sent to the page
    cloud_fraction: float = 0.3
    check: str = DEFAULT_CHECK
    voice: str = BUNDLED_VOICE
    pace: float = 1.0  # Piper's length scale: above 1 speaks slower
    talk_mode: str = "hands-free"
    echo_cancellation: bool = True  # the browser's (getUserMedia); off only to hear the difference
    barge_in: bool = True  # listen while speaking (full duplex)
    input_device: str = ""  # --audio device: name part or index ("" = system default)
    output_device: str = ""

    def validate(self) -> None:
        c = self.cloud.strip()
        if c not in ("local", "none") and not re.match(r"^wss?://[^\s/]+(/\S*)?$", c):
            raise SettingsError("cloud", f"cloud must be 'local', 'none' or a ws:// or wss:// URL, not {c!r}")
        if not isinstance(self.cloud_fraction, (int, float)) or not 0.0 <= float(self.cloud_fraction) <= 1.0:
            raise SettingsError(
                "cloud_fraction", f"cloud fraction must be between 0 and 1, not {self.cloud_fraction!r}"
            )
        if self.check not in CHECK_MODES:
            raise SettingsError("check", f"check mode must be one of {', '.join(CHECK_MODES)}, not {self.check!r}")
        if self.voice != BUNDLED_VOICE:
            raise SettingsError("voice", f"unknown voice {self.voice!r}; this install has {BUNDLED_VOICE}")
        if not isinstance(self.pace, (int, float)) or not 0.5 <= float(self.pace) <= 2.0:
            raise SettingsError("pace", f"pace must be between 0.5 and 2, not {self.pace!r}")
        if self.talk_mode not in TALK_MODES:
            raise SettingsError(
                "talk_mode", f"talk mode must be one of {', '.join(TALK_MODES)}, not {self.talk_mode!r}"
            )
        if "\n" in self.api_key or len(self.api_key) > 4096:
            raise SettingsError("api_key", "the API key must be one line")

    def updated(self, changes: dict[str, Any]) -> AppSettings:
        """A validated copy with `changes` (unknown names and wrong types refused, naming the setting)."""
        known = {f.name: f for f in fields(self)}
        clean: dict[str, Any] = {}
        for k, v in changes.items():
            if k not in known:
                raise SettingsError(k, f"unknown setting {k!r}")
            cur = getattr(self, k)
            if isinstance(cur, bool):
                if not isinstance(v, bool):
                    raise SettingsError(k, f"{k} must be true or false")
            elif isinstance(cur, float):
                if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                    raise SettingsError(k, f"{k} must be a number")
                try:
                    v = float(v)
                except ValueError:
                    raise SettingsError(k, f"{k} must be a number, not {v!r}") from None
            elif not isinstance(v, str):
                raise SettingsError(k, f"{k} must be text")
            else:
                v = v.strip()
            clean[k] = v
        new = replace(self, **clean)
        new.validate()
        return new

    def public(self) -> dict[str, Any]:
        """What the page may see: everything but the key (only whether one is stored)."""
        d = asdict(self)
        d["api_key_set"] = bool(d.pop("api_key"))
        return d


def default_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "tokenrouter" / "app.json"


class SettingsStore:
    """Loads and saves AppSettings as JSON, owner-only (0600 file in a 0700 directory)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else default_path()

    def load(self) -> AppSettings:
        """The saved settings; defaults when there is no file. A setting that no longer validates is
        dropped with a warning (the app still starts)."""
        if not self.path.is_file():
            return AppSettings()
        mode = stat.S_IMODE(self.path.stat().st_mode)
        if mode & 0o077:
            log.warning("%s was readable by others (mode %o); made it owner-only", self.path, mode)
            os.chmod(self.path, 0o600)
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable settings file %s: %s", self.path, e)
            return AppSettings()
        s = AppSettings()
        for k, v in (raw if isinstance(raw, dict) else {}).items():
            try:
                s = s.updated({k: v})
            except SettingsError as e:
                log.warning("ignoring setting %s in %s: %s", k, self.path, e)
        return s

    def save(self, s: AppSettings) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(s), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)  # in case the file existed with a wider mode
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
