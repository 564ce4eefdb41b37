"""LoRA inside the model's projections, for a batch whose tokens use different adapters.

Per step, the runner calls `LoraState.begin` with the scheduled sequences: each sequence's
adapter becomes a slot index (-1 = none) for each of its tokens, and the tokens are grouped by
slot once (`LoraBatch`). Every adapted projection (`LoraLinear`, swapped in for q/k/v, o,
gate/up and down by `attach_lora`) then computes its base output and adds, for each group,
`x[group] @ A[slot].T @ B[slot].T` into the group's rows: column slice by column slice, so the
fused qkv and gate_up outputs each get their own projection's adapter. A step with no adapter
in it skips all of this.

Two backends do the adding: `TorchLora` (gather per group + matmuls; the CPU path and the
reference) and `TritonLora` (SGMV-style shrink/expand kernels, triton_lora.py), chosen like the
attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from workers.engine.linear import Linear
from workers.engine.lora import FUSED

if TYPE_CHECKING:
    from workers.engine.lora_slots import AdapterSlots, LoraStack
    from workers.engine.sequence import Sequence


@dataclass(slots=True)
class LoraBatch:
    """One step's tokens grouped by adapter slot; tokens without an adapter are left out."""

    groups: list[tuple[int, Tensor | None]]  # (slot, its token rows int64); None = every token
    # The same grouping as the kernels take it (vLLM's names in the kernel signatures):
    sorted_tokens: Tensor  # int32 [N]: token rows of every group, group after group
    lora_ids: Tensor  # int32 [G]: slot of each group
    num_tokens: Tensor  # int32 [G]
    starts: Tensor  # int32 [G]: first entry of each group in sorted_tokens
    max_tokens: int  # largest group (the kernels' grid)


def make_lora_batch(slots: list[int], q_lens: list[int], device: torch.device) -> LoraBatch | None:
    """Group the tokens of sequences using `slots[i]` (-1 = none) for `q_lens[i]` tokens each."""
    if all(s < 0 for s in slots):
        return None
    # A stable sort keeps each group's tokens in order (contiguous runs stay contiguous).
    token_slots = torch.tensor(slots, dtype=torch.int64).repeat_interleave(torch.tensor(q_lens))
    order = torch.argsort(token_slots, stable=True)
    ids, counts = torch.unique_consecutive(token_slots[order], return_counts=True)
    if int(ids[0]) < 0:  # the no-adapter tokens sort first: drop them
        order, ids, counts = order[int(counts[0]) :], ids[1:], counts[1:]
    starts = torch.cumsum(counts, 0) - counts
    count_list = counts.tolist()
    if len(count_list) == 1 and count_list[0] == len(token_slots):
        groups: list[tuple[int, Tensor | None]] = [(int(ids[0]), None)]
    else:
        rows = order.to(device)
        groups = [
            (slot, rows[start : start + n])
            for slot, start, n in zip(ids.tolist(), starts.tolist(), count_list, strict=True)
        ]
    return LoraBatch(
        groups=groups,
        sorted_tokens=order.to(device=device, dtype=torch.int32),
        lora_ids=ids.to(device=device, dtype=torch.int32),
        num_tokens=counts.to(device=device, dtype=torch.int32),
        starts=starts.to(device=device, dtype=torch.int32),
        max_tokens=max(count_list),
    )


class LoraBackend(Protocol):
    def apply(self, x: Tensor, out: Tensor, stack: LoraStack, batch: LoraBatch) -> None:
        """out[t, slice s] += x[t] @ A_s[slot(t)].T @ B_s[slot(t)].T for each adapted token t.
        x [T, in]; out [T, sum of the slices' outputs], the base projection's output."""
        ...


class TorchLora:
    """Per group: gather its rows, shrink to the rank, expand each slice into its columns."""

    def apply(self, x: Tensor, out: Tensor, stack: LoraStack, batch: LoraBatch) -> None:
        assert stack.a is not None
        rank = stack.rank
        for slot, rows in batch.groups:
            if not stack.used[slot]:
                continue  # this adapter leaves the projection alone
            xs = x if rows is None else x.index_select(0, rows)
            h = xs @ stack.a[slot].T  # [n, slices * rank]: every slice's shrink in one matmul
            col = 0
            for s, b in enumerate(stack.b):
                width = b.shape[1]
                delta = h[:, s * rank : (s + 1) * rank] @ b[slot].T
                if rows is None:
                    out[:, col : col + width] += delta
                else:
                    out[:, col : col + width].index_add_(0, rows, delta)
                col += width


def select_lora_backend(device: str | torch.device, override: str | None = None) -> LoraBackend:
    """Triton on CUDA, PyTorch elsewhere; `override` ("torch" / "triton") forces one."""
    name = override or ("triton" if torch.device(device).type == "cuda" else "torch")
    if name == "torch":
        return TorchLora()
    if name == "triton":
        # Imported lazily: Triton (and its interpreter flag) must not load on the CPU path.
        from workers.engine.triton_lora import TritonLora

        return TritonLora()
    raise ValueError(f"unknown LoRA backend {name!r}; expected 'torch' or 'triton'")


@dataclass(slots=True)
class LoraState:
    """What every LoraLinear of one model shares: the slots, the backend and this step's batch."""

    slots: AdapterSlots
    backend: LoraBackend
    batch: LoraBatch | None = None

    def begin(self, batch: list[tuple[Sequence, int]], device: torch.device) -> None:
        """Set the slot grouping of the step about to run (every adapter named is resident:
        the scheduler admitted these sequences only once it was)."""
        if all(seq.adapter_id is None for seq, _ in batch):
            self.batch = None
            return
        slot_of = self.slots.slot_of
        slots = [-1 if seq.adapter_id is None else slot_of(seq.adapter_id) for seq, _ in batch]
        self.batch = make_lora_batch(slots, [n for _, n in batch], device)


class LoraLinear(Linear):
    """A Linear (same parameters, same names) that adds the step's adapters to its output."""

    def __init__(self, base: Linear, stack: LoraStack, state: LoraState) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the parameters are the base layer's own
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self.packed, self.panels, self.lib = base.packed, base.panels, base.lib
        self.stack = stack
        self.state = state

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        batch = self.state.batch
        if batch is not None and self.stack.a is not None:
            self.state.backend.apply(x, out, self.stack, batch)
        return out


def attach_lora(model: nn.Module, slots: AdapterSlots, backend: LoraBackend) -> LoraState:
    """Swap the adaptable projections of a loaded model (workers.engine.models.llama) for
    LoraLinear layers reading `slots`; returns the state the runner sets each step."""
    state = LoraState(slots, backend)
    for i, layer in enumerate(model.model.layers):
        for fused in FUSED:
            parent = layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp
            base = getattr(parent, fused)
            if isinstance(base, LoraLinear):
                raise ValueError("LoRA is already attached to this model")
            setattr(parent, fused, LoraLinear(base, slots.stacks[i][fused], state))
    return state
