"""Rate limits with GCRA (generic cell rate algorithm), plus concurrency slots.

GCRA keeps one number per key, the theoretical arrival time (TAT): when the bucket would
be full again if nothing else came. With `interval = period / rate` and a capacity of
`burst` units, a request of `cost` units is allowed when

    max(TAT, now) + cost * interval - burst * interval <= now

and then TAT moves to `max(TAT, now) + cost * interval`. That is a token bucket refilled
continuously at `rate` per `period`, holding at most `burst`, without a refill timer.

- `RedisRateLimiter`: one Lua script (atomic, clock from Redis `TIME`, so every gateway
  replica shares one budget whatever their own clocks say). Keys expire when idle.
- `MemoryRateLimiter`: the same arithmetic in process (embedded mode).

A cost larger than the burst can never be allowed. It is refused with
`retry_after = period` and nothing is charged; callers that want to say "request too
large" rather than "retry later" check `cost > burst` themselves before calling.

`acquire_many` checks several limits (requests/min and tokens/min of a key, say) in one
atomic step: either all are charged or none is, so a request refused on tokens does not
burn a request slot, and it is one round trip to Redis.
"""

from __future__ import annotations

import math
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from tokenmill.settings import Settings

# Floor of a remaining count computed from floats: 9.9999999 units are 10 units.
_EPS = 1e-6


@dataclass(slots=True)
class Decision:
    allowed: bool
    limit: int  # bucket capacity (the burst), what `x-ratelimit-limit-*` reports
    remaining: int  # whole units available right now (after this request's charge)
    reset_after: float  # seconds until the bucket is full again
    retry_after: float  # seconds until this request would be allowed; 0 when allowed


@dataclass(slots=True)
class Limit:
    """One limit to check: `rate` units per `period` seconds, at most `burst` at once."""

    key: str
    rate: int
    period: float = 60.0
    burst: int | None = None
    cost: int = 1

    @property
    def capacity(self) -> int:
        return self.rate if self.burst is None else self.burst

    @property
    def interval(self) -> float:
        return self.period / self.rate

    def validate(self) -> None:
        if self.rate <= 0 or self.period <= 0:
            raise ValueError(f"rate and period must be positive (rate={self.rate}, period={self.period})")
        if self.capacity <= 0:
            raise ValueError(f"burst must be positive (burst={self.burst})")
        if self.cost < 0:
            raise ValueError(f"cost must not be negative (cost={self.cost})")


def _remaining(limit: Limit, tat: float, now: float) -> int:
    units = (limit.capacity * limit.interval - (tat - now)) / limit.interval
    return max(0, math.floor(units + _EPS))


def gcra(limit: Limit, stored_tat: float | None, now: float) -> tuple[Decision, float]:
    """One GCRA step: the decision and the TAT to store if it is applied (pure function).

    The Lua script in `RedisRateLimiter` is a transcription of this.
    """
    tat = now if stored_tat is None or stored_tat < now else stored_tat
    new_tat = tat + limit.cost * limit.interval
    allow_at = new_tat - limit.capacity * limit.interval
    # The tolerance absorbs float error (1/3 s intervals do not add up exactly).
    if limit.cost <= limit.capacity and allow_at <= now + _EPS * limit.interval:
        decision = Decision(True, limit.capacity, _remaining(limit, new_tat, now), new_tat - now, 0.0)
        return decision, new_tat
    retry = limit.period if limit.cost > limit.capacity else allow_at - now
    return Decision(False, limit.capacity, _remaining(limit, tat, now), tat - now, retry), tat


def _uncharged(limit: Limit, stored_tat: float | None, now: float, would_pass: bool) -> Decision:
    """The state of a limit that was not charged because another limit of the batch refused."""
    tat = now if stored_tat is None or stored_tat < now else stored_tat
    return Decision(would_pass, limit.capacity, _remaining(limit, tat, now), tat - now, 0.0)


