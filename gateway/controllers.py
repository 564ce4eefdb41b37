"""HTTP only: parse, call the gateway service, answer through the shared OpenAI shaping."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.params import JSONBody

from gateway.services import Caller, Gateway
from tokenmill.errors import APIError, error_body, exception_handlers
from tokenmill.openai_shapes import (
    completion_responses,
    embedding_list,
    error_responses,
    new_request_id,
    respond,
    streaming_operation,
)
from tokenmill.openai_types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    EmbeddingList,
    EmbeddingRequest,
    ModelCard,
    ModelList,
)

log = logging.getLogger("tokenmill.gateway")


async def require_api_key(request: Request) -> None:
    """Runs before the body is parsed, so a bad key is a 401 whatever the body. A
    `before_request` hook rather than a guard: Litestar copies the route handler for every
    guard call, which costs more than checking the key.

    An address that failed too often gets 429 before its key is looked at (no database
    read, whatever key it sends now), so guessing keys or flooding made-up ones is slow."""
    from tokenmill.clients import auth_failures

    gateway: Gateway = request.app.state.gateway
    with auth_failures(request):
        request.state.caller = await gateway.authenticate(request.headers.get("authorization"))


# The handlers take the gateway and the caller (set by `require_api_key`) from the app and
# connection state rather than as dependencies: Litestar resolves two dependencies of a
# handler concurrently, in a task group per request, which costs more CPU than what the
# gateway itself does with them.


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _caller(request: Request) -> Caller:
    return request.state.caller


def request_id(request: Request) -> str:
    """This request's id, minted by the server the first time it is asked for: it keys the
    ledger, and every answer of `/v1` (errors included) carries it as `x-request-id`."""
    rid = request.state.get("request_id")
    if rid is None:
        rid = request.state.request_id = new_request_id()
    return rid


def _with_request_id(handler: Callable[[Request, Any], Response]) -> Callable[[Request, Any], Response]:
    def answer(request: Request, exc: Any) -> Response:
        response = handler(request, exc)
        response.headers.setdefault("x-request-id", request_id(request))
        return response

    return answer


def _unexpected(request: Request, exc: Exception) -> Response:
    # A bug, not the caller's fault: logged once, with the id the caller can quote.
    rid = request_id(request)
    log.exception("unhandled error in request %s", rid, exc_info=exc)
    body = error_body(
        "The server had an error while processing your request.", "server_error", "internal_error"
    )
    return Response(body, status_code=500, headers={"x-request-id": rid})


def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 413:  # Litestar's own words name no limit
        limit = request.app.state.settings.max_request_bytes
        message = f"The request body is too large: at most {limit} bytes are accepted."
        return Response(error_body(message, "invalid_request_error", "request_too_large"), status_code=413)
    return _http_default(request, exc)


_http_default = exception_handlers()[HTTPException]


def _error_handlers() -> dict[Any, Any]:
    handlers = {kind: _with_request_id(h) for kind, h in exception_handlers().items()}
    handlers[HTTPException] = _with_request_id(_http_error)
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
        responses=error_responses(401, 403, 500),
    )
    async def list_models(self, request: Request) -> Response[ModelList]:
        models = await _gateway(request).models(_caller(request))
        cards = [ModelCard(id=n, created=c, owned_by=o) for n, c, o in models]
        return Response(ModelList(data=cards), headers={"x-request-id": request_id(request)})

    @post(
        "/chat/completions",
        summary="Create a chat completion",
        status_code=200,
        responses=completion_responses(ChatCompletion),
        operation_class=streaming_operation(ChatCompletionChunk),
    )
    async def chat(self, request: Request, data: JSONBody[ChatCompletionRequest]) -> Response:
        return await _generate(request, data)

    @post(
        "/completions",
        summary="Create a text completion",
        status_code=200,
        responses=completion_responses(Completion),
        operation_class=streaming_operation(Completion),
    )
    async def completions(self, request: Request, data: JSONBody[CompletionRequest]) -> Response:
        return await _generate(request, data)

    @post(
        "/embeddings",
        summary="Create embeddings",
        status_code=200,
        responses=error_responses(400, 401, 403, 404, 429, 500, 503),
    )
    async def embeddings(self, request: Request, data: JSONBody[EmbeddingRequest]) -> Response[EmbeddingList]:
        gateway = _gateway(request)
        admitted = await gateway.admit(_caller(request), request_id(request), data)
        try:
            result = await gateway.embed(admitted)
            body = embedding_list(data, admitted.target.model, result.embeddings, result.prompt_tokens)
        except APIError as exc:
            exc.headers.update(admitted.headers)
            raise
        return Response(body, headers=admitted.headers)


async def _generate(request: Request, data: ChatCompletionRequest | CompletionRequest) -> Response:
    gateway = _gateway(request)
    admitted = await gateway.admit(_caller(request), request_id(request), data)
    # `respond` starts the stream at once: from then on, however the request ends, the
    # stream's end gives back its limits and meters it.
    deltas = gateway.stream(admitted)
    return await respond(
        request, data, admitted.target.model, admitted.request_id, deltas, headers=admitted.headers
    )
