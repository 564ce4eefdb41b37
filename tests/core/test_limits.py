"""GCRA rate limits and concurrency slots, memory and Redis.

Exact arithmetic is checked on the memory limiter with a fake clock; the shared tests run
on both backends against the real clock, with tolerances, and the Redis-only tests check
what only Redis can do (several gateway replicas sharing one budget, key expiry).
"""

from __future__ import annotations

import asyncio
import math
import secrets
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from tokenmill.limits import (
    Decision,
    Hold,
    Limit,
    MemoryRateLimiter,
    RateLimiter,
    RedisRateLimiter,
    Slot,
    gcra,
    make_limiter,
)
from tokenmill.settings import Settings

LimiterFactory = Callable[[], RateLimiter]


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def limiter_factory(
    request: pytest.FixtureRequest, redis_url: str, redis_client: Redis
) -> AsyncIterator[LimiterFactory]:
    """Limiters sharing one state, as gateway replicas would: one Redis (a client each) or,
    for memory, the one in-process instance. Keys get a per-test prefix, deleted after."""
    prefix = f"test:rl:{secrets.token_hex(6)}:"
    made: list[RateLimiter] = []
    shared = MemoryRateLimiter()

    def make() -> RateLimiter:
        if request.param == "memory":
            return shared
        limiter = RedisRateLimiter.from_url(redis_url, prefix=prefix)
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.close()
    keys = [k async for k in redis_client.scan_iter(match=f"{prefix}*")]
    if keys:
        await redis_client.delete(*keys)


@pytest.fixture
def limiter(limiter_factory: LimiterFactory) -> RateLimiter:
    return limiter_factory()


def key() -> str:
    return f"org:{secrets.token_hex(4)}"


# The operations tests use, through the limiter's own (`admit`, `finish`).


async def acquire(
    limiter: RateLimiter,
    k: str,
    *,
    rate: int,
    period: float = 60.0,
    burst: int | None = None,
    cost: int = 1,
) -> Decision:
    """Charge one limit."""
    return (await limiter.admit([Limit(k, rate, period, burst, cost)])).limits[0]


async def refund(
    limiter: RateLimiter, k: str, *, rate: int, period: float = 60.0, burst: int | None = None, amount: int
) -> None:
    """Give `amount` units back to one limit."""
    await limiter.finish([Limit(k, rate, period, burst, amount)])


async def take_slot(limiter: RateLimiter, k: str, limit: int, *, ttl: float = 600.0) -> bool:
    return (await limiter.admit([], [Slot(k, limit, ttl)])).allowed


async def release_slot(limiter: RateLimiter, k: str) -> None:
    await limiter.finish([], [Slot(k, 1)])


async def settle(limiter: RateLimiter, k: str, hold_id: str, actual: int) -> int | None:
    return await limiter.finish([], [], (k, hold_id, actual))


# --- shared behaviour ---------------------------------------------------------------------


async def test_burst_then_steady_rate(limiter: RateLimiter) -> None:
    k = key()
    decisions = [await acquire(limiter, k, rate=60, period=60.0, burst=10) for _ in range(12)]
    assert [d.allowed for d in decisions] == [True] * 10 + [False] * 2
    assert [d.remaining for d in decisions[:10]] == list(range(9, -1, -1))
    assert all(d.limit == 10 for d in decisions)
    assert all(d.retry_after == 0 for d in decisions[:10])
    # 60/min refills one unit per second: the next one is about a second away, and the
    # bucket is full again after about 10 s.
    for d in decisions[10:]:
        assert 0.9 < d.retry_after <= 1.0
        assert d.remaining == 0
        assert 9.5 < d.reset_after <= 10.0
    assert decisions[0].reset_after == pytest.approx(1.0, abs=0.05)


async def test_refills_at_the_rate(limiter: RateLimiter) -> None:
    k = key()
    assert (await acquire(limiter, k, rate=10, period=1.0, burst=1)).allowed
    refused = await acquire(limiter, k, rate=10, period=1.0, burst=1)
    assert not refused.allowed
    assert 0.05 < refused.retry_after <= 0.1
    await asyncio.sleep(refused.retry_after + 0.01)
    assert (await acquire(limiter, k, rate=10, period=1.0, burst=1)).allowed


