"""Admission: rate limits, concurrency and the budget hold, in two steps before routing.

Per key and per organisation: requests a minute (cost 1), tokens a minute (prompt +
max_tokens charged up front, the unused part refunded at the end) and concurrent
requests. The organisation's monthly budget is a spend counter (integer nano-units of its
currency) seeded from the ledger; each request holds its worst-case cost until it ends and
then settles its actual cost, so concurrent requests cannot overshoot a hard budget.

`count` charges the request limits right after authentication, before anything expensive
(rendering, tokenizing, compiling a grammar): a flood of costly requests meets 429s, not
work. `admit` follows once the prompt's size is known: tokens, concurrency and the budget
hold in one `RateLimiter.admit` call (one Redis round trip, all or nothing).

If the limiter is unreachable (an outage error: `tokenmill.spool.OUTAGE_ERRORS`), requests
are admitted (availability first) unless the organisation has a hard budget, which cannot
be checked without it. Any other failure is a bug and is not papered over.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.common import month_bounds
from billing.prices.services import Rates, model_rates
from billing.rollups.services import spend_since
from control_plane.plans.limits import Rate
from gateway.catalog import Target
from gateway.keys import Caller
from gateway.metrics import Series
from tokenmill.errors import APIError
from tokenmill.limits import Admission, Hold, Limit, RateLimiter, Slot
from tokenmill.openai_shapes import ONE, Choices, Prompt
from tokenmill.openai_types import ServiceTier
from tokenmill.spool import OUTAGE_ERRORS

log = logging.getLogger("tokenmill.gateway.admission")

NANOS_PER_UNIT = Decimal(10**9)  # budgets count nano-units of their currency: 1 unit = 10**9
HOLD_TTL = 2 * 3600.0  # longer than any request; a crashed gateway's holds lapse after it
RATES_TTL = 60.0


def units(amount: Decimal) -> int:
    """Money as integer nano-units, rounded up so the counter never under-counts."""
    return int((amount * NANOS_PER_UNIT).to_integral_value(ROUND_CEILING))


def _duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest):d}s"


def _month(now: datetime) -> tuple[str, datetime, float]:
    """The month's label, its first instant, and seconds until a day after it ends."""
    start, end = month_bounds(now)
    return start.strftime("%Y-%m"), start, (end - now).total_seconds() + 86400


@dataclass(slots=True)
class Ticket:
    """What one admitted request holds, to give back when it ends."""

    org_id: str
    request_id: str
    charged: int  # tokens charged on each token limit
    token_limits: list[Limit]
    slots: list[Slot]
    rates: Rates
    budget_key: str | None
    headers: dict[str, str] = field(default_factory=dict)
    budget: int | None = None  # the soft budget in nano-units, to warn when crossed
    settled: bool = False
    batch: bool = False  # a batch's line: charged at the batch discount


