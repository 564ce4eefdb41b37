"""ModelConfig: the architecture numbers the engine needs, read from an HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Every architecture here is the same Llama block; they differ only in flags read below.
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # HF's rope parameters ("rope_type" normalised), None = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2)
    eos_token_ids: list[int]
    bos_token_id: int | None

    @classmethod
    def from_hf(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or config.get('model_type')!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (only silu)")
        model_type = config.get("model_type", "llama")
        num_heads = config["num_attention_heads"]
        rope_theta, rope_scaling = _rope(config)
        max_pos = config.get("max_position_embeddings", 4096)
        # Sliding-window attention is not implemented: full attention equals it up to the
        # window, so cap the context there instead of silently diverging beyond it.
        window = config.get("sliding_window")
        if window and (model_type != "qwen2" or config.get("use_sliding_window")):
            max_pos = min(max_pos, window)
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and its config has no flag for it.
            attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            eos_token_ids=_ids((generation_config or {}).get("eos_token_id", config.get("eos_token_id"))),
            bos_token_id=config.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_hf(config, generation)


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling` pair."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    # Old configs spell the kind "type"; "default" with no parameters means plain RoPE.
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **params}


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