async def test_cost_and_refund(limiter: RateLimiter) -> None:
    k = key()
    tpm = {"rate": 1000, "period": 60.0}
    # Charge prompt + max_tokens up front.
    d = await acquire(limiter, k, **tpm, cost=800)
    assert d.allowed and d.remaining == 200
    refused = await acquire(limiter, k, **tpm, cost=300)
    assert not refused.allowed
    assert refused.remaining == 200  # what is left, for x-ratelimit-remaining-tokens
    assert 5.9 < refused.retry_after <= 6.0  # 100 missing units at 1000/min

    # The request generated fewer tokens than max_tokens: give back the difference.
    await refund(limiter, k, **tpm, amount=500)
    d = await acquire(limiter, k, **tpm, cost=300)
    assert d.allowed and d.remaining == 400

    # Refunds never fill the bucket beyond its capacity.
    await refund(limiter, k, **tpm, amount=10_000)
    peek = await acquire(limiter, k, **tpm, cost=0)
    assert peek.allowed and peek.remaining == 1000
    assert peek.reset_after == 0
    d = await acquire(limiter, k, **tpm, cost=1000)
    assert d.allowed and d.remaining == 0
    assert not (await acquire(limiter, k, **tpm, cost=1)).allowed


async def test_refund_of_unknown_key_is_harmless(limiter: RateLimiter) -> None:
    k = key()
    await refund(limiter, k, rate=10, amount=5)
    d = await acquire(limiter, k, rate=10, cost=10)
    assert d.allowed and d.remaining == 0


async def test_cost_larger_than_burst_is_refused(limiter: RateLimiter) -> None:
    k = key()
    d = await acquire(limiter, k, rate=100, period=60.0, burst=10, cost=11)
    assert not d.allowed
    assert d.retry_after == pytest.approx(60.0)  # documented: never allowed, retry_after = period
    assert d.remaining == 10 and d.limit == 10
    # Nothing was charged.
    assert (await acquire(limiter, k, rate=100, period=60.0, burst=10, cost=10)).allowed


async def test_acquire_many_is_all_or_nothing(limiter: RateLimiter) -> None:
    rpm = Limit(key(), rate=100, period=60.0)
    tpm = Limit(key(), rate=1000, period=60.0, cost=600)
    first = await limiter.acquire_many([rpm, tpm])
    assert all(d.allowed for d in first)
    assert [d.remaining for d in first] == [99, 400]

    # Tokens refuse: the request unit is not charged either.
    second = await limiter.acquire_many([rpm, tpm])
    assert [d.allowed for d in second] == [True, False]
    assert second[0].remaining == 99 and second[0].retry_after == 0
    assert second[1].remaining == 400 and 11.9 < second[1].retry_after <= 12.0
    assert (await acquire(limiter, rpm.key, rate=100, period=60.0, cost=0)).remaining == 99


async def test_concurrency_slots(limiter: RateLimiter) -> None:
    k = key()
    assert await take_slot(limiter, k, 2)
    assert await take_slot(limiter, k, 2)
    assert not await take_slot(limiter, k, 2)
    await release_slot(limiter, k)
    assert await take_slot(limiter, k, 2)
    assert not await take_slot(limiter, k, 2)
    await release_slot(limiter, k)
    await release_slot(limiter, k)
    await release_slot(limiter, k)  # one too many: harmless, never below zero
    assert await take_slot(limiter, k, 2)
    assert await take_slot(limiter, k, 2)
    assert not await take_slot(limiter, k, 2)


async def test_leaked_slots_expire_under_traffic(limiter: RateLimiter) -> None:
    k = key()
    # A gateway takes a slot and crashes without releasing it.
    assert await take_slot(limiter, k, 2, ttl=0.3)
    # Steady traffic keeps using the other slot meanwhile (t = 0, 0.1, 0.2 s).
    for _ in range(3):
        assert await take_slot(limiter, k, 2, ttl=0.3)
        assert not await take_slot(limiter, k, 2, ttl=0.3)
        await release_slot(limiter, k)
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.1)
    # The leaked slot expired on its own despite the traffic: both slots are free. (Had
    # releases removed the oldest slot, the leak would live on in the newest one.)
    assert await take_slot(limiter, k, 2, ttl=0.3)
    assert await take_slot(limiter, k, 2, ttl=0.3)


