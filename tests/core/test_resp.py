"""The lean Redis client of the request path (tokenmill/resp.py), against a real Redis.

Keys and streams are random per test and deleted afterwards, so these run against a
shared Redis database. The reply timeout is tried against a server that never answers and
against a real Redis kept busy by a script.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import redis.exceptions
from redis.asyncio import Redis

from tokenmill.bus import FIELD, RedisBus
from tokenmill.protocol import UsageRecord
from tokenmill.resp import (
    RespClient,
    RespConnectionError,
    ResponseError,
    RespPublisher,
    RespTimeoutError,
    encode,
)
from tokenmill.spool import OUTAGE_ERRORS

# Keeps Redis busy for ARGV[1] milliseconds (Redis serves nobody else meanwhile).
BUSY = """
local t = redis.call('TIME')
local start = t[1] * 1000 + t[2] / 1000
repeat
  t = redis.call('TIME')
until t[1] * 1000 + t[2] / 1000 - start >= tonumber(ARGV[1])
return 1
"""


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[RespClient]:
    c = RespClient.from_url(redis_url)
    yield c
    await c.aclose()


@pytest.fixture
async def plain(redis_url: str) -> AsyncIterator[Redis]:
    r = Redis.from_url(redis_url)
    yield r
    await r.aclose()


def _key() -> str:
    return f"test:resp:{secrets.token_hex(6)}"


def test_encoding_is_redis_py_s() -> None:
    assert encode(("SET", b"k", 1, 2.5)) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n$3\r\n2.5\r\n"
    with pytest.raises(TypeError):
        encode(("SET", "k", True))
    with pytest.raises(TypeError):
        encode(("SET", "k", None))


async def test_replies_as_redis_py_gives_them(client: RespClient, plain: Redis) -> None:
    k = _key()
    try:
        assert await client.execute_command("SET", k, 1.5) == b"OK"
        assert await client.execute_command("GET", k) == b"1.5"
        assert await client.execute_command("GET", _key()) is None
        assert await client.execute_command("RPUSH", k + "l", "a", 2) == 2
        assert await client.execute_command("LRANGE", k + "l", 0, -1) == [b"a", b"2"]
        assert await client.execute_command("EVAL", "return {1, {2, 'x'}}", 0) == [1, [2, b"x"]]
        with pytest.raises(ResponseError) as caught:
            await client.execute_command("INCR", k)
        assert isinstance(caught.value, redis.exceptions.ResponseError)
        assert str(caught.value).startswith("ERR")
        assert await client.execute_command("PING") == b"PONG"  # still in step after an error
    finally:
        await plain.delete(k, k + "l")


async def test_concurrent_commands_get_their_own_replies(client: RespClient, plain: Redis) -> None:
    k = _key()
    try:
        replies = await asyncio.gather(*(client.execute_command("INCR", k) for _ in range(500)))
        assert sorted(replies) == list(range(1, 501))
        # a caller that gives up does not shift the replies of the others
        gone = asyncio.ensure_future(client.execute_command("INCR", k))
        await asyncio.sleep(0)
        gone.cancel()
        assert await client.execute_command("SET", k, "x") == b"OK"
        assert await client.execute_command("GET", k) == b"x"
    finally:
        await plain.delete(k)


async def test_reconnects_after_the_connection_is_killed(client: RespClient, plain: Redis) -> None:
    mine = await client.execute_command("CLIENT", "ID")
    await plain.execute_command("CLIENT", "KILL", "ID", mine)  # only this client's connection
    await asyncio.sleep(0.05)
    assert await client.execute_command("PING") == b"PONG"


async def test_unreachable_redis_is_a_connection_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = RespClient.from_url(f"redis://127.0.0.1:{port}/0", connect_timeout=2)
    with pytest.raises(RespConnectionError) as caught:
        await c.execute_command("PING")
    # the spool treats both kinds as an outage of the bus
    assert isinstance(caught.value, OSError) and isinstance(caught.value, redis.exceptions.ConnectionError)
    await c.aclose()


def test_urls() -> None:
    c = RespClient.from_url("redis://user:p%40ss@example:6380/3")
    assert (c.host, c.port, c.db, c.username, c.password, c.tls) == ("example", 6380, 3, "user", "p@ss", None)
    c = RespClient.from_url("rediss://:secret@example")
    assert (c.port, c.db, c.username, c.password) == (6379, 0, None, "secret") and c.tls is not None
    c = RespClient.from_url("unix:///run/redis.sock?db=2")
    assert (c.path, c.db) == ("/run/redis.sock", 2)
    with pytest.raises(ValueError):
        RespClient.from_url("redis+sentinel://host/mymaster")


async def test_select_db(redis_url: str, plain: Redis) -> None:
    base = redis_url.rsplit("/", 1)[0]
    c = RespClient.from_url(f"{base}/5")
    k = _key()
    try:
        await c.execute_command("SET", k, "in-5")
        assert await plain.get(k) is None
        assert await c.execute_command("GET", k) == b"in-5"
    finally:
        await c.execute_command("DEL", k)
        await c.aclose()


async def test_publisher_writes_what_the_bus_writes(client: RespClient, redis_url: str, plain: Redis) -> None:
    stream = _key()
    bus = RedisBus.from_url(redis_url, maxlen=50)
    publisher = RespPublisher(client, maxlen=50)
    record = UsageRecord(request_id="r1", org_id="o", model="m", prompt_tokens=3)
    try:
        a = await bus.publish(stream, record)
        b = await publisher.publish(stream, msgspec.Raw(msgspec.json.encode(record)))
        assert a < b
        entries = await plain.xrange(stream)
        assert [fields for _, fields in entries] == [{FIELD: msgspec.json.encode(record)}] * 2
        assert [i.decode() for i, _ in entries] == [a, b]
        for _ in range(300):  # trimmed like the bus trims (approximately)
            await publisher.publish(stream, record)
        assert await plain.xlen(stream) < 200
        untrimmed = RespPublisher(client, maxlen=50, stream_maxlen={stream: None})
        n = await plain.xlen(stream)
        await untrimmed.publish(stream, record)
        assert await plain.xlen(stream) == n + 1
    finally:
        await plain.delete(stream)
        await bus.close()


# --- reply timeouts -----------------------------------------------------------------------------


async def test_a_redis_that_never_answers_fails_every_waiter_and_is_dropped() -> None:
    connections: list[asyncio.Event] = []

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        closed = asyncio.Event()
        connections.append(closed)
        await reader.read()  # reads whatever comes, answers nothing, until the client closes
        closed.set()
        writer.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    c = RespClient(port=server.sockets[0].getsockname()[1], reply_timeout=0.3)
    try:
        started = time.monotonic()
        results = await asyncio.gather(
            *(c.execute_command("INCR", "k") for _ in range(3)), return_exceptions=True
        )
        assert 0.25 < time.monotonic() - started < 1.5
        for exc in results:
            assert isinstance(exc, RespTimeoutError), exc
            # both the connection-error kind and the timeout kind: an outage, wherever it is caught
            assert isinstance(exc, RespConnectionError) and isinstance(exc, redis.exceptions.TimeoutError)
            assert isinstance(exc, OUTAGE_ERRORS)
        await asyncio.wait_for(connections[0].wait(), 2)  # the stuck connection was dropped
        with pytest.raises(RespTimeoutError):  # the next command reconnects (and waits again)
            await c.execute_command("PING")
        assert len(connections) == 2
    finally:
        await c.aclose()
        server.close()


async def test_a_busy_redis_is_waited_for_within_the_timeout_only(redis_url: str) -> None:
    patient = RespClient.from_url(redis_url, reply_timeout=3)
    hasty = RespClient.from_url(redis_url, reply_timeout=0.3)
    try:
        assert await patient.execute_command("EVAL", BUSY, 0, 600) == 1  # 0.6 s: within 3 s
        await hasty.execute_command("PING")
        busy = asyncio.ensure_future(patient.execute_command("EVAL", BUSY, 0, 1500))
        await asyncio.sleep(0.1)  # the script runs: Redis answers nobody else
        with pytest.raises(RespTimeoutError):
            await hasty.execute_command("PING")
        assert await busy == 1
        assert await hasty.execute_command("PING") == b"PONG"  # reconnected
    finally:
        await patient.aclose()
        await hasty.aclose()


async def test_our_own_stalled_loop_is_not_redis_s_silence(redis_url: str) -> None:
    """A command queued just before our event loop blocks (CPU-bound work) goes out after the
    stall, when its deadline has long passed: Redis gets a fresh window to answer."""
    c = RespClient.from_url(redis_url, reply_timeout=0.3)
    try:
        await c.execute_command("PING")  # connected
        pending = asyncio.ensure_future(c.execute_command("PING"))
        await asyncio.sleep(0)  # queued (not written yet: that happens on the next loop turn)
        time.sleep(1.0)  # noqa: ASYNC251 - the stall under test
        assert await pending == b"PONG"
    finally:
        await c.aclose()
