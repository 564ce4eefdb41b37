"""Paged attention for a mixed batch (decodes and prefill chunks) in ONE kernel.

Why one kernel rather than a decode kernel plus a prefill kernel: the scheduler mixes decodes and
prefill chunks (with or without cached context) in every step, and in this layout the three cases
differ only in the query length. A decode is a query of length 1 whose context is all in the
cache; a prefill chunk is a query of length n whose first `seq_len - n` positions are in the
cache. So one kernel (vLLM's triton `unified_attention` design) covers all of them with one launch,
one code path to test and no host-side split of the batch (which would need a device->host sync
and breaks CUDA-graph capture).

Work split: a program owns (a tile of BLOCK_Q query tokens of one sequence) x (one kv head).
The GQA group — the GROUP query heads that share that kv head — is packed into the rows of the
tile (BLOCK_M = BLOCK_Q * GROUP rows, padded), so every K/V tile loaded from the cache serves the
whole group and `tl.dot` has M >= 16 even for a decode (one query token). The program walks the
sequence's blocks with an online softmax (flash attention): one cache block per iteration, so a
tile never straddles two physical blocks.

Grid: sequence s gets `cu_q[s] // BLOCK_Q + s` as its first query tile, which leaves room for
ceil(q_len / BLOCK_Q) tiles; the grid is `T // BLOCK_Q + num_seqs` tiles (O(T), not
num_seqs * max_query_len) and each program finds its sequence by binary search over cu_q.
The few spare tiles exit at once.

Known limit: a decode's context is walked by one program per kv head, so a small batch of very
long contexts under-fills a big GPU (vLLM adds a split-KV variant for that case).
"""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp2 is the native instruction


@triton.jit
def _find_seq(cu_q_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose first tile (`cu_q[s] // BLOCK_Q + s`) is the last one <= q_tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_q_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16 (arange and tl.dot need it)
    BLOCK_SIZE: tl.constexpr,  # KV cache block size = KV tile width
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q tokens x GROUP heads (+ padding)
    BLOCK_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_q_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    local_tile = q_tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:  # spare tile of the grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # positions already in the cache before this step

    # Row r is query token r // GROUP of the tile, for query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = local_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx  # absolute position: it may see kv positions 0..q_pos (causal)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    q_off = (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    denom = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Only walk the blocks the last query of this tile can see.
    kv_end = tl.minimum(seq_len, ctx_len + (local_tile + 1) * BLOCK_Q)
    offs_n = tl.arange(0, BLOCK_SIZE)
    for j in range(0, tl.cdiv(kv_end, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        kv_pos = j * BLOCK_SIZE + offs_n
        # Mask slots past seq_len: the tail of the last block holds stale (possibly NaN) data,
        # and 0 * NaN in P @ V would poison the row even with its probability at 0.
        kv_ok = kv_pos < seq_len
        k_off = block * stride_kb + offs_n[None, :] * stride_ks + kv_head * stride_kh + dims[:, None]
        # .to: a cache in another dtype than q (half precision under fp32) is widened here.
        k = tl.load(k_cache_ptr + k_off, mask=dim_ok[:, None] & kv_ok[None, :], other=0.0)  # [D, N]
        k = k.to(q.dtype)
        v_off = block * stride_vb + offs_n[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=kv_ok[:, None] & dim_ok[None, :], other=0.0)  # [N, D]
        v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # fp32 accumulate
        s = tl.where(row_ok[:, None] & (kv_pos[None, :] <= q_pos[:, None]), s, float("-inf"))

        # Online softmax: rescale what was accumulated under the old max.
        m_new = tl.maximum(m, tl.max(s, 1))
        # Valid rows see position 0 in the first tile, so only padding rows are all -inf here;
        # keep their max finite so they compute zeros instead of NaN (-inf - -inf) garbage.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_off = (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> None:
    """Causal paged attention for decodes and prefill chunks mixed in one batch; writes `out`.

    q, out: `[T, num_heads, head_dim]`, the new tokens of all sequences end to end.
    k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, already holding every
    position `< seq_lens[s]` (store the new tokens first). cu_seqlens_q: int32 `[num_seqs + 1]`.
    seq_lens: int32 `[num_seqs]`, cached + new tokens. block_tables: int32 `[num_seqs, max_blocks]`.
    Query token i of sequence s sits at position `seq_lens[s] - q_len_s + i` and sees 0..itself.
    No host sync: safe inside CUDA-graph capture for fixed T and num_seqs.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "GQA needs num_heads to be a multiple of num_kv_heads"
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim and out.shape == q.shape
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size: power of two >= 16"
    assert cu_seqlens_q.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    for t in (q, out, k_cache, v_cache, block_tables):
        assert t.stride(-1) == 1, "last axis must be contiguous"
    group = num_heads // num_kv_heads
    # 16 rows is the smallest tl.dot tile; a larger GQA group gets one query token per program.
    block_m = max(16, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    # fp32 inputs: tl.dot would default to TF32 on NVIDIA (10-bit mantissa); keep full precision.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out,
        cu_seqlens_q, seq_lens, block_tables,
        scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, DOT_PRECISION=precision,
    )  # fmt: skip
