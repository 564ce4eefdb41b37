"""The gateway's HTTP client to workers (gateway/upstream.py), against real servers.

What the gateway relies on: streamed lines arrive as the worker sends them, connections are
reused, a response left early closes its connection (the worker sees the client go), a
transport failure is an `UpstreamError`, the keep-alive race (the worker closes an idle
connection as a request goes out) is absorbed, and every wait is bounded: a worker that never
answers, or goes silent mid-stream, is an `UpstreamError` with `timeout=True` (keep-alive
lines and our own stalled event loop do not count as its silence).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvicorn
from litestar import Litestar, Request, post
from litestar.response import Response, Stream

from gateway.upstream import Upstream, UpstreamError

HEADERS = {"content-type": "application/json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Worker:
    """A Litestar app: `/lines` streams `n` NDJSON lines (chunked), `/fail` answers 500,
    `/slow` streams forever until the client leaves."""

    def __init__(self) -> None:
        self.peers: set[int] = set()  # client ports seen: one per connection
        self.slow_gone = asyncio.Event()

    def app(self) -> Litestar:
        @post("/lines", status_code=200)
        async def lines(request: Request) -> Stream:
            self.peers.add(request.client.port if request.client else 0)
            n = int((await request.body()) or b"3")

            async def gen() -> AsyncIterator[bytes]:
                for i in range(n):
                    yield b'{"i": %d}\n' % i
                    await asyncio.sleep(0)

            return Stream(gen(), media_type="application/x-ndjson")

        @post("/fail", status_code=200)
        async def fail(request: Request) -> Response[bytes]:
            await request.body()
            return Response(b'{"error": "nope"}', status_code=500)

        @post("/slow", status_code=200)
        async def slow(request: Request) -> Stream:
            await request.body()

            async def gen() -> AsyncIterator[bytes]:
                try:
                    for i in range(10_000):
                        yield b'{"i": %d}\n' % i
                        await asyncio.sleep(0.01)
                finally:
                    self.slow_gone.set()

            return Stream(gen(), media_type="application/x-ndjson")

        return Litestar([lines, fail, slow])


@contextlib.asynccontextmanager
async def serve(app: Litestar) -> AsyncIterator[str]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "test server did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def worker() -> AsyncIterator[tuple[Worker, str]]:
    w = Worker()
    async with serve(w.app()) as url:
        yield w, url


async def test_lines_stream_and_connections_are_reused(worker: tuple[Worker, str]) -> None:
    w, url = worker
    client = Upstream()
    try:
        for n in (3, 1, 50):
            async with client.post(url, "/lines", str(n).encode(), HEADERS) as r:
                assert r.status_code == 200
                assert [line async for line in r.lines()] == [b'{"i": %d}' % i for i in range(n)]
        assert len(w.peers) == 1  # one keep-alive connection for all three
        # concurrent requests open more connections, which are then kept
        await asyncio.gather(*(_count(client, url) for _ in range(5)))
        assert len(w.peers) <= 5
        before = len(w.peers)
        await asyncio.gather(*(_count(client, url) for _ in range(5)))
        assert len(w.peers) == before
    finally:
        await client.aclose()


async def _count(client: Upstream, url: str) -> int:
    async with client.post(url, "/lines", b"5", HEADERS) as r:
        return len([line async for line in r.lines()])


async def test_error_status_is_a_response(worker: tuple[Worker, str]) -> None:
    _, url = worker
    client = Upstream()
    try:
        async with client.post(url, "/fail", b"{}", HEADERS) as r:
            assert r.status_code == 500
            assert await r.read() == b'{"error": "nope"}'
        async with client.post(url, "/lines", b"2", HEADERS) as r:  # the connection still works
            assert len([line async for line in r.lines()]) == 2
    finally:
        await client.aclose()


async def test_leaving_early_closes_the_connection(worker: tuple[Worker, str]) -> None:
    w, url = worker
    client = Upstream()
    try:
        async with client.post(url, "/slow", b"{}", HEADERS) as r:
            async for _ in r.lines():
                break
        await asyncio.wait_for(w.slow_gone.wait(), 5)  # the worker saw the client go
        assert not any(client._idle.values())  # and that connection was not pooled
    finally:
        await client.aclose()


async def test_unreachable_worker_is_an_upstream_error() -> None:
    client = Upstream(connect_timeout=2)
    with pytest.raises(UpstreamError):
        async with client.post(f"http://127.0.0.1:{_free_port()}", "/generate", b"{}", HEADERS):
            pass
    await client.aclose()


async def test_worker_dying_mid_response_is_an_upstream_error() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nline\n\r\n")
        await writer.drain()
        writer.close()  # no final chunk

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = Upstream()
    try:
        async with client.post(f"http://127.0.0.1:{port}", "/generate", b"{}", HEADERS) as r:
            got = []
            with pytest.raises(UpstreamError):
                async for line in r.lines():
                    got.append(line)
            assert got == [b"line"]
    finally:
        await client.aclose()
        server.close()


async def test_keep_alive_race_is_retried_on_a_new_connection() -> None:
    """The server answers the first request of each connection and closes it, without a
    word, when the second one arrives: as if its idle timeout struck just then."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n")
        await writer.drain()
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = Upstream()
    try:
        for _ in range(3):
            async with client.post(url, "/generate", b"{}", HEADERS) as r:
                assert [line async for line in r.lines()] == [b"ok"]
        assert connections == 3
    finally:
        await client.aclose()
        await asyncio.sleep(0.05)  # the last handler sees its connection close
        server.close()


