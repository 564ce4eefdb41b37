"""Rate limits with GCRA (generic cell rate algorithm), concurrency slots and budget holds.

GCRA keeps one number per key, the theoretical arrival time (TAT): when the bucket would
be full again if nothing else came. With `interval = period / rate` and a capacity of
`burst` units, a request of `cost` units is allowed when

    max(TAT, now) + cost * interval - burst * interval <= now

and then TAT moves to `max(TAT, now) + cost * interval`. That is a token bucket refilled
continuously at `rate` per `period`, holding at most `burst`, without a refill timer.

A cost larger than the burst can never be allowed. It is refused with
`retry_after = period` and nothing is charged; callers that want to say "request too
large" rather than "retry later" check `cost > burst` themselves before calling.

Three operations, each atomic (and one round trip on Redis):

- `admit`: charge several limits (requests/min and tokens/min of a key and of its
  organisation, say), take concurrency slots and place a budget hold, all or nothing, so
  a request refused on tokens does not burn a request slot. A budget is a spend counter in
  integer units (the gateway uses nano-dollars) plus the holds of requests in flight; a
  hold reserves a request's worst-case cost so that concurrent requests cannot overshoot a
  hard cap. The counter is seeded by the caller (from the ledger) the first time it is
  missing: `admit` then changes nothing and says so.
- `finish`: everything a request gives back when it ends: the unused part of its token
  charges, its slots, and its hold replaced by the actual cost.
- `seed`: create the spend counter unless it exists.

Backends:

- `RedisRateLimiter`: one Lua script per operation, run by its SHA1 (atomic, clock from
  Redis `TIME`, so every gateway replica shares one budget whatever their own clocks say).
  Keys expire when idle.
- `MemoryRateLimiter`: the same arithmetic in process (embedded mode).

The GCRA step is written once per backend: `gcra` here, `gcra` in `_GCRA` for Lua.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from tokenmill.resp import RespClient
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


@dataclass(slots=True)
class Slot:
    """One of `limit` concurrent slots under `key`; each expires after `ttl` seconds on its own,
    so slots held by a crashed gateway come back even under steady traffic."""

    key: str
    limit: int
    ttl: float = 600.0


@dataclass(slots=True)
class Hold:
    """Reserve `amount` units of the spend counter `key` for request `id` until settled.

    Refused when spent + held + amount would exceed `cap`; `cap=None` never refuses (a
    soft budget still counts). A hold not settled within `ttl` seconds lapses (a crashed
    gateway must not block an organisation forever).
    """

    key: str
    id: str
    amount: int
    cap: int | None = None
    ttl: float = 3600.0


@dataclass(slots=True)
class Admission:
    allowed: bool
    limits: list[Decision]
    slots: list[bool]  # per slot: whether it had room
    budget_ok: bool = True
    spent: int = 0  # settled spend on the counter
    held: int = 0  # outstanding holds, this request's included when admitted
    seeded: bool = True  # False: the counter is missing; nothing changed, seed and retry


def _remaining(limit: Limit, tat: float, now: float) -> int:
    units = (limit.capacity * limit.interval - (tat - now)) / limit.interval
    return max(0, math.floor(units + _EPS))


def gcra(limit: Limit, stored_tat: float | None, now: float) -> tuple[Decision, float]:
    """One GCRA step: the decision and the TAT to store if it is applied (pure function).

    `_GCRA` is its transcription in Lua. A limit that passes but is not charged (another of
    the batch refused) is described by the step of the same limit at cost 0.
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