async def test_keys_are_independent(limiter: RateLimiter) -> None:
    a, b = key(), key()
    assert (await acquire(limiter, a, rate=1)).allowed
    assert not (await acquire(limiter, a, rate=1)).allowed
    assert (await acquire(limiter, b, rate=1)).allowed
    # A rate key and a concurrency key of the same name do not clash.
    assert await take_slot(limiter, a, 1)


async def test_invalid_limits(limiter: RateLimiter) -> None:
    with pytest.raises(ValueError):
        await acquire(limiter, key(), rate=0)
    with pytest.raises(ValueError):
        await acquire(limiter, key(), rate=10, burst=0)
    with pytest.raises(ValueError):
        await acquire(limiter, key(), rate=10, cost=-1)


async def test_replicas_share_one_budget(limiter_factory: LimiterFactory) -> None:
    a, b = limiter_factory(), limiter_factory()
    k = key()
    results = []
    for i in range(12):
        results.append((await acquire(a if i % 2 else b, k, rate=60, burst=10)).allowed)
    assert results == [True] * 10 + [False] * 2
    assert await take_slot(a, k, 1)
    assert not await take_slot(b, k, 1)
    await release_slot(b, k)
    assert await take_slot(a, k, 1)


async def test_concurrent_acquires_never_overshoot(limiter_factory: LimiterFactory) -> None:
    a, b = limiter_factory(), limiter_factory()
    k = key()
    decisions = await asyncio.gather(*[acquire((a, b)[i % 2], k, rate=600, burst=25) for i in range(60)])
    assert sum(d.allowed for d in decisions) == 25
    slots = await asyncio.gather(*[take_slot((a, b)[i % 2], k, 7) for i in range(30)])
    assert sum(slots) == 7


# --- admission: limits, slots and a budget hold in one step ---------------------------------


async def test_admit_needs_a_seeded_counter(limiter: RateLimiter) -> None:
    k, b = key(), key()
    hold = Hold(b, "r1", amount=5, cap=100)
    first = await limiter.admit([Limit(k, 60, burst=1)], [Slot(k, 1)], hold)
    assert not first.allowed and not first.seeded
    # nothing was charged while unseeded
    assert await limiter.seed(b, 90, ttl=60)
    assert not await limiter.seed(b, 0, ttl=60)  # an existing counter is kept
    ok = await limiter.admit([Limit(k, 60, burst=1)], [Slot(k, 1)], hold)
    assert ok.allowed and ok.seeded and (ok.spent, ok.held) == (90, 5)
    assert ok.limits[0].remaining == 0 and ok.slots == [True]


async def test_admit_is_all_or_nothing(limiter: RateLimiter) -> None:
    k, b = key(), key()
    await limiter.seed(b, 0, ttl=60)
    limits = [Limit(f"{k}:r", 60, burst=5), Limit(f"{k}:t", 1000, cost=400)]
    assert (await limiter.admit(limits, [Slot(k, 1)], Hold(b, "a", 10, cap=15))).allowed
    # the slot is taken: refused, and neither the limits nor the budget were charged
    no_slot = await limiter.admit(limits, [Slot(k, 1)], Hold(b, "b", 1, cap=15))
    assert not no_slot.allowed and no_slot.slots == [False] and no_slot.budget_ok
    assert [d.remaining for d in no_slot.limits] == [4, 600]
    await limiter.finish([], [Slot(k, 1)])
    # the budget would overshoot: refused, slot and limits untouched
    broke = await limiter.admit(limits, [Slot(k, 1)], Hold(b, "c", 6, cap=15))
    assert not broke.allowed and not broke.budget_ok and broke.slots == [True]
    assert (broke.spent, broke.held) == (0, 10)
    assert [d.remaining for d in broke.limits] == [4, 600]
    # settling replaces the hold by the actual cost, freeing the rest of it
    assert await settle(limiter, b, "a", 7) == 7
    again = await limiter.admit(limits, [Slot(k, 1)], Hold(b, "c", 8, cap=15))
    assert again.allowed and (again.spent, again.held) == (7, 8)


