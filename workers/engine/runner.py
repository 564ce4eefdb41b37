"""ModelRunner: turns a scheduled batch into tensors, runs the model, returns logits.

Input of a step: (sequence, number of new tokens) pairs; the new tokens are
`seq.token_ids[seq.num_computed_tokens:][:n]` and the sequence's block table already covers
them. Output: the logits of each sequence's last new token, float32 [num_seqs, vocab].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from workers.engine.attention import AttentionMetadata
from workers.engine.config import ModelConfig
from workers.engine.models import LlamaForCausalLM

if TYPE_CHECKING:
    from workers.engine.cuda_graphs import CudaGraphDecode
    from workers.engine.lora_layers import LoraState
    from workers.engine.sequence import Sequence


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cfg: ModelConfig,
        kv_caches: list[tuple[Tensor, Tensor]],
        block_size: int,
        device: str | torch.device,
        lora: LoraState | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # set when the model's projections take LoRA adapters
        self.cfg = cfg
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        # Captured decode forwards (CUDA; `capture`): a pure-decode step without adapters
        # replays one, padded to the smallest captured batch size that holds it.
        self.graphs: CudaGraphDecode | None = None
        self.graph_steps = 0  # steps that replayed a graph (tests and metrics read it)

    def capture(self, sizes: list[int], max_blocks: int) -> None:
        """Capture the decode forward for each batch size (CUDA only; see cuda_graphs.py)."""
        from workers.engine.cuda_graphs import CudaGraphDecode

        with torch.inference_mode():
            self.graphs = CudaGraphDecode(self.forward, sizes, max_blocks, self.device)

    def prepare(self, batch: list[tuple[Sequence, int]]) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """input_ids [T], positions [T] and the attention metadata of one step."""
        bs = self.block_size
        ids: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        tables: list[list[int]] = []
        for seq, n in batch:
            c = seq.num_computed_tokens
            ids.extend(seq.token_ids[c : c + n])
            if c + n > len(seq.token_ids):  # speculative decoding: the drafts follow the last token
                ids.extend(seq.spec_token_ids[: c + n - len(seq.token_ids)])
            starts.append(c)
            q_lens.append(n)
            tables.append(seq.block_table)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        start = torch.tensor(starts, dtype=torch.int64)
        q_len = torch.tensor(q_lens, dtype=torch.int64)
        seq_lens = start + q_len
        query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int64)
        torch.cumsum(q_len, 0, out=query_start_loc[1:])
        num_tokens = len(ids)
        if num_tokens != sum(q_lens):
            raise ValueError("a sequence was scheduled more new tokens than it has")
        if num_tokens == len(batch):  # pure decode (the hot loop): one token per sequence
            positions, seq_of_token = start, torch.arange(len(batch))
        else:  # position of token i of sequence s = start_s + (i - query_start_s), vectorised
            seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), q_len)
            positions = torch.arange(num_tokens) - query_start_loc[seq_of_token] + start[seq_of_token]
        slots = block_tables[seq_of_token, positions // bs].long() * bs + positions % bs
        meta = AttentionMetadata(
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=block_tables,
            slot_mapping=slots,
            max_query_len=max(q_lens),
            max_seq_len=int(seq_lens.max()),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64)
        if self.device.type != "cpu":
            input_ids, positions = self._to_device(input_ids), self._to_device(positions)
            meta.query_start_loc = self._to_device(meta.query_start_loc)
            meta.seq_lens = self._to_device(meta.seq_lens)
            meta.block_tables = self._to_device(meta.block_tables)
            meta.slot_mapping = self._to_device(meta.slot_mapping)
        return input_ids, positions, meta

    def _to_device(self, t: Tensor) -> Tensor:
        return t.pin_memory().to(self.device, non_blocking=True)

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, keep: Tensor | None = None
    ) -> Tensor:
        """Hidden states [T, hidden] of one step's tokens, or of the rows `keep` only (every
        token's k/v lands in the cache either way)."""
        return self.model(input_ids, positions, self.kv_caches, meta, keep)

    @torch.inference_mode()
    def execute(self, batch: list[tuple[Sequence, int]], num_logits: list[int] | None = None) -> Tensor:
        """Logits of the last new token of every sequence, float32 [num_seqs, vocab]; with
        `num_logits`, of the last `num_logits[i]` new tokens of sequence i, in order (to verify
        draft tokens), float32 [sum(num_logits), vocab]."""
        return self.model.compute_logits(self.hidden(batch, num_logits))

    @torch.inference_mode()
    def hidden(self, batch: list[tuple[Sequence, int]], num_logits: list[int] | None = None) -> Tensor:
        """What `execute` computes the logits of: the final hidden states of those rows."""
        input_ids, positions, meta = self.prepare(batch)
        adapted = False
        if self.lora is not None:  # each token's adapter slot, for the adapted projections
            self.lora.begin(batch, self.device)
            adapted = self.lora.batch is not None
        last = meta.query_start_loc[1:].long() - 1
        if num_logits is not None:
            ends = last.tolist()
            rows = [e - j for e, m in zip(ends, num_logits, strict=True) for j in range(m - 1, -1, -1)]
            last = torch.tensor(rows, dtype=torch.int64, device=input_ids.device)
        graphs = self.graphs
        if (
            graphs is not None
            and not adapted
            and num_logits is None
            and meta.max_query_len == 1
            and graphs.can_run(len(batch), meta.block_tables.shape[1])
        ):
            hidden = graphs.run(input_ids, positions, meta)[last]
            self.graph_steps += 1
        elif adapted or last.numel() == input_ids.numel():
            hidden = self.forward(input_ids, positions, meta)[last]
        else:
            # Only the sampled rows' hidden states go on: the model may skip the others'
            # last-layer work (the adapted projections index adapters by token: all rows there).
            hidden = self.forward(input_ids, positions, meta, last)
        return hidden
