"""vLLM engine arguments a deployment may set: the allowlist with types and ranges, and their
rendering as the flags vLLM's OpenAI server takes.

In the core because both sides use it: the control plane validates a deployment's
`engine_args` with it (control_plane/catalog/engines.py turns its errors into 400s), and a
vLLM worker, which imports nothing of the control plane, renders the same dict as flags
(`--tensor-parallel-size 2`, `--enable-prefix-caching` / `--no-enable-prefix-caching`).
The autoscaler hands the dict to a worker as JSON in `TOKENMILL_VLLM_ENGINE_ARGS`.

Names are vLLM's own (its `EngineArgs` fields, vLLM 0.32). Anything not listed is refused:
an allowlist, because a flag like `--trust-remote-code` or `--load-format` would let a
deployment run code or read files the platform never checked, and the flags a worker sets
itself (block size, KV events, the model, the port...) must stay the worker's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

ENGINE_ARGS_ENV = "TOKENMILL_VLLM_ENGINE_ARGS"

# Weight quantizations vLLM 0.32 knows and that apply to checkpoints a tenant brings
# (AWQ, GPTQ, FP8, compressed-tensors, ModelOpt, MXFP4...); the `_marlin` variants are the
# faster kernels for the same AWQ/GPTQ checkpoints.
QUANTIZATIONS = (
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "fp8",
    "compressed-tensors",
    "experts_int8",
    "moe_wna16",
    "modelopt",
    "modelopt_fp4",
    "mxfp4",
    "torchao",
)
DTYPES = ("auto", "float16", "bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks

# Set by the worker for every vLLM it starts, so the fleet sees it as one of ours.
WORKER_OWNED = frozenset(
    {
        "model",
        "served_model_name",
        "host",
        "port",
        "api_key",
        "block_size",
        "enable_prompt_tokens_details",
        "kv_events_config",
        "tokenizer",
        "lora_modules",
    }
)


@dataclass(frozen=True, slots=True)
class Arg:
    """One allowed argument: its JSON type, and a range [low, high] or a set of choices."""

    kind: type[bool] | type[int] | type[float] | type[str]
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, high]: `low` itself is refused
    choices: tuple[Any, ...] = ()


ALLOWED: dict[str, Arg] = {
    # Parallelism: a replica spans tensor_parallel_size x pipeline_parallel_size GPUs.
    "tensor_parallel_size": Arg(int, 1, 64),
    "pipeline_parallel_size": Arg(int, 1, 64),
    "enable_expert_parallel": Arg(bool),
    "disable_custom_all_reduce": Arg(bool),
    # Weights and numbers.
    "quantization": Arg(str, choices=QUANTIZATIONS),
    "dtype": Arg(str, choices=DTYPES),
    "kv_cache_dtype": Arg(str, choices=KV_CACHE_DTYPES),
    "seed": Arg(int, 0, 2**32 - 1),
    # Memory and context.
    "max_model_len": Arg(int, 1, 16_777_216),
    "gpu_memory_utilization": Arg(float, 0, 1, low_open=True),
    "cpu_offload_gb": Arg(float, 0, 4096),
    "enforce_eager": Arg(bool),
    "disable_sliding_window": Arg(bool),
    # Scheduling.
    "enable_prefix_caching": Arg(bool),
    "enable_chunked_prefill": Arg(bool),
    "max_num_seqs": Arg(int, 1, 65_536),
    "max_num_batched_tokens": Arg(int, 1, 16_777_216),
    "scheduling_policy": Arg(str, choices=("fcfs", "priority")),
    # LoRA adapters (loaded at run time through vLLM's adapter endpoints).
    "enable_lora": Arg(bool),
    "max_loras": Arg(int, 1, 1024),
    "max_lora_rank": Arg(int, choices=LORA_RANKS),
    "max_cpu_loras": Arg(int, 1, 4096),
}


class EngineArgError(ValueError):
    """An argument is unknown or has a wrong type or value; `name` is the argument's."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message


def _check(name: str, value: Any) -> Any:
    spec = ALLOWED.get(name)
    if spec is None:
        if name in WORKER_OWNED:
            raise EngineArgError(name, f"engine_args.{name} is set by the worker; it cannot be changed.")
        raise EngineArgError(
            name, f"Unknown vLLM engine argument '{name}'; allowed: {', '.join(sorted(ALLOWED))}."
        )
    # bool is an int to Python: a JSON `true` is never a number here, nor 1 a boolean.
    if spec.kind is bool:
        ok = isinstance(value, bool)
    elif spec.kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, spec.kind) and not isinstance(value, bool)
    if not ok:
        expected = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
        raise EngineArgError(name, f"engine_args.{name} must be {expected[spec.kind]}.")
    if spec.kind is float:
        value = float(value)
    if spec.choices and value not in spec.choices:
        raise EngineArgError(
            name, f"engine_args.{name} must be one of {', '.join(map(str, spec.choices))}; got {value!r}."
        )
    if spec.low is not None and (value <= spec.low if spec.low_open else value < spec.low):
        above = "above" if spec.low_open else "at least"
        raise EngineArgError(name, f"engine_args.{name} must be {above} {spec.low:g}; got {value!r}.")
    if spec.high is not None and value > spec.high:
        raise EngineArgError(name, f"engine_args.{name} must be at most {spec.high:g}; got {value!r}.")
    return value


