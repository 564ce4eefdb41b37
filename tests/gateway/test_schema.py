"""Schemathesis against the gateway's own `/openapi.json` (issue 4, acceptance 7; issue 14,
acceptance 4).

The gateway runs for real (uvicorn on the test's loop, SQLite, a fake worker); Schemathesis
draws requests from the document the gateway serves and checks every answer against that
same document: no 5xx, only documented status codes and content types, bodies (JSON, and
each server-sent event of a stream) matching the documented schemas. On top, every
successful answer must parse strictly into the official `openai` SDK's types, the
reference client, so a document that is merely self-consistent is not enough.

Every `/admin/v1` operation of the document runs too, with path parameters pointed at real
resources of a sandbox organisation most of the time and as a platform admin, an
organisation admin or a member in turn: no 5xx, successful answers as documented, and every
error in OpenAI's shape. (The admin operations document their successes, not each error
status, so status codes are not checked against the document there.)

Generation is derandomized (Hypothesis derives its seed from the test), so a run is
reproducible; the number of examples is bounded so the whole run takes well under the
3 minutes the test allows.
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
import openai.types.responses
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

from tests.control_plane.conftest import lora_files
from tests.gateway.conftest import BUNDLED_NAME, EMBED_NAME, Env, FakeEmbedder
from tokenmill.openai_responses import ResponseCreateRequest
from tokenmill.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tokenmill.settings import BUNDLED_MODEL

# Examples per /v1 operation and generation mode: (positive, negative). Positive requests
# are valid by the document, so they exercise generation; negative ones must be refused
# with a 4xx. GET /v1/models takes no input: Hypothesis runs out of distinct cases at once.
BUDGET: dict[tuple[str, str], tuple[int, int]] = {
    ("POST", "/v1/chat/completions"): (100, 25),
    ("POST", "/v1/completions"): (100, 25),
    ("POST", "/v1/embeddings"): (60, 20),
    ("GET", "/v1/models"): (5, 0),
    ("GET", "/v1/models/{model}"): (20, 0),
    ("POST", "/v1/responses"): (60, 20),
    ("GET", "/v1/responses/{response_id}"): (10, 5),
    ("GET", "/v1/responses/{response_id}/input_items"): (15, 10),
    ("DELETE", "/v1/responses/{response_id}"): (5, 0),
    ("POST", "/v1/responses/{response_id}/cancel"): (5, 0),
    ("POST", "/v1/files"): (20, 10),
    ("GET", "/v1/files"): (15, 10),
    ("GET", "/v1/files/{file_id}"): (10, 0),
    ("GET", "/v1/files/{file_id}/content"): (10, 0),
    ("DELETE", "/v1/files/{file_id}"): (5, 0),
    ("POST", "/v1/batches"): (15, 10),
    ("GET", "/v1/batches"): (10, 5),
    ("GET", "/v1/batches/{batch_id}"): (10, 0),
    ("POST", "/v1/batches/{batch_id}/cancel"): (5, 0),
}
# The model each operation's requests are pointed at (see `steer`), and those that stream.
SERVED = {
    "/v1/chat/completions": BUNDLED_NAME,
    "/v1/completions": BUNDLED_NAME,
    "/v1/embeddings": EMBED_NAME,
    "/v1/responses": BUNDLED_NAME,
}
STREAMING = {"/v1/chat/completions", "/v1/completions", "/v1/responses"}
# Stored responses the run's path parameters name (made before it starts): one to read, list
# and cancel, one to delete (once; then it is a 404 like any other id).
RESPONSE_IDS: dict[str, str] = {}
# Likewise the uploaded files the run's `file_id`s name.
FILE_IDS: dict[str, str] = {}
# And the batch its `batch_id`s name (no runner here: it stays validating until cancelled).
BATCH_IDS: dict[str, str] = {}
# Every /admin/v1 operation: (positive, negative) examples. Operations that take no input
# yield one distinct case; it is sent again as other callers until each has MIN_PER_OPERATION.
ADMIN_BUDGET = (7, 3)
MIN_PER_OPERATION = 5
MIN_EXAMPLES = 500
# Successful answers each operation must give in the run (its other requests are refused).
# Most drawn prompts and inputs are refused for what the document cannot say (empty, mixed
# lists, unsupported options), hence the low floors for those two.
MIN_OK = {
    "/v1/chat/completions": 20,
    "/v1/completions": 5,
    "/v1/embeddings": 5,
    "/v1/models": 1,
    "/v1/models/{model}": 5,
    "/v1/responses": 10,
    "/v1/responses/{response_id}": 3,
    "/v1/responses/{response_id}/input_items": 3,
    "/v1/responses/{response_id}/cancel": 0,  # nothing runs in the background to cancel
    "/v1/files": 10,  # uploads (any bytes, named batch.jsonl by the document) and lists
    "/v1/files/{file_id}": 3,
    "/v1/files/{file_id}/content": 3,
    "/v1/batches": 3,  # creations on the uploaded file, and lists
    "/v1/batches/{batch_id}": 3,
    "/v1/batches/{batch_id}/cancel": 1,
}

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
    "/v1/responses": ResponseCreateRequest,
}


# --- strict parsing into the SDK's types ---------------------------------------------------


class _StreamedCompletionChoice(openai.types.CompletionChoice):
    # The SDK parses streamed text completions into `Completion`, whose choices require a
    # finish reason; OpenAI itself sends null until the last chunk (the SDK does not
    # validate, so it copes). The only relaxation: every other field is as the SDK types it.
    finish_reason: Literal["stop", "length", "content_filter"] | None = None  # type: ignore[assignment]


class _CompletionChunk(openai.types.Completion):
    choices: list[_StreamedCompletionChoice]  # type: ignore[assignment]


class _DeletedResponse(BaseModel):
    # The SDK returns nothing for a deleted response; OpenAI's body is this.
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class _ModelList(BaseModel):
    # The SDK pages lists itself and has no type for the envelope.
    object: Literal["list"]
    data: list[openai.types.Model]


class _BatchList(BaseModel):
    # OpenAI's cursor page of batches.
    object: Literal["list"]
    data: list[openai.types.Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class _FileList(BaseModel):
    # OpenAI's cursor page of files (the SDK's `SyncCursorPage` reads `data` and `has_more`).
    object: Literal["list"]
    data: list[openai.types.FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


# path -> (type of a JSON body, type of each streamed chunk)
SDK_TYPES: dict[str, tuple[type[BaseModel], type[BaseModel] | None]] = {
    "/v1/chat/completions": (openai.types.chat.ChatCompletion, openai.types.chat.ChatCompletionChunk),
    "/v1/completions": (openai.types.Completion, _CompletionChunk),
    "/v1/models": (_ModelList, None),
    "/v1/models/{model}": (openai.types.Model, None),
    "/v1/embeddings": (openai.types.CreateEmbeddingResponse, None),
    "/v1/responses": (openai.types.responses.Response, None),  # its events: `check_response_events`
    "/v1/responses/{response_id}": (openai.types.responses.Response, None),
    "/v1/responses/{response_id}/input_items": (openai.types.responses.ResponseItemList, None),
    "/v1/responses/{response_id}/cancel": (openai.types.responses.Response, None),
    "/v1/files": (_FileList, None),
    "/v1/files/{file_id}": (openai.types.FileObject, None),
    "/v1/batches": (_BatchList, None),
    "/v1/batches/{batch_id}": (openai.types.Batch, None),
    "/v1/batches/{batch_id}/cancel": (openai.types.Batch, None),
}
# The SDK's DELETE returns nothing; OpenAI's answer is this body.
SDK_TYPES_BY_METHOD: dict[tuple[str, str], type[BaseModel]] = {
    ("DELETE", "/v1/responses/{response_id}"): _DeletedResponse,
    ("POST", "/v1/files"): openai.types.FileObject,
    ("DELETE", "/v1/files/{file_id}"): openai.types.FileDeleted,
    ("POST", "/v1/batches"): openai.types.Batch,
}
# Answers that are bytes, not JSON (the SDK hands them over as they are).
BINARY = {"/v1/files/{file_id}/content"}
_RESPONSE_EVENT = TypeAdapter(openai.types.responses.ResponseStreamEvent)

_ERROR = TypeAdapter(dict[Literal["error"], openai.types.ErrorObject])


def sse_payloads(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (one line each: we never split them)."""
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), body[:500]
    return [e.removeprefix("data: ") for e in events]


