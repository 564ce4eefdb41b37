"""`/v1/batches` in the production setup: a gateway served over HTTP and a real Celery worker
running `billing.run_batches`, on one PostgreSQL database and one Redis (the bus, and the
broker), with shared file storage. The worker is killed mid-batch (its whole process group,
SIGKILL, a line in flight); a new worker, once the dead one's lease lapses, completes the batch
with every line in the output once, and the ledger holds exactly one usage event per output
line, metered as the output says."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import select

from billing import celery_app as capp
from billing.batches import LEASE, BatchRunner
from billing.models import UsageEvent
from control_plane.batches.models import Batch
from control_plane.batches.services import batch_service
from control_plane.bootstrap import bootstrap
from tests import databases
from tests.billing.test_celery import ROOT, _through_worker, start_celery_worker, stop_celery_worker
from tests.gateway.conftest import BUNDLED_NAME, INTERNAL, Env, serve
from tests.gateway.test_admission import new_key
from tests.gateway.test_api import sdk
from tests.gateway.test_batch_lines import caller, create, jsonl
from tokenmill.app import Parts, create_app
from tokenmill.bus import make_bus
from tokenmill.db import make_engine, make_sessionmaker, utcnow
from tokenmill.protocol import USAGE
from tokenmill.settings import BUNDLED_MODEL, Settings
from tokenmill.storage import open_storage

LINES = 60
CONCURRENCY = 2  # lines the runner keeps in flight: with slow workers, the batch takes seconds
TOKEN_DELAY = 0.05  # seconds per token of the fake worker; each line asks for 2 tokens
KILL_AFTER = 10  # lines recorded before the worker is killed


def _own_redis(redis_url: str) -> str:
    """A database index of this test's own on the test Redis (the Celery tests use 13)."""
    base, _, db = redis_url.rpartition("/")
    return f"{base}/12" if db.isdigit() else redis_url


@pytest.fixture
async def platform(pg_url: str, redis_url: str, tmp_path: Path, model_cache: Path) -> AsyncIterator[Env]:
    """The gateway (with the usage consumer that writes the ledger) on PostgreSQL and Redis,
    served over HTTP."""
    url = _own_redis(redis_url)
    with redis.Redis.from_url(url) as r:
        r.delete(USAGE)  # usage events an aborted earlier run left: not this ledger's
    settings = Settings(
        home=tmp_path / "gateway",
        database_url=pg_url,
        redis_url=url,
        storage_url=f"file://{tmp_path / 'storage'}",
        internal_token=INTERNAL,
        secret_key="test-secret",
        model_cache=model_cache,
        worker_wait_seconds=1.0,
        worker_timeout_seconds=600.0,  # the fake worker beats once; the test outlasts a lease
    )
    await asyncio.to_thread(databases.migrate, pg_url)
    engine = make_engine(pg_url)
    boot = await bootstrap(
        make_sessionmaker(engine),
        secret_key="test-secret",
        model_name=BUNDLED_NAME,
        model_source=BUNDLED_MODEL,
        model_format="gguf",
        context_length=8192,
    )
    assert boot.admin_secret
    app = create_app(settings, engine, Parts(gateway=True, consumers=True))
    async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        env = Env(client, app, boot.admin_secret, boot.deployment.id, [])
        async with env._stack:
            yield env


def _worker_env(env: Env, tmp_path: Path) -> dict[str, str]:
    """Production's Celery worker settings: the gateway's URL and internal token, the same
    database, Redis and storage, a home of its own."""
    settings = env.app.state.settings
    worker = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    worker.update(
        DATABASE_URL=settings.database_url,
        REDIS_URL=settings.redis_url,
        TOKENMILL_HOME=str(tmp_path / "celery"),
        TOKENMILL_STORAGE_URL=settings.storage_url,
        TOKENMILL_GATEWAY_URL=str(env.client.base_url),
        TOKENMILL_INTERNAL_TOKEN=INTERNAL,
        TOKENMILL_BATCH_CONCURRENCY=str(CONCURRENCY),
        PYTHONPATH=str(ROOT),
    )
    worker.pop("TOKENMILL_CELERY_BROKER_URL", None)
    return worker


async def _batch_row(env: Env, batch_id: str) -> Batch:
    async with env.app.state.sessionmaker() as s:
        row = await s.get(Batch, batch_id)
    assert row is not None
    return row


async def _ledger(env: Env, batch_id: str, n: int) -> list[UsageEvent]:
    """The batch's usage events once there are `n` (the consumer writes them a little later),
    read again after a pause in which any more would have arrived."""
    stmt = select(UsageEvent).where(UsageEvent.batch_id == batch_id).order_by(UsageEvent.request_id)
    deadline = time.monotonic() + 30
    while True:
        async with env.app.state.sessionmaker() as s:
            rows = list(await s.scalars(stmt))
        if len(rows) >= n or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    async with env.app.state.sessionmaker() as s:
        return list(await s.scalars(stmt))


