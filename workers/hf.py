"""A stop-gap generator on HF transformers, until the engine exists.

One request at a time on CPU: `model.generate` runs in a single worker thread, and every
token is handled inside that thread by a StoppingCriteria (detokenize, stop strings, EOS,
max tokens) which pushes a `GenerateDelta` to the request's asyncio queue. Deciding there,
rather than in a streamer or on the event loop, stops generation exactly at the token that
finished it, with no extra forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from tokenmill.protocol import GenerateDelta, GenerateRequest
from tokenmill.tokenization import IncrementalDetokenizer, StopStringMatcher, Tokenizer

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """A request this generator cannot serve; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class _Job:
    req: GenerateRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerateDelta | None]
    # Set on the event loop when the consumer goes away, read by the generation thread;
    # a plain attribute is enough (one writer, one reader, GIL-atomic).
    aborted: bool = False

    def send(self, item: GenerateDelta | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.aborted = True


class _PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI presence/frequency penalties over the generated tokens (not the prompt), as vLLM."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len = prompt_len
        self.presence = presence
        self.frequency = frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        if out.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@dataclass(slots=True)
class _TokenHandler(StoppingCriteria):
    """Called by HF once per generated token: turns it into a delta and decides to stop."""

    job: _Job
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    stop_ids: frozenset[int]
    max_tokens: int
    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    _done: torch.Tensor = field(default_factory=lambda: torch.ones(1, dtype=torch.bool))
    _running: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.bool))

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.Tensor | None, **kwargs: object
    ) -> torch.Tensor:
        if self.job.aborted:
            return self._done
        if self.finish_reason is None:
            self.on_token(int(input_ids[0, -1]))
        return self._done if self.finish_reason is not None or self.job.aborted else self._running

    def on_token(self, token: int) -> None:
        self.completion_tokens += 1
        text = ""
        if token in self.stop_ids:
            # EOS / stop_token_ids end the turn; their text is never shown.
            self.finish_reason = "stop"
        else:
            text, stopped = self.stops.feed(self.detok.add(token))
            if stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None and self.completion_tokens >= self.max_tokens:
            self.finish_reason = "length"
            text += self.tail()
        self.job.send(self.delta(text, [token]))

    def tail(self) -> str:
        """Text still held back (partial character or partial stop string) at the end."""
        text, stopped = self.stops.feed(self.detok.flush())
        if stopped:
            self.finish_reason = "stop"
            return text
        return text + self.stops.flush()

    def delta(self, text: str, token_ids: list[int]) -> GenerateDelta:
        return GenerateDelta(
            text=text,
            token_ids=token_ids,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=0,
            completion_tokens=self.completion_tokens,
        )


