"""Refused requests and API keys' last use: counted in memory, written in batches.

Every refused answer of `/v1` (a 4xx before any worker ran the request; a worker's own 400
and a client that left, 499, are the gateway's answered requests) passes `refused`, from the
app's `before_send` hook (`gateway.controllers.stamp_request_ids`), which sees the status
Litestar actually sent, whichever handler shaped it (ours, or Litestar's own 404/405/413);
the exception behind it was noted on the connection by `note_exception` (the app's
`after_exception` hook). It becomes a reason of `gateway.metrics.REASONS`: the metrics get
it at once; requests of a known caller are also counted per organisation, key, reason and
minute in memory, and added to `refusals` every `TOKENMILL_REFUSALS_FLUSH_SECONDS`, so a
flood of 429s costs a dictionary increment each and a row per minute. A made-up key names
nobody: its 401s are in the metrics only.

Keys' last use is noted by the key cache on each accepted request (`KeyCache.take_used`)
and written every `TOKENMILL_KEY_LAST_USED_SECONDS`: one statement for all keys used since,
never moving a key's time back (another gateway may have written a later one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

from litestar.exceptions import HTTPException, ValidationException
from litestar.types import Scope
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.refusals.services import RefusalKey, add_refusals
from control_plane.orgs.keys import record_key_use
from gateway.keys import KeyCache
from gateway.metrics import GatewayMetrics
from tokenmill.errors import APIError
from tokenmill.tasks import Background

log = logging.getLogger("tokenmill.gateway.accounting")

# Where `note_exception` leaves the exception in the connection's state.
EXCEPTION = "refused_by"
# Rows kept while the database cannot be written (beyond them, new ones are dropped and
# logged): a key, reason and minute each, so hours of an outage for thousands of keys.
MAX_PENDING = 100_000

_BY_CODE = {
    "context_length_exceeded": "context_length",
    "request_too_large": "too_large",
    "file_too_large": "too_large",
    "too_many_lines": "too_large",
    "insufficient_quota": "budget",
    "too_many_authentication_failures": "auth",
    "invalid_api_key": "auth",
    "model_not_found": "not_found",
}
# Every 403 (a key without the scope, a suspended organisation) is a `permission` refusal.
_BY_STATUS = {401: "auth", 403: "permission", 404: "not_found", 413: "too_large"}
_RATE_LIMIT_TYPES = {"requests": "rate_limit_requests", "tokens": "rate_limit_tokens"}


def reason_of(status: int, exc: BaseException | None) -> str:
    """The reason (`gateway.metrics.REASONS`) of a refused answer of `status`, from the
    exception that made it when there was one."""
    if isinstance(exc, APIError):
        if exc.reason is not None:
            return exc.reason
        found = _BY_CODE.get(exc.code or "")
        if found is not None:
            return found
        if status == 429:
            return _RATE_LIMIT_TYPES.get(exc.type, "rate_limit_requests")
    elif isinstance(exc, ValidationException):
        return "validation"
    elif isinstance(exc, HTTPException) and status == 429:
        return "rate_limit_requests"
    return _BY_STATUS.get(status, "validation")


async def note_exception(exc: Exception, scope: Scope) -> None:
    """The app's `after_exception` hook: runs before the exception is answered."""
    scope["state"][EXCEPTION] = exc


