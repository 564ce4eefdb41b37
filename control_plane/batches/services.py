"""Batches of `/v1/batches`: their rules, and every read and write of their rows.

A batch goes `validating` → `in_progress` → `finalizing` → `completed`, as at OpenAI; or
`failed` (its file as a whole is unusable: duplicate `custom_id`s, no valid line, the
organisation's batch queue is full), `expired` (its window passed), `cancelling` →
`cancelled`. The caller's side (`create`, `get`, `page`, `cancel`) is what the gateway's
`/v1/batches` calls; the runner's side (`claim`, `validate`, `pending`, `record`,
`finalize`) is what billing's batch runner calls, so neither writes SQL of its own.

Each line of the input file is checked once, at validation, before any runs: a bad line
becomes a line of the error file and does not fail the batch. Valid lines are stored as
`pending` rows; a line's result is written once (`record` only updates a pending row), so a
runner taking over after a crash runs exactly the lines without one.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.audit.services import record_change, snapshot
from control_plane.batches.lines import EXPIRED_MESSAGE, Checked, check_line, result_line
from control_plane.batches.models import Batch, BatchLine
from control_plane.files.models import StoredFile
from control_plane.files.services import BATCH, BATCH_OUTPUT, FileService, file_service
from control_plane.orgs.models import Organization
from control_plane.policy import Principal
from tokenmill.db import utcnow
from tokenmill.errors import APIError
from tokenmill.openai_batches import BATCH_ENDPOINTS, BatchCreateRequest
from tokenmill.settings import Settings
from tokenmill.storage import Storage

log = logging.getLogger("tokenmill.batches")

WINDOWS = ("24h",)  # OpenAI's only completion window; its length here is a setting
DEFAULT_WINDOW_SECONDS = 24 * 3600.0
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
CANCELLABLE = ("validating", "in_progress")
# Metadata as at OpenAI: at most 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_ERRORS = 100  # of a failed batch's `errors` (each duplicate `custom_id`, say), as OpenAI caps them
INSERT_CHUNK = 500  # pending rows added per statement at validation


def new_batch_id(now: datetime) -> str:
    """`batch_` and 24 hex digits: the creation time in milliseconds, then 48 random bits, so
    ids sort by creation (what a listing pages by)."""
    return f"batch_{int(now.timestamp() * 1000):012x}{secrets.token_hex(6)}"


def not_found(batch_id: str) -> APIError:
    # One wording for a missing batch and another organisation's: an id reveals nothing.
    return APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise APIError(400, f"metadata may have at most {MAX_METADATA} keys.", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise APIError(
                400, f"metadata keys may be at most {MAX_METADATA_KEY} characters long.", param="metadata"
            )
        if len(value) > MAX_METADATA_VALUE:
            raise APIError(
                400, f"metadata values may be at most {MAX_METADATA_VALUE} characters long.", param="metadata"
            )


async def batch_owner(session: AsyncSession, batch_id: str) -> tuple[str, str | None] | None:
    """(organisation, key) whose requests a batch's lines are, while the batch runs."""
    found = (
        await session.execute(
            select(Batch.org_id, Batch.api_key_id).where(Batch.id == batch_id, Batch.status.in_(ACTIVE))
        )
    ).first()
    return None if found is None else (found[0], found[1])


@dataclass(slots=True)
class BatchPage:
    batches: list[Batch]
    has_more: bool


@dataclass(slots=True)
class Pending:
    line: int
    custom_id: str | None
    body: str


def batch_service(
    settings: Settings, sessionmaker: async_sessionmaker[AsyncSession], storage: Storage
) -> BatchService:
    """The service as the settings configure it (the gateway's and every runner's)."""
    return BatchService(
        sessionmaker,
        file_service(settings, sessionmaker, storage),
        window_seconds=settings.batch_window_seconds,
        queue_tokens=settings.batch_queue_tokens,
    )