def content_type(response: schemathesis.Response) -> str:
    return (response.headers.get("content-type") or [""])[0]


def check_response_events(body: str) -> None:
    """A Responses stream: each event `event: <type>` then its `data`, numbered from 0, ending
    with the response's last state."""
    events = []
    for block in (b for b in body.split("\n\n") if b):
        head, data = block.split("\n")
        event = _RESPONSE_EVENT.validate_json(data.removeprefix("data: "), strict=True)
        assert head == f"event: {event.type}", block[:300]
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created", events[:1]
    assert events[-1].type in ("response.completed", "response.incomplete", "response.failed"), events[-1:]


def check_with_sdk(path: str, body: Any, response: schemathesis.Response, method: str = "POST") -> None:
    """Parse a 2xx body strictly into the SDK's types, an error into its ErrorObject."""
    if response.status_code >= 400:
        _ERROR.validate_json(response.content, strict=True)
        return
    if path == "/v1/responses" and content_type(response).startswith("text/event-stream"):
        assert not response.stream_cut_short, "read the whole stream"
        check_response_events(response.text)
        return
    if (method, path) in SDK_TYPES_BY_METHOD:
        SDK_TYPES_BY_METHOD[method, path].model_validate_json(response.content, strict=True)
        return
    if path in BINARY:
        assert content_type(response) == "application/octet-stream", response.headers
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
    by_operation: dict[tuple[str, str], int] = field(default_factory=dict)  # (method, path) -> calls
    streams: int = 0
    seconds: float = 0.0

    def count(self, status: int, path: str | None = None) -> int:
        return sum(n for (p, s), n in self.by_status.items() if s == status and path in (None, p))

    def record(self, method: str, path: str, response: schemathesis.Response) -> None:
        self.calls += 1
        key = (path, response.status_code)
        self.by_status[key] = self.by_status.get(key, 0) + 1
        op = (method, path)
        self.by_operation[op] = self.by_operation.get(op, 0) + 1
        self.streams += content_type(response).startswith("text/event-stream")


