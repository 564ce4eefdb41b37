"""HTTP only: parse, call the gateway service, answer through the shared OpenAI shaping."""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, TypeAlias, TypeVar

from litestar import Controller, Request, Response, get, post
from litestar.enums import RequestEncodingType
from litestar.exceptions import HTTPException, ValidationException
from litestar.params import Body, FromPath
from litestar.types import Message, Scope

from gateway.services import Caller, Gateway
from tokenmill import logs
from tokenmill.errors import APIError, error_body, exception_handlers
from tokenmill.openai_responses import RESPONSES_PARAMETERS
from tokenmill.openai_shapes import (
    completion_responses,
    embedding_list,
    error_responses,
    new_request_id,
    respond,
    streaming_operation,
)
from tokenmill.openai_types import (
    PARAMETERS,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    EmbeddingList,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    Parameters,
)

log = logging.getLogger("tokenmill.gateway")

T = TypeVar("T")
# A JSON body of one of the request structs, which accept only the names they declare
# (tokenmill.openai_types): the API document says so, so clients and fuzzers know it.
OpenAIBody: TypeAlias = Annotated[
    T, Body(media_type=RequestEncodingType.JSON, schema_extra={"additionalProperties": False})
]


# What a batch's lines may call (`X-Tokenmill-Batch`); anywhere else the header means nothing.
BATCH_LINE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


async def require_api_key(request: Request) -> None:
    """Runs before the body is parsed, so a bad key is a 401 whatever the body. A
    `before_request` hook rather than a guard: Litestar copies the route handler for every
    guard call, which costs more than checking the key.

    An address that failed too often gets 429 before its key is looked at (no database
    read, whatever key it sends now), so guessing keys or flooding made-up ones is slow.
    A caller's `X-Client-Request-Id` is checked once the key is known good (400 if OpenAI
    would refuse it). A batch runner's line (`X-Tokenmill-Batch`, with the internal token)
    runs as the key that created the batch (`gateway/batch_lines.py`)."""
    from tokenmill.clients import auth_failures

    gateway: Gateway = request.app.state.gateway
    batch = request.headers.get("x-tokenmill-batch")
    if batch is not None and request.scope["path"] in BATCH_LINE_PATHS:
        # A line of a batch, from the batch runner: its request id is the line's own. Only a
        # wrong runner token counts as a failed authentication: a 401 past it (the batch's key
        # revoked since) is no guess, and must not throttle the runner's address for every batch.
        authorization = request.headers.get("authorization")
        with auth_failures(request):
            gateway.batch_lines.check_runner(authorization)
        caller, rid = await gateway.batch_lines.authenticate(
            authorization, batch, request.headers.get("x-tokenmill-batch-line")
        )
        logs.bind(request_id=rid, org_id=caller.org_id, key_id=caller.key_id)
        request.state.request_id = rid
        request.state.caller, request.state.batch_id, request.state.client_request_id = caller, batch, None
        return
    # Minted first: whatever happens next, errors and log lines included, sees this id.
    logs.bind(request_id=request_id(request))
    with auth_failures(request):
        caller = request.state.caller = await gateway.authenticate(request.headers.get("authorization"))
    logs.bind(org_id=caller.org_id, key_id=caller.key_id)
    # Kept for the usage event of the request (`Gateway.admit`).
    request.state.batch_id = None
    request.state.client_request_id = client_request_id(request.headers.get("x-client-request-id"))


# The handlers take the gateway and the caller (set by `require_api_key`) from the app and
# connection state rather than as dependencies: Litestar resolves two dependencies of a
# handler concurrently, in a task group per request, which costs more CPU than what the
# gateway itself does with them.


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _caller(request: Request) -> Caller:
    return request.state.caller


def request_id(request: Request) -> str:
    """This request's id, minted by the server the first time it is asked for (by
    `require_api_key`, before anything else runs; by `stamp_request_ids` for a request that
    never reached a handler). It keys the ledger, and every answer of `/v1` carries it as
    `x-request-id`: both read it from the connection's state, so they cannot differ."""
    rid = request.state.get("request_id")
    if rid is None:
        rid = request.state.request_id = new_request_id()
    return rid


# OpenAI's rule for `X-Client-Request-Id`: printable ASCII, at most 512 characters.
_CLIENT_ID = re.compile(r"[\x20-\x7e]{1,512}")


def client_request_id(value: str | None) -> str | None:
    """The caller's own id of this request (`X-Client-Request-Id`), or None if it sent none;
    a value OpenAI would refuse is a 400."""
    if not value:
        return None
    if _CLIENT_ID.fullmatch(value) is None:
        raise APIError(
            400,
            "The X-Client-Request-Id header must be printable ASCII of at most 512 characters.",
            param="X-Client-Request-Id",
        )
    return value


def _under_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


async def stamp_request_ids(message: Message, scope: Scope) -> None:
    """The app's `before_send` hook: every answer of `/v1` carries `x-request-id`, and the
    caller's valid `X-Client-Request-Id` back as `x-client-request-id`; a refused one (4xx)
    is counted (`gateway.accounting`). A hook of the app rather than of this controller,
    because Litestar answers a path or method it cannot route (404, 405) before any
    controller sees the request."""
    if message["type"] != "http.response.start" or not _under_v1(scope.get("path", "")):
        return
    if 400 <= message["status"] < 500:
        scope["litestar_app"].state.accounting.refused(message["status"], scope)
    headers = list(message.get("headers") or ())
    names = {name.lower() for name, _ in headers}
    if b"x-request-id" not in names:
        state = scope["state"]  # the dict behind `request.state`: the id `request_id` minted
        rid = state.get("request_id")
        if rid is None:
            rid = state["request_id"] = new_request_id()
        headers.append((b"x-request-id", rid.encode()))
    sent = next((v for k, v in scope.get("headers", ()) if k == b"x-client-request-id"), None)
    if sent is not None and b"x-client-request-id" not in names:
        try:
            echoed = client_request_id(sent.decode("latin-1"))
        except APIError:
            echoed = None  # refused (or would be): never repeated back
        if echoed is not None:
            headers.append((b"x-client-request-id", sent))
    message["headers"] = headers


