"""`/v1/files` on the gateway (real app and server, SQLite, the local storage directory), driven
by the official SDK: uploaded, listed page by page, read back and deleted; each
organisation's only; refused as OpenAI refuses (purpose, file name, caps), a file over the cap
refused as it arrives; and a storage failing mid-upload leaves no file behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import FileObject
from sqlalchemy import func, select

from control_plane.files.models import StoredFile
from tests.control_plane.test_files_store import FailingMidWrite
from tests.gateway.conftest import Env
from tokenmill.storage import LocalStorage

BATCH = b"".join(
    b'{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", '
    b'"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}}\n' % i
    for i in range(3)
)


def sdk(env: Env, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{env.client.base_url}/v1",
        api_key=key or env.admin_key,
        http_client=env.client,
        max_retries=0,
    )


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def rows(env: Env) -> int:
    async with env.app.state.sessionmaker() as s:
        return int(await s.scalar(select(func.count()).select_from(StoredFile)) or 0)


def stored(env: Env) -> list[str]:
    """Every object under `files/` in the app's storage."""
    storage: LocalStorage = env.app.state.storage
    return list(storage.list("files/"))


def _walk(root: Path) -> list[Path]:
    return list(root.rglob("*"))


async def upload(client: openai.AsyncOpenAI, data: bytes = BATCH, name: str = "batch.jsonl") -> FileObject:
    return await client.files.create(file=(name, data), purpose="batch")


async def test_the_sdk_uploads_reads_and_deletes_a_batch_file(gateway_env: Env) -> None:
    env = gateway_env
    client = sdk(env)
    raw = await client.files.with_raw_response.create(file=("batch.jsonl", BATCH), purpose="batch")
    assert raw.headers["x-request-id"].startswith("req_")
    made = raw.parse()
    # OpenAI's FileObject, field for field (parsed strictly: nothing missing, nothing extra).
    body = FileObject.model_validate_json(raw.content, strict=True).model_dump()
    assert set(raw.http_response.json()) == set(FileObject.model_fields)
    assert body == {
        "id": made.id,
        "object": "file",
        "bytes": len(BATCH),
        "created_at": made.created_at,
        "filename": "batch.jsonl",
        "purpose": "batch",
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }
    assert made.id.startswith("file-") and abs(made.created_at - time.time()) < 60
    assert await client.files.retrieve(made.id) == made
    content = await client.files.content(made.id)
    assert content.content == BATCH
    assert content.response.headers["content-type"] == "application/octet-stream"
    assert content.response.headers["x-request-id"].startswith("req_")
    assert [f.id for f in (await client.files.list()).data] == [made.id]
    org = (await env.app.state.gateway.authenticate(f"Bearer {env.admin_key}")).org_id
    assert stored(env) == [f"files/{org}/{made.id}"]  # under the organisation

    deleted = await client.files.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "file", True)
    assert await rows(env) == 0 and stored(env) == []  # the row and the bytes
    for call in (client.files.retrieve(made.id), client.files.content(made.id), client.files.delete(made.id)):
        with pytest.raises(openai.NotFoundError) as err:
            await call
        assert err.value.body["message"] == f"No such File object: {made.id}"


async def test_the_list_pages_as_openais_cursor_lists(gateway_env: Env) -> None:
    client = sdk(gateway_env)
    ids = [(await upload(client, name=f"{i}.jsonl")).id for i in range(5)]
    first = await client.files.list(limit=2)
    assert [f.id for f in first.data] == ids[:2:-1] and first.has_more  # newest first
    raw = await gateway_env.client.get("/v1/files", params={"limit": 2}, headers=auth(gateway_env.admin_key))
    assert raw.json()["object"] == "list"
    assert (raw.json()["first_id"], raw.json()["last_id"]) == (ids[4], ids[3])
    # The SDK walks the pages by `after` itself.
    assert [f.id async for f in client.files.list(limit=2)] == ids[::-1]
    assert [f.id async for f in client.files.list(limit=2, order="asc")] == ids
    last = await client.files.list(limit=2, order="asc", after=ids[2])
    assert [f.id for f in last.data] == ids[3:] and not last.has_more
    assert (await client.files.list(purpose="batch_output")).data == []
    assert [f.id for f in (await client.files.list(purpose="batch")).data] == ids[::-1]
    for bad in ({"limit": 0}, {"limit": 10_001}, {"order": "sideways"}):
        r = await gateway_env.client.get("/v1/files", params=bad, headers=auth(gateway_env.admin_key))
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


