"""Attention over the paged KV cache: the step's metadata, the backend interface, and the
plain PyTorch backend (the CPU path and the reference the Triton kernels are tested against)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(slots=True)
class AttentionMetadata:
    # One step's batch: the new tokens of every scheduled sequence, laid end to end (T tokens).
    query_start_loc: Tensor  # int32 [num_seqs + 1], cumulative counts of new tokens
    seq_lens: Tensor  # int32 [num_seqs], tokens in context after this step (cached + new)
    block_tables: Tensor  # int32 [num_seqs, max_blocks_per_seq], unused entries 0
    slot_mapping: Tensor  # int64 [T], cache slot of each new token; -1 = do not store
    max_query_len: int
    max_seq_len: int


class AttentionBackend(Protocol):
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """q [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim]; caches
        [num_blocks, block_size, num_kv_heads, head_dim]. Stores k, v at meta.slot_mapping
        (skipping -1), then attends causally over each sequence's context. Returns
        [T, num_heads, head_dim]."""
        ...


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write each new token's k/v into its cache slot; slot -1 (padding) is not stored."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


@dataclass(slots=True)
class _DecodeGroup:
    """Decoding sequences of similar context length, attended together with padding."""

    rows: Tensor  # int64 [B], their token rows in the step's batch
    blocks: Tensor  # int64 [B, nb], their block tables cut to the group's longest context
    mask: Tensor  # bool [B, 1, 1, nb * block_size], True where a key is in context


@dataclass(slots=True)
class _Plan:
    """How one step's batch is split; computed once per step and shared by every layer."""

    decodes: list[_DecodeGroup]
    prefills: list[tuple[int, int, int, int]]  # (seq index, first token row, q_len, seq_len)
    pure_decode: bool  # one group holding every token in order: its output is the output