async def test_soft_budget_counts_but_never_refuses(limiter: RateLimiter) -> None:
    b = key()
    await limiter.seed(b, 1000, ttl=60)
    a = await limiter.admit([], [], Hold(b, "x", 50, cap=None))
    assert a.allowed and (a.spent, a.held) == (1000, 50)
    assert await settle(limiter, b, "x", 20) == 1020


async def test_settle_without_counter_returns_none(limiter: RateLimiter) -> None:
    assert await settle(limiter, key(), "gone", 5) is None


async def test_holds_never_overshoot_a_hard_cap(limiter_factory: LimiterFactory) -> None:
    b = key()
    replicas = [limiter_factory() for _ in range(3)]
    await replicas[0].seed(b, 0, ttl=60)
    results = await asyncio.gather(
        *(replicas[i % 3].admit([], [], Hold(b, f"h{i}", 7, cap=100)) for i in range(60))
    )
    assert sum(r.allowed for r in results) == 14  # 14 * 7 = 98 <= 100 < 105


async def test_lapsed_holds_free_the_budget() -> None:
    now = [0.0]
    limiter = MemoryRateLimiter(clock=lambda: now[0])
    await limiter.seed("b", 0, ttl=100)
    assert (await limiter.admit([], [], Hold("b", "h", 10, cap=10, ttl=5))).allowed
    assert not (await limiter.admit([], [], Hold("b", "i", 10, cap=10, ttl=5))).allowed
    now[0] = 6.0
    assert (await limiter.admit([], [], Hold("b", "i", 10, cap=10, ttl=5))).allowed


# --- Redis only ---------------------------------------------------------------------------


@pytest.mark.parametrize("client", ["resp", "redis-py"])
async def test_redis_loads_each_script_when_redis_lacks_it(
    redis_url: str, redis_client: Redis, client: str
) -> None:
    """Scripts run by SHA1; after a restart (or SCRIPT FLUSH) each operation loads its own
    script on first use, on the gateway's lean client and on redis-py alike."""
    from tokenmill.limits import _admit, _finish, _seed

    prefix = f"test:rl:{secrets.token_hex(6)}:"
    if client == "resp":
        limiter = RedisRateLimiter.from_url(redis_url, prefix=prefix)
    else:
        limiter = RedisRateLimiter(Redis.from_url(redis_url), prefix=prefix, owns_client=True)
    shas = [_admit.sha, _finish.sha, _seed.sha]
    try:
        await redis_client.script_flush()
        assert (await limiter.admit([Limit("k", 10, burst=5, cost=3)], [Slot("k", 1)])).allowed
        assert await redis_client.script_exists(*shas) == [True, False, False]  # only what ran
        assert await limiter.seed("b", 7, ttl=60)
        assert await limiter.finish([Limit("k", 10, burst=5, cost=3)], [Slot("k", 1)], ("b", "x", 5)) == 12
        assert await redis_client.script_exists(*shas) == [True, True, True]
        await redis_client.script_flush()
        again = await limiter.admit([Limit("k", 10, burst=5, cost=0)], [Slot("k", 1)])
        assert again.allowed and again.limits[0].remaining == 5  # the refund and the release held
    finally:
        await limiter.close()
        keys = [k async for k in redis_client.scan_iter(match=f"{prefix}*")]
        if keys:
            await redis_client.delete(*keys)


async def test_redis_lapsed_holds_free_the_budget(redis_url: str) -> None:
    limiter = RedisRateLimiter.from_url(redis_url, prefix=f"test:rl:{secrets.token_hex(6)}:")
    try:
        await limiter.seed("b", 0, ttl=60)
        assert (await limiter.admit([], [], Hold("b", "h", 10, cap=10, ttl=0.2))).allowed
        assert not (await limiter.admit([], [], Hold("b", "i", 10, cap=10, ttl=0.2))).allowed
        await asyncio.sleep(0.3)
        assert (await limiter.admit([], [], Hold("b", "i", 10, cap=10, ttl=0.2))).allowed
    finally:
        await limiter.close()


