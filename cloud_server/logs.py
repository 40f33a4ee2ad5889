"""Server logging: one format for every line (ours and uvicorn's), no secrets, no forged lines.

Why: an operator's log pipeline parses each line; a client must not be able to break that
(a newline in a client-supplied value would start a fake line) nor to put its key in the log
(uvicorn's access lines print the query string, where a client may put a key).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")

# C0/C1 control characters, Unicode line/paragraph separators, and unpaired surrogates
# (which cannot even be written to a UTF-8 stream)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def escape(text: str) -> str:
    """`text` on one line: control characters and surrogates as Python escapes (\\n, \\x1b, \\ud800)."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), text)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (and exc, the traceback, if any).

    JSON escaping keeps every value on its line; ensure_ascii also escapes surrogates."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=True, default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, the message escaped onto one line; a traceback follows on
    lines indented by four spaces, so no line a client influences can look like a record."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return "\n".join("    " + escape(line) for line in super().formatException(ei).splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "\n".join("    " + escape(line) for line in stack_info.splitlines())


class NoQueryString(logging.Filter):
    """Cuts query strings off the paths uvicorn logs (`GET /healthz?key=...`, `WebSocket /v1/route?...`):
    a client may put a key there, and a log is no place for it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("uvicorn") and isinstance(record.args, tuple):
            record.args = tuple(_path_only(a) for a in record.args)
        return True


def _path_only(arg: object) -> object:
    if isinstance(arg, str) and arg.startswith("/") and "?" in arg:
        return arg.split("?", 1)[0]
    return arg


def setup_logging(level: str = "warning", fmt: str = "text", stream: Any = None) -> logging.Handler:
    """One stderr handler on the root logger for every logger, uvicorn's included.

    uvicorn must then be started with `log_config=None` (so it installs no handlers of its
    own); its loggers are reset here to propagate to this handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(NoQueryString())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:
        lg = logging.getLogger(name)
        for old in list(lg.handlers):
            lg.removeHandler(old)
        lg.propagate = True
    logging.captureWarnings(True)  # warnings.warn lines go through the same format
    return handler
