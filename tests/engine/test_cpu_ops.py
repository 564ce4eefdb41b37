"""The fused C ops (workers/engine/csrc/fused.c) against the plain PyTorch modules they stand
for, on shapes like the model's (views into the fused qkv output included), prefill-sized (the
parallel branch) and decode-sized (one thread)."""

from __future__ import annotations

import pytest
import torch

from workers.engine import cpu_kernels
from workers.engine.attention import store_kv as torch_store_kv
from workers.engine.models.llama import RMSNorm, apply_rope

SIZES = [3, 64, 2048]  # tokens: a few, a decode batch, a prefill chunk (past PARALLEL_MIN)


@pytest.mark.parametrize("n", SIZES)
def test_rms_norm(lib: object, n: int) -> None:
    torch.manual_seed(n)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(576))
    x, residual = 3 * torch.randn(n, 576), torch.randn(n, 576)
    torch.testing.assert_close(cpu_kernels.rms_norm(lib, x, norm.weight, 1e-5), norm(x), atol=2e-6, rtol=1e-5)
    # With a residual: the sum goes back into it, and the norm is of the sum.
    expected_sum = residual + x
    out = cpu_kernels.rms_norm(lib, x, norm.weight, 1e-5, residual)
    torch.testing.assert_close(residual, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(out, norm(expected_sum), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16), (8, 8, 128)])
def test_rope_on_qkv_views(lib: object, n: int, heads: tuple[int, int, int]) -> None:
    num_q, num_kv, d = heads
    torch.manual_seed(n + d)
    qkv = torch.randn(n, (num_q + 2 * num_kv) * d)
    q, k, v = qkv.split([num_q * d, num_kv * d, num_kv * d], dim=-1)
    q, k = q.view(n, num_q, d), k.view(n, num_kv, d)
    freqs = torch.arange(n).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    expected_q, expected_k, v_before = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.clone()
    cpu_kernels.rope_(lib, q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, expected_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(v, v_before)  # the rest of the row is left alone


@pytest.mark.parametrize("n", SIZES)
def test_store_kv(lib: object, n: int) -> None:
    torch.manual_seed(n)
    qkv = torch.randn(n, 960)
    _, k, v = qkv.split([576, 192, 192], dim=-1)
    k, v = k.view(n, 3, 64), v.view(n, 3, 64)
    blocks = -(-n // 16) + 4
    slots = torch.randperm(blocks * 16)[:n]
    slots[::5] = -1  # padding: not stored
    caches = [torch.randn(blocks, 16, 3, 64) for _ in range(2)]
    expected = [c.clone() for c in caches]
    torch_store_kv(k, v, *expected, slots)
    cpu_kernels.store_kv(lib, k, v, slots, *caches)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("n", SIZES)
def test_silu_mul(lib: object, n: int) -> None:
    torch.manual_seed(n)
    gate_up = 4 * torch.randn(n, 2 * 1536)
    gate_up[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 88.0, 100.0])  # the tails
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(cpu_kernels.silu_mul(lib, gate_up), expected, atol=1e-6, rtol=2e-6)
