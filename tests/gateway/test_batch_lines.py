"""`/v1/batches` on the gateway (real app and server, SQLite, fake workers): the batch runner's
lines (`X-Tokenmill-Batch`, with the internal token) run as requests of the key that created
the batch, at the engine's batch priority, with the line's own request id, metered with the
batch's id, free of the key's per-minute limits but stopped by its revocation; and the Batch
API itself driven by the official SDK (create, list, retrieve, cancel, each organisation's
only), up to a batch run by the real runner whose output file the SDK reads back."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch as SDKBatch
from openai.types.chat import ChatCompletion

from billing.batches import BatchRunner
from control_plane.batches.services import BatchService, batch_service
from gateway.keys import Caller
from tests.gateway.conftest import INTERNAL, Env
from tests.gateway.test_admission import new_key
from tests.gateway.test_api import HELLO, MODEL, ledger, sdk

CHAT = "/v1/chat/completions"


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **extra}


def jsonl(*custom_ids: str) -> bytes:
    return b"".join(
        json.dumps({"custom_id": c, "method": "POST", "url": CHAT, "body": body()}).encode() + b"\n"
        for c in custom_ids
    )


def service(env: Env) -> BatchService:
    state = env.app.state
    return batch_service(state.settings, state.sessionmaker, state.storage)


async def caller(env: Env, key: str) -> Caller:
    return await env.app.state.gateway.authenticate(f"Bearer {key}")


async def create(env: Env, key: str, data: bytes, **kw: Any) -> SDKBatch:
    client = sdk(env, key)
    source = await client.files.create(file=("in.jsonl", data), purpose="batch")
    return await client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h", **kw)


async def validated(env: Env, key: str, data: bytes) -> tuple[str, str]:
    """(id, status) of a batch of `data` created with `key`, validated as a runner would."""
    made = await create(env, key, data)
    batches = service(env)
    row = await batches.validate(await batches.get((await caller(env, key)).org_id, made.id))
    return row.id, row.status


async def running(env: Env, key: str, lines: int = 3) -> str:
    """A batch of `lines` chat requests (custom ids r1, r2, ...) created with `key`, in progress."""
    batch_id, status = await validated(env, key, jsonl(*(f"r{i}" for i in range(1, lines + 1))))
    assert status == "in_progress"
    return batch_id


async def send_line(
    env: Env, batch_id: str, line: int | str | None, *, token: str = INTERNAL
) -> httpx.Response:
    """One line as the batch runner sends it."""
    headers = {"authorization": f"Bearer {token}", "x-tokenmill-batch": batch_id}
    if line is not None:
        headers["x-tokenmill-batch-line"] = str(line)
    return await env.client.post(CHAT, json=body(), headers=headers)


async def interactive(env: Env, key: str) -> httpx.Response:
    return await env.client.post(CHAT, json=body(), headers={"authorization": f"Bearer {key}"})


# --- the runner's lines ----------------------------------------------------------------------


async def test_only_the_runner_may_send_a_running_batchs_lines(gateway_env: Env) -> None:
    env = gateway_env
    worker = await env.add_worker()
    key = await new_key(env)
    batch_id = await running(env, key)
    failed, status = await validated(env, key, b"")
    assert status == "failed"
    # A key holder cannot pass a request off as a batch's line, not even the batch's creator.
    for token in (key, env.admin_key, "not-the-token"):
        r = await send_line(env, batch_id, 1, token=token)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert r.headers["x-request-id"].startswith("req_") and batch_id not in r.headers["x-request-id"]
    r = await env.client.post(CHAT, json=body(), headers={"x-tokenmill-batch": batch_id})
    assert r.status_code == 401
    # The runner's token, but no batch running by that id: never created, or ended.
    for other in ("batch_000000000000000000000000", failed):
        r = await send_line(env, other, 1)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "batch_not_running" and other in r.json()["error"]["message"]
    for bad in (None, "0", "x", "-1", "1.5"):
        r = await send_line(env, batch_id, bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Tokenmill-Batch-Line", (bad, r.text)
    # Anywhere but the endpoints a line may call, the header means nothing: the token is no key.
    r = await env.client.get(
        "/v1/models", headers={"authorization": f"Bearer {INTERNAL}", "x-tokenmill-batch": batch_id}
    )
    assert r.status_code == 401
    assert worker.received == []
    # Guessing the runner's token is throttled as guessing a key is.
    limit = env.app.state.settings.auth_failures_per_minute
    statuses = [(await send_line(env, batch_id, 1, token="guess")).status_code for _ in range(limit + 1)]
    assert statuses[-1] == 429 and set(statuses[:-1]) <= {401, 429}


async def test_a_line_runs_as_its_creators_request_at_batch_priority(gateway_env: Env) -> None:
    env = gateway_env
    worker = await env.add_worker()
    key = await new_key(env)
    creator = await caller(env, key)
    batch_id = await running(env, key)
    r = await send_line(env, batch_id, 2)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == f"req_{batch_id}-2"
    assert ChatCompletion.model_validate(r.json()).choices[0].message.content
    # Behind interactive requests on the worker, as flex is; interactive ones stay at 0.
    assert (await interactive(env, key)).status_code == 200
    assert [g.priority for g in worker.received] == [1, 0]
    # Sent again (a runner that took over), it is the same request: metered once.
    again = await send_line(env, batch_id, 2)
    assert again.status_code == 200 and again.headers["x-request-id"] == f"req_{batch_id}-2"
    assert (await send_line(env, batch_id, 3)).status_code == 200
    rows = await ledger(env, 3)
    await asyncio.sleep(0.2)  # the duplicate, had it been inserted, would be there by now
    rows = await ledger(env, 3)
    lines = [r for r in rows if r.batch_id is not None]
    assert [r.request_id for r in lines] == [f"req_{batch_id}-2", f"req_{batch_id}-3"]
    for row in lines:
        assert (row.batch_id, row.api_key_id, row.org_id) == (batch_id, creator.key_id, creator.org_id)
        assert row.prompt_tokens > 0 and row.completion_tokens == 2
    (online,) = [r for r in rows if r.batch_id is None]
    assert online.api_key_id == creator.key_id


async def test_a_line_is_metered_by_the_run_that_answered_it(gateway_env: Env) -> None:
    """The runner sends a line again until it is answered: after a 503, or when a runner died
    with it in flight. The runs that got no answer leave the line's one ledger row (the first
    event of its request id) to the run that did."""
    env = gateway_env
    key = await new_key(env)
    batch_id = await running(env, key)
    r = await send_line(env, batch_id, 1)  # no worker yet
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_available"
    worker = await env.add_worker()
    worker.delay = 0.2
    headers = {
        "authorization": f"Bearer {INTERNAL}",
        "x-tokenmill-batch": batch_id,
        "x-tokenmill-batch-line": "2",
    }
    with pytest.raises(httpx.ReadTimeout):  # the runner's connection gone mid-generation
        await env.client.post(CHAT, json=body(), headers=headers, timeout=0.3)
    for _ in range(100):  # the gateway aborts the generation when it sees the connection close
        if worker.streaming == 0:
            break
        await asyncio.sleep(0.02)
    assert worker.streaming == 0 and len(worker.received) == 1
    worker.delay = 0.0
    for line in (1, 2):
        assert (await send_line(env, batch_id, line)).status_code == 200
    await ledger(env, 2)
    await asyncio.sleep(0.2)  # an event of the unanswered runs, had one been published, is in by now
    rows = await ledger(env, 2)
    assert [(r.request_id, r.status, r.completion_tokens) for r in rows] == [
        (f"req_{batch_id}-1", "ok", 2),
        (f"req_{batch_id}-2", "ok", 2),
    ]


async def test_lines_are_free_of_the_keys_per_minute_limits(gateway_env: Env) -> None:
    env = gateway_env
    await env.add_worker()
    key = await new_key(env, requests_per_minute=1, request_burst=1, max_concurrent=1)
    batch_id = await running(env, key, lines=5)
    for n in (1, 2, 3):
        r = await send_line(env, batch_id, n)
        assert r.status_code == 200, r.text
    # The lines took nothing of the key's own minute: its first request is served, its second not.
    assert (await interactive(env, key)).status_code == 200
    limited = await interactive(env, key)
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    # Nor do the key's exhausted limits stop the batch, several lines at once included.
    done = await asyncio.gather(send_line(env, batch_id, 4), send_line(env, batch_id, 5))
    assert [r.status_code for r in done] == [200, 200]


async def test_a_revoked_creator_key_stops_its_batchs_lines(gateway_env: Env) -> None:
    env = gateway_env
    await env.add_worker()
    key, other = await new_key(env), await new_key(env, "globex")
    batch_id = await running(env, key, lines=40)
    theirs = await running(env, other)
    assert (await send_line(env, batch_id, 1)).status_code == 200  # its key's record now cached
    r = await env.client.delete(
        f"/admin/v1/keys/{(await caller(env, key)).key_id}",
        headers={"authorization": f"Bearer {env.admin_key}"},
    )
    assert r.status_code == 200, r.text
    for _ in range(100):  # the revocation travels over the bus; well within a second
        r = await send_line(env, batch_id, 2)
        if r.status_code == 401:
            break
        await asyncio.sleep(0.01)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert "revoked" in r.json()["error"]["message"]
    # Every line of such a batch is refused the same way. It is no guessing of credentials (the
    # runner's token is good): the runner is not throttled, and other batches' lines go on.
    limit = env.app.state.settings.auth_failures_per_minute
    for n in range(3, limit + 8):
        r = await send_line(env, batch_id, n)
        assert r.status_code == 401, (n, r.status_code, r.text)
    assert (await send_line(env, theirs, 1)).status_code == 200


# --- the Batch API, through the SDK ----------------------------------------------------------


async def test_the_sdk_creates_retrieves_lists_and_cancels_batches(gateway_env: Env) -> None:
    env = gateway_env
    client = sdk(env)
    source = await client.files.create(file=("in.jsonl", jsonl("a", "b")), purpose="batch")
    raw = await client.batches.with_raw_response.create(
        input_file_id=source.id, endpoint=CHAT, completion_window="24h", metadata={"job": "nightly"}
    )
    assert raw.http_response.status_code == 200 and raw.headers["x-request-id"].startswith("req_")
    assert set(raw.http_response.json()) == set(SDKBatch.model_fields)
    made = raw.parse()
    assert made.id.startswith("batch_") and made.object == "batch"
    assert (made.status, made.endpoint, made.input_file_id, made.completion_window, made.metadata) == (
        "validating",
        CHAT,
        source.id,
        "24h",
        {"job": "nightly"},
    )
    assert made.expires_at == made.created_at + 24 * 3600
    assert made.request_counts is not None and made.request_counts.total == 0
    assert await client.batches.retrieve(made.id) == made

    ids = [made.id]
    for _ in range(3):
        await asyncio.sleep(0.002)  # ids sort by creation to the millisecond
        ids.append(
            (await client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")).id
        )
    first = await client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[:1:-1] and first.has_more  # newest first
    listed = await env.client.get(
        "/v1/batches", params={"limit": 2}, headers={"authorization": f"Bearer {env.admin_key}"}
    )
    page = listed.json()
    assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == (
        "list",
        ids[3],
        ids[2],
        True,
    )
    # The SDK walks the pages by `after` itself.
    assert [b.id async for b in client.batches.list(limit=2)] == ids[::-1]
    last = await client.batches.list(after=ids[1])
    assert [b.id for b in last.data] == ids[:1] and not last.has_more
    for bad in ({"limit": 0}, {"limit": 101}):
        r = await env.client.get(
            "/v1/batches", params=bad, headers={"authorization": f"Bearer {env.admin_key}"}
        )
        assert r.status_code == 400, r.text

    cancelling = await client.batches.cancel(made.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    assert (await client.batches.cancel(made.id)).status == "cancelling"  # twice is fine
    assert (await client.batches.retrieve(made.id)).status == "cancelling"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/responses"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"input_file_id": "file-000000000000000000000000"}, "input_file_id"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
async def test_the_sdk_gets_openais_400s(gateway_env: Env, change: dict[str, Any], param: str) -> None:
    client = sdk(gateway_env)
    source = await client.files.create(file=("in.jsonl", jsonl("a")), purpose="batch")
    args: dict[str, Any] = {"input_file_id": source.id, "endpoint": CHAT, "completion_window": "24h"} | change
    with pytest.raises(openai.BadRequestError) as err:
        await client.batches.create(**args)
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    assert (await client.batches.list()).data == []
    r = await gateway_env.client.post("/v1/batches", json=args)
    assert r.status_code == 401  # no key: refused before the body is read


async def test_another_organisation_gets_404_on_retrieve_and_cancel(gateway_env: Env) -> None:
    env = gateway_env
    mine = await create(env, env.admin_key, jsonl("a"))
    other = sdk(env, (await env.tenant("other-org")).key)
    never = "batch_0000000000000000deadbeef"
    for batch_id in (mine.id, never):
        for call in (other.batches.retrieve(batch_id), other.batches.cancel(batch_id)):
            with pytest.raises(openai.NotFoundError) as err:
                await call
            # The same words as for a batch that never existed: an id reveals nothing.
            assert err.value.body == {
                "message": f"No such Batch object: {batch_id}",
                "type": "not_found_error",
                "param": "batch_id",
                "code": "not_found",
            }
    assert (await other.batches.list()).data == []
    assert (await sdk(env).batches.retrieve(mine.id)).status == "validating"  # not cancelled by them


async def test_an_ended_batch_cannot_be_cancelled(gateway_env: Env) -> None:
    env = gateway_env
    batch_id, status = await validated(env, env.admin_key, jsonl("a", "a"))
    assert status == "failed"
    failed = await sdk(env).batches.retrieve(batch_id)
    assert failed.errors is not None and [(e.code, e.line) for e in failed.errors.data or []] == [
        ("duplicate_custom_id", 2)
    ]
    with pytest.raises(openai.ConflictError) as err:
        await sdk(env).batches.cancel(batch_id)
    assert err.value.body["code"] == "batch_not_cancellable"


async def test_a_batch_run_by_the_runner_ends_with_files_the_sdk_reads(gateway_env: Env) -> None:
    env = gateway_env
    worker = await env.add_worker()
    key = await new_key(env, requests_per_minute=1, request_burst=1)
    creator = await caller(env, key)
    client = sdk(env, key)
    data = jsonl("first", "second") + b"not json\n" + jsonl("fourth")
    made = await create(env, key, data)
    runner = BatchRunner(service(env), gateway_url=str(env.client.base_url), token=INTERNAL, idle=0.05)
    assert await asyncio.wait_for(runner.run_for(30), 60) == 1
    done = await client.batches.retrieve(made.id)
    assert done.status == "completed" and done.completed_at is not None
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    assert done.usage is not None and done.usage.output_tokens == 3 * 2
    assert done.output_file_id is not None and done.error_file_id is not None
    assert {g.priority for g in worker.received} == {1} and len(worker.received) == 3

    output = [
        json.loads(raw) for raw in (await client.files.content(done.output_file_id)).content.splitlines()
    ]
    assert [o["custom_id"] for o in output] == ["first", "second", "fourth"]
    for o, n in zip(output, (1, 2, 4), strict=True):
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        assert o["response"]["status_code"] == 200
        assert o["response"]["request_id"] == f"req_{made.id}-{n}"
        ChatCompletion.model_validate(o["response"]["body"])
    (error,) = [
        json.loads(raw) for raw in (await client.files.content(done.error_file_id)).content.splitlines()
    ]
    assert error["response"] is None and error["error"]["code"] == "invalid_json_line"
    assert (await client.files.retrieve(done.output_file_id)).purpose == "batch_output"

    rows = await ledger(env, 3)
    assert sorted(r.request_id for r in rows) == [f"req_{made.id}-{n}" for n in (1, 2, 4)]
    assert {(r.batch_id, r.api_key_id) for r in rows} == {(made.id, creator.key_id)}
