"""Structured logs (issue 20): the formats, and the request context on a request's lines only."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

import pytest

from tokenmill import logs
from tokenmill.settings import Settings


def _record(message: str = "served %s", *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("tokenmill.gateway", logging.WARNING, __file__, 1, message, args, exc_info)


def _in_context(fn: object) -> str:
    """`fn()` in a context of its own, as a request's task runs."""
    import contextvars

    return contextvars.copy_context().run(fn)  # type: ignore[arg-type]


def test_a_json_line_has_the_fields_and_the_request_context() -> None:
    def line() -> str:
        logs.bind(request_id="req_1", org_id="org_1", key_id="key_1", model="m", trace_id="ab" * 16)
        logs.bind(key_id=None)  # None adds nothing (and keeps what is there)
        return logs.JsonFormatter().format(_record("served %s", "it", exc=True))

    obj = json.loads(_in_context(line))
    assert obj["ts"].endswith("Z") and obj["ts"][10] == "T"
    assert (obj["level"], obj["logger"], obj["message"]) == ("WARNING", "tokenmill.gateway", "served it")
    assert (obj["request_id"], obj["org_id"], obj["key_id"], obj["model"]) == ("req_1", "org_1", "key_1", "m")
    assert obj["trace_id"] == "ab" * 16
    assert "ValueError: boom" in obj["exc_info"]
    # one line, whatever the message holds
    text = logs.JsonFormatter().format(_record("two\nlines"))
    assert "\n" not in text and json.loads(text)["message"] == "two\nlines"
    assert "request_id" not in json.loads(text)  # outside the request: no context


def test_a_text_line_is_readable_with_the_context_appended() -> None:
    def line() -> str:
        logs.bind(request_id="req_2", model="m")
        return logs.TextFormatter().format(_record(exc=True))

    first, *traceback = _in_context(line).splitlines()
    assert first.endswith("WARNING tokenmill.gateway: served %s  [request_id=req_2 model=m]")
    assert traceback[-1] == "ValueError: boom"
    assert logs.TextFormatter().format(_record("plain")).endswith("tokenmill.gateway: plain")


async def test_each_request_task_logs_its_own_context() -> None:
    seen: dict[str, list[str]] = {}

    async def request(rid: str) -> None:
        logs.bind(request_id=rid)
        await asyncio.sleep(0)  # the other request runs meanwhile

        async def child() -> None:  # a task the request starts copies its context
            seen.setdefault(rid, []).append(logs.context()["request_id"])

        await asyncio.gather(child(), asyncio.create_task(child()))
        logs.bind(model=f"model-{rid}")
        seen[rid].append(logs.context()["model"])

    await asyncio.gather(asyncio.create_task(request("a")), asyncio.create_task(request("b")))
    assert seen == {"a": ["a", "a", "model-a"], "b": ["b", "b", "model-b"]}
    assert dict(logs.context()) == {}  # nothing leaked out of the requests


def test_configure_sends_every_line_through_one_format() -> None:
    """In a fresh process (pytest owns this one's root logger): JSON from our loggers, from
    libraries and from Python's warnings; the secret-bearing loggers stay shut at DEBUG."""
    code = (
        "import logging, warnings\n"
        "from tokenmill import logs\n"
        "logs.configure('DEBUG', 'json')\n"
        "logs.configure('DEBUG', 'json')\n"  # twice: still one handler
        "logging.getLogger('tokenmill.x').debug('hello %s', 'there')\n"
        "logging.getLogger('sqlalchemy.engine').info('SELECT hash FROM api_keys')\n"
        "warnings.warn('careful')\n"
        "assert logs.current_format() == 'json'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = [json.loads(ln) for ln in out.stderr.splitlines()]
    assert [(ln["logger"], ln["level"]) for ln in lines] == [
        ("tokenmill.x", "DEBUG"),
        ("py.warnings", "WARNING"),
    ], out.stderr
    assert lines[0]["message"] == "hello there" and "careful" in lines[1]["message"]


def test_the_format_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_LOG_FORMAT", raising=False)
    assert Settings().log_format == "text"
    monkeypatch.setenv("TOKENMILL_LOG_FORMAT", "json")
    assert Settings().log_format == "json"
    monkeypatch.setenv("TOKENMILL_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="log_format"):
        Settings()
