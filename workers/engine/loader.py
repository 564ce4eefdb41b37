"""Load a model from an HF directory (config.json + safetensors) or a llama.cpp GGUF file.

Both paths end in `LlamaForCausalLM.load_weights` with HF tensor names; GGUF tensors are
renamed, dequantized and (for q/k) un-permuted on the way. transformers is never imported.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from workers.engine.attention import AttentionBackend, select_backend
from workers.engine.config import ModelConfig
from workers.engine.meta import materialize
from workers.engine.models import LlamaForCausalLM


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Model in eval mode with weights in `dtype` on `device`, and its config."""
    path = Path(path)
    device = torch.device(device)
    if path.suffix == ".gguf":
        from gguf import GGUFReader  # only the GGUF path needs it

        reader = GGUFReader(path)
        cfg = ModelConfig.from_hf(_gguf_config(reader))
        weights = _gguf_weights(reader, cfg)
    elif (path / "config.json").exists():
        cfg = ModelConfig.from_dir(path)
        weights = _safetensors_weights(path)
    else:
        raise ValueError(f"{path}: expected an HF model directory (config.json) or a .gguf file")
    # Build on the meta device (no random init of weights about to be overwritten), then
    # allocate uninitialised storage in the compute dtype and fill it from the checkpoint.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend or select_backend(device))
    model = materialize(model, dtype, device)
    model.tie_weights()
    model.load_weights(weights)
    return model.eval(), cfg


# --------------------------------------------------------------------------------------------
# HF directories
# --------------------------------------------------------------------------------------------


def _safetensors_weights(path: Path) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():  # sharded: the index names the files
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


# --------------------------------------------------------------------------------------------
# GGUF files (llama.cpp)
# --------------------------------------------------------------------------------------------

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_config(reader: Any) -> dict[str, Any]:
    """The GGUF metadata as an HF config dict, so both formats go through ModelConfig.from_hf."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":  # Mistral GGUFs are "llama" too; others use other tensor layouts
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama')")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF with rope_freqs (Llama 3.1 rope scaling) is not supported; use the HF weights")

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{name}", default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    vocab = key("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "intermediate_size": key("feed_forward_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 4096),
        # llama.cpp omits the output matrix when it is the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = key("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor")}
    return config


def _gguf_weights(reader: Any, cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    from gguf.quants import dequantize

    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")  # suffix: weight / bias
        if base.startswith("blk."):
            _, layer, kind = base.split(".", 2)
            name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
        else:
            name = f"{_GGUF_TOP_NAMES[base]}.{suffix}"
        # GGUF shapes are listed fastest dimension first; torch wants the reverse.
        array = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))  # copy off the read-only mmap
        if base.endswith("attn_q"):
            tensor = unpermute_qk(tensor, cfg.num_heads)
        elif base.endswith("attn_k"):
            tensor = unpermute_qk(tensor, cfg.num_kv_heads)
        yield name, tensor


def unpermute_qk(w: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation.

    HF rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent pairs,
    so its converter interleaves each head's halves: rows (h, i, half) are stored as
    (h, half, i). Without this the model runs and emits garbage.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