class RateLimiter(ABC):
    @abstractmethod
    async def admit(
        self, limits: Sequence[Limit], slots: Sequence[Slot] = (), hold: Hold | None = None
    ) -> Admission:
        """Charge every limit, take every slot and place the hold, atomically, or do nothing.

        When something refuses, every decision has `allowed` = whether that limit alone
        would have passed, and remaining/reset_after describe the uncharged state; the
        refusing ones carry their `retry_after`. When the hold's counter does not exist
        yet, nothing changes and the result has `seeded=False`: call `seed` and try again.
        On Redis Cluster the keys must share a hash slot (use a `{hash tag}`).
        """

    async def acquire_many(self, limits: Sequence[Limit]) -> list[Decision]:
        """`admit` of rate limits alone: their decisions (all charged, or none)."""
        return (await self.admit(limits)).limits

    @abstractmethod
    async def finish(
        self,
        refunds: Sequence[Limit] = (),
        slots: Sequence[Slot] = (),
        hold: tuple[str, str, int] | None = None,
    ) -> int | None:
        """Everything a request gives back when it ends, atomically: each limit's `cost`
        units (never filling a bucket beyond its capacity), one slot of each slot key (the
        newest: releasing the oldest would keep pushing a leaked slot's count onto ever
        newer entries, so under steady traffic it would never expire; the newest belongs to
        someone alive, or expires last anyway), and the hold `(key, hold id, actual)`
        replaced by its actual cost. Returns the new spend; None without a hold or when the
        counter is gone (its next seed reads the ledger, which will hold this request)."""

    @abstractmethod
    async def seed(self, key: str, amount: int, ttl: float) -> bool:
        """Create the spend counter unless it exists. True when this call created it."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to close in memory
        pass


# --- in memory --------------------------------------------------------------------------


class MemoryRateLimiter(RateLimiter):
    """Same algorithm in process, on `time.monotonic`. Safe because nothing here awaits."""

    def __init__(self, clock: Any = time.monotonic):
        self._clock = clock
        self._tats: dict[str, float] = {}
        self._slots: dict[str, list[float]] = {}  # key -> expiry time of each held slot
        self._spent: dict[str, tuple[int, float]] = {}  # key -> (spend, expiry)
        self._holds: dict[str, dict[str, tuple[int, float]]] = {}  # key -> id -> (amount, expiry)
        self._prune_at = 1024

    def _prune(self, now: float) -> None:
        # Idle keys (bucket full again, no live slots) are dropped, like Redis's TTLs; the
        # threshold doubles so pruning stays amortised O(1).
        if len(self._tats) + len(self._slots) < self._prune_at:
            return
        self._tats = {k: t for k, t in self._tats.items() if t > now}
        self._slots = {k: kept for k, v in self._slots.items() if (kept := [e for e in v if e > now])}
        self._prune_at = max(1024, 2 * (len(self._tats) + len(self._slots)))

    def _counter(self, key: str, now: float) -> int | None:
        entry = self._spent.get(key)
        if entry is None or entry[1] <= now:
            self._spent.pop(key, None)
            return None
        return entry[0]

    def _live_holds(self, key: str, now: float) -> dict[str, tuple[int, float]]:
        holds = {i: h for i, h in self._holds.get(key, {}).items() if h[1] > now}
        self._holds[key] = holds
        return holds

    async def admit(
        self, limits: Sequence[Limit], slots: Sequence[Slot] = (), hold: Hold | None = None
    ) -> Admission:
        for limit in limits:
            limit.validate()
        now = self._clock()
        self._prune(now)
        spent = held = 0
        budget_ok = True
        if hold is not None:
            counter = self._counter(hold.key, now)
            if counter is None:
                return Admission(False, [], [], seeded=False)
            spent = counter
            held = sum(a for a, _ in self._live_holds(hold.key, now).values())
            budget_ok = hold.cap is None or spent + held + hold.amount <= hold.cap
        results = [gcra(limit, self._tats.get(limit.key), now) for limit in limits]
        room = [sum(1 for e in self._slots.get(s.key, ()) if e > now) < s.limit for s in slots]
        allowed = budget_ok and all(room) and all(d.allowed for d, _ in results)
        if not allowed:
            decisions = [
                d if not d.allowed else gcra(replace(limit, cost=0), self._tats.get(limit.key), now)[0]
                for limit, (d, _) in zip(limits, results, strict=True)
            ]
            return Admission(False, decisions, room, budget_ok, spent, held)
        for limit, (_, tat) in zip(limits, results, strict=True):
            self._tats[limit.key] = tat
        for slot in slots:
            self._slots[slot.key] = [e for e in self._slots.get(slot.key, ()) if e > now] + [now + slot.ttl]
        if hold is not None:
            self._holds[hold.key][hold.id] = (hold.amount, now + hold.ttl)
            held += hold.amount
        return Admission(True, [d for d, _ in results], room, True, spent, held)

    async def finish(
        self,
        refunds: Sequence[Limit] = (),
        slots: Sequence[Slot] = (),
        hold: tuple[str, str, int] | None = None,
    ) -> int | None:
        for limit in refunds:
            limit.validate()
        now = self._clock()
        for limit in refunds:
            tat = self._tats.get(limit.key)
            if tat is None or tat <= now:
                continue  # already full
            new_tat = tat - limit.cost * limit.interval
            if new_tat <= now:
                del self._tats[limit.key]
            else:
                self._tats[limit.key] = new_tat
        for slot in slots:
            held = self._slots.get(slot.key)
            if held:
                held.remove(max(held))  # the newest (see `RateLimiter.finish`)
                if not held:
                    del self._slots[slot.key]
        if hold is None:
            return None
        key, hold_id, actual = hold
        self._holds.get(key, {}).pop(hold_id, None)
        counter = self._counter(key, now)
        if counter is None:
            return None
        self._spent[key] = (counter + actual, self._spent[key][1])
        return counter + actual

    async def seed(self, key: str, amount: int, ttl: float) -> bool:
        now = self._clock()
        if self._counter(key, now) is not None:
            return False
        self._spent[key] = (amount, now + ttl)
        return True


# --- Redis ------------------------------------------------------------------------------

# All times in microseconds from Redis TIME. Lua numbers are doubles: ~1.8e15 µs is still
# exact (< 2^53). Replies are integers (Lua numbers are truncated on the way out), so
# times are rounded up to whole microseconds. Keys that hold a TAT expire when the bucket
# is full again; slot sets and holds when their last member lapses.
_CLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
"""

