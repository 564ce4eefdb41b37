"""The periodic billing jobs: one schedule, run by Celery beat + a real Celery worker
(production) and by the in-process scheduler of `tokenmill serve` (embedded mode)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from celery.schedules import maybe_schedule
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing import celery_app as capp
from billing.models import Invoice, InvoiceLine, UsageRollup
from billing.schedule import (
    Cron,
    Every,
    InProcessScheduler,
    Job,
    JobContext,
    jobs,
    next_month,
    previous_month,
)
from control_plane.orgs.models import Organization
from tests.billing.billing_world import JAN, World, add_model_price, add_usage, make_world
from tests.billing.billing_world import t as wt
from tests.billing.fake_stripe import API_KEY, FakeStripe
from tokenmill.db import make_engine, make_sessionmaker
from tokenmill.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _t(s: str) -> datetime:
    return datetime.fromisoformat(s).replace(tzinfo=UTC)


# --- the schedule definition --------------------------------------------------------------


def test_cron_next_run_times() -> None:
    hourly, daily, monthly = Cron(minute=5), Cron(minute=30, hour=0), Cron(minute=30, hour=0, day=1)
    assert hourly.next_after(_t("2026-03-31 23:04:59")) == _t("2026-03-31 23:05")
    assert hourly.next_after(_t("2026-03-31 23:05")) == _t("2026-04-01 00:05")  # strictly after
    assert daily.next_after(_t("2026-02-28 00:30")) == _t("2026-03-01 00:30")
    assert daily.next_after(_t("2026-02-28 00:29")) == _t("2026-02-28 00:30")
    assert monthly.next_after(_t("2026-01-15 12:00")) == _t("2026-02-01 00:30")
    assert monthly.next_after(_t("2026-12-01 00:30")) == _t("2027-01-01 00:30")
    assert monthly.next_after(_t("2026-12-01 00:29")) == _t("2026-12-01 00:30")
    assert Every(900).next_after(_t("2026-01-01 10:07")) == _t("2026-01-01 10:22")
    with pytest.raises(ValueError):
        Cron(minute=0, hour=0, day=31)  # not every month has one


def test_month_helpers() -> None:
    assert next_month(_t("2026-12-31 23:00").date()) == _t("2027-01-01 00:00").date()
    assert previous_month(_t("2026-01-01 00:00").date()) == _t("2025-12-01 00:00").date()
    assert previous_month(_t("2026-03-31 00:00").date()) == _t("2026-02-01 00:00").date()


def test_default_schedule_from_settings() -> None:
    settings = Settings(rollup_minute=7, invoice_hour=1, invoice_minute=15, stripe_sync_minutes=10)
    by_name = {job.name: job for job in jobs(settings)}
    assert by_name["rollup_hours"].trigger == Cron(minute=7)
    assert by_name["invoices"].trigger == Cron(minute=15, hour=1)
    assert by_name["finalize_invoices"].trigger == Cron(minute=15, hour=1, day=1)
    # A lost finalization message would skip a month: it never expires. The others do,
    # since the next run redoes their work.
    assert by_name["finalize_invoices"].expires is None
    assert all(j.expires for j in by_name.values() if j.name != "finalize_invoices")
    assert by_name["stripe_sync"].trigger == Every(600)
    assert "stripe_sync" not in {j.name for j in jobs(Settings(stripe_sync_minutes=0))}


def test_beat_and_the_in_process_scheduler_agree() -> None:
    """Beat computes next runs with Celery's own schedule classes; they must land exactly
    where `Trigger.next_after` (what the in-process scheduler uses) does."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0")
    app = capp.make_celery(settings)
    schedule = app.conf.beat_schedule
    job_list = jobs(settings)
    assert set(schedule) == {j.name for j in job_list}
    samples = [_t("2026-01-30 21:00") + timedelta(minutes=37 * i + i % 3) for i in range(3000)]
    samples += [_t("2026-02-28 23:05"), _t("2026-12-31 23:59:59"), _t("2027-01-01 00:30")]
    for job in job_list:
        entry = schedule[job.name]
        assert entry["task"] == f"billing.{job.name}" and entry["task"] in app.tasks
        celery_sched = maybe_schedule(entry["schedule"], app=app)
        for t in samples:
            celery_sched.nowfun = lambda t=t: t
            expected = t + celery_sched.remaining_estimate(t)
            assert job.trigger.next_after(t) == expected, (job.name, t)


