"""The engine in a process of its own, for servers: the step loop never shares a GIL with HTTP.

A server's event loop (HTTP framing, JSON, tokenizing OpenAI prompts) and the engine's step
loop (scheduling, model dispatch, sampling, detokenizing) are both Python. In one process they
take turns on one GIL, and the engine's OpenMP threads sit at a barrier while the event loop
holds it. Here the engine runs in a child process (vLLM V1 splits its API server and EngineCore
the same way) and the two talk over a pipe: requests, aborts and adapter calls in; once per
step, everything the step produced (every request's output, the prefix-cache events, the load
figures) out in one message, which the server's loop dispatches in one callback.

`EngineProcess` has AsyncEngine's interface (generate / abort / call / shutdown), so the
worker's generator runs on either. Messages are pickled by value (tensors of an adapter
included): no shared memory, no file descriptors to pass.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from workers.engine.config import ModelConfig
from workers.engine.engine import EngineConfig, LLMEngine, Output, take_queued
from workers.engine.omp import spin_env
from workers.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineInfo:
    """What a server needs to know of the engine, sent once when it is ready."""

    model_config: ModelConfig
    max_model_len: int
    block_size: int
    adapters_enabled: bool
    tokenizer_dir: str | None


@dataclass(slots=True)
class EngineState:
    """The engine's load and counters after a step (heartbeats and /metrics read these)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    adapter_ids: tuple[str, ...] = ()

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineState:
        bm, stats = engine.block_manager, engine.stats
        return cls(
            running=engine.scheduler.num_running,
            waiting=engine.scheduler.num_waiting,
            kv_usage=bm.usage,
            prefix_cache_queries=bm.queries,
            prefix_cache_hits=bm.hits,
            spec_draft_tokens=stats.spec_draft_tokens,
            spec_accepted_tokens=stats.spec_accepted_tokens,
            adapter_ids=engine.adapter_ids,
        )


@dataclass(slots=True)
class _Batch:
    """One step's news, engine -> server."""

    outputs: list[Output]
    errors: list[tuple[str, BaseException]]  # (request id, why it was refused or failed)
    kv_events: list[object]  # BlockStored / BlockRemoved, in order
    state: EngineState
    results: list[tuple[int, Any, BaseException | None]] = field(default_factory=list)  # calls


# --- the engine process ---------------------------------------------------------------------


def _picklable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a ValueError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return ValueError(str(exc))


def _serve(
    conn: Connection,
    config: EngineConfig,
    loader: Callable[[str], Any] | None,
    threads: int,
    log_level: int,
    log_formatter: logging.Formatter | None,
) -> None:
    """The child's main: build the engine, then step while there is work and read the pipe."""
    import signal

    import torch

    # A spawned process starts with no logging setup: the worker's level and format, on stderr.
    handler = logging.StreamHandler()
    handler.setFormatter(log_formatter or logging.Formatter(_LOG_FORMAT))
    logging.basicConfig(level=log_level, handlers=[handler])
    logging.captureWarnings(True)

    # Ctrl-C (the whole process group) or a SIGTERM meant for the worker must not kill the engine
    # under requests the worker is draining: the worker ends us (a message, or its end of the
    # pipe closing when it exits, however it exits).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    torch.set_num_threads(threads)
    events: list[object] = []
    try:
        engine = LLMEngine(config, on_kv_event=events.append, adapter_loader=loader)
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(("failed", "".join(traceback.format_exception(exc)))))
        return
    tok = config.tokenizer or config.model
    info = EngineInfo(
        model_config=engine.model_config,
        max_model_len=engine.max_model_len,
        block_size=config.block_size,
        adapters_enabled=engine.adapters is not None,
        tokenizer_dir=tok,
    )
    conn.send_bytes(pickle.dumps(("ready", info, EngineState.of(engine))))
    live: set[str] = set()
    errors: list[tuple[str, BaseException]] = []
    results: list[tuple[int, Any, BaseException | None]] = []
    while True:
        # Block only when idle; otherwise take what arrived and step again.
        wait = None if not engine.has_unfinished() else 0.0
        applied = False  # the load figures changed (an abort, an adapter): say so even idle
        try:
            while conn.poll(wait):
                msg = pickle.loads(conn.recv_bytes())
                wait = 0.0
                if msg is None:
                    return
                _apply(engine, msg, live, errors, results)
                applied = True
        except (EOFError, OSError):  # the server is gone: so are its requests
            return
        outputs: list[Output] = []
        if engine.has_unfinished():
            try:
                outputs = engine.step()
            except Exception as exc:  # fail every request in flight rather than hang them
                log.exception("engine step failed")
                failure = _picklable(exc)
                for rid in live:
                    engine.abort(rid)
                    errors.append((rid, failure))
                live.clear()
            for out in outputs:
                if out.finish_reason is not None and engine.is_done(out.request_id):
                    live.discard(out.request_id)
        if outputs or errors or events or results or (applied and not engine.has_unfinished()):
            batch = _Batch(outputs, errors, events[:], EngineState.of(engine), results)
            events.clear()
            errors, results = [], []
            try:
                conn.send_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
            except (BrokenPipeError, OSError):
                return


