"""The batches of `/v1/batches` (control_plane/batches), on SQLite and PostgreSQL with a local
storage directory: refused as OpenAI refuses them, each organisation's only, paged by creation;
each input line checked once (a bad line is a line of the error file, a bad file fails the
batch); runners taking batches by lease; each line's result written once; the output and error
files written in line order; cancelled, expired. Every Batch object parses as the official SDK's
`openai.types.Batch`, and every output and error line has OpenAI's batch output keys."""

from __future__ import annotations

import asyncio
import io
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import openai.types
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.batches.lines import EXPIRED_MESSAGE, check_line, result_line
from control_plane.batches.models import Batch, BatchLine
from control_plane.batches.schemas import batch_object
from control_plane.batches.services import BatchService
from control_plane.files.models import StoredFile
from control_plane.files.services import BATCH_OUTPUT, FileService
from control_plane.orgs.models import Organization
from tests import databases
from tokenmill.db import make_engine, make_sessionmaker
from tokenmill.errors import APIError
from tokenmill.openai_batches import BatchCreateRequest
from tokenmill.storage import LocalStorage

CHAT = "/v1/chat/completions"
KEY = "key_creator"
OUTPUT_KEYS = {"id", "custom_id", "response", "error"}  # OpenAI's batch output/error line


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}


def line(custom_id: str, *, method: str = "POST", url: str = CHAT, body: Any = None) -> bytes:
    return json.dumps(
        {"custom_id": custom_id, "method": method, "url": url, "body": chat() if body is None else body}
    ).encode()


def jsonl(*lines: bytes) -> bytes:
    return b"".join(raw + b"\n" for raw in lines)


def wire(row: Batch) -> openai.types.Batch:
    """The batch as the SDK reads it: every field it knows, nothing it does not."""
    data = msgspec.to_builtins(batch_object(row))
    assert set(data) == set(openai.types.Batch.model_fields)
    return openai.types.Batch.model_validate(data)


async def _orgs(db: async_sessionmaker[AsyncSession]) -> tuple[str, str]:
    async with db() as s, s.begin():
        s.add_all([Organization(id="org_a", name="a"), Organization(id="org_b", name="b")])
    return "org_a", "org_b"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "storage"


def _services(
    db: async_sessionmaker[AsyncSession], root: Path, **kw: Any
) -> tuple[FileService, BatchService]:
    files = FileService(db, LocalStorage(root))
    return files, BatchService(db, files, **kw)


async def _upload(files: FileService, org: str, data: bytes) -> StoredFile:
    return await files.upload(org, filename="in.jsonl", purpose="batch", content=io.BytesIO(data))


async def _create(batches: BatchService, files: FileService, org: str, data: bytes, **kw: Any) -> Batch:
    source = await _upload(files, org, data)
    request = BatchCreateRequest(input_file_id=source.id, endpoint=CHAT, completion_window="24h", **kw)
    return await batches.create(org, KEY, request)


async def _ready(batches: BatchService, files: FileService, org: str, data: bytes) -> Batch:
    """A batch of `data`, validated."""
    return await batches.validate(await _create(batches, files, org, data))


async def _lines(db: async_sessionmaker[AsyncSession], batch_id: str) -> list[BatchLine]:
    async with db() as s:
        return list(
            await s.scalars(select(BatchLine).where(BatchLine.batch_id == batch_id).order_by(BatchLine.line))
        )


async def _count(db: async_sessionmaker[AsyncSession], model: type[Any]) -> int:
    async with db() as s:
        return int(await s.scalar(select(func.count()).select_from(model)) or 0)


def _stored(root: Path) -> list[Path]:
    """Every file under the storage root, partial ones included."""
    return sorted(p for p in root.rglob("*") if p.is_file())


