"""Schemathesis against the gateway's own `/openapi.json` (issue 4, acceptance 7).

The gateway runs for real (uvicorn on the test's loop, SQLite, a fake worker); Schemathesis
draws requests from the document the gateway serves and checks every answer against that
same document: no 5xx, only documented status codes and content types, bodies (JSON, and
each server-sent event of a stream) matching the documented schemas. On top, every
successful answer must parse strictly into the official `openai` SDK's types, the
reference client, so a document that is merely self-consistent is not enough.

Generation is derandomized (Hypothesis derives its seed from the test), so a run is
reproducible; the number of examples is bounded so the whole run takes seconds.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import hypothesis
import msgspec
import numpy as np
import openai.types
import openai.types.chat
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from pydantic import BaseModel, TypeAdapter
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.gateway.conftest import BUNDLED_NAME, EMBED_NAME, Env, FakeEmbedder
from tokenmill.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

# Examples per /v1 operation and generation mode: (positive, negative). Positive requests
# are valid by the document, so they exercise generation; negative ones must be refused
# with a 4xx. GET /v1/models takes no input: Hypothesis runs out of distinct cases at once.
BUDGET: dict[tuple[str, str], tuple[int, int]] = {
    ("POST", "/v1/chat/completions"): (100, 25),
    ("POST", "/v1/completions"): (100, 25),
    ("POST", "/v1/embeddings"): (60, 20),
    ("GET", "/v1/models"): (5, 0),
}
# The model each operation's requests are pointed at (see `steer`), and those that stream.
SERVED = {"/v1/chat/completions": BUNDLED_NAME, "/v1/completions": BUNDLED_NAME, "/v1/embeddings": EMBED_NAME}
STREAMING = {"/v1/chat/completions", "/v1/completions"}
MIN_EXAMPLES = 200
# Successful answers each operation must give in the run (its other requests are refused).
# Most drawn prompts and inputs are refused for what the document cannot say (empty, mixed
# lists, unsupported options), hence the low floors for those two.
MIN_OK = {"/v1/chat/completions": 20, "/v1/completions": 5, "/v1/embeddings": 5, "/v1/models": 1}

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]

# The types the gateway parses request bodies into: a body the document calls valid must
# parse, or the document promises what the server refuses (a 400 is documented, so the
# response checks alone would not notice).
REQUEST_TYPES: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}


# --- strict parsing into the SDK's types ---------------------------------------------------


class _StreamedCompletionChoice(openai.types.CompletionChoice):
    # The SDK parses streamed text completions into `Completion`, whose choices require a
    # finish reason; OpenAI itself sends null until the last chunk (the SDK does not
    # validate, so it copes). The only relaxation: every other field is as the SDK types it.
    finish_reason: Literal["stop", "length", "content_filter"] | None = None  # type: ignore[assignment]


class _CompletionChunk(openai.types.Completion):
    choices: list[_StreamedCompletionChoice]  # type: ignore[assignment]


class _ModelList(BaseModel):
    # The SDK pages lists itself and has no type for the envelope.
    object: Literal["list"]
    data: list[openai.types.Model]


# path -> (type of a JSON body, type of each streamed chunk)
SDK_TYPES: dict[str, tuple[type[BaseModel], type[BaseModel] | None]] = {
    "/v1/chat/completions": (openai.types.chat.ChatCompletion, openai.types.chat.ChatCompletionChunk),
    "/v1/completions": (openai.types.Completion, _CompletionChunk),
    "/v1/models": (_ModelList, None),
    "/v1/embeddings": (openai.types.CreateEmbeddingResponse, None),
}

_ERROR = TypeAdapter(dict[Literal["error"], openai.types.ErrorObject])


def sse_payloads(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (one line each: we never split them)."""
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), body[:500]
    return [e.removeprefix("data: ") for e in events]


def content_type(response: schemathesis.Response) -> str:
    return (response.headers.get("content-type") or [""])[0]


def check_with_sdk(path: str, body: Any, response: schemathesis.Response) -> None:
    """Parse a 2xx body strictly into the SDK's types, an error into its ErrorObject."""
    if response.status_code >= 400:
        _ERROR.validate_json(response.content, strict=True)
        return
    whole, chunk = SDK_TYPES[path]
    if path == "/v1/embeddings" and isinstance(body, dict) and body.get("encoding_format") == "base64":
        # The SDK asks for base64 and decodes it into floats before building its objects.
        data = response.json()
        for item in data["data"]:
            item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist()
        whole.model_validate(data, strict=True)
        return
    if content_type(response).startswith("text/event-stream"):
        assert chunk is not None, f"{path} streamed"
        assert not response.stream_cut_short, "read the whole stream"
        payloads = sse_payloads(response.text)
        assert payloads[-1] == "[DONE]", payloads[-1:]
        assert payloads[:-1], "a stream carries at least one chunk"
        for p in payloads[:-1]:
            chunk.model_validate_json(p, strict=True)
    else:
        whole.model_validate_json(response.content, strict=True)


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Tally:
    calls: int = 0
    by_status: dict[tuple[str, int], int] = field(default_factory=dict)  # (path, status) -> calls
    streams: int = 0
    seconds: float = 0.0

    def count(self, status: int, path: str | None = None) -> int:
        return sum(n for (p, s), n in self.by_status.items() if s == status and path in (None, p))


def fuzz(schema: schemathesis.BaseSchema, base_url: str, key: str) -> Tally:
    """Every /v1 operation, positive then negative cases; runs in a thread (blocking I/O)."""
    tally = Tally()
    headers = {"Authorization": f"Bearer {key}"}
    started = time.monotonic()
    with requests.Session() as session:
        for (method, path), (positive, negative) in BUDGET.items():
            operation = schema[path][method]
            for mode, n in ((GenerationMode.POSITIVE, positive), (GenerationMode.NEGATIVE, negative)):
                if n:
                    run_operation(operation, mode, n, tally, lambda c: c.call(base_url, session, headers))
    tally.seconds = time.monotonic() - started
    return tally