class RateLimiter(ABC):
    async def acquire(
        self, key: str, *, rate: int, period: float = 60.0, burst: int | None = None, cost: int = 1
    ) -> Decision:
        """Take `cost` units from `key`'s bucket (`rate` per `period`, capacity `burst`, default `rate`)."""
        return (await self.acquire_many([Limit(key, rate, period, burst, cost)]))[0]

    @abstractmethod
    async def acquire_many(self, limits: Sequence[Limit]) -> list[Decision]:
        """Check several limits atomically: all are charged, or none (then nothing changes).

        When one refuses, every decision has `allowed` = whether that limit alone would
        have passed, and remaining/reset_after describe the uncharged state; the refusing
        ones carry their `retry_after`. Overall success is `all(d.allowed for d in result)`.
        On Redis Cluster the keys must share a hash slot (use a `{hash tag}`).
        """

    @abstractmethod
    async def refund(
        self, key: str, *, rate: int, period: float = 60.0, burst: int | None = None, amount: int
    ) -> None:
        """Give `amount` units back (e.g. max_tokens charged up front but not generated).

        The bucket never goes above its capacity.
        """

    @abstractmethod
    async def acquire_concurrency(self, key: str, limit: int, *, ttl: float = 600) -> bool:
        """Take one of `limit` concurrent slots; False when all are taken.

        Each slot expires after `ttl` seconds on its own, so slots held by a crashed
        gateway come back even under steady traffic.
        """

    @abstractmethod
    async def release_concurrency(self, key: str) -> None:
        """Give back one slot taken with `acquire_concurrency`."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to close in memory
        pass


# --- in memory --------------------------------------------------------------------------


class MemoryRateLimiter(RateLimiter):
    """Same algorithm in process, on `time.monotonic`. Safe because nothing here awaits."""

    def __init__(self, clock: Any = time.monotonic):
        self._clock = clock
        self._tats: dict[str, float] = {}
        self._slots: dict[str, list[float]] = {}  # key -> expiry time of each held slot
        self._prune_at = 1024

    def _prune(self, now: float) -> None:
        # Idle keys (bucket full again, no live slots) are dropped, like Redis's TTLs; the
        # threshold doubles so pruning stays amortised O(1).
        if len(self._tats) + len(self._slots) < self._prune_at:
            return
        self._tats = {k: t for k, t in self._tats.items() if t > now}
        self._slots = {k: kept for k, v in self._slots.items() if (kept := [e for e in v if e > now])}
        self._prune_at = max(1024, 2 * (len(self._tats) + len(self._slots)))

    async def acquire_many(self, limits: Sequence[Limit]) -> list[Decision]:
        for limit in limits:
            limit.validate()
        now = self._clock()
        self._prune(now)
        results = [gcra(limit, self._tats.get(limit.key), now) for limit in limits]
        if all(d.allowed for d, _ in results):
            for limit, (_, tat) in zip(limits, results, strict=True):
                self._tats[limit.key] = tat
            return [d for d, _ in results]
        return [
            d if not d.allowed else _uncharged(limit, self._tats.get(limit.key), now, True)
            for limit, (d, _) in zip(limits, results, strict=True)
        ]

    async def refund(
        self, key: str, *, rate: int, period: float = 60.0, burst: int | None = None, amount: int
    ) -> None:
        limit = Limit(key, rate, period, burst, amount)
        limit.validate()
        tat = self._tats.get(key)
        now = self._clock()
        if tat is None or tat <= now:
            return  # already full
        new_tat = tat - amount * limit.interval
        if new_tat <= now:
            del self._tats[key]
        else:
            self._tats[key] = new_tat

    async def acquire_concurrency(self, key: str, limit: int, *, ttl: float = 600) -> bool:
        now = self._clock()
        slots = [e for e in self._slots.get(key, ()) if e > now]
        if len(slots) >= limit:
            self._slots[key] = slots
            return False
        slots.append(now + ttl)
        self._slots[key] = slots
        return True

    async def release_concurrency(self, key: str) -> None:
        slots = self._slots.get(key)
        if not slots:
            return
        # Drop the newest slot (see the Lua script for why not the oldest).
        slots.remove(max(slots))
        if not slots:
            del self._slots[key]


# --- Redis ------------------------------------------------------------------------------

# All times in microseconds from Redis TIME. Lua numbers are doubles: ~1.8e15 µs is still
# exact (< 2^53). Replies are integers (Lua numbers are truncated on the way out), so
# times are rounded up to whole microseconds.
_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local op = ARGV[1]
local EPS = 1e-6

local function remaining(interval, burst, tat)
  local units = math.floor((burst * interval - (tat - now)) / interval + EPS)
  if units < 0 then return 0 end
  return units
end

if op == 'gcra' then
  -- per key i: ARGV[2+4(i-1)..] = interval, burst, cost, period
  local out, tats, new_tats, pass = {}, {}, {}, {}
  local all_ok = true
  for i = 1, #KEYS do
    local base = 4 * (i - 1) + 1
    local interval = tonumber(ARGV[base + 1])
    local burst = tonumber(ARGV[base + 2])
    local cost = tonumber(ARGV[base + 3])
    local tat = tonumber(redis.call('GET', KEYS[i]) or now)
    if tat < now then tat = now end
    local new_tat = tat + cost * interval
    local allow_at = new_tat - burst * interval
    tats[i], new_tats[i] = tat, new_tat
    pass[i] = cost <= burst and allow_at <= now + EPS * interval
    if not pass[i] then
      all_ok = false
      local retry = allow_at - now
      if cost > burst then retry = tonumber(ARGV[base + 4]) end
      out[i] = {0, remaining(interval, burst, tat), math.ceil(retry), math.ceil(tat - now)}
    end
  end
  for i = 1, #KEYS do
    local base = 4 * (i - 1) + 1
    local interval = tonumber(ARGV[base + 1])
    local burst = tonumber(ARGV[base + 2])
    if all_ok then
      local reset = new_tats[i] - now
      -- The key lives exactly as long as the bucket is not full: idle keys vanish.
      if reset > 0 then
        redis.call('SET', KEYS[i], new_tats[i], 'PX', math.ceil(reset / 1000) + 1)
      end
      out[i] = {1, remaining(interval, burst, new_tats[i]), 0, math.ceil(reset)}
    elseif pass[i] then
      out[i] = {1, remaining(interval, burst, tats[i]), 0, math.ceil(tats[i] - now)}
    end
  end
  return out

elseif op == 'refund' then
  -- ARGV[2] = interval, ARGV[3] = amount
  local tat = tonumber(redis.call('GET', KEYS[1]) or 0)
  if tat <= now then return 0 end
  local new_tat = tat - tonumber(ARGV[2]) * tonumber(ARGV[3])
  if new_tat <= now then
    redis.call('DEL', KEYS[1])
  else
    redis.call('SET', KEYS[1], new_tat, 'PX', math.ceil((new_tat - now) / 1000) + 1)
  end
  return 1

elseif op == 'cacquire' then
  -- A sorted set of slots scored by their expiry: each slot expires on its own.
  -- ARGV[2] = limit, ARGV[3] = ttl, ARGV[4] = member (unique per call)
  local ttl = tonumber(ARGV[3])
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[4])
  redis.call('PEXPIRE', KEYS[1], math.ceil(ttl / 1000) + 1)
  return 1

elseif op == 'crelease' then
  -- Remove the newest slot, not the oldest: releasing the oldest would keep pushing a
  -- leaked slot's count onto ever newer entries, so under steady traffic it would never
  -- expire. The newest belongs to someone alive (or expires last anyway).
  redis.call('ZPOPMAX', KEYS[1])
  return 1
end
return redis.error_reply('unknown op ' .. tostring(op))
"""


