"""HTTP/1.1 to workers, lean: keep-alive connections, one POST at a time on each.

The gateway's hot path makes one call per request to a worker it chose itself: a small
JSON body out, NDJSON deltas (or one JSON object) back. A general client (httpx) spends
more CPU on that than the rest of the request path together (its pool scans every
connection per request, anyio wraps every read and write); this one is an asyncio
protocol around httptools' parser (C, what uvicorn parses with), a list of idle
connections per worker address, and nothing else: no redirects, cookies, proxies,
compression or retries beyond the one below.

Semantics the gateway relies on:

- A transport failure (refused, reset, cut off before the response completed, a malformed
  response) raises `UpstreamError`; an HTTP error status is a normal response.
- Leaving a response before its end closes the connection, so the worker sees the client
  go and stops generating; only a response read to its end returns the connection to the
  pool.
- A request that fails on a reused idle connection before any byte of a response arrived
  is sent once more on a new connection: the worker closed the idle connection as the
  request went out (keep-alive race), so it never saw the request.
- Every wait is bounded: connecting (`connect_timeout`), the response headers
  (`first_byte_timeout`) and each silence inside the body (`idle_timeout`; workers send an
  empty keep-alive line every few seconds while a request produces nothing, and `lines()`
  skips it). Past one, the connection is closed and `UpstreamError` raised with
  `timeout=True`; a timed-out request is never sent again (the worker may be running it).
  Only time during which this process could read counts: a timer that fires late because
  our own event loop was stalled, or while reading is paused because our caller is slow,
  gives the worker a fresh window instead of blaming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

# Idle connections older than this are not reused: servers close idle keep-alive connections
# after a few seconds (uvicorn: 5 s), and a request sent as that happens is lost.
IDLE_SECONDS = 4.0
MAX_IDLE_PER_ADDRESS = 256
_HIGH_WATER = 1 << 20  # bytes of unread body at which reading pauses
# A timeout check running this much later than due (at most half the timeout) means our own
# event loop was stalled meanwhile: what the worker sent may be unread in the socket.
_LATE = 1.0


class UpstreamError(Exception):
    """The worker could not be reached, or the connection failed before the response ended.

    `timeout` is True when it was a timeout (no connection, headers or body data in time)."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


@dataclass(slots=True)
class _Origin:
    host: str
    port: int
    ssl: ssl.SSLContext | None
    head: bytes  # b"host: ...\r\n"