async def test_a_killed_celery_worker_leaves_a_batch_the_next_one_completes(
    platform: Env, tmp_path: Path
) -> None:
    env = platform
    fake = await env.add_worker()
    fake.delay = TOKEN_DELAY
    key = await new_key(env)
    creator = await caller(env, key)
    client = sdk(env, key)
    custom_ids = [f"line-{n}" for n in range(1, LINES + 1)]
    made = await create(env, key, jsonl(*custom_ids))
    assert made.status == "validating"

    worker_env = _worker_env(env, tmp_path)
    tasks = capp.make_celery(
        Settings(redis_url=worker_env["REDIS_URL"], database_url=worker_env["DATABASE_URL"])
    )
    first = start_celery_worker(worker_env, tmp_path, tmp_path / "worker-1.log")
    second: subprocess.Popen[bytes] | None = None
    try:
        # The first worker takes the batch and runs lines until it is killed, one in flight.
        tasks.send_task("billing.run_batches", ignore_result=True)  # its worker dies: no result
        deadline = time.monotonic() + 90
        while True:
            assert first.poll() is None, (tmp_path / "worker-1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "worker-1.log").read_text()[-3000:]
            counts = (await client.batches.retrieve(made.id)).request_counts
            if counts is not None and counts.completed >= KILL_AFTER and fake.streaming > 0:
                os.killpg(first.pid, signal.SIGKILL)  # nothing awaited since the check: still in flight
                break
            await asyncio.sleep(0.02)
        first.wait()
        mid = await client.batches.retrieve(made.id)
        assert mid.status == "in_progress" and mid.request_counts is not None
        assert mid.request_counts.total == LINES
        assert 0 < mid.request_counts.completed < LINES and mid.request_counts.failed == 0
        held = await _batch_row(env, made.id)
        assert held.lease_owner is not None and held.lease_until is not None and held.lease_until > utcnow()

        # A new worker: refused the batch while the dead one's lease runs, then completes it.
        second = start_celery_worker(worker_env, tmp_path, tmp_path / "worker-2.log")
        handle = {"app": tasks, "proc": second, "log": tmp_path / "worker-2.log"}
        results: list[Any] = []
        deadline = time.monotonic() + LEASE + 120
        while True:
            results.append(await _through_worker(handle, "billing.run_batches"))
            if (await client.batches.retrieve(made.id)).status == "completed":
                break
            assert time.monotonic() < deadline, (results, handle["log"].read_text()[-3000:])
            await asyncio.sleep(1.0)
        # The lease kept the new runner off the batch at first; then one task took it to the end.
        assert len(results) >= 2 and results == [{"batches": 0}] * (len(results) - 1) + [{"batches": 1}]
    finally:
        tasks.close()
        for proc in (first, second):
            if proc is not None:
                stop_celery_worker(proc)

    done = await client.batches.retrieve(made.id)
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        LINES,
        LINES,
        0,
    )
    assert done.error_file_id is None and done.output_file_id is not None
    assert done.usage is not None and done.usage.output_tokens == 2 * LINES  # each line counted once
    # The line in flight at the kill was sent again.
    assert len(fake.received) > LINES

    output = [
        json.loads(raw) for raw in (await client.files.content(done.output_file_id)).content.splitlines()
    ]
    seen = Counter(o["custom_id"] for o in output)
    assert sorted(seen) == sorted(custom_ids) and set(seen.values()) == {1}
    for o in output:
        line = int(o["custom_id"].removeprefix("line-"))
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["request_id"] == f"req_{made.id}-{line}"

    # The ledger: one usage event per output line, each as the output meters it, of the key
    # that created the batch; none for a line's aborted first run.
    rows = await _ledger(env, made.id, LINES)
    billed = {r.request_id: r for r in rows}
    assert len(rows) == len(billed) == len(output)
    assert sorted(billed) == sorted(o["response"]["request_id"] for o in output)
    for o in output:
        row, usage = billed[o["response"]["request_id"]], o["response"]["body"]["usage"]
        assert (row.status, row.prompt_tokens, row.completion_tokens) == (
            "ok",
            usage["prompt_tokens"],
            usage["completion_tokens"],
        ), o["custom_id"]
        assert (row.org_id, row.api_key_id) == (creator.org_id, creator.key_id)
    assert sum(r.completion_tokens for r in rows) == done.usage.output_tokens


async def test_a_runner_with_nothing_to_do_ends_at_once(pg_url: str, redis_url: str, tmp_path: Path) -> None:
    """What a `billing.run_batches` task does when no batch waits: claim nothing and end, its
    follower of the workers' heartbeats stopped even when redis-py swallows a cancellation
    (a single cancel left about one task in ten running until the job time limit)."""
    await asyncio.to_thread(databases.migrate, pg_url)
    settings = Settings(home=tmp_path, database_url=pg_url, redis_url=_own_redis(redis_url))
    engine = make_engine(pg_url)
    try:
        batches = batch_service(settings, make_sessionmaker(engine), open_storage(settings))
        for _ in range(20):
            bus = make_bus(settings)
            try:
                runner = BatchRunner(batches, gateway_url="http://127.0.0.1:9", token=INTERNAL, bus=bus)
                assert await asyncio.wait_for(runner.run_for(60), 5) == 0
            finally:
                await bus.close()
    finally:
        await engine.dispose()
