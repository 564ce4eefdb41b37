"""Preparing a request off the event loop: chat templates, tokenization, grammars.

One gateway process serves every tenant from one event loop, so a second spent rendering
or tokenizing one request is a second in which nobody else is answered (and in the
embedded server, in which no worker heartbeat is read). Small requests are prepared inline:
handing them to a thread costs more than the work. Larger ones go to a small thread pool
(tokenizing releases the GIL; what holds it, templates and grammars, is bounded by
`tokenmill.request_limits`), one job at a time per organisation, so a tenant sending many
large requests queues behind itself, not in front of the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# Characters of input below which a request is prepared inline (well under a millisecond).
INLINE_CHARS = 16_384


class Prep:
    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gateway-prep")
        # organisation -> (its lock, requests holding or waiting for it); dropped at zero so
        # the table holds only organisations with large requests in flight.
        self._orgs: dict[str, tuple[asyncio.Lock, int]] = {}

    async def run(self, org: str, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` for a request of `org` carrying `size` characters."""
        if size < INLINE_CHARS:
            return fn(*args, **kwargs)
        lock, users = self._orgs.get(org) or (asyncio.Lock(), 0)
        self._orgs[org] = (lock, users + 1)
        try:
            await lock.acquire()
        except BaseException:
            self._leave(org)
            raise
        job = asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

        # The organisation's turn ends when the thread does, not when its caller gives up:
        # a client that disconnects must not let its tenant start more jobs than one.
        def done(f: asyncio.Future[T]) -> None:
            lock.release()
            self._leave(org)
            if not f.cancelled():
                f.exception()  # retrieved, also when the caller is gone: no "never retrieved"

        job.add_done_callback(done)
        return await asyncio.shield(job)

    def _leave(self, org: str) -> None:
        lock, users = self._orgs[org]
        if users == 1:
            del self._orgs[org]
        else:
            self._orgs[org] = (lock, users - 1)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
