"""HTTP only: OpenAI's Files API, `/v1/files` (control_plane/files owns the files and their rules).

An upload is read as it arrives: the key is checked before any of it is read (`require_api_key`),
a body announcing more than the caps allow is refused before it is read, and the file is
refused (413) as soon as it passes `TOKENMILL_MAX_FILE_BYTES`, spooled to a temporary file on the
way (never held whole in memory), then stored. The app's body limit (`TOKENMILL_MAX_REQUEST_BYTES`)
does not apply to this one route: it has its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal
from urllib.parse import quote

from litestar import Controller, Request, delete, get, post
from litestar.datastructures import UploadFile
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    Encoding,
    OpenAPIFormat,
    OpenAPIHeader,
    OpenAPIMediaType,
    Operation,
    RequestBody,
    Schema,
)
from litestar.openapi.spec.enums import OpenAPIType
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.response import Stream
from multipart import MultipartSegment

from control_plane.files.models import StoredFile
from control_plane.files.services import (
    UPLOAD_PURPOSES,
    FileService,
    check_filename,
    check_upload_purpose,
    file_service,
    too_large,
)
from gateway.controllers import OpenAIController, require_api_key
from gateway.keys import Caller
from tokenmill.bodies import MULTIPART_HEADER_BYTES, Form, read_multipart
from tokenmill.errors import APIError
from tokenmill.openai_files import FileDeleted, FileList, FileObject
from tokenmill.openai_shapes import error_responses
from tokenmill.openai_types import ErrorResponse

UPLOAD_HELP = (
    "Upload a file as multipart/form-data with the fields 'purpose' ('batch') and 'file' (a .jsonl file)."
)
# Text fields of an upload (`purpose`) and parts in all: what a valid upload needs, with room.
FIELD_BYTES = 1024
PARTS = 8
# What an upload may hold beside its file: its other parts with their headers.
FORM_OVERHEAD = PARTS * (FIELD_BYTES + MULTIPART_HEADER_BYTES * 8)

_NOT_FOUND = ResponseSpec(
    data_container=ErrorResponse,
    description="No file by this id for this organisation: never uploaded, deleted, or another "
    "organisation's.",
    generate_examples=False,
)


def _error(description: str) -> ResponseSpec:
    return ResponseSpec(data_container=ErrorResponse, description=description, generate_examples=False)


def _upload_operation() -> type[Operation]:
    """An `operation_class` documenting the upload's multipart body, which the handler reads
    itself (as it arrives) rather than through a `data` parameter."""
    body = RequestBody(
        required=True,
        content={
            "multipart/form-data": OpenAPIMediaType(
                schema=Schema(
                    type=OpenAPIType.OBJECT,
                    required=["file", "purpose"],
                    properties={
                        "file": Schema(
                            type=OpenAPIType.STRING,
                            format=OpenAPIFormat.BINARY,
                            description="The file: JSON lines, one request each, its name ending in .jsonl.",
                        ),
                        "purpose": Schema(
                            type=OpenAPIType.STRING,
                            enum=list(UPLOAD_PURPOSES),
                            description="What the file is for: `batch` (an input file of the Batch API).",
                        ),
                    },
                    additional_properties=False,
                ),
                encoding={
                    "file": Encoding(
                        headers={
                            "Content-Disposition": OpenAPIHeader(
                                schema=Schema(type=OpenAPIType.STRING),
                                example='form-data; name="file"; filename="batch.jsonl"',
                            )
                        }
                    )
                },
            )
        },
    )

    @dataclass
    class UploadOperation(Operation):
        def __post_init__(self) -> None:
            self.request_body = body

    return UploadOperation


def _files(request: Request) -> FileService:
    gateway = request.app.state.gateway
    return file_service(gateway.settings, gateway.sessionmaker, request.app.state.storage)


def _caller(request: Request) -> Caller:
    return request.state.caller  # set by `require_api_key`


def file_object(row: StoredFile) -> FileObject:
    return FileObject(
        id=row.id,
        bytes=row.size,
        created_at=int(row.created_at.timestamp()),
        filename=row.filename,
        purpose=row.purpose,  # type: ignore[arg-type]  # the table holds only these purposes
    )


@dataclass(slots=True)
class Upload:
    form: Form  # close it when done (its file is spooled to disk)
    purpose: str
    file: UploadFile


async def read_upload(request: Request, max_bytes: int) -> Upload:
    """The upload's form, its file spooled, refused as early as it can be: a body announcing
    more than the caps allow before it is read, a wrong purpose or file name before the file
    is read, a file passing `max_bytes` while it arrives."""
    content_type, options = request.content_type
    boundary = options.get("boundary")
    if content_type != "multipart/form-data" or not boundary:
        raise APIError(400, UPLOAD_HELP)
    if (request.content_length or 0) > max_bytes + FORM_OVERHEAD:
        raise too_large(max_bytes)
    parts: list[Form] = []  # the form being read, once its file starts

    async def file_limit(part: MultipartSegment, form: Form) -> tuple[int, str]:
        if part.name != "file":
            raise APIError(400, f"Unexpected file '{part.name}'. {UPLOAD_HELP}", param=part.name)
        if form.files:
            raise APIError(400, f"Send one file per upload. {UPLOAD_HELP}", param="file")
        purpose = form.text("purpose")
        if purpose is not None:  # sent first (as the SDK sends it): checked before the file is read
            check_upload_purpose(purpose)
            check_filename(purpose, part.filename or "")
        parts.append(form)
        return max_bytes, ""

    try:
        form = await read_multipart(
            request.stream(),
            boundary.encode(),
            text_limit=FIELD_BYTES,
            max_parts=PARTS,
            file_limit=file_limit,
        )
    except APIError as exc:
        if exc.status == 413 and parts and not parts[0].files:  # the file passed the cap as it arrived
            raise too_large(max_bytes) from None
        raise
    try:
        return _fields(form)
    except BaseException:
        await form.close()
        raise


def _fields(form: Form) -> Upload:
    for name, value in form.items:
        if name not in ("file", "purpose"):
            # `expires_after` too: files are kept until they are deleted.
            param = name.split("[", 1)[0]
            raise APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
        if name == "file" and isinstance(value, str):
            raise APIError(400, f"'file' must be a file part, with a file name. {UPLOAD_HELP}", param="file")
    purpose = form.text("purpose")
    if purpose is None:
        raise APIError(400, "Missing required parameter: 'purpose'.", param="purpose")
    if len([v for k, v in form.items if k == "purpose"]) > 1:
        raise APIError(400, "'purpose' was sent twice.", param="purpose")
    files = form.files
    if not files:
        raise APIError(400, "Missing required parameter: 'file'.", param="file")
    return Upload(form, purpose, files[0][1])


class FilesController(Controller):
    path = "/v1/files"
    before_request = require_api_key
    exception_handlers = OpenAIController.exception_handlers  # the same OpenAI-style errors
    tags = ["OpenAI"]

    # No body limit of Litestar's: `read_upload` applies the file caps as the body arrives.
    @post(
        "/",
        summary="Upload a file",
        status_code=200,
        request_max_body_size=None,
        operation_class=_upload_operation(),
        responses={
            200: ResponseSpec(data_container=FileObject, description="The stored file."),
            **error_responses(401, 403, 500),
            400: _error(
                "Not a multipart upload, no file or purpose, a purpose other than `batch`, a file "
                "name not ending in .jsonl, or more lines than TOKENMILL_MAX_FILE_LINES."
            ),
            413: _error("The file is larger than TOKENMILL_MAX_FILE_BYTES."),
            503: _error("The storage could not be written to; retry shortly."),
        },
    )
    async def create(self, request: Request) -> FileObject:
        files = _files(request)
        upload = await read_upload(request, files.max_bytes)
        try:
            row = await files.upload(
                _caller(request).org_id,
                filename=upload.file.filename,
                purpose=upload.purpose,
                content=upload.file.file,
            )
        finally:
            await upload.form.close()
        return file_object(row)

    @get(
        "/",
        summary="List the organisation's files",
        responses={**error_responses(400, 401, 403, 500)},
    )
    async def list_files(
        self,
        request: Request,
        purpose: FromQuery[str | None] = None,
        after: FromQuery[str | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=10_000)] = 10_000,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
    ) -> FileList:
        page = await _files(request).page(
            _caller(request).org_id, purpose=purpose, after=after, limit=limit, order=order
        )
        data = [file_object(row) for row in page.files]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return FileList(data, first, last, page.has_more)

    @get(
        "/{file_id:str}",
        summary="Retrieve a file",
        responses={**error_responses(400, 401, 403, 500), 404: _NOT_FOUND},
    )
    async def retrieve(self, request: Request, file_id: FromPath[str]) -> FileObject:
        return file_object(await _files(request).get(_caller(request).org_id, file_id))

    @get(
        "/{file_id:str}/content",
        summary="Retrieve a file's content",
        media_type="application/octet-stream",
        responses={
            200: ResponseSpec(
                data_container=bytes,
                media_type="application/octet-stream",
                description="The file's bytes, as uploaded (or made).",
                generate_examples=False,
            ),
            **error_responses(400, 401, 403, 500),
            404: _NOT_FOUND,
            503: _error("The storage could not be read; retry shortly."),
        },
    )
    async def content(self, request: Request, file_id: FromPath[str]) -> Stream:
        files = _files(request)
        row = await files.get(_caller(request).org_id, file_id)
        chunks = await files.open(row)  # opened before answering: a storage failure is still a 503
        headers = {
            "content-length": str(row.size),
            "content-disposition": f"attachment; filename*=UTF-8''{quote(row.filename)}",
        }
        return Stream(chunks, media_type="application/octet-stream", headers=headers)

    @delete(
        "/{file_id:str}",
        summary="Delete a file",
        status_code=200,
        responses={**error_responses(400, 401, 403, 500), 404: _NOT_FOUND},
    )
    async def delete(self, request: Request, file_id: FromPath[str]) -> FileDeleted:
        await _files(request).delete(_caller(request).org_id, file_id)
        return FileDeleted(file_id)
