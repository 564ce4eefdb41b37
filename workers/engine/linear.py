"""The model's projections, with weights prepacked once on fp32 CPUs.

`F.linear` on the CPU hands each call to MKL's sgemm, which repacks the whole weight into its
panel layout on every call: at decode sizes (a few dozen rows) that packing is a large part
of the matmul (19% of a decode step's samples in issue 15's profile). oneDNN can take the
weight already in its blocked layout, packed once at load (`torch.ops.mkldnn`, what inductor's
CPU freezing pass uses): 1.3x on the decoder's projections at 64 rows, 2x on the
vocabulary-sized lm_head, 2-4x at 8 rows on this machine. The packed copy is exact fp32 math
in another summation order (its own equality test in tests/engine/test_linear.py).

Where the C kernels are built and the CPU has AVX-512 (or AVX2 and FMA), the weight is also
packed into the panels of csrc/gemm.c, for batches up to `PANEL_ROWS` rows (decode steps):
1.1-1.6x oneDNN's packed projections at 64 rows, 2x at 8 (AVX2 on a Zen EPYC: 1.19x at 64 rows,
1.5x at 8, level at 256, 0.95x at 384). Larger batches (prefill steps) stay with oneDNN: in
process, `F.linear` ran 2048 rows as fast, but served (the gateway sharing the cores) the
prefills took 1.25x as long with it. The cost is a second packed copy: the model's size again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine import cpu_kernels

# Rows up to which the panels of csrc/gemm.c run a projection; measured on two AVX-512 cores,
# the panels lead up to ~256 rows and all three ways are alike from ~384 to 1024 (with AVX2 the
# lead ends at ~256 too; one limit for both, the rows between are rare: mixed steps' tails).
PANEL_ROWS = 384


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) that runs from `panels` or `packed` once `pack`
    set one."""

    packed: Tensor | None = None  # oneDNN's layout
    panels: Tensor | None = None  # csrc/gemm.c's, read through `lib`
    lib: Any = None

    def forward(self, x: Tensor) -> Tensor:
        if self.panels is not None and x.numel() <= PANEL_ROWS * self.in_features:
            out = cpu_kernels.gemm(self.lib, x, self.panels, self.out_features)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def can_pack(weight: Tensor) -> bool:
    on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
    return on_cpu and torch.backends.mkldnn.is_available()


def pack(model: nn.Module, rows: int = 64, lib: Any = None) -> int:
    """Prepack every Linear's weight of a loaded model for oneDNN (`rows`: the batch it tunes
    the layout for; any row count runs) and, with the C kernels' `lib` on an AVX-512 or AVX2 CPU, into
    csrc/gemm.c's panels for small batches; returns how many were packed. Call again after the
    weights change: the packed copies do not follow them."""
    n = 0
    for module in model.modules():
        if isinstance(module, Linear) and can_pack(module.weight):
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)
            module.panels = None if lib is None else cpu_kernels.pack_panels(lib, module.weight)
            module.lib = lib if module.panels is not None else None
            n += 1
    return n


def unpack(model: nn.Module) -> None:
    """Back to `F.linear` on the plain weights (the reference path)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = module.panels = module.lib = None
