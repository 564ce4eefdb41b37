"""HTTP only: parse, call the gateway service, answer through the shared OpenAI shaping."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from litestar.params import JSONBody

from gateway.services import Caller, Gateway
from tokenmill.errors import APIError
from tokenmill.openai_shapes import (
    chat_prompt,
    completion_prompt,
    completion_responses,
    embedding_inputs,
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


async def require_api_key(request: Request) -> None:
    """Runs before the body is parsed, so a bad key is a 401 whatever the body. A
    `before_request` hook rather than a guard: Litestar copies the route handler for every
    guard call, which costs more than checking the key."""
    gateway: Gateway = request.app.state.gateway
    request.state.caller = await gateway.authenticate(request.headers.get("authorization"))


# The handlers take the gateway and the caller (set by `require_api_key`) from the app and
# connection state rather than as dependencies: Litestar resolves two dependencies of a
# handler concurrently, in a task group per request, which costs more CPU than what the
# gateway itself does with them.


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _caller(request: Request) -> Caller:
    return request.state.caller


class OpenAIController(Controller):
    path = "/v1"
    before_request = require_api_key
    tags = ["OpenAI"]

    @get(
        "/models",
        summary="List the models this key may use",
        responses=error_responses(401, 403, 500),
    )
    async def list_models(self, request: Request) -> ModelList:
        models = await _gateway(request).models(_caller(request))
        cards = [ModelCard(id=n, created=c, owned_by=o) for n, c, o in models]
        return ModelList(data=cards)

    @post(
        "/chat/completions",
        summary="Create a chat completion",
        status_code=200,
        responses=completion_responses(ChatCompletion),
        operation_class=streaming_operation(ChatCompletionChunk),
    )
    async def chat(
        self,
        request: Request,
        data: JSONBody[ChatCompletionRequest],
    ) -> Response:
        gateway, caller = _gateway(request), _caller(request)
        target = await gateway.resolve(caller, data.model)
        tok = await gateway.tokenizer(target)
        prompt = chat_prompt(data, tok, context_length=target.context_length, defaults=target.defaults)
        headers: dict[str, str] = {}
        return await respond(
            request,
            data,
            target.model,
            lambda rid: gateway.generate(caller, target, rid, prompt, headers),
            headers,
        )

    @post(
        "/completions",
        summary="Create a text completion",
        status_code=200,
        responses=completion_responses(Completion),
        operation_class=streaming_operation(Completion),
    )
    async def completions(
        self,
        request: Request,
        data: JSONBody[CompletionRequest],
    ) -> Response:
        gateway, caller = _gateway(request), _caller(request)
        target = await gateway.resolve(caller, data.model)
        tok = await gateway.tokenizer(target)
        prompt = completion_prompt(data, tok, context_length=target.context_length, defaults=target.defaults)
        headers: dict[str, str] = {}
        return await respond(
            request,
            data,
            target.model,
            lambda rid: gateway.generate(caller, target, rid, prompt, headers),
            headers,
        )

    @post(
        "/embeddings",
        summary="Create embeddings",
        status_code=200,
        responses=error_responses(400, 401, 403, 404, 429, 500, 503),
    )
    async def embeddings(self, request: Request, data: JSONBody[EmbeddingRequest]) -> Response[EmbeddingList]:
        gateway, caller = _gateway(request), _caller(request)
        target = await gateway.resolve(caller, data.model, kind="embed")
        tok = await gateway.tokenizer(target)
        inputs = embedding_inputs(data, tok, context_length=target.context_length)
        request_id = new_request_id()
        headers = {"x-request-id": request_id}
        try:
            result = await gateway.embed(caller, target, request_id, inputs, headers)
        except APIError as exc:
            exc.headers.update(headers)
            raise
        return Response(
            embedding_list(data, target.model, result.embeddings, result.prompt_tokens), headers=headers
        )