# `gcra` and `_remaining` above, in Lua: the decision of one limit at its stored TAT.
# Returns whether it passes, the TAT clamped to now, the TAT to store if it is charged, and
# the retry time when it does not pass.
_GCRA = """
local EPS = 1e-6

local function remaining(interval, burst, tat)
  local units = math.floor((burst * interval - (tat - now)) / interval + EPS)
  if units < 0 then return 0 end
  return units
end

local function gcra(key, interval, burst, cost, period)
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + cost * interval
  local allow_at = new_tat - burst * interval
  if cost <= burst and allow_at <= now + EPS * interval then
    return true, tat, new_tat, 0
  end
  if cost > burst then return false, tat, tat, period end
  return false, tat, tat, allow_at - now
end
"""

_ADMIT = (
    _CLOCK
    + _GCRA
    + """
-- ARGV[1..3] = number of limits, of slots, 1 if there is a hold; then 4 args per limit
-- (interval, burst, cost, period), 3 per slot (limit, ttl, member), 4 for the hold (id,
-- amount, cap or -1, ttl). KEYS = the limits' keys, the slots' keys, then the spend counter
-- and its holds. Replies {1 if admitted, rows, room, budget}, or {-1} when the counter is
-- missing (nothing changed).
local nl, ns, nh = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local a = 4
local budget = {1, 0, 0}
local all_ok = true
if nh == 1 then
  local sk, hk = KEYS[nl + ns + 1], KEYS[nl + ns + 2]
  local spent = redis.call('GET', sk)
  if not spent then return {-1} end
  local b = a + 4 * nl + 3 * ns
  local amount, cap = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local held = 0
  local holds = redis.call('HGETALL', hk)
  for i = 1, #holds, 2 do
    local amt, exp = string.match(holds[i + 1], '^(%-?%d+):(%d+)$')
    if amt == nil or tonumber(exp) <= now then
      redis.call('HDEL', hk, holds[i])
    else
      held = held + tonumber(amt)
    end
  end
  spent = tonumber(spent)
  local ok = 1
  if cap >= 0 and spent + held + amount > cap then ok = 0; all_ok = false end
  budget = {ok, spent, held}
end
local params, tats, new_tats, pass, rows = {}, {}, {}, {}, {}
for i = 1, nl do
  local interval, burst = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local ok, tat, new_tat, retry = gcra(KEYS[i], interval, burst, tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
  a = a + 4
  params[i], tats[i], new_tats[i], pass[i] = {interval, burst}, tat, new_tat, ok
  if not ok then
    all_ok = false
    rows[i] = {0, remaining(interval, burst, tat), math.ceil(retry), math.ceil(tat - now)}
  end
end
local room, members = {}, {}
for j = 1, ns do
  local k = KEYS[nl + j]
  local lim, ttl = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  members[j] = {ARGV[a + 2], ttl}
  a = a + 3
  redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
  room[j] = 1
  if redis.call('ZCARD', k) >= lim then room[j] = 0; all_ok = false end
end
for i = 1, nl do
  local interval, burst = params[i][1], params[i][2]
  if all_ok then
    local reset = new_tats[i] - now
    if reset > 0 then
      redis.call('SET', KEYS[i], new_tats[i], 'PX', math.ceil(reset / 1000) + 1)
    end
    rows[i] = {1, remaining(interval, burst, new_tats[i]), 0, math.ceil(reset)}
  elseif pass[i] then  -- would pass, not charged: described at its current TAT
    rows[i] = {1, remaining(interval, burst, tats[i]), 0, math.ceil(tats[i] - now)}
  end
end
if all_ok then
  for j = 1, ns do
    local ttl = members[j][2]
    redis.call('ZADD', KEYS[nl + j], now + ttl, members[j][1])
    redis.call('PEXPIRE', KEYS[nl + j], math.ceil(ttl / 1000) + 1)
  end
  if nh == 1 then
    local hk = KEYS[nl + ns + 2]
    local b = 4 + 4 * nl + 3 * ns
    local ttl = tonumber(ARGV[b + 3])
    redis.call('HSET', hk, ARGV[b], ARGV[b + 1] .. ':' .. string.format('%d', now + ttl))
    if redis.call('PTTL', hk) < math.ceil(ttl / 1000) + 1 then
      redis.call('PEXPIRE', hk, math.ceil(ttl / 1000) + 1)
    end
    budget[3] = budget[3] + tonumber(ARGV[b + 1])
  end
end
local ok_all = 0
if all_ok then ok_all = 1 end
return {ok_all, rows, room, budget}
"""
)

