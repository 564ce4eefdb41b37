"""Hung dependencies, with real processes (issue 14, acceptance 3).

A production-style stack per test: `tokenmill gateway` and `tokenmill control-plane` (the
ledger and worker-lifetime consumers) against a real PostgreSQL and a Redis this test
starts itself, a real SmolLM2 worker (`tokenmill worker`), and fake workers that speak the
real protocol but hang (tests/e2e/fake_worker.py). The timeouts are set short through the
environment, as an operator would. The client is the official openai SDK.

- A worker that accepts connections and never answers: beside a healthy worker its
  requests are answered by the healthy one; alone, they end 503/504 within the configured
  timeout. A worker that stalls mid-stream ends the stream with an error event.
- Redis stopped (SIGSTOP) for 10 s and resumed (SIGCONT): requests meanwhile complete or
  fail cleanly within bounded time, and everything works afterwards.
- In each, the ledger holds exactly one usage event per answered request.

And a worker killed with SIGKILL under `tokenmill serve` is declared gone on evidence and its
lifetime row is closed as lost, at its last heartbeat.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.models import UsageEvent
from control_plane.bootstrap import bootstrap
from control_plane.catalog.models import Worker
from tests import databases
from tests.e2e.serve import Server, start_server
from tests.e2e.test_gateway_replicas import RedisServer, _free_port
from tokenmill.db import make_engine, make_sessionmaker
from tokenmill.settings import BUNDLED_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SECRET, INTERNAL = "faults-secret", "faults-internal"
MODEL = "SmolLM2-135M-Instruct"

# The timeouts these tests run with (seconds): short, so that hangs show within the test.
FIRST_BYTE = 3.0
IDLE = 4.0
REDIS_TIMEOUT = 1.0
HEARTBEAT = 1.0  # the default
# After a worker fails before its first token the gateway waits this long for another one.
RETRY_WAIT = 2 * HEARTBEAT


@dataclass
class Stack:
    tmp: Path
    redis: RedisServer
    db_url: str
    model_cache: Path
    sessionmaker: async_sessionmaker[AsyncSession]
    key: str = ""
    deployment_id: str = ""
    gateway: str = ""
    control_plane: str = ""  # its admin API
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "DATABASE_URL": self.db_url,
            "REDIS_URL": self.redis.url,
            "TOKENMILL_SECRET_KEY": SECRET,
            "TOKENMILL_INTERNAL_TOKEN": INTERNAL,
            "TOKENMILL_HOME": str(self.tmp / "home"),
            "TOKENMILL_MODEL_CACHE": str(self.model_cache),
            "TOKENMILL_LOG_LEVEL": "INFO",
            "TOKENMILL_UPSTREAM_FIRST_BYTE_TIMEOUT_SECONDS": str(FIRST_BYTE),
            "TOKENMILL_UPSTREAM_IDLE_TIMEOUT_SECONDS": str(IDLE),
            "TOKENMILL_REDIS_TIMEOUT_SECONDS": str(REDIS_TIMEOUT),
            "TOKENMILL_WORKER_WAIT_SECONDS": "20",
            # every other request goes to the hung worker first when there are two
            "TOKENMILL_ROUTING": "round_robin",
            "TOKENMILL_TORCH_THREADS": "1",
            "TOKENMILL_KV_CACHE_GIB": "0.25",
            **extra,
        }

    def spawn(self, name: str, args: list[str], **env: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(
            [sys.executable, *args], env=self.env(**env), cwd=ROOT, stdout=log, stderr=log
        )
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log")
        )

    def start_real_worker(self, worker_id: str) -> subprocess.Popen[bytes]:
        return self.spawn(
            worker_id,
            ["-m", "tokenmill.cli", "worker", "--model", BUNDLED_MODEL, "--deployment", self.deployment_id,
             "--worker-id", worker_id],
        )  # fmt: skip

    def start_fake_worker(self, worker_id: str, *fault: str) -> Path:
        """A fake worker with `fault` (`--hang`, `--stall-after N`); returns its request log."""
        log = self.tmp / f"{worker_id}.requests"
        log.touch()
        self.spawn(
            worker_id,
            ["-m", "tests.e2e.fake_worker", "--redis", self.redis.url, "--deployment", self.deployment_id,
             "--port", str(_free_port()), "--token", INTERNAL, "--id", worker_id, "--log", str(log), *fault],
        )  # fmt: skip
        return log

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.gateway}/v1", api_key=self.key, max_retries=0, timeout=120)

    async def workers_routed(self) -> int:
        async with httpx.AsyncClient(timeout=5) as c:
            return int((await c.get(f"{self.gateway}/health")).json().get("workers", 0))

    async def wait_for_workers(self, n: int, within: float = 180) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                if await self.workers_routed() >= n:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the gateway never saw {n} workers\n{self.logs()}"
            await asyncio.sleep(0.3)

    async def ledger(self, request_ids: list[str], wait: float = 90) -> dict[str, list[UsageEvent]]:
        """The usage events of `request_ids`, once each has one (or `wait` has passed)."""
        deadline = time.monotonic() + wait
        while True:
            async with self.sessionmaker() as s:
                rows = (
                    await s.scalars(select(UsageEvent).where(UsageEvent.request_id.in_(request_ids)))
                ).all()
            found: dict[str, list[UsageEvent]] = {}
            for row in rows:
                found.setdefault(row.request_id, []).append(row)
            if len(found) == len(set(request_ids)) or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.5)


@pytest.fixture
async def stack(tmp_path: Path, pg_url: str, model_cache: Path) -> AsyncIterator[Stack]:
    rs = RedisServer(tmp_path)
    rs.start()
    await asyncio.to_thread(databases.migrate, pg_url)
    engine = make_engine(pg_url)
    st = Stack(tmp_path, rs, pg_url, model_cache, make_sessionmaker(engine))
    boot = await bootstrap(
        st.sessionmaker,
        secret_key=SECRET,
        model_name=MODEL,
        model_source=BUNDLED_MODEL,
        model_format="gguf",
        context_length=8192,
    )
    assert boot.admin_secret
    st.key, st.deployment_id = boot.admin_secret, boot.deployment.id
    port = _free_port()
    st.spawn("gateway", ["-m", "tokenmill.cli", "gateway"], TOKENMILL_PORT=str(port))
    st.gateway = f"http://127.0.0.1:{port}"
    admin_port = _free_port()
    st.spawn("control-plane", ["-m", "tokenmill.cli", "control-plane"], TOKENMILL_PORT=str(admin_port))
    st.control_plane = f"http://127.0.0.1:{admin_port}"
    try:
        yield st
    finally:
        if rs.proc is not None and rs.proc.poll() is None:
            rs.proc.send_signal(signal.SIGCONT)  # never leave it stopped
        for p in st.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in st.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        rs.kill()
        await engine.dispose()


@dataclass
class Outcome:
    status: int
    request_id: str
    seconds: float
    body: Any = None


async def chat(stack: Stack, prompt: str, *, stream: bool = False) -> Outcome:
    """One chat request through the SDK: its status, request id and duration."""
    started = time.monotonic()
    args: dict[str, Any] = dict(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
    )
    async with stack.client() as client:
        try:
            if stream:
                raw = await client.chat.completions.with_raw_response.create(**args, stream=True)
                chunks = [c async for c in raw.parse()]  # `with_raw_response` parses synchronously
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                return Outcome(raw.status_code, raw.headers["x-request-id"], time.monotonic() - started, text)
            raw = await client.chat.completions.with_raw_response.create(**args)
            reply = raw.parse()
            return Outcome(raw.status_code, raw.headers["x-request-id"], time.monotonic() - started, reply)
        except openai.APIStatusError as exc:
            # an OpenAI error body, never a traceback or an empty page
            assert isinstance(exc.body, dict) and exc.body.get("message"), exc.response.text
            return Outcome(
                exc.status_code,
                exc.response.headers.get("x-request-id", ""),
                time.monotonic() - started,
                exc.body,
            )


async def assert_metered_once(stack: Stack, outcomes: list[Outcome]) -> None:
    """Exactly one usage event, with status ok, per answered (200) request."""
    answered = [o.request_id for o in outcomes if o.status == 200]
    assert answered and all(answered)
    found = await stack.ledger(answered)
    missing = [r for r in answered if r not in found]
    assert not missing, f"answered but not metered: {missing}\n{stack.logs()}"
    for request_id in answered:
        assert [e.status for e in found[request_id]] == ["ok"], request_id


# --- a worker that accepts connections and never answers -----------------------------------------


async def test_a_hung_worker_is_bypassed_and_alone_ends_in_a_timely_error(stack: Stack) -> None:
    hung = stack.start_fake_worker("hung", "--hang")
    await stack.wait_for_workers(1)

    # Alone: each request waits out the first-byte timeout, finds no other worker, and ends
    # with a clean 503/504.
    alone = [await chat(stack, f"Alone {i}?") for i in range(2)]
    for o in alone:
        assert o.status in (503, 504), o
        assert o.seconds < FIRST_BYTE + RETRY_WAIT + 5, o
        assert o.seconds >= FIRST_BYTE  # it did wait for the worker, for that long
    assert len(hung.read_text().split()) >= 2  # the hung worker did get them

    # Beside a healthy worker: every request is answered, those sent to the hung one first
    # after one first-byte timeout.
    stack.start_real_worker("real-1")
    await stack.wait_for_workers(2)
    before = len(hung.read_text().split())
    answered = [await chat(stack, f"Name a colour, number {i}.", stream=i % 3 == 0) for i in range(8)]
    for o in answered:
        assert o.status == 200, o
        assert o.seconds < FIRST_BYTE + 30, o
    assert len(hung.read_text().split()) - before >= 2, "round robin never tried the hung worker"
    # concurrent requests too
    concurrent = await asyncio.gather(*(chat(stack, f"Count to {i}.") for i in range(6)))
    assert [o.status for o in concurrent] == [200] * 6, concurrent

    await assert_metered_once(stack, alone + answered + concurrent)


async def test_a_stream_that_stalls_ends_with_an_error_event(stack: Stack) -> None:
    stack.start_fake_worker("staller", "--stall-after", "2")
    await stack.wait_for_workers(1)
    started = time.monotonic()
    got: list[str] = []
    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Go on."}], max_tokens=16, stream=True
        )
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                got += [c.delta.content or "" for c in chunk.choices]
    assert "".join(got) == "t0 t1 "  # the two deltas it sent, then the error event
    assert "worker" in str(caught.value.message).lower(), caught.value
    assert time.monotonic() - started < IDLE + 5


# --- Redis stopped and resumed -----------------------------------------------------------------


async def test_requests_survive_redis_stopped_for_10_seconds(stack: Stack) -> None:
    stack.start_real_worker("real-1")
    await stack.wait_for_workers(1)
    warm = [await chat(stack, f"Warm up {i}.") for i in range(3)]
    assert [o.status for o in warm] == [200] * 3, warm

    assert stack.redis.proc is not None
    during: list[Outcome] = []

    async def client_loop(n: int) -> None:
        i = 0
        while not stopped_done.is_set():
            during.append(await chat(stack, f"During the outage, client {n} request {i}."))
            i += 1

    stopped_done = asyncio.Event()
    stack.redis.proc.send_signal(signal.SIGSTOP)
    clients = [asyncio.create_task(client_loop(n)) for n in range(2)]
    try:
        await asyncio.sleep(10)
    finally:
        stack.redis.proc.send_signal(signal.SIGCONT)
        stopped_done.set()
    resumed_at = time.monotonic()
    await asyncio.gather(*clients)

    assert during, "no request was sent while Redis was stopped"
    # Each ended cleanly (a 200, or an OpenAI error body checked in `chat`) and none hung: a
    # request waits at most for its Redis calls to time out (admission, settling, the usage
    # event, which is spooled) around its generation.
    bound = 4 * REDIS_TIMEOUT + 2.0 + 10
    for o in during:
        assert o.status == 200 or 400 <= o.status < 600, o
        assert o.seconds < bound, (o, stack.logs())
    assert all(o.status != 500 for o in during), during
    assert time.monotonic() - resumed_at < bound + 5  # the last ones ended soon after SIGCONT

    # Everything works after SIGCONT: the gateway's Redis client reconnects, the worker's
    # heartbeats and the ledger consumer resume.
    after = [await chat(stack, f"After the outage {i}.") for i in range(4)]
    assert [o.status for o in after] == [200] * 4, after
    assert await stack.workers_routed() == 1
    async with stack.sessionmaker() as s:  # the worker was never declared gone
        statuses = (await s.scalars(select(Worker.status).where(Worker.id == "real-1"))).all()
    assert statuses == ["running"]

    await assert_metered_once(stack, warm + during + after)
    # and the outage was real: the gateway spooled usage events meanwhile
    assert "spool: the bus is unreachable" in (stack.tmp / "gateway.log").read_text(), stack.logs()


# --- a worker killed with SIGKILL ---------------------------------------------------------------

SERVE_ENV = {
    "TOKENMILL_EMBED_MODEL": "",
    "TOKENMILL_TORCH_THREADS": "1",
    "TOKENMILL_KV_CACHE_GIB": "0.25",
    "TOKENMILL_AUTOSCALE_INTERVAL_SECONDS": "0.5",
    "TOKENMILL_SCHEDULER": "false",
}


@pytest.fixture
def server(tmp_path: Path, model_cache: Path) -> Iterator[Server]:
    s = start_server(tmp_path, model_cache, SERVE_ENV)
    yield s
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(60)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()


def _worker_rows(server: Server) -> list[tuple[str, str, str | None, str | None]]:
    with sqlite3.connect(f"file:{server.home / 'tokenmill.db'}?mode=ro", uri=True, timeout=30) as db:
        return db.execute(
            "SELECT id, status, last_seen_at, stopped_at FROM workers ORDER BY started_at"
        ).fetchall()


def test_a_worker_killed_with_sigkill_gets_its_lifetime_closed(server: Server) -> None:
    workers = [pid for pid in server.children() if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 1, workers
    assert (
        server.client()
        .chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        .choices
    )
    (victim_id, status, _, _), *_ = _worker_rows(server)
    assert status == "running"
    os.kill(workers[0], signal.SIGKILL)
    killed_at = datetime.now(UTC)

    deadline = time.monotonic() + 60
    while True:  # declared gone after the heartbeat timeout (3 s), then recorded
        rows = {r[0]: r for r in _worker_rows(server)}
        if rows[victim_id][1] != "running":
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.5)
    _, status, last_seen, stopped = rows[victim_id]
    assert status == "lost"
    assert stopped is not None and stopped == last_seen  # stopped at its last heartbeat
    stopped_at = datetime.fromisoformat(stopped).replace(tzinfo=UTC)
    # its last heartbeat came at most a beat (plus scheduling) before the kill, never after
    assert 0 <= (killed_at - stopped_at).total_seconds() < 3 * HEARTBEAT
    assert "stopped sending heartbeats: replacing it" in "\n".join(server.lines)
    # and it was replaced by a new worker, whose lifetime is open
    deadline = time.monotonic() + 120
    while not any(r[1] == "running" for r in _worker_rows(server)):
        assert time.monotonic() < deadline, _worker_rows(server)
        time.sleep(0.5)
    assert (
        server.client()
        .chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi again"}], max_tokens=4
        )
        .choices
    )
