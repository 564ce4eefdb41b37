"""The files of `/v1/files` (control_plane/files), on SQLite and PostgreSQL with a local
storage directory: bytes and row together or neither, each organisation's only, paged by
creation, read back in chunks and numbered lines (what a batch runner reads), deleted whole."""

from __future__ import annotations

import contextlib
import errno
import io
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.files.models import StoredFile
from control_plane.files.services import (
    BATCH_OUTPUT,
    FileService,
    FileStore,
    measure,
    new_file_id,
)
from control_plane.orgs.models import Organization
from tokenmill.errors import APIError
from tokenmill.storage import LocalStorage

LINES = b'{"custom_id": "a"}\n{"custom_id": "b"}\n'


async def _orgs(db: async_sessionmaker[AsyncSession]) -> tuple[str, str]:
    async with db() as s, s.begin():
        s.add_all([Organization(id="org_a", name="a"), Organization(id="org_b", name="b")])
    return "org_a", "org_b"


async def _rows(db: async_sessionmaker[AsyncSession]) -> int:
    async with db() as s:
        return int(await s.scalar(select(func.count()).select_from(StoredFile)) or 0)


def _stored(root: Path) -> list[Path]:
    """Every file under the storage root, partial ones included."""
    return [p for p in root.rglob("*") if p.is_file()]


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _service(db: async_sessionmaker[AsyncSession], root: Path, **caps: int) -> FileService:
    return FileService(db, LocalStorage(root), **caps)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The storage directory (beside the SQLite database, not around it)."""
    return tmp_path / "storage"


async def _upload(files: FileService, org: str, data: bytes, name: str = "in.jsonl") -> StoredFile:
    return await files.upload(org, filename=name, purpose="batch", content=io.BytesIO(data))


async def _content(files: FileService, row: StoredFile) -> bytes:
    return b"".join([chunk async for chunk in await files.open(row)])


async def test_a_file_is_stored_whole_and_is_its_organisations_only(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, b = await _orgs(migrated_db)
    files = _service(migrated_db, root)
    row = await _upload(files, a, LINES)
    assert row.id.startswith("file-") and len(row.id) == 29
    assert (row.org_id, row.filename, row.purpose, row.size, row.lines) == (
        a,
        "in.jsonl",
        "batch",
        len(LINES),
        2,
    )
    # The bytes are where the key says, under the organisation.
    assert (root / "files" / a / row.id).read_bytes() == LINES
    found = await files.get(a, row.id)
    assert (found.id, found.size, found.created_at) == (row.id, row.size, row.created_at)
    assert await _content(files, found) == LINES
    # Another organisation, and an id that never existed: the same 404, in the same words.
    for org, file_id in ((b, row.id), (a, "file-000000000000000000000000")):
        assert await files.find(org, file_id) is None
        with pytest.raises(APIError) as missing:
            await files.get(org, file_id)
        assert (missing.value.status, missing.value.message) == (404, f"No such File object: {file_id}")
        with pytest.raises(APIError) as not_theirs:
            await files.delete(org, file_id)
        assert not_theirs.value.status == 404
    assert (await files.page(b)).files == []
    # Deleting removes the row and the bytes; a second delete is a 404.
    await files.delete(a, row.id)
    assert await _rows(migrated_db) == 0
    assert not (root / "files" / a / row.id).exists()
    with pytest.raises(APIError) as gone:
        await files.delete(a, row.id)
    assert gone.value.status == 404


async def test_files_page_by_creation_with_cursors_that_outlive_their_file(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, b = await _orgs(migrated_db)
    files = _service(migrated_db, root)
    made = [await _upload(files, a, LINES, f"{i}.jsonl") for i in range(5)]
    await _upload(files, b, LINES)  # never in a's pages
    output = await files.create(a, filename="out.jsonl", purpose=BATCH_OUTPUT, content=b"{}\n")
    ids = [f.id for f in made]
    assert sorted(ids) == ids  # ids sort by creation

    async def walk(order: str, limit: int, purpose: str | None = "batch") -> list[list[str]]:
        pages, after = [], None
        while True:
            page = await files.page(a, purpose=purpose, after=after, limit=limit, order=order)  # type: ignore[arg-type]
            pages.append([f.id for f in page.files])
            if not page.has_more:
                return pages
            after = page.files[-1].id

    assert await walk("desc", 2) == [ids[4:2:-1], ids[2:0:-1], ids[:1]]  # newest first by default
    assert await walk("asc", 2) == [ids[0:2], ids[2:4], ids[4:]]
    assert await walk("asc", 5) == [ids]  # exactly one full page: no more
    assert await walk("desc", 10, None) == [[output.id, *ids[::-1]]]
    assert [f.id for f in (await files.page(a, purpose=BATCH_OUTPUT)).files] == [output.id]
    assert (await files.page(a, purpose="fine-tune")).files == []
    # A cursor whose file was deleted meanwhile still pages on from where it was.
    await files.delete(a, ids[2])
    page = await files.page(a, purpose="batch", after=ids[2], limit=10, order="asc")
    assert [f.id for f in page.files] == ids[3:] and not page.has_more


def test_ids_sort_by_creation_time() -> None:
    t = datetime(2026, 12, 1, tzinfo=UTC)
    earlier, later = new_file_id(t), new_file_id(t + timedelta(milliseconds=1))
    assert earlier < later and earlier[:17] != later[:17]
    assert new_file_id(t) != earlier  # the random part


@pytest.mark.parametrize(
    ("purpose", "name", "param", "words"),
    [
        ("batch_output", "x.jsonl", "purpose", "made by the Batch API"),
        ("fine-tune", "x.jsonl", "purpose", "'fine-tune' is not supported here"),
        ("batch", "x.json", "file", "Invalid file format for Batch API. Must be .jsonl"),
        ("batch", " ", "file", "The file has no name"),
    ],
)
async def test_uploads_are_refused_for_a_purpose_or_name_batch_files_cannot_have(
    migrated_db: async_sessionmaker[AsyncSession],
    root: Path,
    purpose: str,
    name: str,
    param: str,
    words: str,
) -> None:
    a, _ = await _orgs(migrated_db)
    files = _service(migrated_db, root)
    with pytest.raises(APIError) as refused:
        await files.upload(a, filename=name, purpose=purpose, content=io.BytesIO(LINES))
    assert (refused.value.status, refused.value.param) == (400, param)
    assert words in refused.value.message
    assert await _rows(migrated_db) == 0 and not (root / "files").exists()


async def test_caps_apply_to_uploads_not_to_what_the_server_makes(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files = _service(migrated_db, root, max_bytes=len(LINES), max_lines=2)
    assert (await _upload(files, a, LINES)).lines == 2  # exactly at both caps
    with pytest.raises(APIError) as too_big:
        await _upload(files, a, LINES + b"{}")
    assert (too_big.value.status, too_big.value.code, too_big.value.param) == (413, "file_too_large", "file")
    with pytest.raises(APIError) as too_long:
        await _upload(files, a, b"{}\n{}\n{}")  # three lines, the last without its newline
    assert (too_long.value.status, too_long.value.code) == (400, "too_many_lines")
    assert "3 lines" in too_long.value.message and "at most 2" in too_long.value.message
    assert await _rows(migrated_db) == 1
    made = await files.create(a, filename="out.jsonl", purpose=BATCH_OUTPUT, content=LINES * 10)
    assert (made.size, made.lines) == (len(LINES) * 10, 20)


class FailingMidWrite(LocalStorage):
    """A local storage whose writes fail after `room` bytes have gone to disk, as a full disk or
    a dropped connection to S3 would fail them: the real store's clean-up runs."""

    def __init__(self, root: Path, room: int) -> None:
        super().__init__(root)
        self.room = room

    def put(self, key: str, data: bytes | IO[bytes]) -> int:
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        room = self.room

        class Filling:
            def read(self, size: int = -1) -> bytes:
                nonlocal room
                if room <= 0:
                    raise OSError(errno.ENOSPC, "No space left on device")
                chunk = source.read(min(size if size >= 0 else room, room))
                room -= len(chunk)
                return chunk

        return super().put(key, Filling())  # type: ignore[arg-type]


