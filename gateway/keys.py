"""Who is calling: API keys checked against an in-process cache of key records.

The database is read once per key per `ttl`, not once per request. Revoking a key (or
changing an organisation) publishes `KeysChanged` on the KEYS stream; every replica tails
it and drops the record at once, so a revoked key stops working everywhere within a
second. The TTL bounds staleness if an event is ever missed.

The secret itself is never cached: each request's key is hashed and compared (in
constant time) with the stored hash, exactly as without the cache.

Memory is bounded whatever callers send: known keys in an LRU of `TOKENMILL_KEY_CACHE_SIZE`
records, unknown ones (so a repeated bad key skips the database) in a separate, smaller LRU
of `TOKENMILL_KEY_CACHE_MISSES` prefixes for `miss_ttl` seconds, so a flood of made-up keys
can neither grow the process nor push real keys out. (Failed authentications are counted
per client address by the controller, before a key is looked at: `tokenmill.clients`.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.orgs.keys import check_key, find_key, find_key_by_id
from control_plane.orgs.models import ApiKey, Organization
from control_plane.plans.limits import Rate, key_limits, org_limits
from control_plane.plans.models import Plan
from control_plane.policy import check_serving
from gateway.metrics import GatewayMetrics
from tokenmill import security
from tokenmill.bus import EventBus
from tokenmill.db import utcnow
from tokenmill.errors import APIError
from tokenmill.protocol import KEYS, KeysChanged
from tokenmill.settings import Settings
from tokenmill.tasks import Background, tail

log = logging.getLogger("tokenmill.gateway.keys")


@dataclass(slots=True, frozen=True)
class Quota:
    """The limits that apply to one key: its own, and its organisation's plan (or defaults)."""

    key_requests: Rate | None = None
    key_tokens: Rate | None = None
    key_concurrent: int | None = None
    org_requests: Rate | None = None
    org_tokens: Rate | None = None
    org_concurrent: int | None = None
    budget: Decimal | None = None  # monthly spend limit of the organisation
    hard_budget: bool = False  # refuse what would overshoot, rather than only alert


@dataclass(slots=True, frozen=True)
class Caller:
    key_id: str
    org_id: str
    role: str
    scopes: tuple[str, ...] | None
    cache_salt: str
    quota: Quota = Quota()
    # A batch runner's line (`KeyCache.batch_caller`): its tokens are priced at the batch
    # discount, so its budget hold and charge are too.
    batch: bool = False

    def may_use(self, model: str) -> bool:
        return self.scopes is None or model in self.scopes


def quota(key: ApiKey, plan: Plan | None, settings: Settings) -> Quota:
    org, own = org_limits(plan, settings), key_limits(key)  # the rule: control_plane/plans/limits.py
    return Quota(
        key_requests=own.requests,
        key_tokens=own.tokens,
        key_concurrent=own.concurrent,
        org_requests=org.requests,
        org_tokens=org.tokens,
        org_concurrent=org.concurrent,
        budget=org.budget,
        hard_budget=org.hard_budget,
    )


@dataclass(slots=True)
class _Entry:
    key: ApiKey | None  # None: no such key (cached briefly so floods of bad keys skip the DB)
    org: Organization | None
    caller: Caller | None
    expires: float  # monotonic


_NO_KEY = _Entry(None, None, None, 0.0)


