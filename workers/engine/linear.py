"""The model's projections, with weights prepacked for oneDNN on fp32 CPUs.

`F.linear` on the CPU hands each call to MKL's sgemm, which repacks the whole weight into its
panel layout on every call: at decode sizes (a few dozen rows) that packing is a large part
of the matmul (19% of a decode step's samples in issue 15's profile). oneDNN can take the
weight already in its blocked layout, packed once at load (`torch.ops.mkldnn`, what inductor's
CPU freezing pass uses): 1.3x on the decoder's projections at 64 rows, 2x on the
vocabulary-sized lm_head, 2-4x at 8 rows on this machine. The packed copy is exact fp32 math
in another summation order (its own equality test in tests/engine/test_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) that runs from `packed` once `pack` set it."""

    packed: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def can_pack(weight: Tensor) -> bool:
    on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
    return on_cpu and torch.backends.mkldnn.is_available()


def pack(model: nn.Module, rows: int = 64) -> int:
    """Prepack every Linear's weight of a loaded model (`rows`: the batch oneDNN tunes the
    layout for; any row count runs); returns how many were packed. Call again after the
    weights change: the packed copies do not follow them."""
    n = 0
    for module in model.modules():
        if isinstance(module, Linear) and can_pack(module.weight):
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)
            n += 1
    return n


def unpack(model: nn.Module) -> None:
    """Back to `F.linear` on the plain weights (the reference path)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = None