class RedisRateLimiter(RateLimiter):
    """GCRA and concurrency slots in Redis, shared by every gateway replica."""

    def __init__(self, redis: Redis, *, prefix: str = "tm:rl:", owns_client: bool = False):
        self._redis = redis
        self._prefix = prefix
        self._owns_client = owns_client
        self._script = redis.register_script(_LUA)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisRateLimiter:
        from redis.asyncio import Redis

        return cls(Redis.from_url(url), owns_client=True, **kwargs)

    def _rate_key(self, key: str) -> str:
        return f"{self._prefix}r:{key}"

    def _slot_key(self, key: str) -> str:
        return f"{self._prefix}c:{key}"

    async def acquire_many(self, limits: Sequence[Limit]) -> list[Decision]:
        if not limits:
            return []
        args: list[Any] = ["gcra"]
        for limit in limits:
            limit.validate()
            args += [limit.interval * 1e6, limit.capacity, limit.cost, limit.period * 1e6]
        rows = await self._script(keys=[self._rate_key(limit.key) for limit in limits], args=args)
        return [
            Decision(bool(ok), limit.capacity, int(remaining), int(reset) / 1e6, int(retry) / 1e6)
            for limit, (ok, remaining, retry, reset) in zip(limits, rows, strict=True)
        ]

    async def refund(
        self, key: str, *, rate: int, period: float = 60.0, burst: int | None = None, amount: int
    ) -> None:
        limit = Limit(key, rate, period, burst, amount)
        limit.validate()
        if amount:
            await self._script(keys=[self._rate_key(key)], args=["refund", limit.interval * 1e6, amount])

    async def acquire_concurrency(self, key: str, limit: int, *, ttl: float = 600) -> bool:
        member = secrets.token_hex(8)
        ok = await self._script(keys=[self._slot_key(key)], args=["cacquire", limit, ttl * 1e6, member])
        return bool(ok)

    async def release_concurrency(self, key: str) -> None:
        await self._script(keys=[self._slot_key(key)], args=["crelease"])

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()


def make_limiter(settings: Settings) -> RateLimiter:
    """Redis when REDIS_URL is set (shared by all replicas), else in memory."""
    if settings.redis_url:
        return RedisRateLimiter.from_url(settings.redis_url)
    return MemoryRateLimiter()
