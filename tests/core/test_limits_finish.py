"""`RateLimiter.finish`: everything a request gives back in one step (one Redis round trip)
leaves the same state as giving back each part in a call of its own (the refunds, the
slots, the hold), and the expected state."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from tokenmill.limits import Hold, Limit, MemoryRateLimiter, RateLimiter, RedisRateLimiter, Slot

Finish = Callable[[RateLimiter, list[Limit], list[Slot], tuple[str, str, int]], Awaitable[int | None]]


async def _one_step(
    lim: RateLimiter, refunds: list[Limit], slots: list[Slot], hold: tuple[str, str, int]
) -> int | None:
    return await lim.finish(refunds, slots, hold)


async def _separately(
    lim: RateLimiter, refunds: list[Limit], slots: list[Slot], hold: tuple[str, str, int]
) -> int | None:
    for r in refunds:
        assert await lim.finish([r]) is None
    for s in slots:
        assert await lim.finish([], [s]) is None
    return await lim.finish([], [], hold)


@pytest.fixture(params=["memory", "redis"])
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], RateLimiter]]:
    made: list[RateLimiter] = []

    def new() -> RateLimiter:
        if request.param == "memory":
            lim: RateLimiter = MemoryRateLimiter()
        else:
            url = request.getfixturevalue("redis_url")
            lim = RedisRateLimiter.from_url(url, prefix=f"test:{secrets.token_hex(4)}:")
        made.append(lim)
        return lim

    yield new
    for lim in made:
        await lim.close()


async def _scenario(lim: RateLimiter, finish: Finish) -> tuple[object, ...]:
    # Per day, so that no bucket refills a unit while the scenario runs (on a busy machine
    # a per-minute bucket of 1000 refills one every 60 ms, and the counts below would drift).
    day = 86400.0
    tpm = [Limit("{o}:k:tpm", 1000, day, 1000, 300), Limit("{o}:o:tpm", 5000, day, 5000, 300)]
    rpm = Limit("{o}:k:rpm", 100, day, 100, 1)
    slots = [Slot("{o}:k:conc", 2), Slot("{o}:o:conc", 3)]
    assert await lim.seed("{o}:spend", 1000, 3600)
    for rid in ("a", "b"):
        assert (await lim.admit([*tpm, rpm], slots, Hold("{o}:spend", rid, 500, 10_000))).allowed
    spent = await finish(
        lim, [Limit(t.key, t.rate, t.period, t.burst, 120) for t in tpm], slots, ("{o}:spend", "a", 42)
    )
    # What is left: tokens (remaining after a zero-cost probe), slots (one more fits, not two),
    # the hold of "a" gone and that of "b" still counted against the cap.
    probe = await lim.admit([Limit(t.key, t.rate, t.period, t.burst, 0) for t in tpm])
    one = await lim.admit([], slots)
    two = await lim.admit([], slots)
    over = await lim.admit([], [], Hold("{o}:spend", "c", 10_000 - 1042 - 500 + 1, 10_000))
    fits = await lim.admit([], [], Hold("{o}:spend", "c", 10_000 - 1042 - 500, 10_000))
    return spent, [d.remaining for d in probe.limits], one.allowed, two.allowed, over.allowed, fits.allowed


async def test_finish_in_one_step_is_each_part_in_turn(make: Callable[[], RateLimiter]) -> None:
    assert (
        await _scenario(make(), _one_step)
        == await _scenario(make(), _separately)
        == (
            1042,
            [1000 - 600 + 120, 5000 - 600 + 120],
            True,
            False,
            False,
            True,
        )
    )


async def test_finish_without_a_hold_or_anything(make: Callable[[], RateLimiter]) -> None:
    lim = make()
    assert await lim.finish() is None
    assert (await lim.admit([], [Slot("s", 1)])).allowed
    assert await lim.finish([], [Slot("s", 1)]) is None
    assert (await lim.admit([], [Slot("s", 1)])).allowed  # the slot came back
    assert await lim.finish([], [], ("gone", "x", 5)) is None  # no counter to settle on
