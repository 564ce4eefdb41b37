"""PEFT LoRA adapters read from disk: `adapter_config.json` + `adapter_model.safetensors`.

A LoRA adapter adds `scaling * B @ A` (rank r) to some of a layer's linear projections; for
the Llama family those are q/k/v/o (attention) and gate/up/down (MLP). The tensors decide
which projections of which layers are adapted (PEFT's `target_modules` may be a regex or
"all-linear", and `layers_to_transform` only leaves tensors out), so only the tensors are
read for that. The scaling is folded into B here, so a slot holds (A, B) and applying it is
two matmuls with no per-adapter factor.

PEFT features that change the computation and are not implemented (DoRA, LoRA biases,
`modules_to_save`, adapted embeddings or output head) are refused rather than ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from workers.engine.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION + MLP

# HF projection -> (the engine's fused module, index of its slice in the fused output).
SLICES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight; older PEFT versions keep
# the adapter's name (`.lora_A.default.weight`).
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served: bad files, unknown id, no room. A ValueError so the
    engine's callers report it as a refused request."""


class AdapterBusy(AdapterError):
    """Refused for now: every slot holds an adapter that running requests use."""


@dataclass(slots=True)
class LoraAdapter:
    adapter_id: str
    rank: int  # the largest rank of its modules
    # (layer, HF module) -> (A [r, in], B [out, r] with the scaling folded in), on the CPU.
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]]

    @property
    def target_modules(self) -> list[str]:
        present = {module for _, module in self.weights}
        return [m for m in MODULES if m in present]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of an HF projection of this model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


def load_adapter(
    path: str | Path,
    cfg: ModelConfig,
    *,
    adapter_id: str,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Read and check a PEFT LoRA directory against the base model; AdapterError if it does
    not fit (wrong shapes, rank above `max_rank`, unsupported PEFT features)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {adapter_id!r}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {adapter_id!r}: {CONFIG_FILE} must hold a JSON object")
    _check_config(adapter_id, config)
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    try:
        with safe_open(path / WEIGHTS_FILE, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                m = _TENSOR.search(name)
                if m is None or m[3] not in (ATTENTION if m[2] == "self_attn" else MLP):
                    raise AdapterError(
                        f"adapter {adapter_id!r}: tensor {name!r} is not a LoRA weight of a "
                        f"{'/'.join(MODULES)} projection"
                    )
                pairs.setdefault((int(m[1]), m[3]), {})[m[4]] = f.get_tensor(name)
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"adapter {adapter_id!r}: cannot read {WEIGHTS_FILE}: {exc}") from None
    if not pairs:
        raise AdapterError(f"adapter {adapter_id!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        where = f"adapter {adapter_id!r}, layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must come in pairs")
        if layer >= cfg.num_layers:
            raise AdapterError(f"{where}: the base model has {cfg.num_layers} layers")
        a, b = _oriented(where, pair["A"], pair["B"], module_shape(cfg, module), config)
        rank = a.shape[0]
        if rank > max_rank:
            raise AdapterError(f"{where}: rank {rank} exceeds this engine's maximum of {max_rank}")
        scaling = _scaling(config, f"model.layers.{layer}.{_parent(module)}.{module}", rank)
        # Fold in fp32, then cast: B is small, and the product is what the merged model adds.
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoraAdapter(adapter_id, rank, weights)


def _parent(module: str) -> str:
    return "self_attn" if module in ATTENTION else "mlp"


def _check_config(adapter_id: str, config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"adapter {adapter_id!r}: only LoRA adapters are supported, not {peft_type!r}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(config.get("modules_to_save")),
        "target_parameters": bool(config.get("target_parameters")),
        "lora_bias": bool(config.get("lora_bias")),
        "layer_replication": bool(config.get("layer_replication")),
        "trainable_token_indices": bool(config.get("trainable_token_indices")),
        # Activated LoRA: the adapter applies only after its invocation tokens.
        "alora_invocation_tokens": bool(config.get("alora_invocation_tokens")),
    }
    for name, used in unsupported.items():
        if used:
            raise AdapterError(f"adapter {adapter_id!r}: {name} is not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise AdapterError(f"adapter {adapter_id!r}: {key} must be a positive number, got {value!r}")


def _oriented(
    where: str, a: Tensor, b: Tensor, in_out: tuple[int, int], config: dict[str, Any]
) -> tuple[Tensor, Tensor]:
    """A [r, in] and B [out, r]. PEFT stores them so for nn.Linear whatever `fan_in_fan_out`
    says (it resets the flag for Linear layers: it describes GPT-2's Conv1D base weights), but
    an exporter that honoured the flag would have written both transposed: accept that too."""
    n_in, n_out = in_out
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterError(f"{where}: lora_A and lora_B must be matrices")
    if config.get("fan_in_fan_out") and a.shape[1] == b.shape[0] and (a.shape[0], b.shape[1]) == in_out:
        a, b = a.T, b.T
    if a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
        raise AdapterError(
            f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
            f"[r, {n_in}] and [{n_out}, r]"
        )
    return a, b


def _scaling(config: dict[str, Any], name: str, rank: int) -> float:
    """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with rsLoRA; alpha may come
    from `alpha_pattern` (keys are matched against the end of the module name, as PEFT does).
    The rank is the tensors' own, which is what `rank_pattern` would say."""
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", name):
            alpha = float(value)
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
