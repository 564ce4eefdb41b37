"""tests/stalls.py: a blocked event loop is noted with what blocked it; an idle one is not."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests import stalls


async def test_a_blocked_loop_is_noted_with_the_blocking_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stalls, "THRESHOLD", 1.0)
    watch = stalls.LoopWatch()
    start = time.monotonic()
    watch.start(asyncio.get_running_loop())
    try:
        await asyncio.sleep(1.5)  # waiting is not a stall: the loop turns
        assert watch.since(start) == []
        time.sleep(2.5)  # noqa: ASYNC251 (the stall under test)
        await asyncio.sleep(0.1)
    finally:
        watch.stop()
    [noted] = watch.since(start)
    assert noted.startswith("the event loop had not turned for ")
    assert "time.sleep(2.5)" in noted  # the main thread's stack, taken during the stall
    assert "busiest processes:" in noted and "threads' CPU time:" in noted
    assert watch.since(time.monotonic()) == []
