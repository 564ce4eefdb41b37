"""The reference a gateway is measured against: a bare Litestar endpoint that only forwards.

    python -m bench._forwarder --port N --worker URL --token T [--client upstream|httpx]

`POST /v1/chat/completions` reads the body, sends one fixed generate request to the
worker over shared keep-alive connections, and answers with what the worker said. No key,
no limits, no tokenizer, no routing, no metering: the difference to the gateway is what
the product path costs. The worker client is the gateway's own (`gateway.upstream`) by
default, or an `httpx.AsyncClient` (what the gateway used before). Served by uvicorn
(httptools) on uvloop, like `tokenmill gateway`.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import msgspec
import uvicorn
import uvloop
from litestar import Litestar, Request, Response, post

from gateway.upstream import Upstream
from tokenmill.protocol import GenerateRequest, SamplingParams

Send = Callable[[], Awaitable[tuple[int, bytes]]]


def make_app(worker: str, token: str, client: str) -> Litestar:
    request = GenerateRequest(
        request_id="bench", prompt_token_ids=list(range(1, 25)), sampling=SamplingParams(max_tokens=8)
    )
    body = msgspec.json.encode(request)
    headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    send: list[Send] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        if client == "httpx":
            async with httpx.AsyncClient(timeout=30) as http:

                async def via_httpx() -> tuple[int, bytes]:
                    r = await http.post(f"{worker}/generate", content=body, headers=headers)
                    return r.status_code, r.content

                send.append(via_httpx)
                yield
        else:
            upstream = Upstream()

            async def via_upstream() -> tuple[int, bytes]:
                async with upstream.post(worker, "/generate", body, headers) as r:
                    return r.status_code, await r.read()

            send.append(via_upstream)
            try:
                yield
            finally:
                await upstream.aclose()

    @post("/v1/chat/completions", status_code=200)
    async def forward(request: Request) -> Response[bytes]:
        await request.body()
        status, content = await send[0]()
        return Response(content, status_code=status, media_type="application/json")

    return Litestar([forward], lifespan=[lifespan], logging_config=None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--client", choices=["upstream", "httpx"], default="upstream")
    args = p.parse_args()
    app = make_app(args.worker, args.token, args.client)
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_config=None, access_log=False)
    uvloop.run(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
