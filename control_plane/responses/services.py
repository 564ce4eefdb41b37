"""Storing, reading, listing, deleting and expiring the responses of `/v1/responses`.

Every read names the organisation: a response of another organisation, an expired one and
one that never existed are the same `None` (the gateway answers 404 for all three, so an id
reveals nothing). Expired rows are invisible at once and deleted by the periodic
`purge_responses` job (billing/schedule.py, run by Celery beat or `tokenmill serve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.responses.models import StoredResponse
from tokenmill.db import utcnow
from tokenmill.errors import APIError


class ResponseStore:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def add(
        self,
        *,
        response_id: str,
        org_id: str,
        model: str,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        lifetime: timedelta,
        now: datetime | None = None,
    ) -> StoredResponse:
        """Keep `response` (the Response object as answered) and the conversation it answered
        for `lifetime`."""
        now = now or utcnow()
        row = StoredResponse(
            id=response_id,
            org_id=org_id,
            model=model,
            response=response,
            input_items=input_items,
            created_at=now,
            expires_at=now + lifetime,
        )
        self.session.add(row)
        await self.session.flush()
        return row

    async def get(
        self, org_id: str, response_id: str, *, now: datetime | None = None
    ) -> StoredResponse | None:
        """The organisation's response by this id, unless it has expired."""
        stmt = select(StoredResponse).where(
            StoredResponse.id == response_id,
            StoredResponse.org_id == org_id,
            StoredResponse.expires_at > (now or utcnow()),
        )
        return await self.session.scalar(stmt)

    async def delete(self, org_id: str, response_id: str, *, now: datetime | None = None) -> bool:
        """Delete the organisation's response; False if it has none by this id (or it expired)."""
        result = await self.session.execute(
            delete(StoredResponse).where(
                StoredResponse.id == response_id,
                StoredResponse.org_id == org_id,
                StoredResponse.expires_at > (now or utcnow()),
            )
        )
        return bool(getattr(result, "rowcount", 0))

    async def purge_expired(self, now: datetime | None = None) -> int:
        """Delete every expired response; how many there were."""
        result = await self.session.execute(
            delete(StoredResponse).where(StoredResponse.expires_at <= (now or utcnow()))
        )
        return int(getattr(result, "rowcount", 0) or 0)


async def purge_expired(sessionmaker: async_sessionmaker[AsyncSession], now: datetime | None = None) -> int:
    """`ResponseStore.purge_expired` in a transaction of its own (the periodic job)."""
    async with sessionmaker() as session, session.begin():
        return await ResponseStore(session).purge_expired(now)


@dataclass(slots=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


def page_items(
    items: list[dict[str, Any]], *, after: str | None, limit: int, order: Literal["asc", "desc"]
) -> ItemPage:
    """One page of a response's input items, OpenAI's way: newest first by default, `after`
    the id of the last item of the previous page (400 if no item has it)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise APIError(400, f"No input item of this response has the id '{after}'.", param="after")
        start = ids.index(after) + 1
    return ItemPage(ordered[start : start + limit], start + limit < len(ordered))
