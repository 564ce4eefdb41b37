"""The inference engine: paged KV cache, continuous batching, prefix caching, sampling.

A library usable alone::

    from workers.engine import LLM, SamplingParams
    llm = LLM("path/to/hf-model")
    print(llm.generate(["Hello"], SamplingParams(max_tokens=20))[0].outputs[0].text)

It knows nothing of tenants, HTTP or databases: a request is prompt token ids, sampling
parameters, an optional adapter id, a cache salt, a priority and an opaque fairness key.
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy: `from workers.engine.scheduler import Scheduler` must not load torch and the model
# code, and the Triton backend must only be imported when selected.
_EXPORTS = {
    "LLM": "llm",
    "Completion": "llm",
    "RequestResult": "llm",
    "AsyncEngine": "async_engine",
    "EngineConfig": "engine",
    "LLMEngine": "engine",
    "Output": "engine",
    "SamplingParams": "sampling",
    "Grammar": "structured",  # SamplingParams(grammar=Grammar("json_schema", ...)): structured output
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'workers.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"workers.engine.{_EXPORTS[name]}"), name)
