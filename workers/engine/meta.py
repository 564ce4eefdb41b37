"""Models built on the meta device, then given uninitialised storage to load weights into.

Both steps must stay clear of torch._refs, the Python decompositions that meta tensors run
through: their first call imports torch._dynamo (3-5 s) or sympy (about 1 s), seconds of a
worker's start for tensors whose values the checkpoint overwrites anyway.
"""

from __future__ import annotations

import torch
from torch import nn


def embedding(n: int, dim: int) -> nn.Embedding:
    """nn.Embedding with its storage given, so without the random init (normal_ on the meta
    device imports torch._dynamo)."""
    return nn.Embedding(n, dim, _weight=torch.empty(n, dim))


def materialize(model: nn.Module, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """`model`, built on the meta device, with uninitialised storage on `device` (floating
    tensors in `dtype`). torch.empty rather than `to_empty`, whose empty_like of a meta tensor
    imports sympy."""
    return model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