class Admitter:
    def __init__(self, limiter: RateLimiter, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self.limiter = limiter
        self.sessionmaker = sessionmaker
        self._rates: dict[str, tuple[Rates, float]] = {}
        self._loading_rates: dict[str, asyncio.Future[Rates]] = {}
        self._alerted: set[str] = set()
        self._month_cache: tuple[str, datetime, float, float] | None = None

    def _month(self) -> tuple[str, datetime, float]:
        """`_month(now)`, worked out once a month rather than on every request."""
        now = time.time()
        if self._month_cache is None or now >= self._month_cache[3]:
            label, start, ttl = _month(datetime.fromtimestamp(now, UTC))
            self._month_cache = (label, start, ttl, now + ttl - 86400)  # the month's end
        label, start, _, end = self._month_cache
        return label, start, end - now + 86400

    async def rates(self, model_id: str) -> Rates:
        hit = self._rates.get(model_id)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        # Concurrent misses (every request in flight, when the entry expires) share one read.
        fut = self._loading_rates.get(model_id)
        if fut is None:
            fut = asyncio.ensure_future(self._load_rates(model_id))
            self._loading_rates[model_id] = fut
            fut.add_done_callback(lambda _: self._loading_rates.pop(model_id, None))
        return await asyncio.shield(fut)

    async def _load_rates(self, model_id: str) -> Rates:
        async with self.sessionmaker() as session:
            rates = await model_rates(session, model_id)
        self._rates[model_id] = (rates, time.monotonic() + RATES_TTL)
        return rates

    async def count(self, caller: Caller, request_id: str) -> dict[str, str]:
        """Charge one request on the key's and the organisation's request limits; their
        `x-ratelimit-*-requests` headers, or a 429 carrying them."""
        q = caller.quota
        tag = f"{{{caller.org_id}}}"
        requests: list[tuple[Limit, Rate, str]] = []
        for who, rate, key in (("key", q.key_requests, f"k:{caller.key_id}"), ("org", q.org_requests, "o")):
            if rate is not None:
                requests.append((Limit(f"{tag}:{key}:rpm", rate.per_minute, 60.0, rate.burst, 1), rate, who))
        if not requests:
            return {}
        try:
            result = await self.limiter.admit([lim for lim, _, _ in requests])
        except OUTAGE_ERRORS as exc:
            log.warning("rate limiter unavailable, counting %s unchecked: %s", request_id, exc)
            return {}
        headers = _headers(result, requests, [])
        if not result.allowed:
            raise _refusal(result, requests, [], [], headers)
        return headers

    async def admit(
        self, caller: Caller, model_id: str | None, request_id: str, prompt_tokens: int, max_tokens: int
    ) -> Ticket:
        """Tokens, concurrency and the budget hold of a request `count` let through.
        `model_id`: whose token prices apply; None when tokens are not billed (dedicated)."""
        q = caller.quota
        tag = f"{{{caller.org_id}}}"  # one Redis Cluster hash slot for all of an org's keys
        cost = prompt_tokens + max_tokens
        tokens: list[tuple[Limit, Rate, str]] = []
        for who, rate, key in (("key", q.key_tokens, f"k:{caller.key_id}"), ("org", q.org_tokens, "o")):
            if rate is not None:
                if cost > rate.burst:
                    raise APIError(
                        400,
                        f"Request too large: it may use {cost} tokens (prompt {prompt_tokens} + "
                        f"max_tokens {max_tokens}), more than the {who}'s limit of {rate.burst} "
                        "tokens at once. Shorten the prompt or lower max_tokens.",
                        code="request_too_large",
                        param="max_tokens",
                    )
                tokens.append((Limit(f"{tag}:{key}:tpm", rate.per_minute, 60.0, rate.burst, cost), rate, who))
        slots = [
            Slot(f"{tag}:{key}:conc", n)
            for n, key in ((q.key_concurrent, f"k:{caller.key_id}"), (q.org_concurrent, "o"))
            if n
        ]
        rates = await self.rates(model_id) if q.budget is not None and model_id is not None else Rates()
        hold = None
        budget_key = None
        if q.budget is not None:
            month, start, ttl = self._month()
            budget_key = f"{tag}:spend:{month}"
            hold = Hold(
                budget_key,
                request_id,
                units(rates.worst_case(prompt_tokens, max_tokens, batch=caller.batch)),
                units(q.budget) if q.hard_budget else None,
                HOLD_TTL,
            )
        limits = [lim for lim, _, _ in tokens]
        if not (limits or slots or hold):
            return Ticket(caller.org_id, request_id, cost, [], [], rates, None, batch=caller.batch)
        try:
            result = await self.limiter.admit(limits, slots, hold)
            if not result.seeded and hold is not None:
                async with self.sessionmaker() as session:
                    spent = await spend_since(session, caller.org_id, start)
                await self.limiter.seed(hold.key, units(spent), ttl)
                result = await self.limiter.admit(limits, slots, hold)
        except OUTAGE_ERRORS as exc:
            if q.hard_budget:
                raise APIError(
                    503, "Cannot check the budget right now; please retry.", code="limiter_unavailable"
                ) from exc
            log.warning("rate limiter unavailable, admitting %s unchecked: %s", request_id, exc)
            return Ticket(caller.org_id, request_id, 0, [], [], rates, None, batch=caller.batch)
        headers = _headers(result, [], tokens)
        if not result.allowed:
            raise _refusal(result, [], tokens, slots, headers)
        soft = units(q.budget) if q.budget is not None and not q.hard_budget else None
        return Ticket(
            caller.org_id,
            request_id,
            cost,
            [lim for lim, _, _ in tokens],
            slots,
            rates,
            budget_key,
            headers,
            soft,
            batch=caller.batch,
        )

    async def settle(self, ticket: Ticket, prompt: int, cached: int, completion: int) -> None:
        """Give back unused tokens and the slots; replace the hold by the actual cost."""
        if ticket.settled:
            return
        ticket.settled = True
        unused = ticket.charged - prompt - completion
        refunds = [replace(lim, cost=unused) for lim in ticket.token_limits] if unused > 0 else []
        hold = None
        if ticket.budget_key is not None:
            hold = (
                ticket.budget_key,
                ticket.request_id,
                units(ticket.rates.cost(prompt, cached, completion, batch=ticket.batch)),
            )
        try:
            # One round trip: the refunds, the slots and the hold together.
            spent = await self.limiter.finish(refunds, ticket.slots, hold)
            if ticket.budget_key is not None:
                over = ticket.budget is not None and spent is not None and spent > ticket.budget
                if over and ticket.budget_key not in self._alerted:  # once per organisation and month
                    self._alerted.add(ticket.budget_key)
                    log.warning(
                        "organisation %s is over its monthly budget (soft): %s spent of %s",
                        ticket.org_id,
                        Decimal(spent or 0) / NANOS_PER_UNIT,
                        Decimal(ticket.budget or 0) / NANOS_PER_UNIT,
                    )
        except Exception as exc:
            # Slots and holds lapse on their own; the budget counter is re-seeded from the ledger.
            log.warning("could not settle %s with the limiter: %s", ticket.request_id, exc)


def _headers(
    result: Admission, requests: list[tuple[Limit, Rate, str]], tokens: list[tuple[Limit, Rate, str]]
) -> dict[str, str]:
    headers: dict[str, str] = {}
    decisions = result.limits
    for name, group, offset in (("requests", requests, 0), ("tokens", tokens, len(requests))):
        if not group or len(decisions) < offset + len(group):
            continue
        tight = min(range(len(group)), key=lambda i: decisions[offset + i].remaining)
        d, rate = decisions[offset + tight], group[tight][1]
        headers[f"x-ratelimit-limit-{name}"] = str(rate.per_minute)
        headers[f"x-ratelimit-remaining-{name}"] = str(d.remaining)
        headers[f"x-ratelimit-reset-{name}"] = _duration(d.reset_after)
    return headers


def _refusal(
    result: Admission,
    requests: list[tuple[Limit, Rate, str]],
    tokens: list[tuple[Limit, Rate, str]],
    slots: list[Slot],
    headers: dict[str, str],
) -> APIError:
    if not result.budget_ok:
        return APIError(
            429,
            "Your organisation has reached its monthly budget. Raise the budget or wait for the next month.",
            code="insufficient_quota",
            type="insufficient_quota",
            headers=headers,
            reason="budget",
        )
    for i, ((_, rate, who), d) in enumerate(zip(requests + tokens, result.limits, strict=True)):
        if not d.allowed:
            what = "requests" if i < len(requests) else "tokens"
            retry = max(1, math.ceil(d.retry_after))
            return APIError(
                429,
                f"Rate limit reached for {what} per minute of this {who} (limit {rate.per_minute}, "
                f"burst {rate.burst}). Please try again in {_duration(d.retry_after)}.",
                code="rate_limit_exceeded",
                type=what,
                headers={**headers, "retry-after": str(retry)},
                reason=f"rate_limit_{what}",
            )
    for slot, ok in zip(slots, result.slots, strict=True):
        if not ok:
            return APIError(
                429,
                f"Too many concurrent requests (limit {slot.limit}). Please retry when one finishes.",
                code="rate_limit_exceeded",
                type="requests",
                headers={**headers, "retry-after": "1"},
                reason="concurrency",
            )
    return APIError(429, "Request refused by the rate limiter.", code="rate_limit_exceeded", headers=headers)


# The engine's priority class of each service tier (lower runs first): flex is batch work,
# scheduled behind every default request waiting on the same worker.
TIER_PRIORITY: dict[ServiceTier, int] = {"default": 0, "flex": 1}


@dataclass(slots=True)
class Admitted:
    """A request let through admission, with everything needed to serve it."""

    request_id: str
    caller: Caller
    target: Target
    ticket: Ticket
    prompts: list[Prompt] | None = None  # generation: each served as `choices.n` sequences
    choices: Choices = ONE  # how its sequences become its choices
    inputs: list[list[int]] | None = None  # embeddings
    # The request's context, recorded on its usage event: OpenAI's `user` (the caller's end
    # user), the caller's X-Client-Request-Id, and the tier it runs at.
    user: str | None = None
    client_request_id: str | None = None
    service_tier: ServiceTier = "default"
    batch_id: str | None = None  # the batch (/v1/batches) this request is a line of
    series: Series | None = None  # what it is recorded in (`Gateway.admit` sets it)

    @property
    def priority(self) -> int:
        """The engine's priority class it runs at: a batch's line, as flex, behind the rest."""
        return TIER_PRIORITY["flex" if self.batch_id is not None else self.service_tier]

    @property
    def headers(self) -> dict[str, str]:
        """What every answer to it carries: `x-ratelimit-*` (and `x-request-id`)."""
        return {**self.ticket.headers, "x-request-id": self.request_id}
