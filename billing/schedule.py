"""The periodic billing jobs and when they run: the one schedule that Celery beat
(production, `billing.celery_app`) and the in-process scheduler of `tokenmill serve`
(embedded mode, `InProcessScheduler`) both read.

A job is a plain async function `run(ctx, now, **params)`: `now` is the time the run is
for (the windows it works on are derived from it, so a retried run redoes the same work),
`params` are optional overrides for a manual run (a backfill). Every job is idempotent —
rollups are upserts, invoices are rebuilt from rollups, Stripe calls carry idempotency
keys — so a run that is repeated, retried or redelivered changes nothing.

Times are UTC throughout (Celery is configured with `timezone="UTC"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from billing.common import HOUR, floor_hour, month_bounds
from billing.common import parse_time as parse_param
from billing.exports.services import export_query, stream_export
from billing.jobs import build_invoices, finalize_invoices, rollup_hours
from billing.stripe.services import stripe_sync_job
from control_plane.responses.services import purge_expired as purge_expired_responses
from tokenmill.db import utcnow
from tokenmill.storage import open_storage
from tokenmill.tasks import Background

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    from tokenmill.settings import Settings

log = logging.getLogger("tokenmill.billing.schedule")


# --- triggers ---------------------------------------------------------------------------


class Trigger(Protocol):
    def next_after(self, t: datetime) -> datetime:
        """The first run strictly after `t` (UTC)."""
        ...

    def to_celery(self) -> Any:
        """The same trigger as a Celery beat schedule (`crontab` or `timedelta`)."""
        ...


@dataclass(frozen=True, slots=True)
class Cron:
    """At `minute` past every hour; with `hour`, once a day; with `day` too, once a month."""

    minute: int
    hour: int | None = None
    day: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.minute <= 59 or (self.hour is not None and not 0 <= self.hour <= 23):
            raise ValueError(f"bad time {self.hour}:{self.minute}")
        # Days past the 28th do not exist in every month; the jobs never need them.
        if self.day is not None and (self.hour is None or not 1 <= self.day <= 28):
            raise ValueError("a monthly trigger needs an hour and a day in 1..28")

    def next_after(self, t: datetime) -> datetime:
        t = t.astimezone(UTC)
        if self.hour is None:
            c = t.replace(minute=self.minute, second=0, microsecond=0)
            return c if c > t else c + HOUR
        if self.day is None:
            c = t.replace(hour=self.hour, minute=self.minute, second=0, microsecond=0)
            return c if c > t else c + timedelta(days=1)
        c = t.replace(day=self.day, hour=self.hour, minute=self.minute, second=0, microsecond=0)
        if c > t:
            return c
        first = next_month(t.date())
        return c.replace(year=first.year, month=first.month)

    def to_celery(self) -> Any:
        from celery.schedules import crontab

        return crontab(
            minute=str(self.minute),
            hour="*" if self.hour is None else str(self.hour),
            day_of_month="*" if self.day is None else str(self.day),
        )


@dataclass(frozen=True, slots=True)
class Every:
    """Every `seconds`, counted from the previous run (as beat counts a `timedelta`)."""

    seconds: float

    def next_after(self, t: datetime) -> datetime:
        return t + timedelta(seconds=self.seconds)

    def to_celery(self) -> Any:
        return timedelta(seconds=self.seconds)


# --- jobs -------------------------------------------------------------------------------


@dataclass(slots=True)
class JobContext:
    """What a job runs with: in Celery a fresh engine per task, in `serve` the app's own."""

    settings: Settings
    sessionmaker: async_sessionmaker[AsyncSession]


JobFn = Callable[..., Awaitable[Any]]  # async (ctx: JobContext, now: datetime, **params) -> result


@dataclass(frozen=True, slots=True)
class Job:
    name: str  # also the Celery task name, `billing.<name>`
    trigger: Trigger
    run: JobFn
    # A beat message still queued after this long is dropped: the next run covers its
    # work. None for jobs whose every run matters (month-end finalization).
    expires: float | None = None


@contextlib.asynccontextmanager
async def job_context(settings: Settings) -> AsyncIterator[JobContext]:
    """A context on an engine of its own, disposed at the end.

    Celery runs each task in a fresh `asyncio.run` loop, and asyncpg connections belong to
    the loop that opened them: a pool shared across tasks would hand the next loop a dead
    connection. One connect per task is nothing next to jobs that run hourly.
    """
    from tokenmill.db import make_engine, make_sessionmaker

    engine = make_engine(settings.db_url)
    try:
        yield JobContext(settings, make_sessionmaker(engine))
    finally:
        await engine.dispose()