_FINISH = (
    _CLOCK
    + """
-- ARGV[1..3] = number of refunds, of slots, 1 if there is a hold; then 2 args per refund
-- (interval, amount) and 2 for the hold (id, actual). KEYS = the refunds' keys, the slots'
-- keys, then the spend counter and its holds. Returns the new spend, -1 when the counter is
-- gone, -2 without a hold.
local nr, ns, nh = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, nr do
  local tat = tonumber(redis.call('GET', KEYS[i]) or 0)
  if tat > now then
    local new_tat = tat - tonumber(ARGV[2 + 2 * i]) * tonumber(ARGV[3 + 2 * i])
    if new_tat <= now then
      redis.call('DEL', KEYS[i])
    else
      redis.call('SET', KEYS[i], new_tat, 'PX', math.ceil((new_tat - now) / 1000) + 1)
    end
  end
end
for j = 1, ns do
  redis.call('ZPOPMAX', KEYS[nr + j])  -- the newest slot (see RateLimiter.finish)
end
if nh == 0 then return -2 end
local a = 4 + 2 * nr
redis.call('HDEL', KEYS[nr + ns + 2], ARGV[a])
if redis.call('EXISTS', KEYS[nr + ns + 1]) == 0 then return -1 end
return redis.call('INCRBY', KEYS[nr + ns + 1], ARGV[a + 1])
"""
)

_SEED = """
-- ARGV[1] = amount, ARGV[2] = ttl in ms
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""


class _Script:
    """A Lua script run by its SHA1 (EVALSHA) and loaded when Redis does not know it (first
    use, or after a restart): what redis-py's `register_script` does, on either client."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, redis: Redis | RespClient, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except Exception as exc:
            # redis-py raises NoScriptError (its message without the code), RespClient a
            # ResponseError starting with the code.
            if type(exc).__name__ != "NoScriptError" and not str(exc).startswith("NOSCRIPT"):
                raise
        await redis.execute_command("SCRIPT", "LOAD", self.source)
        return await redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


