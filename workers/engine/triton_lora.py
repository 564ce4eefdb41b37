"""The Triton LoRA backend: one shrink launch and one expand launch per slice for each adapted
projection, over the step's tokens grouped by adapter slot (kernels/lora_shrink.py, lora_expand.py).

As with the attention backend, the kernels are imported when the backend is built: Triton fixes
compiled vs. interpreted (TRITON_INTERPRET=1) when a kernel is defined.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.engine.lora_layers import LoraBatch
    from workers.engine.lora_slots import LoraStack


class TritonLora:
    """LoraBackend on the SGMV kernels (CUDA; CPU tensors only under TRITON_INTERPRET=1)."""

    def __init__(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        from workers.engine import kernels
        from workers.engine.kernels.lora_shrink import _lora_shrink_kernel

        self._kernels = kernels
        self.interpreted = isinstance(_lora_shrink_kernel, InterpretedFunction)

    def apply(self, x: torch.Tensor, out: torch.Tensor, stack: LoraStack, batch: LoraBatch) -> None:
        if x.device.type != "cuda" and not self.interpreted:
            raise RuntimeError(
                "Triton kernels on CPU need TRITON_INTERPRET=1 set before workers.engine.kernels is "
                "imported; use the torch LoRA backend on CPU"
            )
        if self.interpreted and x.dtype == torch.bfloat16:
            raise RuntimeError("the Triton interpreter computes tl.dot on bf16 wrongly; use fp32/fp16")
        assert stack.a is not None
        k = self._kernels
        grouping = (batch.sorted_tokens, batch.num_tokens, batch.starts, batch.lora_ids, batch.max_tokens)
        # Rows of tokens without an adapter stay uninitialised: the expand never reads them.
        h = torch.empty(x.shape[0], stack.a.shape[1], dtype=torch.float32, device=x.device)
        k.lora_shrink(x, stack.a, h, *grouping)
        k.lora_expand(h, stack.b, out, *grouping)
