"""OpenTelemetry tracing, off unless the standard `OTEL_*` settings turn it on.

On when `OTEL_TRACES_EXPORTER` is `otlp`, or when it is unset and an OTLP endpoint is
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`); `OTEL_SDK_DISABLED=true`
turns it off. Spans go out in batches as OTLP over HTTP/protobuf, the SDK reading the rest of
the standard settings itself (endpoint, headers, timeout, compression, certificates,
`OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_RESOURCE_ATTRIBUTES`). `OTEL_SERVICE_NAME` names
every process; unset, a gateway is `tokenmill-gateway` and a worker `tokenmill-worker`.

Off, OpenTelemetry's tracing SDK is never imported and the request path runs no tracing
code: the gateway's collaborators are wrapped (gateway/tracing.py) and the servers get
`ServerSpans` only when `setup` says tracing is on. On, a request's spans are mostly built after the fact
from times recorded on the way (`span_at`): the engine's queueing, prefill and decode come
from the timestamps it records anyway, so its step loop never calls into tracing.

One trace per request: the gateway's SERVER span, its children, the worker call as a CLIENT
span whose W3C `traceparent` header the worker continues (`ServerSpans(remote=True)`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from tokenmill import logs

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanKind, Tracer
    from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

# The SERVER span of the request this task serves (set by `ServerSpans`); tasks the request
# starts copy it, so whatever runs for the request can hang its spans under it.
CURRENT: ContextVar[Span | None] = ContextVar("tokenmill_span", default=None)

_tracer: Tracer | None = None


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* settings in `env` ask for traces (OTLP over HTTP/protobuf)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if not exporters:
        on = bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    else:
        on = "otlp" in exporters
        if exporters - {"otlp", "none"}:
            log.warning(
                "OTEL_TRACES_EXPORTER=%s: only otlp is supported; %s",
                env["OTEL_TRACES_EXPORTER"],
                "exporting over OTLP" if on else "tracing stays off",
            )
    if not on:
        return False
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip()
    if protocol and protocol != "http/protobuf":
        log.warning(
            "OTEL_EXPORTER_OTLP_PROTOCOL=%s: only http/protobuf is supported; tracing stays off", protocol
        )
        return False
    return True


def setup(service: str, *, instance: str | None = None, env: Mapping[str, str] = os.environ) -> bool:
    """Set up this process's tracing as `service` (unless OTEL_SERVICE_NAME names it) if the
    OTEL_* settings ask for it; whether it is on. Once per process: later calls only answer."""
    global _tracer
    if _tracer is not None:
        return True
    if not enabled(env):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from tokenmill import __version__

    attributes: dict[str, str] = {"service.version": __version__}
    # The SDK reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES itself; ours fills the gaps.
    named = "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if not (env.get("OTEL_SERVICE_NAME") or named):
        attributes["service.name"] = service
    if instance:
        attributes["service.instance.id"] = instance
    # Its own provider, not the global one: a library that traces on its own (with whatever
    # it would put in its spans) stays off unless the operator sets that up.
    provider = TracerProvider(resource=Resource.create(attributes))  # flushed at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _tracer = provider.get_tracer("tokenmill", __version__)
    log.info("tracing on: %s spans go out over OTLP/HTTP", provider.resource.attributes.get("service.name"))
    return True


def tracer() -> Tracer | None:
    """This process's tracer; None while tracing is off."""
    return _tracer


def _kind(name: str) -> SpanKind:
    from opentelemetry.trace import SpanKind

    return SpanKind[name]


def start(
    name: str,
    parent: Span | None,
    *,
    kind: str = "INTERNAL",
    attributes: Attributes = None,
    at: int | None = None,
) -> Span:
    """A live span (end it), child of `parent` or a new trace's root, from `at` (ns since the
    epoch) or now."""
    from opentelemetry import trace

    assert _tracer is not None
    context = trace.set_span_in_context(parent) if parent is not None else None
    return _tracer.start_span(name, context, _kind(kind), attributes=attributes, start_time=at)


def span_at(
    name: str,
    parent: Span,
    start_ns: int,
    end_ns: int | None = None,
    *,
    attributes: Attributes = None,
    error: BaseException | None = None,
) -> None:
    """A finished child span of `parent` from recorded times (ns since the epoch; end: now)."""
    span = start(name, parent, attributes=attributes, at=start_ns)
    if error is not None:
        fail(span, error)
    span.end(end_time=end_ns)


def fail(span: Span, error: BaseException) -> None:
    """Mark `span` failed by the kind of `error` only: an exception's message may quote input
    (a prompt, a header), which has no place in a trace any more than in a log."""
    from opentelemetry.trace import Status, StatusCode

    kind = type(error).__name__
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, kind))


def traceparent(span: Span) -> str:
    """The W3C `traceparent` header that makes the callee's spans children of `span`."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def inject(headers: dict[str, str]) -> None:
    """Add the current request's `traceparent` to an outgoing call's headers (if traced)."""
    span = CURRENT.get()
    if span is not None:
        headers["traceparent"] = traceparent(span)


def wall_ns(*monotonic: float) -> list[int]:
    """time.monotonic() readings (of any process of this host) as ns since the epoch."""
    # The monotonic clock first: a preemption between the two reads then maps a reading a little
    # later, never earlier, than its wall time; the other way round, a busy host could map it
    # before a wall-clock time taken ahead of it (spans that start before their parent).
    mono = time.monotonic_ns()
    offset = time.time_ns() - mono
    return [offset + int(t * 1e9) for t in monotonic]


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class ServerSpans:
    """ASGI middleware: a SERVER span around each POST to `paths`, the current span (`CURRENT`)
    of the request's task, its trace id on the request's log lines. With `remote`, a W3C
    `traceparent` header continues the caller's trace (a worker behind the gateway); without,
    every request starts a trace of its own (a public API follows no client's trace)."""

    def __init__(self, app: Any, *, paths: Collection[str], remote: bool = False) -> None:
        self.app, self.paths, self.remote = app, frozenset(paths), remote

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            _tracer is None
            or scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in self.paths
        ):
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = None
        if self.remote and (header := _header(scope, b"traceparent")) is not None:
            context = TraceContextTextMapPropagator().extract({"traceparent": header})
        path = scope["path"]
        span = _tracer.start_span(
            f"POST {path}",
            context,
            SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": path},
        )
        token = CURRENT.set(span)
        logs.bind(trace_id=f"{span.get_span_context().trace_id:032x}")
        status = 0

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException as exc:
            fail(span, exc)
            raise
        finally:
            CURRENT.reset(token)
            rid = logs.context().get("request_id") or scope.get("state", {}).get("request_id")
            if rid:
                span.set_attribute("tokenmill.request_id", rid)
            if status:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            span.end()
