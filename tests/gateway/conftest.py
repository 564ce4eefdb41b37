"""A gateway app on a migrated SQLite database, and fake workers that speak the real protocol.

Fake workers keep these tests fast and deterministic; the real worker is tested in
tests/workers and end to end in tests/e2e.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest
import uvicorn
from litestar import Litestar, Request, post
from litestar.response import Stream
from sqlalchemy import select

from control_plane.bootstrap import bootstrap
from control_plane.catalog.models import Deployment, Model
from control_plane.catalog.services import CatalogService
from tests import databases
from tokenmill.app import Parts, create_app
from tokenmill.db import make_engine, make_sessionmaker
from tokenmill.protocol import (
    WORKERS,
    EmbedRequest,
    EmbedResponse,
    GenerateDelta,
    GenerateRequest,
    Heartbeat,
)
from tokenmill.settings import BUNDLED_MODEL, Settings

BUNDLED_NAME = "SmolLM2-135M-Instruct"  # the catalogue name `gateway_env` gives the bundled model
EMBED_NAME = "all-MiniLM-L6-v2"  # the bundled embedding model, once `Env.embed_deployment` adds it

INTERNAL = "internal-test-token"


@dataclass
class FakeWorker:
    """Streams `word0 word1 ...` (max_tokens of them, at most 8) as tokens 100, 101, ...;
    `fail` answers 500. Asked for logprobs, token 100 + i gets -0.5 - i/10 and the likeliest
    are `fake_top_logprobs` (unless `no_logprobs`: a worker that does not compute them)."""

    worker_id: str
    fail: bool = False
    delay: float = 0.0  # seconds per token
    max_tokens: int = 8
    no_logprobs: bool = False
    received: list[GenerateRequest] = field(default_factory=list)
    url: str = ""
    streaming: int = 0  # streams open right now
    streamed: list[int] = field(default_factory=list)  # tokens each stream has sent, in arrival order

    def app(self) -> Litestar:
        @post("/generate", status_code=200)
        async def generate(request: Request) -> Stream:
            assert request.headers.get("authorization") == f"Bearer {INTERNAL}"
            req = msgspec.json.decode(await request.body(), type=GenerateRequest)
            self.received.append(req)
            if self.fail:
                raise RuntimeError("fake worker failure")
            n = min(req.sampling.max_tokens, self.max_tokens)

            k = None if self.no_logprobs else req.sampling.logprobs

            async def lines() -> AsyncIterator[bytes]:
                self.streaming += 1
                stream = len(self.streamed)
                self.streamed.append(0)
                try:
                    for i in range(n):
                        await asyncio.sleep(self.delay)
                        d = GenerateDelta(
                            text=f"word{i} ",
                            token_ids=[100 + i],
                            prompt_tokens=len(req.prompt_token_ids),
                            completion_tokens=i + 1,
                            finish_reason="length" if i == n - 1 else None,
                            logprobs=None if k is None else [-0.5 - i / 10],
                            top_logprobs=None if k is None else [fake_top_logprobs(i)[:k]],
                        )
                        yield msgspec.json.encode(d) + b"\n"
                        self.streamed[stream] += 1
                finally:
                    self.streaming -= 1

            return Stream(lines(), media_type="application/x-ndjson")

        return Litestar([generate])


def fake_top_logprobs(i: int) -> list[tuple[int, float]]:
    """The likeliest tokens a `FakeWorker` reports at its i-th token: the sampled one, then
    300 + i, 301 + i, ... (twenty in all, best first)."""
    return [(100 + i, -0.5 - i / 10), *((300 + i + j, -2.0 - j) for j in range(19))]


@dataclass
class FakeEmbedder:
    """A worker of an embed deployment: answers `/embed` with a fixed `dim`-long vector per input."""

    worker_id: str
    dim: int = 8
    received: list[EmbedRequest] = field(default_factory=list)
    url: str = ""

    def app(self) -> Litestar:
        @post("/embed", status_code=200)
        async def embed(request: Request) -> bytes:
            assert request.headers.get("authorization") == f"Bearer {INTERNAL}"
            req = msgspec.json.decode(await request.body(), type=EmbedRequest)
            self.received.append(req)
            vectors = [[(len(ids) + j) / (self.dim + 0.5) for j in range(self.dim)] for ids in req.inputs]
            tokens = sum(len(ids) for ids in req.inputs)
            return msgspec.json.encode(EmbedResponse(embeddings=vectors, prompt_tokens=tokens))

        return Litestar([embed])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serve(app: Litestar) -> AsyncIterator[str]:
    port = _free_port()
    # proxy_headers off, as `tokenmill serve` runs uvicorn: the app decides whom to believe.
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", proxy_headers=False)
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]  # leave pytest's handlers alone
    task = asyncio.create_task(server.serve())
    for _ in range(1000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        raise RuntimeError(f"test server did not start on port {port}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@dataclass
class Env:
    client: httpx.AsyncClient
    app: Litestar
    admin_key: str
    deployment_id: str
    workers: list[FakeWorker]

    async def add_worker(self, fail: bool = False) -> FakeWorker:
        w = FakeWorker(f"fake-{len(self.workers)}", fail=fail)
        w.url = await self._stack.enter_async_context(serve(w.app()))
        self.workers.append(w)
        await self.beat(w)
        return w

    async def beat(self, w: FakeWorker, **kw: object) -> None:
        hb = Heartbeat(
            worker_id=w.worker_id,
            deployment_id=self.deployment_id,
            address=w.url,
            model="m",
            ts=time.time(),
            **kw,  # type: ignore[arg-type]
        )
        await self.app.state.bus.publish(WORKERS, hb)
        fleet = self.app.state.gateway.fleet
        for _ in range(200):
            if w.worker_id in fleet.workers:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the fleet view never saw the heartbeat")

    # --- tenants and deployments, for isolation tests --------------------------------------

    async def tenant(self, name: str, *, scopes: list[str] | None = None) -> Tenant:
        """A new organisation and a member key of it, made through the admin API."""
        admin = {"authorization": f"Bearer {self.admin_key}"}
        r = await self.client.post("/admin/v1/organizations", headers=admin, json={"name": name})
        assert r.status_code == 201, r.text
        org_id = r.json()["id"]
        return Tenant(org_id, await self.key(org_id, scopes=scopes))

    async def key(self, org_id: str, *, scopes: list[str] | None = None) -> str:
        """The secret of a new member key of `org_id`; `scopes` are the model names it may use."""
        admin = {"authorization": f"Bearer {self.admin_key}"}
        body = {"role": "member", "scopes": scopes}
        r = await self.client.post(f"/admin/v1/organizations/{org_id}/keys", headers=admin, json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["secret"])

    async def dedicated(self, name: str, org_id: str, model: str = BUNDLED_NAME) -> str:
        """Id of a new dedicated deployment of `model` owned by `org_id`, written to the table
        directly (the admin API's deployment endpoints are tested in tests/control_plane)."""
        async with self.app.state.sessionmaker() as session, session.begin():
            model_id = await session.scalar(select(Model.id).where(Model.name == model))
            assert model_id is not None, model
            dep = Deployment(name=name, model_id=model_id, org_id=org_id, kind="generate", type="dedicated")
            session.add(dep)
            await session.flush()
            return dep.id

    async def add_worker_for(self, deployment_id: str) -> FakeWorker:
        """A fake worker serving another deployment than the bundled model's (not in
        `workers`, which `beat` would move back to that one)."""
        w = FakeWorker(f"fake-{deployment_id}")
        w.url = await self._stack.enter_async_context(serve(w.app()))
        await self.announce(w.worker_id, w.url, deployment_id)
        return w

    async def announce(self, worker_id: str, url: str, deployment_id: str, model: str = "m") -> None:
        """Put any worker (fake or real) serving `deployment_id` into the gateway's fleet view."""
        hb = Heartbeat(
            worker_id=worker_id, deployment_id=deployment_id, address=url, model=model, ts=time.time()
        )
        await self.app.state.bus.publish(WORKERS, hb)
        fleet = self.app.state.gateway.fleet
        for _ in range(200):
            if worker_id in fleet.workers:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the fleet view never saw the heartbeat")

    # --- embeddings ---------------------------------------------------------------------------

    async def embed_deployment(self) -> str:
        """Id of the serverless deployment of the bundled MiniLM (added to the catalogue)."""
        async with self.app.state.sessionmaker() as session, session.begin():
            catalog = CatalogService(session)
            model = await catalog.ensure_model(
                name=EMBED_NAME, source="bundled:minilm", format="hf", kind="embed", context_length=256
            )
            return (await catalog.ensure_serverless(model)).id

    async def add_embed_worker(self, deployment_id: str) -> FakeEmbedder:
        w = FakeEmbedder(f"fake-embed-{deployment_id}")
        w.url = await self._stack.enter_async_context(serve(w.app()))
        await self.announce(w.worker_id, w.url, deployment_id, model=EMBED_NAME)
        return w

    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)


@dataclass(frozen=True)
class Tenant:
    org_id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


@pytest.fixture
async def gateway_env(tmp_path: Path, model_cache: Path) -> AsyncIterator[Env]:
    settings = Settings(
        home=tmp_path,
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}",
        internal_token=INTERNAL,
        secret_key="test-secret",
        model_cache=model_cache,
        worker_wait_seconds=1.0,
        worker_timeout_seconds=30.0,
    )
    await asyncio.to_thread(databases.migrate, settings.db_url)
    engine = make_engine(settings.db_url)
    boot = await bootstrap(
        make_sessionmaker(engine),
        secret_key="test-secret",
        model_name="SmolLM2-135M-Instruct",
        model_source=BUNDLED_MODEL,
        model_format="gguf",
        context_length=8192,
        sampling={"temperature": 0.3, "top_p": 0.8, "max_tokens": 5},
    )
    assert boot.admin_secret
    app = create_app(settings, engine, Parts(gateway=True, admin=True, consumers=True, internal_bus=True))
    # A real server on the test's own loop: the fake workers live on it too.
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        env = Env(client, app, boot.admin_secret, boot.deployment.id, [])
        async with env._stack:
            yield env
