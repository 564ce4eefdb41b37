"""Checks of an uploaded PEFT LoRA adapter against its base model, before it is stored.

A LoRA adapter adds `B @ A` (rank r) to some linear layers of the base model. For the
Llama family (Llama, Mistral, Qwen2, SmolLM...) the layer names and shapes follow from
the base model's config.json, so every tensor can be checked without loading either
model: `lora_A` is `[r, in_features]` and `lora_B` is `[out_features, r]`.

The safetensors header is parsed here directly (8-byte length + JSON), which also checks
that each tensor's byte range matches its dtype and shape and lies inside the file, so a
truncated or forged file is refused before it reaches a worker. Pickled `.bin` weights are
never accepted: unpickling runs code.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import IO, Any

from tokenmill.errors import APIError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION + MLP

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_MAX_HEADER = 64 << 20  # a header this large is not an adapter's
_MAX_CONFIG = 1 << 20
MAX_CONFIG = _MAX_CONFIG
# A safetensors header entry of one tensor is ~170 bytes of JSON (a 78-character name, dtype,
# shape, offsets); 256 leaves room. `__metadata__` (PEFT writes {"format": "pt"}) gets 64 KiB.
_HEADER_PER_TENSOR = 256
_HEADER_METADATA = 64 << 10
# PEFT names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (older PEFT
# versions sometimes keep the adapter name, `.lora_A.default.weight`).
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """What an adapter must fit: the linear layers of one base model."""

    num_layers: int
    hidden: int
    intermediate: int
    q_out: int  # num_heads * head_dim
    kv_out: int  # num_kv_heads * head_dim

    def in_out(self, module: str) -> tuple[int, int]:
        return {
            "q_proj": (self.hidden, self.q_out),
            "k_proj": (self.hidden, self.kv_out),
            "v_proj": (self.hidden, self.kv_out),
            "o_proj": (self.q_out, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }[module]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> BaseShapes:
        """From an HF config.json of a Llama-family model; ValueError if it is not one."""
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            return cls(
                num_layers=int(config["num_hidden_layers"]),
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                q_out=heads * head_dim,
                kv_out=kv_heads * head_dim,
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise ValueError(f"not a Llama-family config.json (missing or bad {exc})") from None


def max_header_size(shapes: BaseShapes) -> int:
    """Largest safetensors header of an adapter for `shapes`: every module of every layer."""
    return _HEADER_METADATA + _HEADER_PER_TENSOR * shapes.num_layers * len(MODULES) * 2


def max_weights_size(shapes: BaseShapes, max_rank: int) -> int:
    """Bytes of the largest adapter_model.safetensors `validate` accepts for `shapes` at
    `max_rank`: A and B of every module of every layer, float32, the largest header. An
    upload is refused as soon as it passes this, before it is all received."""
    per_rank = sum(sum(shapes.in_out(m)) for m in MODULES) * shapes.num_layers  # A + B elements
    return 8 + max_header_size(shapes) + per_rank * max_rank * max(_DTYPE_BYTES.values())


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    rank: int
    alpha: float
    target_modules: list[str]
    tensors: int
    weights_size: int
    sha256: str  # of the weights file


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_adapter")


def parse_config(raw: bytes, max_rank: int) -> tuple[int, float, list[str]]:
    """(rank, alpha, target modules) of an adapter_config.json, or a 400 naming the problem."""
    if len(raw) > _MAX_CONFIG:
        raise _bad(f"{CONFIG_FILE} is larger than {_MAX_CONFIG} bytes.", CONFIG_FILE)
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"{CONFIG_FILE} is not valid JSON: {exc}", CONFIG_FILE) from None
    except RecursionError:
        raise _bad(f"{CONFIG_FILE} is not valid JSON: nested too deeply.", CONFIG_FILE) from None
    if not isinstance(config, dict):
        raise _bad(f"{CONFIG_FILE} must hold a JSON object.", CONFIG_FILE)
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _bad(f"Only LoRA adapters are supported; peft_type is {peft_type!r}.", "peft_type")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _bad(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}.", "r")
    if rank > max_rank:
        raise _bad(f"LoRA rank {rank} exceeds the maximum of {max_rank}.", "r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise _bad(f"{CONFIG_FILE}: lora_alpha must be a positive number, got {alpha!r}.", "lora_alpha")
    targets = config.get("target_modules")
    if targets == "all-linear":  # PEFT's shorthand: every linear layer but the output head
        targets = list(MODULES)
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _bad(
            f"{CONFIG_FILE}: target_modules must be a list of module names (of {', '.join(MODULES)}).",
            "target_modules",
        )
    unknown = sorted(set(targets) - set(MODULES))
    if unknown:
        raise _bad(
            f"target_modules {unknown} are not supported; allowed: {', '.join(MODULES)}.", "target_modules"
        )
    # Features the engine does not implement are refused rather than silently ignored.
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "bias": config.get("bias", "none") not in ("none", None),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "layers_to_transform": config.get("layers_to_transform") is not None,
    }
    for name, used in unsupported.items():
        if used:
            raise _bad(f"{CONFIG_FILE}: {name} is not supported.", name)
    return rank, float(alpha), sorted(set(targets), key=MODULES.index)


def read_header(f: IO[bytes], size: int, max_header: int = _MAX_HEADER) -> dict[str, Any]:
    """The safetensors header of a file of `size` bytes, with every entry's byte range
    checked against its dtype and shape; 400 on anything malformed."""
    param = WEIGHTS_FILE
    if size < 8:
        raise _bad(f"{WEIGHTS_FILE} is too short to be a safetensors file.", param)
    f.seek(0)
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(max_header, size - 8):
        raise _bad(f"{WEIGHTS_FILE} is not a valid safetensors file (header length {length}).", param)
    try:
        header = json.loads(f.read(length))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _bad(f"{WEIGHTS_FILE} is not a valid safetensors file (bad header).", param) from None
    if not isinstance(header, dict):
        raise _bad(f"{WEIGHTS_FILE} is not a valid safetensors file (bad header).", param)
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    spans = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise _bad(f"Tensor '{name}' has a malformed header entry.", name) from None
        if dtype not in _DTYPE_BYTES:
            raise _bad(f"Tensor '{name}' has dtype {dtype}; adapters must be F32, F16 or BF16.", name)
        if not isinstance(begin, int) or not isinstance(end, int) or not 0 <= begin <= end:
            raise _bad(f"Tensor '{name}' has malformed data offsets.", name)
        if end > data_size:
            raise _bad(f"{WEIGHTS_FILE} is truncated: tensor '{name}' ends past the end of the file.", param)
        if end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise _bad(f"Tensor '{name}': its data size does not match its dtype and shape.", name)
        spans.append((begin, end))
    # Tensors must tile the data area exactly: no overlaps, no hidden bytes.
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise _bad(f"{WEIGHTS_FILE}: tensor data overlaps or leaves gaps.", param)
        position = end
    if position != data_size:
        raise _bad(f"{WEIGHTS_FILE}: the file is truncated or has trailing bytes.", param)
    return header


def check_tensors(header: dict[str, Any], shapes: BaseShapes, rank: int, targets: list[str]) -> None:
    """Every tensor is a lora_A/lora_B of a targeted module of an existing layer, shaped
    for the base model and the rank; every A has its B."""
    seen: dict[tuple[int, str], set[str]] = {}
    for name in sorted(header):
        m = _TENSOR.match(name)
        if m is None:
            raise _bad(
                f"Tensor '{name}' is not a LoRA weight of an attention or MLP projection "
                "(expected base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight).",
                name,
            )
        layer, parent, module, which = int(m[1]), m[2], m[3], m[4]
        if module not in (ATTENTION if parent == "self_attn" else MLP):
            raise _bad(f"Tensor '{name}': there is no module {parent}.{module} in this model.", name)
        if module not in targets:
            raise _bad(f"Tensor '{name}' adapts {module}, which is not in target_modules {targets}.", name)
        if layer >= shapes.num_layers:
            raise _bad(
                f"Tensor '{name}' is for layer {layer}; the base model has {shapes.num_layers} layers.", name
            )
        in_features, out_features = shapes.in_out(module)
        expected = [rank, in_features] if which == "A" else [out_features, rank]
        if header[name]["shape"] != expected:
            raise _bad(
                f"Tensor '{name}' has shape {header[name]['shape']}; the base model and rank {rank} "
                f"need {expected}.",
                name,
            )
        pair = seen.setdefault((layer, f"{parent}.{module}"), set())
        if which in pair:
            raise _bad(f"Tensor '{name}' appears twice (with and without '.default').", name)
        pair.add(which)
    if not seen:
        raise _bad(f"{WEIGHTS_FILE} holds no LoRA tensors.", WEIGHTS_FILE)
    for (layer, module), pair in sorted(seen.items()):
        if pair != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise _bad(
                f"Layer {layer} {module} has lora_{pair.pop()} but no lora_{missing}.",
                f"base_model.model.model.layers.{layer}.{module}.lora_{missing}.weight",
            )


def sha256_of(f: IO[bytes]) -> str:
    f.seek(0)
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def validate(
    config_raw: bytes, weights: IO[bytes], weights_size: int, shapes: BaseShapes, max_rank: int
) -> AdapterInfo:
    """Check an adapter's two files (blocking: reads the weights once to hash them)."""
    rank, alpha, targets = parse_config(config_raw, max_rank)
    header = read_header(weights, weights_size, max_header_size(shapes))
    check_tensors(header, shapes, rank, targets)
    return AdapterInfo(
        rank=rank,
        alpha=alpha,
        target_modules=targets,
        tensors=len(header),
        weights_size=weights_size,
        sha256=sha256_of(weights),
    )
