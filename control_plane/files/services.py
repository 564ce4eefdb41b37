"""Storing, reading, listing and deleting the files of `/v1/files`: bytes and rows together.

- `FileService.upload`: what a caller uploads. Purpose `batch` only, a `.jsonl` name (OpenAI's
  rule for batch files), at most `max_bytes` and `max_lines`. The lines themselves are not
  checked: as at OpenAI, a batch checks each line when it is created and reports the bad ones
  in its error file, so one malformed line does not cost the whole upload.
- `FileService.create`: what the server makes for an organisation (a batch's `batch_output`
  files), without caps; `write` + `discard` do the same inside a caller's own transaction.
- `get`/`find`, `page`, `delete`; `open` streams the bytes, `lines` numbers them for a batch
  runner.

Bytes are written before the row is added and deleted after it is: a failed write leaves no
row, and a row never names missing bytes. Every read names the organisation: another
organisation's file and one that never existed are the same 404, in the same words.
Storage calls are blocking (boto3), so they run in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Literal

from sqlalchemy import delete, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.files.models import StoredFile, file_key
from tokenmill.db import utcnow
from tokenmill.errors import APIError
from tokenmill.settings import Settings
from tokenmill.storage import CHUNK, ObjectNotFound, Storage

log = logging.getLogger("tokenmill.files")

BATCH = "batch"  # a batch's input file, uploaded
BATCH_OUTPUT = "batch_output"  # a batch's output or error file, made by the server
UPLOAD_PURPOSES = (BATCH,)
MAX_FILENAME = 255  # characters (the column's size)
# OpenAI's defaults for batch input files (TOKENMILL_MAX_FILE_BYTES, TOKENMILL_MAX_FILE_LINES).
DEFAULT_MAX_BYTES = 200 * 1024 * 1024
DEFAULT_MAX_LINES = 50_000


def new_file_id(now: datetime) -> str:
    """`file-` and 24 hex digits: the creation time in milliseconds, then 48 random bits, so ids
    sort by creation (what a listing pages by)."""
    return f"file-{int(now.timestamp() * 1000):012x}{secrets.token_hex(6)}"


def not_found(file_id: str) -> APIError:
    # One wording for a missing file and another organisation's: an id reveals nothing.
    return APIError(404, f"No such File object: {file_id}", param="file_id", code="not_found")


def too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"The file is larger than {max_bytes} bytes, the most a file may have here.",
        param="file",
        code="file_too_large",
    )


def check_upload_purpose(purpose: str) -> None:
    """400 unless files of `purpose` may be uploaded."""
    if purpose in UPLOAD_PURPOSES:
        return
    if purpose == BATCH_OUTPUT:
        message = (
            "Files with purpose 'batch_output' are made by the Batch API, not uploaded; upload a "
            "batch's input file with purpose 'batch'."
        )
    else:
        message = (
            f"Invalid value for 'purpose': '{purpose}' is not supported here; the supported value "
            "is 'batch' (an input file of the Batch API)."
        )
    raise APIError(400, message, param="purpose")


def check_filename(purpose: str, filename: str) -> None:
    """400 unless `filename` suits an uploaded file of `purpose`."""
    if not filename.strip():
        raise APIError(400, "The file has no name; send it with a file name ending in .jsonl.", param="file")
    if len(filename) > MAX_FILENAME:
        raise APIError(400, f"The file name is longer than {MAX_FILENAME} characters.", param="file")
    if purpose == BATCH and not filename.lower().endswith(".jsonl"):
        raise APIError(400, "Invalid file format for Batch API. Must be .jsonl", param="file")


def measure(content: IO[bytes]) -> tuple[int, int]:
    """(bytes, lines) of a binary file from its start, which it is left at again (blocking). A
    last line without a newline counts; blank lines count too, so the line cap also bounds
    what reading the file line by line costs."""
    content.seek(0)
    size = lines = 0
    last = b""
    while chunk := content.read(CHUNK):
        size += len(chunk)
        lines += chunk.count(b"\n")
        last = chunk[-1:]
    content.seek(0)
    return size, lines + (size > 0 and last != b"\n")


@dataclass(slots=True)
class FilePage:
    files: list[StoredFile]
    has_more: bool


class FileStore:
    """The rows, in a caller's session."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get(self, org_id: str, file_id: str) -> StoredFile | None:
        stmt = select(StoredFile).where(StoredFile.id == file_id, StoredFile.org_id == org_id)
        return await self.session.scalar(stmt)

    async def page(
        self,
        org_id: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10_000,
        order: Literal["asc", "desc"] = "desc",
    ) -> FilePage:
        """One page of the organisation's files, newest first unless `order` is asc, starting
        after the id `after` (ids sort by creation, so any id is a cursor, even a deleted one's)."""
        stmt = select(StoredFile).where(StoredFile.org_id == org_id)
        if purpose is not None:
            stmt = stmt.where(StoredFile.purpose == purpose)
        if after is not None:
            stmt = stmt.where(StoredFile.id > after if order == "asc" else StoredFile.id < after)
        by = StoredFile.id.asc() if order == "asc" else StoredFile.id.desc()
        rows = list(await self.session.scalars(stmt.order_by(by).limit(limit + 1)))
        return FilePage(rows[:limit], len(rows) > limit)

    async def delete(self, org_id: str, file_id: str) -> bool:
        """Delete the row; False if the organisation has no file by this id."""
        result = await self.session.execute(
            delete(StoredFile).where(StoredFile.id == file_id, StoredFile.org_id == org_id)
        )
        return bool(getattr(result, "rowcount", 0))