class KeyCache(Background):
    name = "key-cache"

    def __init__(
        self,
        settings: Settings,
        bus: EventBus,
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        ttl: float = 30.0,
        miss_ttl: float = 2.0,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        super().__init__()
        assert settings.secret_key
        self.settings = settings
        self.secret_key = settings.secret_key
        self.bus = bus
        self.sessionmaker = sessionmaker
        self.ttl = ttl
        self.miss_ttl = miss_ttl
        self.size = settings.key_cache_size
        self.miss_size = settings.key_cache_misses
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._misses: OrderedDict[str, float] = OrderedDict()  # prefix -> expiry (monotonic)
        self._loading: dict[str, asyncio.Future[_Entry]] = {}
        self._generation = 0  # bumped by every change event
        self._changed = msgspec.json.Decoder(KeysChanged)
        # Key id -> when it was last accepted (epoch seconds), until `take_used` hands it to
        # the writer (gateway/accounting.py): a dictionary store per request, no database write.
        self._used: dict[str, float] = {}
        lookups = (metrics or GatewayMetrics.create()).key_cache
        self._lookup_hit, self._lookup_miss = lookups.labels("hit"), lookups.labels("miss")

    async def run(self) -> None:
        await tail(self.bus, KEYS, lambda raw: self.apply(self._changed.decode(raw)), name=self.name)

    def apply(self, ev: KeysChanged) -> None:
        self._generation += 1
        if ev.prefix is not None:
            self._entries.pop(ev.prefix, None)
            self._misses.pop(ev.prefix, None)  # a key just created is no longer unknown
            # The same key's record looked up by id for a batch (`batch_caller`).
            for cached in [p for p, e in self._entries.items() if e.key and e.key.prefix == ev.prefix]:
                del self._entries[cached]
        if ev.org_id is not None:
            for prefix in [p for p, e in self._entries.items() if e.org and e.org.id == ev.org_id]:
                del self._entries[prefix]

    async def caller(self, authorization: str | None) -> Caller:
        scheme, _, secret = (authorization or "").partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise APIError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer tm-...'.",
                code="invalid_api_key",
            )
        prefix = security.key_prefix(secret)
        entry = await self._entry(prefix) if prefix is not None else None
        check_key(secret, entry.key if entry else None, self.secret_key)
        assert entry is not None and entry.org is not None and entry.caller is not None
        check_serving(entry.org)
        self._used[entry.caller.key_id] = time.time()
        return entry.caller

    async def batch_caller(self, key_id: str | None, org_id: str) -> Caller:
        """Whose request a batch line is: the key that created the batch, with its budget but
        none of its per-minute or concurrency limits (a batch must not lock its organisation
        out of interactive calls; the runner paces itself). A key revoked or expired since
        stops its batches' lines (401), as a suspended organisation does (403)."""
        entry = await self._entry(f"id:{key_id}") if key_id is not None else _NO_KEY
        key, org = entry.key, entry.org
        if key is None or org is None or entry.caller is None or org.id != org_id:
            raise APIError(
                401, "The API key that created this batch no longer exists.", code="invalid_api_key"
            )
        if key.revoked_at is not None or (key.expires_at is not None and key.expires_at <= utcnow()):
            raise APIError(
                401, "The API key that created this batch was revoked or has expired.", code="invalid_api_key"
            )
        check_serving(org)
        q = entry.caller.quota
        return replace(entry.caller, quota=Quota(budget=q.budget, hard_budget=q.hard_budget), batch=True)

    def take_used(self) -> dict[str, float]:
        """The keys accepted since the last call, with the time of each one's latest use."""
        used, self._used = self._used, {}
        return used

    def held(self) -> tuple[int, int]:
        """(known keys, remembered unknown keys) in memory now."""
        return len(self._entries), len(self._misses)

    async def _entry(self, prefix: str) -> _Entry:
        now = time.monotonic()
        entry = self._entries.get(prefix)
        if entry is not None and entry.expires > now:
            self._entries.move_to_end(prefix)
            self._lookup_hit.inc()
            return entry
        missed = self._misses.get(prefix)
        if missed is not None and missed > now:
            self._lookup_hit.inc()  # a key known not to exist: no database read either
            return _NO_KEY
        self._lookup_miss.inc()
        # Concurrent first requests of one key share one database read.
        fut = self._loading.get(prefix)
        if fut is None:
            fut = asyncio.ensure_future(self._load(prefix))
            self._loading[prefix] = fut
            fut.add_done_callback(lambda _: self._loading.pop(prefix, None))
        return await asyncio.shield(fut)

    async def _load(self, prefix: str) -> _Entry:
        generation = self._generation
        async with self.sessionmaker() as session:
            # `id:<key id>`: a batch's key, looked up by id (`batch_caller`).
            by_id = prefix.startswith("id:")
            found = await (find_key_by_id(session, prefix[3:]) if by_id else find_key(session, prefix))
        now = time.monotonic()
        if found is None:
            if generation == self._generation:
                _remember(self._misses, prefix, now + self.miss_ttl, self.miss_size)
            return _NO_KEY
        key, org, plan = found
        caller = Caller(
            key.id,
            org.id,
            key.role,
            tuple(key.scopes) if key.scopes else None,
            org.cache_salt,
            quota(key, plan, self.settings),
        )
        entry = _Entry(key, org, caller, now + self.ttl)
        # A change event that arrived while we read may describe a newer row than ours:
        # use what we read for this request only.
        if generation == self._generation:
            self._misses.pop(prefix, None)
            _remember(self._entries, prefix, entry, self.size)
        return entry


def _remember(lru: OrderedDict[str, Any], key: str, value: Any, size: int) -> None:
    """Put `key` last (most recent) and drop the least recently used beyond `size`."""
    lru[key] = value
    lru.move_to_end(key)
    while len(lru) > size:
        lru.popitem(last=False)
