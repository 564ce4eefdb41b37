"""LoRA shrink: `out[t] = scaling * x[t] @ A[slot(t)].T` for a batch mixing adapters (SGMV).

The tokens arrive grouped by adapter slot (a sort done once per step, shared by every layer):
a program owns BLOCK_M tokens of one group x BLOCK_N output columns, gathers those rows of x,
and multiplies them by the group's A, so each A tile is loaded once per BLOCK_M tokens instead
of once per token (the BGMV alternative), and a group of one token (a decode) costs one tile.
The signature follows vLLM's `lora_shrink` op: the grouping tensors carry its names.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr,
    sorted_ptr, num_tokens_ptr, start_ptr, lora_ids_ptr,
    scaling, N, K,
    stride_xt, stride_xk, stride_al, stride_an, stride_ak, stride_ot, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TILES_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    group = tl.program_id(1)
    tile_m = pid // TILES_N
    tile_n = pid % TILES_N
    slot = tl.load(lora_ids_ptr + group)
    count = tl.load(num_tokens_ptr + group)
    if slot < 0 or tile_m * BLOCK_M >= count:  # no adapter, or a spare tile of a smaller group
        return
    start = tl.load(start_ptr + group)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    tokens = tl.load(sorted_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a = tl.load(  # A is [N, K]; the tile is read transposed, [BLOCK_K, BLOCK_N]
            a_base + cols[None, :] * stride_an + ks[:, None] * stride_ak,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(x, a.to(x.dtype), input_precision=DOT_PRECISION)
    dst = out_ptr + tokens[:, None] * stride_ot + cols[None, :] * stride_on
    tl.store(dst, (acc * scaling).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def lora_shrink(
    inputs: torch.Tensor,
    lora_a: torch.Tensor,
    output: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    max_tokens_per_lora: int,
    scaling: float = 1.0,
) -> None:
    """`output[t, :] = scaling * inputs[t] @ lora_a[slot].T` for every token t of every group.

    inputs `[T, K]`; lora_a `[num_slots, N, K]` (the slices of a fused projection stacked
    along N); output `[T, N]`, fp32 normally (vLLM's choice: the rank-sized intermediate keeps
    full precision). Group g holds `num_tokens_per_lora[g]` token rows, listed in
    `token_indices_sorted_by_lora_ids` from `lora_token_start_loc[g]`, and uses slot
    `lora_ids[g]` (-1: skipped). Rows of tokens in no group are left untouched. The int32
    grouping tensors are built once per step; `max_tokens_per_lora` sizes the grid.
    """
    num_groups = lora_ids.shape[0]
    if num_groups == 0 or max_tokens_per_lora == 0 or inputs.shape[0] == 0:
        return
    _, n, k = lora_a.shape
    assert inputs.shape[1] == k and output.shape == (inputs.shape[0], n), "shapes do not line up"
    for t in (token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids):
        assert t.dtype == torch.int32, "grouping tensors are int32"
    block_m = 16  # tl.dot's smallest tile; a decode group is one token
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    tiles_n = triton.cdiv(n, block_n)
    grid = (triton.cdiv(max_tokens_per_lora, block_m) * tiles_n, num_groups)
    # fp32 inputs: tl.dot would default to TF32 on NVIDIA (10-bit mantissa); keep full precision.
    precision = "ieee" if inputs.dtype == torch.float32 else "tf32"
    _lora_shrink_kernel[grid](
        inputs, lora_a, output,
        token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
        scaling, n, k,
        inputs.stride(0), inputs.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        output.stride(0), output.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TILES_N=tiles_n, DOT_PRECISION=precision,
    )  # fmt: skip
