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
    """Write each new token's k/v into its cache slot (in the cache's dtype); slot -1 (padding)
    is not stored."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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
    length mask. Prefill chunks run one sequence at a time through SDPA: a whole prompt on its
    own k/v with the causal mask, a chunk after cached context on the context read back from
    the cache, with the causal mask offset by it (there a token stored at slot -1 is not seen,
    as in the Triton kernels).
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
            rows = slice(start, start + q_len)
            out[rows] = _prefill(
                q[rows], k[rows], v[rows], k_cache, v_cache, meta.block_tables[s], seq_len, scale
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
        # A cache in another dtype than the queries (a half-precision one) is widened here.
        out = F.scaled_dot_product_attention(
            q[:, :, None],
            k.view(shape).transpose(1, 2).to(q.dtype),
            v.view(shape).transpose(1, 2).to(q.dtype),
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
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_len: int,
    scale: float,
) -> Tensor:
    """q_len queries (the last q_len positions of a seq_len context) of one sequence; k_new,
    v_new are their own keys and values (just stored in the cache)."""
    q_len = q.shape[0]
    if q_len == seq_len:  # a whole prompt: its context is its own k/v, no need to read the cache
        return _sdpa_gqa(q, k_new, v_new, None, scale)
    block_size = k_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)  # [seq_len, kvh, d]
    v = v_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype)
    # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
    pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]
    return _sdpa_gqa(q, k, v, mask, scale)


def _sdpa_gqa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Causal SDPA of q [Lq, H, d] over k, v [Lk, KVH, d] (mask [Lq, Lk], None = plain causal).

    The query heads sharing a kv head become the head dimension of a batch over kv heads, and
    k/v are broadcast to them with stride 0: no copy, and the CPU's flash kernel takes it. With
    `enable_gqa=True` instead, SDPA on the CPU repeats k/v and falls back to its math path
    (measured 4-10x slower on SmolLM2's prompts)."""
    lq, heads, d = q.shape
    lk, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    qq = q.view(lq, kv_heads, group, d).permute(1, 2, 0, 3)  # [KVH, G, Lq, d]
    kk = k.permute(1, 0, 2)[:, None].expand(kv_heads, group, lk, d)
    vv = v.permute(1, 0, 2)[:, None].expand(kv_heads, group, lk, d)
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(lq, heads, d)


# Sequences with at most this many new tokens (decodes, verified drafts) go to the CPU kernel's
# walk per query row; longer ones (prefill chunks) to its walk per run of rows, where each key
# and value row read serves every query of the run.
KERNEL_MAX_QUERY = 8


class CpuAttention(TorchAttention):
    """The CPU path: a C kernel (workers/engine/csrc) that reads every key and value row in
    place in the paged cache, one pass, no gather, no padding to the longest context: short
    queries a row at a time, prefill chunks (whole prompts too, read back from the cache they
    were just stored in) in runs of rows, one call per layer for all of a step's prefills.
    Against the per-sequence SDPA calls of TorchAttention, 1.3-2x on this attention alone."""

    def __init__(self, lib: object) -> None:
        super().__init__()
        self.lib = lib  # also the model's fused elementwise ops (LlamaForCausalLM.use_cpu_ops)
        self._lib = lib
        self._checked: tuple[int, ...] = ()
        # This step's split (planned once per metadata object, apart from the parent's plan,
        # which the fallback path keeps using): kernel rows and SDPA prefills.
        self._kmeta: AttentionMetadata | None = None
        self._rows: Tensor | None = None  # int32 query rows for the kernel; None = every row
        self._row_seq = torch.empty(0, dtype=torch.int32)
        self._prefill_seqs = torch.empty(0, dtype=torch.int32)

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
        from workers.engine import cpu_kernels

        shape = (q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1])
        if (
            q.dtype != torch.float32
            or k_cache.dtype not in cpu_kernels.KV_DTYPES
            or q.device.type != "cpu"
            or (shape != self._checked and not cpu_kernels.supports(self._lib, *shape))  # type: ignore[arg-type]
        ):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        self._checked = shape
        if k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(2) == 1 and v.stride(1) == v.shape[2]:
            cpu_kernels.store_kv(self._lib, k, v, meta.slot_mapping, k_cache, v_cache)  # type: ignore[arg-type]
        else:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if self._kmeta is not meta:
            self._plan_kernel(meta)
            self._kmeta = meta
        q = q.contiguous()
        out = torch.empty_like(q)
        context = (q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
        lib = self._lib
        if self._row_seq.numel():
            cpu_kernels.paged_attention(lib, *context, self._rows, self._row_seq, scale, out)  # type: ignore[arg-type]
        if self._prefill_seqs.numel():
            cpu_kernels.prefill_attention(lib, *context, self._prefill_seqs, scale, out)  # type: ignore[arg-type]
        return out

    def _plan_kernel(self, meta: AttentionMetadata) -> None:
        starts = meta.query_start_loc.tolist()
        rows: list[int] = []
        row_seq: list[int] = []
        prefills = []
        for s, (a, b) in enumerate(itertools.pairwise(starts)):
            if b - a <= KERNEL_MAX_QUERY:
                rows.extend(range(a, b))
                row_seq.extend([s] * (b - a))
            else:
                prefills.append(s)
        self._prefill_seqs = torch.tensor(prefills, dtype=torch.int32)
        self._row_seq = torch.tensor(row_seq, dtype=torch.int32)
        # Rows in order from 0 (every row a kernel row: the hot decode loop) need no index.
        self._rows = None if len(rows) == starts[-1] else torch.tensor(rows, dtype=torch.int32)
        if meta.block_tables.dtype != torch.int32 or not meta.block_tables.is_contiguous():
            meta.block_tables = meta.block_tables.to(torch.int32).contiguous()
        meta.query_start_loc = meta.query_start_loc.to(torch.int32).contiguous()
        meta.seq_lens = meta.seq_lens.to(torch.int32).contiguous()


def select_backend(
    device: str | torch.device, override: str | None = None, cache: str | None = None
) -> AttentionBackend:
    """Triton on CUDA; on the CPU the C kernel when it builds (`cache`: where it is kept), else
    PyTorch. `override` ("cpu" / "torch" / "triton") forces one."""
    is_cuda = torch.device(device).type == "cuda"
    name = override or ("triton" if is_cuda else "cpu")
    if name == "cpu":
        from workers.engine import cpu_kernels

        lib = None if is_cuda else cpu_kernels.load(cache)
        return CpuAttention(lib) if lib is not None else TorchAttention()
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        # Imported lazily: Triton (and its interpreter flag) must not load on the CPU path.
        from workers.engine.triton_attention import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; expected 'cpu', 'torch' or 'triton'")
