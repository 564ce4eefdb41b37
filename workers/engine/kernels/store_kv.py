"""KV store by slot mapping: vLLM's `reshape_and_cache_flash` for the layout
`[num_blocks, block_size, num_kv_heads, head_dim]`."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per token: it copies all kv heads of that token (a few KiB at most) in one tile.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)  # int64, so the cache offsets below cannot overflow
    if slot < 0:  # -1 = padding / do not store
        return
    block = slot // BLOCK_SIZE
    pos = slot % BLOCK_SIZE
    # arange needs powers of two: pad heads and dims, mask the padding.
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)

    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + pos * stride_kcs + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + pos * stride_vcs + h * stride_vch + d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `k`, `v` `[T, num_kv_heads, head_dim]` into the caches at `slot_mapping` `[T]` (int64).

    Slot -1 skips the token. `k`/`v` may be strided views (e.g. slices of a fused qkv output)
    as long as the last dimension is contiguous; values are cast to the cache dtype.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    assert v.shape == k.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "cache must be [blocks, block_size, kv_heads, dim]"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,)
    for t in (k, v, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head_dim axis must be contiguous"
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
