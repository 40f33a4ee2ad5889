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
import threading
import time
from typing import Any

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
TRACEBACK_EVERY_S = 10.0  # at most one traceback per this many seconds, process-wide (the rest are counted)
ADMITTED = "traceback_admitted"  # a record's attribute: its traceback already passed the limit (no second check)


class TracebackLimit:
    """At most one traceback per `every_s` seconds; the others are counted, and the count goes with the
    next one. Why: a client that can make the server fail, with or without a key (a text frame that
    is not UTF-8 fails in uvicorn before any of our code runs), must not be able to flood the log."""

    def __init__(self, every_s: float = TRACEBACK_EVERY_S) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self.suppressed = 0

    def admit(self) -> int | None:
        """None: no traceback now (counted); else how many were held back since the last one."""
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self.suppressed += 1
                return None
            self._last, n, self.suppressed = now, self.suppressed, 0
            return n


TRACEBACKS = TracebackLimit()  # the process's one limit: the transport's failures and every logged traceback


class TracebackFilter(logging.Filter):
    """Every record that carries a traceback, whoever logs it (uvicorn's protocol layer, the ASGI app,
    the engine thread), passes `limit` unless it already did: a record held back is dropped, and the
    next one admitted says how many were."""

    def __init__(self, limit: TracebackLimit = TRACEBACKS) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or getattr(record, ADMITTED, False):
            return True
        held_back = self.limit.admit()
        if held_back is None:
            return False
        if held_back:
            record.msg = f"{record.msg} ({held_back} more failures since the last traceback)"
        setattr(record, ADMITTED, True)
        return True


# C0/C1 control characters, Unicode line/paragraph separators, bidi controls (embeddings, overrides,
# isolates and marks: U+202E would show the rest of an operator's line reversed), and unpaired
# surrogates (which cannot even be written to a UTF-8 stream)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def escape(text: str) -> str:
    """`text` on one line, shown as written: control characters, bidi controls and surrogates as
    Python escapes (\\n, \\x1b, \\u202e, \\ud800). The one escape of every text log line (`TextFormatter`;
    the JSON format escapes all of them too), so no call site that logs a client's string needs its own."""
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


def setup_logging(
    level: str = "warning", fmt: str = "text", stream: Any = None, tracebacks: TracebackLimit = TRACEBACKS
) -> logging.Handler:
    """One stderr handler on the root logger for every logger, uvicorn's included, whose tracebacks pass
    `tracebacks` (the process's limit, which the transport's failure log shares).

    uvicorn must then be started with `log_config=None` (so it installs no handlers of its
    own); its loggers are reset here to propagate to this handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(NoQueryString())
    handler.addFilter(TracebackFilter(tracebacks))
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
        lg.setLevel(logging.NOTSET)  # the root's level decides (an earlier uvicorn in this process set its own)
        lg.disabled = False
    logging.captureWarnings(True)  # warnings.warn lines go through the same format
    return handler
