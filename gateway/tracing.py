"""The gateway's spans, when tracing is on (tokenmill/tracing.py says when).

`instrument` wraps the calls the request path makes to the gateway's collaborators, so that
each one made inside a traced request becomes a child span of the request's SERVER span:
tokenization (`Prep.run`), admission (`Admitter.count`, the request; `Admitter.admit`, its
tokens, concurrency and budget hold), routing (`FleetView.wait_for`), the call to the worker
(`Upstream.post`, a CLIENT span whose `traceparent` the worker continues) and the usage event
(`publish`, which also puts the request's figures on its SERVER span). Wrapped at the
composition root, only when tracing is on: a gateway without tracing runs none of this.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from tokenmill import tracing
from tokenmill.protocol import USAGE, UsageRecord

if TYPE_CHECKING:
    from gateway.fleet import Route
    from gateway.services import Gateway
    from gateway.upstream import Response

T = TypeVar("T")

# The SERVER spans: the endpoints a request of the OpenAI API is served by.
TRACED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


def instrument(gateway: Gateway) -> None:
    """Wrap `gateway`'s collaborators' calls of the request path in spans (see above)."""
    gateway.prep.run = _timed("gateway.tokenize", gateway.prep.run)  # type: ignore[method-assign]
    gateway.admitter.count = _timed(  # type: ignore[method-assign]
        "gateway.admission", gateway.admitter.count, {"tokenmill.admission": "requests"}
    )
    gateway.admitter.admit = _timed(  # type: ignore[method-assign]
        "gateway.admission", gateway.admitter.admit, {"tokenmill.admission": "tokens"}
    )
    gateway.fleet.wait_for = _timed(  # type: ignore[method-assign]
        "gateway.route", gateway.fleet.wait_for, describe=_routed
    )
    gateway.upstream.post = _worker_call(gateway.upstream.post)  # type: ignore[method-assign]
    gateway.publisher.publish = _usage_event(gateway.publisher.publish)  # type: ignore[method-assign]


def _timed(
    name: str,
    call: Callable[..., Awaitable[T]],
    attributes: Mapping[str, str] | None = None,
    describe: Callable[[T], Mapping[str, Any]] | None = None,
) -> Callable[..., Awaitable[T]]:
    """`call`, recorded as a span named `name` when made inside a traced request."""

    @functools.wraps(call)
    async def timed(*args: Any, **kwargs: Any) -> T:
        parent = tracing.CURRENT.get()
        if parent is None:
            return await call(*args, **kwargs)
        started = time.time_ns()
        try:
            result = await call(*args, **kwargs)
        except BaseException as exc:
            tracing.span_at(name, parent, started, attributes=attributes, error=exc)
            raise
        extra = describe(result) if describe is not None else {}
        tracing.span_at(name, parent, started, attributes={**(attributes or {}), **extra})
        return result

    return timed


def _routed(route: Route | None) -> dict[str, str | int]:
    if route is None:
        return {}
    return {"tokenmill.worker_id": route.worker.worker_id, "tokenmill.cached_blocks": route.cached_blocks}


def _worker_call(
    post: Callable[[str, str, bytes, Mapping[str, str]], contextlib.AbstractAsyncContextManager[Response]],
) -> Callable[[str, str, bytes, Mapping[str, str]], contextlib.AbstractAsyncContextManager[Response]]:
    """`Upstream.post` with a CLIENT span from the request to the response's end, whose id
    goes to the worker in the `traceparent` header."""

    @contextlib.asynccontextmanager
    async def traced(
        address: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> AsyncIterator[Response]:
        parent = tracing.CURRENT.get()
        if parent is None:
            async with post(address, path, body, headers) as response:
                yield response
            return
        span = tracing.start(
            "gateway.worker_call",
            parent,
            kind="CLIENT",
            attributes={"http.request.method": "POST", "server.address": address, "url.path": path},
        )
        try:
            async with post(address, path, body, {**headers, "traceparent": tracing.traceparent(span)}) as r:
                span.set_attribute("http.response.status_code", r.status_code)
                yield r
        except BaseException as exc:
            tracing.fail(span, exc)
            raise
        finally:
            span.end()

    return traced


def _usage_event(publish: Callable[[str, Any], Awaitable[str]]) -> Callable[[str, Any], Awaitable[str]]:
    """`publish`, with the usage event's span; the event's figures go on the request's span."""
    timed = _timed("gateway.usage_event", publish)

    @functools.wraps(publish)
    async def traced(stream: str, event: Any) -> str:
        parent = tracing.CURRENT.get()
        if parent is None or stream != USAGE or not isinstance(event, UsageRecord):
            return await publish(stream, event)
        parent.set_attributes(
            {
                k: v
                for k, v in {
                    "tokenmill.request_id": event.request_id,
                    "tokenmill.org_id": event.org_id,
                    "tokenmill.key_id": event.api_key_id,
                    "tokenmill.model": event.model,
                    "tokenmill.deployment_id": event.deployment_id,
                    "tokenmill.status": event.status,
                    "tokenmill.prompt_tokens": event.prompt_tokens,
                    "tokenmill.cached_tokens": event.cached_tokens,
                    "tokenmill.completion_tokens": event.completion_tokens,
                    "tokenmill.ttft_ms": event.ttft_ms,
                }.items()
                if v is not None
            }
        )
        return await timed(stream, event)

    return traced
