"""Triton kernels (store_kv, unified paged attention) against a naive dense reference.

On CPU the kernels run under Triton's interpreter, which must be switched on before triton (or
the kernels) is imported, hence the assignment above the imports. The gpu-marked test re-runs
this file in a child process with the kernels compiled on CUDA.
"""

import os

_DEVICE = os.environ.get("TOKENMILL_KERNEL_TEST_DEVICE", "cpu")
if _DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from workers.engine.attention import AttentionMetadata, TorchAttention  # noqa: E402
from workers.engine.kernels import store_kv, unified_attention  # noqa: E402
from workers.engine.triton_attention import TritonAttention  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


@dataclass(slots=True)
class Meta:
    """Same fields as workers.engine.attention.AttentionMetadata (kept local: no dependency)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int


@dataclass(slots=True)
class Batch:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KvH, D], the new tokens
    v: torch.Tensor
    k_cache: torch.Tensor  # context already stored, every other slot NaN
    v_cache: torch.Tensor
    meta: Meta
    keys: list[torch.Tensor]  # per sequence, all seq_len positions [L, KvH, D] (for the reference)
    values: list[torch.Tensor]


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = _DEVICE,
    seed: int = 0,
) -> Batch:
    """A step whose sequence s has ctx_lens[s] tokens cached and q_lens[s] new ones.

    Blocks are handed out shuffled (tables are not contiguous) and free slots hold NaN, so a
    kernel that reads past a sequence's length or through the wrong block fails loudly.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(q_lens), max(blocks_per_seq), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values, new_k, new_v, slots = [], [], [], [], []
    for s, (ctx, seq_len) in enumerate(zip(ctx_lens, seq_lens, strict=True)):
        table = [order.pop() for _ in range(blocks_per_seq[s])]
        tables[s, : len(table)] = torch.tensor(table)
        key = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        value = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        pos_slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        for p in range(ctx):  # the cached context, as earlier steps would have stored it
            k_cache.view(-1, num_kv_heads, head_dim)[pos_slots[p]] = key[p]
            v_cache.view(-1, num_kv_heads, head_dim)[pos_slots[p]] = value[p]
        keys.append(key)
        values.append(value)
        new_k.append(key[ctx:])
        new_v.append(value[ctx:])
        slots += pos_slots[ctx:]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=g).to(dtype)
    meta = Meta(
        query_start_loc=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return Batch(
        q.to(device), torch.cat(new_k).to(device), torch.cat(new_v).to(device),
        k_cache.to(device), v_cache.to(device), meta, keys, values,
    )  # fmt: skip


def reference(batch: Batch, scale: float) -> torch.Tensor:
    """Naive dense causal attention per sequence, in fp32 on CPU."""
    cu = batch.meta.query_start_loc.tolist()
    group = batch.q.shape[1] // batch.keys[0].shape[1]
    out = []
    for s, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.q[cu[s] : cu[s + 1]].cpu().float()  # [n, H, D]
        k = key.float().repeat_interleave(group, dim=1)  # [L, H, D]: query head h uses kv head h // group
        v = value.float().repeat_interleave(group, dim=1)
        n, seq_len = q.shape[0], k.shape[0]
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        q_pos = torch.arange(seq_len - n, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v))
    return torch.cat(out)


# name -> (q_lens, ctx_lens): decode = q_len 1 over cached context (one ending exactly on a block
# boundary); prefill = whole prompts, nothing cached; mixed = decode, a prefill chunk on cached
# context, decode, fresh prompt, all in one launch.
SCENARIOS = {
    "decode": ([1, 1, 1], [16, 37, 70]),
    "prefill": ([20, 7], [0, 0]),
    "mixed": ([1, 23, 1, 9], [50, 18, 31, 0]),
}
# (scenario, num_heads, num_kv_heads, head_dim, block_size): GQA 1/3/4, dims 32/64, blocks 16/32.
CASES = [
    ("decode", 4, 4, 32, 16),
    ("prefill", 6, 2, 64, 32),
    ("mixed", 8, 2, 64, 16),
    ("mixed", 3, 1, 32, 32),
]