# Checks one answer: (case, response, generation mode).
Check = Callable[[Any, schemathesis.Response, GenerationMode], None]


@dataclass
class Sandbox:
    """Real resources of an organisation of their own for admin path parameters to name,
    and its callers (header sets): none of them is a resource the run may revoke."""

    ids: dict[str, str]  # path parameter -> id
    callers: list[dict[str, str]]  # taken in turn: mostly the platform admin


def fuzz(schema: schemathesis.BaseSchema, base_url: str, key: str, sandbox: Sandbox) -> Tally:
    """Every /v1 operation, then every /admin/v1 one, positive then negative cases; runs in a
    thread (blocking I/O)."""
    tally = Tally()
    headers = {"Authorization": f"Bearer {key}"}
    started = time.monotonic()
    with requests.Session() as session:

        def top_up(method: str, path: str, drawn: list[Any], check: Check) -> None:
            """An operation without inputs yields one distinct case: send it again, as the
            other callers, until the operation has MIN_PER_OPERATION answers."""
            while tally.by_operation.get((method, path), 0) < MIN_PER_OPERATION:
                case = drawn[tally.calls % len(drawn)]
                response = case.call(base_url, session, sandbox.callers[tally.calls % len(sandbox.callers)])
                tally.record(method, path, response)
                check(case, response, GenerationMode.POSITIVE)

        for (method, path), (positive, negative) in BUDGET.items():
            operation = schema[path][method]
            drawn: list[Any] = []

            def send_v1(case: Any, drawn: list[Any] = drawn) -> schemathesis.Response:
                drawn.append(case)
                return case.call(base_url, session, headers)

            for mode, n in ((GenerationMode.POSITIVE, positive), (GenerationMode.NEGATIVE, negative)):
                if n:
                    run_operation(operation, mode, n, tally, send_v1)
            top_up(method, path, drawn, check_v1)
        for method, path in admin_operations(schema.raw_schema):
            operation = schema[path][method]
            drawn = []

            def send(case: Any, drawn: list[Any] = drawn) -> schemathesis.Response:
                drawn.append(case)
                caller = sandbox.callers[tally.calls % len(sandbox.callers)]
                return case.call(base_url, session, caller)

            for mode, n in zip((GenerationMode.POSITIVE, GenerationMode.NEGATIVE), ADMIN_BUDGET, strict=True):
                try:
                    run_operation(
                        operation, mode, n, tally, send, steer=steer_admin(sandbox), check=check_admin
                    )
                except hypothesis.errors.Unsatisfiable:
                    # Nothing in the request can be invalid (no body, string path parameters).
                    assert mode is GenerationMode.NEGATIVE, (method, path)
            top_up(method, path, drawn, check_admin)
    tally.seconds = time.monotonic() - started
    return tally