class BatchService:
    """Batches of organisations, their rows through `sessionmaker`, their files through `files`."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        files: FileService,
        *,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        queue_tokens: int = 0,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.files = files
        self.window = timedelta(seconds=window_seconds)
        self.queue_tokens = queue_tokens  # per organisation; 0 = no limit

    # --- the caller's side -----------------------------------------------------------------

    async def create(self, org_id: str, api_key_id: str | None, request: BatchCreateRequest) -> Batch:
        if request.endpoint not in BATCH_ENDPOINTS:
            served = ", ".join(BATCH_ENDPOINTS)
            raise APIError(
                400,
                f"Invalid value for 'endpoint': '{request.endpoint}'. Supported values are: {served}.",
                param="endpoint",
            )
        if request.completion_window not in WINDOWS:
            raise APIError(
                400,
                f"Invalid value for 'completion_window': '{request.completion_window}'. "
                "Supported values are: '24h'.",
                param="completion_window",
            )
        check_metadata(request.metadata)
        source = await self.files.find(org_id, request.input_file_id)
        if source is None:
            raise APIError(
                400, f"No such File object: {request.input_file_id}", param="input_file_id", code="not_found"
            )
        if source.purpose != BATCH:
            raise APIError(
                400,
                f"The file {source.id} has purpose '{source.purpose}'; a batch's input file must have "
                "purpose 'batch'.",
                param="input_file_id",
            )
        now = utcnow()
        row = Batch(
            id=new_batch_id(now),
            org_id=org_id,
            api_key_id=api_key_id,
            endpoint=request.endpoint,
            input_file_id=source.id,
            completion_window=request.completion_window,
            status="validating",
            meta=request.metadata,
            total=0,
            completed=0,
            failed=0,
            input_tokens=0,
            cached_tokens=0,
            output_tokens=0,
            queued_tokens=0,
            created_at=now,
            expires_at=now + self.window,
        )
        async with self.sessionmaker() as session, session.begin():
            session.add(row)
        return row

    async def find(self, org_id: str, batch_id: str) -> Batch | None:
        async with self.sessionmaker() as session:
            return await session.scalar(select(Batch).where(Batch.id == batch_id, Batch.org_id == org_id))

    async def get(self, org_id: str, batch_id: str) -> Batch:
        row = await self.find(org_id, batch_id)
        if row is None:
            raise not_found(batch_id)
        return row

    async def page(self, org_id: str, *, after: str | None = None, limit: int = 20) -> BatchPage:
        """Newest first, starting after the id `after` (ids sort by creation)."""
        stmt = select(Batch).where(Batch.org_id == org_id)
        if after is not None:
            stmt = stmt.where(Batch.id < after)
        async with self.sessionmaker() as session:
            rows = list(await session.scalars(stmt.order_by(Batch.id.desc()).limit(limit + 1)))
        return BatchPage(rows[:limit], len(rows) > limit)

    async def cancel(self, org_id: str, batch_id: str, actor: Principal | None = None) -> Batch:
        """`cancelling` now; the runner stops starting lines and finalizes it as `cancelled`
        with what ran. Cancelling a batch already cancelling or cancelled changes nothing.
        An `actor` (an admin in the dashboard, as opposed to the batch's API caller) is
        written to the audit log in the same transaction as the change."""
        async with self.sessionmaker() as session, session.begin():
            row = await session.scalar(
                select(Batch).where(Batch.id == batch_id, Batch.org_id == org_id).with_for_update()
            )
            if row is None:
                raise not_found(batch_id)
            if row.status in ("cancelling", "cancelled"):
                return row
            if row.status not in CANCELLABLE:
                raise APIError(
                    409,
                    f"Cannot cancel a batch with status '{row.status}'.",
                    param="batch_id",
                    code="batch_not_cancellable",
                )
            before = snapshot(row)
            row.status, row.cancelling_at = "cancelling", utcnow()
            if actor is not None:
                await record_change(
                    session, actor, "cancel", "batch", row.id, org_id=org_id, before=before, after=row
                )
        return row

    # --- the runner's side -----------------------------------------------------------------

    async def claim(self, owner: str, lease: float) -> Batch | None:
        """The oldest unfinished batch no other runner holds (or whose runner's lease lapsed),
        now held by `owner` for `lease` seconds; None if there is none."""
        now = utcnow()
        free = or_(Batch.lease_until.is_(None), Batch.lease_until < now, Batch.lease_owner == owner)
        async with self.sessionmaker() as session, session.begin():
            ids = list(
                await session.scalars(
                    select(Batch.id).where(Batch.status.in_(ACTIVE), free).order_by(Batch.id).limit(8)
                )
            )
            for batch_id in ids:
                # Conditional: of two runners racing for one batch, one update matches.
                taken = await session.execute(
                    update(Batch)
                    .where(Batch.id == batch_id, Batch.status.in_(ACTIVE), free)
                    .values(lease_owner=owner, lease_until=now + timedelta(seconds=lease))
                )
                if getattr(taken, "rowcount", 0):
                    return await session.get(Batch, batch_id)
        return None

    async def renew(self, batch_id: str, owner: str, lease: float) -> Batch | None:
        """Extend the lease; the batch as it is now (its status may have become `cancelling`),
        or None if the lease was lost to another runner."""
        async with self.sessionmaker() as session, session.begin():
            held = await session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.lease_owner == owner)
                .values(lease_until=utcnow() + timedelta(seconds=lease))
            )
            if not getattr(held, "rowcount", 0):
                return None
            return await session.get(Batch, batch_id)

    async def release(self, batch_id: str, owner: str) -> None:
        async with self.sessionmaker() as session, session.begin():
            await session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.lease_owner == owner)
                .values(lease_owner=None, lease_until=None)
            )

    async def validate(self, batch: Batch) -> Batch:
        """Check every line of the input file and store it (pending, or failed with its error),
        then move the batch to `in_progress`; or to `failed` if the file as a whole cannot run.
        All in one transaction: a crash mid-way leaves the batch `validating`, to start over."""
        source = await self.files.find(batch.org_id, batch.input_file_id)
        checked: list[Checked] = []
        if source is not None:
            async for number, raw in self.files.lines(source):
                checked.append(check_line(batch.endpoint, number, raw))
        errors = self._file_errors(source, checked)
        queued = sum(c.tokens for c in checked)
        now = utcnow()
        async with self.sessionmaker() as session, session.begin():
            row = await session.get(Batch, batch.id, with_for_update=True)
            if row is None or row.status != "validating":
                return row or batch
            if not errors and self.queue_tokens:
                errors = await self._queue_errors(session, row, queued)
            if errors:
                row.status, row.failed_at, row.errors = "failed", now, errors
                row.lease_owner = row.lease_until = None
                return row
            rows = [self._line_row(row.id, c) for c in checked]
            for start in range(0, len(rows), INSERT_CHUNK):
                await session.execute(BatchLine.__table__.insert(), rows[start : start + INSERT_CHUNK])
            row.total = len(checked)
            row.failed = sum(1 for c in checked if c.code is not None)
            row.model = next((c.model for c in checked if c.model), None)
            row.queued_tokens = queued
            row.status, row.in_progress_at = "in_progress", now
        return row

    @staticmethod
    def _line_row(batch_id: str, c: Checked) -> dict[str, Any]:
        row: dict[str, Any] = {"batch_id": batch_id, "line": c.line, "custom_id": c.custom_id}
        if c.code is None:
            return row | {"state": "pending", "body": c.body, "result": None}
        result = result_line(batch_id, c.line, c.custom_id, code=c.code, message=c.message)
        return row | {"state": "failed", "body": None, "result": result}

    def _file_errors(self, source: StoredFile | None, checked: Sequence[Checked]) -> list[dict[str, Any]]:
        """Why the file as a whole cannot run: missing, empty, or duplicate `custom_id`s."""
        if source is None:
            return [{"code": "invalid_file", "message": "The input file was deleted before it was read."}]
        if not checked:
            return [{"code": "empty_file", "message": "The input file has no request lines."}]
        errors: list[dict[str, Any]] = []
        seen: set[str] = set()
        for c in checked:
            if c.custom_id is None:
                continue
            if c.custom_id in seen:
                errors.append(
                    {
                        "code": "duplicate_custom_id",
                        "message": f"The custom_id '{c.custom_id}' appears more than once; each "
                        "request of a batch needs its own.",
                        "param": "custom_id",
                        "line": c.line,
                    }
                )
            seen.add(c.custom_id)
        if not errors and all(c.code is not None for c in checked):
            errors.append(
                {"code": "no_valid_lines", "message": "No line of the input file is a valid request."}
            )
        return errors[:MAX_ERRORS]

    async def _queue_errors(self, session: AsyncSession, row: Batch, queued: int) -> list[dict[str, Any]]:
        # Runners validating one organisation's batches at once take turns on its row, or each
        # could count before the other's tokens land and both pass the limit. (SQLite has no
        # row locks: `tokenmill serve` runs one runner there.)
        await session.execute(select(Organization.id).where(Organization.id == row.org_id).with_for_update())
        held = await session.scalar(
            select(func.coalesce(func.sum(Batch.queued_tokens), 0)).where(
                Batch.org_id == row.org_id, Batch.status.in_(ACTIVE), Batch.id != row.id
            )
        )
        if int(held or 0) + queued <= self.queue_tokens:
            return []
        return [
            {
                "code": "token_limit_exceeded",
                "message": f"Enqueued token limit reached: this batch needs about {queued} tokens and the "
                f"organisation's running batches hold {int(held or 0)} of its {self.queue_tokens}. Try "
                "again once they finish.",
            }
        ]

    async def pending(self, batch_id: str, *, after: int = 0, limit: int = 64) -> list[Pending]:
        """Lines still to run, in order, numbered above `after`."""
        async with self.sessionmaker() as session:
            rows = await session.execute(
                select(BatchLine.line, BatchLine.custom_id, BatchLine.body)
                .where(
                    and_(BatchLine.batch_id == batch_id, BatchLine.state == "pending", BatchLine.line > after)
                )
                .order_by(BatchLine.line)
                .limit(limit)
            )
            return [Pending(line, custom_id, body or "{}") for line, custom_id, body in rows]

    async def record(
        self, batch_id: str, line: int, *, ok: bool, result: str, usage: tuple[int, int, int] = (0, 0, 0)
    ) -> bool:
        """A line's result, and the batch's counts with it; False (nothing changed) if the line
        already had one."""
        prompt, cached, completion = usage
        async with self.sessionmaker() as session, session.begin():
            done = await session.execute(
                update(BatchLine)
                .where(BatchLine.batch_id == batch_id, BatchLine.line == line, BatchLine.state == "pending")
                .values(state="ok" if ok else "failed", result=result, body=None)
            )
            if not getattr(done, "rowcount", 0):
                return False
            counts: dict[str, Any] = {
                "input_tokens": Batch.input_tokens + prompt,
                "cached_tokens": Batch.cached_tokens + cached,
                "output_tokens": Batch.output_tokens + completion,
            }
            if ok:
                counts["completed"] = Batch.completed + 1
            else:
                counts["failed"] = Batch.failed + 1
            await session.execute(update(Batch).where(Batch.id == batch_id).values(**counts))
        return True

    async def finalizing(self, batch_id: str) -> None:
        """An `in_progress` batch whose lines have all run is `finalizing` until its files are
        written (what a caller polling it sees meanwhile)."""
        async with self.sessionmaker() as session, session.begin():
            await session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.status == "in_progress")
                .values(status="finalizing", finalizing_at=utcnow())
            )

    async def finalize(self, batch: Batch, end: str) -> Batch:
        """Write the output and error files from the lines' results (in line order) and end the
        batch as `end` (completed, cancelled or expired). Lines that never ran are left out, or,
        for an expired batch, written to the error file as `batch_expired`, as at OpenAI. Files
        and status change together: if the update fails, the files are removed again."""
        output: list[str] = []
        errors: list[str] = []
        async with self.sessionmaker() as session:
            rows = await session.execute(
                select(BatchLine.line, BatchLine.custom_id, BatchLine.state, BatchLine.result)
                .where(BatchLine.batch_id == batch.id)
                .order_by(BatchLine.line)
            )
            expired = 0
            for line, custom_id, state, result in rows:
                if state == "ok":
                    output.append(result)
                elif state == "failed":
                    errors.append(result)
                elif end == "expired":
                    expired += 1
                    errors.append(
                        result_line(
                            batch.id,
                            line,
                            custom_id,
                            code="batch_expired",
                            message=EXPIRED_MESSAGE,
                        )
                    )
        made: list[StoredFile] = []

        async def write(lines: list[str], kind: str) -> StoredFile | None:
            if not lines:
                return None
            made.append(
                await self.files.write(
                    batch.org_id,
                    filename=f"{batch.id}_{kind}.jsonl",
                    purpose=BATCH_OUTPUT,
                    content=("\n".join(lines) + "\n").encode(),
                )
            )
            return made[-1]

        try:
            out_file = await write(output, "output")
            err_file = await write(errors, "error")
            async with self.sessionmaker() as session, session.begin():
                row = await session.get(Batch, batch.id, with_for_update=True)
                if row is None or row.status not in ACTIVE:
                    raise _AlreadyEnded
                for f in made:
                    session.add(f)
                now = utcnow()
                row.output_file_id = out_file.id if out_file else None
                row.error_file_id = err_file.id if err_file else None
                row.finalizing_at = row.finalizing_at or now
                row.failed += expired
                row.status = end
                setattr(row, f"{end}_at", now)
                row.lease_owner = row.lease_until = None
                # The results are in the files now.
                await session.execute(delete(BatchLine).where(BatchLine.batch_id == row.id))
            return row
        except BaseException as exc:
            for f in made:
                await self.files.discard(f)
            if isinstance(exc, _AlreadyEnded):
                return await self.find(batch.org_id, batch.id) or batch
            raise


class _AlreadyEnded(Exception):
    """Another runner finalized the batch first."""