# --- timeouts ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def raw_server(
    respond: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[tuple[str, list[asyncio.Event]]]:
    """A TCP server that reads one request head per connection, runs `respond`, then waits for
    the client to close; yields its URL and, per connection, an event set when it closed."""
    closed: list[asyncio.Event] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gone = asyncio.Event()
        closed.append(gone)
        try:
            await reader.readuntil(b"\r\n\r\n")
            await respond(reader, writer)
            await reader.read()  # until the client closes
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            gone.set()
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", closed
    finally:
        # the handlers end as the client's connections close (callers close their client first)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(gone.wait() for gone in closed)), 2)
        server.close()


async def test_a_worker_that_never_answers_times_out_once() -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        return  # reads the request, answers nothing

    async with raw_server(never) as (url, closed):
        client = Upstream(first_byte_timeout=0.5)
        try:
            started = time.monotonic()
            with pytest.raises(UpstreamError) as caught:
                async with client.post(url, "/generate", b"{}", HEADERS):
                    pass
            assert caught.value.timeout
            assert 0.4 < time.monotonic() - started < 2.0
            assert "did not answer" in str(caught.value)
            await asyncio.wait_for(closed[0].wait(), 2)  # the worker sees the request abandoned
            assert len(closed) == 1  # and it was not sent again
        finally:
            await client.aclose()


async def test_a_stream_that_goes_silent_times_out() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nline\n\r\n")
        await writer.drain()  # and then nothing more

    async with raw_server(stall) as (url, closed):
        client = Upstream(first_byte_timeout=5, idle_timeout=0.5)
        try:
            got = []
            async with client.post(url, "/generate", b"{}", HEADERS) as r:
                started = time.monotonic()
                with pytest.raises(UpstreamError) as caught:
                    async for line in r.lines():
                        got.append(line)
            assert got == [b"line"]
            assert caught.value.timeout and "sent nothing" in str(caught.value)
            assert 0.4 < time.monotonic() - started < 2.0
            await asyncio.wait_for(closed[0].wait(), 2)
        finally:
            await client.aclose()


async def test_keep_alive_lines_hold_a_slow_stream_open() -> None:
    """A worker whose request waits in its queue longer than the idle timeout, sending the
    empty keep-alive lines a worker sends meanwhile: the stream is read to its end."""

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(8):  # 1.6 s of nothing but keep-alives, idle timeout 0.5 s
            writer.write(b"1\r\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
        writer.write(b"5\r\nline\n\r\n0\r\n\r\n")
        await writer.drain()

    async with raw_server(slow) as (url, _):
        client = Upstream(first_byte_timeout=5, idle_timeout=0.5)
        try:
            async with client.post(url, "/generate", b"{}", HEADERS) as r:
                assert [line async for line in r.lines()] == [b"line"]
        finally:
            await client.aclose()


def _threaded_server(respond: Callable[[socket.socket], None]) -> tuple[str, threading.Thread]:
    """One connection served by a thread: independent of the client's event loop."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                respond(conn)
                with contextlib.suppress(OSError):
                    conn.recv(1)  # until the client closes

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{port}", thread


def test_our_own_stalled_loop_does_not_count_as_the_worker_s_silence() -> None:
    """The gateway runs on uvloop, whose timers fire before it reads sockets: after our loop
    was blocked past the idle timeout, the check must not blame a worker whose data is
    waiting unread in the socket."""
    import uvloop

    def respond(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        time.sleep(0.3)
        conn.sendall(b"5\r\nline\n\r\n0\r\n\r\n")

    url, thread = _threaded_server(respond)

    async def client_side() -> list[bytes]:
        client = Upstream(first_byte_timeout=5, idle_timeout=0.5)
        try:
            async with client.post(url, "/generate", b"{}", HEADERS) as r:
                time.sleep(1.5)  # noqa: ASYNC251 - a CPU-bound stall of our loop; the line arrives meanwhile
                return [line async for line in r.lines()]
        finally:
            await client.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(client_side()) == [b"line"]
    thread.join(5)