async def test_redis_keys_expire_when_idle(redis_url: str, redis_client: Redis) -> None:
    prefix = f"test:rl:{secrets.token_hex(6)}:"
    limiter = RedisRateLimiter.from_url(redis_url, prefix=prefix)
    try:
        await acquire(limiter, "k", rate=10, period=1.0, burst=5, cost=3)
        ttl_ms = await redis_client.pttl(f"{prefix}r:k")
        assert 0 < ttl_ms <= 302  # the bucket is full again after 0.3 s
        await take_slot(limiter, "k", 3, ttl=2.0)
        assert 0 < await redis_client.pttl(f"{prefix}c:k") <= 2001
        # Refunding everything means a full bucket: no key to keep.
        await refund(limiter, "k", rate=10, period=1.0, burst=5, amount=3)
        assert not await redis_client.exists(f"{prefix}r:k")
    finally:
        await limiter.close()
        keys = [k async for k in redis_client.scan_iter(match=f"{prefix}*")]
        if keys:
            await redis_client.delete(*keys)


async def test_redis_uses_the_server_clock(redis_url: str, redis_client: Redis) -> None:
    """The stored TAT is in Redis TIME microseconds, whatever the client's clock says."""
    prefix = f"test:rl:{secrets.token_hex(6)}:"
    limiter = RedisRateLimiter.from_url(redis_url, prefix=prefix)
    try:
        sec, usec = await redis_client.time()
        await acquire(limiter, "k", rate=10, period=1.0)
        tat = float(await redis_client.get(f"{prefix}r:k"))
        assert 0 < tat - (sec * 1_000_000 + usec) <= 100_000 + 50_000
    finally:
        await limiter.close()
        await redis_client.delete(f"{prefix}r:k")


# --- exact arithmetic (memory, fake clock) ------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_exact_gcra_with_fake_clock() -> None:
    clock = FakeClock()
    limiter = MemoryRateLimiter(clock=clock)
    for i in range(10):
        d = await acquire(limiter, "k", rate=60, burst=10)
        assert d == Decision(True, 10, 9 - i, float(i + 1), 0.0)
    assert await acquire(limiter, "k", rate=60, burst=10) == Decision(False, 10, 0, 10.0, 1.0)
    clock.now += 0.5
    assert (await acquire(limiter, "k", rate=60, burst=10)).retry_after == pytest.approx(0.5)
    clock.now += 0.5
    d = await acquire(limiter, "k", rate=60, burst=10)
    assert d.allowed and d.remaining == 0 and d.reset_after == pytest.approx(10.0)
    # Idle long enough, the bucket is full again (and never fuller).
    clock.now += 3600
    assert (await acquire(limiter, "k", rate=60, burst=10)).remaining == 9


def test_gcra_remaining_survives_float_error() -> None:
    # 1/3-second intervals do not add up exactly in binary; remaining must not lose a unit.
    limit = Limit("k", rate=3, period=1.0, burst=3)
    tat = None
    for expected in (2, 1, 0):
        d, tat = gcra(limit, tat, 10.0)
        assert d.allowed and d.remaining == expected
    d, _ = gcra(limit, tat, 10.0)
    assert not d.allowed and math.isclose(d.retry_after, 1 / 3)


async def test_memory_prunes_idle_keys() -> None:
    clock = FakeClock()
    limiter = MemoryRateLimiter(clock=clock)
    for i in range(1500):
        await acquire(limiter, f"old{i}", rate=10, period=1.0)
    clock.now += 2.0  # all those buckets are full again: nothing worth keeping
    for i in range(600):
        await acquire(limiter, f"new{i}", rate=10, period=1.0)
    assert len(limiter._tats) < 1000
    assert "new599" in limiter._tats


async def test_make_limiter(redis_url: str) -> None:
    assert isinstance(make_limiter(Settings(redis_url=None)), MemoryRateLimiter)
    limiter = make_limiter(Settings(redis_url=redis_url))
    assert isinstance(limiter, RedisRateLimiter)
    await limiter.close()
