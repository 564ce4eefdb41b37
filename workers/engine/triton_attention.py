"""The Triton attention backend: store the new K/V by slot mapping, then one unified paged
attention launch for the whole mixed batch (see kernels/unified_attention.py for why one kernel).

The kernels are imported when the backend is built, not when this module is imported: Triton
fixes compiled vs. interpreted (TRITON_INTERPRET=1) when a kernel is defined, and on CPU only the
interpreter can run them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.engine.attention import AttentionMetadata


class TritonAttention:
    """AttentionBackend on Triton kernels (CUDA; CPU tensors only under TRITON_INTERPRET=1)."""

    def __init__(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        from workers.engine import kernels
        from workers.engine.kernels.unified_attention import _unified_attention_kernel

        self._kernels = kernels
        self.interpreted = isinstance(_unified_attention_kernel, InterpretedFunction)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q `[T, H, D]`, k/v `[T, KvH, D]` -> `[T, H, D]`; stores k/v first (slot -1 skipped)."""
        if q.device.type != "cuda" and not self.interpreted:
            raise RuntimeError(
                "Triton kernels on CPU need TRITON_INTERPRET=1 set before workers.engine.kernels is "
                "imported; use the torch backend on CPU"
            )
        if self.interpreted and q.dtype == torch.bfloat16:
            raise RuntimeError("the Triton interpreter computes tl.dot on bf16 wrongly; use fp32/fp16")
        self._kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q is
        self._kernels.unified_attention(
            q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
        )
        return out
