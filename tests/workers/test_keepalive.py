"""A /generate stream that has nothing to send yet keeps telling the gateway it is alive.

A request may wait in the engine's queue or prefill a long prompt for longer than the gateway's
idle timeout; the worker then sends empty lines, so only a hung worker trips that timeout. The
worker's server runs over real HTTP (uvicorn) around a generator that holds its first delta
back; the gateway's own client (gateway/upstream.py) reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import uvicorn
from litestar import Litestar

from gateway.upstream import Upstream
from tokenmill.protocol import GenerateDelta, GenerateRequest, KvOp, SamplingParams
from workers.server import Traffic, WorkerInfo, create_app

TOKEN = "keepalive-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class HeldBack:
    """A generator whose deltas come after `delay` seconds (a request waiting its turn), or
    that fails then when `fail`."""

    def __init__(self, delay: float, fail: bool = False) -> None:
        self.delay = delay
        self.fail = fail
        self.stopped = asyncio.Event()  # set when a generation ends, however it ends
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.adapters: list[str] = []

    def validate(self, req: GenerateRequest) -> None:
        return None

    def drain_kv_events(self) -> list[KvOp]:
        return []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        try:
            await asyncio.sleep(self.delay)
            if self.fail:
                raise RuntimeError("the engine broke")
            yield GenerateDelta(text="a", token_ids=[1], prompt_tokens=2, completion_tokens=1)
            yield GenerateDelta(
                text="b", token_ids=[2], prompt_tokens=2, completion_tokens=2, finish_reason="length"
            )
        finally:
            self.stopped.set()


@contextlib.asynccontextmanager
async def serve(generator: HeldBack, keepalive: float, traffic: Traffic | None = None) -> AsyncIterator[str]:
    app: Litestar = create_app(
        generator,  # type: ignore[arg-type]  # what /generate uses of the protocol
        token=TOKEN,
        info=WorkerInfo("w-keepalive", "m"),
        keepalive=keepalive,
        traffic=traffic,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), "worker app did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


def _body() -> bytes:
    return msgspec.json.encode(
        GenerateRequest(request_id="r", prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=2))
    )


async def test_a_request_waiting_its_turn_sends_keep_alive_lines() -> None:
    generator = HeldBack(delay=1.2)
    async with serve(generator, keepalive=0.2) as url:
        async with (
            httpx.AsyncClient(timeout=10) as client,
            client.stream("POST", f"{url}/generate", content=_body(), headers=AUTH) as r,
        ):
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines()]
        deltas = [msgspec.json.decode(line, type=GenerateDelta) for line in lines if line]
        assert [d.text for d in deltas] == ["a", "b"]
        # empty lines while it waited (about one per 0.2 s), none once deltas flowed
        assert lines.index(next(line for line in lines if line)) >= 3
        assert all(lines[lines.index(next(ln for ln in lines if ln)) :])

        # the gateway's client, whose idle timeout is shorter than the wait, reads it through
        upstream = Upstream(first_byte_timeout=5, idle_timeout=0.5)
        try:
            async with upstream.post(url, "/generate", _body(), AUTH) as resp:
                got = [msgspec.json.decode(line, type=GenerateDelta) async for line in resp.lines()]
            assert [d.finish_reason for d in got] == [None, "length"]
        finally:
            await upstream.aclose()


async def test_leaving_while_waiting_stops_the_generation() -> None:
    generator = HeldBack(delay=30)
    async with serve(generator, keepalive=0.1) as url:
        upstream = Upstream(first_byte_timeout=5, idle_timeout=5)
        try:
            async with upstream.post(url, "/generate", _body(), AUTH) as resp:
                assert resp.status_code == 200
            started = time.monotonic()  # leaving the block closed the connection
            await asyncio.wait_for(generator.stopped.wait(), 5)
            assert time.monotonic() - started < 5
        finally:
            await upstream.aclose()


async def test_a_generator_failing_after_keep_alives_reports_in_band() -> None:
    generator = HeldBack(delay=0.5, fail=True)
    async with serve(generator, keepalive=0.1) as url, httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{url}/generate", content=_body(), headers=AUTH)
    assert r.status_code == 200
    lines = r.text.split("\n")
    assert lines[0] == ""  # keep-alives came first
    last: dict[str, Any] = msgspec.json.decode([ln for ln in lines if ln][-1])
    assert last["finish_reason"] == "error" and "the engine broke" in last["error"]
