"""The search box and pager of the dashboard's lists (organisations, API keys, adapters,
deployments, invoices, the audit log): a page of 50 rows read through the control plane's
and billing's keyset pagination (control_plane/paging.py), and links that keep the page's
filters (organisation, search, ...) while they move the cursor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from control_plane.paging import Order, Page, PageQuery, page_of
from dashboard import PREFIX

PAGE_SIZE = 50


def list_query(q: str | None, after: str | None, before: str | None, order: Order | None = None) -> PageQuery:
    """The page a list's query string asks for (empty fields: not given)."""
    return page_of(q, PAGE_SIZE, after, before, order)


@dataclass(slots=True)
class Pager:
    """One list's page as its template shows it. `params` are the filters to keep in every
    link (empty ones are left out); the search is `query.q`."""

    path: str  # the page's path under the dashboard, e.g. "/keys"
    query: PageQuery
    page: Page[Any]
    noun: str  # what the rows are, plural: "keys"
    params: dict[str, str] = field(default_factory=dict)

    @property
    def rows(self) -> list[Any]:
        return self.page.rows

    @property
    def q(self) -> str:
        return self.query.text or ""

    @property
    def kept(self) -> dict[str, str]:
        """The filters a search form carries along (everything but the search and cursor)."""
        return {k: v for k, v in self.params.items() if v}

    def url(self, **cursor: str) -> str:
        query = self.kept | ({"q": self.q} if self.q else {}) | cursor
        return PREFIX + self.path + (f"?{urlencode(query)}" if query else "")

    @property
    def first_url(self) -> str | None:
        return self.url() if self.query.paged else None

    @property
    def prev_url(self) -> str | None:
        before = self.page.prev_before
        return self.url(before=before) if before is not None else None

    @property
    def next_url(self) -> str | None:
        after = self.page.next_after
        return self.url(after=after) if after is not None else None

    @property
    def clear_url(self) -> str:
        """The list without the search, other filters kept."""
        return PREFIX + self.path + (f"?{urlencode(self.kept)}" if self.kept else "")

    def empty(self, none_yet: str) -> str:
        """What an empty page says: that the search found nothing, that the pages ran out,
        or (`none_yet`) that there is nothing at all."""
        if self.q:
            return f"No {self.noun} match '{self.q}'."
        if self.query.paged:
            return f"No more {self.noun}."
        return none_yet
