"""The worker's generator on top of the engine: wire requests in, wire deltas out, and the
LoRA adapters it serves (fetched from storage, read off the engine thread, then registered on it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path

from tokenmill.protocol import GenerateDelta, GenerateRequest, KvOp
from workers.adapters import AdapterProblem, check_adapter_key
from workers.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from workers.engine.block_manager import BlockRemoved, BlockStored
from workers.engine.lora import AdapterBusy, AdapterError

log = logging.getLogger(__name__)

# (adapter id, storage key or None) -> local directory of its PEFT files (workers.adapters).
FetchAdapter = Callable[[str, str | None], Path]


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineGenerator:
    def __init__(self, config: EngineConfig, fetch_adapter: FetchAdapter | None = None) -> None:
        # Prefix-cache changes, appended on the engine thread (deque appends are atomic) and
        # drained by the worker's publisher on the event loop.
        self.kv_events: deque[KvOp] = deque()
        self._fetch = fetch_adapter
        self._keys: dict[str, str] = {}  # adapter id -> the storage key it was loaded from
        self._loading: dict[str, asyncio.Future[list[str]]] = {}  # loads in progress, shared
        self.engine = LLMEngine(
            config,
            on_kv_event=self._on_kv_event,
            adapter_loader=self._fetch_now if fetch_adapter is not None else None,
        )
        self.tokenizer = self.engine.tokenizer
        self.model_dir = Path(config.model)
        self._async = AsyncEngine(self.engine)
        self._ids = itertools.count()

    def _on_kv_event(self, event: BlockStored | BlockRemoved) -> None:
        op = "stored" if isinstance(event, BlockStored) else "removed"
        self.kv_events.append(KvOp(op, [h.hex() for h in event.hashes]))

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
        return self.engine.block_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.engine.block_manager.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.engine.block_manager.hits

    @property
    def spec_draft_tokens(self) -> int:
        return self.engine.stats.spec_draft_tokens

    @property
    def spec_accepted_tokens(self) -> int:
        return self.engine.stats.spec_accepted_tokens

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + completion) one sequence may hold."""
        return self.engine.max_model_len

    def close(self) -> None:
        self._async.shutdown()

    # --- LoRA adapters -------------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        """Loaded adapters (what heartbeats report), least recently used first."""
        return list(self.engine.adapter_ids)

    async def load_adapter(self, adapter_id: str, key: str | None = None) -> list[str]:
        """Make an adapter loaded (fetched from storage unless it is); returns the ids evicted
        to make room. AdapterProblem says why not. Concurrent loads of one adapter share one."""
        if self.engine.adapters is None:
            raise AdapterProblem(400, "this worker does not serve adapters", "adapters_disabled")
        if key:
            key = check_adapter_key(adapter_id, key)
        if adapter_id in self.engine.adapter_ids:
            return []
        pending = self._loading.get(adapter_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load(adapter_id, key))
            self._loading[adapter_id] = pending
            pending.add_done_callback(lambda _: self._loading.pop(adapter_id, None))
        # Shielded: one caller giving up (client gone) must not cancel the others' load.
        return await asyncio.shield(pending)

    async def _load(self, adapter_id: str, key: str | None) -> list[str]:
        if self._fetch is None:
            raise AdapterProblem(
                404,
                f"adapter {adapter_id!r} is not loaded and this worker has no adapter storage",
                "adapter_not_found",
            )
        try:
            path = await asyncio.to_thread(self._fetch, adapter_id, key)
            # Reading the safetensors (and folding the scaling) is the slow part: not on the engine thread.
            adapter = await asyncio.to_thread(self.engine.read_adapter, path, adapter_id)
            if key:
                self._keys[adapter_id] = key
            evicted = await self._async.call(self.engine.add_adapter, adapter)
        except AdapterProblem:
            raise
        except AdapterBusy as exc:
            raise AdapterProblem(409, str(exc), "adapter_slots_busy") from exc
        except AdapterError as exc:
            raise AdapterProblem(400, str(exc), "invalid_adapter") from exc
        except FileNotFoundError as exc:
            raise AdapterProblem(
                404, f"adapter {adapter_id!r} is not in storage: {exc}", "adapter_not_found"
            ) from exc
        except Exception as exc:  # storage down, network: another worker (or a retry) may do
            log.exception("loading adapter %s failed", adapter_id)
            raise AdapterProblem(
                503, f"adapter {adapter_id!r} could not be fetched: {exc}", "adapter_unavailable"
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

    async def unload_adapter(self, adapter_id: str) -> None:
        try:
            await self._async.call(self.engine.remove_adapter, adapter_id)
        except AdapterBusy as exc:
            raise AdapterProblem(409, str(exc), "adapter_in_use") from exc
        except AdapterError as exc:
            raise AdapterProblem(404, str(exc), "adapter_not_loaded") from exc

    # --- requests ----------------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> None:
        if req.adapter is not None and self.engine.adapters is None:
            raise InvalidRequest("this worker does not serve adapters", "adapter")
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequest("prompt_token_ids must not be empty", "prompt_token_ids")
        vocab = self.engine.model_config.vocab_size
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= vocab:
            raise InvalidRequest(f"token ids must be in [0, {vocab})", "prompt_token_ids")
        if n >= self.engine.max_model_len:
            raise InvalidRequest(
                f"prompt has {n} tokens; the context length is {self.engine.max_model_len}",
                "prompt_token_ids",
            )
        params = self._params(req)
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
        """Deltas of one request; the last carries finish_reason. Closing the iterator aborts."""
        params = self._params(req)
        # The engine's id is ours: a client reusing an id must not collide with (or abort) another.
        outputs = self._async.generate(
            f"{req.request_id}#{next(self._ids)}",
            req.prompt_token_ids,
            params,
            cache_salt=req.cache_salt,
            adapter_id=req.adapter,
            priority=req.priority,
            fairness_key=req.fairness_key,
        )
        async with aclosing(outputs) as stream:
            async for out in stream:
                yield GenerateDelta(
                    text=out.text,
                    token_ids=out.token_ids,
                    finish_reason=out.finish_reason,
                    prompt_tokens=out.prompt_tokens,
                    cached_tokens=out.cached_tokens,
                    completion_tokens=out.completion_tokens,
                )