def test_celery_configuration() -> None:
    settings = Settings(redis_url="redis://r:6379/0", job_time_limit_seconds=900)
    conf = capp.make_celery(settings).conf
    assert conf.broker_url == conf.result_backend == "redis://r:6379/0"
    assert conf.task_serializer == conf.result_serializer == "json" and conf.accept_content == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert (conf.task_time_limit, conf.task_soft_time_limit) == (900, 840)
    assert conf.broker_transport_options["visibility_timeout"] > conf.task_time_limit
    own = capp.make_celery(Settings(redis_url="redis://r:6379/0", celery_broker_url="redis://b:6379/3")).conf
    assert own.broker_url == own.result_backend == "redis://b:6379/3"


# --- transient errors and retries -------------------------------------------------------


async def test_transient_errors_are_told_apart(pg_url: str) -> None:
    from sqlalchemy import exc as sa
    from sqlalchemy import text

    # Real failures, as a job would see them: a refused connection...
    engine = make_engine("postgresql+asyncpg://u@127.0.0.1:1/none")
    try:
        with pytest.raises(Exception) as refused:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
    finally:
        await engine.dispose()
    assert capp.is_transient(refused.value)
    # ... a connection the server dropped mid-job (a restart, a failover) ...
    engine = make_engine(pg_url)
    try:
        async with engine.connect() as victim, engine.connect() as killer:
            pid = await victim.scalar(text("SELECT pg_backend_pid()"))
            await killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            with pytest.raises(sa.DBAPIError) as dropped:
                await victim.execute(text("SELECT 1"))
        # ... and a bug in the data or the query, which retrying cannot fix.
        async with engine.connect() as conn:
            with pytest.raises(sa.DBAPIError) as bad:
                await conn.execute(text("SELECT 1 / 0"))
    finally:
        await engine.dispose()
    assert capp.is_transient(dropped.value)
    assert not capp.is_transient(bad.value)
    assert capp.is_transient(sa.OperationalError("x", {}, Exception("database is locked")))
    assert not capp.is_transient(sa.IntegrityError("x", {}, Exception("duplicate key")))
    assert not capp.is_transient(ValueError("bad month"))
    assert not capp.is_transient(FileNotFoundError("x"))


async def test_task_retries_a_transient_failure_on_the_same_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[datetime, dict[str, Any]]] = []

    async def flaky(ctx: JobContext, now: datetime, **params: Any) -> dict[str, Any]:
        seen.append((now, params))
        if len(seen) < 6:  # more retries than Celery's default limit (3)
            raise ConnectionRefusedError("database restarting")
        return {"ok": True, "now": now}

    async def broken(ctx: JobContext, now: datetime, **params: Any) -> None:
        seen.append((now, params))
        raise ValueError("a bug, not an outage")

    settings = Settings(redis_url="redis://127.0.0.1:1/0", database_url=f"sqlite:///{tmp_path}/x.db")
    app = capp.make_celery(settings)
    flaky_task = capp.register_job(app, settings, "flaky", flaky)
    broken_task = capp.register_job(app, settings, "broken", broken)
    monkeypatch.setattr(capp, "RETRY_BASE_SECONDS", 0)
    # Eager apply() runs retries inline; in a thread, as the task makes its own event loop.
    result = await asyncio.to_thread(flaky_task.apply, kwargs={"now": "2026-03-01T00:30:00", "org": "o1"})
    assert result.get() == {"ok": True, "now": "2026-03-01T00:30:00Z"}  # JSON-safe result
    assert seen == [(_t("2026-03-01 00:30"), {"org": "o1"})] * 6  # same window every time

    seen.clear()
    result = await asyncio.to_thread(broken_task.apply)
    assert isinstance(result.result, ValueError) and len(seen) == 1  # not retried

    async def down(ctx: JobContext, now: datetime, **params: Any) -> None:
        seen.append((now, params))
        raise ConnectionRefusedError("still down")

    seen.clear()
    result = await asyncio.to_thread(capp.register_job(app, settings, "down", down).apply)
    assert isinstance(result.result, ConnectionRefusedError)
    assert len(seen) == 1 + capp.MAX_RETRIES  # then it gives up