class _Connection(asyncio.Protocol):
    """One connection; one request/response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.headers_done = False
        self.complete = False  # the current response has ended
        self.keep_alive = False
        self.received = False  # any byte of the current response arrived
        self.error: BaseException | None = None  # the connection failed or closed
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.idle_since = 0.0
        # The running timeout: the worker must show progress (`activity`) every `limit`
        # seconds; one timer per phase, re-armed lazily rather than per wait.
        self.loop = asyncio.get_running_loop()
        self.limit: float | None = None
        self.idle_limit: float | None = None
        self.activity = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.due = 0.0

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("unexpected protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed response: {exc}"))

    def eof_received(self) -> bool | None:
        self._fail(UpstreamError("the worker closed the connection"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(UpstreamError(f"connection lost: {exc}" if exc else "connection closed"))

    def pause_writing(self) -> None:  # requests are small; the transport buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # --- httptools callbacks ---

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._arm(self.idle_limit)  # from the first byte's deadline to the body's idle one
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.activity = self.loop.time()
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._disarm()
        self._wake()

    # --- timeouts ---

    def _arm(self, limit: float | None) -> None:
        self._disarm()
        self.limit = limit
        if limit is not None:
            self.activity = self.loop.time()
            self._schedule(self.activity + limit)

    def _schedule(self, due: float) -> None:
        self.due = due
        self.timer = self.loop.call_at(due, self._check)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        self.timer = None
        limit = self.limit
        if limit is None or self.complete or self.error is not None:
            return
        now = self.loop.time()
        if self.paused or now - self.due > min(_LATE, limit / 2):
            # Not the worker's silence: we stopped reading (our caller is slow) or our own
            # loop was stalled past the deadline. A fresh window from now.
            self.activity = now
        deadline = self.activity + limit
        if now < deadline:
            self._schedule(deadline)
            return
        what = "sent nothing" if self.headers_done else "did not answer"
        self._fail(UpstreamError(f"the worker {what} for {limit:g} s", timeout=True))
        if self.transport is not None:
            self.transport.close()

    # --- internals ---

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._disarm()
        self._wake()

    async def wait(self) -> None:
        """Until something arrives (or the connection fails)."""
        if self.error is not None and not self.complete:
            raise self.error
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def start(self, request: bytes, first_byte: float | None, idle: float | None) -> None:
        self.status, self.headers_done, self.complete, self.received = 0, False, False, False
        self.chunks.clear()
        self.buffered = 0
        assert self.transport is not None
        self.idle_limit = idle
        self._arm(first_byte)
        self.transport.write(request)

    @property
    def reusable(self) -> bool:
        return (
            self.error is None
            and self.transport is not None
            and not self.transport.is_closing()
            and time.monotonic() - self.idle_since < IDLE_SECONDS
        )

    def close(self) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.close()


class Response:
    """A worker's answer; the body is read with `lines()` or `read()`, once."""

    def __init__(self, pool: Upstream, key: str, conn: _Connection) -> None:
        self._pool = pool
        self._key = key
        self._conn: _Connection | None = conn
        self.status_code = conn.status

    async def _chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        assert conn is not None, "the body was read already"
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                break
            await conn.wait()
        self._release()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self._chunks()])

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's non-empty lines, without their line ends."""
        rest = b""
        async for chunk in self._chunks():
            if rest:
                chunk = rest + chunk
            *lines, rest = chunk.split(b"\n")
            for line in lines:
                if line and line != b"\r":
                    yield line.removesuffix(b"\r")
        if rest.strip():
            yield rest.removesuffix(b"\r")

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._put(self._key, conn)

    def close(self) -> None:
        """Drop the connection unless the response was read to its end."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class Upstream:
    """Keep-alive connections to workers, per address (`http://host:port`)."""

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        first_byte_timeout: float | None = 60.0,
        idle_timeout: float | None = 30.0,
    ) -> None:
        """Timeouts in seconds (None: wait for ever); see the module's docstring."""
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self._idle: dict[str, list[_Connection]] = {}
        self._origins: dict[str, _Origin] = {}
        self._closed = False

    def _origin(self, address: str) -> _Origin:
        origin = self._origins.get(address)
        if origin is None:
            url = urlsplit(address)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise UpstreamError(f"not an http(s) address: {address!r}")
            context = ssl.create_default_context() if url.scheme == "https" else None
            port = url.port or (443 if url.scheme == "https" else 80)
            origin = _Origin(url.hostname, port, context, f"host: {url.netloc}\r\n".encode())
            self._origins[address] = origin
        return origin

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Connection, origin.host, origin.port, ssl=origin.ssl)
        except TimeoutError as exc:
            raise UpstreamError(
                f"cannot connect to {origin.host}:{origin.port} within {self.connect_timeout:g} s",
                timeout=True,
            ) from exc
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {origin.host}:{origin.port}: {exc!r}") from exc
        return conn

    def _put(self, key: str, conn: _Connection) -> None:
        if self._closed or not conn.keep_alive or conn.error is not None:
            conn.close()
            return
        idle = self._idle.setdefault(key, [])
        if len(idle) >= MAX_IDLE_PER_ADDRESS:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _get(self, key: str) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be timed out
            if conn.reusable:
                return conn
            conn.close()
        return None

    @contextlib.asynccontextmanager
    async def post(
        self, address: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> AsyncIterator[Response]:
        """POST `body` to `address` + `path`; the response, once its headers are in."""
        if self._closed:
            raise UpstreamError("the client is closed")
        origin = self._origin(address)
        head = [f"POST {path} HTTP/1.1\r\n".encode(), origin.head]
        head += [f"{k}: {v}\r\n".encode() for k, v in headers.items()]
        head.append(f"content-length: {len(body)}\r\n\r\n".encode())
        request = b"".join(head) + body
        conn = self._get(address)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(origin)
            try:
                conn.start(request, self.first_byte_timeout, self.idle_timeout)
                while not conn.headers_done:
                    await conn.wait()
                break
            except UpstreamError as exc:
                conn.close()
                if exc.timeout or not (reused and not conn.received):
                    raise
                conn, reused = None, False  # the keep-alive race: once more, on a new connection
            except BaseException:
                conn.close()
                raise
        response = Response(self, address, conn)
        try:
            yield response
        finally:
            response.close()

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
