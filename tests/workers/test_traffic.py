"""A worker counts the requests that reach it and those that end, however they end: its
heartbeats carry both counts (the autoscaler's arrival rate) and /metrics the arrivals.
The worker's server over real HTTP around a generator that holds its deltas back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import msgspec

from tests.workers.test_keepalive import AUTH, TOKEN, HeldBack, _body, serve
from tests.workers.test_vllm_worker import _Capture
from tokenmill.protocol import EmbedRequest, EmbedResponse, Heartbeat, WorkerAnnounce
from tokenmill.settings import Settings
from workers.main import _beat, _Identity
from workers.server import RecentTtft, Traffic, WorkerInfo, create_app


async def _until(check: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_arrivals_and_ends_are_counted_in_heartbeats_and_metrics() -> None:
    generator, traffic = HeldBack(delay=0.5), Traffic()
    async with serve(generator, keepalive=5, traffic=traffic) as url, httpx.AsyncClient(base_url=url) as c:
        pending = asyncio.create_task(c.post("/generate", content=_body(), headers=AUTH, timeout=10))
        await _until(lambda: traffic.arrived == 1)
        assert traffic.finished == 0  # running

        bus: Any = _Capture()  # what _beat uses of a publisher
        identity = _Identity("w-1", "dep-1", url, "m")
        settings = Settings(heartbeat_seconds=0.02)
        beat = asyncio.create_task(
            _beat(bus, settings, identity, generator, RecentTtft(), asyncio.Event(), traffic=traffic)
        )
        try:
            await _until(lambda: any(isinstance(e, Heartbeat) for e in bus.events))
            heartbeat = next(e for e in bus.events if isinstance(e, Heartbeat))
            assert isinstance(bus.events[0], WorkerAnnounce)
            assert (heartbeat.arrived, heartbeat.finished) == (1, 0)

            assert (await pending).status_code == 200
            assert (traffic.arrived, traffic.finished) == (1, 1)

            # A client that leaves mid-request: the request ends with it.
            generator.delay = 30
            generator.stopped.clear()
            leaving = asyncio.create_task(c.post("/generate", content=_body(), headers=AUTH, timeout=10))
            await _until(lambda: traffic.arrived == 2)
            leaving.cancel()
            await asyncio.wait_for(generator.stopped.wait(), 5)
            await _until(lambda: traffic.finished == 2)

            # A generation that fails counts as ended; a body refused before it starts, not at all.
            generator.delay, generator.fail = 0.0, True
            assert (await c.post("/generate", content=_body(), headers=AUTH)).status_code == 200
            assert (await c.post("/generate", content=b"{", headers=AUTH)).status_code == 400
            assert (traffic.arrived, traffic.finished) == (3, 3)
            seen = len(bus.events)
            await _until(lambda: len(bus.events) > seen + 1)
            assert (bus.events[-1].arrived, bus.events[-1].finished) == (3, 3)
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

        text = (await c.get("/metrics", headers=AUTH)).text
        assert 'tokenmill_worker_requests_arrived_total{model_name="m"} 3.0' in text
        # completions stay vLLM's: one by finish reason (the failed stream ended in-band)
        assert 'vllm:request_success_total{finished_reason="length",model_name="m"} 1.0' in text


class _Embedder:
    running = waiting = 0
    kv_usage = 0.0

    def validate(self, req: EmbedRequest) -> None:
        return None

    async def embed(self, req: EmbedRequest) -> EmbedResponse:
        return EmbedResponse([[0.0] for _ in req.inputs], sum(len(i) for i in req.inputs))


async def test_an_embed_worker_counts_its_requests_too() -> None:
    from litestar.testing import AsyncTestClient

    traffic = Traffic()
    app = create_app(embedder=_Embedder(), token=TOKEN, info=WorkerInfo("w-e", "e"), traffic=traffic)  # type: ignore[arg-type]
    async with AsyncTestClient(app) as c:
        body = msgspec.json.encode(EmbedRequest("r", [[1, 2], [3]]))
        for _ in range(2):
            assert (await c.post("/embed", content=body, headers=AUTH)).status_code == 200
        text = (await c.get("/metrics", headers=AUTH)).text
    assert (traffic.arrived, traffic.finished) == (2, 2)
    assert 'tokenmill_worker_requests_arrived_total{model_name="e"} 2.0' in text
