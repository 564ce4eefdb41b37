"""The event bus, memory and Redis, plus publishing over the internal HTTP endpoint.

Every test uses its own random stream names and deletes them afterwards, so tests can run
against a shared Redis database without colliding and without flushing anything.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from litestar import Litestar
from redis.asyncio import Redis

from tokenmill import protocol
from tokenmill.bus import (
    BusConfigError,
    BusPublishError,
    EventBus,
    HttpPublisher,
    MemoryBus,
    RedisBus,
    make_bus,
    make_publisher,
    parse_id,
)
from tokenmill.internal import internal_router
from tokenmill.settings import Settings
from tokenmill.spool import OUTAGE_ERRORS

BusFactory = Callable[..., EventBus]


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def new_stream(redis_client: Redis) -> AsyncIterator[Callable[[], str]]:
    """Unique stream names, deleted from Redis after the test (a no-op for memory)."""
    made: list[str] = []

    def make() -> str:
        made.append(f"test:bus:{secrets.token_hex(6)}")
        return made[-1]

    yield make
    if made:
        await redis_client.delete(*made)


@pytest.fixture(params=["memory", "redis"])
async def bus_factory(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[BusFactory]:
    """Builds buses of one kind, as separate processes would hold them.

    Redis: a new client each time, all sharing the server. Memory: the bus lives in the
    server process, so every caller without options gets that one instance.
    """
    made: list[EventBus] = []
    shared = MemoryBus()

    def make(**kwargs: Any) -> EventBus:
        if request.param == "memory":
            if not kwargs:
                return shared
            bus: EventBus = MemoryBus(**kwargs)
        else:
            bus = RedisBus.from_url(redis_url, **kwargs)
        made.append(bus)
        return bus

    yield make
    for bus in [*made, shared]:
        await bus.close()


@pytest.fixture
def bus(bus_factory: BusFactory) -> EventBus:
    return bus_factory()


async def restart(bus: EventBus, bus_factory: BusFactory) -> EventBus:
    """What a consumer restart looks like for each backend.

    Redis: a new process means a new client, state lives in the server. Memory: the bus is
    hosted by the server and outlives the consumer task, which calls `replay_pending`.
    """
    if isinstance(bus, RedisBus):
        await bus.close()
        return bus_factory()
    return bus


# --- publish / read -----------------------------------------------------------------------


async def test_publish_read_order_and_ids(bus: EventBus, new_stream: Callable[[], str]) -> None:
    stream = new_stream()
    ids = [await bus.publish(stream, {"i": i}) for i in range(5)]
    assert [parse_id(i) for i in ids] == sorted(parse_id(i) for i in ids)
    assert len(set(ids)) == 5

    got = await bus.read(stream, "0", block=0)
    assert [entry_id for entry_id, _ in got] == ids
    assert [msgspec.json.decode(data) for _, data in got] == [{"i": i} for i in range(5)]
    assert await bus.last_id(stream) == ids[-1]


async def test_structs_are_encoded_with_msgspec(bus: EventBus, new_stream: Callable[[], str]) -> None:
    stream = new_stream()
    hb = protocol.Heartbeat(worker_id="w1", deployment_id=None, address="http://w1", model="m", running=2)
    await bus.publish(stream, hb)
    [(_, data)] = await bus.read(stream, "0", block=0)
    assert msgspec.json.decode(data, type=protocol.WorkerEvent) == hb


async def test_after_semantics(bus: EventBus, new_stream: Callable[[], str]) -> None:
    stream = new_stream()
    assert await bus.last_id(stream) == "0-0"
    ids = [await bus.publish(stream, {"i": i}) for i in range(5)]

    # Strictly after the given id; count caps the batch.
    assert [e for e, _ in await bus.read(stream, ids[2], block=0)] == ids[3:]
    assert [e for e, _ in await bus.read(stream, "0", block=0, count=2)] == ids[:2]
    assert await bus.read(stream, ids[-1], block=0) == []
    # "$" only sees what is added after the call: nothing, without blocking.
    assert await bus.read(stream, "$", block=0) == []

    # Starting from last_id misses nothing published between two calls.
    start = await bus.last_id(stream)
    later = await bus.publish(stream, {"i": 5})
    assert [e for e, _ in await bus.read(stream, start, block=0)] == [later]


async def test_read_times_out_empty(bus: EventBus, new_stream: Callable[[], str]) -> None:
    stream = new_stream()
    t0 = time.monotonic()
    assert await bus.read(stream, "$", block=0.2) == []
    assert 0.15 <= time.monotonic() - t0 < 1.0


async def test_blocking_read_is_woken_by_publish(
    bus_factory: BusFactory, new_stream: Callable[[], str]
) -> None:
    reader, writer = bus_factory(), bus_factory()
    stream = new_stream()

    # From last_id: no race between starting the read and the publish.
    start = await reader.last_id(stream)
    task = asyncio.create_task(reader.read(stream, start, block=3.0))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    entry_id = await writer.publish(stream, {"hello": "world"})
    got = await asyncio.wait_for(task, 2.0)
    assert got == [(entry_id, b'{"hello":"world"}')]
    assert time.monotonic() - t0 < 0.5

    # From "$": the read must be waiting before the publish to see it.
    task = asyncio.create_task(reader.read(stream, "$", block=3.0))
    await asyncio.sleep(0.1)
    second = await writer.publish(stream, {"n": 2})
    assert [e for e, _ in await asyncio.wait_for(task, 2.0)] == [second]


async def test_a_reader_cancelled_as_an_entry_arrives_is_cancelled() -> None:
    """A follower cancelled in the loop turn its entry arrives must still end (Python 3.11's
    wait_for returned the entry instead, and a tail loop then read on for ever)."""
    bus = MemoryBus()
    task = asyncio.create_task(bus.read("s", "$", block=5.0))
    await asyncio.sleep(0.01)
    await bus.publish("s", {"n": 1})
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_maxlen_caps_the_stream(bus_factory: BusFactory, new_stream: Callable[[], str]) -> None:
    bus = bus_factory(maxlen=10)
    stream = new_stream()
    ids = [await bus.publish(stream, {"i": i}) for i in range(600)]
    kept = [e for e, _ in await bus.read(stream, "0", block=0, count=10_000)]
    # Approximate like MAXLEN ~: at least maxlen kept, far fewer than published, and
    # always a contiguous tail ending with the newest entry.
    assert 10 <= len(kept) <= 300
    assert kept == ids[-len(kept) :]


async def test_stream_maxlen_override(bus_factory: BusFactory, new_stream: Callable[[], str]) -> None:
    capped, uncapped = new_stream(), new_stream()
    bus = bus_factory(maxlen=10, stream_maxlen={uncapped: None})
    for i in range(600):
        await bus.publish(capped, {"i": i})
        await bus.publish(uncapped, {"i": i})
    assert len(await bus.read(capped, "0", block=0, count=10_000)) <= 300
    assert len(await bus.read(uncapped, "0", block=0, count=10_000)) == 600


# --- consumer groups ----------------------------------------------------------------------


async def test_group_starts_from_the_beginning(bus: EventBus, new_stream: Callable[[], str]) -> None:
    stream = new_stream()
    ids = [await bus.publish(stream, {"i": i}) for i in range(3)]
    got = await bus.read_group(stream, "billing", "c1", block=0)
    assert [e for e, _ in got] == ids
    # Delivered once: the next read has nothing new.
    assert await bus.read_group(stream, "billing", "c1", block=0) == []


async def test_two_consumers_share_the_work(bus_factory: BusFactory, new_stream: Callable[[], str]) -> None:
    a, b = bus_factory(), bus_factory()
    stream = new_stream()
    ids = [await a.publish(stream, {"i": i}) for i in range(6)]
    got_a = await a.read_group(stream, "g", "a", block=0, count=3)
    got_b = await b.read_group(stream, "g", "b", block=0, count=10)
    assert len(got_a) == 3 and len(got_b) == 3
    assert sorted([e for e, _ in got_a + got_b], key=parse_id) == ids
    # Another group sees everything again, independently.
    assert len(await b.read_group(stream, "other", "x", block=0, count=10)) == 6


async def test_ack_and_redelivery_after_restart(
    bus_factory: BusFactory, new_stream: Callable[[], str]
) -> None:
    bus = bus_factory()
    stream = new_stream()
    ids = [await bus.publish(stream, {"i": i}) for i in range(4)]
    got = await bus.read_group(stream, "g", "c1", block=0)
    assert [e for e, _ in got] == ids
    assert await bus.ack(stream, "g", ids[0], ids[2]) == 2
    assert await bus.ack(stream, "g", ids[0]) == 0  # already acknowledged

    # The consumer "crashes" before acknowledging ids[1] and ids[3], then comes back.
    bus = await restart(bus, bus_factory)
    await bus.replay_pending(stream, "g", "c1")
    new = await bus.publish(stream, {"i": 4})
    replay = await bus.read_group(stream, "g", "c1", block=0)
    assert [e for e, _ in replay] == [ids[1], ids[3]]
    assert [msgspec.json.decode(d)["i"] for _, d in replay] == [1, 3]
    # Caught up with its backlog, it moves on to new entries, even before acking
    # (the replay is not repeated forever).
    assert [e for e, _ in await bus.read_group(stream, "g", "c1", block=0)] == [new]
    assert await bus.ack(stream, "g", ids[1], ids[3], new) == 3

    # Nothing pending any more: a restart delivers nothing old.
    bus = await restart(bus, bus_factory)
    await bus.replay_pending(stream, "g", "c1")
    assert await bus.read_group(stream, "g", "c1", block=0) == []


async def test_other_consumers_pending_is_not_redelivered(
    bus_factory: BusFactory, new_stream: Callable[[], str]
) -> None:
    bus = bus_factory()
    stream = new_stream()
    ids = [await bus.publish(stream, {"i": i}) for i in range(2)]
    await bus.read_group(stream, "g", "a", block=0, count=1)
    bus = await restart(bus, bus_factory)
    await bus.replay_pending(stream, "g", "b")
    # b's own backlog is empty; a's pending entry stays a's.
    assert [e for e, _ in await bus.read_group(stream, "g", "b", block=0)] == [ids[1]]


async def test_replay_pending_without_restart(bus: EventBus, new_stream: Callable[[], str]) -> None:
    stream = new_stream()
    ids = [await bus.publish(stream, {"i": i}) for i in range(3)]
    assert len(await bus.read_group(stream, "g", "c", block=0, count=2)) == 2
    # Processing failed: retry the same batch without a restart.
    await bus.replay_pending(stream, "g", "c")
    assert [e for e, _ in await bus.read_group(stream, "g", "c", block=0)] == ids[:2]
    assert [e for e, _ in await bus.read_group(stream, "g", "c", block=0)] == ids[2:]


async def test_read_group_blocks_until_publish(
    bus_factory: BusFactory, new_stream: Callable[[], str]
) -> None:
    consumer, producer = bus_factory(), bus_factory()
    stream = new_stream()
    assert await consumer.read_group(stream, "g", "c", block=0) == []  # creates the group
    task = asyncio.create_task(consumer.read_group(stream, "g", "c", block=3.0))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    entry_id = await producer.publish(stream, {"x": 1})
    assert [e for e, _ in await asyncio.wait_for(task, 2.0)] == [entry_id]
    assert time.monotonic() - t0 < 0.5


async def test_trimmed_pending_entries_are_skipped(
    bus_factory: BusFactory, new_stream: Callable[[], str]
) -> None:
    bus = bus_factory(maxlen=10)
    stream = new_stream()
    first = [await bus.publish(stream, {"i": i}) for i in range(3)]
    assert [e for e, _ in await bus.read_group(stream, "g", "c", block=0)] == first
    for i in range(600):  # pushes the three pending entries out of the capped stream
        await bus.publish(stream, {"i": i})
    bus = await restart(bus, bus_factory)
    await bus.replay_pending(stream, "g", "c")
    got = await bus.read_group(stream, "g", "c", block=0, count=1000)
    # The lost entries are not delivered as empty events; the consumer continues with
    # what is still there.
    assert got and all(data for _, data in got)
    assert not {e for e, _ in got} & set(first)


# --- internal endpoint and HttpPublisher --------------------------------------------------

TOKEN = "internal-" + secrets.token_hex(8)


def asgi_client(app: Litestar) -> httpx.AsyncClient:
    # In-process ASGI on the test's own event loop (Litestar's AsyncTestClient runs the app
    # on a loop of its own, where a Redis client made here cannot be used).
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def internal_app(bus: EventBus, streams: set[str] | None = None) -> Litestar:
    router = internal_router(bus, TOKEN) if streams is None else internal_router(bus, TOKEN, streams=streams)
    return Litestar(route_handlers=[router])


async def test_http_publisher_lands_on_the_bus(bus: EventBus, new_stream: Callable[[], str]) -> None:
    # A unique stream allowed explicitly, so the shared Redis's real tm:* streams are untouched.
    stream = new_stream()
    async with asgi_client(internal_app(bus, {stream})) as client:
        pub = HttpPublisher(f"{client.base_url}/internal/bus", TOKEN, client=client)
        hb = protocol.Heartbeat(worker_id="w1", deployment_id="d", address="a", model="m")
        entry_id = await pub.publish(stream, hb)
        await pub.close()  # does not close a client it was given
        assert not client.is_closed
    assert await bus.read(stream, "0", block=0) == [(entry_id, msgspec.json.encode(hb))]


def test_known_streams_only() -> None:
    from tokenmill.internal import KNOWN_STREAMS

    assert {protocol.WORKERS, protocol.KV, protocol.USAGE, protocol.KEYS} == KNOWN_STREAMS


async def test_internal_endpoint_errors() -> None:
    bus = MemoryBus()
    async with asgi_client(internal_app(bus)) as client:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        url = f"/internal/bus/{protocol.USAGE}"

        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            resp = await client.post(url, json={"a": 1}, headers=headers)
            assert resp.status_code == 401
            assert resp.json() == {
                "error": {
                    "message": "Missing or invalid internal token.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_internal_token",
                }
            }
        # The token is checked before anything else: no probing of stream names.
        assert (await client.post("/internal/bus/tm:secret", json={}, headers={})).status_code == 401

        resp = await client.post("/internal/bus/tm:nope", json={"a": 1}, headers=auth)
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "unknown_stream"

        for body in (b"{not json", b"[1, 2]"):
            resp = await client.post(url, content=body, headers=auth)
            assert resp.status_code == 400
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

        resp = await client.post(url, json={"request_id": "r1"}, headers=auth)
        assert resp.status_code == 202
        assert await bus.read(protocol.USAGE, "0", block=0) == [(resp.json()["id"], b'{"request_id":"r1"}')]


@pytest.fixture
async def live_server() -> AsyncIterator[tuple[str, MemoryBus]]:
    """The internal router on a real uvicorn server and a free port."""
    bus = MemoryBus()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(internal_app(bus), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}", bus
    server.should_exit = True
    await task
    sock.close()


async def test_http_publisher_over_real_http(live_server: tuple[str, MemoryBus]) -> None:
    base, bus = live_server
    pub = HttpPublisher(f"{base}/internal/bus/", TOKEN)
    try:
        ids = [await pub.publish(protocol.KV, {"n": i}) for i in range(3)]
        assert [e for e, _ in await bus.read(protocol.KV, "0", block=0)] == ids

        with pytest.raises(BusPublishError, match="404"):
            await pub.publish("tm:unknown", {"n": 1})
    finally:
        await pub.close()

    wrong = HttpPublisher(f"{base}/internal/bus", "wrong-token")
    try:
        with pytest.raises(BusPublishError, match="401"):
            await wrong.publish(protocol.KV, {"n": 1})
    finally:
        await wrong.close()


async def test_http_publisher_unreachable() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    pub = HttpPublisher(f"http://127.0.0.1:{port}/internal/bus", TOKEN, timeout=1.0)
    try:
        with pytest.raises(BusPublishError, match="cannot reach"):
            await pub.publish(protocol.KV, {"n": 1})
    finally:
        await pub.close()


# --- factories ----------------------------------------------------------------------------


async def test_factories(redis_url: str) -> None:
    plain = Settings(redis_url=None, bus_url=None, internal_token="t")
    bus = make_bus(plain)
    assert isinstance(bus, MemoryBus)
    await bus.close()
    with pytest.raises(BusConfigError, match="REDIS_URL"):
        make_publisher(plain)

    with pytest.raises(BusConfigError, match="INTERNAL_TOKEN"):
        make_publisher(Settings(redis_url=None, bus_url="http://x/internal/bus", internal_token=None))
    pub = make_publisher(Settings(redis_url=None, bus_url="http://x/internal/bus", internal_token="t"))
    assert isinstance(pub, HttpPublisher)
    await pub.close()

    with_redis = Settings(redis_url=redis_url, redis_timeout_seconds=1.5)
    bus = make_bus(with_redis, maxlen=5)
    assert isinstance(bus, RedisBus)
    # bounded calls; blocking reads (up to max_block) have a client whose timeout covers them
    kwargs = bus.redis.connection_pool.connection_kwargs
    assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"]) == (1.5, 1.5)
    assert bus._blocking.connection_pool.connection_kwargs["socket_timeout"] == bus._max_block + 1.5
    await bus.close()
    pub = make_publisher(with_redis)
    assert isinstance(pub, RedisBus)
    assert pub.redis.connection_pool.connection_kwargs["socket_timeout"] is not None
    await pub.close()


async def test_a_redis_that_never_answers_is_an_outage_within_the_timeout() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    bus = RedisBus.from_url(f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0", timeout=0.3)
    try:
        for call, bound in (
            (lambda: bus.publish("s", {"a": 1}), 0.3),
            (lambda: bus.read("s", "0-0", block=0), 0.3),
            (lambda: bus.read("s", "0-0", block=0.5), 0.3 + bus._max_block),
        ):
            started = time.monotonic()
            with pytest.raises(OUTAGE_ERRORS):
                await call()
            assert time.monotonic() - started < bound + 1.0
    finally:
        await bus.close()
        server.close()


async def test_a_long_blocking_read_is_not_a_timeout(redis_url: str, new_stream: Callable[[], str]) -> None:
    bus = RedisBus.from_url(redis_url, timeout=0.3, max_block=1.0)
    try:
        started = time.monotonic()
        assert await bus.read(new_stream(), "$", block=1.0) == []  # blocks 1 s > the 0.3 s timeout
        assert time.monotonic() - started >= 0.9
    finally:
        await bus.close()


def test_parse_id() -> None:
    assert parse_id("0") == (0, 0)
    assert parse_id("5-3") < parse_id("5-10") < parse_id("6-0")
    with pytest.raises(ValueError):
        parse_id("$")


async def test_redis_group_recreated_after_stream_loss(
    redis_url: str, redis_client: Redis, new_stream: Callable[[], str]
) -> None:
    bus = RedisBus.from_url(redis_url)
    stream = new_stream()
    try:
        await bus.publish(stream, {"i": 0})
        assert len(await bus.read_group(stream, "g", "c", block=0)) == 1
        await redis_client.delete(stream)  # e.g. Redis restarted without persistence
        entry_id = await bus.publish(stream, {"i": 1})
        assert [e for e, _ in await bus.read_group(stream, "g", "c", block=0)] == [entry_id]
    finally:
        await bus.close()


async def test_tail_survives_a_lost_stream(redis_url: str, new_stream: Callable[[], str]) -> None:
    """A Redis restarted without persistence has lost the stream a tail waits on: entries
    published afterwards must still reach it."""
    from tokenmill.tasks import tail

    stream = new_stream()
    bus = RedisBus.from_url(redis_url)
    seen: list[bytes] = []
    task: asyncio.Task[None] | None = None
    try:
        for i in range(3):
            await bus.publish(stream, {"n": i})
        task = asyncio.create_task(tail(bus, stream, seen.append, name="test"))
        await asyncio.sleep(0.2)
        await bus.publish(stream, {"n": 3})
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.02)
        assert [msgspec.json.decode(s) for s in seen] == [{"n": 3}]  # from "now" on
        await bus.redis.delete(stream)  # what a restart without persistence leaves
        # A real restart takes far longer than a millisecond; published within the same one as
        # n=3, the recreated stream would reuse n=3's id (`<ms>-0`), which the tail waits past.
        await asyncio.sleep(0.005)
        await bus.publish(stream, {"n": 4})
        for _ in range(200):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.02)
        assert [msgspec.json.decode(s) for s in seen] == [{"n": 3}, {"n": 4}]
        task.cancel()  # a tail ends when cancelled, whatever read it is in
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
    finally:
        if task is not None and not task.done():
            task.cancel()  # never left reading for the rest of the run
        await bus.close()