def run_operation(
    operation: Any, mode: GenerationMode, n: int, tally: Tally, send: Callable[[Any], schemathesis.Response]
) -> None:
    checks = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS

    @hypothesis.settings(
        max_examples=n,
        derandomize=True,  # the seed comes from the test itself: every run draws the same cases
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case: Any) -> None:
        steer(case, operation.path, tally.calls, mode)
        if mode is GenerationMode.POSITIVE and operation.path in REQUEST_TYPES:
            try:
                # As Litestar parses a JSON body: decoded, then converted leniently (2.0 is an int).
                wire = msgspec.json.decode(msgspec.json.encode(case.body))
                msgspec.convert(wire, REQUEST_TYPES[operation.path], strict=False, str_keys=True)
            except msgspec.ValidationError as exc:
                raise AssertionError(f"the document allows a body the gateway refuses: {exc}") from exc
        response = send(case)
        tally.calls += 1
        key = (operation.path, response.status_code)
        tally.by_status[key] = tally.by_status.get(key, 0) + 1
        tally.streams += content_type(response).startswith("text/event-stream")
        case.validate_response(response, checks=checks)
        check_with_sdk(operation.path, case.body, response)

    one()


def steer(case: Any, path: str, i: int, mode: GenerationMode) -> None:
    """Point drawn requests at what the fake fleet serves, deterministically by call number.

    A drawn model name is never served (404): all but every fifth request name the served
    model instead. Hypothesis rarely turns on `stream` among so many optional fields, so
    every third positive request streams (half of them asking for a usage chunk). The body
    is assigned, not edited in place, so Schemathesis re-checks whether a negative case is
    still invalid.
    """
    if not isinstance(case.body, dict):
        return
    body = dict(case.body)
    if i % 5 and "model" in body:
        body["model"] = SERVED[path]
    if mode is GenerationMode.POSITIVE and path in STREAMING and i % 3 == 1:
        body["stream"] = True
        body["stream_options"] = {"include_usage": bool(i % 2)}
    case.body = body


@contextlib.asynccontextmanager
async def heartbeats(
    env: Env, embedder: FakeEmbedder, embed_dep: str, every: float = 5.0
) -> AsyncIterator[None]:
    """Keep the fake workers alive in the fleet view however long the run takes."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(every)
            for w in env.workers:
                await env.beat(w)
            await env.announce(embedder.worker_id, embedder.url, embed_dep, model=EMBED_NAME)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def v1_operations(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, item in doc["paths"].items() if p.startswith("/v1/") for m in item}


@pytest.mark.timeout(180)
async def test_schemathesis_finds_no_server_error_and_no_undocumented_response(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    embed_dep = await gateway_env.embed_deployment()
    embedder = await gateway_env.add_embed_worker(embed_dep)
    doc = (await gateway_env.client.get("/openapi.json")).json()
    # A new endpoint joins the run rather than going untested: give it a budget here and a
    # fake backend (a worker for its deployment), or it fails as a 5xx.
    missing = v1_operations(doc) ^ set(BUDGET)
    assert not missing, f"operations of the document without a budget, or gone: {sorted(missing)}"
    schema = schemathesis.openapi.from_dict(doc)
    async with heartbeats(gateway_env, embedder, embed_dep):
        tally = await asyncio.to_thread(fuzz, schema, str(gateway_env.client.base_url), gateway_env.admin_key)
    print(f"schemathesis: {tally}")
    assert tally.calls >= MIN_EXAMPLES, tally
    # The run reached generation and streaming, and bad input and unknown models were refused.
    # Every operation answered successfully often enough for the SDK check to mean something,
    # streams included, and bad input and unknown models were refused.
    assert {p: tally.count(200, p) for _, p in BUDGET} == {
        p: max(tally.count(200, p), minimum) for p, minimum in MIN_OK.items()
    }, tally
    assert tally.streams >= 10 and tally.count(400) >= 20 and tally.count(404) >= 10, tally


async def test_document_describes_errors_and_streams(gateway_env: Env) -> None:
    """What Schemathesis cannot tell by itself: the shapes are OpenAI's, not merely consistent."""
    doc = (await gateway_env.client.get("/openapi.json")).json()
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert error["required"] == ["error"]
    detail = error["properties"]["error"]
    detail = doc["components"]["schemas"][detail["$ref"].rsplit("/", 1)[1]] if "$ref" in detail else detail
    assert sorted(detail["required"]) == ["code", "message", "param", "type"]
    for path, item in doc["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, op in item.items():
            responses = op["responses"]
            assert {"401", "500"} <= set(responses), (method, path)
            for status, r in responses.items():
                if status.startswith(("4", "5")):
                    assert r["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/ErrorResponse"
                    }, (method, path, status)
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"400", "404", "429", "503"} <= set(responses)
        ok = responses["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
        data = ok["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
        assert data[0] == {"type": "string", "const": "[DONE]"}
        assert data[1]["contentMediaType"] == "application/json"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "The request body is empty; send a JSON object."),
        (b"null", "Expected `object`, got `null`"),
        (b"[]", "Expected `object`, got `array`"),
        (b"a=1", "JSON is malformed: invalid character (byte 0)"),
    ],
)
async def test_bodies_outside_the_document_get_a_readable_400(
    gateway_env: Env, body: bytes, message: str
) -> None:
    r = await gateway_env.client.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {gateway_env.admin_key}", "content-type": "application/json"},
        content=body,
    )
    assert r.status_code == 400
    assert r.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    }