def _at_least(args: Mapping[str, Any], big: str, small: str) -> None:
    if big in args and small in args and args[big] < args[small]:
        raise EngineArgError(
            big,
            f"engine_args.{big} ({args[big]}) must be at least {small} ({args[small]}), as vLLM requires.",
        )


def validate_engine_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """`args` checked against the allowlist, in the allowlist's order (numbers for floats
    as floats); raises EngineArgError naming the first wrong argument."""
    for name in args:
        if not isinstance(name, str) or name not in ALLOWED:
            _check(str(name), None)
    clean = {name: _check(name, args[name]) for name in ALLOWED if name in args}
    # What vLLM would refuse at start-up, after the replica got its GPUs: refused here.
    _at_least(clean, "max_num_batched_tokens", "max_num_seqs")
    _at_least(clean, "max_cpu_loras", "max_loras")
    if clean.get("enable_chunked_prefill") is False:
        _at_least(clean, "max_num_batched_tokens", "max_model_len")
    return clean


def parallel_size(args: Mapping[str, Any]) -> int:
    """GPUs one replica spans: tensor_parallel_size x pipeline_parallel_size (1 each unset)."""
    return int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))


def vllm_flags(args: Mapping[str, Any]) -> list[str]:
    """Validated `args` as vLLM OpenAI server flags, in the allowlist's order: booleans as
    `--name` / `--no-name` (vLLM's BooleanOptionalAction), the rest as `--name value`."""
    flags: list[str] = []
    for name, value in validate_engine_args(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, repr(value) if isinstance(value, float) else str(value)]
    return flags


def encode_engine_args(args: Mapping[str, Any]) -> str:
    """Validated `args` as the JSON of `TOKENMILL_VLLM_ENGINE_ARGS`."""
    return msgspec.json.encode(validate_engine_args(args)).decode()


def decode_engine_args(text: str | None) -> dict[str, Any]:
    """`TOKENMILL_VLLM_ENGINE_ARGS` (JSON object; empty or unset: none), validated."""
    if not text or not text.strip():
        return {}
    try:
        args = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise EngineArgError("", f"{ENGINE_ARGS_ENV} is not JSON: {exc}") from None
    if not isinstance(args, dict):
        raise EngineArgError("", f"{ENGINE_ARGS_ENV} must be a JSON object of vLLM engine arguments.")
    return validate_engine_args(args)


def lora_enabled(args: Mapping[str, Any]) -> bool:
    """Adapters cost speed and memory on vLLM (on CPU they turn off torch.compile): on only
    when the deployment asks (`enable_lora`, or a `max_loras`)."""
    return bool(args.get("enable_lora", "max_loras" in args))


def schedules_by_priority(args: Mapping[str, Any]) -> bool:
    """vLLM takes a request's priority (flex behind default) only when it schedules by
    priority, the worker's default; a deployment may ask for `fcfs` instead."""
    return args.get("scheduling_policy", "priority") == "priority"


def vllm_server_flags(
    args: Mapping[str, Any], *, prefix_caching: bool = True, max_lora_rank: int = 64
) -> list[str]:
    """The deployment's engine arguments as flags (`vllm_flags`), then the worker's own
    defaults where the deployment says nothing: no prefix caching when TOKENMILL_PREFIX_CACHING
    is off; with adapters, LoRA on and TOKENMILL_MAX_LORA_RANK, so every adapter the control
    plane accepted loads; scheduling by priority, so flex requests wait behind default ones.
    One function for the vLLM a worker starts and the pod's sidecar."""
    flags = vllm_flags(args)
    if "scheduling_policy" not in args:
        flags += ["--scheduling-policy", "priority"]
    if "enable_prefix_caching" not in args and not prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if lora_enabled(args):
        if "enable_lora" not in args:
            flags.append("--enable-lora")
        if "max_lora_rank" not in args and max_lora_rank in LORA_RANKS:
            flags += ["--max-lora-rank", str(max_lora_rank)]
    return flags


def compact_json(value: dict[str, Any]) -> str:
    # Sorted keys, no spaces: what Terraform's jsonencode writes, so both sides hash alike.
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def kv_events_config(endpoint: str) -> str:
    """vLLM's --kv-events-config: its ZMQ publisher on `endpoint`, which the worker subscribes to."""
    return compact_json({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})


def structured_outputs_config() -> str:
    """vLLM's --structured-outputs-config: llguidance (our engine's grammar library, so a
    `lark` grammar means the same on both engines) and compact JSON (small models given free
    whitespace pad with newlines until max_tokens)."""
    return compact_json({"backend": "guidance", "disable_any_whitespace": True})
