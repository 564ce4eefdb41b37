"""Request bodies: every decoding error a 400, and forms parsed with bounded fields.

Litestar (2.x) lets two kinds of bad input through as 500s: msgspec (before 0.23) raises
`UnicodeDecodeError` for invalid UTF-8 inside a JSON string, and `RecursionError` for deep
nesting, and neither is the `DecodeError` Litestar turns into a 400. (msgspec 0.23 raises a
`DecodeError` for invalid UTF-8, with a message of its own: both versions get ours.) Its multipart parser
buffers a text field in memory whatever its size (a 419 MB field stays as a 419 MB
string) and decodes it with whatever charset the part names (an unknown one is a
`LookupError`). `Request` below fixes both for every app that sets it as its
`request_class` (the main app, the dashboard); `read_multipart` is the streaming parser
behind it, also used directly by uploads that need per-file limits decided while the body
arrives (adapters).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import litestar
import msgspec
from litestar.datastructures import FormMultiDict, UploadFile
from litestar.enums import RequestEncodingType
from litestar.exceptions import ClientException, SerializationException
from litestar.types import Empty
from multipart import MultipartSegment, ParserError, ParserLimitReached, PushMultipartParser

from tokenmill.errors import APIError

# A text field of a form. The largest any of our forms sends is a few hundred bytes.
FORM_FIELD_BYTES = 64 << 10
MULTIPART_HEADER_BYTES = 4096 + 128  # one header line of a part (the multipart package's default)

_UTF8 = {"utf-8", "utf8", "us-ascii", "ascii"}


def json_error(exc: BaseException) -> str | None:
    """The message for a JSON body that failed to decode, or None if `exc` is no such error."""
    if isinstance(exc, UnicodeDecodeError) or (isinstance(exc, msgspec.DecodeError) and "UTF-8" in str(exc)):
        return "JSON is malformed: a string is not valid UTF-8."
    if isinstance(exc, msgspec.DecodeError):
        return str(exc)  # "JSON is malformed: ...", "Input data was truncated"
    if isinstance(exc, RecursionError):
        return "JSON is nested too deeply."
    return None


def decode_json(body: bytes, type: Any = Any) -> Any:
    """`msgspec.json.decode` for bodies decoded by hand: every decoding error is an
    APIError 400 (validation errors against `type` too), never a 500."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"Invalid request body: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise APIError(400, json_error(exc) or "JSON is malformed.") from None


class Request(litestar.Request[Any, Any, Any]):
    """Litestar's request with JSON and form decoding that cannot end in a 500."""

    async def json(self) -> Any:
        try:
            return await super().json()
        except (UnicodeDecodeError, RecursionError) as exc:
            # A ClientException is answered as a 400 by every app's handlers, and Litestar's
            # own malformed-JSON errors become one too, with the same shape.
            raise ClientException(json_error(exc)) from None
        except SerializationException as exc:
            # Litestar's own 400 for msgspec's DecodeError, carrying msgspec's message.
            if isinstance(exc.__cause__, msgspec.DecodeError):
                raise ClientException(json_error(exc.__cause__)) from None
            raise

    async def form(self) -> FormMultiDict:
        state = self._connection_state
        if self._form is Empty and state.form is Empty:
            content_type, options = self.content_type
            if content_type == RequestEncodingType.MULTI_PART:
                boundary = options.get("boundary")
                if not boundary:
                    raise ClientException("multipart boundary missing in Content-Type")
                form = await read_multipart(
                    self.stream(),
                    boundary.encode(),
                    max_parts=self.app.multipart_form_part_limit,
                )
                # Litestar's own shape: one value per name, or a list of them.
                state.form = form.as_litestar()  # type: ignore[assignment]
        return await super().form()


