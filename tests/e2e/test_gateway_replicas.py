"""Two `tokenmill gateway` processes sharing one Redis and one PostgreSQL, in front of fake
worker processes that speak the real protocol (tests/e2e/fake_worker.py).

- limits hold across replicas (requests/min and tokens/min, with bursts);
- a hard budget holds under 50 concurrent requests and is nearly all spent;
- 2,000 requests while a worker is killed and Redis restarts: the ledger holds exactly
  the completed requests, with the tokens their responses reported.

Redis here keeps an append-only file, as a production bus must: a restart then loses
nothing that was acknowledged. While it is down, gateways spool usage events to disk
and replay them once it is back.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.ledger.services import UsageConsumer
from billing.models import Price, UsageEvent
from control_plane.bootstrap import bootstrap
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.models import ApiKey, Organization
from control_plane.orgs.services import OrganizationService
from control_plane.plans.models import Plan
from tests import databases
from tokenmill.bus import RedisBus
from tokenmill.db import make_engine, make_sessionmaker
from tokenmill.settings import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[2]
SECRET, INTERNAL = "replica-secret", "replica-internal"
MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server with an append-only file, restartable on the same port."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as r:
                    if r.ping():
                        return
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Stack:
    tmp: Path
    redis: RedisServer
    db_url: str
    sessionmaker: async_sessionmaker[AsyncSession]
    model_id: str = ""
    deployment_id: str = ""
    gateways: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DATABASE_URL": self.db_url,
            "REDIS_URL": self.redis.url,
            "TOKENMILL_SECRET_KEY": SECRET,
            "TOKENMILL_INTERNAL_TOKEN": INTERNAL,
            "TOKENMILL_HOME": str(self.tmp / "home"),
            "TOKENMILL_WORKER_TIMEOUT_SECONDS": "3",
            "TOKENMILL_LOG_LEVEL": "WARNING",
        }

    def start_gateway(self, model_cache: Path) -> None:
        port = _free_port()
        env = {**self.env(), "TOKENMILL_PORT": str(port), "TOKENMILL_MODEL_CACHE": str(model_cache)}
        env["TOKENMILL_SPOOL_DIR"] = str(self.tmp / f"spool-{port}")
        log = open(self.tmp / f"gateway-{port}.log", "wb")  # noqa: SIM115 - lives as long as the process
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tokenmill.cli", "gateway"], env=env, cwd=ROOT, stdout=log, stderr=log
            )
        )
        self.gateways.append(f"http://127.0.0.1:{port}")

    def start_worker(self, i: int) -> None:
        self.workers.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.fake_worker", "--redis", self.redis.url, "--deployment",
                 self.deployment_id, "--port", str(_free_port()), "--token", INTERNAL, "--id", f"fake-{i}",
                 "--seed", str(i)],
                env=self.env(),
                cwd=ROOT,
            )
        )  # fmt: skip

    async def new_key(self, org_name: str, plan: Plan | None = None, **fields: object) -> str:
        async with self.sessionmaker() as s, s.begin():
            org = await OrganizationService(session=s).create_org(org_name)
            if plan is not None:
                s.add(plan)
                await s.flush()
                await s.execute(update(Organization).where(Organization.id == org.id).values(plan_id=plan.id))
            created = await ApiKeyService(session=s).create_key(org_id=org.id, secret_key=SECRET)
            if fields:
                await s.execute(update(ApiKey).where(ApiKey.id == created.key.id).values(**fields))
        return created.secret

    async def ledger(self, org_id: str | None = None) -> list[UsageEvent]:
        async with self.sessionmaker() as s:
            q = select(UsageEvent)
            if org_id:
                q = q.where(UsageEvent.org_id == org_id)
            return list((await s.scalars(q)).all())


@pytest.fixture
async def stack(tmp_path: Path, pg_url: str, model_cache: Path) -> AsyncIterator[Stack]:
    rs = RedisServer(tmp_path)
    rs.start()
    await asyncio.to_thread(databases.migrate, pg_url)
    engine = make_engine(pg_url)
    st = Stack(tmp_path, rs, pg_url, make_sessionmaker(engine))
    boot = await bootstrap(
        st.sessionmaker,
        secret_key=SECRET,
        model_name=MODEL,
        model_source=BUNDLED_MODEL,
        model_format="gguf",
        context_length=8192,
    )
    st.model_id, st.deployment_id = boot.model.id, boot.deployment.id
    for i in range(3):
        st.start_worker(i)
    for _ in range(2):
        st.start_gateway(model_cache)
    bus = RedisBus.from_url(rs.url)
    consumer = UsageConsumer(bus, st.sessionmaker, "test-ledger")
    await consumer.start()
    assert boot.admin_secret
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for url in st.gateways:  # ready: answers, knows a worker, has the tokenizer
                deadline = time.monotonic() + 120
                while True:
                    try:
                        r = await client.post(
                            f"{url}/v1/completions",
                            headers={"authorization": f"Bearer {boot.admin_secret}"},
                            json={"model": MODEL, "prompt": [1, 2], "max_tokens": 1},
                        )
                        if r.status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline, st.tmp / "gateway.log"
                    await asyncio.sleep(0.2)
        yield st
    finally:
        await consumer.stop()
        await bus.close()
        for p in st.procs + st.workers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in st.procs + st.workers:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        rs.kill()
        await engine.dispose()


async def _settle(stack: Stack, org_id: str, n: int, wait: float = 60) -> list[UsageEvent]:
    deadline = time.monotonic() + wait
    while True:
        rows = await stack.ledger(org_id)
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.2)


async def _org_of(stack: Stack, secret: str) -> str:
    async with stack.sessionmaker() as s:
        return (await s.scalars(select(ApiKey.org_id).where(ApiKey.prefix == secret[:11]))).one()


# --- acceptance 2: limits across replicas ---------------------------------------------------


async def _flood(
    stack: Stack, key: str, seconds: float, per_second: float, body: dict
) -> list[httpx.Response]:
    """Requests at `per_second`, alternating between the replicas, for `seconds` from the first."""
    out: list[httpx.Response] = []
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as client:
        pending = []
        for i in itertools.count():
            at = start + i / per_second
            if at - start >= seconds:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            url = stack.gateways[i % len(stack.gateways)]
            pending.append(
                asyncio.create_task(
                    client.post(
                        f"{url}/v1/completions", headers={"authorization": f"Bearer {key}"}, json=body
                    )
                )
            )
        out = list(await asyncio.gather(*pending))
    return out


async def test_limits_hold_across_replicas(stack: Stack) -> None:
    # A prompt of 4 token ids and max_tokens 1 costs exactly 5 tokens, all used (no refund).
    body = {"model": MODEL, "prompt": [11, 12, 13, 14], "max_tokens": 1}
    by_requests = await stack.new_key("rpm-org", requests_per_minute=60, request_burst=10)
    by_tokens = await stack.new_key("tpm-org", tokens_per_minute=60 * 5, token_burst=10 * 5)
    req_rs, tok_rs = await asyncio.gather(
        _flood(stack, by_requests, 60, 8, body), _flood(stack, by_tokens, 60, 8, body)
    )
    for name, rs, kind in (("requests", req_rs, "requests"), ("tokens", tok_rs, "tokens")):
        ok = [r for r in rs if r.status_code == 200]
        refused = [r for r in rs if r.status_code == 429]
        assert len(ok) + len(refused) == len(rs), [r.text for r in rs if r.status_code not in (200, 429)]
        assert 60 <= len(ok) <= 70, (name, len(ok))
        for r in refused:
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and err["type"] == kind
            assert 1 <= int(r.headers["retry-after"]) <= 2
            # fewer units left than this request needs (1 request, or 5 tokens)
            assert int(r.headers[f"x-ratelimit-remaining-{kind}"]) < (1 if kind == "requests" else 5)
        limit = "60" if kind == "requests" else "300"
        assert {r.headers[f"x-ratelimit-limit-{kind}"] for r in rs} == {limit}
        # both replicas answered and refused: one shared budget, not one each
        assert {str(r.request.url).rsplit("/v1", 1)[0] for r in ok} == set(stack.gateways)


# --- acceptance 3: a hard budget under concurrency -------------------------------------------


async def test_hard_budget_is_never_exceeded_and_nearly_spent(stack: Stack) -> None:
    input_price, output_price = Decimal(100), Decimal(200)  # per million tokens
    async with stack.sessionmaker() as s, s.begin():
        s.add(Price(model_id=stack.model_id, input_per_mtok=input_price, output_per_mtok=output_price))
    budget = Decimal("0.50")
    key = await stack.new_key("budget-org", Plan(name="hard-50c", monthly_budget=budget, budget_mode="hard"))
    org_id = await _org_of(stack, key)
    rng = random.Random(7)
    completed = 0

    async def client_loop(client: httpx.AsyncClient, n: int) -> None:
        nonlocal completed
        refusals = 0
        while refusals < 5:
            prompt = [rng.randrange(1, 40000) for _ in range(rng.randrange(8, 25))]
            r = await client.post(
                f"{stack.gateways[n % 2]}/v1/completions",
                headers={"authorization": f"Bearer {key}"},
                json={"model": MODEL, "prompt": prompt, "max_tokens": 16},
            )
            if r.status_code == 200:
                completed += 1
                refusals = 0
            else:
                assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota", r.text
                refusals += 1
                await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=60)) as client:
        await asyncio.gather(*(client_loop(client, n) for n in range(50)))
    rows = await _settle(stack, org_id, completed)
    assert len(rows) == completed > 0
    spent = sum(
        (
            Decimal(r.prompt_tokens - r.cached_tokens) * input_price
            + Decimal(r.completion_tokens) * output_price
        )
        for r in rows
    ) / Decimal(1_000_000)
    assert spent <= budget, spent
    assert spent >= Decimal("0.9") * budget, spent


# --- acceptance 4: nothing lost, nothing doubled ------------------------------------------------


async def test_ledger_is_exact_through_worker_death_and_redis_restart(stack: Stack) -> None:
    key = await stack.new_key("chaos-org", Plan(name="unlimited"))  # a plan without limits
    org_id = await _org_of(stack, key)
    total, concurrency = 2000, 32
    done: dict[str, dict] = {}  # request id -> usage of every completed response
    failures: list[tuple[int, str]] = []
    counter = itertools.count()
    events: dict[str, float] = {}

    async def client_loop(client: httpx.AsyncClient) -> None:
        while (i := next(counter)) < total:
            if i == 400 and "killed" not in events:
                stack.workers[0].send_signal(signal.SIGKILL)
                events["killed"] = time.monotonic()
            if i == 1000 and "redis" not in events:
                events["redis"] = time.monotonic()
                await asyncio.to_thread(stack.redis.kill)
                await asyncio.sleep(0.5)
                await asyncio.to_thread(stack.redis.start)
            try:
                r = await client.post(
                    f"{stack.gateways[i % 2]}/v1/completions",
                    headers={"authorization": f"Bearer {key}"},
                    json={"model": MODEL, "prompt": [i % 1000 + 1, 7, 8], "max_tokens": 12},
                )
            except httpx.HTTPError as exc:
                failures.append((-1, repr(exc)))
                continue
            if r.status_code == 200:
                done[r.headers["x-request-id"]] = r.json()["usage"]
            else:
                assert "error" in r.json(), r.text  # clean OpenAI errors, never a traceback
                failures.append((r.status_code, r.text[:200]))

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    assert len(done) + len(failures) == total
    assert len(failures) <= total * 0.05, failures[:10]
    rows = await _settle(stack, org_id, len(done), wait=90)
    ok = {r.request_id: r for r in rows if r.status == "ok"}
    # every completed request is in the ledger once, with the tokens its response reported
    assert set(ok) == set(done), (len(ok), len(done), len(set(done) - set(ok)), len(set(ok) - set(done)))
    for rid, u in done.items():
        row = ok[rid]
        assert (row.prompt_tokens, row.completion_tokens) == (u["prompt_tokens"], u["completion_tokens"])
    assert sum(r.completion_tokens for r in ok.values()) == sum(u["completion_tokens"] for u in done.values())
    assert len({r.request_id for r in rows}) == len(rows)  # never doubled
    # the outage was real: some gateway had to spool usage events while Redis was down
    logs = "".join(p.read_text(errors="replace") for p in stack.tmp.glob("gateway-*.log"))
    assert "spool: the bus is unreachable" in logs, logs[-2000:]
