"""The step loop: schedule, run the model, sample, turn tokens into outputs."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.tokenization import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from workers.engine import linear
from workers.engine.attention import CpuAttention, select_backend
from workers.engine.block_manager import BlockManager
from workers.engine.greedy_head import GreedyHead
from workers.engine.greedy_head import plain as plain_greedy
from workers.engine.host_memory import Prefault, keep_freed_heap
from workers.engine.kv_cache import EngineRegistry, allocate_kv_cache, kv_budget_bytes, num_blocks_for_budget
from workers.engine.loader import load_model
from workers.engine.lora import AdapterError, LoraAdapter, load_adapter
from workers.engine.lora_layers import LoraState, attach_lora, select_lora_backend
from workers.engine.lora_slots import AdapterSlots
from workers.engine.runner import ModelRunner
from workers.engine.sampling import SampleOutput, Sampler, SampleRow, SamplingParams, greedy, make_generator
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence
from workers.engine.spec import NgramProposer
from workers.engine.structured import Matcher, StructuredOutputs

log = logging.getLogger(__name__)


KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(slots=True)
class EngineConfig:
    model: str  # an HF directory or a .gguf file
    tokenizer: str | None = None  # a directory with tokenizer.json; default: the model's
    dtype: torch.dtype | None = None  # default: bf16 on CUDA, fp32 elsewhere
    device: str | None = None  # default: CUDA when there is one, else the CPU
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # the token budget of one step
    # CPU: memory for the KV cache; None = a capped share of the host's memory (kv_cache.py)
    kv_cache_gib: float | None = None
    # CPU: how much of the pool a background thread maps in at start (host_memory.py), so that
    # steps do not pay for first touching it; the rest maps in on first use. 0 = none (a
    # worker's default is TOKENMILL_KV_PREFAULT_GIB's).
    kv_prefault_gib: float = 0.0
    # What the KV cache stores: None = the model's dtype; float16 under an fp32 model halves its
    # bytes (twice the tokens in the same memory, half the reads per decode step) at the cost of
    # rounding every key and value to a half (attention's arithmetic stays in the model's dtype).
    kv_cache_dtype: torch.dtype | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of free memory for the KV cache
    num_blocks: int | None = None  # fixed pool size, overriding the budgets
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # "cpu" | "torch" | "triton"; default by device
    # CUDA with Triton attention: decode steps replay CUDA graphs captured at start (cuda_graphs.py)
    cuda_graphs: bool = True
    # Where one-time builds (the CPU attention kernel) are kept: a worker passes its model cache;
    # default TOKENMILL_KERNEL_CACHE or ~/.cache/tokenmill/kernels.
    compile_cache: str | None = None
    # LoRA: device slots for adapters used by running requests (0 = no LoRA), the largest rank,
    # adapters kept loaded on the CPU (default 2 * max_loras), "torch" | "triton" (by device).
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_backend: str | None = None
    # Admission across fairness keys (tenants): "fair" (virtual token counters) or "fcfs"; the
    # service charged per prompt token computed and per token generated.
    scheduling: str = "fair"
    fair_weights: tuple[float, float] = (1.0, 2.0)
    # Speculative decoding by n-gram prompt lookup (greedy requests only): draft tokens verified
    # per step (0 = off), the n-gram sizes looked up, and the most running sequences at which it
    # still speculates (a large batch keeps the hardware busy already; drafts would slow it).
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_disable_by_batch_size: int = 8


@dataclass(slots=True)
class Timings:
    """A finished sequence's life on the engine's clock (time.monotonic(), shared by the
    processes of a host): arrived, first scheduled, first token (0.0 when none came; likewise
    scheduled), finished. The worker builds its queue, prefill and decode spans from these."""

    arrived: float
    scheduled: float
    first_token: float
    finished: float
    preemptions: int = 0


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
    timings: Timings | None = None  # on the sequence's last output


def merge_outputs(a: Output, b: Output) -> Output:
    """`b` appended to `a` (the same sample, `b` the later step): one output for both."""
    return Output(
        request_id=a.request_id,
        index=a.index,
        token_ids=a.token_ids + b.token_ids,
        text=a.text + b.text,
        finish_reason=b.finish_reason,
        prompt_tokens=b.prompt_tokens,
        cached_tokens=b.cached_tokens,
        completion_tokens=b.completion_tokens,
        logprobs=None if a.logprobs is None or b.logprobs is None else a.logprobs + b.logprobs,
        top_logprobs=None
        if a.top_logprobs is None or b.top_logprobs is None
        else a.top_logprobs + b.top_logprobs,
        timings=b.timings,
    )


def take_queued(first: Output, box: asyncio.Queue[Any]) -> tuple[Output, BaseException | None]:
    """`first` merged with the outputs already waiting in `box` (a one-sample request's queue):
    a caller that fell behind gets one output for all of them (one delta, one frame) instead of
    many. An exception met on the way is handed back, for after this output."""
    while first.finish_reason is None and not box.empty():
        nxt = box.get_nowait()
        if isinstance(nxt, BaseException):
            return first, nxt
        first = merge_outputs(first, nxt)
    return first, None


@dataclass(slots=True)
class _Stream:
    """Per-sequence output state the scheduler does not need."""

    index: int
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    generator: torch.Generator | None
    max_tokens: int
    matcher: Matcher | None = None  # where the sequence is in its grammar (structured output)


@dataclass(slots=True)
class Stats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    spec_draft_tokens: int = 0  # draft tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # of those, the ones the model confirmed


# What `add_request` calls for an adapter it has not loaded: a PEFT directory (or the adapter
# itself) for that id; raising AdapterError (or FileNotFoundError) refuses the request.
AdapterLoader = Callable[[str], str | Path | LoraAdapter]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        on_kv_event: Callable[[object], None] | None = None,
        *,
        adapter_loader: AdapterLoader | None = None,
    ) -> None:
        self.config = config
        if config.device is None:
            config.device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(config.device)
        if config.dtype is None:
            config.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        backend = select_backend(device, config.attention_backend, config.compile_cache)
        self.model, self.model_config = load_model(
            config.model, dtype=config.dtype, device=device, backend=backend
        )
        cpu_ops = backend.lib if isinstance(backend, CpuAttention) and config.dtype == torch.float32 else None
        if cpu_ops is not None:
            # The C library that reads the paged cache in place also fuses the elementwise work.
            self.model.use_cpu_ops(cpu_ops)
        # fp32 on the CPU: the projections run from weights packed once (linear.py): for the C
        # library's small-batch kernel where the CPU has AVX-512, else for oneDNN.
        linear.pack(self.model, lib=cpu_ops)
        # Plain greedy rows take their tokens without the full fp32 logits where bf16 pays for it.
        self.greedy_head = GreedyHead.build(self.model.lm_head, cpu_ops)
        tok_dir = config.tokenizer or (config.model if Path(config.model).is_dir() else None)
        if tok_dir is None:
            raise ValueError("a .gguf model needs `tokenizer`: a directory with tokenizer.json")
        self.tokenizer = Tokenizer.from_dir(tok_dir)
        cfg = self.model_config
        kv_dtype = config.kv_cache_dtype or config.dtype
        if kv_dtype not in KV_CACHE_DTYPES:
            names = ", ".join(map(str, KV_CACHE_DTYPES))
            raise ValueError(f"kv_cache_dtype {kv_dtype} is not one of {names}")
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            engines = 1
            if device.type == "cpu" and config.kv_cache_gib is None:
                # Our share of the host: count the engines running here, this one included.
                self._registry = EngineRegistry()
                engines = self._registry.register()
            budget = kv_budget_bytes(
                device,
                gpu_fraction=config.gpu_memory_utilization,
                cpu_gib=config.kv_cache_gib,
                engines=engines,
            )
            num_blocks = num_blocks_for_budget(cfg, config.block_size, kv_dtype, budget)
            log.info(
                "KV cache: %.2f GiB of %s, %d blocks (%d engines on this host)",
                budget / 2**30,
                str(kv_dtype).removeprefix("torch."),
                num_blocks,
                engines,
            )
        kv_caches = allocate_kv_cache(cfg, num_blocks, config.block_size, kv_dtype, device)
        self.prefault: Prefault | None = None
        if device.type == "cpu":
            keep_freed_heap()
            if config.kv_prefault_gib > 0 and isinstance(backend, CpuAttention):
                self.prefault = Prefault(backend.lib, kv_caches, int(config.kv_prefault_gib * 2**30))  # type: ignore[arg-type]
                weakref.finalize(self, self.prefault.stop)  # an engine dropped early frees its pool
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            on_event=on_kv_event,
        )
        # LoRA: the adapted projections read the slots; a sequence starts once its adapter has one.
        self.adapters: AdapterSlots | None = None
        self.adapter_loader = adapter_loader
        lora: LoraState | None = None
        if config.max_loras > 0:
            self.adapters = AdapterSlots(
                cfg,
                max_loras=config.max_loras,
                max_rank=config.max_lora_rank,
                max_cpu_loras=config.max_cpu_loras,
                dtype=config.dtype,
                device=device,
            )
            lora = attach_lora(self.model, self.adapters, select_lora_backend(device, config.lora_backend))
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                policy=config.scheduling,
                prompt_weight=config.fair_weights[0],
                output_weight=config.fair_weights[1],
            ),
            self.block_manager,
            admit=self._admit if self.adapters is not None else None,
        )
        self.runner = ModelRunner(self.model, cfg, kv_caches, config.block_size, device, lora=lora)
        if config.cuda_graphs and device.type == "cuda" and type(backend).__name__ == "TritonAttention":
            # Only the Triton backend is capturable (the PyTorch one plans on the host).
            from workers.engine.cuda_graphs import capture_sizes

            max_blocks = -(-cfg.max_position_embeddings // config.block_size)
            self.runner.capture(capture_sizes(config.max_num_seqs), max_blocks)
        self.sampler = Sampler()
        self.proposer = (
            NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
            if config.num_speculative_tokens > 0
            else None
        )
        self.eos_token_ids = frozenset(cfg.eos_token_ids or self.tokenizer.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer, cfg.vocab_size, sorted(self.eos_token_ids))
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
        if adapter_id is not None and adapter_id not in self.adapter_ids:
            self._load_on_demand(adapter_id)
        # Compiled once per request (GrammarError, a ValueError, if it does not compile); each
        # sample walks the grammar on its own copy.
        matcher = self.structured.matcher(params.grammar) if params.grammar is not None else None
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
                matcher=matcher.copy() if matcher is not None and index else matcher,
            )
            self.scheduler.add(seq)
            seqs.append(seq)
        self._seqs[request_id] = seqs
        self.stats.prompt_tokens += len(prompt_token_ids) * params.n

    # --- LoRA adapters -------------------------------------------------------------------

    @property
    def adapter_ids(self) -> tuple[str, ...]:
        """Loaded adapters, least recently used first (safe to read from any thread)."""
        return self.adapters.ids if self.adapters is not None else ()

    def read_adapter(self, path: str | Path, adapter_id: str) -> LoraAdapter:
        """Parse a PEFT directory for this model; touches no engine state, so a server can
        run it off the engine thread and hand the result to `add_adapter`."""
        if self.adapters is None:
            raise AdapterError("this engine serves no LoRA adapters (max_loras is 0)")
        return load_adapter(
            path,
            self.model_config,
            adapter_id=adapter_id,
            max_rank=self.config.max_lora_rank,
            dtype=self.config.dtype or torch.float32,
        )

    def add_adapter(self, adapter: LoraAdapter | str | Path, adapter_id: str | None = None) -> list[str]:
        """Load an adapter (a LoraAdapter, or a PEFT directory read now under `adapter_id`);
        returns the ids evicted to make room. It takes a device slot when a request uses it."""
        if not isinstance(adapter, LoraAdapter):
            adapter = self.read_adapter(adapter, adapter_id or Path(adapter).name)
        if self.adapters is None:
            raise AdapterError("this engine serves no LoRA adapters (max_loras is 0)")
        return self.adapters.add(adapter, self._adapters_in_use)

    def remove_adapter(self, adapter_id: str) -> None:
        """Unload an adapter; AdapterError if unknown, AdapterBusy while requests use it."""
        if self.adapters is None:
            raise AdapterError(f"adapter {adapter_id!r} is not loaded")
        self.adapters.remove(adapter_id, self._adapters_in_use)

    def _load_on_demand(self, adapter_id: str) -> None:
        if self.adapters is None:
            raise AdapterError("this engine serves no LoRA adapters (max_loras is 0)")
        if self.adapter_loader is None:
            raise AdapterError(f"adapter {adapter_id!r} is not loaded")
        try:
            source = self.adapter_loader(adapter_id)
        except FileNotFoundError as exc:
            raise AdapterError(f"adapter {adapter_id!r} cannot be found: {exc}") from None
        except Exception as exc:  # refuses this request; it must not reach the step loop
            raise AdapterError(f"adapter {adapter_id!r} cannot be loaded: {exc}") from exc
        self.add_adapter(source, adapter_id)

    def _adapters_in_use(self) -> set[str]:
        """Adapters of unfinished sequences (running or waiting): never unloaded."""
        return {
            s.adapter_id
            for seqs in self._seqs.values()
            for s in seqs
            if s.adapter_id is not None and not s.is_finished
        }

    def _admit(self, seq: Sequence) -> bool:
        """The scheduler's gate: a sequence starts once its adapter is in a device slot."""
        if seq.adapter_id is None:
            return True
        assert self.adapters is not None
        return self.adapters.acquire(
            seq.adapter_id,
            lambda: {s.adapter_id for s in self.scheduler.running if s.adapter_id is not None},
        )

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
        if self.proposer is not None:
            self._propose()
        scheduled = self.scheduler.schedule()
        batch = scheduled.batch
        # Sequences the scheduler gave up on (too long for the whole KV pool) end here.
        outputs = [self._end(seq) for seq in scheduled.finished if seq.seq_id in self._streams]
        if not batch:
            return outputs
        started = time.perf_counter()
        accepted: dict[int, int] | None = None
        # Only sequences whose prompt (or recompute) completes in this step get a token.
        picks = [
            i
            for i, (seq, n) in enumerate(batch)
            if seq.num_computed_tokens + n == len(seq.token_ids) + len(seq.spec_token_ids)
        ]
        result: SampleOutput | None = None
        if self.proposer is not None and any(seq.spec_token_ids for seq, _ in batch):
            logits = self.runner.execute(batch, [1 + len(seq.spec_token_ids) for seq, _ in batch])
            logits, accepted = self._verify(batch, logits)
        elif self.greedy_head is not None and all(plain_greedy(batch[i][0].params) for i in picks):
            # Every token wanted is a plain argmax: no full logits (greedy_head.py).
            hidden = self.runner.hidden(batch)
            if len(picks) != hidden.shape[0]:
                hidden = hidden[picks]
            tokens = self.greedy_head(hidden) if picks else []
            result = SampleOutput(tokens, [math.nan] * len(tokens), [[] for _ in tokens])
        else:
            logits = self.runner.execute(batch)
        if result is None and picks:
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
            # After the forward is launched and before its logits are read: on a GPU the masks
            # are computed on the CPU while the model runs.
            self._grammar_masks([batch[i][0] for i in picks], rows)
            # Every row sampled (the hot decode loop): no copy of the [B, vocab] logits.
            result = self.sampler(logits if len(picks) == logits.shape[0] else logits[picks], rows)
        sampled: dict[int, int] = {}
        if result is not None:
            sampled = {batch[i][0].seq_id: result.token_ids[j] for j, i in enumerate(picks)}
        self.scheduler.update(batch, sampled, accepted)
        if picks:
            for j, i in enumerate(picks):
                seq = batch[i][0]
                new = 1 + accepted.get(seq.seq_id, 0) if accepted else 1
                outputs.append(self._emit(seq, result, j, new))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - started
        self.stats.generation_tokens += len(sampled) + (sum(accepted.values()) if accepted else 0)
        return outputs

    # --- speculative decoding ------------------------------------------------------------

    def _propose(self) -> None:
        """Draft tokens for the running decodes that can verify them exactly, unless the batch
        is large. Only plain greedy rows speculate: the greedy token is an argmax of the raw
        logits, which one forward computes for every draft position at once; penalties, biases,
        grammars and logprobs would need each position's own processing, and temperature > 0
        would need rejection sampling (not implemented; those rows decode one token a step)."""
        assert self.proposer is not None
        running = self.scheduler.running
        on = len(running) <= self.config.speculative_disable_by_batch_size
        for seq in running:
            seq.spec_token_ids.clear()
            p = seq.params
            if (
                not on
                or seq.is_prefill
                or not p.greedy
                or p.penalized
                or p.logit_bias
                or p.logprobs is not None
                or p.grammar is not None
            ):
                continue
            # Room for the drafts and the token sampled after them within max_tokens.
            room = self._streams[seq.seq_id].max_tokens - seq.num_completion_tokens - 1
            if room > 0:
                seq.spec_token_ids = self.proposer.propose(seq.token_ids, room)

    def _verify(
        self, batch: list[tuple[Sequence, int]], logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """Greedy verification. `logits` has 1 + len(drafts) rows per sequence: row i predicts
        the token after draft i (row 0, after the last real token). A sequence keeps its drafts
        up to the first that differs from the model's argmax. Returns one row per sequence, the
        one after its last kept draft (where the sampler picks the next token: the model's own
        token instead of the first rejected draft, or one more if all were kept), and how many
        drafts each speculating sequence kept."""
        targets = greedy(logits).tolist()
        rows: list[int] = []
        accepted: dict[int, int] = {}
        row = 0
        for seq, _ in batch:
            drafts = seq.spec_token_ids
            m = 0
            while m < len(drafts) and drafts[m] == targets[row + m]:
                m += 1
            if drafts:
                accepted[seq.seq_id] = m
                self.stats.spec_draft_tokens += len(drafts)
                self.stats.spec_accepted_tokens += m
            rows.append(row + m)
            row += 1 + len(drafts)
        return logits[rows], accepted

    def _grammar_masks(self, seqs: list[Sequence], rows: list[SampleRow]) -> None:
        """Give each constrained row the bitmask of the tokens its grammar allows next."""
        streams = [self._streams[seq.seq_id] for seq in seqs]
        matchers = [(j, s.matcher) for j, s in enumerate(streams) if s.matcher is not None]
        if matchers:
            masks = self.structured.masks([m for _, m in matchers])
            for k, (j, _) in enumerate(matchers):
                rows[j].bitmask = masks[k]

    def _end(self, seq: Sequence) -> Output:
        stream = self._streams.pop(seq.seq_id)
        tail, _ = stream.stops.feed(stream.detok.flush())
        self._forget_if_done(seq.request_id)
        # No tokens, so no logprobs; but empty lists, not None, when they were asked for: merged
        # with earlier outputs (merge_outputs) None would drop theirs.
        want = seq.params.logprobs is not None
        return Output(
            request_id=seq.request_id,
            index=stream.index,
            token_ids=[],
            text=tail + stream.stops.flush(),
            finish_reason=seq.finish_reason or "length",
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_completion_tokens,
            logprobs=[] if want else None,
            top_logprobs=[] if want else None,
            timings=_timings(seq),
        )

    @staticmethod
    def _advance(matcher: Matcher, seq: Sequence, token: int) -> str | None:
        """Feed the grammar; a complete output ends the sequence now (the grammar would allow
        nothing but EOS next). A refused token cannot come from a masked row: report, not hide."""
        if not matcher.advance(token):
            log.error("grammar refused token %d of %s: %s", token, seq.request_id, matcher.error)
            return "error"
        return "stop" if matcher.done else None

    def _forget_if_done(self, request_id: str) -> None:
        if all(s.is_finished for s in self._seqs.get(request_id, [])):
            self._seqs.pop(request_id, None)

    def _emit(self, seq: Sequence, result: SampleOutput, j: int, new: int = 1) -> Output:
        """The output of the `new` tokens this step appended to `seq` (more than one when draft
        tokens were accepted), checking after each one whether the sequence ends there."""
        stream = self._streams[seq.seq_id]
        params = seq.params
        finish = None
        text = ""
        if not seq.first_token_at:
            seq.first_token_at = time.monotonic()
        start = len(seq.token_ids) - new
        tokens = seq.token_ids[start:]
        for i, token in enumerate(tokens):
            if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
                finish = "stop"  # the stop token itself is not shown
            else:
                piece, stopped = stream.stops.feed(stream.detok.add(token))
                text += piece
                if stopped:
                    finish = "stop"
                elif stream.matcher is not None:
                    finish = self._advance(stream.matcher, seq, token)
            if finish is None and start + i + 1 - seq.num_prompt_tokens >= stream.max_tokens:
                finish = "length"
            if finish is not None:
                # Accepted drafts past the end were computed but are not produced: drop them
                # (the sequence finishes now, so nothing reads its tokens as appended-only).
                del tokens[i + 1 :]
                del seq.token_ids[start + i + 1 :]
                break
        completion = len(seq.token_ids) - seq.num_prompt_tokens
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
            token_ids=tokens,
            text=text,
            finish_reason=finish,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=completion,
            logprobs=[result.logprobs[j]] if want else None,
            top_logprobs=[result.top_logprobs[j]] if want else None,
            timings=None if finish is None else _timings(seq),
        )


def _timings(seq: Sequence) -> Timings:
    return Timings(seq.arrival, seq.scheduled_at, seq.first_token_at, time.monotonic(), seq.num_preemptions)
