"""Consumer groups on Redis when a consumer dies, and the trimming of the streams they read.

- A consumer killed between reading and acknowledging (a real process, SIGKILLed) leaves its
  entries pending under a name that never comes back (pod names change on every restart):
  another consumer claims them once they have been idle past the bus's threshold, and the
  ledger ends with each event exactly once.
- The usage stream is never capped when published: it is trimmed only behind every group
  reading it, however far more than the cap is published. Fan-out streams stay capped.

Claim tests use the session's throwaway Redis with random stream names; trimming tests run a
`redis-server` of their own, since they need the real usage stream name.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from redis.asyncio import Redis
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.ledger.services import UsageConsumer, record_usage
from billing.models import UsageEvent
from tests.conftest import _start_redis, _stop_process
from tokenmill import bus as bus_module
from tokenmill.bus import DEFAULT_MAXLEN, RedisBus
from tokenmill.protocol import KV, USAGE, WORKERS, UsageRecord
from tokenmill.resp import RespClient, RespPublisher

GROUP = "billing-ledger"

# A consumer process that reads `n` entries and dies before acknowledging them: it prints
# how many it holds, then waits (as if in the middle of writing them) for its SIGKILL.
_DOOMED = """
import asyncio, sys
from tokenmill.bus import RedisBus