def parse_time(value: str | datetime) -> datetime:
    """The `now` of a task message (ISO); naive means UTC."""
    t = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def next_month(d: date) -> date:
    return date(d.year + d.month // 12, d.month % 12 + 1, 1)


def previous_month(d: date) -> date:
    return (d.replace(day=1) - timedelta(days=1)).replace(day=1)


# The jobs. Each adapts one function of billing/jobs.py (or stripe/services.py) to the
# schedule: it derives the window from `now`, and takes overrides for a manual run.
# Overrides are parsed like the admin API's parameters (a bad one is a clear 400 error).


async def rollup_recent_hours(
    ctx: JobContext, now: datetime, *, start: str | None = None, end: str | None = None
) -> Any:
    """The last `rollup_lookback_hours` full hours (or [start, end)): more than the one just
    ended, so usage that reached the ledger late (replayed from a spool) is counted too."""
    hi = parse_param(end, "end") if end else floor_hour(now)
    lo = parse_param(start, "start") if start else hi - ctx.settings.rollup_lookback_hours * HOUR
    return await rollup_hours(ctx.sessionmaker, lo, hi)


async def refresh_draft_invoices(ctx: JobContext, now: datetime, *, month: str | None = None) -> Any:
    """This month's drafts, from the rollups so far (so dashboards show a running total)."""
    return await build_invoices(ctx.sessionmaker, month or now)


async def finalize_last_month(ctx: JobContext, now: datetime, *, month: str | None = None) -> Any:
    """Roll up the whole previous month (or `month`) again, then finalize its invoices.

    Re-rolling the full month, not just its last hours, means a final invoice never depends
    on every hourly run of the month having succeeded. Once a month, and idempotent.
    """
    start, end = month_bounds(month or previous_month(now.date()))
    await rollup_hours(ctx.sessionmaker, start, end)
    return await finalize_invoices(ctx.sessionmaker, start, now=now)


async def purge_responses(ctx: JobContext, now: datetime) -> dict[str, int]:
    """Delete the stored responses of /v1/responses that have expired (they are already 404:
    this only frees the space)."""
    return {"purged": await purge_expired_responses(ctx.sessionmaker, now)}


# A Celery task's share of batch running: the runner lets its batch go after this, for the task
# beat sends next (any worker's), so no task outlives the job time limit and a deploy never
# waits long for one. Beat sends one every BATCH_TICK; several run at once on several batches.
BATCH_SHARE = 300.0
BATCH_TICK = 10.0


async def run_batches(ctx: JobContext, now: datetime) -> dict[str, Any]:
    """Run `/v1/batches` batches for a while (billing/batches.py): production's batch runner,
    sending lines to the gateway at TOKENMILL_GATEWAY_URL. `tokenmill serve` runs its own."""
    from billing.batches import BatchRunner
    from control_plane.batches.services import batch_service
    from tokenmill.bus import make_bus

    settings = ctx.settings
    if not settings.gateway_url or not settings.internal_token:
        return {"skipped": "TOKENMILL_GATEWAY_URL and TOKENMILL_INTERNAL_TOKEN are needed to run batches"}
    bus = make_bus(settings)  # the workers' heartbeats, to pace by
    try:
        runner = BatchRunner(
            batch_service(settings, ctx.sessionmaker, open_storage(settings)),
            gateway_url=settings.gateway_url,
            token=settings.internal_token,
            bus=bus,
            concurrency=settings.batch_concurrency,
        )
        share = min(BATCH_SHARE, settings.job_time_limit_seconds - 120.0)
        return {"batches": await runner.run_for(share)}
    finally:
        await bus.close()


async def export_to_storage(
    ctx: JobContext,
    now: datetime,
    *,
    what: str,
    format: str = "csv",
    start: str | None = None,
    end: str | None = None,
    org_id: str | None = None,
) -> dict[str, Any]:
    """Write an export (usage, rollups or invoices as CSV or JSON, the admin API's shapes)
    to the object storage under `exports/`, for ranges too large to download in one request.

    Not on the schedule: enqueued on demand (`billing.export`). Streamed through a temporary
    file, so memory stays bounded; the same parameters and `now` write the same key, so a
    retry or redelivery replaces the object with the same content.
    """
    q = export_query(what, format, start, end, org_id, now=now)
    storage = open_storage(ctx.settings)
    key = f"exports/{q.filename}"
    with tempfile.TemporaryFile() as tmp:
        async with ctx.sessionmaker() as session:
            async for chunk in stream_export(session, q):
                tmp.write(chunk)  # chunks of ~64 KiB: a page-cache write, not a wait
        tmp.seek(0)
        size = await asyncio.to_thread(storage.put, key, tmp)
    return {"key": key, "uri": storage.uri(key), "bytes": size, "media_type": q.media_type}


def jobs(settings: Settings) -> list[Job]:
    """The schedule. Order matters to the in-process scheduler, which runs jobs due at the
    same moment one after another: rollups before the invoices built from them."""
    at_invoice_time = {"minute": settings.invoice_minute, "hour": settings.invoice_hour}
    found = [
        Job("rollup_hours", Cron(minute=settings.rollup_minute), rollup_recent_hours, expires=3600),
        Job("invoices", Cron(**at_invoice_time), refresh_draft_invoices, expires=86400),
        Job("finalize_invoices", Cron(**at_invoice_time, day=1), finalize_last_month),
        # Not billing's own job, but this is the one schedule (control_plane/responses owns the table).
        Job("purge_responses", Every(3600.0), purge_responses, expires=3600),
    ]
    if settings.gateway_url:  # production's batch runner; `serve` starts its own (tokenmill/app.py)
        found.append(Job("run_batches", Every(BATCH_TICK), run_batches, expires=BATCH_TICK))
    if settings.stripe_sync_minutes > 0:  # does nothing without TOKENMILL_STRIPE_API_KEY
        interval = settings.stripe_sync_minutes * 60.0
        found.append(Job("stripe_sync", Every(interval), stripe_sync_job, expires=interval))
    return found


# Run on demand only (Celery task `billing.<name>`), never on the schedule.
ON_DEMAND: dict[str, JobFn] = {"export": export_to_storage}


# --- the in-process scheduler -----------------------------------------------------------


class InProcessScheduler(Background):
    """Runs `jobs(settings)` inside `tokenmill serve`, on the schedule beat would keep.

    As with beat, the last run of each job is remembered (in `state_path`), so a job whose
    time passed while the server was down runs once at the next start; a first start runs
    nothing at once. A failed job is logged and retried with backoff (1 min doubling to
    1 h, never later than its next regular run), so a month-end finalization that hit a
    locked database is not left until the next month. Jobs are async database work; each
    runs under the job time limit, one at a time, so the event loop is never held.
    """

    name = "billing-scheduler"

    def __init__(
        self,
        settings: Settings,
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        job_list: list[Job] | None = None,
        state_path: Path | None = None,
        clock: Callable[[], datetime] = utcnow,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        max_sleep: float = 60.0,
    ) -> None:
        super().__init__()
        self.ctx = JobContext(settings, sessionmaker)
        self.jobs = jobs(settings) if job_list is None else job_list
        self.state_path = state_path
        self.clock = clock
        self.sleep = sleep
        # asyncio sleeps on the monotonic clock, which stands still while a laptop is
        # suspended: waking up at least this often notices the wall clock has moved on.
        self.max_sleep = max_sleep
        self.due: dict[str, datetime] = {}
        self.failures: dict[str, int] = {}

    def _load(self) -> dict[str, datetime]:
        if self.state_path is None or not self.state_path.exists():
            return {}
        try:
            raw = json.loads(self.state_path.read_text())
            return {name: parse_time(value) for name, value in raw.items()}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("ignoring unreadable scheduler state %s (%s)", self.state_path, exc)
            return {}

    def _save(self, last: dict[str, datetime]) -> None:
        if self.state_path is None:
            return
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({name: t.isoformat() for name, t in last.items()}))
            os.replace(tmp, self.state_path)  # atomic: a crash leaves the old state or the new
        except OSError as exc:
            log.warning("cannot save scheduler state to %s (%s)", self.state_path, exc)

    async def run_job(self, job: Job, now: datetime) -> bool:
        """Run one job now; True when it succeeded. Errors are logged, never raised."""
        try:
            async with asyncio.timeout(self.ctx.settings.job_time_limit_seconds):
                result = await job.run(self.ctx, now)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("billing job %s failed", job.name)
            return False
        log.info("billing job %s done: %s", job.name, result)
        return True

    async def run(self) -> None:
        last = self._load()
        start = self.clock()
        self.due = {job.name: job.trigger.next_after(last.get(job.name, start)) for job in self.jobs}
        while True:
            for job in self.jobs:
                now = self.clock()
                if self.due[job.name] > now:
                    continue
                if await self.run_job(job, now):
                    self.failures.pop(job.name, None)
                    last[job.name] = now
                    self._save(last)
                    self.due[job.name] = job.trigger.next_after(now)
                else:
                    # Not recorded as run: a restart before the retry still catches it up.
                    n = self.failures[job.name] = self.failures.get(job.name, 0) + 1
                    retry = now + timedelta(seconds=min(60.0 * 2 ** (n - 1), 3600.0))
                    self.due[job.name] = min(retry, job.trigger.next_after(now))
            if not self.due:
                return
            wait = (min(self.due.values()) - self.clock()).total_seconds()
            await self.sleep(min(max(wait, 0.0), self.max_sleep))