async def test_another_organisation_gets_404_on_everything(gateway_env: Env) -> None:
    env = gateway_env
    mine = await upload(sdk(env))
    other = sdk(env, (await env.tenant("other-org")).key)
    never = "file-0000000000000000deadbeef"
    for file_id in (mine.id, never):
        for call in (
            other.files.retrieve(file_id),
            other.files.content(file_id),
            other.files.delete(file_id),
        ):
            with pytest.raises(openai.NotFoundError) as err:
                await call
            # The same words as for a file that never existed: an id reveals nothing.
            assert err.value.body == {
                "message": f"No such File object: {file_id}",
                "type": "not_found_error",
                "param": "file_id",
                "code": "not_found",
            }
    assert (await other.files.list()).data == []
    assert (await sdk(env).files.retrieve(mine.id)).id == mine.id  # still there for its owner
    assert (await sdk(env).files.content(mine.id)).content == BATCH


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        (
            {"purpose": "fine-tune"},
            "purpose",
            "Invalid value for 'purpose': 'fine-tune' is not supported here",
        ),
        (
            {"purpose": "batch_output"},
            "purpose",
            "Files with purpose 'batch_output' are made by the Batch API",
        ),
        ({"file": ("notes.txt", BATCH)}, "file", "Invalid file format for Batch API. Must be .jsonl"),
        (
            {"expires_after": {"anchor": "created_at", "seconds": 3600}},
            "expires_after",
            "Unrecognized request argument supplied: expires_after",
        ),
    ],
)
async def test_uploads_are_refused_as_openai_refuses_them(
    gateway_env: Env, kwargs: dict[str, Any], param: str, message: str
) -> None:
    args: dict[str, Any] = {"file": ("batch.jsonl", BATCH), "purpose": "batch", **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(gateway_env).files.create(**args)
    assert err.value.body["param"] == param and err.value.body["message"].startswith(message), err.value.body
    assert err.value.response.headers["x-request-id"].startswith("req_")
    assert await rows(gateway_env) == 0 and stored(gateway_env) == []


async def test_uploads_that_are_no_uploads_get_a_400_naming_what_is_missing(gateway_env: Env) -> None:
    env, headers = gateway_env, auth(gateway_env.admin_key)
    cases = [
        ({"files": {"purpose": (None, "batch")}}, "file"),
        ({"files": {"file": ("batch.jsonl", BATCH)}}, "purpose"),
        ({"files": {"purpose": (None, "batch"), "file": (None, "not a file part")}}, "file"),
        ({"data": {"purpose": "batch"}}, None),  # a form, but not multipart
        ({"json": {"purpose": "batch"}}, None),  # not a form at all
    ]
    for kwargs, param in cases:
        r = await env.client.post("/v1/files", headers=headers, **kwargs)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (kwargs, r.text)
    r = await env.client.post(
        "/v1/files",
        headers=headers,
        data={"purpose": "batch"},
        files=[("file", ("a.jsonl", BATCH)), ("file", ("b.jsonl", BATCH))],
    )
    assert r.status_code == 400 and "one file" in r.json()["error"]["message"]
    r = await env.client.post("/v1/files", files={"file": ("batch.jsonl", BATCH)}, data={"purpose": "batch"})
    assert r.status_code == 401  # the key is checked before anything is read
    assert await rows(env) == 0 and stored(env) == []


async def test_files_over_the_caps_are_refused(gateway_env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    env = gateway_env
    settings = env.app.state.gateway.settings
    monkeypatch.setattr(settings, "max_file_bytes", 64 << 10)
    monkeypatch.setattr(settings, "max_file_lines", 3)
    client = sdk(env)
    assert (await upload(client)).bytes == len(BATCH)  # 3 lines: at the cap
    with pytest.raises(openai.BadRequestError) as lines:
        await upload(client, BATCH + b"{}\n")
    assert lines.value.body["code"] == "too_many_lines" and lines.value.body["param"] == "file"
    with pytest.raises(openai.APIStatusError) as size:
        await upload(client, b"{}\n" + b" " * (64 << 10))
    assert size.value.status_code == 413
    assert size.value.body == {
        "message": f"The file is larger than {64 << 10} bytes, the most a file may have here.",
        "type": "invalid_request_error",
        "param": "file",
        "code": "file_too_large",
    }
    assert await rows(env) == 1 and len(stored(env)) == 1


async def _raw_upload(env: Env, head: str, send: Any) -> tuple[int, dict[str, Any], int]:
    """POST /v1/files over a bare connection: the request head, then whatever `send(writer)`
    writes (it returns the bytes it wrote) while the answer is awaited; (status, body, bytes
    written when the answer came)."""
    url = env.client.base_url
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(head.encode())
    answer = asyncio.create_task(_read_response(reader))
    sent = 0
    with contextlib.suppress(ConnectionError):
        sent = await send(writer, answer)
    status, body = await asyncio.wait_for(answer, 30)
    writer.close()
    return status, json.loads(body), sent


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    status = int(head.split(" ", 2)[1])
    length = next(int(h.split(":")[1]) for h in head.split("\r\n") if h.lower().startswith("content-length:"))
    return status, await reader.readexactly(length)


BOUNDARY = "tm-boundary"
PREFIX = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
).encode()


async def test_an_upload_over_the_cap_is_refused_before_it_is_read(
    gateway_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = gateway_env
    cap = 1 << 20
    monkeypatch.setattr(env.app.state.gateway.settings, "max_file_bytes", cap)
    head = (
        "POST /v1/files HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
    ).format(key=env.admin_key)

    # A body announcing 10 GB: answered at once, none of it read (it is never sent).
    async def nothing_more(writer: asyncio.StreamWriter, answer: asyncio.Task[Any]) -> int:
        writer.write(PREFIX)
        await writer.drain()
        return len(PREFIX)

    status, body, _ = await _raw_upload(env, head + f"Content-Length: {10**10}\r\n\r\n", nothing_more)
    assert status == 413 and body["error"]["code"] == "file_too_large", body

    # No length announced (chunked): refused as the file passes the cap, long before the 256 MiB
    # the client would send; what was spooled is gone.
    async def stream(writer: asyncio.StreamWriter, answer: asyncio.Task[Any]) -> int:
        chunk = b'{"custom_id": "x"}\n' * 13_000  # ~250 KB
        sent = 0
        for piece in (PREFIX, *[chunk] * 1000):
            if answer.done():
                break
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            sent += len(piece)
        return sent

    status, body, sent = await _raw_upload(env, head + "Transfer-Encoding: chunked\r\n\r\n", stream)
    assert status == 413 and body["error"]["param"] == "file", body
    assert sent < 64 << 20, sent  # the answer came while the client was still sending
    assert await rows(env) == 0 and stored(env) == []


async def test_an_upload_may_be_larger_than_the_apis_body_limit(gateway_env: Env) -> None:
    limit = gateway_env.app.state.settings.max_request_bytes
    line = b'{"custom_id": "x", "body": {"input": "' + b"y" * 10_000 + b'"}}\n'
    data = line * (limit // len(line) + 10)
    made = await upload(sdk(gateway_env), data)
    assert made.bytes == len(data) > limit
    assert (await sdk(gateway_env).files.content(made.id)).content == data


async def test_a_storage_failing_mid_upload_leaves_no_file(gateway_env: Env) -> None:
    env = gateway_env
    healthy = env.app.state.storage
    env.app.state.storage = FailingMidWrite(healthy.root, room=100)
    try:
        with pytest.raises(openai.InternalServerError) as err:
            await upload(sdk(env), BATCH * 10)
    finally:
        env.app.state.storage = healthy
    assert err.value.status_code == 503 and err.value.body["code"] == "storage_error"
    assert await rows(env) == 0 and stored(env) == []
    assert not any(p.is_file() for p in _walk(healthy.root))  # no partial file either
    made = await upload(sdk(env))  # the storage is back: uploads work again
    assert (await sdk(env).files.content(made.id)).content == BATCH