def _unavailable(what: str) -> APIError:
    return APIError(503, f"The file could not be {what} the storage; retry shortly.", code="storage_error")


class FileService:
    """Files of organisations: bytes in `storage`, rows through `sessionmaker`. The caps apply
    to uploads only (`upload`), never to the files the server makes."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        storage: Storage,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_lines: int = DEFAULT_MAX_LINES,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.storage = storage
        self.max_bytes = max_bytes
        self.max_lines = max_lines

    # --- writing ---------------------------------------------------------------------------

    async def upload(self, org_id: str, *, filename: str, purpose: str, content: IO[bytes]) -> StoredFile:
        """A caller's upload (`content` a seekable binary file, e.g. the spooled upload), checked
        against the purpose, name and caps, then stored."""
        check_upload_purpose(purpose)
        check_filename(purpose, filename)
        size, lines = await asyncio.to_thread(measure, content)
        if size > self.max_bytes:  # the gateway refuses it as it arrives; any other caller, here
            raise too_large(self.max_bytes)
        if lines > self.max_lines:
            raise APIError(
                400,
                f"The file has {lines} lines; a batch file may have at most {self.max_lines}.",
                param="file",
                code="too_many_lines",
            )
        return await self._create(org_id, filename, purpose, content, lines)

    async def create(
        self, org_id: str, *, filename: str, purpose: str, content: bytes | IO[bytes]
    ) -> StoredFile:
        """Store a file for the organisation and add its row, in a transaction of its own (what
        the server makes, e.g. purpose `batch_output`; no caps). If the row cannot be added, the
        bytes are removed again."""
        stream = _stream(content)
        _, lines = await asyncio.to_thread(measure, stream)
        return await self._create(org_id, filename, purpose, stream, lines)

    async def _create(
        self, org_id: str, filename: str, purpose: str, stream: IO[bytes], lines: int
    ) -> StoredFile:
        row = await self._write(org_id, filename, purpose, stream, lines)
        try:
            async with self.sessionmaker() as session, session.begin():
                session.add(row)
        except BaseException as exc:
            await self.discard(row)
            if isinstance(exc, SQLAlchemyError | OSError):
                log.exception("could not record file %s", row.id)
                raise APIError(
                    503, "The file was stored but could not be recorded; retry.", code="store_failed"
                ) from exc
            raise
        return row

    async def write(
        self, org_id: str, *, filename: str, purpose: str, content: bytes | IO[bytes]
    ) -> StoredFile:
        """Store the bytes and give back the file's row, not yet added to any session: a caller
        adds it in its own transaction (a batch runner, with the batch's update) and calls
        `discard` if that transaction fails. 503 if the storage fails (nothing is left)."""
        stream = _stream(content)
        _, lines = await asyncio.to_thread(measure, stream)
        return await self._write(org_id, filename, purpose, stream, lines)

    async def _write(
        self, org_id: str, filename: str, purpose: str, stream: IO[bytes], lines: int
    ) -> StoredFile:
        now = utcnow()
        file_id = new_file_id(now)
        key = file_key(org_id, file_id)
        try:
            size = await asyncio.to_thread(self.storage.put, key, stream)
        except Exception as exc:  # OSError on a disk, botocore's errors on S3: an outage either way
            log.exception("could not store file %s", key)
            await self._remove(key)  # a store keeps no half-written object; make sure of it
            raise _unavailable("written to") from exc
        return StoredFile(
            id=file_id,
            org_id=org_id,
            filename=filename,
            purpose=purpose,
            size=size,
            lines=lines,
            created_at=now,
        )

    async def discard(self, row: StoredFile) -> None:
        """Remove the bytes of a row `write` gave that was never committed."""
        await self._remove(row.key)

    async def _remove(self, key: str) -> None:
        try:
            await asyncio.to_thread(self.storage.delete, key)
        except Exception:  # the storage may be what failed; the bytes are unreferenced either way
            log.exception("could not remove stored file %s", key)

    # --- reading ---------------------------------------------------------------------------

    async def find(self, org_id: str, file_id: str) -> StoredFile | None:
        async with self.sessionmaker() as session:
            return await FileStore(session).get(org_id, file_id)

    async def get(self, org_id: str, file_id: str) -> StoredFile:
        """The organisation's file; 404 if it has none by this id."""
        row = await self.find(org_id, file_id)
        if row is None:
            raise not_found(file_id)
        return row

    async def page(
        self,
        org_id: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10_000,
        order: Literal["asc", "desc"] = "desc",
    ) -> FilePage:
        async with self.sessionmaker() as session:
            return await FileStore(session).page(
                org_id, purpose=purpose, after=after, limit=limit, order=order
            )

    async def open(self, row: StoredFile) -> AsyncGenerator[bytes, None]:
        """The file's bytes, in chunks. The object is opened here, so a failure to open it is
        raised (503, or 404 if the file was deleted meanwhile) before anything is sent."""
        stack = contextlib.ExitStack()
        try:
            stream = await asyncio.to_thread(stack.enter_context, self.storage.open(row.key))
        except Exception as exc:  # as in `write`
            if isinstance(exc, ObjectNotFound) and await self.find(row.org_id, row.id) is None:
                raise not_found(row.id) from None  # deleted since its row was read
            log.exception("could not open stored file %s", row.key)
            raise _unavailable("read from") from exc
        return _chunks(stream, stack)

    async def lines(self, row: StoredFile) -> AsyncIterator[tuple[int, bytes]]:
        """Each line of the file that is not blank, without its line end (`\\n` or `\\r\\n`), with
        its number: 1 for the first line, blank lines counted (what a batch runner reports and
        keys each request by)."""
        number = 0
        parts: list[bytes] = []  # the line so far, joined once (a long line is not copied over and over)
        chunks = await self.open(row)
        try:
            async for chunk in chunks:
                start = 0
                while (end := chunk.find(b"\n", start)) != -1:
                    parts.append(chunk[start:end])
                    line, parts = b"".join(parts), []
                    number += 1
                    if line.strip():
                        yield number, line.removesuffix(b"\r")
                    start = end + 1
                if start < len(chunk):
                    parts.append(chunk[start:])
        finally:
            await chunks.aclose()  # also when the caller stops early: the storage stream is closed now
        line = b"".join(parts)
        if line.strip():
            yield number + 1, line.removesuffix(b"\r")

    # --- deleting --------------------------------------------------------------------------

    async def delete(self, org_id: str, file_id: str) -> None:
        """Delete the organisation's file (404 if it has none by this id): the row first, then,
        once that is committed, the bytes."""
        async with self.sessionmaker() as session, session.begin():
            deleted = await FileStore(session).delete(org_id, file_id)
        if not deleted:
            raise not_found(file_id)
        await self._remove(file_key(org_id, file_id))


def file_service(
    settings: Settings, sessionmaker: async_sessionmaker[AsyncSession], storage: Storage
) -> FileService:
    """The service with the caps the settings give uploads (the gateway's and a batch runner's)."""
    return FileService(
        sessionmaker, storage, max_bytes=settings.max_file_bytes, max_lines=settings.max_file_lines
    )


def _stream(content: bytes | IO[bytes]) -> IO[bytes]:
    return io.BytesIO(content) if isinstance(content, bytes) else content


async def _chunks(stream: IO[bytes], stack: contextlib.ExitStack) -> AsyncGenerator[bytes, None]:
    try:
        while chunk := await asyncio.to_thread(stream.read, CHUNK):
            yield chunk
    finally:
        await asyncio.to_thread(stack.close)
