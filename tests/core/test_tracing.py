"""Tracing (issue 20): when the OTEL_* settings turn it on, the SERVER spans of the servers and
the gateway's step spans; when off, nothing of OpenTelemetry even imported. The whole journey
through real processes is tests/e2e/test_tracing.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.tracing import _timed, _worker_call
from tokenmill import logs, tracing


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),  # off by default
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),  # the SDK's default endpoint, localhost:4318
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, False),  # not ours to print among the logs
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, True),
    ],
)
def test_which_settings_turn_tracing_on(env: dict[str, str], on: bool) -> None:
    assert tracing.enabled(env) is on


def test_off_no_tracer_is_set_up() -> None:
    """The servers as they start without OTEL_* settings: the tracing SDK and its exporter
    never imported, so the request path cannot be calling into them (redis-py imports
    OpenTelemetry's API and metrics for its own optional instrumentation: not ours to judge)."""
    code = (
        "import sys\n"
        "import tokenmill.app, tokenmill.cli, gateway.services, gateway.controllers\n"
        "import workers.main, workers.server, workers.generator\n"
        "from tokenmill import tracing\n"
        "assert tracing.setup('tokenmill-gateway') is False and tracing.tracer() is None\n"
        "ours = ('opentelemetry.sdk.trace', 'opentelemetry.exporter')\n"
        "loaded = [m for m in sys.modules if m.startswith(ours)]\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on, in this process, with the spans kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def _asgi(status: int, seen: list[Any]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((tracing.CURRENT.get(), dict(logs.context())))
        if status >= 500:
            raise RuntimeError("the prompt was: secret words")
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return app


def _call(app: Any, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers or [], "state": {}}
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    async def run() -> None:
        with contextlib.suppress(RuntimeError):  # the failing app's error, past the middleware
            await app(scope, receive, send)

    asyncio.run(run())


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_worker_continues_the_callers_trace(spans: InMemorySpanExporter) -> None:
    seen: list[Any] = []
    app = tracing.ServerSpans(_asgi(200, seen), paths=("/generate",), remote=True)
    _call(app, "/generate", [(b"traceparent", TRACEPARENT.encode())])
    (span,) = spans.get_finished_spans()
    assert span.name == "POST /generate" and span.kind is SpanKind.SERVER
    assert f"{span.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert span.parent is not None and f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    assert span.attributes["http.response.status_code"] == 200
    # inside: the current span, and its trace id on the request's log lines
    assert seen == [(seen[0][0], {"trace_id": "0af7651916cd43dd8448eb211c80319c"})]
    assert seen[0][0] is not None and tracing.CURRENT.get() is None


def test_the_gateway_starts_its_own_trace_and_traces_only_inference(spans: InMemorySpanExporter) -> None:
    seen: list[Any] = []
    app = tracing.ServerSpans(_asgi(500, seen), paths=("/v1/chat/completions",))
    _call(app, "/v1/chat/completions", [(b"traceparent", TRACEPARENT.encode())])
    _call(app, "/v1/models")
    (span,) = spans.get_finished_spans()
    assert span.parent is None and f"{span.context.trace_id:032x}" != "0af7651916cd43dd8448eb211c80319c"
    assert span.status.status_code is StatusCode.ERROR
    # the kind of failure, never its message (which may quote a prompt)
    assert span.attributes["error.type"] == "RuntimeError"
    assert "secret" not in repr(span.attributes) + repr(span.status.description) + repr(span.events)
    assert [current is None for current, _ in seen] == [False, True]  # /v1/models: untraced


def _by_name(spans: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans.get_finished_spans()}


async def test_a_step_becomes_a_child_span_of_the_request_only_inside_one(
    spans: InMemorySpanExporter,
) -> None:
    async def admit(n: int) -> int:
        if n < 0:
            raise ValueError("bad")
        return n

    timed = _timed("gateway.admission", admit, {"tokenmill.admission": "tokens"})
    assert await timed(1) == 1  # no request span: nothing recorded
    assert spans.get_finished_spans() == ()
    root = tracing.start("POST /v1/chat/completions", None, kind="SERVER")
    token = tracing.CURRENT.set(root)
    try:
        assert await timed(2) == 2
        with pytest.raises(ValueError):
            await timed(-1)
    finally:
        tracing.CURRENT.reset(token)
    ok, failed = spans.get_finished_spans()
    assert ok.parent is not None and ok.parent.span_id == root.get_span_context().span_id
    assert ok.attributes == {"tokenmill.admission": "tokens"} and ok.start_time <= ok.end_time
    assert failed.status.status_code is StatusCode.ERROR and failed.attributes["error.type"] == "ValueError"


async def test_the_worker_call_sends_its_own_span_as_traceparent(spans: InMemorySpanExporter) -> None:
    sent: list[dict[str, str]] = []

    class Response:
        status_code = 200

    @contextlib.asynccontextmanager
    async def post(address: str, path: str, body: bytes, headers: Any) -> Any:
        sent.append(dict(headers))
        yield Response()

    root = tracing.start("POST /v1/chat/completions", None, kind="SERVER")
    token = tracing.CURRENT.set(root)
    try:
        async with _worker_call(post)("http://w:1", "/generate", b"{}", {"authorization": "x"}) as r:
            assert r.status_code == 200
    finally:
        tracing.CURRENT.reset(token)
    async with _worker_call(post)("http://w:1", "/generate", b"{}", {"authorization": "x"}):
        pass  # outside a traced request: the headers as they were
    call = _by_name(spans)["gateway.worker_call"]
    assert call.kind is SpanKind.CLIENT and call.attributes["http.response.status_code"] == 200
    ctx = call.context
    assert sent == [
        {
            "authorization": "x",
            "traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}",
        },
        {"authorization": "x"},
    ]


def test_engine_times_become_epoch_times() -> None:
    import time

    before = time.time_ns()
    (now,) = tracing.wall_ns(time.monotonic())
    assert before <= now <= time.time_ns()


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({}, "tokenmill-worker"),
        ({"OTEL_SERVICE_NAME": "gpu-pool-a"}, "gpu-pool-a"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes,team=ml"}, "from-attributes"),
    ],
)
def test_the_service_is_named_by_role_unless_the_settings_name_it(env: dict[str, str], name: str) -> None:
    code = (
        "from tokenmill import tracing\n"
        "assert tracing.setup('tokenmill-worker', instance='worker-7')\n"
        "attrs = tracing.tracer().resource.attributes\n"
        "print(attrs['service.name'], attrs['service.instance.id'])\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    # a port nothing listens on: the test exports nothing, it only sets up
    env = {**base, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [name, "worker-7"]
