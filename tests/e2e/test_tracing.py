"""One trace per request across gateway, worker and engine (issue 20, acceptance 2): `tokenmill
serve` with the standard OTEL_* settings pointing at a local OTLP/HTTP receiver started here,
one streaming chat request through the official openai SDK, and the spans that arrive: the
gateway's (its request, admission, tokenization, routing, the worker call, the usage event)
and the worker process's (its /generate, continued from the gateway's `traceparent`, with the
engine's queueing, prefill and decode), all of one trace. Its JSON log lines carry the trace id.
"""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.serve import MODEL, Server, start_server
from tests.otlp import OtlpReceiver, Span

pytestmark = pytest.mark.slow

CANARY = "tracing-canary-" + secrets.token_hex(6)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, receiver: OtlpReceiver
) -> Iterator[Server]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,  # tracing on: OTLP over HTTP/protobuf
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export every 0.1 s rather than every 5 s
        "TOKENMILL_EMBED_MODEL": "",
        "TOKENMILL_LOG_FORMAT": "json",
        "TOKENMILL_LOG_LEVEL": "DEBUG",  # the access log: a line of the request's
    }
    s = start_server(tmp_path_factory.mktemp("tracing"), model_cache, env)
    try:
        yield s
    finally:
        s.close()


def _one(spans: list[Span], name: str, **where: str) -> Span:
    found = [s for s in spans if s.name == name and all(getattr(s, k) == v for k, v in where.items())]
    assert len(found) == 1, (name, where, found)
    return found[0]


def test_a_streaming_chat_request_is_one_trace_from_gateway_to_engine(
    server: Server, receiver: OtlpReceiver
) -> None:
    raw = server.client().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Say {CANARY} back."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    rid = raw.headers["x-request-id"]
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0

    def complete(spans: list[Span]) -> bool:
        roots = [s for s in spans if s.attributes.get("tokenmill.request_id") == rid and s.kind == "SERVER"]
        traces = {s.trace_id for s in roots}
        names = {s.name for s in spans if s.trace_id in traces}
        return len(roots) == 2 and {"engine.decode", "gateway.usage_event"} <= names

    spans = receiver.wait_for(f"spans of request {rid}", complete)
    root = _one(spans, "POST /v1/chat/completions", kind="SERVER", service="tokenmill-gateway")
    trace = [s for s in spans if s.trace_id == root.trace_id]

    # --- the gateway's request and its steps ------------------------------------------------
    assert root.parent_id == ""  # a trace of its own: the gateway follows no client's trace
    assert root.attributes["tokenmill.request_id"] == rid
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["tokenmill.model"] == MODEL
    assert root.attributes["tokenmill.status"] == "ok"
    assert root.attributes["tokenmill.completion_tokens"] == usage.completion_tokens
    assert root.attributes["tokenmill.prompt_tokens"] == usage.prompt_tokens
    steps = {s.name: s for s in trace if s.parent_id == root.span_id}
    assert set(steps) == {
        "gateway.admission",
        "gateway.tokenize",
        "gateway.route",
        "gateway.worker_call",
        "gateway.usage_event",
    }, sorted(steps)
    admissions = [s for s in trace if s.name == "gateway.admission"]
    assert sorted(s.attributes["tokenmill.admission"] for s in admissions) == ["requests", "tokens"]
    assert all(s.service == "tokenmill-gateway" for s in [*admissions, *steps.values()])
    route, call = steps["gateway.route"], steps["gateway.worker_call"]
    assert call.kind == "CLIENT" and call.attributes["url.path"] == "/generate"
    assert call.attributes["http.response.status_code"] == 200
    assert route.attributes["tokenmill.worker_id"] and route.attributes["tokenmill.cached_blocks"] >= 0
    # in the order the request went through them, within the request
    order = [
        next(s for s in admissions if s.attributes["tokenmill.admission"] == "requests"),
        steps["gateway.tokenize"],
        next(s for s in admissions if s.attributes["tokenmill.admission"] == "tokens"),
        route,
        call,
        steps["gateway.usage_event"],
    ]
    for before, after in itertools.pairwise(order):
        assert before.end <= after.start, (before.name, after.name)
    assert root.start <= order[0].start and call.end <= root.end

    # --- the worker, continuing the gateway's trace through `traceparent` -----------------
    worker = _one(trace, "POST /generate")
    assert worker.service == "tokenmill-worker" and worker.kind == "SERVER"
    assert worker.parent_id == call.span_id  # the worker call's child: one trace, linked
    assert worker.attributes["tokenmill.request_id"] == rid
    assert worker.attributes["tokenmill.completion_tokens"] == usage.completion_tokens
    # Called, then answered: the worker's span may end after the gateway read the last byte
    # (the server finishes up after sending it), so its end is not compared.
    assert call.start <= worker.start

    # --- the engine's queueing, prefill and decode, built from its timestamps --------------
    queue, prefill, decode = (_one(trace, f"engine.{n}") for n in ("queue", "prefill", "decode"))
    assert {s.parent_id for s in (queue, prefill, decode)} == {worker.span_id}
    assert {s.service for s in (queue, prefill, decode)} == {"tokenmill-worker"}
    assert worker.start <= queue.start <= queue.end == prefill.start <= prefill.end == decode.start
    assert decode.start <= decode.end <= worker.end
    assert decode.end <= call.end  # the last token was made before the gateway had it
    assert prefill.attributes["tokenmill.prompt_tokens"] == usage.prompt_tokens
    assert decode.attributes["tokenmill.completion_tokens"] == usage.completion_tokens

    # One trace, nothing of the prompt in it.
    assert len([s for s in spans if s.attributes.get("tokenmill.request_id") == rid]) == 2
    assert CANARY not in json.dumps([s.attributes for s in spans])

    # The request's log lines (JSON) carry its trace id beside its request id.
    lines = [json.loads(ln) for ln in server.lines if ln.startswith("{")]
    mine = [ln for ln in lines if ln.get("request_id") == rid]
    assert any(ln["logger"] == "uvicorn.access" for ln in mine), mine
    assert {ln.get("trace_id") for ln in mine} == {root.trace_id}, mine
