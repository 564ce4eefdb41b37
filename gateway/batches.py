"""HTTP only: OpenAI's Batch API, `/v1/batches` (control_plane/batches owns batches and their
rules; billing's batch runner runs them)."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, Request, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, FromQuery, QueryParameter

from control_plane.batches.schemas import batch_object
from control_plane.batches.services import BatchService, batch_service
from gateway.controllers import OpenAIBody, OpenAIController, require_api_key
from gateway.keys import Caller
from tokenmill.openai_batches import BatchCreateRequest, BatchList, BatchObject
from tokenmill.openai_shapes import error_responses
from tokenmill.openai_types import ErrorResponse

_NOT_FOUND = ResponseSpec(
    data_container=ErrorResponse,
    description="No batch by this id for this organisation: never created, or another organisation's.",
    generate_examples=False,
)


def _batches(request: Request) -> BatchService:
    gateway = request.app.state.gateway
    return batch_service(gateway.settings, gateway.sessionmaker, request.app.state.storage)


def _caller(request: Request) -> Caller:
    return request.state.caller  # set by `require_api_key`


class BatchesController(Controller):
    path = "/v1/batches"
    before_request = require_api_key
    exception_handlers = OpenAIController.exception_handlers  # the same OpenAI-style errors
    tags = ["OpenAI"]

    @post(
        "/",
        summary="Create a batch",
        status_code=200,
        responses={**error_responses(400, 401, 403, 500)},
    )
    async def create(self, request: Request, data: OpenAIBody[BatchCreateRequest]) -> BatchObject:
        caller = _caller(request)
        return batch_object(await _batches(request).create(caller.org_id, caller.key_id, data))

    @get("/", summary="List the organisation's batches", responses={**error_responses(400, 401, 403, 500)})
    async def list_batches(
        self,
        request: Request,
        after: FromQuery[str | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
    ) -> BatchList:
        page = await _batches(request).page(_caller(request).org_id, after=after, limit=limit)
        data = [batch_object(row) for row in page.batches]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return BatchList(data, first, last, page.has_more)

    @get(
        "/{batch_id:str}",
        summary="Retrieve a batch",
        responses={**error_responses(400, 401, 403, 500), 404: _NOT_FOUND},
    )
    async def retrieve(self, request: Request, batch_id: FromPath[str]) -> BatchObject:
        return batch_object(await _batches(request).get(_caller(request).org_id, batch_id))

    @post(
        "/{batch_id:str}/cancel",
        summary="Cancel a batch",
        status_code=200,
        responses={
            **error_responses(400, 401, 403, 500),
            404: _NOT_FOUND,
            409: ResponseSpec(
                data_container=ErrorResponse,
                description="The batch has already ended (completed, failed or expired).",
                generate_examples=False,
            ),
        },
    )
    async def cancel(self, request: Request, batch_id: FromPath[str]) -> BatchObject:
        return batch_object(await _batches(request).cancel(_caller(request).org_id, batch_id))