def _apply(
    engine: LLMEngine,
    msg: tuple[Any, ...],
    live: set[str],
    errors: list[tuple[str, BaseException]],
    results: list[tuple[int, Any, BaseException | None]],
) -> None:
    kind = msg[0]
    if kind == "add":
        _, rid, prompt, params, kwargs = msg
        try:
            engine.add_request(rid, prompt, params, **kwargs)
        except ValueError as exc:  # refused (AdapterError is one): the request's own error
            errors.append((rid, _picklable(exc)))
            return
        live.add(rid)
    elif kind == "abort":
        if msg[1] in live:
            live.discard(msg[1])
            engine.abort(msg[1])
    elif kind == "call":
        _, call_id, name, args = msg
        try:
            results.append((call_id, getattr(engine, name)(*args), None))
        except Exception as exc:
            results.append((call_id, None, _picklable(exc)))


# --- the server's side ----------------------------------------------------------------------

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _log_formatter() -> logging.Formatter | None:
    """The formatter of this process's log handler, for the engine process to log alike (one
    format, e.g. JSON lines, in the worker's output); None if it cannot be sent there."""
    for handler in logging.getLogger().handlers:
        if handler.formatter is not None:
            try:
                pickle.dumps(handler.formatter)
            except Exception:
                return None
            return handler.formatter
    return None


class EngineProcess:
    """AsyncEngine's interface over an engine in a child process."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        adapter_loader: Callable[[str], Any] | None = None,
        threads: int | None = None,
        on_kv_events: Callable[[list[object]], None] | None = None,
        start_timeout: float = 600.0,
    ) -> None:
        import torch

        # spawn, not fork: the parent may already run threads (and OpenMP's pool), which a
        # forked child would inherit half-initialised.
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve,
            args=(
                child,
                config,
                adapter_loader,
                threads or torch.get_num_threads(),
                logging.getLogger().getEffectiveLevel(),
                _log_formatter(),
            ),
            name="tokenmill-engine",
            daemon=True,
        )
        # OpenMP threads that spin briefly, then sleep (workers/engine/omp.py).
        with spin_env():
            self._proc.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self._proc.kill()
            raise RuntimeError("the engine process did not start in time")
        try:
            msg = pickle.loads(self._conn.recv_bytes())
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(
                f"the engine process died while starting (exit {self._proc.exitcode})"
            ) from None
        if msg[0] == "failed":
            self._proc.join(5)
            raise RuntimeError(f"the engine failed to start:\n{msg[1]}")
        self.info: EngineInfo = msg[1]
        self.state: EngineState = msg[2]
        self._on_kv_events = on_kv_events
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests: dict[str, asyncio.Queue[Output | BaseException]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_call = 0
        self._pending_adds = 0  # sent, not yet answered by a step: waiting, as far as load goes
        # Sends go through a thread: a full pipe (the engine mid-step) must not block the loop.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._closed = False
        self._dead: BaseException | None = None  # set once the engine process has exited
        self._sender = threading.Thread(target=self._send_loop, name="engine-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="engine-read", daemon=True)
        self._sender.start()
        self._reader.start()

    # --- AsyncEngine's interface -----------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.state.running

    @property
    def num_waiting(self) -> int:
        return self.state.waiting + self._pending_adds

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
        self._bind()
        if self._dead is not None:
            raise self._dead
        box: asyncio.Queue[Output | BaseException] = asyncio.Queue()
        self._requests[request_id] = box
        self._pending_adds += 1
        self._send(("add", request_id, prompt_token_ids, params, kwargs))
        remaining = params.n
        held: BaseException | None = None  # met while coalescing: raised after that output
        try:
            while remaining:
                item = held or await box.get()
                held = None
                if isinstance(item, BaseException):
                    remaining = 0  # refused or failed: nothing of ours is left to abort
                    raise item
                if coalesce and params.n == 1:
                    item, held = take_queued(item, box)
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            self._requests.pop(request_id, None)
            if remaining:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._send(("abort", request_id))

    async def call(self, name: str, *args: Any) -> Any:
        """`engine.<name>(*args)` in the engine process, between two steps; its result here."""
        self._bind()
        if self._dead is not None:
            raise self._dead
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()
        self._next_call += 1
        self._calls[self._next_call] = future
        self._send(("call", self._next_call, name, args))
        return await future

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._outbox.put(pickle.dumps(None))
        self._outbox.put(None)
        self._sender.join(timeout=10)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    # --- plumbing ----------------------------------------------------------------------------

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop and not self._loop.is_closed():
            raise RuntimeError("an EngineProcess serves one event loop")
        self._loop = loop

    def _send(self, msg: tuple[Any, ...]) -> None:
        if not self._closed:
            self._outbox.put(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_loop(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                return

    def _read_loop(self) -> None:
        while True:
            try:
                batch = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            loop = self._loop
            if loop is None or loop.is_closed():
                self.state = batch.state  # nobody is waiting on outputs yet
                continue
            loop.call_soon_threadsafe(self._dispatch, batch)
        if not self._closed:
            log.error("the engine process exited (code %s)", self._proc.exitcode)
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._fail_all, RuntimeError("the engine process exited"))

    def _dispatch(self, batch: _Batch) -> None:
        """On the event loop, once per step: hand every output to its request."""
        self.state = batch.state
        if batch.kv_events and self._on_kv_events is not None:
            self._on_kv_events(batch.kv_events)
        for out in batch.outputs:
            box = self._requests.get(out.request_id)
            if box is not None:
                box.put_nowait(out)
        for rid, exc in batch.errors:
            box = self._requests.get(rid)
            if box is not None:
                box.put_nowait(exc)
        for call_id, result, error in batch.results:
            future = self._calls.pop(call_id, None)
            if future is None or future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        # Adds the engine has seen are in its own waiting count now; close enough for load.
        self._pending_adds = 0

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        for box in self._requests.values():
            box.put_nowait(exc)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(exc)
        self._calls.clear()
