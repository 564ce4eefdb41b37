"""Celery for the periodic billing jobs (production): workers run them, beat schedules them.

    tokenmill celery worker     # = celery -A billing.celery_app worker
    tokenmill celery beat       # exactly one per deployment

Broker and result backend are `TOKENMILL_CELERY_BROKER_URL`, else `REDIS_URL`; the
database is `DATABASE_URL`. The tasks and the beat schedule both come from
`billing.schedule.jobs`, the same list the in-process scheduler of `tokenmill serve` runs.
Task `billing.<job>` takes optional keyword arguments: `now` (ISO time the run is for,
default: when the worker starts it) and the job's own overrides (e.g. `start`/`end` of a
rollup backfill).
"""

from __future__ import annotations

import asyncio
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
from celery import Celery, Task
from celery.beat import PersistentScheduler
from celery.signals import beat_init, worker_init
from celery.utils.time import get_exponential_backoff_interval

from billing.schedule import ON_DEMAND, Job, JobFn, job_context, jobs, parse_time
from tokenmill.db import utcnow
from tokenmill.settings import Settings

MAX_RETRIES = 8  # 10, 20, 40 ... 600, 600 s: about half an hour of outage is ridden out
RETRY_BASE_SECONDS = 10
RETRY_MAX_SECONDS = 600

# SQLSTATEs worth a retry: connection exceptions (class 08), serialization failure and
# deadlock (40001, 40P01), insufficient resources (class 53, e.g. too many connections),
# operator intervention (class 57: admin shutdown, cannot connect now, crash shutdown).
_TRANSIENT_SQLSTATE_PREFIXES = ("08", "40001", "40P01", "53", "57")


def broker_url(settings: Settings) -> str | None:
    return settings.celery_broker_url or settings.redis_url


def is_transient(exc: BaseException) -> bool:
    """Whether a failed job may succeed when simply run again: lost or refused connections
    to PostgreSQL or Redis, a locked SQLite file, a serialization failure or deadlock.
    Programming errors and bad data fail at once instead of retrying for half an hour."""
    import redis.exceptions
    from sqlalchemy import exc as sa

    if isinstance(exc, ConnectionError | TimeoutError | socket.gaierror | sa.TimeoutError):
        return True
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return True
    if isinstance(exc, sa.DBAPIError):
        if exc.connection_invalidated:
            return True
        # asyncpg's exception (with its SQLSTATE) is the cause of SQLAlchemy's adapted one.
        for cause in (exc.orig, getattr(exc.orig, "__cause__", None)):
            state = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
            if isinstance(state, str) and state.startswith(_TRANSIENT_SQLSTATE_PREFIXES):
                return True
            if isinstance(cause, OSError):  # refused or reset while connecting
                return True
        return isinstance(exc, sa.OperationalError) and "database is locked" in str(exc)
    # The cause chain, for errors a job wraps in its own exception type.
    cause = exc.__cause__
    return cause is not None and cause is not exc and is_transient(cause)


def _jsonable(value: Any) -> Any:
    """A job's result as JSON for the result backend (Decimals and times as strings)."""
    return msgspec.to_builtins(value, enc_hook=str)


async def _run_job(settings: Settings, run: JobFn, now: datetime, params: dict[str, Any]) -> Any:
    async with job_context(settings) as ctx:
        return await run(ctx, now, **params)


def register_job(app: Celery, settings: Settings, name: str, run: JobFn) -> Task:
    """Task `billing.<name>` running `run` in a fresh event loop, retrying transient errors."""

    # Not shared: each app keeps the tasks made with its own settings (tests make several).
    # max_retries here too: Celery's own default (3) would otherwise end the retries early.
    @app.task(name=f"billing.{name}", bind=True, shared=False, max_retries=MAX_RETRIES)
    def task(self: Task, now: str | None = None, **params: Any) -> Any:
        at = parse_time(now) if now else utcnow()
        try:
            # A new loop per task: nothing async outlives it (see job_context).
            return _jsonable(asyncio.run(_run_job(settings, run, at, params)))
        except Exception as exc:
            if not is_transient(exc) or self.request.retries >= MAX_RETRIES:
                raise
            countdown = get_exponential_backoff_interval(
                RETRY_BASE_SECONDS, self.request.retries, RETRY_MAX_SECONDS, full_jitter=False
            )
            # Pinned to the same `now`, so the retry works on the same hours and month.
            raise self.retry(
                kwargs={**params, "now": at.isoformat()}, exc=exc, countdown=max(countdown, 1)
            ) from exc

    return task


class BeatScheduler(PersistentScheduler):
    """Beat's own scheduler, keeping its last-run file under TOKENMILL_HOME (created if
    missing) rather than in whatever directory beat was started from."""

    def setup_schedule(self) -> None:
        Path(self.schedule_filename).parent.mkdir(parents=True, exist_ok=True)
        super().setup_schedule()


def beat_schedule(job_list: list[Job]) -> dict[str, dict[str, Any]]:
    schedule: dict[str, dict[str, Any]] = {}
    for job in job_list:
        entry: dict[str, Any] = {"task": f"billing.{job.name}", "schedule": job.trigger.to_celery()}
        if job.expires is not None:
            entry["options"] = {"expires": job.expires}
        schedule[job.name] = entry
    return schedule


def make_celery(settings: Settings | None = None) -> Celery:
    """The Celery app for `settings` (default: the environment), tasks registered."""
    settings = settings or Settings()
    url = broker_url(settings)
    limit = settings.job_time_limit_seconds
    app = Celery("tokenmill", set_as_current=False)
    app.conf.update(
        broker_url=url,
        result_backend=url,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        timezone="UTC",
        enable_utc=True,
        # Acknowledge after the job, and redeliver the job of a worker that died running it:
        # jobs are idempotent, a lost month-end finalization is not.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # jobs are long: do not hold messages another worker could run
        task_time_limit=limit,
        task_soft_time_limit=limit - 60,
        # Redis hands an unacknowledged message to another worker after the visibility
        # timeout; below the time limit, a long job would run twice at once.
        broker_transport_options={"visibility_timeout": limit + 600},
        result_expires=24 * 3600,
        task_track_started=True,
        broker_connection_retry_on_startup=True,
        beat_schedule=beat_schedule(jobs(settings)),
        beat_schedule_filename=str(settings.home_dir / "celerybeat-schedule"),
        beat_scheduler=f"{__name__}:BeatScheduler",
    )
    app.conf["tokenmill_configured"] = url is not None
    for job in jobs(settings):
        register_job(app, settings, job.name, job.run)
    for name, run in ON_DEMAND.items():  # e.g. billing.export
        register_job(app, settings, name, run)
    return app


def _require_broker(sender: Any = None, **_: Any) -> None:
    # Without this, Celery would quietly try amqp://guest@localhost for ever. SystemExit,
    # because Celery's signals swallow ordinary exceptions of their receivers.
    conf = getattr(getattr(sender, "app", None), "conf", None)
    if conf is not None and conf.get("tokenmill_configured") is False:
        raise SystemExit("error: set REDIS_URL or TOKENMILL_CELERY_BROKER_URL (the Celery broker)")


worker_init.connect(_require_broker)
beat_init.connect(_require_broker)

# `celery -A billing.celery_app worker|beat` finds this.
app = make_celery()
