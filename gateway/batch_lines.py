"""Who a batch's line is: a request sent by a batch runner (billing/batches.py) with the
internal token and `X-Tokenmill-Batch` / `X-Tokenmill-Batch-Line`, served as a request of the
key that created the batch, under the line's own request id."""

from __future__ import annotations

import hmac
import time

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.batches.lines import line_request_id
from control_plane.batches.services import batch_owner
from gateway.keys import Caller, KeyCache
from tokenmill.errors import APIError
from tokenmill.settings import Settings

OWNER_TTL = 10.0  # seconds a batch's owner is remembered (a cancelled batch's lines stop after it)
OWNERS = 1024


class BatchLines:
    def __init__(
        self, settings: Settings, sessionmaker: async_sessionmaker[AsyncSession], keys: KeyCache
    ) -> None:
        self.settings = settings
        self.sessionmaker = sessionmaker
        self.keys = keys
        self._owners: dict[str, tuple[tuple[str, str | None], float]] = {}  # batch -> (owner, expiry)

    def check_runner(self, authorization: str | None) -> None:
        """401 unless `authorization` is the internal token, the batch runner's credential, so
        no key holder can pass a request off as a batch's."""
        token = self.settings.internal_token
        scheme, _, secret = (authorization or "").partition(" ")
        supplied = secret.strip().encode()
        if not token or scheme.lower() != "bearer" or not hmac.compare_digest(supplied, token.encode()):
            raise APIError(401, "Only the batch runner may send a batch's lines.", code="invalid_api_key")

    async def authenticate(
        self, authorization: str | None, batch_id: str, line: str | None
    ) -> tuple[Caller, str]:
        """The caller a line runs as (the key that created the batch: `KeyCache.batch_caller`)
        and its request id, the same however often the line is sent (`line_request_id`)."""
        self.check_runner(authorization)
        if line is None or not line.isdigit() or not 0 < int(line) <= 10**9:
            raise APIError(
                400, "X-Tokenmill-Batch-Line must be the line's number.", param="X-Tokenmill-Batch-Line"
            )
        owner = await self._owner(batch_id)
        if owner is None:
            raise APIError(409, f"The batch {batch_id} is not running.", code="batch_not_running")
        caller = await self.keys.batch_caller(owner[1], owner[0])
        return caller, line_request_id(batch_id, int(line))

    async def _owner(self, batch_id: str) -> tuple[str, str | None] | None:
        """`batch_owner`, read once per batch and `OWNER_TTL`: every line of a batch asks.
        Bounded: the oldest entries go first."""
        now = time.monotonic()
        hit = self._owners.get(batch_id)
        if hit is not None and hit[1] > now:
            return hit[0]
        async with self.sessionmaker() as session:
            owner = await batch_owner(session, batch_id)
        if owner is not None:
            self._owners[batch_id] = (owner, now + OWNER_TTL)
            while len(self._owners) > OWNERS:
                del self._owners[next(iter(self._owners))]
        return owner