# --- the in-process scheduler -----------------------------------------------------------


class Stop(Exception):
    pass


class FakeClock:
    """Wall clock that moves only when the scheduler sleeps; stops the run at `end`."""

    def __init__(self, start: datetime, end: datetime) -> None:
        self.now, self.end = start, end
        self.sleeps: list[float] = []

    def __call__(self) -> datetime:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += timedelta(seconds=seconds)
        if self.now > self.end:
            raise Stop
        await asyncio.sleep(0)


def _recording_job(name: str, trigger: Any, calls: list[tuple[str, datetime]], fail: int = 0) -> Job:
    failures = [fail]

    async def run(ctx: JobContext, now: datetime) -> str:
        calls.append((name, now))
        if failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError(f"{name} broke")
        return "ok"

    return Job(name, trigger, run)


async def _run_until_stop(sched: InProcessScheduler) -> None:
    with pytest.raises(Stop):
        await sched.run()


async def test_scheduler_runs_jobs_at_their_times_in_order(tmp_path: Path) -> None:
    calls: list[tuple[str, datetime]] = []
    clock = FakeClock(_t("2026-01-31 22:50"), _t("2026-02-01 01:40"))
    sched = InProcessScheduler(
        Settings(),
        None,  # type: ignore[arg-type]  # the recording jobs touch no database
        job_list=[
            _recording_job("hourly", Cron(minute=5), calls),
            _recording_job("daily", Cron(minute=30, hour=0), calls),
            _recording_job("monthly", Cron(minute=30, hour=0, day=1), calls),
            _recording_job("every", Every(1800), calls),
        ],
        state_path=tmp_path / "state.json",
        clock=clock,
        sleep=clock.sleep,
    )
    await _run_until_stop(sched)
    assert calls == [
        ("hourly", _t("2026-01-31 23:05")),
        ("every", _t("2026-01-31 23:20")),
        ("every", _t("2026-01-31 23:50")),
        ("hourly", _t("2026-02-01 00:05")),
        ("every", _t("2026-02-01 00:20")),
        ("daily", _t("2026-02-01 00:30")),  # same moment: list order
        ("monthly", _t("2026-02-01 00:30")),
        ("every", _t("2026-02-01 00:50")),
        ("hourly", _t("2026-02-01 01:05")),
        ("every", _t("2026-02-01 01:20")),
    ]
    assert max(clock.sleeps) <= 60.0  # wakes up at least every minute (suspend, clock jumps)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["monthly"] == "2026-02-01T00:30:00+00:00"


async def test_scheduler_catches_up_a_missed_run_once(tmp_path: Path) -> None:
    """Like beat: a run missed while the server was down happens once at the next start;
    a first start (no state) runs nothing at once."""
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"hourly": "2026-03-10T02:05:00+00:00"}))
    calls: list[tuple[str, datetime]] = []
    clock = FakeClock(_t("2026-03-10 09:41"), _t("2026-03-10 10:06"))
    sched = InProcessScheduler(
        Settings(),
        None,  # type: ignore[arg-type]
        job_list=[_recording_job("hourly", Cron(minute=5), calls), _recording_job("new", Cron(0), calls)],
        state_path=state,
        clock=clock,
        sleep=clock.sleep,
    )
    await _run_until_stop(sched)
    assert calls == [
        ("hourly", _t("2026-03-10 09:41")),  # the catch-up, once for seven missed hours
        ("new", _t("2026-03-10 10:00")),
        ("hourly", _t("2026-03-10 10:05")),
    ]


