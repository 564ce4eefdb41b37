"""Logging for every process (`tokenmill` commands, workers, the engine process): one setup,
readable text or one JSON object per line (`TOKENMILL_LOG_FORMAT`), and the request's context
on every line logged while a request is served.

The context (request id, organisation id, key id, model, trace id) lives in a ContextVar,
bound as the request learns it (the gateway: its request id when minted, the caller once
authenticated, the model once resolved; a worker: the request id of /generate). A request is
one asyncio task, and the tasks it starts copy its context, so its lines carry it and no other
request's do. Only identifiers go there: never a prompt, a key or any other secret.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Literal

LogFormat = Literal["text", "json"]

# The context fields, in the order lines show them.
FIELDS = ("request_id", "org_id", "key_id", "model", "trace_id")

# Copied on write (`bind`): a task started by the request sees what was bound before it started,
# and nothing a request binds can reach another request's lines.
_context: ContextVar[Mapping[str, str]] = ContextVar("tokenmill_log_context", default=MappingProxyType({}))

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Database and HTTP libraries log statements with their parameters (key hashes, password
# hashes, cache salts) or headers at DEBUG: never let TOKENMILL_LOG_LEVEL open them.
SECRET_BEARING_LOGGERS = (
    "aiosqlite",
    "asyncpg",
    "sqlalchemy.engine",
    "sqlalchemy.pool",
    "httpcore",
    "hpack",
    "botocore",
    "boto3",
    "urllib3",
    "stripe",
)


def bind(**fields: str | None) -> None:
    """Add fields to the current request's log context (None values are left out)."""
    current = _context.get()
    _context.set({**current, **{k: v for k, v in fields.items() if v is not None}})


def context() -> Mapping[str, str]:
    """The current request's log context (empty outside a request)."""
    return _context.get()


class TextFormatter(logging.Formatter):
    """The classic line, with the request's context appended: `... message  [request_id=...]`."""

    def __init__(self) -> None:
        super().__init__(TEXT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ctx = _context.get()
        if not ctx:
            return line
        fields = " ".join(f"{k}={ctx[k]}" for k in FIELDS if k in ctx)
        head, sep, tail = line.partition("\n")  # after the message, before a traceback
        return f"{head}  [{fields}]{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, message, the request's
    context fields, and the traceback (`exc_info`) or stack (`stack_info`) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        line: dict[str, object] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(_context.get())
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc_info"] = record.exc_text
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


def configure(level: str | int, fmt: LogFormat = "text") -> None:
    """Set up this process's logging on stderr, unless something (a test's capture) already
    has: every line through the one handler, so uvicorn's and the libraries' lines and Python's
    warnings come out in the same format."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(formatter(fmt))
        root.addHandler(handler)
        root.setLevel(level.upper() if isinstance(level, str) else level)
        # A warning printed by the warnings module would be a bare multi-line text among JSON.
        logging.captureWarnings(True)
    floor = max(logging.WARNING, root.level)
    # Alembic narrates every step at INFO; the commands say what matters themselves.
    logging.getLogger("alembic").setLevel(floor)
    for name in SECRET_BEARING_LOGGERS:
        logging.getLogger(name).setLevel(floor)


def current_format() -> LogFormat:
    """The format this process logs in (what a child process it spawns should use)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            return "json"
    return "text"
