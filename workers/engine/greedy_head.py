"""Greedy tokens without every fp32 logit, on CPUs with bf16 dot products (AMX, AVX-512 BF16).

A greedy row needs the argmax of its logits, not the logits. At a decode step of 64 rows the
fp32 lm_head (49152 x 576 for SmolLM2) is ~30 ms of a ~240 ms step on the Xeons here; the same
product in bf16 on the tile unit (oneDNN) takes ~7 (on a Zen 4 EPYC, with AVX-512 BF16, 13 ms
in fp32 against 5 in bf16). So the head runs in bf16 as a screen, and only the columns that
can still hold the fp32 argmax get their exact fp32 logit: the same in-order sum csrc/gemm.c's
panels compute for the full head, so the token is the one the fp32 path picks, bit for bit
(ties included: the first largest).

Why the screen cannot miss it: with h and w rounded to bf16 (each within 2^-9 of itself), their
products exact in fp32, the sum accumulated in fp32 and rounded to bf16 at the end, the screen
s_j of the logit L_j = h . w_j is off by at most c * sum_k |h_k w_jk| <= c * |h| |w_j| (Cauchy-
Schwarz), c = 2^-8 + 2^-8 (the result's rounding taken as a truncation, to be safe) and fp32's
rounding of both sums (`bound`). The argmax j* has
L_j* >= L_i for every i, so s_j* + e_j* >= s_i - e_i: it is among the columns with
s_j + e_j >= max_i (s_i - e_i). On SmolLM2 that is 1-4 columns a row (63 at most, seen).

Only plain greedy rows take it (no logprobs, penalties, bias or grammar: those need the logits),
and only where the head runs from the panels (whose sums the exact pass repeats). A row with too
many candidates, or anything not finite, gets its logits in full instead.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from workers.engine import cpu_kernels
from workers.engine.linear import PANEL_ROWS, Linear
from workers.engine.sampling import SamplingParams, greedy

# Candidates past which a row's logits are computed in full: the exact pass costs ~1 us each.
CAP = 512
# Added to every norm: c * FLOOR^2 is above what k products flushed to zero can miss (k * 2^-126).
FLOOR = 1e-15


def bound(k: int) -> float:
    """c of the screen's error bound (module docstring) for sums over k terms: the inputs'
    roundings to bf16, the result's (up to 2^-8 of it), and fp32's accumulation error in the
    screen and in the exact sum (at most k * 2^-24 / (1 - k * 2^-24) of the sum of magnitudes
    each), with room to spare."""
    u = 2.0**-24
    gamma = k * u / (1 - k * u)
    return (2.0**-8 + 2.0**-18 + 2.0**-8 * 1.01 + 2.02 * gamma) * 1.01


def _norms(rows: Tensor) -> Tensor:
    """Each row's norm, rounded up a little so the bound holds for it as fp32 holds it; the floor
    covers the products of tiny values the tile unit flushes to zero."""
    return (rows.double().norm(dim=1) * (1 + 1e-6) + FLOOR).float()


def plain(params: SamplingParams) -> bool:
    """Whether a row's token is the argmax of the raw logits and nothing else is read of them."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and not params.penalized
        and params.grammar is None
    )


class GreedyHead:
    def __init__(self, head: Linear, lib: ctypes.CDLL) -> None:
        self.head = head
        self.lib = lib
        w = head.weight.detach()
        self.weight = w.contiguous()
        self.norms = _norms(w)
        self.screen = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
        self.c = bound(w.shape[1])

    @classmethod
    def build(cls, head: Linear, lib: Any) -> GreedyHead | None:
        """The head for this model, or None where it would not pay (no bf16 dot products) or cannot repeat the
        full head's sums (the head not on the panels)."""
        if lib is None or head.panels is None or not cpu_kernels.has_bf16_dot():
            return None
        return cls(head, lib)

    @torch.inference_mode()
    def __call__(self, hidden: Tensor) -> list[int]:
        """The greedy token of each row of `hidden` [n, hidden] (the final norm's output)."""
        n = hidden.shape[0]
        if self.head.panels is None or n > PANEL_ROWS:  # unpacked since, or beyond the panels
            return greedy(self.head(hidden)).tolist()
        h = hidden.contiguous()
        s = torch.ops.mkldnn._linear_pointwise(h.bfloat16(), self.screen, None, "none", [], "")
        hn = _norms(h)
        out = torch.empty(n, dtype=torch.int64)
        v, k = self.weight.shape
        self.lib.tm_greedy_pick(
            h.data_ptr(),
            n,
            k,
            h.stride(0),
            self.weight.data_ptr(),
            s.data_ptr(),
            v,
            self.norms.data_ptr(),
            hn.data_ptr(),
            self.c,
            CAP,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        full = (out < 0).nonzero().squeeze(1)
        if full.numel():
            out[full] = greedy(self.head(h[full]))
        return out.tolist()
