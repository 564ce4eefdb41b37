"""vLLM engine arguments: the allowlist's types and ranges, and the flags they render as, read
back by the real vLLM's own argument parser (the CPU build in .venv-vllm, `make vllm`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tokenmill.vllm_args import (
    ALLOWED,
    ENGINE_ARGS_ENV,
    EngineArgError,
    decode_engine_args,
    encode_engine_args,
    parallel_size,
    validate_engine_args,
    vllm_flags,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("TOKENMILL_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"

# One value of every allowed argument, none at vLLM's default, so the parser must read each.
EVERY = {
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 3,
    "enable_expert_parallel": True,
    "disable_custom_all_reduce": True,
    "quantization": "awq_marlin",
    "dtype": "bfloat16",
    "kv_cache_dtype": "fp8_e5m2",
    "seed": 1234,
    "max_model_len": 4096,
    "gpu_memory_utilization": 0.85,
    "cpu_offload_gb": 2.5,
    "enforce_eager": True,
    "disable_sliding_window": True,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
    "max_num_seqs": 48,
    "max_num_batched_tokens": 8192,
    "scheduling_policy": "priority",
    "enable_lora": True,
    "max_loras": 3,
    "max_lora_rank": 32,
    "max_cpu_loras": 6,
}


def test_every_allowed_argument_is_exercised() -> None:
    assert set(EVERY) == set(ALLOWED)


def test_flags_in_allowlist_order_with_boolean_pairs() -> None:
    args = {
        "enable_prefix_caching": False,
        "tensor_parallel_size": 2,
        "enforce_eager": True,
        "dtype": "float16",
    }
    assert vllm_flags(args) == [
        "--tensor-parallel-size", "2",
        "--dtype", "float16",
        "--enforce-eager",
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    assert vllm_flags({"gpu_memory_utilization": 1}) == ["--gpu-memory-utilization", "1.0"]
    assert vllm_flags({}) == []


@pytest.mark.parametrize(
    ("args", "name", "says"),
    [
        ({"tensor_parallel_sise": 2}, "tensor_parallel_sise", "Unknown vLLM engine argument"),
        ({"trust_remote_code": True}, "trust_remote_code", "Unknown"),
        ({"block_size": 32}, "block_size", "set by the worker"),
        ({"kv_events_config": "{}"}, "kv_events_config", "set by the worker"),
        ({"tensor_parallel_size": "2"}, "tensor_parallel_size", "whole number"),
        ({"tensor_parallel_size": 2.0}, "tensor_parallel_size", "whole number"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size", "whole number"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", "at least 1"),
        ({"pipeline_parallel_size": 65}, "pipeline_parallel_size", "at most 64"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization", "above 0"),
        ({"gpu_memory_utilization": 1.01}, "gpu_memory_utilization", "at most 1"),
        ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization", "a number"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization", "a number"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching", "true or false"),
        ({"enable_prefix_caching": "true"}, "enable_prefix_caching", "true or false"),
        ({"quantization": "bitsandbytes4"}, "quantization", "one of"),
        ({"dtype": "half"}, "dtype", "one of"),
        ({"max_lora_rank": 12}, "max_lora_rank", "one of"),
        ({"max_model_len": -1}, "max_model_len", "at least 1"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens", "max_num_seqs"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras", "max_loras"),
        (
            {"enable_chunked_prefill": False, "max_model_len": 8192, "max_num_batched_tokens": 4096},
            "max_num_batched_tokens",
            "max_model_len",
        ),
    ],
)
def test_bad_arguments_name_themselves(args: dict[str, Any], name: str, says: str) -> None:
    with pytest.raises(EngineArgError) as caught:
        validate_engine_args(args)
    assert caught.value.name == name
    assert says in caught.value.message


def test_parallel_size_and_the_environment_round_trip() -> None:
    assert parallel_size({}) == 1
    assert parallel_size({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}) == 8
    text = encode_engine_args({"quantization": "awq", "tensor_parallel_size": 2})
    assert json.loads(text) == {"tensor_parallel_size": 2, "quantization": "awq"}
    assert decode_engine_args(text) == {"tensor_parallel_size": 2, "quantization": "awq"}
    assert decode_engine_args("") == decode_engine_args(None) == {}
    with pytest.raises(EngineArgError, match=ENGINE_ARGS_ENV):
        decode_engine_args("[1, 2]")
    with pytest.raises(EngineArgError, match="not JSON"):
        decode_engine_args("{tensor_parallel_size: 2}")
    with pytest.raises(EngineArgError, match="Unknown"):
        decode_engine_args('{"speculative_config": {"method": "ngram"}}')


# vLLM's own parser, as its OpenAI server builds it; prints what it read, as JSON.
_PARSE = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
ns = parser.parse_args(["--model", "m", *json.loads(sys.argv[1])])
print(json.dumps({k: getattr(ns, k) for k in json.loads(sys.argv[2])}))
"""


def test_vllms_own_parser_reads_every_flag_as_meant() -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM's CPU build is not installed at {VLLM_PYTHON}: run `make vllm`")
    flags = vllm_flags(EVERY)
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", _PARSE, json.dumps(flags), json.dumps(sorted(EVERY))],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == EVERY
