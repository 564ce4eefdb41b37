"""A deployment's engine, its vLLM engine arguments and its GPUs per replica: the rules,
whoever asks (admin API, dashboard, CLI).

- `engine` is `builtin` (ours, the default) or `vllm`; vLLM serves generate models (an embed
  deployment's workers are our encoder).
- `engine_args` are vLLM's, checked against tokenmill/vllm_args.py's allowlist (a 400 naming
  `engine_args.<name>`); only a vllm deployment has any, and switching one back to builtin
  drops them. `max_model_len` may not pass the base model's context length.
- `gpus_per_replica` is what one worker holds: what quotas count and GPU-hours multiply. With a
  gpu_type it defaults to, and may not be below, tensor_parallel_size x pipeline_parallel_size
  (1 when unset); without one it is 0 (a CPU deployment holds no GPUs and is billed none).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from control_plane.catalog.models import VLLM
from tokenmill.errors import APIError
from tokenmill.vllm_args import EngineArgError, parallel_size, validate_engine_args


@dataclass(frozen=True, slots=True)
class EngineChoice:
    engine: str
    engine_args: dict[str, Any]
    gpus_per_replica: int


def check_engine_args(
    engine: str, args: Mapping[str, Any], *, kind: str, context_length: int
) -> dict[str, Any]:
    """`args` validated for `engine` and a base model of `kind` and `context_length`."""
    if engine != VLLM:
        if args:
            raise APIError(
                400,
                "engine_args are vLLM's engine arguments: set engine to 'vllm' to use them.",
                param="engine_args",
            )
        return {}
    if kind != "generate":
        raise APIError(
            400, "The vllm engine serves generate models; embed deployments run on builtin.", param="engine"
        )
    try:
        clean = validate_engine_args(args)
    except EngineArgError as exc:
        raise APIError(400, exc.message, param=f"engine_args.{exc.name}") from None
    if clean.get("max_model_len", 0) > context_length:
        raise APIError(
            400,
            f"engine_args.max_model_len ({clean['max_model_len']}) exceeds the base model's context "
            f"length ({context_length}).",
            param="engine_args.max_model_len",
        )
    return clean


def resolve_gpus(gpu_type: str | None, args: Mapping[str, Any], asked: int | None, current: int = 0) -> int:
    """GPUs per replica: `asked` when given (checked), else what the deployment had
    (`current`, 0 for a new one) raised to what its parallelism needs."""
    need = parallel_size(args)
    if gpu_type is None:
        if asked:
            raise APIError(
                400,
                "gpus_per_replica needs a gpu_type: a deployment without one runs on CPUs and holds no GPUs.",
                param="gpus_per_replica",
            )
        return 0
    if asked is None:
        return max(need, current)
    if asked < need:
        raise APIError(
            400,
            f"gpus_per_replica ({asked}) is below what one replica spans: tensor_parallel_size x "
            f"pipeline_parallel_size = {need}.",
            param="gpus_per_replica",
        )
    return asked


def choose_engine(
    engine: str,
    args: Mapping[str, Any],
    gpus: int | None,
    *,
    gpu_type: str | None,
    kind: str,
    context_length: int,
    current_gpus: int = 0,
) -> EngineChoice:
    clean = check_engine_args(engine, args, kind=kind, context_length=context_length)
    return EngineChoice(engine, clean, resolve_gpus(gpu_type, clean, gpus, current_gpus))


# --- `name=value` lines: how the CLI and the dashboard's forms write engine_args ---------------


def parse_assignments(items: Iterable[str]) -> dict[str, Any]:
    """`name=value` items (blank ones skipped) as engine_args: a value reads as JSON when it
    is JSON (`2`, `0.9`, `true`), else as a string (`awq`)."""
    args: dict[str, Any] = {}
    for item in items:
        if not item.strip():
            continue
        name, sep, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or not name or not raw:
            raise APIError(
                400,
                f"Write engine arguments as name=value, one each; got '{item.strip()}'.",
                param="engine_args",
            )
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        # Only scalars: `[1]` or `{"a": 1}` would be a string to vLLM's flags anyway.
        args[name] = value if isinstance(value, bool | int | float | str) else raw
    return args


def format_assignments(args: Mapping[str, Any]) -> list[str]:
    """engine_args as the `name=value` lines `parse_assignments` reads back."""
    return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in args.items()]
