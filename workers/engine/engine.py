"""The step loop: schedule, run the model, sample, turn tokens into outputs."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.tokenization import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from workers.engine.attention import select_backend
from workers.engine.block_manager import BlockManager
from workers.engine.kv_cache import allocate_kv_cache, kv_budget_bytes, num_blocks_for_budget
from workers.engine.loader import load_model
from workers.engine.runner import ModelRunner
from workers.engine.sampling import SampleOutput, Sampler, SampleRow, SamplingParams, make_generator
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence


@dataclass(slots=True)
class EngineConfig:
    model: str  # an HF directory or a .gguf file
    tokenizer: str | None = None  # a directory with tokenizer.json; default: the model's
    dtype: torch.dtype | None = None  # default: bf16 on CUDA, fp32 elsewhere
    device: str | None = None  # default: CUDA when there is one, else the CPU
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # the token budget of one step
    kv_cache_gib: float = 1.0  # CPU: memory for the KV cache
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of free memory for the KV cache
    num_blocks: int | None = None  # fixed pool size, overriding the budgets
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # "torch" | "triton"; default by device


@dataclass(slots=True)
class Output:
    """What one step produced for one sequence (sample `index` of request `request_id`)."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class _Stream:
    """Per-sequence output state the scheduler does not need."""

    index: int
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    generator: torch.Generator | None
    max_tokens: int


@dataclass(slots=True)
class Stats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, on_kv_event: Callable[[object], None] | None = None) -> None:
        self.config = config
        if config.device is None:
            config.device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(config.device)
        if config.dtype is None:
            config.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        backend = select_backend(device, config.attention_backend)
        self.model, self.model_config = load_model(
            config.model, dtype=config.dtype, device=device, backend=backend
        )
        tok_dir = config.tokenizer or (config.model if Path(config.model).is_dir() else None)
        if tok_dir is None:
            raise ValueError("a .gguf model needs `tokenizer`: a directory with tokenizer.json")
        self.tokenizer = Tokenizer.from_dir(tok_dir)
        cfg = self.model_config
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            budget = kv_budget_bytes(
                device, gpu_fraction=config.gpu_memory_utilization, cpu_gib=config.kv_cache_gib
            )
            num_blocks = num_blocks_for_budget(cfg, config.block_size, config.dtype, budget)
        kv_caches = allocate_kv_cache(cfg, num_blocks, config.block_size, config.dtype, device)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            on_event=on_kv_event,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(self.model, cfg, kv_caches, config.block_size, device)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(cfg.eos_token_ids or self.tokenizer.eos_token_ids)
        self.max_model_len = cfg.max_position_embeddings
        self.stats = Stats()
        self._streams: dict[int, _Stream] = {}
        self._seqs: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()

    # --- requests ----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        priority: int = 0,
        fairness_key: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already running")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context length is {self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params.check_vocab(vocab)
        # Bounded by the context length and by what the whole KV pool can hold.
        pool_tokens = self.block_manager.num_blocks * self.config.block_size
        max_tokens = min(params.max_tokens, min(self.max_model_len, pool_tokens) - len(prompt_token_ids))
        if max_tokens < 1:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this engine holds {pool_tokens}"
            )
        now = time.monotonic()
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                seq_id=next(self._ids),
                request_id=request_id,
                token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids),
                params=params,
                block_table=[],
                priority=priority,
                arrival=now,
                cache_salt=cache_salt,
                adapter_id=adapter_id,
                fairness_key=fairness_key,
            )
            self._streams[seq.seq_id] = _Stream(
                index=index,
                detok=IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
                stops=StopStringMatcher(params.stop),
                generator=make_generator(params.seed, index),
                max_tokens=max_tokens,
            )
            self.scheduler.add(seq)
            seqs.append(seq)
        self._seqs[request_id] = seqs
        self.stats.prompt_tokens += len(prompt_token_ids) * params.n

    def abort(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        for seq in self.scheduler.abort(request_id):
            self._streams.pop(seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_done(self, request_id: str) -> bool:
        """Whether every sample of the request has finished (or it was never added)."""
        return request_id not in self._seqs

    # --- one step ------------------------------------------------------------------------

    def step(self) -> list[Output]:
        scheduled = self.scheduler.schedule()
        batch = scheduled.batch
        # Sequences the scheduler gave up on (too long for the whole KV pool) end here.
        outputs = [self._end(seq) for seq in scheduled.finished if seq.seq_id in self._streams]
        if not batch:
            return outputs
        started = time.perf_counter()
        logits = self.runner.execute(batch)
        # Only sequences whose prompt (or recompute) completes in this step get a token.
        picks = [i for i, (seq, n) in enumerate(batch) if seq.num_computed_tokens + n == len(seq.token_ids)]
        sampled: dict[int, int] = {}
        if picks:
            rows = []
            for i in picks:
                seq = batch[i][0]
                # Only penalties read the history; slicing it for every row would cost O(length).
                history = seq.params.penalized
                rows.append(
                    SampleRow(
                        params=seq.params,
                        prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens] if history else [],
                        output_token_ids=seq.token_ids[seq.num_prompt_tokens :] if history else [],
                        generator=self._streams[seq.seq_id].generator,
                    )
                )
            result = self.sampler(logits[picks], rows)
            for j, i in enumerate(picks):
                sampled[batch[i][0].seq_id] = result.token_ids[j]
        self.scheduler.update(batch, sampled)
        if picks:
            for j, i in enumerate(picks):
                seq = batch[i][0]
                outputs.append(self._emit(seq, result, j))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - started
        self.stats.generation_tokens += len(sampled)
        return outputs

    def _end(self, seq: Sequence) -> Output:
        stream = self._streams.pop(seq.seq_id)
        tail, _ = stream.stops.feed(stream.detok.flush())
        self._forget_if_done(seq.request_id)
        return Output(
            request_id=seq.request_id,
            index=stream.index,
            token_ids=[],
            text=tail + stream.stops.flush(),
            finish_reason=seq.finish_reason or "length",
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_completion_tokens,
        )

    def _forget_if_done(self, request_id: str) -> None:
        if all(s.is_finished for s in self._seqs.get(request_id, [])):
            self._seqs.pop(request_id, None)

    def _emit(self, seq: Sequence, result: SampleOutput, j: int) -> Output:
        stream = self._streams[seq.seq_id]
        token = seq.token_ids[-1]
        params = seq.params
        finish = None
        text = ""
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            finish = "stop"  # the stop token itself is not shown
        else:
            text, stopped = stream.stops.feed(stream.detok.add(token))
            if stopped:
                finish = "stop"
        completion = len(seq.token_ids) - seq.num_prompt_tokens
        if finish is None and completion >= stream.max_tokens:
            finish = "length"
        if finish is not None:
            if not stream.stops.stopped:
                tail, _ = stream.stops.feed(stream.detok.flush())
                text += tail + stream.stops.flush()
            self.scheduler.finish(seq, finish)
            self._streams.pop(seq.seq_id, None)
            self._forget_if_done(seq.request_id)
        want = params.logprobs is not None
        return Output(
            request_id=seq.request_id,
            index=stream.index,
            token_ids=[token],
            text=text,
            finish_reason=finish,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=completion,
            logprobs=[result.logprobs[j]] if want else None,
            top_logprobs=[result.top_logprobs[j]] if want else None,
        )
