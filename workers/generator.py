"""The worker's generator on top of the engine: wire requests in, wire deltas out."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

from tokenmill.protocol import GenerateDelta, GenerateRequest, KvOp
from workers.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from workers.engine.block_manager import BlockRemoved, BlockStored


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineGenerator:
    def __init__(self, config: EngineConfig) -> None:
        # Prefix-cache changes, appended on the engine thread (deque appends are atomic) and
        # drained by the worker's publisher on the event loop.
        self.kv_events: deque[KvOp] = deque()
        self.engine = LLMEngine(config, on_kv_event=self._on_kv_event)
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
    def context_length(self) -> int:
        """Most tokens (prompt + completion) one sequence may hold."""
        return self.engine.max_model_len

    def close(self) -> None:
        self._async.shutdown()

    # --- requests ----------------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> None:
        if req.adapter is not None:
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
        self._params(req)

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