async def test_a_failed_write_leaves_neither_row_nor_bytes(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files = FileService(migrated_db, FailingMidWrite(root, room=10))
    with pytest.raises(APIError) as failed:
        await _upload(files, a, LINES)
    assert (failed.value.status, failed.value.code) == (503, "storage_error")
    assert await _rows(migrated_db) == 0
    assert _stored(root) == []  # not even a partial file


async def test_bytes_whose_row_cannot_be_added_are_removed(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    await _orgs(migrated_db)
    files = _service(migrated_db, root)
    # No such organisation: the row breaks its foreign key after the bytes were written.
    with pytest.raises(APIError) as failed:
        await _upload(files, "org_gone", LINES)
    assert (failed.value.status, failed.value.code) == (503, "store_failed")
    assert await _rows(migrated_db) == 0
    assert _stored(root) == []


async def test_a_runner_adds_the_row_in_its_own_transaction_or_discards_the_bytes(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files = _service(migrated_db, root)
    kept = await files.write(a, filename="out.jsonl", purpose=BATCH_OUTPUT, content=LINES)
    assert await files.find(a, kept.id) is None  # stored, not yet recorded
    async with migrated_db() as s, s.begin():
        s.add(kept)  # beside the batch's own update, in one transaction
    assert await _content(files, await files.get(a, kept.id)) == LINES

    dropped = await files.write(a, filename="err.jsonl", purpose=BATCH_OUTPUT, content=LINES)
    assert (root / dropped.key).exists()
    with pytest.raises(RuntimeError):
        async with migrated_db() as s, s.begin():
            s.add(dropped)
            raise RuntimeError("the batch's update failed")
    await files.discard(dropped)
    assert not (root / dropped.key).exists() and await files.find(a, dropped.id) is None
    async with migrated_db() as s:
        assert [f.id for f in (await FileStore(s).page(a)).files] == [kept.id]


async def test_lines_are_numbered_as_in_the_file_and_agree_with_the_count(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files = _service(migrated_db, root)
    long = b'{"x": "' + b"y" * (3 << 20) + b'"}'  # spans several chunks of the storage stream
    data = b'{"n": 1}\r\n\n  \n' + long + b"\n" + b'{"n": 5}'  # CRLF, blank lines, no final newline
    row = await files.create(a, filename="mixed.jsonl", purpose="batch", content=data)
    assert row.lines == 5 == measure(io.BytesIO(data))[1]
    got = [(n, line) async for n, line in files.lines(row)]
    assert got == [(1, b'{"n": 1}'), (4, long), (5, b'{"n": 5}')]
    assert measure(io.BytesIO(b"")) == (0, 0) and measure(io.BytesIO(b"\n")) == (1, 1)
    # A reader that stops early (and closes the iterator) leaves no storage stream open.
    before = _open_files()
    async with contextlib.aclosing(files.lines(row)) as lines:
        async for _ in lines:
            assert _open_files() == before + 1  # the stored object, being read
            break
    assert _open_files() == before