async def _file_lines(files: FileService, org: str, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    row = await files.get(org, file_id)
    assert row.purpose == BATCH_OUTPUT
    out = [json.loads(raw) async for _, raw in files.lines(row)]
    for item in out:
        assert set(item) == OUTPUT_KEYS, item
    return out


# --- creating, reading, listing --------------------------------------------------------------


async def test_create_makes_a_validating_batch_that_the_sdk_reads(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root, window_seconds=3600)
    row = await _create(batches, files, a, jsonl(line("x")), metadata={"job": "nightly"})
    assert row.id.startswith("batch_") and len(row.id) == 30
    assert (row.org_id, row.api_key_id, row.status) == (a, KEY, "validating")
    assert row.expires_at - row.created_at == timedelta(hours=1)
    got = wire(await batches.get(a, row.id))
    assert (got.id, got.object, got.status, got.endpoint, got.completion_window) == (
        row.id,
        "batch",
        "validating",
        CHAT,
        "24h",
    )
    assert got.metadata == {"job": "nightly"} and got.errors is None and got.output_file_id is None
    assert got.expires_at == got.created_at + 3600
    assert got.request_counts is not None and (got.request_counts.total, got.request_counts.failed) == (0, 0)
    assert got.usage is not None and got.usage.total_tokens == 0


async def test_create_refuses_what_openai_refuses_naming_the_param(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, b = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    mine = await _upload(files, a, jsonl(line("x")))
    theirs = await _upload(files, b, jsonl(line("x")))
    output = await files.create(a, filename="out.jsonl", purpose=BATCH_OUTPUT, content=b"{}\n")
    never = "file-000000000000000000000000"
    ok = {"input_file_id": mine.id, "endpoint": CHAT, "completion_window": "24h"}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"endpoint": "/v1/responses"}, "endpoint", "Invalid value for 'endpoint': '/v1/responses'"),
        ({"endpoint": "/v1/chat/completions/"}, "endpoint", "Invalid value for 'endpoint'"),
        ({"completion_window": "1h"}, "completion_window", "Invalid value for 'completion_window': '1h'"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 keys"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "keys may be at most 64"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "values may be at most 512"),
        ({"input_file_id": never}, "input_file_id", f"No such File object: {never}"),
        # Another organisation's file: the same words as one that never existed.
        ({"input_file_id": theirs.id}, "input_file_id", f"No such File object: {theirs.id}"),
        ({"input_file_id": output.id}, "input_file_id", "has purpose 'batch_output'"),
    ]
    for change, param, words in cases:
        with pytest.raises(APIError) as refused:
            await batches.create(a, KEY, BatchCreateRequest(**(ok | change)))
        assert (refused.value.status, refused.value.param) == (400, param), change
        assert words in refused.value.message, (change, refused.value.message)
    assert await _count(migrated_db, Batch) == 0
    # At the limits exactly, it is fine.
    edge = {f"k{i}": "v" * 512 for i in range(15)} | {"k" * 64: "v"}
    assert (await batches.create(a, KEY, BatchCreateRequest(**ok, metadata=edge))).meta == edge