class HFGenerator:
    """Serves `GenerateRequest`s with `AutoModelForCausalLM.generate`, one at a time, on CPU."""

    def __init__(self, model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> None:
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        model.eval()
        gen_cfg = model.generation_config
        eos = set(self.tokenizer.eos_token_ids)
        eos.update(
            [gen_cfg.eos_token_id] if isinstance(gen_cfg.eos_token_id, int) else gen_cfg.eos_token_id or []
        )
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # EOS is handled by _TokenHandler (so ignore_eos and stop_token_ids work the same
        # way); HF must not stop on it by itself.
        if gen_cfg.pad_token_id is None:
            gen_cfg.pad_token_id = min(eos) if eos else 0
        gen_cfg.eos_token_id = None
        self.model = model
        self.vocab_size: int = model.get_input_embeddings().weight.shape[0]
        self.context_length: int | None = getattr(model.config, "max_position_embeddings", None)
        # One thread: requests run strictly one after another, in arrival order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        self._counts_lock = threading.Lock()
        self._running = 0
        self._waiting = 0

    # --- load, for metrics and heartbeats ---

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._waiting

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- requests ---

    def validate(self, req: GenerateRequest) -> None:
        """Raise InvalidRequest if `req` cannot be served."""
        s = req.sampling
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequest("prompt_token_ids must not be empty", "prompt_token_ids")
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= self.vocab_size:
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size})", "prompt_token_ids")
        if self.context_length is not None and n >= self.context_length:
            raise InvalidRequest(
                f"prompt has {n} tokens; the context length is {self.context_length}", "prompt_token_ids"
            )
        if req.adapter is not None:
            raise InvalidRequest("this worker does not serve adapters", "adapter")
        checks = [
            (s.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (s.temperature >= 0, "temperature", "must be >= 0"),
            (0 < s.top_p <= 1, "top_p", "must be in (0, 1]"),
            (s.top_k >= -1, "top_k", "must be >= 0 (0 or -1 disables it)"),
            (0 <= s.min_p <= 1, "min_p", "must be in [0, 1]"),
            (s.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= s.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= s.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (all(0 <= t < self.vocab_size for t in s.stop_token_ids), "stop_token_ids", "out of range"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(f"{param} {message}", param)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream deltas for `req`; the last has finish_reason. Closing the iterator aborts."""
        self.validate(req)
        job = _Job(req=req, loop=asyncio.get_running_loop(), queue=asyncio.Queue())
        with self._counts_lock:
            self._waiting += 1
        future = self._executor.submit(self._run, job)
        finished = False
        try:
            while (delta := await job.queue.get()) is not None:
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    break
            # The thread is returning from generate(); wait for it so that `running` is
            # already 0 when the client sees the end of the stream.
            await asyncio.wrap_future(future)
            finished = True
        finally:
            if not finished:
                # Client gone (generator closed or cancelled): stop at the next token.
                job.aborted = True
                if future.cancel():  # never started: it still counts as waiting
                    with self._counts_lock:
                        self._waiting -= 1

    def _run(self, job: _Job) -> None:
        with self._counts_lock:
            self._waiting -= 1
            self._running += 1
        try:
            if not job.aborted:
                self._generate(job)
        except Exception as exc:  # report to the client rather than killing the stream silently
            log.exception("generation failed for %s", job.req.request_id)
            job.send(
                GenerateDelta(
                    finish_reason="error",
                    error=f"{type(exc).__name__}: {exc}",
                    prompt_tokens=len(job.req.prompt_token_ids),
                )
            )
        finally:
            with self._counts_lock:
                self._running -= 1
            job.send(None)

    def _generate(self, job: _Job) -> None:
        req, s = job.req, job.req.sampling
        prompt = req.prompt_token_ids
        max_tokens = s.max_tokens
        if self.context_length is not None:
            max_tokens = min(max_tokens, self.context_length - len(prompt))
        stop_ids = set(s.stop_token_ids)
        if not s.ignore_eos:
            stop_ids |= self.eos_token_ids
        handler = _TokenHandler(
            job=job,
            detok=IncrementalDetokenizer(self.tokenizer, prompt),
            stops=StopStringMatcher(s.stop),
            stop_ids=frozenset(stop_ids),
            max_tokens=max_tokens,
            prompt_tokens=len(prompt),
        )
        greedy = s.temperature == 0
        config = GenerationConfig(
            max_new_tokens=max_tokens,
            do_sample=not greedy,
            num_beams=1,
            repetition_penalty=s.repetition_penalty,
            pad_token_id=self.model.generation_config.pad_token_id,
        )
        if not greedy:
            config.temperature = s.temperature
            config.top_p = s.top_p
            config.top_k = max(s.top_k, 0)  # explicit 0: HF's default would be 50
            if s.min_p > 0:
                config.min_p = s.min_p
        processors = LogitsProcessorList()
        if s.presence_penalty or s.frequency_penalty:
            processors.append(_PresenceFrequencyPenalty(len(prompt), s.presence_penalty, s.frequency_penalty))
        # Same seed, same text: the generator thread owns torch's global RNG while it runs.
        torch.manual_seed(s.seed if s.seed is not None else secrets.randbits(63))
        input_ids = torch.tensor([prompt], dtype=torch.long)
        with torch.inference_mode():
            self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([handler]),
            )
        if handler.finish_reason is None and not job.aborted:
            # HF stopped on its own (a limit of its own): close the stream as "length".
            handler.finish_reason = "length"
            job.send(handler.delta(handler.tail(), []))
