"""The paged KV cache: how many blocks fit a memory budget, and allocating them.

Per layer a (k_cache, v_cache) pair, each [num_blocks, block_size, num_kv_heads, head_dim]
(vLLM's layout); a token at position p lives in slot block_table[p // block_size] *
block_size + p % block_size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.engine.config import ModelConfig


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def kv_budget_bytes(
    device: str | torch.device, *, gpu_fraction: float = 0.9, cpu_gib: float = 1.0, model_bytes: int = 0
) -> int:
    """Memory for the KV cache: on CUDA a fraction of the free device memory, less
    `model_bytes` of weights not yet loaded there (0 once the model is resident); on the CPU
    the configured GiB (weights live outside that budget)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(0, int(free * gpu_fraction) - model_bytes)
    return int(cpu_gib * 2**30)


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return budget_bytes // block_bytes(cfg, block_size, dtype)


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
) -> list[tuple[Tensor, Tensor]]:
    """One zeroed allocation for the whole cache, handed out as per-layer views. Zeroed, not
    empty: padded attention multiplies masked-out values by 0, and NaN garbage * 0 is NaN."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    cache = torch.zeros(cfg.num_layers, 2, *shape, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]