_admit, _finish, _seed = _Script(_ADMIT), _Script(_FINISH), _Script(_SEED)


class RedisRateLimiter(RateLimiter):
    """GCRA, concurrency slots and budget holds in Redis, shared by every gateway replica.

    `redis` is a redis-py client or, from `from_url`, the lean `RespClient` (a fraction of
    the CPU per call, and every request makes one or two).
    """

    def __init__(self, redis: Redis | RespClient, *, prefix: str = "tm:rl:", owns_client: bool = False):
        self._redis = redis
        self._prefix = prefix
        self._owns_client = owns_client
        # Slot members need only be unique: a random prefix per limiter and a counter (no
        # system call for randomness on every request).
        self._member = secrets.token_hex(8) + ":"
        self._members = itertools.count()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisRateLimiter:
        from tokenmill.resp import RespClient

        try:
            client: Redis | RespClient = RespClient.from_url(url)
        except ValueError:  # a URL only redis-py reads (e.g. sentinel): the general client
            from redis.asyncio import Redis

            client = Redis.from_url(url)
        return cls(client, owns_client=True, **kwargs)

    def _rate_key(self, key: str) -> str:
        return f"{self._prefix}r:{key}"

    def _slot_key(self, key: str) -> str:
        return f"{self._prefix}c:{key}"

    def _budget_keys(self, key: str) -> list[str]:
        return [f"{self._prefix}b:{key}", f"{self._prefix}h:{key}"]

    async def admit(
        self, limits: Sequence[Limit], slots: Sequence[Slot] = (), hold: Hold | None = None
    ) -> Admission:
        keys = [self._rate_key(limit.key) for limit in limits] + [self._slot_key(s.key) for s in slots]
        args: list[Any] = [len(limits), len(slots), 0 if hold is None else 1]
        for limit in limits:
            limit.validate()
            args += [limit.interval * 1e6, limit.capacity, limit.cost, limit.period * 1e6]
        for slot in slots:
            args += [slot.limit, slot.ttl * 1e6, f"{self._member}{next(self._members)}"]
        if hold is not None:
            keys += self._budget_keys(hold.key)
            args += [hold.id, hold.amount, -1 if hold.cap is None else hold.cap, hold.ttl * 1e6]
        reply = await _admit(self._redis, keys, args)
        if reply[0] == -1:
            return Admission(False, [], [], seeded=False)
        ok, rows, room, (budget_ok, spent, held) = reply
        decisions = [
            Decision(bool(allowed), limit.capacity, int(remaining), int(reset) / 1e6, int(retry) / 1e6)
            for limit, (allowed, remaining, retry, reset) in zip(limits, rows, strict=True)
        ]
        return Admission(bool(ok), decisions, [bool(r) for r in room], bool(budget_ok), int(spent), int(held))

    async def finish(
        self,
        refunds: Sequence[Limit] = (),
        slots: Sequence[Slot] = (),
        hold: tuple[str, str, int] | None = None,
    ) -> int | None:
        refunds = [limit for limit in refunds if limit.cost]
        if not (refunds or slots or hold):
            return None
        keys = [self._rate_key(limit.key) for limit in refunds] + [self._slot_key(s.key) for s in slots]
        args: list[Any] = [len(refunds), len(slots), 0 if hold is None else 1]
        for limit in refunds:
            limit.validate()
            args += [limit.interval * 1e6, limit.cost]
        if hold is not None:
            keys += self._budget_keys(hold[0])
            args += [hold[1], hold[2]]
        spent = int(await _finish(self._redis, keys, args))
        return None if spent < 0 else spent

    async def seed(self, key: str, amount: int, ttl: float) -> bool:
        keys = self._budget_keys(key)[:1]
        return bool(await _seed(self._redis, keys, [amount, max(1, int(ttl * 1000))]))

    async def close(self) -> None:
        if self._owns_client:
            await self._redis.aclose()


def make_limiter(settings: Settings) -> RateLimiter:
    """Redis when REDIS_URL is set (shared by all replicas), else in memory."""
    if settings.redis_url:
        return RedisRateLimiter.from_url(settings.redis_url)
    return MemoryRateLimiter()
