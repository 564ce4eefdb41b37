"""The worker's generator on top of the engine: wire requests in, wire deltas out, and the
LoRA adapters it serves (fetched from storage, read off the engine's loop, then registered on it).

The engine runs on a thread of this process (`AsyncEngine`, the default: tests and the library)
or, for a served worker, in a process of its own (`EngineProcess`, `process=True`), so that HTTP
and tokenization never hold the engine's GIL.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import torch

from tokenmill import tracing
from tokenmill.errors import APIError
from tokenmill.protocol import GenerateDelta, GenerateRequest, KvOp
from tokenmill.request_limits import check_prompt
from tokenmill.tokenization import Tokenizer
from workers.adapters import AdapterProblem, FetchAdapter, check_adapter_key, fetch_files
from workers.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from workers.engine.block_manager import BlockRemoved, BlockStored
from workers.engine.engine import Output, Timings
from workers.engine.lora import AdapterBusy, AdapterError, LoraAdapter, load_adapter
from workers.engine.process import EngineInfo, EngineProcess, EngineState

log = logging.getLogger(__name__)

# (adapter id, storage key or None) -> local directory of its PEFT files (workers.adapters).


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _FetchById:
    """The engine process's fallback loader (an adapter evicted between `load_adapter` and its
    request reaching the engine): the storage is searched by id. Picklable when `fetch` is."""

    def __init__(self, fetch: FetchAdapter) -> None:
        self.fetch = fetch

    def __call__(self, adapter_id: str) -> Path:
        return self.fetch(adapter_id, None)


class EngineGenerator:
    def __init__(
        self, config: EngineConfig, fetch_adapter: FetchAdapter | None = None, *, process: bool = False
    ) -> None:
        # Prefix-cache changes, appended by the engine (its thread, or the dispatch of its
        # process's messages; deque appends are atomic) and drained by the worker's publisher.
        self.kv_events: deque[KvOp] = deque()
        self._fetch = fetch_adapter
        self._keys: dict[str, str] = {}  # adapter id -> the storage key it was loaded from
        self._loading: dict[str, asyncio.Future[list[str]]] = {}  # loads in progress, shared
        self.model_dir = Path(config.model)
        self._ids = itertools.count()
        self.engine: LLMEngine | None = None
        self._async: AsyncEngine | EngineProcess
        if process:
            self._async = self._proc = EngineProcess(
                config, adapter_loader=self._process_loader(), on_kv_events=self._on_kv_events
            )
            self.info = self._proc.info
            self.tokenizer = Tokenizer.from_dir(self.info.tokenizer_dir or config.model)
        else:
            self.engine = LLMEngine(
                config,
                on_kv_event=self._on_kv_event,
                adapter_loader=self._fetch_now if fetch_adapter is not None else None,
            )
            self.tokenizer = self.engine.tokenizer
            self.info = EngineInfo(
                model_config=self.engine.model_config,
                max_model_len=self.engine.max_model_len,
                block_size=config.block_size,
                adapters_enabled=self.engine.adapters is not None,
                tokenizer_dir=config.tokenizer or config.model,
            )
            self._async = AsyncEngine(self.engine)
        self._config = config

    def _process_loader(self) -> _FetchById | None:
        if self._fetch is None:
            return None
        loader = _FetchById(self._fetch)
        try:
            pickle.dumps(loader)
        except Exception:  # e.g. a lambda: requests retry after loading here instead (generate)
            return None
        return loader

    @property
    def _state(self) -> EngineState:
        """The engine's figures: live on a thread, as of its last step in a process."""
        if self.engine is not None:
            return EngineState.of(self.engine)
        return self._proc.state

    def _on_kv_event(self, event: BlockStored | BlockRemoved) -> None:
        op = "stored" if isinstance(event, BlockStored) else "removed"
        self.kv_events.append(KvOp(op, [h.hex() for h in event.hashes]))

    def _on_kv_events(self, events: list[Any]) -> None:
        for event in events:
            self._on_kv_event(event)

    def drain_kv_events(self) -> list[KvOp]:
        ops = []
        while self.kv_events:
            ops.append(self.kv_events.popleft())
        return ops

    # --- load, for metrics and heartbeats --------------------------------------------------

    @property
    def running(self) -> int:
        return self._async.num_running

    @property
    def waiting(self) -> int:
        return self._async.num_waiting

    @property
    def kv_usage(self) -> float:
        return self._state.kv_usage

    @property
    def prefix_cache_queries(self) -> int:
        return self._state.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self._state.prefix_cache_hits

    @property
    def spec_draft_tokens(self) -> int:
        return self._state.spec_draft_tokens

    @property
    def spec_accepted_tokens(self) -> int:
        return self._state.spec_accepted_tokens

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + completion) one sequence may hold."""
        return self.info.max_model_len

    def close(self) -> None:
        self._async.shutdown()

    # --- LoRA adapters -------------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        """Loaded adapters (what heartbeats report), least recently used first."""
        return list(self._state.adapter_ids)

    async def load_adapter(self, adapter_id: str, key: str | None = None) -> list[str]:
        """Make an adapter loaded (fetched from storage unless it is); returns the ids evicted
        to make room. AdapterProblem says why not. Concurrent loads of one adapter share one."""
        if not self.info.adapters_enabled:
            raise AdapterProblem(400, "this worker does not serve adapters", "adapters_disabled")
        if key:
            key = check_adapter_key(adapter_id, key)
        if adapter_id in self._state.adapter_ids:
            return []
        pending = self._loading.get(adapter_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load(adapter_id, key))
            self._loading[adapter_id] = pending
            pending.add_done_callback(lambda _: self._loading.pop(adapter_id, None))
        # Shielded: one caller giving up (client gone) must not cancel the others' load.
        return await asyncio.shield(pending)

    async def _load(self, adapter_id: str, key: str | None) -> list[str]:
        path = await fetch_files(self._fetch, adapter_id, key)
        try:
            # Reading the safetensors (and folding the scaling) is the slow part: not on the engine's loop.
            adapter = await asyncio.to_thread(self._read_adapter, path, adapter_id)
            if key:
                self._keys[adapter_id] = key
            evicted = await self._call("add_adapter", adapter)
        except AdapterProblem:
            raise
        except AdapterBusy as exc:
            raise AdapterProblem(409, str(exc), "adapter_slots_busy") from exc
        except AdapterError as exc:
            raise AdapterProblem(400, str(exc), "invalid_adapter") from exc
        except Exception as exc:  # its files unreadable, the engine process gone: a retry may do
            log.exception("loading adapter %s failed", adapter_id)
            raise AdapterProblem(
                503, f"adapter {adapter_id!r} could not be loaded: {exc}", "adapter_unavailable"
            ) from exc
        log.info(
            "loaded adapter %s (rank %d, %s, %.1f MB)%s",
            adapter_id,
            adapter.rank,
            "/".join(adapter.target_modules),
            adapter.nbytes / 1e6,
            f"; evicted {', '.join(evicted)}" if evicted else "",
        )
        return evicted

    def _fetch_now(self, adapter_id: str) -> Path:
        """The engine's own fallback, on its thread: an adapter evicted between `load_adapter`
        and its request reaching the engine is fetched again (from the local copy, normally)."""
        assert self._fetch is not None
        return self._fetch(adapter_id, self._keys.get(adapter_id))

    def _read_adapter(self, path: Path, adapter_id: str) -> LoraAdapter:
        """LLMEngine.read_adapter, without the engine (it may be in another process)."""
        return load_adapter(
            path,
            self.info.model_config,
            adapter_id=adapter_id,
            max_rank=self._config.max_lora_rank,
            dtype=self._config.dtype or torch.float32,
        )

    async def _call(self, name: str, *args: Any) -> Any:
        """`engine.<name>(*args)` between two steps, on its thread or in its process."""
        if self.engine is not None:
            return await self._async.call(getattr(self.engine, name), *args)  # type: ignore[arg-type]
        return await self._proc.call(name, *args)

    async def unload_adapter(self, adapter_id: str) -> None:
        try:
            await self._call("remove_adapter", adapter_id)
        except AdapterBusy as exc:
            raise AdapterProblem(409, str(exc), "adapter_in_use") from exc
        except AdapterError as exc:
            raise AdapterProblem(404, str(exc), "adapter_not_loaded") from exc

    # --- requests ----------------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> None:
        if req.adapter is not None and not self.info.adapters_enabled:
            raise InvalidRequest("this worker does not serve adapters", "adapter")
        try:  # the gateway's check again: anything holding the internal token can call a worker
            check_prompt(
                req.prompt_token_ids,
                self.info.max_model_len,
                param="prompt_token_ids",
                vocab_size=self.info.model_config.vocab_size,
            )
        except APIError as exc:
            raise InvalidRequest(exc.message, exc.param) from exc
        params = self._params(req)
        try:  # here, not only on the engine's admission: a 400 before the stream starts
            params.check_vocab(self.info.model_config.vocab_size)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "logit_bias") from exc
        if params.grammar is not None:
            try:  # compiled without the tokenizer here (cheap); the engine compiles it for real
                params.grammar.check()
            except ValueError as exc:
                raise InvalidRequest(str(exc), "grammar") from exc

    def _params(self, req: GenerateRequest) -> SamplingParams:
        try:
            return SamplingParams.from_wire(req.sampling)
        except ValueError as exc:
            raise InvalidRequest(str(exc), getattr(exc, "param", None)) from exc

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Deltas of one request; the last carries finish_reason. Closing the iterator aborts.
        Outputs that queued up while the caller was busy come out as one delta."""
        params = self._params(req)
        for attempt in range(2):
            # The engine's id is ours: a client reusing an id must not collide with (or abort) another.
            outputs = self._async.generate(
                f"{req.request_id}#{next(self._ids)}",
                req.prompt_token_ids,
                params,
                coalesce=True,
                cache_salt=req.cache_salt,
                adapter_id=req.adapter,
                priority=req.priority,
                fairness_key=req.fairness_key,
            )
            started = False
            try:
                async with aclosing(outputs) as stream:
                    async for out in stream:
                        started = True
                        if out.timings is not None:
                            _engine_spans(out, out.timings)
                        yield GenerateDelta(
                            text=out.text,
                            token_ids=out.token_ids,
                            finish_reason=out.finish_reason,
                            prompt_tokens=out.prompt_tokens,
                            cached_tokens=out.cached_tokens,
                            completion_tokens=out.completion_tokens,
                            # One entry per token id (None unless sampling.logprobs was set).
                            logprobs=out.logprobs,
                            top_logprobs=out.top_logprobs,
                        )
                return
            except AdapterError:
                # An engine process has no loader of its own when the fetcher does not pickle:
                # an adapter evicted since `load_adapter` is loaded again here, once.
                if started or attempt or req.adapter is None or self.engine is not None:
                    raise
                await self.load_adapter(req.adapter, req.adapter_key)


