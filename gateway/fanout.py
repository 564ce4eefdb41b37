"""A request of several sequences (`n` choices, several prompts) streamed as one: each
sequence pumped by a task of its own, their deltas merged as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from tokenmill.openai_shapes import ChoiceDelta


async def merge(sequences: list[AsyncGenerator[ChoiceDelta, None]]) -> AsyncGenerator[ChoiceDelta, None]:
    """The deltas of all `sequences` as they come, each sequence pumped by a task of its own.
    The first failure of one ends this (raised here); closing this cancels the tasks, which
    closes every sequence (and its worker stream) at once."""
    # Unbounded: a sequence yields at most its max_tokens, and a pump must never wait.
    queue: asyncio.Queue[ChoiceDelta | Exception | None] = asyncio.Queue()

    async def pump(sequence: AsyncGenerator[ChoiceDelta, None]) -> None:
        try:
            async with aclosing(sequence):
                async for item in sequence:
                    queue.put_nowait(item)
        except Exception as exc:
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)  # this one is done

    tasks = [asyncio.ensure_future(pump(s)) for s in sequences]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
