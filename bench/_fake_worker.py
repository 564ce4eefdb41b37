"""An instant fake worker for gateway benchmarks, as cheap as a worker can be.

    python -m bench._fake_worker --redis URL --deployment ID --port N --token T

It speaks the real worker protocol (`POST /generate`, internal token, NDJSON deltas) and
heartbeats on Redis like `tests/e2e/fake_worker.py`, whose completion lengths it copies
(`1 + (sum of prompt ids + seed) % max_tokens` tokens). Unlike that one it is a bare
asyncio protocol on uvloop with httptools' parser and no framework, and it answers with a
whole body (content-length) instead of a chunked stream: it shares the machine's cores
with the gateway under test, so every microsecond it spends is one the gateway does not
get. A gateway reads the body line by line either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import httptools
import msgspec
import uvloop

from tokenmill.bus import RedisBus
from tokenmill.protocol import WORKERS, GenerateDelta, GenerateRequest, Heartbeat

_request = msgspec.json.Decoder(GenerateRequest)
_encode = msgspec.json.Encoder().encode


def completion(body: bytes, seed: int) -> bytes:
    """The NDJSON deltas of a completion of the request in `body`."""
    req = _request.decode(body)
    n = 1 + (sum(req.prompt_token_ids) + seed) % max(1, req.sampling.max_tokens)
    prompt = len(req.prompt_token_ids)
    return b"".join(
        _encode(
            GenerateDelta(
                text=f"t{i} ",
                token_ids=[100 + i],
                prompt_tokens=prompt,
                completion_tokens=i + 1,
                finish_reason="length" if i == n - 1 else None,
            )
        )
        + b"\n"
        for i in range(n)
    )


def _response(status: bytes, body: bytes, content_type: bytes = b"application/x-ndjson") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type
        + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


class _Http(asyncio.Protocol):
    """One keep-alive connection: requests are answered in order as they complete."""

    def __init__(self, auth: bytes, seed: int) -> None:
        self.auth = auth
        self.seed = seed
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.authorized = False
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(_response(b"400 Bad Request", b"bad request", b"text/plain"))
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.authorized, self.body = b"", False, []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.authorized = value == self.auth

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.url == b"/health":
            out = _response(b"200 OK", b'{"status":"ok"}', b"application/json")
        elif self.url != b"/generate":
            out = _response(b"404 Not Found", b"not found", b"text/plain")
        elif not self.authorized:
            out = _response(b"401 Unauthorized", b'{"error":"unauthorized"}', b"application/json")
        else:
            try:
                out = _response(b"200 OK", completion(b"".join(self.body), self.seed))
            except msgspec.DecodeError as exc:
                out = _response(b"400 Bad Request", str(exc).encode(), b"text/plain")
        self.transport.write(out)
        if not self.parser.should_keep_alive():
            self.transport.close()


async def heartbeats(bus: RedisBus, worker_id: str, deployment: str, address: str) -> None:
    while True:
        with contextlib.suppress(Exception):  # Redis may be restarting; keep trying
            await bus.publish(
                WORKERS,
                Heartbeat(
                    worker_id=worker_id,
                    deployment_id=deployment,
                    address=address,
                    model="fake",
                    ts=time.time(),
                ),
            )
        await asyncio.sleep(0.3)


async def serve(host: str, port: int, token: str, seed: int) -> asyncio.Server:
    auth = f"Bearer {token}".encode()
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Http(auth, seed), host, port, backlog=1024)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--redis", required=True)
    p.add_argument("--deployment", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--id", default="fake")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    server = await serve("127.0.0.1", args.port, args.token, args.seed)
    bus = RedisBus.from_url(args.redis)
    beat = asyncio.create_task(heartbeats(bus, args.id, args.deployment, f"http://127.0.0.1:{args.port}"))
    try:
        async with server:
            await server.serve_forever()
    finally:
        beat.cancel()
        await bus.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main())