def _unexpected(request: Request, exc: Exception) -> Response:
    # A bug, not the caller's fault: logged once, with the id the caller can quote.
    log.exception("unhandled error in request %s", request_id(request), exc_info=exc)
    body = error_body(
        "The server had an error while processing your request.", "server_error", "internal_error"
    )
    return Response(body, status_code=500)


def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 413:  # Litestar's own words name no limit
        limit = request.app.state.settings.max_request_bytes
        message = f"The request body is too large: at most {limit} bytes are accepted."
        return Response(error_body(message, "invalid_request_error", "request_too_large"), status_code=413)
    return _http_default(request, exc)


_http_default = exception_handlers()[HTTPException]
_validation_default = exception_handlers()[ValidationException]

# msgspec's words for a name a request struct does not declare (`forbid_unknown_fields`); at the
# top level of the body they come with no "- at `$...`" location.
_UNKNOWN = re.compile(r"Object contains unknown field `(.+)`")
_BODIES: dict[str, Parameters] = {
    "/v1/chat/completions": PARAMETERS[ChatCompletionRequest],
    "/v1/completions": PARAMETERS[CompletionRequest],
    "/v1/embeddings": PARAMETERS[EmbeddingRequest],
    "/v1/responses": RESPONSES_PARAMETERS,
}


def _validation(request: Request, exc: ValidationException) -> Response:
    """An unknown name in the body is answered as OpenAI answers it; OpenAI's own parameters
    that are refused whatever their value get their own message."""
    extra = exc.extra if isinstance(exc.extra, list) else []
    message = str(extra[0].get("message", "")) if extra and isinstance(extra[0], dict) else ""
    unknown = _UNKNOWN.fullmatch(message)
    known = _BODIES.get(request.scope["path"])
    if unknown is None or known is None:
        return _validation_default(request, exc)
    name = unknown.group(1)
    text = known.refused.get(name) or f"Unrecognized request argument supplied: {name}"
    return Response(error_body(text, "invalid_request_error", None, name), status_code=400)


def _error_handlers() -> dict[Any, Any]:
    handlers = exception_handlers()
    handlers[HTTPException] = _http_error
    handlers[ValidationException] = _validation
    handlers[Exception] = _unexpected
    return handlers


class OpenAIController(Controller):
    path = "/v1"
    before_request = require_api_key
    exception_handlers = _error_handlers()
    tags = ["OpenAI"]

    @get(
        "/models",
        summary="List the models this key may use",
        responses=error_responses(400, 401, 403, 500),
    )
    async def list_models(self, request: Request) -> ModelList:
        models = await _gateway(request).catalog.models(_caller(request))
        return ModelList(data=[ModelCard(id=n, created=c, owned_by=o) for n, c, o in models])

    @get(
        "/models/{model:path}",
        summary="Retrieve a model this key may use",
        responses=error_responses(400, 401, 403, 404, 500),
    )
    async def retrieve_model(self, request: Request, model: FromPath[str]) -> ModelCard:
        # A `path` parameter: model names may hold '/' (the SDK sends it percent-encoded).
        name, created, owner = await _gateway(request).catalog.model(_caller(request), model.lstrip("/"))
        return ModelCard(id=name, created=created, owned_by=owner)

    @post(
        "/chat/completions",
        summary="Create a chat completion",
        status_code=200,
        responses=completion_responses(ChatCompletion),
        operation_class=streaming_operation(ChatCompletionChunk),
    )
    async def chat(self, request: Request, data: OpenAIBody[ChatCompletionRequest]) -> Response:
        return await _generate(request, data)

    @post(
        "/completions",
        summary="Create a text completion",
        status_code=200,
        responses=completion_responses(Completion),
        operation_class=streaming_operation(Completion),
    )
    async def completions(self, request: Request, data: OpenAIBody[CompletionRequest]) -> Response:
        return await _generate(request, data)

    @post(
        "/embeddings",
        summary="Create embeddings",
        status_code=200,
        responses=error_responses(400, 401, 403, 404, 429, 500, 503),
    )
    async def embeddings(
        self, request: Request, data: OpenAIBody[EmbeddingRequest]
    ) -> Response[EmbeddingList]:
        gateway = _gateway(request)
        admitted = await gateway.admit(
            _caller(request),
            request_id(request),
            data,
            client_request_id=request.state.client_request_id,
            batch_id=request.state.batch_id,
        )
        try:
            result = await gateway.embed(admitted)
            body = embedding_list(data, admitted.target.model, result.embeddings, result.prompt_tokens)
        except APIError as exc:
            exc.headers.update(admitted.headers)
            raise
        return Response(body, headers=admitted.headers)


async def _generate(request: Request, data: ChatCompletionRequest | CompletionRequest) -> Response:
    gateway = _gateway(request)
    admitted = await gateway.admit(
        _caller(request),
        request_id(request),
        data,
        client_request_id=request.state.client_request_id,
        batch_id=request.state.batch_id,
    )
    # `respond` starts the stream at once: from then on, however the request ends, the
    # stream's end gives back its limits and meters it.
    deltas = gateway.stream(admitted)
    return await respond(
        request,
        data,
        admitted.target.model,
        admitted.request_id,
        deltas,
        headers=admitted.headers,
        choices=admitted.choices,
        tier=admitted.service_tier,
    )
