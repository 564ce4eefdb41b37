"""HTTP only: OpenAI's Responses API, `/v1/responses` (gateway/response_service.py does the work)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, Operation, Schema
from litestar.openapi.spec.enums import OpenAPIType
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.response import Stream

from gateway.controllers import OpenAIBody, OpenAIController, request_id, require_api_key
from gateway.keys import Caller
from gateway.response_service import ResponsesService
from tokenmill.errors import APIError
from tokenmill.openai_responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    DeletedResponse,
    ErrorEvent,
    LifecycleEvent,
    OutputItemEvent,
    ResponseCreateRequest,
    ResponseItemList,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
)
from tokenmill.openai_shapes import _inline_schemas, error_responses
from tokenmill.openai_types import ErrorResponse

_NOT_FOUND = ResponseSpec(
    data_container=ErrorResponse,
    description="No response by this id kept for this organisation: never stored, deleted, expired, "
    "or another organisation's.",
    generate_examples=False,
)


def _event_stream() -> type[Operation]:
    """An `operation_class` documenting the streamed form of a created response: server-sent
    events, each `event: <type>` and `data: <the event>` (as `streaming_operation` documents
    the chat completion chunks)."""
    events = (
        LifecycleEvent,
        OutputItemEvent,
        ContentPartEvent,
        TextDeltaEvent,
        TextDoneEvent,
        ArgumentsDeltaEvent,
        ArgumentsDoneEvent,
        ErrorEvent,
    )
    event = Schema(
        type=OpenAPIType.OBJECT,
        required=["event", "data"],
        properties={
            "event": Schema(type=OpenAPIType.STRING, description="The event's `type`."),
            "data": Schema(
                type=OpenAPIType.STRING,
                content_media_type="application/json",
                content_schema={"anyOf": _inline_schemas(*events)},  # type: ignore[arg-type]
            ),
        },
        description="One server-sent event of the Responses stream.",
    )

    @dataclass
    class EventStreamOperation(Operation):
        def __post_init__(self) -> None:
            ok = (self.responses or {}).get("200")
            if isinstance(ok, OpenAPIResponse):
                ok.content = {**(ok.content or {}), "text/event-stream": OpenAPIMediaType(schema=event)}

    return EventStreamOperation


def _service(request: Request) -> ResponsesService:
    return ResponsesService(request.app.state.gateway)


def _caller(request: Request) -> Caller:
    return request.state.caller  # set by `require_api_key`


class ResponsesController(Controller):
    path = "/v1/responses"
    before_request = require_api_key
    exception_handlers = OpenAIController.exception_handlers  # the same OpenAI-style errors
    tags = ["OpenAI"]

    @post(
        "/",
        summary="Create a model response",
        status_code=200,
        responses={
            200: ResponseSpec(
                data_container=ResponseObject,
                description="The response; with `stream: true`, a `text/event-stream` of Responses "
                "events (`event:` its type, `data:` the event) ending with response.completed, "
                "response.incomplete or response.failed.",
                generate_examples=False,
            ),
            **error_responses(400, 401, 403, 429, 500, 503),
            404: ResponseSpec(
                data_container=ErrorResponse,
                description="No such model for this key, or no such `previous_response_id`.",
                generate_examples=False,
            ),
        },
        operation_class=_event_stream(),
    )
    async def create(self, request: Request, data: OpenAIBody[ResponseCreateRequest]) -> Response:
        answer = await _service(request).create(
            _caller(request),
            request_id(request),
            data,
            request.receive,
            client_request_id=request.state.client_request_id,
        )
        if answer.events is not None:
            headers = {**answer.headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
            return Stream(answer.events, media_type="text/event-stream", headers=headers)
        if answer.body is None:
            return Response(b"", status_code=499, headers=answer.headers)  # nobody is listening
        body = msgspec.json.encode(answer.body)
        return Response(body, media_type="application/json", headers=answer.headers)

    @get(
        "/{response_id:str}",
        summary="Retrieve a stored response",
        responses={
            200: ResponseSpec(data_container=ResponseObject, description="The response, as created."),
            **error_responses(400, 401, 403, 500),
            404: _NOT_FOUND,
        },
    )
    async def retrieve(
        self,
        request: Request,
        response_id: FromPath[str],
        stream: FromQuery[bool] = False,  # refused: a stored response is not streamed again
    ) -> Response:
        if stream:
            raise APIError(400, "Streaming a stored response again is not supported.", param="stream")
        found = await _service(request).retrieve(_caller(request), response_id)
        # As it was answered (and stored): no need to decode it into structs to encode it again.
        return Response(msgspec.json.encode(found), media_type="application/json")

    @delete(
        "/{response_id:str}",
        summary="Delete a stored response",
        status_code=200,
        responses={**error_responses(400, 401, 403, 500), 404: _NOT_FOUND},
    )
    async def delete(self, request: Request, response_id: FromPath[str]) -> DeletedResponse:
        return await _service(request).delete(_caller(request), response_id)

    @get(
        "/{response_id:str}/input_items",
        summary="List the input items of a stored response",
        responses={**error_responses(400, 401, 403, 500), 404: _NOT_FOUND},
    )
    async def input_items(
        self,
        request: Request,
        response_id: FromPath[str],
        after: FromQuery[str | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
    ) -> ResponseItemList:
        return await _service(request).input_items(
            _caller(request), response_id, after=after, limit=limit, order=order
        )

    @post(
        "/{response_id:str}/cancel",
        summary="Cancel a background response",
        status_code=200,
        responses={**error_responses(400, 401, 403, 500), 404: _NOT_FOUND},
    )
    async def cancel(self, request: Request, response_id: FromPath[str]) -> None:
        await _service(request).cancel(_caller(request), response_id)
