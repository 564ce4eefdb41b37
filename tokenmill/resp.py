"""A lean Redis client for the request path: one pipelined connection, replies parsed by hiredis.

Each gateway request makes three Redis calls: the admission script, the one that settles,
and the usage event. redis-py's asyncio client spends about 40 µs of CPU on each (a pool
checkout, retry and observability wrappers, per-argument encoding); this client about 7:
every caller queues its command on the one connection, the commands of an event loop
turn go out in one write, and the replies come back in order (RESP pipelining, what
Redis is built for). It implements `execute_command(*args)` and nothing else; everything
off the request path keeps using redis-py.

Replies are what redis-py returns without `decode_responses`: bytes, ints, lists, None.
An error reply raises `ResponseError` (its message starts with the Redis error code, e.g.
`NOSCRIPT`). When the connection fails, the commands waiting on it raise
`RespConnectionError` (they may or may not have run); the next command reconnects. Both
are redis-py exception classes too, so code that catches redis-py's errors catches these.

Every wait is bounded: connecting (with AUTH and SELECT) by `connect_timeout`, replies by
`reply_timeout`. Replies come back in order, so a Redis that sends no reply for
`reply_timeout` while commands wait (stopped, hung, cut off) fails them all with
`RespTimeoutError` (a `RespConnectionError` and a redis-py `TimeoutError`) and the
connection is dropped; the next command reconnects. A check that runs late because our own
event loop was stalled gives Redis a fresh window instead (its replies may be unread in the
socket).

`RespPublisher` publishes events with it exactly as `RedisBus.publish` does.

URLs: `redis://[[user]:password@]host[:port][/db]`, `rediss://` (TLS) and
`unix://[[user]:password@]/path[?db=N]`, as redis-py reads them.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis
import redis.exceptions

from tokenmill.bus import DEFAULT_MAXLEN, FIELD, REDIS_TIMEOUT, Event, redis_stream_maxlen_of
from tokenmill.bus import encode as encode_event


class ResponseError(redis.exceptions.ResponseError):
    """Redis answered with an error (a redis-py `ResponseError`, so callers catch both alike)."""


class RespConnectionError(redis.exceptions.ConnectionError, ConnectionError):
    """Redis could not be reached, or the connection failed before the reply arrived (a
    redis-py `ConnectionError` and an `OSError`)."""


class RespTimeoutError(RespConnectionError, redis.exceptions.TimeoutError):
    """Redis did not connect or reply in time; the connection was dropped."""


# A timeout check running this much later than due (at most half the timeout) means our own
# event loop was stalled meanwhile.
_LATE = 1.0


def encode(args: tuple[Any, ...]) -> bytes:
    """A command as a RESP array of bulk strings (numbers as redis-py writes them)."""
    out = [b"*%d\r\n" % len(args)]
    add = out.append
    for arg in args:
        kind = type(arg)
        if kind is str:
            data = arg.encode()
        elif kind is bytes:
            data = arg
        elif kind is int or kind is float:
            data = repr(arg).encode()
        elif isinstance(arg, bool):  # as redis-py: ambiguous, refused
            raise TypeError(f"cannot send a bool to Redis: {arg!r}")
        elif isinstance(arg, bytes | memoryview):
            data = bytes(arg)
        elif isinstance(arg, int | float):
            data = repr(arg).encode()
        elif isinstance(arg, str):
            data = arg.encode()
        else:
            raise TypeError(f"cannot send {type(arg).__name__} to Redis: {arg!r}")
        add(b"$%d\r\n" % len(data))
        add(data)
        add(b"\r\n")
    return b"".join(out)


class _Connection(asyncio.Protocol):
    def __init__(self, reply_timeout: float | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.pending: list[bytes] = []  # commands not written yet
        self.lost: BaseException | None = None
        # Redis must show progress (`progress`: a reply arrived, or a command went out on an
        # idle connection) every `reply_timeout` while commands wait: one lazily re-armed
        # timer per connection, not one per command.
        self.loop = asyncio.get_running_loop()
        self.reply_timeout = reply_timeout
        self.progress = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.due = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.progress = self.loop.time()
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(RespConnectionError(f"malformed reply from Redis: {exc}"))
                if self.transport is not None:
                    self.transport.close()
                return
            if reply is False:
                return
            if not self.waiting:  # a reply nobody asked for: the stream is out of step
                self._fail(RespConnectionError("unexpected reply from Redis"))
                if self.transport is not None:
                    self.transport.close()
                return
            fut = self.waiting.popleft()
            if fut.done():  # its caller was cancelled; the reply is dropped in order
                continue
            if isinstance(reply, hiredis.ReplyError):
                fut.set_exception(ResponseError(str(reply)))
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(
            RespConnectionError(f"connection to Redis lost: {exc}" if exc else "connection to Redis closed")
        )

    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)

    def send(self, payload: bytes) -> asyncio.Future[Any]:
        """Queue a command; the commands of one event loop turn go out in one write."""
        loop = self.loop
        fut = loop.create_future()
        if not self.waiting:  # the first command on an idle connection: its clock starts now
            self.progress = loop.time()
        self.waiting.append(fut)
        if not self.pending:
            loop.call_soon(self._flush)
        self.pending.append(payload)
        if self.timer is None and self.reply_timeout is not None:
            self._schedule(self.progress + self.reply_timeout)
        return fut

    def _schedule(self, due: float) -> None:
        self.due = due
        self.timer = self.loop.call_at(due, self._check)

    def _check(self) -> None:
        self.timer = None
        limit = self.reply_timeout
        if limit is None or not self.waiting or self.lost is not None:
            return  # the next command on an idle connection arms it again
        now = self.loop.time()
        if now - self.due > min(_LATE, limit / 2):
            self.progress = now  # our own loop was stalled: not Redis's silence
        deadline = self.progress + limit
        if now < deadline:
            self._schedule(deadline)
            return
        self._fail(RespTimeoutError(f"Redis sent no reply for {limit:g} s"))
        if self.transport is not None:
            self.transport.close()

    def _flush(self) -> None:
        payload = b"".join(self.pending)
        self.pending.clear()
        if self.lost is None and self.transport is not None and not self.transport.is_closing():
            self.transport.write(payload)

    @property
    def usable(self) -> bool:
        return self.lost is None and self.transport is not None and not self.transport.is_closing()


class RespClient:
    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        path: str | None = None,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
        connect_timeout: float = REDIS_TIMEOUT,
        reply_timeout: float | None = REDIS_TIMEOUT,
    ) -> None:
        self.host, self.port, self.path, self.db = host, port, path, db
        self.username, self.password, self.tls = username, password, tls
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self._conn: _Connection | None = None
        self._connecting: asyncio.Lock | None = None
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RespClient:
        u = urlsplit(url)
        query = parse_qs(u.query)
        db = int(query["db"][0]) if "db" in query else 0
        auth = {
            "username": unquote(u.username) if u.username else None,
            "password": unquote(u.password) if u.password else None,
        }
        if u.scheme == "unix":
            return cls(path=u.path, db=db, **auth, **kwargs)
        if u.scheme not in ("redis", "rediss"):
            raise ValueError(f"unsupported Redis URL scheme {u.scheme!r}")
        if u.path.strip("/"):
            db = int(u.path.strip("/"))
        tls = ssl.create_default_context() if u.scheme == "rediss" else None
        return cls(host=u.hostname or "127.0.0.1", port=u.port or 6379, db=db, tls=tls, **auth, **kwargs)

    async def execute_command(self, *args: Any) -> Any:
        conn = self._conn
        if conn is None or not conn.usable:
            conn = await self._connect()
        return await conn.send(encode(args))

    async def _connect(self) -> _Connection:
        if self._closed:
            raise RespConnectionError("the client is closed")
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # concurrent callers share one new connection
            conn = self._conn
            if conn is not None and conn.usable:
                return conn
            loop = asyncio.get_running_loop()
            conn = None
            try:
                async with asyncio.timeout(self.connect_timeout):
                    if self.path is not None:
                        _, conn = await loop.create_unix_connection(self._protocol, self.path)
                    else:
                        _, conn = await loop.create_connection(
                            self._protocol, self.host, self.port, ssl=self.tls
                        )
                    hello: list[asyncio.Future[Any]] = []
                    if self.password is not None:
                        auth = (self.username, self.password) if self.username else (self.password,)
                        hello.append(conn.send(encode(("AUTH", *auth))))
                    if self.db:
                        hello.append(conn.send(encode(("SELECT", self.db))))
                    for reply in hello:
                        await reply
            except TimeoutError as exc:
                if conn is not None and conn.transport is not None:
                    conn.transport.close()  # connected, but AUTH or SELECT got no reply
                raise RespTimeoutError(f"cannot connect to Redis within {self.connect_timeout:g} s") from exc
            except OSError as exc:
                if conn is not None and conn.transport is not None:
                    conn.transport.close()
                raise RespConnectionError(f"cannot connect to Redis: {exc!r}") from exc
            except ResponseError:
                if conn is not None and conn.transport is not None:
                    conn.transport.close()
                raise
            self._conn = conn
            return conn

    def _protocol(self) -> _Connection:
        return _Connection(self.reply_timeout)

    async def aclose(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()


class RespPublisher:
    """A `Publisher` on a `RespClient`: the same stream entries as `RedisBus.publish` (one
    field holding the JSON event; trimmed with `MAXLEN ~ maxlen`, none when None: by default
    the usage stream, which the consumer side trims behind its groups)."""

    def __init__(
        self,
        client: RespClient,
        *,
        maxlen: int | None = DEFAULT_MAXLEN,
        stream_maxlen: Mapping[str, int | None] | None = None,
        owns_client: bool = False,
    ) -> None:
        self.client = client
        self._maxlen = maxlen
        self._stream_maxlen = redis_stream_maxlen_of(stream_maxlen)
        self._owns_client = owns_client

    async def publish(self, stream: str, event: Event) -> str:
        maxlen = self._stream_maxlen.get(stream, self._maxlen)
        trim = () if maxlen is None else ("MAXLEN", "~", maxlen)
        entry_id = await self.client.execute_command("XADD", stream, *trim, "*", FIELD, encode_event(event))
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()