def check_backend(scenario: str, heads: int, kv_heads: int, dim: int, block: int, dtype: torch.dtype) -> None:
    q_lens, ctx_lens = SCENARIOS[scenario]
    batch = make_batch(q_lens, ctx_lens, heads, kv_heads, dim, block, dtype)
    scale = dim**-0.5
    out = TritonAttention().forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, scale
    )
    assert out.shape == batch.q.shape and out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), reference(batch, scale), atol=tol, rtol=tol)
    # The new tokens were stored first, where the slot mapping says.
    slots = batch.meta.slot_mapping
    torch.testing.assert_close(batch.k_cache.view(-1, kv_heads, dim)[slots], batch.k, atol=0, rtol=0)
    torch.testing.assert_close(batch.v_cache.view(-1, kv_heads, dim)[slots], batch.v, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}kv{c[2]}-d{c[3]}-bs{c[4]}")
def test_attention_matches_reference(case: tuple[str, int, int, int, int], dtype: torch.dtype) -> None:
    check_backend(*case, dtype)


def test_attention_odd_head_dim_and_big_group() -> None:
    """head_dim 24 (padded to 32 inside) and a GQA group of 32 (one query token per program)."""
    check_backend("mixed", 4, 4, 24, 16, torch.float32)
    check_backend("mixed", 32, 1, 16, 16, torch.float32)


def test_unified_attention_writes_only_out() -> None:
    """The attention kernel alone, on pre-filled caches and strided q (a slice of a fused qkv)."""
    batch = make_batch([3, 1], [5, 20], 4, 2, 32, 16, torch.float32)
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    qkv = torch.cat([batch.q, torch.zeros_like(batch.q)], dim=1)  # q = qkv[:, :4] is not contiguous
    out = torch.full_like(batch.q, 7.0)
    m = batch.meta
    unified_attention(qkv[:, :4], batch.k_cache, batch.v_cache, out, m.query_start_loc, m.seq_lens,
                      m.block_tables, 0.125)  # fmt: skip
    torch.testing.assert_close(out.cpu(), reference(batch, 0.125), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_store_kv_skips_minus_one(dtype: torch.dtype) -> None:
    num_blocks, block, kv_heads, dim = 4, 16, 3, 32
    cache_shape = (num_blocks, block, kv_heads, dim)
    k_cache = torch.zeros(cache_shape, dtype=dtype, device=_DEVICE)
    v_cache = torch.zeros(cache_shape, dtype=dtype, device=_DEVICE)
    # k and v as strided slices of one fused projection, as a model produces them.
    kv = torch.randn(6, 2 * kv_heads, dim).to(dtype).to(_DEVICE)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    slots = torch.tensor([17, -1, 0, 63, -1, 40], dtype=torch.int64, device=_DEVICE)
    store_kv(k, v, k_cache, v_cache, slots)

    want_k = torch.zeros(num_blocks * block, kv_heads, dim, dtype=dtype)
    want_v = torch.zeros_like(want_k)
    keep = slots.cpu() >= 0
    want_k[slots.cpu()[keep]] = k.cpu()[keep]
    want_v[slots.cpu()[keep]] = v.cpu()[keep]
    assert torch.equal(k_cache.cpu().view_as(want_k), want_k)
    assert torch.equal(v_cache.cpu().view_as(want_v), want_v)


def test_matches_torch_attention() -> None:
    """Same outputs and caches as the PyTorch backend on a SmolLM2-shaped mixed batch."""
    batch = make_batch([1, 23, 1, 9], [50, 18, 31, 0], 9, 3, 64, 16, torch.float32, seed=1)
    m = batch.meta
    meta = AttentionMetadata(m.query_start_loc, m.seq_lens, m.block_tables, m.slot_mapping,
                             m.max_query_len, m.max_seq_len)  # fmt: skip
    # The torch backend reads whole blocks, so zero the NaN filler that padding slots would hold.
    k_cache, v_cache = batch.k_cache.nan_to_num(0.0), batch.v_cache.nan_to_num(0.0)
    k2, v2 = k_cache.clone(), v_cache.clone()
    args = (batch.q, batch.k, batch.v)
    out_triton = TritonAttention().forward(*args, k_cache, v_cache, meta, 0.125)
    out_torch = TorchAttention().forward(*args, k2, v2, meta, 0.125)
    torch.testing.assert_close(out_triton, out_torch, atol=1e-4, rtol=1e-4)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)


@pytest.mark.gpu
def test_kernels_compiled_on_cuda() -> None:
    """Every comparison above, with the kernels compiled for CUDA (a child process: this one
    defined them interpreted)."""
    if _DEVICE == "cuda":
        pytest.skip("already running on CUDA")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TOKENMILL_KERNEL_TEST_DEVICE"] = "cuda"
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
