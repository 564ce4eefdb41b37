"""HTTP only: parse, call the gateway service, answer through the shared OpenAI shaping."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers import BaseRouteHandler
from litestar.params import JSONBody

from gateway.services import Caller, Gateway
from tokenmill.openai_shapes import chat_prompt, completion_prompt, respond
from tokenmill.openai_types import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList


async def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Guard: runs before the body is parsed, so a bad key is a 401 whatever the body."""
    gateway: Gateway = connection.app.state.gateway
    connection.state.caller = await gateway.authenticate(connection.headers.get("authorization"))


def provide_caller(request: Request) -> Caller:
    return request.state.caller


class OpenAIController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @get("/models", summary="List the models this key may use")
    async def list_models(
        self, gateway: NamedDependency[Gateway], caller: NamedDependency[Caller]
    ) -> ModelList:
        cards = [ModelCard(id=n, created=c, owned_by=o) for n, c, o in await gateway.models(caller)]
        return ModelList(data=cards)

    @post("/chat/completions", summary="Create a chat completion", status_code=200)
    async def chat(
        self,
        request: Request,
        data: JSONBody[ChatCompletionRequest],
        gateway: NamedDependency[Gateway],
        caller: NamedDependency[Caller],
    ) -> Response:
        target = await gateway.resolve(caller, data.model)
        tok = await gateway.tokenizer(target)
        prompt = chat_prompt(data, tok, context_length=target.context_length, defaults=target.defaults)
        return await respond(
            request, data, target.model, lambda rid: gateway.generate(caller, target, rid, prompt)
        )

    @post("/completions", summary="Create a text completion", status_code=200)
    async def completions(
        self,
        request: Request,
        data: JSONBody[CompletionRequest],
        gateway: NamedDependency[Gateway],
        caller: NamedDependency[Caller],
    ) -> Response:
        target = await gateway.resolve(caller, data.model)
        tok = await gateway.tokenizer(target)
        prompt = completion_prompt(data, tok, context_length=target.context_length, defaults=target.defaults)
        return await respond(
            request, data, target.model, lambda rid: gateway.generate(caller, target, rid, prompt)
        )
