"""LoRA expand: `out[t, offset:offset+N] += h[t] @ B[slot(t)].T` for a batch mixing adapters.

The second half of SGMV (see lora_shrink.py for the grouping): `h` is the shrink's rank-sized
output, and each slice of a fused projection (q, k, v of qkv; gate, up of gate_up) is expanded
into its own column range of the fused output, so one base matmul and one adapter pass serve
the three (or two) projections. The signature follows vLLM's `lora_expand` op.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, out_ptr,
    sorted_ptr, num_tokens_ptr, start_ptr, lora_ids_ptr,
    N, R, col_offset,
    stride_ht, stride_hr, stride_bl, stride_bn, stride_br, stride_ot, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    TILES_N: tl.constexpr, ADD_INPUTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    group = tl.program_id(1)
    tile_m = pid // TILES_N
    tile_n = pid % TILES_N
    slot = tl.load(lora_ids_ptr + group)
    count = tl.load(num_tokens_ptr + group)
    if slot < 0 or tile_m * BLOCK_M >= count:
        return
    start = tl.load(start_ptr + group)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    tokens = tl.load(sorted_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_base = b_ptr + slot.to(tl.int64) * stride_bl
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < R
        h = tl.load(
            h_ptr + tokens[:, None] * stride_ht + rs[None, :] * stride_hr,
            mask=row_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        b = tl.load(  # B is [N, R]; the tile is read transposed, [BLOCK_R, BLOCK_N]
            b_base + cols[None, :] * stride_bn + rs[:, None] * stride_br,
            mask=r_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        # In the weights' precision (fp32 h rounded to fp16/bf16 as vLLM does), fp32 accumulate.
        acc += tl.dot(h.to(b.dtype), b, input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    dst = out_ptr + tokens[:, None] * stride_ot + (col_offset + cols)[None, :] * stride_on
    if ADD_INPUTS:
        acc += tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand(
    inputs: torch.Tensor,
    lora_b: list[torch.Tensor],
    output: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    max_tokens_per_lora: int,
    offset_start: int = 0,
    add_inputs: bool = True,
) -> None:
    """For each slice s (rank R, `lora_b[s]` `[num_slots, N_s, R]`): the grouped tokens' rows
    of `output[:, offset_s : offset_s + N_s]` get `inputs[t, s*R:(s+1)*R] @ lora_b[s][slot].T`
    added (`add_inputs`) or written, where offset_0 = `offset_start` and each slice starts
    where the previous one ends. inputs `[T, len(lora_b) * R]` (the shrink's output); output
    `[T, total]`. The grouping tensors are lora_shrink's. One launch per slice.
    """
    num_groups = lora_ids.shape[0]
    if num_groups == 0 or max_tokens_per_lora == 0 or inputs.shape[0] == 0:
        return
    rank = lora_b[0].shape[2]
    assert inputs.shape == (output.shape[0], len(lora_b) * rank), "inputs must be [T, slices * rank]"
    assert offset_start + sum(b.shape[1] for b in lora_b) <= output.shape[1], "slices overrun the output"
    block_m = 16
    block_r = max(16, min(64, triton.next_power_of_2(rank)))
    precision = "ieee" if lora_b[0].dtype == torch.float32 else "tf32"
    col = offset_start
    for s, b in enumerate(lora_b):
        assert b.shape[2] == rank, "every slice has the same (padded) rank"
        n = b.shape[1]
        h = inputs[:, s * rank : (s + 1) * rank]  # a strided view: the kernel takes strides
        block_n = max(16, min(64, triton.next_power_of_2(n)))
        tiles_n = triton.cdiv(n, block_n)
        grid = (triton.cdiv(max_tokens_per_lora, block_m) * tiles_n, num_groups)
        _lora_expand_kernel[grid](
            h, b, output,
            token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids,
            n, rank, col,
            h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2),
            output.stride(0), output.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, TILES_N=tiles_n,
            ADD_INPUTS=add_inputs, DOT_PRECISION=precision,
        )  # fmt: skip
        col += n