@dataclass(slots=True)
class Form:
    """A multipart body: text fields and files in the order they came."""

    items: list[tuple[str, str | UploadFile]] = field(default_factory=list)

    def text(self, name: str) -> str | None:
        return next((v for k, v in self.items if k == name and isinstance(v, str)), None)

    @property
    def files(self) -> list[tuple[str, UploadFile]]:
        return [(k, v) for k, v in self.items if isinstance(v, UploadFile)]

    def as_litestar(self) -> dict[str, Any]:
        grouped: dict[str, list[Any]] = {}
        for k, v in self.items:
            grouped.setdefault(k, []).append(v)
        return {k: v if len(v) > 1 else v[0] for k, v in grouped.items()}

    async def close(self) -> None:
        for _, upload in self.files:
            await upload.close()


# Called when a file part starts, with the part and the form so far: the most bytes that
# file may have and why (ending the message "... is larger than N bytes<why>."); an
# APIError raised there refuses the upload before the file is read.
FileLimit = Callable[[MultipartSegment, Form], Awaitable[tuple[int, str]]]


def _too_large(what: str, limit: float, why: str, param: str | None) -> APIError:
    return APIError(
        413, f"{what} is larger than {int(limit)} bytes{why}.", code="request_too_large", param=param
    )


async def read_multipart(
    chunks: AsyncIterator[bytes],
    boundary: bytes,
    *,
    text_limit: int = FORM_FIELD_BYTES,
    max_parts: int = 1000,
    file_limit: FileLimit | None = None,
) -> Form:
    """Parse a multipart/form-data body as it arrives. Text fields hold at most
    `text_limit` bytes each and must be UTF-8; files are spooled to disk past 1 MiB and
    each is refused (413) as soon as it passes what `file_limit` allowed for it. A
    malformed or truncated body is a 400. On any error the files read so far are closed.
    """
    form = Form()
    text = bytearray()
    upload: UploadFile | None = None
    limit, why = math.inf, ""
    segment: MultipartSegment | None = None
    try:
        parser = PushMultipartParser(
            boundary, max_header_size=MULTIPART_HEADER_BYTES, max_segment_count=max_parts
        )
        with parser:
            async for chunk in chunks:
                if not chunk:
                    continue
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        segment, text = event, bytearray()
                        if segment.filename is not None:
                            limit, why = await file_limit(segment, form) if file_limit else (math.inf, "")
                            upload = UploadFile(
                                content_type=segment.content_type or "application/octet-stream",
                                filename=segment.filename,
                                headers=dict(segment.headerlist),
                            )
                        else:
                            upload, limit, why = None, text_limit, ""
                    elif event:
                        assert segment is not None
                        if segment.bytes_received > limit:
                            if upload is not None:
                                what, param = f"File '{segment.filename}'", segment.filename
                            else:
                                what, param = f"Form field '{segment.name}'", segment.name
                            raise _too_large(what, limit, why, param)
                        if upload is not None:
                            await upload.write(event)
                        else:
                            text.extend(event)
                    else:  # the end of a part
                        assert segment is not None
                        if upload is not None:
                            await upload.seek(0)
                            form.items.append((segment.name or "", upload))
                            upload = None
                        else:
                            form.items.append((segment.name or "", _text(segment, bytes(text))))
                        segment = None
            # Leaving the `with` checks the body was complete (a truncated one is an error).
    except ParserLimitReached as exc:
        await _discard(form, upload)
        raise APIError(413, f"The multipart body exceeds a limit: {exc}", code="request_too_large") from None
    except ParserError as exc:
        await _discard(form, upload)
        raise APIError(400, f"The multipart body is malformed: {exc}") from None
    except BaseException:
        await _discard(form, upload)
        raise
    return form


def _text(segment: MultipartSegment, raw: bytes) -> str:
    charset = (segment.charset or "utf-8").lower()
    try:
        return raw.decode("utf-8" if charset in _UTF8 else charset)
    except (LookupError, UnicodeDecodeError):
        raise APIError(
            400, f"Form field '{segment.name}' is not valid {charset} text.", param=segment.name
        ) from None


async def _discard(form: Form, upload: UploadFile | None) -> None:
    if upload is not None:
        await upload.close()
    await form.close()
