"""The engine for servers: requests in from the event loop, steps on a thread of their own.

The step loop holds the CPU (or waits on the GPU) for milliseconds at a time, so it runs
off the event loop. The engine itself is not thread-safe: every call into it happens on
the engine thread, which takes new requests and aborts from an inbox between steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from workers.engine.engine import LLMEngine, Output, take_queued
from workers.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kwargs: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue[Output | BaseException]


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    """A function to run on the engine thread between steps (e.g. loading an adapter)."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Add | _Abort | _Call | None] = queue.Queue()
        self._requests: dict[str, _Add] = {}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    @property
    def num_running(self) -> int:
        return self.engine.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + self._inbox.qsize()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        coalesce: bool = False,
        **kwargs: Any,
    ) -> AsyncIterator[Output]:
        """Outputs of one request until all its samples finish; closing the iterator aborts it.
        With `coalesce`, outputs of a sample that queued up meanwhile come merged into one."""
        outbox: asyncio.Queue[Output | BaseException] = asyncio.Queue()
        self._inbox.put(
            _Add(request_id, prompt_token_ids, params, kwargs, asyncio.get_running_loop(), outbox)
        )
        remaining = params.n
        held: BaseException | None = None  # met while coalescing: raised after that output
        try:
            while remaining:
                item = held or await outbox.get()
                held = None
                if isinstance(item, BaseException):
                    remaining = 0  # refused or failed: nothing of ours is left to abort
                    raise item
                if coalesce and params.n == 1:
                    item, held = take_queued(item, outbox)
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the engine thread, between two steps; its result or exception here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(_Call(lambda: fn(*args), loop, future))
        return await future

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # --- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            # Block only when idle; otherwise take what arrived and step again.
            idle = not self.engine.has_unfinished()
            try:
                msg = self._inbox.get(block=idle)
            except queue.Empty:
                msg = _NOTHING
            while msg is not _NOTHING:
                if msg is None:
                    return
                self._apply(msg)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = _NOTHING
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # fail every request in flight rather than hang them
                log.exception("engine step failed")
                for rid, add in list(self._requests.items()):
                    self.engine.abort(rid)
                    add.loop.call_soon_threadsafe(add.outbox.put_nowait, exc)
                self._requests.clear()
                continue
            for out in outputs:
                add = self._requests.get(out.request_id)
                if add is None:
                    continue
                add.loop.call_soon_threadsafe(add.outbox.put_nowait, out)
                if out.finish_reason is not None and self.engine.is_done(out.request_id):
                    self._requests.pop(out.request_id, None)

    def _apply(self, msg: _Add | _Abort | _Call) -> None:
        if isinstance(msg, _Call):
            try:
                result, error = msg.fn(), None
            except Exception as exc:
                result, error = None, exc
            msg.loop.call_soon_threadsafe(_settle, msg.future, result, error)
            return
        if isinstance(msg, _Abort):
            if self._requests.pop(msg.request_id, None) is not None:
                self.engine.abort(msg.request_id)
            return
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, **msg.kwargs)
        except ValueError as exc:
            msg.loop.call_soon_threadsafe(msg.outbox.put_nowait, exc)
            return
        self._requests[msg.request_id] = msg


_NOTHING: Any = object()


def _settle(future: asyncio.Future[Any], result: Any, error: Exception | None) -> None:
    if future.done():  # the caller went away (cancelled) meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
