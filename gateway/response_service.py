"""`/v1/responses`: a Responses request served through the gateway's chat completion path,
and the responses kept for the organisation (`store`) read back, listed and deleted.

One request is one chat completion (`serve_chat`): the same admission, limits, budget hold,
routing and one usage event as `/v1/chat/completions`. The table of kept responses belongs
to control_plane/responses; a response of another organisation, an expired one and one
that does not exist are the same 404.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import msgspec
from sqlalchemy.exc import SQLAlchemyError

from control_plane.responses.models import StoredResponse
from control_plane.responses.services import ResponseStore, page_items
from gateway.keys import Caller
from gateway.response_events import Chunk, response_events
from gateway.response_shapes import (
    Item,
    chat_request,
    continued,
    draft,
    finished,
    input_items,
    output_items,
)
from gateway.services import Gateway
from tokenmill.errors import APIError
from tokenmill.openai_responses import (
    DeletedResponse,
    ResponseCreateRequest,
    ResponseItemList,
    ResponseObject,
)
from tokenmill.openai_shapes import Receive, collect_unless_gone, finish_reason, usage, uses_tools
from tokenmill.openai_types import ChatCompletionRequest
from tokenmill.protocol import GenerateDelta
from tokenmill.structured import parse_tool_calls

log = logging.getLogger("tokenmill.gateway")


@dataclass(slots=True)
class Answer:
    """What `create` answers: the Response object, or its event stream, or nothing (the
    client left before the end), with the headers every answer of the request carries."""

    headers: dict[str, str] = field(default_factory=dict)
    body: ResponseObject | None = None
    events: AsyncIterator[bytes] | None = None


@dataclass(slots=True)
class Served:
    headers: dict[str, str]  # what every answer to the request carries (x-ratelimit-*, x-request-id)
    service_tier: str  # the tier it runs at
    deltas: AsyncGenerator[GenerateDelta, None]


async def serve_chat(
    gateway: Gateway,
    caller: Caller,
    request_id: str,
    chat: ChatCompletionRequest,
    client_request_id: str | None,
) -> Served:
    """The gateway's chat completion path, exactly as `/v1/chat/completions` takes it: admitted
    (counted, limits, budget hold, prompt rendered and tokenized), then streamed from a worker,
    settled and metered once however it ends. The first delta has been awaited, so a failure
    before the first token is raised here, as an HTTP error. The one place this module
    touches the chat path."""
    admitted = await gateway.admit(
        caller, request_id, chat, client_request_id=client_request_id, endpoint="responses"
    )
    deltas = _one_choice(gateway.stream(admitted))  # started at once below: its end is what settles
    headers = admitted.headers
    try:
        first = await anext(deltas)
    except APIError as exc:
        exc.headers.update(headers)
        raise
    return Served(headers, admitted.service_tier, _achain(first, deltas))


async def _one_choice(stream: AsyncGenerator[Any, None]) -> AsyncGenerator[GenerateDelta, None]:
    """The deltas of the request's one choice (n = 1), untagged: the gateway tags each delta
    with the choice it belongs to (`ChoiceDelta`)."""
    try:
        async for item in stream:
            yield item if isinstance(item, GenerateDelta) else item.delta
    finally:
        await stream.aclose()


async def _achain(
    first: GenerateDelta, rest: AsyncGenerator[GenerateDelta, None]
) -> AsyncGenerator[GenerateDelta, None]:
    try:
        yield first
        async for d in rest:
            yield d
    finally:
        await rest.aclose()


async def chunks(deltas: AsyncGenerator[GenerateDelta, None]) -> AsyncGenerator[Chunk, None]:
    """Deltas as what the Responses events are made of: (text, finished, cut short, usage)."""
    try:
        async for d in deltas:
            yield d.text, d.finish_reason is not None, finish_reason(d) == "length", usage(d)
    finally:
        await deltas.aclose()


class ResponsesService:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.lifetime = timedelta(days=gateway.settings.response_retention_days)

    async def create(
        self,
        caller: Caller,
        request_id: str,
        req: ResponseCreateRequest,
        receive: Receive,
        client_request_id: str | None = None,
    ) -> Answer:
        """Answer `req` (its conversation continued from `previous_response_id` if it names
        one), keeping the result for the organisation unless `store` is false."""
        conversation = input_items(req)
        if req.previous_response_id is not None:
            previous = await self._stored(caller, req.previous_response_id, "previous_response_id")
            conversation = continued(previous.input_items, previous.response, conversation)
        chat = chat_request(req, conversation)
        # Everything that can refuse the request runs before admission, which holds limits.
        base = draft(req, f"resp_{request_id.removeprefix('req_')}", req.model, chat)
        tools = uses_tools(chat)

        async def keep(final: ResponseObject) -> None:
            if final.store:
                await self._keep(caller, final, conversation)

        served = await serve_chat(self.gateway, caller, request_id, chat, client_request_id)
        headers, deltas = served.headers, served.deltas
        base = msgspec.structs.replace(base, service_tier=served.service_tier)
        if req.stream:
            return Answer(headers, events=response_events(base, chunks(deltas), tools, keep))
        try:
            first = await anext(deltas)
            collected = await collect_unless_gone(first, deltas, receive)
            if collected is None:
                return Answer(headers)  # nobody is listening: nothing to keep either
            text, last = collected[0].text, collected[0].last  # the one choice
            truncated = finish_reason(last) == "length"
            calls = parse_tool_calls(text) if tools else None
            final = finished(base, output_items(text, calls, truncated), usage(last), truncated)
            await keep(final)
        except APIError as exc:  # failed after the first token, still before any byte was sent
            exc.headers.update(headers)
            raise
        return Answer(headers, body=final)

    async def _keep(self, caller: Caller, final: ResponseObject, conversation: list[Item]) -> None:
        try:
            async with self.gateway.sessionmaker() as session, session.begin():
                await ResponseStore(session).add(
                    response_id=final.id,
                    org_id=caller.org_id,
                    model=final.model,
                    response=msgspec.to_builtins(final),
                    input_items=conversation,
                    lifetime=self.lifetime,
                )
        except (SQLAlchemyError, OSError) as exc:
            # Answering as if kept would promise a response that a GET then cannot find.
            log.exception("could not store response %s", final.id)
            raise APIError(
                503,
                "The response was generated but could not be stored; retry, or send 'store': false.",
                code="store_failed",
            ) from exc

    async def _stored(self, caller: Caller, response_id: str, param: str) -> StoredResponse:
        async with self.gateway.sessionmaker() as session:
            row = await ResponseStore(session).get(caller.org_id, response_id)
        if row is None:
            # One wording for missing, expired and another organisation's: an id reveals nothing.
            raise APIError(404, f"No response found with id '{response_id}'.", param=param, code="not_found")
        return row

    async def retrieve(self, caller: Caller, response_id: str) -> dict[str, Any]:
        return (await self._stored(caller, response_id, "response_id")).response

    async def delete(self, caller: Caller, response_id: str) -> DeletedResponse:
        async with self.gateway.sessionmaker() as session, session.begin():
            deleted = await ResponseStore(session).delete(caller.org_id, response_id)
        if not deleted:
            raise APIError(
                404, f"No response found with id '{response_id}'.", param="response_id", code="not_found"
            )
        return DeletedResponse(response_id)

    async def input_items(
        self,
        caller: Caller,
        response_id: str,
        *,
        after: str | None,
        limit: int,
        order: Literal["asc", "desc"],
    ) -> ResponseItemList:
        """The conversation the response answered (its predecessors' turns included), newest
        first unless `order` is asc; `after` is the last id of the previous page."""
        row = await self._stored(caller, response_id, "response_id")
        page = page_items(row.input_items, after=after, limit=limit, order=order)
        first = page.items[0]["id"] if page.items else None
        last = page.items[-1]["id"] if page.items else None
        return ResponseItemList(page.items, first, last, page.has_more)

    async def cancel(self, caller: Caller, response_id: str) -> None:
        await self._stored(caller, response_id, "response_id")
        raise APIError(
            400,
            "Only background responses can be cancelled, and this server runs none: this one has ended.",
            param="response_id",
        )