async def main(url: str, stream: str, consumer: str, n: int) -> None:
    bus = RedisBus.from_url(url)
    got = []
    while len(got) < n:
        got += await bus.read_group(stream, "billing-ledger", consumer, block=1.0, count=n)
    print(len(got), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


def _usage(i: int) -> UsageRecord:
    return UsageRecord(request_id=f"req-{i}", org_id="org-1", model="m", prompt_tokens=i)


def _read_and_die(url: str, stream: str, consumer: str, n: int) -> None:
    """Run a consumer process that reads `n` entries, then SIGKILL it before it acks."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _DOOMED, url, stream, consumer, str(n)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child prints once it holds the batch
        assert line.strip() == str(n).encode(), proc.stderr.read() if proc.stderr else line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


async def _pending(client: Redis, stream: str) -> dict[str, int]:
    """Consumer name -> how many entries it holds pending."""
    summary = await client.xpending(stream, GROUP)
    return {c["name"].decode(): int(c["pending"]) for c in summary["consumers"]}


@pytest.fixture
async def plain(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def stream(plain: Redis) -> AsyncIterator[str]:
    name = f"test:recovery:{secrets.token_hex(6)}"
    yield name
    await plain.delete(name)


# --- a killed consumer's entries --------------------------------------------------------------


async def test_entries_of_a_killed_consumer_are_claimed_by_another(
    redis_url: str, plain: Redis, stream: str
) -> None:
    producer = RedisBus.from_url(redis_url)
    claim_idle = 2.0
    survivor = RedisBus.from_url(redis_url, claim_idle=claim_idle)
    try:
        ids = [await producer.publish(stream, {"i": i}) for i in range(5)]
        _read_and_die(redis_url, stream, "pod-a-1", 5)
        killed = time.monotonic()
        assert await _pending(plain, stream) == {"pod-a-1": 5}
        await plain.xdel(stream, ids[1])  # trimmed or deleted while pending: nothing to deliver
        later = [await producer.publish(stream, {"i": i}) for i in (5, 6)]

        # Not before the threshold: a live consumer that is merely slow keeps its entries.
        delivered: list[str] = []
        while time.monotonic() - killed < claim_idle * 0.5:
            got = await survivor.read_group(stream, GROUP, "pod-a-2", block=0.1)
            delivered += [e for e, _ in got]
            await survivor.ack(stream, GROUP, *[e for e, _ in got])
        assert delivered == later
        # (Redis 7 drops the deleted entry from the pending list as soon as a scan meets it.)
        assert (await _pending(plain, stream)).get("pod-a-1", 0) >= 4

        # Past it, the new consumer (another name, as after a pod restart) gets them once.
        deadline = time.monotonic() + claim_idle * 4 + 5
        while len(delivered) < len(later) + 4 and time.monotonic() < deadline:
            got = await survivor.read_group(stream, GROUP, "pod-a-2", block=0.1)
            assert all(data for _, data in got)  # never an empty event for the deleted one
            delivered += [e for e, _ in got]
            await survivor.ack(stream, GROUP, *[e for e, _ in got])
        assert time.monotonic() - killed >= claim_idle
        assert sorted(delivered) == sorted([*ids[:1], *ids[2:], *later])  # each exactly once
        assert sum((await _pending(plain, stream)).values()) == 0  # the deleted one too
    finally:
        await producer.close()
        await survivor.close()


async def test_usage_of_a_killed_consumer_reaches_the_ledger_exactly_once(
    migrated_db: async_sessionmaker[AsyncSession], redis_url: str, plain: Redis, stream: str
) -> None:
    producer = RedisBus.from_url(redis_url)
    bus = RedisBus.from_url(redis_url, claim_idle=0.5)
    consumer = UsageConsumer(bus, migrated_db, "pod-b-2")
    consumer.stream = stream
    try:
        for i in range(20):
            await producer.publish(stream, _usage(i))
        _read_and_die(redis_url, stream, "pod-b-1", 20)
        # It had committed the first half when it died (the ack never happened).
        async with migrated_db() as s, s.begin():
            await record_usage(s, [_usage(i) for i in range(10)])

        await consumer.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            async with migrated_db() as s:
                n = await s.scalar(select(func.count()).select_from(UsageEvent))
            if n == 20 and not sum((await _pending(plain, stream)).values()):
                break
            await asyncio.sleep(0.1)
        async with migrated_db() as s:
            rows = (await s.scalars(select(UsageEvent.request_id))).all()
        assert sorted(rows) == sorted(f"req-{i}" for i in range(20))
        assert sum((await _pending(plain, stream)).values()) == 0
    finally:
        await consumer.stop()
        await bus.close()
        await producer.close()


# --- trimming -------------------------------------------------------------------------------


@pytest.fixture
def own_redis() -> Iterator[str]:
    """A redis-server of this test's own: the trimming tests use the real stream names."""
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-trim-"))
    try:
        proc, port = _start_redis(tmp)
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            _stop_process(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _ids(client: Redis, stream: str) -> list[str]:
    return [i.decode() for i, _ in await client.xrange(stream)]


async def test_usage_stream_is_trimmed_only_behind_its_group(
    own_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 10
    # A tiny cap, for every stream and for the usage stream's own (about 2M entries before
    # usage was trimmed behind its group): were it applied, unread events would go. The
    # gateway publishes through RespPublisher, billing reads through RedisBus.
    monkeypatch.setitem(bus_module.STREAM_MAXLEN, USAGE, cap)
    client = RespClient.from_url(own_redis)
    gateway = RespPublisher(client, maxlen=cap)
    bus = RedisBus.from_url(own_redis, maxlen=cap, trim_interval=0.0)
    plain = Redis.from_url(own_redis)
    try:
        published = [await bus.publish(USAGE, _usage(i)) for i in range(300)]
        published += [await gateway.publish(USAGE, _usage(i)) for i in range(300, 600)]
        assert await plain.xlen(USAGE) == 600  # no MAXLEN on the usage stream

        delivered = [e for e, _ in await bus.read_group(USAGE, GROUP, "c", block=0, count=250)]
        assert delivered == published[:250]
        await bus.ack(USAGE, GROUP, *published[:200])  # 200..249 stay pending
        more = [e for e, _ in await bus.read_group(USAGE, GROUP, "c", block=0, count=100)]
        await bus.ack(USAGE, GROUP, *more)
        delivered += more
        kept = await _ids(plain, USAGE)
        assert len(kept) < 550  # trimmed behind the group...
        assert kept[-400:] == published[200:]  # ...never at or past its oldest pending entry

        # Far more than the cap while one entry stays unacknowledged: nothing unread is lost.
        published += [await gateway.publish(USAGE, _usage(i)) for i in range(600, 1600)]
        while got := await bus.read_group(USAGE, GROUP, "c", block=0, count=300):
            delivered += [e for e, _ in got]
            await bus.ack(USAGE, GROUP, *[e for e, _ in got])
        assert delivered == published
        await bus.replay_pending(USAGE, GROUP, "c")
        pending = await bus.read_group(USAGE, GROUP, "c", block=0, count=100)
        assert [e for e, _ in pending] == published[200:250]
        assert [msgspec.json.decode(d)["request_id"] for _, d in pending] == [
            f"req-{i}" for i in range(200, 250)
        ]
        await bus.ack(USAGE, GROUP, *[e for e, _ in pending])

        # All acknowledged: the next read trims the stream down to (about) nothing.
        assert await bus.read_group(USAGE, GROUP, "c", block=0) == []
        assert await plain.xlen(USAGE) < 150
        assert (await _ids(plain, USAGE))[-1] == published[-1]
    finally:
        await bus.close()
        await client.aclose()
        await plain.aclose()


async def test_trimming_waits_for_the_slowest_group(own_redis: str) -> None:
    bus = RedisBus.from_url(own_redis, maxlen=10, trim_interval=0.0)
    plain = Redis.from_url(own_redis)
    try:
        published = [await bus.publish(USAGE, _usage(i)) for i in range(500)]
        await bus.read_group(USAGE, "audit", "x", block=0, count=100)  # another group, far behind
        await bus.ack(USAGE, "audit", *published[:100])
        while got := await bus.read_group(USAGE, GROUP, "c", block=0, count=200):
            await bus.ack(USAGE, GROUP, *[e for e, _ in got])
        kept = await _ids(plain, USAGE)
        assert kept[-400:] == published[100:]  # the audit group has not read past 100
        assert len(kept) < 500
    finally:
        await bus.close()
        await plain.aclose()


async def test_fan_out_streams_stay_capped(own_redis: str) -> None:
    client = RespClient.from_url(own_redis)
    gateway = RespPublisher(client, maxlen=10)
    bus = RedisBus.from_url(own_redis, maxlen=10, trim_interval=0.0)
    plain = Redis.from_url(own_redis)
    try:
        # Defaults: only the usage stream goes uncapped on Redis, for the bus and the gateway.
        defaults = RedisBus(plain)
        assert defaults.stream_maxlen.get(USAGE, 0) is None
        assert defaults.stream_maxlen.get(WORKERS, defaults.maxlen) == DEFAULT_MAXLEN
        assert defaults.stream_maxlen.get(KV, defaults.maxlen) == DEFAULT_MAXLEN

        # The workers stream is tailed by every gateway and read by a group (worker
        # lifetimes): still capped, even with entries the group has not acknowledged.
        await bus.publish(WORKERS, {"i": -1})
        assert len(await bus.read_group(WORKERS, "control-plane-workers", "c", block=0)) == 1
        for i in range(300):
            await bus.publish(WORKERS, {"i": i})
            await gateway.publish(KV, {"i": i})
        await bus.read_group(WORKERS, "control-plane-workers", "c", block=0, count=5)
        for i in range(300):
            await bus.publish(WORKERS, {"i": i})
            await gateway.publish(KV, {"i": i})
        assert await plain.xlen(WORKERS) <= 300
        assert await plain.xlen(KV) <= 300
        tail = await bus.read(WORKERS, "0", block=0, count=10_000)
        assert msgspec.json.decode(tail[-1][1]) == {"i": 299}
    finally:
        await bus.close()
        await client.aclose()
        await plain.aclose()
