"""Shared engine fixtures: tiny random-weight HF models saved as safetensors directories.

``tiny_model`` (session, parametrized) yields a :class:`TinyModel` for each of
``TINY_CONFIGS``: Llama with GQA, Llama 3 with "llama3" rope scaling, Qwen2 (q/k/v biases)
and Mistral. The HF model itself is kept as the correctness reference.

``lib`` (module) is the C kernels (workers/engine/csrc) built for this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=256,
    # Larger than HF's 0.02 so the logits are spread out and greedy choices are not ties.
    initializer_range=0.1,
)

# name -> (transformers config class, its arguments besides _COMMON)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    # Scaling only changes frequencies with wavelengths beyond original_max / high_freq_factor
    # (16 positions here), and rope_theta 500000 puts most of a 16-dim head's frequencies there.
    "llama3-rope": (
        "LlamaConfig",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=4, head_dim=16, sliding_window=None)),
}


@dataclass(slots=True)
class TinyModel:
    name: str
    path: Path  # HF directory: config.json + model.safetensors
    hf: torch.nn.Module  # the transformers model, eval mode, fp32


def _randomize(model: torch.nn.Module) -> None:
    """HF initialises norms to 1 and biases to 0, which would hide a swapped norm or a dropped
    bias: give every parameter random values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    import transformers  # here, not at import: the kernel and scheduler tests do not need it

    name = request.param
    config_class, kwargs = TINY_CONFIGS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**_COMMON, **kwargs)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(hf)
    hf.eval()
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)  # safetensors
    return TinyModel(name, path, hf)


@pytest.fixture(scope="module")
def lib() -> object:
    """The C kernels (workers/engine/csrc), built for this machine. A failed build fails the
    tests that use it: every supported host has a C compiler (make run needs one for the fast path)."""
    from workers.engine import cpu_kernels  # here: a broken engine module fails its tests, not collection

    lib = cpu_kernels.load()
    assert lib is not None, "the CPU kernels did not build"
    return lib