async def test_scheduler_logs_failures_and_retries_with_backoff(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[tuple[str, datetime]] = []
    clock = FakeClock(_t("2026-02-01 00:29"), _t("2026-02-01 01:10"))
    state = tmp_path / "state.json"
    sched = InProcessScheduler(
        Settings(),
        None,  # type: ignore[arg-type]
        job_list=[
            _recording_job("monthly", Cron(minute=30, hour=0, day=1), calls, fail=3),
            _recording_job("hourly", Cron(minute=5), calls),
        ],
        state_path=state,
        clock=clock,
        sleep=clock.sleep,
    )
    with caplog.at_level(logging.ERROR, logger="tokenmill.billing.schedule"):
        await _run_until_stop(sched)
    assert calls == [
        ("monthly", _t("2026-02-01 00:30")),  # fails
        ("monthly", _t("2026-02-01 00:31")),  # fails: retried after 1 min
        ("monthly", _t("2026-02-01 00:33")),  # fails: after 2 min
        ("monthly", _t("2026-02-01 00:37")),  # succeeds: after 4 min
        ("hourly", _t("2026-02-01 01:05")),  # the other job was never held up
    ]
    assert [r.getMessage() for r in caplog.records] == ["billing job monthly failed"] * 3
    assert json.loads(state.read_text())["monthly"] == "2026-02-01T00:37:00+00:00"


async def test_scheduler_time_limit_and_stop(tmp_path: Path) -> None:
    """A hung job is cut off at the time limit (logged as a failure); `stop()` ends the loop."""
    started = asyncio.Event()

    async def hang(ctx: JobContext, now: datetime) -> None:
        started.set()
        await asyncio.sleep(3600)

    settings = Settings()
    settings.job_time_limit_seconds = 0.2  # type: ignore[assignment]  # the field's minimum is for users
    sched = InProcessScheduler(settings, None, job_list=[Job("hang", Every(0.01), hang)])  # type: ignore[arg-type]
    ok = await sched.run_job(sched.jobs[0], datetime.now(UTC))
    assert ok is False
    await sched.start()
    await asyncio.wait_for(started.wait(), 5)
    await sched.stop()  # cancels the job under way, without hanging


async def test_serve_app_runs_the_scheduler(tmp_path: Path) -> None:
    """`Parts(scheduler=True)` (what `serve` sets) starts the scheduler with the app and stops it with it."""
    from litestar.testing import AsyncTestClient

    from tokenmill.app import Parts, create_app
    from tokenmill.db import make_engine

    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path}/tm.db")
    app = create_app(settings, make_engine(settings.db_url), Parts(scheduler=True))
    sched = app.state.scheduler
    assert isinstance(sched, InProcessScheduler)
    assert [j.name for j in sched.jobs] == [j.name for j in jobs(settings)]
    async with AsyncTestClient(app):
        await asyncio.sleep(0.05)
        assert sched._task is not None and not sched._task.done()
    assert sched._task is None
    assert "scheduler" not in create_app(settings, make_engine(settings.db_url), Parts()).state


# --- the CLI --------------------------------------------------------------------------------


