"""The batch runner: runs the lines of `/v1/batches` batches through the gateway, from spare
capacity.

Each line is sent over HTTP to the gateway's own endpoint (`/v1/chat/completions`, ...) with
the internal token and the batch's id and line number (`X-Tokenmill-Batch`,
`X-Tokenmill-Batch-Line`): the gateway serves it as a request of the key that created the
batch, through the same admission, routing and metering as any other, but without the key's
per-minute limits, at the engine's batch priority, and with the request id
`<batch id>-<line>`. So billing never imports the gateway (DESIGN.md's arrows), and a line's
usage event is the ledger's one row for that request id however often the line is sent.

Pacing: at most `batch_concurrency` lines in flight, and none started while a live worker
reports waiting requests (heartbeats on the `WORKERS` stream): interactive traffic queueing
is the signal that the fleet has no capacity to spare.

Who runs it: `tokenmill serve` starts one (`BatchRunner.run`, for ever); in production the
Celery task `billing.run_batches` (every few seconds from beat) runs one for a bounded time
(`run_for`). Runners take a batch by a lease in its row (`BatchService.claim`); one that
crashes loses the lease when it lapses, and the next runner resumes from the lines' rows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Any

import httpx
import msgspec

from control_plane.batches.lines import result_line
from control_plane.batches.models import Batch
from control_plane.batches.services import BatchService, Pending
from tokenmill.bus import EventBus
from tokenmill.db import utcnow
from tokenmill.fleet import WorkerTable
from tokenmill.tasks import Background

log = logging.getLogger("tokenmill.batches.runner")

LEASE = 30.0  # seconds a runner holds a batch without renewing; a crashed runner's lapses after it
# Renewing also reads the batch's status: a cancel stops new lines within about this long.
RENEW = 1.0
IDLE = 1.0  # seconds between looks for work when there is none
# Answers that say "not now" rather than "no": the line is sent again later.
RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
MAX_BACKOFF = 30.0
LINE_TIMEOUT = 600.0  # seconds one line may take through the gateway
# A worker silent this long no longer counts toward pacing.
WORKER_TIMEOUT = 15.0


def runner_id(kind: str) -> str:
    return f"{kind}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _usage(body: Any) -> tuple[int, int, int]:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details") or {}
    return (
        int(usage.get("prompt_tokens") or 0),
        int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
        int(usage.get("completion_tokens") or 0),
    )


def _quota_refusal(body: Any) -> bool:
    """A 429 for the organisation's budget: final, unlike a rate limit's."""
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == "insufficient_quota"


class BatchRunner(Background):
    name = "batch-runner"

    def __init__(
        self,
        batches: BatchService,
        *,
        gateway_url: str,
        token: str,
        bus: EventBus | None = None,
        concurrency: int = 8,
        owner: str | None = None,
        client: httpx.AsyncClient | None = None,
        idle: float = IDLE,
    ) -> None:
        super().__init__()
        self.batches = batches
        self.url = gateway_url.rstrip("/")
        self.token = token
        self.bus = bus
        self.concurrency = concurrency
        self.owner = owner or runner_id("runner")
        self.client = client
        self.idle = idle
        self.fleet = _Fleet(bus, WORKER_TIMEOUT)

    # --- lifetimes ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Take batches and run them, for ever."""
        await self._serve(None)

    async def run_for(self, seconds: float) -> int:
        """Run batches for about `seconds` (a Celery task's share), then let them go for the next
        runner; the number of batches it worked on."""
        return await self._serve(time.monotonic() + seconds)

    async def _serve(self, deadline: float | None) -> int:
        own_client = self.client is None
        client = self.client or httpx.AsyncClient(timeout=httpx.Timeout(LINE_TIMEOUT, connect=10.0))
        if self.bus is not None:
            await self.fleet.start()
        worked = 0
        try:
            while deadline is None or time.monotonic() < deadline:
                batch = await self.batches.claim(self.owner, LEASE)
                if batch is None:
                    if deadline is not None:
                        break
                    await asyncio.sleep(self.idle)
                    continue
                worked += 1
                try:
                    await self.work(batch, client, deadline)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # Left to its lease: this runner (or another) takes it up again.
                    log.exception("batch %s: run interrupted", batch.id)
                    await asyncio.sleep(self.idle)
        finally:
            # `Background.stop` cancels until it takes: a single cancel that redis-py swallows
            # would leave the follower reading for ever, and a Celery task never ending.
            await self.fleet.stop()
            if own_client:
                await client.aclose()
        return worked

    # --- one batch ----------------------------------------------------------------------------

    async def work(self, batch: Batch, client: httpx.AsyncClient, deadline: float | None = None) -> Batch:
        """Carry the batch as far as it goes: validate it, run its lines, finalize it."""
        if batch.status == "validating":
            batch = await self.batches.validate(batch)
            log.info("batch %s: %s, %d lines (%d invalid)", batch.id, batch.status, batch.total, batch.failed)
        if batch.status not in ("in_progress", "cancelling", "finalizing"):
            return batch
        end = "completed" if batch.status == "finalizing" else await self._run_lines(batch, client, deadline)
        if end is None:  # lease lost or time up: another runner (or the next task) goes on
            await self.batches.release(batch.id, self.owner)
            return batch
        if end == "completed":
            await self.batches.finalizing(batch.id)
        done = await self.batches.finalize(batch, end)
        log.info("batch %s: %s, %d completed, %d failed", done.id, done.status, done.completed, done.failed)
        return done

    async def _run_lines(self, batch: Batch, client: httpx.AsyncClient, deadline: float | None) -> str | None:
        """Run the pending lines until none is left ("completed"), the batch is cancelled
        ("cancelled") or expires ("expired"); None if the lease was lost or time ran out. Lines in
        flight are always let finish: what ran is in the files."""
        stop = asyncio.Event()
        flying: set[asyncio.Task[None]] = set()
        queue: list[Pending] = []
        last = 0
        renew_at = 0.0
        end: str | None = "completed"
        exhausted = False
        try:
            while True:
                now = time.monotonic()
                if now >= renew_at:
                    current = await self.batches.renew(batch.id, self.owner, LEASE)
                    renew_at = now + RENEW
                    if current is None:
                        end = None
                        break
                    if current.status == "cancelling":
                        end = "cancelled"
                        break
                if utcnow() >= batch.expires_at:
                    end = "expired"
                    break
                if deadline is not None and now >= deadline:
                    end = None
                    break
                if not queue and not exhausted:
                    queue = await self.batches.pending(batch.id, after=last, limit=4 * self.concurrency)
                    exhausted = not queue
                if not queue and not flying:
                    # Every line was sent; lines sent back as "not now" are pending again.
                    if not await self.batches.pending(batch.id, limit=1):
                        break
                    last, exhausted = 0, False
                    await asyncio.sleep(self.idle)
                    continue
                if queue and len(flying) < self._allowed():
                    line = queue.pop(0)
                    last = line.line
                    task = asyncio.create_task(self._line(batch, line, client, stop))
                    flying.add(task)
                    task.add_done_callback(flying.discard)
                    continue
                if flying:
                    await asyncio.wait(flying, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                else:  # held back by pacing
                    await asyncio.sleep(0.1)
        finally:
            stop.set()
            if flying:
                await asyncio.gather(*flying, return_exceptions=True)
        return end

    def _allowed(self) -> int:
        """Lines that may be in flight now: none more while a worker has requests waiting."""
        if self.bus is None:
            return self.concurrency
        now = time.monotonic()
        if any(w.waiting > 0 for w in self.fleet.workers.values() if self.fleet.alive(w, now)):
            return 0
        return self.concurrency

    async def _line(
        self, batch: Batch, line: Pending, client: httpx.AsyncClient, stop: asyncio.Event
    ) -> None:
        """Send one line until it gets an answer that is not "not now", and record it. A line
        still without one when the batch stops stays pending (a later run sends it again)."""
        headers = {
            "authorization": f"Bearer {self.token}",
            "content-type": "application/json",
            "x-tokenmill-batch": batch.id,
            "x-tokenmill-batch-line": str(line.line),
        }
        backoff = 0.5
        while True:
            try:
                r = await client.post(f"{self.url}{batch.endpoint}", content=line.body, headers=headers)
                body: Any = _json(r.content)
                if r.status_code not in RETRY_STATUSES or (r.status_code == 429 and _quota_refusal(body)):
                    break
                wait = _retry_after(r.headers.get("retry-after"), backoff)
                log.debug("batch %s line %d: %d, again in %.1fs", batch.id, line.line, r.status_code, wait)
            except httpx.TransportError as exc:
                wait = backoff
                log.info(
                    "batch %s line %d: gateway unreachable (%s), again in %.1fs",
                    batch.id,
                    line.line,
                    exc,
                    wait,
                )
            if stop.is_set():
                return
            try:
                async with asyncio.timeout(wait):
                    await stop.wait()
                return
            except TimeoutError:
                backoff = min(backoff * 2, MAX_BACKOFF)
        ok = 200 <= r.status_code < 300
        result = result_line(batch.id, line.line, line.custom_id, status=r.status_code, body=body)
        await self.batches.record(
            batch.id, line.line, ok=ok, result=result, usage=_usage(body) if ok else (0, 0, 0)
        )


class _Fleet(WorkerTable, Background):
    """The workers' heartbeats (`WORKERS`), followed while the runner works: what it paces by."""

    name = "batch-runner-fleet"

    def __init__(self, bus: EventBus | None, timeout: float) -> None:
        WorkerTable.__init__(self, timeout)
        Background.__init__(self)
        self.bus = bus

    async def run(self) -> None:
        assert self.bus is not None
        await self.follow(self.bus, name=self.name)


def _json(content: bytes) -> Any:
    try:
        return msgspec.json.decode(content)
    except msgspec.DecodeError:
        return {"error": {"message": content[:500].decode("utf-8", "replace"), "type": "server_error"}}


def _retry_after(value: str | None, default: float) -> float:
    try:
        return min(max(float(value), 0.1), MAX_BACKOFF) if value else default
    except ValueError:
        return default
