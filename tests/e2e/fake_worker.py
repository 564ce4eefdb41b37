"""A worker process that speaks the real worker protocol without a model (for load and chaos
tests): it heartbeats on Redis, answers `/generate` with NDJSON deltas at once, and can be
killed like a real worker.

    python -m tests.e2e.fake_worker --redis URL --deployment ID --port N --token T

Each request gets a completion of `1 + (sum of prompt ids + seed) % max_tokens` tokens, so
lengths vary but are reproducible from the request.

Faults (tests/e2e/test_faults.py): `--hang` accepts each request and never answers;
`--stall-after N` streams N deltas and then nothing more, the connection left open. Either
way the worker keeps heartbeating, as a hung process's heartbeat task may. `--log FILE`
appends the id of every request received.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import uvicorn
from litestar import Litestar, Request, post
from litestar.response import Response, Stream

from tokenmill.bus import RedisBus
from tokenmill.protocol import WORKERS, GenerateDelta, GenerateRequest, Heartbeat


def make_app(
    token: str, seed: int, *, hang: bool = False, stall_after: int | None = None, log: str | None = None
) -> Litestar:
    @post("/generate", status_code=200)
    async def generate(request: Request) -> Stream | Response:
        if request.headers.get("authorization") != f"Bearer {token}":
            return Response({"error": "unauthorized"}, status_code=401)
        req = msgspec.json.decode(await request.body(), type=GenerateRequest)
        if log is not None:  # a line, appended: small enough not to matter on the loop
            with Path(log).open("a") as f:  # noqa: ASYNC230
                f.write(req.request_id + "\n")
        if hang:
            await asyncio.Event().wait()  # the request was read; no answer ever comes
        n = 1 + (sum(req.prompt_token_ids) + seed) % max(1, req.sampling.max_tokens)

        async def lines() -> AsyncIterator[bytes]:
            for i in range(n):
                if stall_after is not None and i == stall_after:
                    await asyncio.Event().wait()  # mid-stream: nothing more, connection open
                d = GenerateDelta(
                    text=f"t{i} ",
                    token_ids=[100 + i],
                    prompt_tokens=len(req.prompt_token_ids),
                    completion_tokens=i + 1,
                    finish_reason="length" if i == n - 1 else None,
                )
                yield msgspec.json.encode(d) + b"\n"
                if i % 4 == 3:
                    await asyncio.sleep(0)

        return Stream(lines(), media_type="application/x-ndjson")

    return Litestar([generate])


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


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--redis", required=True)
    p.add_argument("--deployment", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--id", default="fake")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang", action="store_true", help="never answer /generate")
    p.add_argument("--stall-after", type=int, default=None, help="stream this many deltas, then stall")
    p.add_argument("--log", default=None, help="append received request ids to this file")
    args = p.parse_args()
    bus = RedisBus.from_url(args.redis)
    address = f"http://127.0.0.1:{args.port}"
    beat = asyncio.create_task(heartbeats(bus, args.id, args.deployment, address))
    server = uvicorn.Server(
        uvicorn.Config(
            make_app(args.token, args.seed, hang=args.hang, stall_after=args.stall_after, log=args.log),
            host="127.0.0.1",
            port=args.port,
            log_level="warning",
        )
    )
    try:
        await server.serve()
    finally:
        beat.cancel()
        await bus.close()


if __name__ == "__main__":
    asyncio.run(main())