def test_celery_cli_needs_a_broker_and_a_database(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.pop("TOKENMILL_CELERY_BROKER_URL", None)
    env["TOKENMILL_HOME"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "celery", "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "DATABASE_URL" in out.stderr and "REDIS_URL" in out.stderr


# --- the real jobs: a world with a month of usage -------------------------------------------

# January 2025 (billing_world's month): org A on the small model, org B on the big one.
# Prices make whole cents: small 1.00 / 0.50 / 2.00 and big 3.00 / 1.00 / 6.00 per million
# input / cached input / output tokens.
USAGE_PLAN = [  # (org, model, day, hour, prompt, cached, output)
    ("a", "small", 1, 0, 400_000, 100_000, 50_000),
    ("a", "small", 1, 1, 600_000, 0, 150_000),
    ("a", "small", 1, 2, 250_000, 250_000, 0),
    ("b", "big", 1, 1, 100_000, 0, 100_000),
    ("b", "big", 31, 23, 200_000, 0, 0),  # the month's last hour
]
EXPECTED_TOTALS = {
    # A: input (400k-100k + 600k) x 1 + cached (100k + 250k) x 0.5 + output 200k x 2 = 0.90 + 0.175 + 0.40
    "a": Decimal("1.48"),  # lines rounded half-even: 0.90 + 0.18 + 0.40
    # B: input 300k x 3 + output 100k x 6 = 0.90 + 0.60
    "b": Decimal("1.50"),
}


async def _seed(sm: async_sessionmaker[AsyncSession]) -> World:
    world = await make_world(sm)
    async with sm() as s, s.begin():  # Stripe: A's invoices are mirrored, B's usage is metered
        for org, mode in ((world.org_a, "invoices"), (world.org_b, "meters")):
            await s.execute(update(Organization).where(Organization.id == org).values(billing_mode=mode))
    await add_model_price(sm, world.small, JAN - timedelta(days=30), "1.00", "0.50", "2.00")
    await add_model_price(sm, world.big, JAN - timedelta(days=30), "3.00", "1.00", "6.00")
    orgs = {"a": world.org_a, "b": world.org_b}
    deps = {"small": (world.small_dep, "small-model"), "big": (world.big_dep, "big-model")}
    rows = [
        world.usage(orgs[o], deps[m][0], wt(day, hour, 17), prompt, cached, output, model=deps[m][1])
        for o, m, day, hour, prompt, cached, output in USAGE_PLAN
    ]
    await add_usage(sm, rows)
    return world


async def _snapshot(sm: async_sessionmaker[AsyncSession]) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the derived tables, every column: equal snapshots mean nothing was written."""
    out = {}
    async with sm() as s:
        for model in (UsageRollup, Invoice, InvoiceLine):
            cols = list(model.__table__.columns)
            rows = (await s.execute(select(*cols).order_by(*cols))).all()
            out[model.__tablename__] = [tuple(r) for r in rows]
    return out


async def _invoice_totals(
    sm: async_sessionmaker[AsyncSession], world: World
) -> dict[str, tuple[str, Decimal]]:
    names = {world.org_a: "a", world.org_b: "b"}
    async with sm() as s:
        rows = (await s.execute(select(Invoice.org_id, Invoice.status, Invoice.total))).all()
    return {names[org]: (status, total) for org, status, total in rows}


def _celery_redis(redis_url: str) -> str:
    """A database index of our own on the test Redis: the queue is nobody else's business."""
    base, _, db = redis_url.rpartition("/")
    return f"{base}/13" if db.isdigit() else redis_url


def start_celery_worker(env: dict[str, str], cwd: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """A real `tokenmill celery worker` (prefork, one child, as in production) with `env`, its
    output in `log_path`."""
    with log_path.open("wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "celery", "worker", "--pool=prefork", "--concurrency=1",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel=INFO",
             f"--hostname=test-{os.getpid()}@%h"],
            env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so teardown reaches the pool children
        )  # fmt: skip


def stop_celery_worker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # warm shutdown: the child finishes, then all exit
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything left of the group, the children too
    proc.wait()


@pytest.fixture
def fake_stripe() -> Iterator[FakeStripe]:
    with FakeStripe() as fake:
        yield fake


@pytest.fixture
def celery_worker(
    pg_url: str, redis_url: str, tmp_path: Path, fake_stripe: FakeStripe
) -> Iterator[dict[str, Any]]:
    """A real `tokenmill celery worker` (prefork, one child, as in production) on the test's
    PostgreSQL database, migrated, with Redis as broker and result backend, and the fake
    Stripe as Stripe."""
    from tests import databases

    with ThreadPoolExecutor(1) as pool:  # migrate() runs its own event loop
        pool.submit(databases.migrate, pg_url).result()
    broker = _celery_redis(redis_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env.update(
        DATABASE_URL=pg_url,
        REDIS_URL=broker,
        TOKENMILL_HOME=str(tmp_path / "home"),
        TOKENMILL_STRIPE_API_KEY=API_KEY,
        TOKENMILL_STRIPE_API_BASE=fake_stripe.url,
        PYTHONPATH=str(ROOT),
    )
    env.pop("TOKENMILL_CELERY_BROKER_URL", None)
    log_path = tmp_path / "worker.log"
    proc = start_celery_worker(env, tmp_path, log_path)
    client = capp.make_celery(Settings(redis_url=broker, database_url=pg_url, home=tmp_path / "home"))
    try:
        yield {
            "app": client,
            "proc": proc,
            "log": log_path,
            "home": tmp_path / "home",
            "pg_url": pg_url,
            "env": env,
        }
    finally:
        client.close()
        stop_celery_worker(proc)


async def _through_worker(worker: dict[str, Any], task: str, **kwargs: Any) -> Any:
    """Send `task` to the real worker and wait for its result (failing fast if the worker died)."""
    result = worker["app"].send_task(task, kwargs=kwargs)
    deadline = time.monotonic() + 60
    try:
        while not await asyncio.to_thread(result.ready):
            if worker["proc"].poll() is not None:
                pytest.fail(f"celery worker exited:\n{worker['log'].read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{task} not done in 60 s; worker log:\n{worker['log'].read_text()[-3000:]}")
            await asyncio.sleep(0.1)
        return await asyncio.to_thread(result.get, timeout=5)
    finally:
        # Unsubscribed from its result now, not whenever the garbage collector gets to it: that
        # may be after the session stopped Redis (then Celery retries for 20 s, and warns).
        await asyncio.to_thread(result.forget)


async def test_jobs_run_through_a_real_celery_worker(
    celery_worker: dict[str, Any], fake_stripe: FakeStripe
) -> None:
    engine = make_engine(celery_worker["pg_url"])
    sm = make_sessionmaker(engine)
    try:
        world = await _seed(sm)

        # The hourly rollup as beat sends it at 03:05 on the 1st: the last three full hours.
        stats = await _through_worker(celery_worker, "billing.rollup_hours", now="2025-01-01T03:05:00Z")
        assert (stats["start"], stats["end"]) == ("2025-01-01T00:00:00Z", "2025-01-01T03:00:00Z")
        async with sm() as s:
            hours = (await s.execute(select(UsageRollup.hour, UsageRollup.meter, UsageRollup.quantity))).all()
        assert {h for h, _, _ in hours} == {wt(1, 0), wt(1, 1), wt(1, 2)}  # day 31 not yet
        assert sum(q for _, m, q in hours if m == "output") == 50_000 + 150_000 + 100_000
        before = await _snapshot(sm)
        again = await _through_worker(celery_worker, "billing.rollup_hours", now="2025-01-01T03:05:00Z")
        assert (again["inserted"], again["updated"], again["deleted"]) == (0, 0, 0)
        assert await _snapshot(sm) == before

        # Daily drafts in mid-January, then the month's close on February 1st.
        await _through_worker(celery_worker, "billing.invoices", now="2025-01-15T00:30:00Z")
        assert {o: st for o, (st, _) in (await _invoice_totals(sm, world)).items()} == {
            "a": "draft",
            "b": "draft",
        }
        final = await _through_worker(celery_worker, "billing.finalize_invoices", now="2025-02-01T00:30:00Z")
        assert final["month"] == "2025-01" and len(final["finalized"]) == 2
        # Finalizing re-rolled the whole month: the last hour (never rolled up hourly here) is billed.
        assert await _invoice_totals(sm, world) == {
            "a": ("finalized", EXPECTED_TOTALS["a"]),
            "b": ("finalized", EXPECTED_TOTALS["b"]),
        }
        before = await _snapshot(sm)
        for task, now in [
            ("billing.finalize_invoices", "2025-02-01T00:30:00Z"),
            ("billing.invoices", "2025-01-20T00:30:00Z"),  # a late draft run cannot touch them
            ("billing.rollup_hours", "2025-01-01T03:05:00Z"),
        ]:
            await _through_worker(celery_worker, task, now=now)
        assert await _snapshot(sm) == before

        # Stripe sync an hour after the close: A's finalized invoice is mirrored, B's closed
        # hours within Stripe's 30-day window (January 31st, 23:00) go as meter events.
        fake_stripe.clock = _t("2025-02-01 01:00").timestamp  # Stripe's 35-day window for meter events
        stripe = await _through_worker(celery_worker, "billing.stripe_sync", now="2025-02-01T01:00:00Z")
        assert stripe["configured"] and stripe["customers"] == 2 and stripe["invoices"] == 1
        assert stripe["meter_events"] >= 1
        seen = (len(fake_stripe.created("POST", "/v1/invoices")), dict(fake_stripe.meter_events))
        assert seen[0] == 1
        again = await _through_worker(celery_worker, "billing.stripe_sync", now="2025-02-01T01:00:00Z")
        assert (again["customers"], again["invoices"], again["meter_events"]) == (0, 0, 0)
        assert (len(fake_stripe.created("POST", "/v1/invoices")), fake_stripe.meter_events) == seen
        assert len(fake_stripe.created("POST", "/v1/billing/meter_events")) == len(seen[1])

        # An export of the month's ledger into the storage directory.
        out = await _through_worker(
            celery_worker, "billing.export", what="usage", format="csv", start="2025-01", end="2025-02"
        )
        path = celery_worker["home"] / "storage" / out["key"]
        assert out["key"].startswith("exports/usage-all-") and out["bytes"] == path.stat().st_size
        lines = path.read_text().splitlines()
        assert len(lines) == 1 + len(USAGE_PLAN) and lines[0].startswith("request_id,")

        # Bad input fails at once with the API's message, without retries.
        with pytest.raises(Exception, match="month must look like"):
            await _through_worker(celery_worker, "billing.finalize_invoices", month="January")
    finally:
        await engine.dispose()


def test_beat_sends_a_due_job_to_the_worker(celery_worker: dict[str, Any], tmp_path: Path) -> None:
    """`tokenmill celery beat` with its state saying the hourly rollup last ran two hours ago
    (as after a beat outage): it sends the job at once, and the worker runs it."""
    import shelve

    from celery import __version__ as celery_version
    from celery.beat import ScheduleEntry

    home: Path = celery_worker["home"]
    home.mkdir(parents=True, exist_ok=True)
    app = celery_worker["app"]
    with shelve.open(str(home / "celerybeat-schedule")) as store:
        store["entries"] = {
            "rollup_hours": ScheduleEntry(
                name="rollup_hours",
                task="billing.rollup_hours",
                schedule=app.conf.beat_schedule["rollup_hours"]["schedule"],
                last_run_at=datetime.now(UTC) - timedelta(hours=2),
                app=app,
            )
        }
        store.update({"__version__": celery_version, "tz": "UTC", "utc_enabled": True})
    log_path = tmp_path / "beat.log"
    with log_path.open("wb") as log_file:
        beat = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "celery", "beat", "--max-interval=1", "--loglevel=INFO"],
            env=celery_worker["env"], cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=log_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        done = re.compile(r"Task billing\.rollup_hours\[[-0-9a-f]+\] succeeded")
        while not done.search(celery_worker["log"].read_text()):
            assert beat.poll() is None, f"beat exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"nothing sent; beat log:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        assert "Sending due task rollup_hours (billing.rollup_hours)" in log_path.read_text()
    finally:
        beat.send_signal(signal.SIGTERM)
        try:
            beat.wait(timeout=20)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(beat.pid, signal.SIGKILL)
            beat.wait()


async def test_in_process_scheduler_runs_the_real_jobs(
    migrated_db: async_sessionmaker[AsyncSession], tmp_path: Path
) -> None:
    """The embedded mode on a fake clock through the month's close: hourly rollups, then on
    February 1st at 00:30 the drafts and the finalization, as in production."""
    world = await _seed(migrated_db)
    clock = FakeClock(wt(31, 22, 50), wt(32, 0, 40))
    sched = InProcessScheduler(
        Settings(home=tmp_path), migrated_db, state_path=tmp_path / "s.json", clock=clock, sleep=clock.sleep
    )
    await _run_until_stop(sched)
    assert sched.failures == {}
    async with migrated_db() as s:
        hours = set((await s.scalars(select(UsageRollup.hour))).all())
    assert wt(31, 23) in hours  # rolled up at 00:05 on the 1st
    assert await _invoice_totals(migrated_db, world) == {
        "a": ("finalized", EXPECTED_TOTALS["a"]),
        "b": ("finalized", EXPECTED_TOTALS["b"]),
    }
    state = json.loads((tmp_path / "s.json").read_text())
    assert state["finalize_invoices"] == state["invoices"] == wt(32, 0, 30).isoformat()