def _engine_spans(out: Output, t: Timings) -> None:
    """A finished sequence's queueing, prefill and decode as spans of the request being served
    (when traced: `tracing.CURRENT`), from the times the engine recorded on the way: its step
    loop never calls into tracing."""
    span = tracing.CURRENT.get()
    if span is None:
        return
    arrived, scheduled, first, finished = tracing.wall_ns(
        t.arrived, t.scheduled or t.finished, t.first_token or t.finished, t.finished
    )
    tracing.span_at("engine.queue", span, arrived, scheduled)
    if t.scheduled:
        prompt = {"tokenmill.prompt_tokens": out.prompt_tokens, "tokenmill.cached_tokens": out.cached_tokens}
        tracing.span_at("engine.prefill", span, scheduled, first, attributes=prompt)
    if t.first_token:
        done = {"tokenmill.completion_tokens": out.completion_tokens, "tokenmill.preemptions": t.preemptions}
        tracing.span_at("engine.decode", span, first, finished, attributes=done)
    span.set_attributes(
        {
            "tokenmill.finish_reason": out.finish_reason or "",
            "tokenmill.prompt_tokens": out.prompt_tokens,
            "tokenmill.cached_tokens": out.cached_tokens,
            "tokenmill.completion_tokens": out.completion_tokens,
        }
    )
