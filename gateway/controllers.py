"""HTTP only: parse, call the gateway service, shape OpenAI responses and SSE streams."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers import BaseRouteHandler
from litestar.params import JSONBody
from litestar.response import Stream

from gateway.services import Caller, Gateway, Prompt, Target
from tokenmill.errors import APIError
from tokenmill.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)
from tokenmill.protocol import GenerateDelta


async def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Guard: runs before the body is parsed, so a bad key is a 401 whatever the body."""
    gateway: Gateway = connection.app.state.gateway
    connection.state.caller = await gateway.authenticate(connection.headers.get("authorization"))


def provide_caller(request: Request) -> Caller:
    return request.state.caller


def _usage(d: GenerateDelta) -> Usage:
    return Usage(
        prompt_tokens=d.prompt_tokens,
        completion_tokens=d.completion_tokens,
        total_tokens=d.prompt_tokens + d.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=d.cached_tokens),
    )


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
        prompt = gateway.chat_prompt(data, tok, target)
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return await _respond(
            request, gateway, caller, target, prompt, "chatcmpl", data.stream, include_usage, _chat
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
        prompt = gateway.completion_prompt(data, tok, target)
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return await _respond(
            request, gateway, caller, target, prompt, "cmpl", data.stream, include_usage, _text
        )


class _Shape(msgspec.Struct):
    """How one endpoint turns deltas into its objects."""

    final: Callable[[str, int, str, str, str | None, Usage], msgspec.Struct]
    chunk: Callable[[str, int, str, str | None, str | None, bool], msgspec.Struct]
    usage_chunk: Callable[[str, int, str, Usage], msgspec.Struct]


_chat = _Shape(
    final=lambda i, c, m, text, fin, u: ChatCompletion(
        id=i,
        created=c,
        model=m,
        usage=u,
        choices=[ChatChoice(index=0, message=AssistantMessage(content=text), finish_reason=fin)],
    ),
    chunk=lambda i, c, m, text, fin, first: ChatCompletionChunk(
        id=i,
        created=c,
        model=m,
        choices=[
            ChunkChoice(
                index=0, delta=Delta(role="assistant" if first else None, content=text), finish_reason=fin
            )
        ],
    ),
    usage_chunk=lambda i, c, m, u: ChatCompletionChunk(id=i, created=c, model=m, choices=[], usage=u),
)

_text = _Shape(
    final=lambda i, c, m, text, fin, u: Completion(
        id=i, created=c, model=m, usage=u, choices=[CompletionChoice(index=0, text=text, finish_reason=fin)]
    ),
    chunk=lambda i, c, m, text, fin, _first: Completion(
        id=i, created=c, model=m, choices=[CompletionChoice(index=0, text=text or "", finish_reason=fin)]
    ),
    usage_chunk=lambda i, c, m, u: Completion(id=i, created=c, model=m, choices=[], usage=u),
)


async def _respond(
    request: Request,
    gateway: Gateway,
    caller: Caller,
    target: Target,
    prompt: Prompt,
    kind: str,
    stream: bool,
    include_usage: bool,
    shape: _Shape,
) -> Response:
    rid = secrets.token_hex(12)
    request_id, object_id, created = f"req_{rid}", f"{kind}-{rid}", int(time.time())
    headers = {"x-request-id": request_id}
    deltas = gateway.generate(caller, target, request_id, prompt)
    # Wait for the first delta before answering, so "no worker" and worker failures before
    # the first token are proper HTTP errors rather than a broken stream.
    try:
        first = await anext(deltas)
    except APIError as exc:
        exc.headers.update(headers)
        raise
    if not stream:
        # Nothing is sent until the end, so watch for the client leaving: then stop the
        # generation (the worker aborts, usage is metered as cancelled) instead of finishing it.
        collect = asyncio.ensure_future(_collect(first, deltas))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collect.done():
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            await deltas.aclose()
            return Response(b"", status_code=499, headers=headers)  # nobody is listening
        text, last = collect.result()
        body = shape.final(object_id, created, target.model, text, _finish(last), _usage(last))
        return Response(msgspec.json.encode(body), media_type="application/json", headers=headers)

    async def events() -> AsyncIterator[bytes]:
        last, is_first = first, True
        try:
            async for d in _achain(first, deltas):
                last = d
                fin = _finish(d)
                if d.text or fin or is_first:
                    chunk = shape.chunk(object_id, created, target.model, d.text, fin, is_first)
                    yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                    is_first = False
            if include_usage:
                u = shape.usage_chunk(object_id, created, target.model, _usage(last))
                yield b"data: " + msgspec.json.encode(u) + b"\n\n"
        except APIError as exc:
            yield b"data: " + msgspec.json.encode(exc.body()) + b"\n\n"
        finally:
            await deltas.aclose()
        yield b"data: [DONE]\n\n"

    return Stream(
        events(),
        media_type="text/event-stream",
        headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
    )


async def _collect(first: GenerateDelta, rest: AsyncIterator[GenerateDelta]) -> tuple[str, GenerateDelta]:
    parts, last = [first.text], first
    async for d in rest:
        parts.append(d.text)
        last = d
    return "".join(parts), last


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _finish(d: GenerateDelta) -> str | None:
    if d.finish_reason is None:
        return None
    return d.finish_reason if d.finish_reason in ("stop", "length") else "stop"


async def _achain(first: GenerateDelta, rest: AsyncIterator[GenerateDelta]) -> AsyncIterator[GenerateDelta]:
    yield first
    async for d in rest:
        yield d
