"""Offline batches: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.engine.engine import EngineConfig, LLMEngine
from workers.engine.sampling import SamplingParams


@dataclass(slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class RequestResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]  # one per sample (n)
    cached_tokens: int = 0


@dataclass(slots=True)
class _Acc:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class LLM:
    def __init__(self, model: str, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer

    def add_adapter(self, adapter_id: str, path: str) -> None:
        """Load a PEFT LoRA directory under `adapter_id` (needs `max_loras` > 0)."""
        self.engine.add_adapter(path, adapter_id)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        adapters: str | list[str | None] | None = None,
    ) -> list[RequestResult]:
        """Run every prompt to completion, all in one continuously batched run; `params` is one
        for all prompts or one per prompt, and so is `adapters` (LoRA adapter ids, None = none)."""
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        lora = adapters if isinstance(adapters, list) else [adapters] * len(ids)
        if len(lora) != len(ids):
            raise ValueError(f"{len(ids)} prompts but {len(lora)} adapters")
        each = params if isinstance(params, list) else [params or SamplingParams()] * len(ids)
        if len(each) != len(ids):
            raise ValueError(f"{len(ids)} prompts but {len(each)} sampling params")
        accs: dict[str, list[_Acc]] = {}
        cached: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(ids, each, strict=True)):
            rid = str(i)
            self.engine.add_request(rid, prompt, p, adapter_id=lora[i])
            accs[rid] = [_Acc() for _ in range(p.n)]
        while self.engine.has_unfinished():
            for out in self.engine.step():
                acc = accs[out.request_id][out.index]
                acc.text.append(out.text)
                acc.token_ids += out.token_ids
                acc.finish_reason = out.finish_reason
                acc.logprobs += out.logprobs or []
                acc.top_logprobs += out.top_logprobs or []
                cached[out.request_id] = out.cached_tokens
        return [
            RequestResult(
                request_id=str(i),
                prompt_token_ids=prompt,
                outputs=[
                    Completion(
                        text="".join(a.text),
                        token_ids=a.token_ids,
                        finish_reason=a.finish_reason,
                        logprobs=a.logprobs if each[i].logprobs is not None else None,
                        top_logprobs=a.top_logprobs if each[i].logprobs is not None else None,
                    )
                    for a in accs[str(i)]
                ],
                cached_tokens=cached.get(str(i), 0),
            )
            for i, prompt in enumerate(ids)
        ]