def admin_operations(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted(
        (m.upper(), p) for p, item in doc["paths"].items() if p.startswith("/admin/v1/") for m in item
    )


def steer_admin(sandbox: Sandbox) -> Callable[[Any, str, int, GenerationMode], None]:
    """Three in four requests name the sandbox's resources (a drawn id is never found)."""

    def steer(case: Any, path: str, i: int, mode: GenerationMode) -> None:
        if i % 4 == 3 or not case.path_parameters:
            return
        case.path_parameters = {
            name: sandbox.ids.get(name, value) for name, value in case.path_parameters.items()
        }

    return steer


def check_admin(case: Any, response: schemathesis.Response, mode: GenerationMode) -> None:
    if response.status_code < 400:
        # JSON answers as documented; exports (CSV, JSON lines) are not in the document.
        json_body = content_type(response).startswith("application/json")
        checks = [not_a_server_error, response_schema_conformance] if json_body else [not_a_server_error]
        case.validate_response(response, checks=checks)
        return
    case.validate_response(response, checks=[not_a_server_error])
    _ERROR.validate_json(response.content, strict=True)


def check_v1(case: Any, response: schemathesis.Response, mode: GenerationMode) -> None:
    checks = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS
    case.validate_response(response, checks=checks)
    check_with_sdk(case.operation.path, case.body, response, case.operation.method.upper())


def run_operation(
    operation: Any,
    mode: GenerationMode,
    n: int,
    tally: Tally,
    send: Callable[[Any], schemathesis.Response],
    *,
    steer: Callable[[Any, str, int, GenerationMode], None] | None = None,
    check: Check = check_v1,
) -> None:
    steer = steer or steer_v1

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
        tally.record(operation.method.upper(), operation.path, response)
        check(case, response, mode)

    one()


def steer_v1(case: Any, path: str, i: int, mode: GenerationMode) -> None:
    """Point drawn requests at what the fake fleet serves, deterministically by call number.

    A drawn model name is never served (404): all but every fifth request name the served
    model instead (in the body, or the path of a model's retrieval). Hypothesis rarely turns
    on `stream` among so many optional fields, so every third positive request streams (half
    of them asking for a usage chunk). The body is assigned, not edited in place, so
    Schemathesis re-checks whether a negative case is still invalid.
    """
    if path == "/v1/models/{model}" and i % 5:
        case.path_parameters = {"model": (BUNDLED_NAME, EMBED_NAME)[i % 2]}
    if path.startswith("/v1/responses/") and i % 5:
        which = "delete" if case.operation.method.upper() == "DELETE" else "read"
        case.path_parameters = {**(case.path_parameters or {}), "response_id": RESPONSE_IDS[which]}
    if path.startswith("/v1/files/") and i % 5:
        which = "delete" if case.operation.method.upper() == "DELETE" else "read"
        case.path_parameters = {**(case.path_parameters or {}), "file_id": FILE_IDS[which]}
    if path.startswith("/v1/batches/") and i % 5:
        case.path_parameters = {**(case.path_parameters or {}), "batch_id": BATCH_IDS["read"]}
    if not isinstance(case.body, dict):
        return
    body = dict(case.body)
    if path == "/v1/batches" and i % 5:  # the uploaded file, and what it may run
        body.update(input_file_id=FILE_IDS["read"], endpoint="/v1/chat/completions", completion_window="24h")
    if i % 5 and "model" in body:
        body["model"] = SERVED[path]
    if i % 5 and path == "/v1/responses" and body.get("input") is None:
        body["input"] = "Hello"  # optional in the document (as OpenAI's), needed to answer
    if mode is GenerationMode.POSITIVE and path in STREAMING and i % 3 == 1:
        body["stream"] = True
        if path != "/v1/responses":  # its stream_options hold no usage switch
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


async def make_sandbox(env: Env) -> Sandbox:
    """An organisation with one of everything the admin operations name, made through the
    admin API, and the three kinds of caller (the run never names their keys)."""
    c, root = env.client, {"authorization": f"Bearer {env.admin_key}"}

    async def made(path: str, body: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        r = await c.post(f"/admin/v1{path}", headers=root, json=body, **kwargs)
        assert r.status_code == 201, (path, r.text)
        return dict(r.json())

    org = (await made("/organizations", {"name": "fuzz-sandbox"}))["id"]
    org_admin = await made(f"/organizations/{org}/keys", {"role": "org_admin", "name": "caller"})
    member = await made(f"/organizations/{org}/keys", {"role": "member", "name": "caller"})
    victim = await made(f"/organizations/{org}/keys", {"role": "member", "name": "to rotate and revoke"})
    user = await made(f"/organizations/{org}/users", {"email": "fuzz@example.com", "password": "x" * 12})
    plan = await made("/plans", {"name": "fuzz-plan", "requests_per_minute": 60})
    model = await made("/models", {"name": "fuzz-model", "source": BUNDLED_MODEL, "format": "gguf"})
    await made("/prices/gpus", {"gpu_type": "fuzz-gpu", "per_hour": "1"})  # dedicated ones need a price
    dep = await made(
        "/deployments",
        {"name": "fuzz-dedicated", "model": model["id"], "org_id": org, "gpu_type": "fuzz-gpu"},
    )
    files = lora_files(rank=1, layers=2)
    r = await c.post(
        f"/admin/v1/organizations/{org}/adapters",
        headers=root,
        data={"name": "fuzz-adapter", "model": BUNDLED_NAME},
        files=[("file", (name, content)) for name, content in files.items()],
    )
    assert r.status_code == 201, r.text
    ids = {
        "org_id": org,
        "key_id": victim["id"],
        "user_id": user["id"],
        "plan_id": plan["id"],
        "model_id": model["id"],
        "deployment_id": dep["id"],
        "adapter_id": r.json()["id"],
        "what": "usage",
    }
    # Three in five requests as the platform admin (who may do everything), one each as the
    # organisation admin and the member (who meet 403s).
    bearer = [env.admin_key, org_admin["secret"], env.admin_key, member["secret"], env.admin_key]
    return Sandbox(ids, [{"Authorization": f"Bearer {k}"} for k in bearer])


@pytest.mark.timeout(180)
async def test_schemathesis_finds_no_server_error_and_no_undocumented_response(gateway_env: Env) -> None:
    started = time.monotonic()
    await gateway_env.add_worker()
    embed_dep = await gateway_env.embed_deployment()
    embedder = await gateway_env.add_embed_worker(embed_dep)
    doc = (await gateway_env.client.get("/openapi.json")).json()
    # A new endpoint joins the run rather than going untested: give it a budget here and a
    # fake backend (a worker for its deployment), or it fails as a 5xx.
    missing = v1_operations(doc) ^ set(BUDGET)
    assert not missing, f"operations of the document without a budget, or gone: {sorted(missing)}"
    sandbox = await make_sandbox(gateway_env)
    for which in ("read", "delete"):
        made = await gateway_env.client.post(
            "/v1/responses",
            headers={"authorization": f"Bearer {gateway_env.admin_key}"},
            json={"model": BUNDLED_NAME, "input": "Hello", "max_output_tokens": 2},
        )
        assert made.status_code == 200, made.text
        RESPONSE_IDS[which] = made.json()["id"]
        uploaded = await gateway_env.client.post(
            "/v1/files",
            headers={"authorization": f"Bearer {gateway_env.admin_key}"},
            data={"purpose": "batch"},
            files={"file": (f"{which}.jsonl", b'{"custom_id": "1"}\n')},
        )
        assert uploaded.status_code == 200, uploaded.text
        FILE_IDS[which] = uploaded.json()["id"]
    batch = await gateway_env.client.post(
        "/v1/batches",
        headers={"authorization": f"Bearer {gateway_env.admin_key}"},
        json={"input_file_id": FILE_IDS["read"], "endpoint": "/v1/completions", "completion_window": "24h"},
    )
    assert batch.status_code == 200, batch.text
    BATCH_IDS["read"] = batch.json()["id"]
    schema = schemathesis.openapi.from_dict(doc)
    async with heartbeats(gateway_env, embedder, embed_dep):
        tally = await asyncio.to_thread(
            fuzz, schema, str(gateway_env.client.base_url), gateway_env.admin_key, sandbox
        )
    print(f"schemathesis: {tally}")
    assert tally.calls >= MIN_EXAMPLES, tally
    # Every operation of the document ran, each at least MIN_PER_OPERATION times.
    operations = v1_operations(doc) | set(admin_operations(doc))
    assert len(admin_operations(doc)) >= 40
    assert {op: min(tally.by_operation.get(op, 0), MIN_PER_OPERATION) for op in operations} == {
        op: MIN_PER_OPERATION for op in operations
    }, tally.by_operation
    # The admin run reached real resources and real successes, not only 404s and 403s.
    assert sum(n for (p, s), n in tally.by_status.items() if p.startswith("/admin/") and s < 300) >= 60
    assert time.monotonic() - started < 180
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
