"""CUDA graphs for decode steps: the model's forward for a pure-decode batch, captured once per
batch size and replayed, so a step launches one graph instead of hundreds of kernels.

A decode step is the same shape whatever it holds (B tokens, one per sequence); only the
number of sequences changes from step to step. Graphs are captured for a few sizes
(`capture_sizes`: 1, 2, 4, 8, then every 8 up to the largest batch), and a batch of n sequences
runs in the smallest graph of at least n (`padded_size`), padded with sequences that write
nothing and whose outputs are dropped (`pad_decode`): their one token has slot -1 (never stored)
and attends one key, its block table all zeros. Capture and replay need CUDA; the choice of
sizes and the padding are plain tensor code, tested on the CPU.

Only steps without LoRA adapters replay (their per-step grouping is data-dependent); steps with
adapters, prefill chunks and batches larger than the largest graph run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from workers.engine.attention import AttentionMetadata

# Batch sizes up to this are captured one by one (1, 2, 4, 8); past it, every _STEP.
_SMALL = (1, 2, 4, 8)
_STEP = 8


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending; the largest is `max_num_seqs` (rounded up to the step)."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be at least 1")
    sizes = [s for s in _SMALL if s < max_num_seqs]
    size = _STEP
    while size < max_num_seqs:
        size += _STEP
        sizes.append(size)
    if not sizes or sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs if max_num_seqs <= _SMALL[-1] else -(-max_num_seqs // _STEP) * _STEP)
    return sorted(set(sizes))


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding n sequences; None when n is past the largest."""
    for size in sizes:
        if size >= n:
            return size
    return None


def pad_decode(
    input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, size: int, width: int
) -> tuple[Tensor, Tensor, AttentionMetadata]:
    """A pure-decode batch of n <= size sequences as `size` sequences whose block tables are
    `width` wide: the real ones first, unchanged, then padding that stores nothing (slot -1) and
    attends one key of block 0 (zeros in a fresh pool, finite in any)."""
    n = input_ids.shape[0]
    if n > size or meta.block_tables.shape[1] > width:
        raise ValueError(
            f"a batch of {n} x {meta.block_tables.shape[1]} blocks does not fit {size} x {width}"
        )
    if int(meta.query_start_loc[-1]) != n:
        raise ValueError("only a pure decode batch (one token per sequence) can be padded")
    pad = size - n
    device = input_ids.device
    ids = torch.cat([input_ids, torch.zeros(pad, dtype=input_ids.dtype, device=device)])
    pos = torch.cat([positions, torch.zeros(pad, dtype=positions.dtype, device=device)])
    tables = torch.zeros(size, width, dtype=meta.block_tables.dtype, device=device)
    tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
    slots = torch.cat(
        [meta.slot_mapping, torch.full((pad,), -1, dtype=meta.slot_mapping.dtype, device=device)]
    )
    seq_lens = torch.cat([meta.seq_lens, torch.ones(pad, dtype=meta.seq_lens.dtype, device=device)])
    padded = AttentionMetadata(
        query_start_loc=torch.arange(size + 1, dtype=meta.query_start_loc.dtype, device=device),
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=max(meta.max_seq_len, 1),
    )
    return ids, pos, padded


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    out: Tensor  # the hidden states the graph writes, [size, hidden]


class CudaGraphDecode:
    """Captured decode forwards, one per size, sharing one set of static input buffers.

    `forward(input_ids, positions, meta)` is the model's forward over the runner's KV caches;
    the buffers hold the largest batch, and each graph reads the first `size` rows of them.
    """

    def __init__(
        self,
        forward: Callable[[Tensor, Tensor, AttentionMetadata], Tensor],
        sizes: list[int],
        max_blocks: int,
        device: torch.device,
    ) -> None:
        self.sizes = sizes
        self.width = max_blocks
        big = sizes[-1]
        self._ids = torch.zeros(big, dtype=torch.int64, device=device)
        self._pos = torch.zeros(big, dtype=torch.int64, device=device)
        self._slots = torch.full((big,), -1, dtype=torch.int64, device=device)
        self._seq_lens = torch.ones(big, dtype=torch.int32, device=device)
        self._starts = torch.arange(big + 1, dtype=torch.int32, device=device)
        self._tables = torch.zeros(big, max_blocks, dtype=torch.int32, device=device)
        self._graphs: dict[int, _Graph] = {}
        pool = None
        # Largest first: the smaller graphs reuse the memory pool the largest one set up.
        for size in reversed(sizes):
            meta = self._meta(size)
            forward(self._ids[:size], self._pos[:size], meta)  # warm up (allocations, autotuning)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(self._ids[:size], self._pos[:size], meta)
            pool = graph.pool()
            self._graphs[size] = _Graph(graph, out)
        torch.cuda.synchronize(device)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self._starts[: size + 1],
            seq_lens=self._seq_lens[:size],
            block_tables=self._tables[:size],
            slot_mapping=self._slots[:size],
            max_query_len=1,
            max_seq_len=self.width,  # unread by the Triton kernels; fixed for the capture
        )

    def can_run(self, num_seqs: int, width: int) -> bool:
        return padded_size(num_seqs, self.sizes) is not None and width <= self.width

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """Hidden states [n, hidden] of a pure-decode batch of n sequences, by graph replay."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        assert size is not None
        ids, pos, padded = pad_decode(input_ids, positions, meta, size, self.width)
        self._ids[:size].copy_(ids)
        self._pos[:size].copy_(pos)
        self._slots[:size].copy_(padded.slot_mapping)
        self._seq_lens[:size].copy_(padded.seq_lens)
        self._tables[:size].copy_(padded.block_tables)
        entry = self._graphs[size]
        entry.graph.replay()
        return entry.out[:n]