async def test_another_organisations_batch_is_the_same_404_as_a_missing_one(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, b = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    row = await _create(batches, files, a, jsonl(line("x")))
    never = "batch_000000000000000000000000"
    for batch_id in (row.id, never):
        assert await batches.find(b, batch_id) is None
        for call in (batches.get, batches.cancel):
            with pytest.raises(APIError) as missing:
                await call(b, batch_id)
            err = missing.value
            assert (err.status, err.message, err.param, err.code) == (
                404,
                f"No such Batch object: {batch_id}",
                "batch_id",
                "not_found",
            )
    assert (await batches.page(b)).batches == []
    assert (await batches.get(a, row.id)).status == "validating"  # b's cancel changed nothing


async def test_batches_page_newest_first_by_cursor(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, b = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    made = []
    for i in range(5):
        made.append((await _create(batches, files, a, jsonl(line(f"x{i}")))).id)
        await asyncio.sleep(0.002)  # ids sort by creation to the millisecond
    await _create(batches, files, b, jsonl(line("y")))  # never in a's pages
    assert sorted(made) == made

    pages, after = [], None
    while True:
        page = await batches.page(a, after=after, limit=2)
        pages.append(([r.id for r in page.batches], page.has_more))
        if not page.has_more:
            break
        after = page.batches[-1].id
    assert pages == [(made[4:2:-1], True), (made[2:0:-1], True), (made[:1], False)]
    full = await batches.page(a, limit=5)
    assert [r.id for r in full.batches] == made[::-1] and not full.has_more
    assert (await batches.page(a, after=made[0])).batches == []


# --- validation ------------------------------------------------------------------------------


async def test_bad_lines_become_failed_lines_and_the_batch_runs_the_rest(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    data = jsonl(
        line("good-1"),
        b'{"custom_id": "broken", "method": "POST"',  # 2: not JSON
        json.dumps({"custom_id": "no-body", "method": "POST", "url": CHAT}).encode(),  # 3
        line("get", method="GET"),  # 4
        line("elsewhere", url="/v1/embeddings", body={"model": "m", "input": "hi"}),  # 5
        line("streaming", body=chat(stream=True)),  # 6
        line("no-messages", body=chat(messages=[])),  # 7: the endpoint's schema refuses it
        line("typo", body=chat(temprature=0.5)),  # 8: a field the endpoint does not know
        b"   ",  # 9: blank, counted but not a request
        line("good-10", body=chat(max_tokens=20)),
    )
    row = await _ready(batches, files, a, data)
    assert row.status == "in_progress" and row.in_progress_at is not None and row.errors is None
    assert (row.total, row.completed, row.failed, row.model) == (9, 0, 7, "m")
    assert row.queued_tokens > 8 + 20  # both good lines' output, and their prompts
    got = wire(await batches.get(a, row.id))
    assert got.request_counts is not None
    assert (got.request_counts.total, got.request_counts.completed, got.request_counts.failed) == (9, 0, 7)

    rows = await _lines(migrated_db, row.id)
    assert [(r.line, r.custom_id, r.state) for r in rows] == [
        (1, "good-1", "pending"),
        (2, None, "failed"),
        (3, "no-body", "failed"),
        (4, "get", "failed"),
        (5, "elsewhere", "failed"),
        (6, "streaming", "failed"),
        (7, "no-messages", "failed"),
        (8, "typo", "failed"),
        (10, "good-10", "pending"),
    ]
    codes = {}
    for r in rows:
        if r.state == "failed":
            assert r.body is None and r.result is not None
            result = json.loads(r.result)
            assert set(result) == OUTPUT_KEYS and result["response"] is None
            assert result["custom_id"] == r.custom_id
            assert result["id"] == f"batch_req_{row.id.removeprefix('batch_')}-{r.line}"
            codes[r.line] = result["error"]["code"]
    assert codes == {
        2: "invalid_json_line",
        3: "invalid_request",
        4: "invalid_method",
        5: "mismatched_endpoint",
        6: "invalid_request",
        7: "invalid_request",
        8: "invalid_request",
    }
    # What runs: the valid lines, their bodies as sent.
    pending = await batches.pending(row.id)
    assert [(p.line, p.custom_id) for p in pending] == [(1, "good-1"), (10, "good-10")]
    assert json.loads(pending[1].body) == chat(max_tokens=20)
    assert [p.line for p in await batches.pending(row.id, after=1)] == [10]
    # Validated once: a second validation changes nothing.
    again = await batches.validate(row)
    assert (again.status, again.total, again.failed) == ("in_progress", 9, 7)
    assert len(await _lines(migrated_db, row.id)) == 9


def test_each_line_is_checked_as_its_endpoint_checks_a_request() -> None:
    ok = check_line(CHAT, 3, line("a"))
    assert (ok.line, ok.custom_id, ok.code, ok.model) == (3, "a", None, "m")
    emb = check_line("/v1/embeddings", 1, line("e", url="/v1/embeddings", body={"model": "e", "input": "hi"}))
    assert emb.code is None and emb.model == "e"
    refused = check_line(
        "/v1/embeddings", 1, line("e", url="/v1/embeddings", body={"model": "e", "messages": []})
    )
    assert refused.code == "invalid_request" and refused.custom_id == "e"
    assert check_line(CHAT, 1, line("", body=chat())).code == "invalid_request"  # empty custom_id
    assert check_line(CHAT, 1, b'["not", "an", "object"]').code == "invalid_request"
    assert check_line(CHAT, 1, line("p", method="post")).code is None  # as OpenAI: any case
    extra = json.loads(line("x"))
    extra["extra"] = 1
    assert check_line(CHAT, 1, json.dumps(extra).encode()).code == "invalid_request"


async def test_duplicate_custom_ids_fail_the_batch_naming_the_line(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    row = await _ready(batches, files, a, jsonl(line("a"), line("b"), line("a")))
    assert row.status == "failed" and row.failed_at is not None and row.in_progress_at is None
    assert row.errors == [
        {
            "code": "duplicate_custom_id",
            "message": row.errors[0]["message"],
            "param": "custom_id",
            "line": 3,
        }
    ]
    assert "'a'" in row.errors[0]["message"]
    assert (row.lease_owner, row.lease_until) == (None, None)
    assert await _lines(migrated_db, row.id) == []
    got = wire(await batches.get(a, row.id))
    assert got.status == "failed" and got.failed_at is not None and got.errors is not None
    assert got.errors.object == "list"
    assert [(e.code, e.line, e.param) for e in got.errors.data or []] == [
        ("duplicate_custom_id", 3, "custom_id")
    ]
    # A failed batch is never taken by a runner.
    assert await batches.claim("runner", 30) is None


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "empty_file"),
        (b"\n  \n\r\n", "empty_file"),  # only blank lines
        (jsonl(b"{", line("x", method="GET")), "no_valid_lines"),
    ],
)
async def test_a_file_without_a_request_to_run_fails_the_batch(
    migrated_db: async_sessionmaker[AsyncSession], root: Path, data: bytes, code: str
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    row = await _ready(batches, files, a, data)
    assert row.status == "failed" and [e["code"] for e in row.errors or []] == [code]
    assert await _lines(migrated_db, row.id) == []
    assert wire(row).errors is not None


async def test_an_input_file_deleted_before_validation_fails_the_batch(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    row = await _create(batches, files, a, jsonl(line("x")))
    await files.delete(a, row.input_file_id)
    done = await batches.validate(row)
    assert done.status == "failed" and [e["code"] for e in done.errors or []] == ["invalid_file"]


async def test_the_queue_limit_fails_a_batch_while_others_hold_the_queue(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, b = await _orgs(migrated_db)
    one = jsonl(line("x"))
    tokens = check_line(CHAT, 1, line("x")).tokens
    files, batches = _services(migrated_db, root, queue_tokens=tokens * 3 // 2)
    first = await _ready(batches, files, a, one)
    assert (first.status, first.queued_tokens) == ("in_progress", tokens)
    second = await _ready(batches, files, a, one)
    assert second.status == "failed" and second.queued_tokens == 0
    assert [e["code"] for e in second.errors or []] == ["token_limit_exceeded"]
    assert str(tokens) in (second.errors or [{}])[0]["message"]
    assert wire(second).errors is not None
    # Another organisation has a queue of its own.
    theirs = await _ready(batches, files, b, one)
    assert theirs.status == "in_progress"
    # Once the first ends, its tokens are free again.
    await batches.finalize(first, "cancelled")
    assert (await _ready(batches, files, a, one)).status == "in_progress"
    # A batch over the limit by itself never runs, even with the queue empty.
    await batches.finalize(theirs, "cancelled")
    alone = await _ready(batches, files, b, jsonl(line("p"), line("q")))
    assert alone.status == "failed" and [e["code"] for e in alone.errors or []] == ["token_limit_exceeded"]


async def test_batches_validated_at_once_never_hold_more_than_the_queue_limit(
    pg_url: str, root: Path
) -> None:
    """Runners in several processes validate an organisation's batches at the same time: each
    fits alone, only one fits beside the others (PostgreSQL: SQLite has no row locks, and
    `tokenmill serve` runs one runner there)."""
    await asyncio.to_thread(databases.migrate, pg_url)
    engine = make_engine(pg_url)
    try:
        db = make_sessionmaker(engine)
        a, _ = await _orgs(db)
        tokens = check_line(CHAT, 1, line("x")).tokens
        files, batches = _services(db, root, queue_tokens=tokens * 3 // 2)
        made = [await _create(batches, files, a, jsonl(line("x"))) for _ in range(4)]
        done = await asyncio.gather(*(batches.validate(row) for row in made))
        assert sorted(row.status for row in done) == ["failed", "failed", "failed", "in_progress"]
        async with db() as s:
            held = await s.scalar(select(func.sum(Batch.queued_tokens)).where(Batch.org_id == a))
        assert held == tokens
    finally:
        await engine.dispose()


# --- runners: leases, results, files ---------------------------------------------------------


async def test_racing_runners_each_take_a_different_batch(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    made = {(await _create(batches, files, a, jsonl(line(f"x{i}")))).id for i in range(3)}
    got = await asyncio.gather(*(batches.claim(f"runner-{i}", 30) for i in range(6)))
    taken = [(g.id, g.lease_owner) for g in got if g is not None]
    assert len(taken) == 3 and {batch_id for batch_id, _ in taken} == made
    assert len({owner for _, owner in taken}) == 3
    assert all(g.lease_until is not None for g in got if g is not None)
    assert await batches.claim("late", 30) is None  # every batch is held


async def test_one_batch_is_taken_once_until_its_lease_lapses(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    row = await _create(batches, files, a, jsonl(line("x")))
    got = await asyncio.gather(*(batches.claim(f"runner-{i}", 0.5) for i in range(4)))
    winners = [g for g in got if g is not None]
    assert len(winners) == 1 and winners[0].id == row.id
    owner = winners[0].lease_owner
    assert owner is not None
    # Its runner takes it again (after a restart, say) without waiting out its own lease.
    assert (again := await batches.claim(owner, 0.5)) is not None and again.id == row.id
    assert await batches.claim("other", 30) is None
    await asyncio.sleep(0.7)
    # Lapsed: another runner takes it over, and the first has lost it.
    taken = await batches.claim("other", 30)
    assert taken is not None and (taken.id, taken.lease_owner) == (row.id, "other")
    assert await batches.renew(row.id, owner, 30) is None
    renewed = await batches.renew(row.id, "other", 30)
    assert renewed is not None and renewed.status == "validating"
    await batches.release(row.id, owner)  # not its lease: nothing happens
    assert await batches.claim(owner, 30) is None
    await batches.release(row.id, "other")
    assert (free := await batches.claim(owner, 30)) is not None and free.lease_owner == owner


async def test_a_line_is_recorded_once(migrated_db: async_sessionmaker[AsyncSession], root: Path) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    row = await _ready(batches, files, a, jsonl(line("x"), line("y")))
    answer = result_line(row.id, 1, "x", status=200, body={"id": "chatcmpl-1"})
    assert await batches.record(row.id, 1, ok=True, result=answer, usage=(10, 4, 3))
    # A second answer of the same line (a runner that took over, say) changes nothing.
    other = result_line(row.id, 1, "x", status=200, body={"id": "chatcmpl-2"})
    assert not await batches.record(row.id, 1, ok=True, result=other, usage=(10, 4, 3))
    assert not await batches.record(row.id, 1, ok=False, result=other)
    assert not await batches.record(row.id, 7, ok=True, result=other)  # no such line
    now = await batches.get(a, row.id)
    assert (now.completed, now.failed, now.input_tokens, now.cached_tokens, now.output_tokens) == (
        1,
        0,
        10,
        4,
        3,
    )
    rows = await _lines(migrated_db, row.id)
    assert [(r.state, r.result, r.body) for r in rows[:1]] == [("ok", answer, None)]
    assert [p.line for p in await batches.pending(row.id)] == [2]
    refused = result_line(row.id, 2, "y", status=400, body={"error": {"message": "no"}})
    assert await batches.record(row.id, 2, ok=False, result=refused)
    now = await batches.get(a, row.id)
    assert (now.completed, now.failed) == (1, 1) and await batches.pending(row.id) == []
    usage = wire(now).usage
    assert usage is not None
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens) == (10, 4, 3)
    assert usage.total_tokens == 13


async def test_finalize_writes_the_files_in_line_order_and_drops_the_lines(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    row = await _ready(batches, files, a, jsonl(line("one"), b"{oops", line("three"), line("four")))
    # Answers arrive out of order.
    for n, custom_id, status in ((3, "three", 200), (4, "four", 429), (1, "one", 200)):
        body = {"id": f"chatcmpl-{n}"} if status == 200 else {"error": {"code": "insufficient_quota"}}
        result = result_line(row.id, n, custom_id, status=status, body=body)
        assert await batches.record(row.id, n, ok=status == 200, result=result, usage=(5, 0, 2))
    await batches.finalizing(row.id)
    assert (await batches.get(a, row.id)).status == "finalizing"
    before = await _count(migrated_db, StoredFile)
    done = await batches.finalize(row, "completed")
    assert done.status == "completed" and done.completed_at is not None and done.finalizing_at is not None
    assert (done.total, done.completed, done.failed) == (4, 2, 2)
    assert (done.lease_owner, done.lease_until) == (None, None)
    assert await _lines(migrated_db, row.id) == []  # the results are in the files now
    assert await _count(migrated_db, StoredFile) == before + 2

    prefix = f"batch_req_{row.id.removeprefix('batch_')}"
    output = await _file_lines(files, a, done.output_file_id)
    assert [(o["id"], o["custom_id"]) for o in output] == [(f"{prefix}-1", "one"), (f"{prefix}-3", "three")]
    for o, n in zip(output, (1, 3), strict=True):
        assert o["error"] is None
        assert o["response"] == {
            "status_code": 200,
            "request_id": f"req_{row.id}-{n}",
            "body": {"id": f"chatcmpl-{n}"},
        }
    errors = await _file_lines(files, a, done.error_file_id)
    assert [(e["id"], e["custom_id"]) for e in errors] == [(f"{prefix}-2", None), (f"{prefix}-4", "four")]
    assert errors[0]["response"] is None and errors[0]["error"]["code"] == "invalid_json_line"
    assert errors[1]["error"] is None and errors[1]["response"]["status_code"] == 429
    for file_id, name in ((done.output_file_id, "output"), (done.error_file_id, "error")):
        assert file_id is not None
        made = await files.get(a, file_id)
        assert made.filename == f"{row.id}_{name}.jsonl" and made.org_id == a

    got = wire(await batches.get(a, row.id))
    assert (got.status, got.output_file_id, got.error_file_id) == (
        "completed",
        done.output_file_id,
        done.error_file_id,
    )
    assert got.completed_at is not None and got.finalizing_at is not None
    # Finalized twice (a runner that lost the race): nothing new is written, no bytes left over.
    stored = _stored(root)
    again = await batches.finalize(row, "completed")
    assert (again.output_file_id, again.error_file_id) == (done.output_file_id, done.error_file_id)
    assert await _count(migrated_db, StoredFile) == before + 2
    assert _stored(root) == stored
    # An ended batch cannot be cancelled.
    with pytest.raises(APIError) as late:
        await batches.cancel(a, row.id)
    assert (late.value.status, late.value.code) == (409, "batch_not_cancellable")


async def test_a_batch_with_only_good_lines_has_no_error_file(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    row = await _ready(batches, files, a, jsonl(line("x")))
    await batches.record(row.id, 1, ok=True, result=result_line(row.id, 1, "x", status=200, body={}))
    done = await batches.finalize(row, "completed")
    assert done.output_file_id is not None and done.error_file_id is None
    assert wire(done).error_file_id is None


async def test_an_expired_batch_reports_what_never_ran_as_batch_expired(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    row = await _ready(batches, files, a, jsonl(line("one"), line("two"), b"[]", line("four")))
    await batches.record(row.id, 2, ok=True, result=result_line(row.id, 2, "two", status=200, body={}))
    done = await batches.finalize(row, "expired")
    assert done.status == "expired" and done.expired_at is not None and done.completed_at is None
    assert (done.total, done.completed, done.failed) == (4, 1, 3)
    output = await _file_lines(files, a, done.output_file_id)
    assert [o["custom_id"] for o in output] == ["two"]
    errors = await _file_lines(files, a, done.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("one", "batch_expired"),
        (None, "invalid_request"),
        ("four", "batch_expired"),
    ]
    assert errors[0]["error"]["message"] == EXPIRED_MESSAGE and errors[0]["response"] is None
    got = wire(done)
    assert got.status == "expired" and got.request_counts is not None and got.request_counts.failed == 3
    assert await _lines(migrated_db, row.id) == []


async def test_cancel_moves_a_running_batch_to_cancelling_and_is_idempotent(
    migrated_db: async_sessionmaker[AsyncSession], root: Path
) -> None:
    a, _ = await _orgs(migrated_db)
    files, batches = _services(migrated_db, root)
    validating = await _create(batches, files, a, jsonl(line("x")))
    running = await _ready(batches, files, a, jsonl(line("x"), line("y")))
    failed = await _ready(batches, files, a, b"")
    for row in (validating, running):
        cancelling = await batches.cancel(a, row.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        assert wire(cancelling).cancelling_at is not None
        # Twice is fine: nothing changes.
        twice = await batches.cancel(a, row.id)
        assert (twice.status, twice.cancelling_at) == ("cancelling", cancelling.cancelling_at)
    # A batch cancelled while validating is never validated.
    assert (await batches.validate(validating)).status == "cancelling"
    assert await _lines(migrated_db, validating.id) == []
    with pytest.raises(APIError) as ended:
        await batches.cancel(a, failed.id)
    assert (ended.value.status, ended.value.code) == (409, "batch_not_cancellable")
    assert "'failed'" in ended.value.message
    # Runners still take cancelling batches, to end them with what ran.
    taken = [await batches.claim(f"r{i}", 30) for i in range(3)]
    assert [t.id if t else None for t in taken] == [validating.id, running.id, None]
    await batches.record(running.id, 1, ok=True, result=result_line(running.id, 1, "x", status=200, body={}))
    done = await batches.finalize(running, "cancelled")
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert (done.completed, done.failed) == (1, 0)
    assert [o["custom_id"] for o in await _file_lines(files, a, done.output_file_id)] == ["x"]
    assert done.error_file_id is None  # the line that never ran is left out
    assert (await batches.cancel(a, running.id)).status == "cancelled"
    assert wire(done).cancelled_at is not None