class TorchAttention:
    """Plain PyTorch attention for mixed prefill/decode batches over the paged cache.

    Decoding sequences (q_len 1, the hot loop) are batched: sorted by context length into a
    few groups, each gathered block-wise into one padded tensor and run through SDPA with a
    length mask. Prefill chunks run one sequence at a time through SDPA with a causal mask
    offset by the cached context. Everything is read back from the cache after the store, so
    a token stored at slot -1 is not seen (as in the Triton kernels).
    """

    def __init__(self) -> None:
        # The metadata is one object per step shared by all layers: plan once per object.
        self._meta: AttentionMetadata | None = None
        self._block_size = 0
        self._plan = _Plan([], [], False)
        # Reused destination of the decode gather: a fresh multi-MB tensor per layer and step
        # goes back to the OS on free, and its page faults cost as much as the gather itself.
        self._scratch = torch.empty(0)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        block_size = k_cache.shape[1]
        if self._meta is not meta or self._block_size != block_size:
            self._plan = _make_plan(meta, block_size)
            self._meta, self._block_size = meta, block_size
        plan = self._plan
        if plan.pure_decode:
            return self._decode(q, k_cache, v_cache, plan.decodes[0], scale)
        out = torch.empty_like(q)
        for group in plan.decodes:
            out[group.rows] = self._decode(q[group.rows], k_cache, v_cache, group, scale)
        for s, start, q_len, seq_len in plan.prefills:
            out[start : start + q_len] = _prefill(
                q[start : start + q_len], k_cache, v_cache, meta.block_tables[s], seq_len, scale
            )
        return out

    def _decode(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, group: _DecodeGroup, scale: float
    ) -> Tensor:
        """Single-token queries of B sequences against their contexts, padded to the longest."""
        b, num_blocks = group.blocks.shape
        # One block-wise gather per tensor into [B, L, kvh, d]; SDPA takes the [B, kvh, L, d]
        # view as strided input, so there is no second copy (measured fastest on CPU).
        k, v = self._buffers((b * num_blocks, *k_cache.shape[1:]), k_cache)
        torch.index_select(k_cache, 0, group.blocks.view(-1), out=k)
        torch.index_select(v_cache, 0, group.blocks.view(-1), out=v)
        shape = (b, num_blocks * k_cache.shape[1], *k_cache.shape[2:])
        out = F.scaled_dot_product_attention(
            q[:, :, None],
            k.view(shape).transpose(1, 2),
            v.view(shape).transpose(1, 2),
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.view(q.shape)

    def _buffers(self, shape: tuple[int, ...], like: Tensor) -> tuple[Tensor, Tensor]:
        size = math.prod(shape)
        s = self._scratch
        if s.numel() < 2 * size or s.dtype != like.dtype or s.device != like.device:
            # Room to spare: contexts grow a block at a time, so do not reallocate each time.
            s = self._scratch = torch.empty(4 * size, dtype=like.dtype, device=like.device)
        return s[:size].view(shape), s[size : 2 * size].view(shape)


# Decoding sequences are split into up to _MAX_GROUPS groups of similar context length when
# that saves work: padding every context to the batch's longest wastes up to half of it on
# mixed lengths, while each extra group costs about _GROUP_COST tokens' worth of attention
# (one more gather, SDPA call and scatter per layer; measured on CPU).
_MAX_GROUPS = 4
_GROUP_COST = 512


def _make_plan(meta: AttentionMetadata, block_size: int) -> _Plan:
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    prefills = [(s, starts[s], n, seq_lens[s]) for s, n in enumerate(q_lens) if n > 1]
    splits = _split([seq_lens[s] for s in decodes])
    if len(splits) > 1:
        decodes.sort(key=seq_lens.__getitem__)
    groups = []
    device = meta.block_tables.device
    for lo, hi in itertools.pairwise([0, *splits]):
        seqs = decodes[lo:hi]
        idx = torch.tensor(seqs, device=device)
        num_blocks = -(-max(seq_lens[s] for s in seqs) // block_size)
        mask = torch.arange(num_blocks * block_size, device=device) < meta.seq_lens[idx, None]
        rows = torch.tensor([starts[s] for s in seqs], device=device)
        blocks = meta.block_tables[idx, :num_blocks].long().contiguous()
        groups.append(_DecodeGroup(rows, blocks, mask[:, None, None, :]))
    # One unsorted group holding every token (so in order) needs no scatter into an output.
    pure = not prefills and len(groups) == 1 and len(decodes) == len(q_lens)
    return _Plan(groups, prefills, pure)


def _split(lens: list[int]) -> list[int]:
    """Group ends (into the lengths sorted) minimising padded keys + _GROUP_COST per group,
    over equal-count splits into 1.._MAX_GROUPS groups; [len(lens)] = one group."""
    if not lens:
        return []
    ordered = sorted(lens)
    best, best_cost = [len(lens)], len(lens) * ordered[-1]
    for g in range(2, min(_MAX_GROUPS, len(lens)) + 1):
        ends = [-(-len(lens) * i // g) for i in range(1, g + 1)]
        cost = sum((hi - lo) * ordered[hi - 1] for lo, hi in itertools.pairwise([0, *ends]))
        cost += _GROUP_COST * (g - 1)
        if cost < best_cost:
            best, best_cost = ends, cost
    return best


def _prefill(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_len: int, scale: float
) -> Tensor:
    """q_len queries (the last q_len positions of a seq_len context) of one sequence."""
    q_len = q.shape[0]
    block_size = k_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)  # [kvh, seq_len, d]
    v = v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
    if q_len == seq_len:  # no cached context: the plain causal mask
        mask = None
    else:  # query i sits at position seq_len - q_len + i and sees keys 0..that position
        pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def select_backend(device: str | torch.device, override: str | None = None) -> AttentionBackend:
    """Triton on CUDA, PyTorch elsewhere; `override` ("torch" / "triton") forces one."""
    name = override or ("triton" if torch.device(device).type == "cuda" else "torch")
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        # Imported lazily: Triton (and its interpreter flag) must not load on the CPU path.
        from workers.engine.triton_attention import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")
