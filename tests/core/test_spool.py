"""The usage spool against a real Redis: outages, restarts, crash leftovers, torn lines.

Outage tests run their own `redis-server` (killed and restarted on the same port mid-test);
the others use the session's throwaway Redis with random stream names, deleted afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from tokenmill.bus import RedisBus, encode
from tokenmill.protocol import UsageRecord
from tokenmill.spool import SpoolingPublisher, SpoolLine

PUBLISH_TIMEOUT = 0.5


def _usage(n: int) -> UsageRecord:
    return UsageRecord(request_id=f"req-{n}", org_id="org-1", model="m")


def _line(stream: str, n: int) -> bytes:
    return encode(SpoolLine(stream=stream, event=msgspec.Raw(encode(_usage(n))))) + b"\n"


async def _request_ids(client: Redis, stream: str) -> list[str]:
    entries = await client.xrange(stream)
    return [msgspec.json.decode(fields[b"d"], type=UsageRecord).request_id for _id, fields in entries]


async def _until(cond: Callable[[], bool], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.02)


async def _replay(pub: SpoolingPublisher) -> bool:
    # A deadline, so that a replay that never finishes fails the test instead of hanging it.
    async with asyncio.timeout(10):
        return await pub.replay()


class PrivateRedis:
    """A redis-server of this test's own, to kill and restart on the same port."""

    def __init__(self, tmp: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server not found (Debian: apt-get install redis-server)", pytrace=False)
        self.binary = binary
        self.tmp = tmp
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        for _attempt in range(3):
            if not self.port or _attempt:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    self.port = s.getsockname()[1]
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.tmp), "--logfile", str(self.tmp / "redis.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                        s.sendall(b"PING\r\n")
                        if s.recv(16).startswith(b"+PONG"):
                            return
                except OSError:
                    time.sleep(0.02)
            self.kill()
        pytest.fail(f"redis-server did not start on port {self.port}", pytrace=False)

    def restart_same_port(self) -> None:
        port = self.port
        self.start()  # first attempt reuses self.port
        assert self.port == port, "the port was taken while Redis was down"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def stream(redis_client: Redis) -> AsyncIterator[str]:
    name = f"test:spool:{secrets.token_hex(6)}"
    yield name
    await redis_client.delete(name)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _spool_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


async def test_outage_spools_then_replays_everything_once_in_order(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    name = "tm:usage:test"
    bus = RedisBus.from_url(private_redis.url)
    spool_dir = tmp_path / "spool"
    pub = SpoolingPublisher(
        bus, spool_dir, streams={name}, replay_interval=0.05, publish_timeout=PUBLISH_TIMEOUT, owns_inner=True
    )
    await pub.start()
    try:
        live_id = await pub.publish(name, _usage(-1))
        assert not live_id.startswith("spool-"), "with Redis up, events go straight to it"

        private_redis.kill()
        slowest = 0.0
        began = time.monotonic()
        ids = []
        for n in range(100):
            t = time.monotonic()
            ids.append(await pub.publish(name, _usage(n)))
            slowest = max(slowest, time.monotonic() - t)
        total = time.monotonic() - began
        assert all(i.startswith("spool-") for i in ids)
        assert slowest < PUBLISH_TIMEOUT + 0.25, f"a publish took {slowest:.2f}s with Redis down"
        # Only the first event waits for the bus; the rest go to the spool without trying it.
        assert total < PUBLISH_TIMEOUT + 2.0, f"100 publishes took {total:.2f}s"
        assert pub.spooling and pub.pending() == 100

        # Replay attempts against the dead server must neither lose nor deliver anything.
        attempts_done = time.monotonic() + 4 * 0.05 + PUBLISH_TIMEOUT
        await _until(lambda: time.monotonic() > attempts_done)
        assert pub.pending() == 100

        # Without persistence the restarted Redis is empty: the stream holds exactly what the
        # spool replays, so duplicates or gaps would show.
        private_redis.restart_same_port()
        await _until(lambda: not pub.spooling and pub.pending() == 0)
        check = Redis.from_url(private_redis.url)
        try:
            assert await _request_ids(check, name) == [f"req-{n}" for n in range(100)]
            assert _spool_files(spool_dir) == [], "delivered files are deleted"

            after = await pub.publish(name, _usage(100))
            assert not after.startswith("spool-"), "once drained, events go straight to Redis again"
            assert (await _request_ids(check, name))[-1] == "req-100"
        finally:
            await check.aclose()
    finally:
        await pub.close()


async def test_order_kept_while_spool_not_empty(private_redis: PrivateRedis, tmp_path: Path) -> None:
    name = "tm:usage:test"
    bus = RedisBus.from_url(private_redis.url)
    # No background replays: this test decides when the spool is replayed.
    pub = SpoolingPublisher(
        bus, tmp_path / "spool", streams={name}, replay_interval=3600, publish_timeout=PUBLISH_TIMEOUT
    )
    await pub.start()
    check: Redis | None = None
    try:
        private_redis.kill()
        for n in range(3):
            assert (await pub.publish(name, _usage(n))).startswith("spool-")
        # Streams outside `streams` are not spooled: their callers see the outage.
        with pytest.raises(RedisConnectionError):
            await pub.publish("tm:workers:test", {"worker": "w"})
        assert await _replay(pub) is False, "the bus is still down"
        assert pub.pending() == 3

        private_redis.restart_same_port()
        check = Redis.from_url(private_redis.url)
        # Redis is back but older events are still spooled: new ones queue behind them.
        for n in range(3, 6):
            assert (await pub.publish(name, _usage(n))).startswith("spool-")
        assert await _request_ids(check, name) == []

        assert await _replay(pub) is True
        assert await _request_ids(check, name) == [f"req-{n}" for n in range(6)]
        assert not pub.spooling and pub.pending() == 0
        assert not (await pub.publish(name, _usage(6))).startswith("spool-")
    finally:
        if check is not None:
            await check.aclose()
        await pub.close()
        await bus.close()


async def test_leftovers_of_dead_processes_are_replayed_first(
    redis_url: str, redis_client: Redis, stream: str, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    host = socket.gethostname()
    dead = _dead_pid()
    # A process that crashed mid-replay (the .replaying file) and mid-write (the torn last line
    # of its active file); then this process's own pid from an older incarnation (pid reuse).
    (spool_dir / f"{host}.{dead}.0000000000001aa.000000.replaying").write_bytes(
        _line(stream, 0) + _line(stream, 1)
    )
    (spool_dir / f"{host}.{dead}.0000000000001aa.spool").write_bytes(
        _line(stream, 2) + _line(stream, 3) + _line(stream, 99)[:25]
    )
    (spool_dir / f"{host}.{os.getpid()}.0000000000002bb.spool").write_bytes(_line(stream, 4))
    # Not ours to take: a live process on this host (pid 1 always is) and another host.
    untouched = [f"{host}.1.0000000000001cc.spool", f"other-host.{dead}.0000000000001dd.spool"]
    for file in untouched:
        (spool_dir / file).write_bytes(_line(stream, 50))

    bus = RedisBus.from_url(redis_url)
    pub = SpoolingPublisher(bus, spool_dir, streams={stream}, replay_interval=0.05)
    await pub.start()
    try:
        assert pub.pending() == 6, "five events and one torn line were found"
        await _until(lambda: pub.pending() == 0 and not pub.spooling)
        assert await _request_ids(redis_client, stream) == [f"req-{n}" for n in range(5)]
        assert _spool_files(spool_dir) == sorted(untouched)
    finally:
        await pub.close()
        await bus.close()


async def test_torn_line_in_the_middle_is_skipped(
    redis_url: str, redis_client: Redis, stream: str, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    # A cut-short write that a later append terminated: garbage on a line of its own.
    torn = _line(stream, 1)[:30] + b"\n"
    (spool_dir / f"{socket.gethostname()}.{_dead_pid()}.0000000000001aa.spool").write_bytes(
        _line(stream, 0) + torn + b"\n" + _line(stream, 2)
    )
    bus = RedisBus.from_url(redis_url)
    pub = SpoolingPublisher(bus, spool_dir, streams={stream}, replay_interval=3600)
    await pub.start()
    try:
        assert await _replay(pub) is True
        assert await _request_ids(redis_client, stream) == ["req-0", "req-2"]
        assert pub.pending() == 0 and _spool_files(spool_dir) == []
    finally:
        await pub.close()
        await bus.close()


async def test_a_live_instance_in_the_same_process_keeps_its_files(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    name = "tm:usage:test"
    spool_dir = tmp_path / "spool"
    bus = RedisBus.from_url(private_redis.url)
    first = SpoolingPublisher(
        bus, spool_dir, streams={name}, replay_interval=3600, publish_timeout=PUBLISH_TIMEOUT
    )
    second = SpoolingPublisher(
        bus, spool_dir, streams={name}, replay_interval=3600, publish_timeout=PUBLISH_TIMEOUT
    )
    await first.start()
    try:
        private_redis.kill()
        await first.publish(name, _usage(0))
        # Same pid, other incarnation, but alive: not a dead predecessor's leftovers.
        await second.start()
        assert second.pending() == 0 and first.pending() == 1

        private_redis.restart_same_port()
        assert await _replay(first) is True
        check = Redis.from_url(private_redis.url)
        try:
            assert await _request_ids(check, name) == ["req-0"]
        finally:
            await check.aclose()
    finally:
        await second.close()
        await first.close()
        await bus.close()


async def test_stop_leaves_undelivered_events_for_the_next_start(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    name = "tm:usage:test"
    spool_dir = tmp_path / "spool"
    bus = RedisBus.from_url(private_redis.url)
    pub = SpoolingPublisher(
        bus, spool_dir, streams={name}, replay_interval=0.05, publish_timeout=PUBLISH_TIMEOUT
    )
    await pub.start()
    private_redis.kill()
    for n in range(3):
        await pub.publish(name, _usage(n))
    await pub.close()
    assert len(_spool_files(spool_dir)) == 1

    # The next incarnation of this process (same pid) takes them over once Redis is back.
    private_redis.restart_same_port()
    again = SpoolingPublisher(bus, spool_dir, streams={name}, replay_interval=0.05)
    await again.start()
    try:
        await _until(lambda: again.pending() == 0 and not again.spooling)
        check = Redis.from_url(private_redis.url)
        try:
            assert await _request_ids(check, name) == ["req-0", "req-1", "req-2"]
        finally:
            await check.aclose()
    finally:
        await again.close()
        await bus.close()


async def test_stop_in_the_middle_of_a_replay_loses_nothing_and_resumes(
    redis_url: str, redis_client: Redis, stream: str, tmp_path: Path
) -> None:
    total = 40_000  # enough that a replay is still running when stop() comes
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    (spool_dir / f"{socket.gethostname()}.{_dead_pid()}.0000000000001aa.spool").write_bytes(
        b"".join(_line(stream, n) for n in range(total))
    )
    bus = RedisBus.from_url(redis_url)
    first = SpoolingPublisher(bus, spool_dir, streams={stream}, replay_interval=0.01, publish_timeout=0.3)
    second: SpoolingPublisher | None = None
    try:
        await first.start()
        delivered = 0
        deadline = time.monotonic() + 15
        while delivered < 1000:
            assert time.monotonic() < deadline, "the replay did not start"
            await asyncio.sleep(0.01)
            delivered = await redis_client.xlen(stream)
        began = time.monotonic()
        # (The deadline only turns a hang into a failure: Background.stop() absorbs its cancel.)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await first.stop()
        # The loop is cancelled even though each publish is quick (redis-py drops some
        # cancellations on Python 3.11), and the last attempt is bounded by the timeout.
        assert time.monotonic() - began < 0.3 + 1.0
        left = first.pending()
        assert 0 < left < total, "stop() came after the replay had finished: raise `total`"
        assert any(p.name.endswith(".offset") for p in spool_dir.iterdir()), "progress was saved"

        second = SpoolingPublisher(bus, spool_dir, streams={stream}, replay_interval=0.01)
        await second.start()
        assert second.pending() == left, "the next start resumes where the replay stopped"
        await _until(lambda: second is not None and second.pending() == 0 and not second.spooling, 60)
        ids = await _request_ids(redis_client, stream)
        assert list(dict.fromkeys(ids)) == [f"req-{n}" for n in range(total)]
        # At most the event in flight at each interruption (background loop, last attempt).
        assert len(ids) - total <= 2
        assert _spool_files(spool_dir) == []
    finally:
        await first.close()
        if second is not None:
            await second.close()
        await bus.close()


async def test_a_hung_redis_costs_one_timeout_then_events_spool(
    private_redis: PrivateRedis, tmp_path: Path
) -> None:
    name = "tm:usage:test"
    bus = RedisBus.from_url(private_redis.url)
    pub = SpoolingPublisher(
        bus, tmp_path / "spool", streams={name}, replay_interval=3600, publish_timeout=PUBLISH_TIMEOUT
    )
    await pub.start()
    assert private_redis.proc is not None
    stopped = False
    try:
        await pub.publish(name, _usage(0))  # connected before the server hangs
        # Accepts connections (the kernel does) but never answers: only the timeout saves us.
        private_redis.proc.send_signal(signal.SIGSTOP)
        stopped = True
        began = time.monotonic()
        ids = [await pub.publish(name, _usage(n)) for n in range(1, 21)]
        assert time.monotonic() - began < PUBLISH_TIMEOUT + 1.0
        assert all(i.startswith("spool-") for i in ids)

        private_redis.proc.send_signal(signal.SIGCONT)
        stopped = False
        assert await _replay(pub) is True
        check = Redis.from_url(private_redis.url)
        try:
            got = await _request_ids(check, name)
        finally:
            await check.aclose()
        assert list(dict.fromkeys(got)) == [f"req-{n}" for n in range(21)]
        # The timed-out XADD may still have reached Redis, and is replayed anyway: at least once.
        assert len(got) - 21 <= 1
    finally:
        if stopped:
            private_redis.proc.send_signal(signal.SIGCONT)
        await pub.close()
        await bus.close()
