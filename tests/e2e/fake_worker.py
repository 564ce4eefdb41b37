"""A worker process that speaks the real worker protocol without a model (for load, chaos and
autoscaling tests): it announces itself and heartbeats on Redis (running requests, and the
cumulative arrived / finished counts), answers `/generate` with NDJSON deltas, and can be
killed like a real worker.

    python -m tests.e2e.fake_worker --redis URL --deployment ID --port N --token T

It also takes the command line `LocalProcessProvider` gives `tokenmill worker` (`worker --model
M --deployment ID --worker-id W --exit-with-parent`, any port, the Redis URL and the token from
REDIS_URL and TOKENMILL_INTERNAL_TOKEN), so a reconciler can start it as its deployment's worker
(tests/e2e/test_autoscaling.py).

Each request gets a completion of `1 + (sum of prompt ids + seed) % max_tokens` tokens, so
lengths vary but are reproducible from the request; `--delay S` spaces its tokens S seconds
apart, so that requests take time and run side by side.

Faults (tests/e2e/test_faults.py): `--hang` accepts each request and never answers;
`--stall-after N` streams N deltas and then nothing more, the connection left open. Either
way the worker keeps heartbeating, as a hung process's heartbeat task may. `--log FILE`
appends the id of every request received.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import uvicorn
from litestar import Litestar, Request, post
from litestar.response import Response, Stream

from tokenmill.bus import RedisBus
from tokenmill.protocol import (
    WORKERS,
    GenerateDelta,
    GenerateRequest,
    Heartbeat,
    WorkerAnnounce,
    WorkerDeparture,
)


class Counts:
    """What heartbeats report: requests streaming now, and arrived / finished since the start."""

    running = arrived = finished = 0


def make_app(
    token: str,
    seed: int,
    *,
    hang: bool = False,
    stall_after: int | None = None,
    log: str | None = None,
    delay: float = 0.0,
    counts: Counts | None = None,
) -> Litestar:
    counts = counts or Counts()

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
            counts.arrived += 1
            counts.running += 1
            try:
                for i in range(n):
                    if stall_after is not None and i == stall_after:
                        await asyncio.Event().wait()  # mid-stream: nothing more, connection open
                    if delay:
                        await asyncio.sleep(delay)
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
            finally:
                counts.running -= 1
                counts.finished += 1

        return Stream(lines(), media_type="application/x-ndjson")

    return Litestar([generate])


async def heartbeats(bus: RedisBus, worker_id: str, deployment: str, address: str, counts: Counts) -> None:
    announced = False
    while True:
        with contextlib.suppress(Exception):  # Redis may be restarting; keep trying
            if not announced:  # first, as a real worker: it counts from zero from here
                await bus.publish(
                    WORKERS, WorkerAnnounce(worker_id, deployment, address, model="fake", ts=time.time())
                )
                announced = True
            await bus.publish(
                WORKERS,
                Heartbeat(
                    worker_id=worker_id,
                    deployment_id=deployment,
                    address=address,
                    model="fake",
                    running=counts.running,
                    ts=time.time(),
                    arrived=counts.arrived,
                    finished=counts.finished,
                ),
            )
        await asyncio.sleep(0.3)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", nargs="?", help="`worker`, as LocalProcessProvider runs `tokenmill`; ignored")
    p.add_argument("--redis", default=os.environ.get("REDIS_URL"))
    p.add_argument("--deployment", required=True)
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--token", default=os.environ.get("TOKENMILL_INTERNAL_TOKEN"))
    p.add_argument("--id", "--worker-id", dest="id", default="fake")
    p.add_argument("--model", default="fake", help="ignored: there is no model")
    p.add_argument("--exit-with-parent", action="store_true", help="ignored: the provider sees to it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0, help="seconds between a request's tokens")
    p.add_argument("--hang", action="store_true", help="never answer /generate")
    p.add_argument("--stall-after", type=int, default=None, help="stream this many deltas, then stall")
    p.add_argument("--log", default=None, help="append received request ids to this file")
    args = p.parse_args()
    if not args.redis or not args.token:
        p.error("--redis and --token (or REDIS_URL and TOKENMILL_INTERNAL_TOKEN) are required")
    bus = RedisBus.from_url(args.redis)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    address = f"http://127.0.0.1:{sock.getsockname()[1]}"
    counts = Counts()
    beat = asyncio.create_task(heartbeats(bus, args.id, args.deployment, address, counts))
    app = make_app(
        args.token,
        args.seed,
        hang=args.hang,
        stall_after=args.stall_after,
        log=args.log,
        delay=args.delay,
        counts=counts,
    )
    # A hung request never ends by itself: past a second, SIGTERM cancels it (uvicorn would
    # otherwise wait for it until the test's teardown kills the process, 20 s later).
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    try:
        await server.serve(sockets=[sock])
    finally:
        beat.cancel()
        with contextlib.suppress(Exception):
            await bus.publish(WORKERS, WorkerDeparture(args.id, args.deployment, ts=time.time()))
        await bus.close()


if __name__ == "__main__":
    asyncio.run(main())
