"""Leader election: of all running reconcilers, only the holder of the lease acts.

Every reconciler watches the fleet; only one may start and stop workers, or two would each
start the missing replica. The lease is a Redis key holding the leader's id with a TTL:
the leader renews it every interval, and when it dies the key expires and another takes it.
Renewal and release check the holder inside Redis (a Lua script), so a leader that paused
past its TTL cannot extend or delete a lease that someone else took meanwhile.
"""

from __future__ import annotations

import logging
from typing import Protocol

from redis.asyncio import Redis

log = logging.getLogger("tokenmill.autoscaler.leader")

LEASE_KEY = "tm:autoscaler:leader"

# Take the lease if it is free, renew it if it is ours; 1 when we hold it afterwards.
_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease(Protocol):
    holder: str

    async def hold(self) -> bool:
        """Take or renew the lease; True while this process leads."""
        ...

    async def release(self) -> None: ...


class SoleLease:
    """The embedded mode: one server, so it always leads."""

    def __init__(self, holder: str = "embedded") -> None:
        self.holder = holder

    async def hold(self) -> bool:
        return True

    async def release(self) -> None:
        return None


class RedisLease:
    def __init__(self, redis: Redis, holder: str, ttl: float, key: str = LEASE_KEY) -> None:
        self.redis = redis
        self.holder = holder
        self.ttl_ms = max(1, int(ttl * 1000))
        self.key = key
        self._hold = redis.register_script(_HOLD)
        self._release = redis.register_script(_RELEASE)
        self.leading = False

    async def hold(self) -> bool:
        try:
            leading = bool(await self._hold(keys=[self.key], args=[self.holder, self.ttl_ms]))
        except Exception as exc:
            # Cannot tell whether we still lead: stop acting. A leader cut off from Redis
            # would otherwise go on while another takes the expired lease.
            log.warning("autoscaler lease: %s; not acting until Redis answers", exc)
            leading = False
        if leading != self.leading:
            log.info("%s %s the autoscaler lease", self.holder, "took" if leading else "lost")
        self.leading = leading
        return leading

    async def release(self) -> None:
        try:
            await self._release(keys=[self.key], args=[self.holder])
        except Exception as exc:
            log.warning("autoscaler lease: could not release (%s); it expires by itself", exc)
        self.leading = False