class Accounting(Background):
    name = "accounting"

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        metrics: GatewayMetrics,
        keys: KeyCache,
        *,
        flush_seconds: float = 10.0,
        last_used_seconds: float = 30.0,
    ) -> None:
        super().__init__()
        self.sessionmaker = sessionmaker
        self.metrics = metrics
        self.keys = keys
        self.flush_seconds = flush_seconds
        self.last_used_seconds = last_used_seconds
        self._refused: dict[RefusalKey, int] = {}
        self._dropped = 0
        self._used: dict[str, float] = {}  # key id -> time (epoch seconds) not yet written
        self._minute = (-1, datetime.fromtimestamp(0, UTC))  # (index, its start), reused

    # --- counting (on the request path: no I/O) ----------------------------------------------

    def refused(self, status: int, scope: Scope) -> None:
        """Count a 4xx answer of `status` of the request of `scope`, unless a worker ran the
        request: then the gateway counted it with the answered ones (and the ledger has it),
        as it did a request whose client left (499)."""
        state = scope["state"]
        exc = state.get(EXCEPTION)
        if status == 499 or (isinstance(exc, APIError) and exc.metered):
            return
        reason = reason_of(status, exc)
        self.metrics.refusals.labels(reason).inc()
        self.metrics.requests.labels(endpoint_of(scope), "", "", "4xx").inc()
        caller = state.get("caller")
        if caller is None:
            return
        key = (caller.org_id, caller.key_id, reason, self._this_minute())
        n = self._refused.get(key)
        if n is not None:
            self._refused[key] = n + 1
        elif len(self._refused) < MAX_PENDING:
            self._refused[key] = 1
        else:
            self._dropped += 1

    def _this_minute(self) -> datetime:
        index = int(time.time() // 60)
        if index != self._minute[0]:
            self._minute = (index, datetime.fromtimestamp(index * 60, UTC))
        return self._minute[1]

    # --- writing -------------------------------------------------------------------------------

    async def run(self) -> None:
        last_used_due = time.monotonic() + self.last_used_seconds
        while True:
            await asyncio.sleep(self.flush_seconds)
            await self.flush_refusals()
            if time.monotonic() >= last_used_due:
                last_used_due = time.monotonic() + self.last_used_seconds
                await self.flush_last_used()

    async def stop(self) -> None:
        """Stop the loop, then write what is still counted."""
        await super().stop()
        await self.flush_refusals()
        await self.flush_last_used()

    async def flush_refusals(self) -> None:
        """Add the refusals counted since the last flush to `refusals`; kept for the next
        flush if the database cannot be written (or this is cancelled mid-way)."""
        counts, self._refused = self._refused, {}
        if self._dropped:
            log.warning("%d refusals were not counted per key: too many waiting to be written", self._dropped)
            self._dropped = 0
        if not counts:
            return
        try:
            async with self.sessionmaker() as session, session.begin():
                await add_refusals(session, counts)
        except BaseException as exc:
            for key, n in counts.items():
                self._refused[key] = self._refused.get(key, 0) + n
            if not isinstance(exc, Exception):
                raise
            log.warning("could not write %d refusal counts; retrying at the next flush: %s", len(counts), exc)

    async def flush_last_used(self) -> None:
        """Write the keys' last use noted since the last write (at most one time per key)."""
        for key_id, t in self.keys.take_used().items():
            if t > self._used.get(key_id, 0.0):
                self._used[key_id] = t
        used, self._used = self._used, {}
        if not used:
            return
        try:
            async with self.sessionmaker() as session, session.begin():
                await record_key_use(session, {k: datetime.fromtimestamp(t, UTC) for k, t in used.items()})
        except BaseException as exc:
            for key_id, t in used.items():
                self._used[key_id] = max(t, self._used.get(key_id, 0.0))
            if not isinstance(exc, Exception):
                raise
            log.warning("could not write the last use of %d API keys; retrying later: %s", len(used), exc)


def endpoint_of(scope: Scope) -> str:
    """The `endpoint` label, as the gateway names answered requests (`chat`, `completions`,
    `embeddings`, `responses`; likewise `models`, `files`, `batches`): the first part of the
    route's path after `/v1/`, or `other` for a path no route serves (never the path itself,
    which the caller chooses)."""
    template: Any = scope.get("path_template")
    if not isinstance(template, str):
        return "other"
    parts = template.split("/", 3)  # "", "v1", "chat", "completions"
    return parts[2] if len(parts) > 2 and parts[2] else "other"
