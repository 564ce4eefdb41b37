"""Where adapters live in the engine: a registry of loaded adapters (CPU copies, up to
`max_cpu_loras`) and `max_loras` device slots that batches read from.

Every fused projection of every layer has a `LoraStack`: the A and B matrices of all slots
stacked (`[max_loras, slices * R, in]` and, per slice, `[max_loras, out, R]`), ranks
zero-padded to a common R, so one step's tokens can use different adapters by slot index.
Stacks are allocated the first time an adapter adapts their projection, and R grows (up to
`max_rank`) with the largest rank loaded: an engine that never sees an adapter pays nothing.

Both tiers evict their least recently used entry when full, but never an adapter in use: a
slot is safe while a running sequence uses its adapter (the scheduler admits a sequence only
once its adapter has a slot), a registry entry while any unfinished sequence names it. The
engine passes those sets in; this class knows nothing of sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from workers.engine.config import ModelConfig
from workers.engine.lora import FUSED, SLICES, AdapterBusy, AdapterError, LoraAdapter, module_shape


@dataclass(slots=True)
class LoraStack:
    """One fused projection of one layer: every slot's LoRA weights, stacked by slot."""

    in_features: int
    out_sizes: list[int]  # per slice (q, k, v / gate, up / the one output)
    a: Tensor | None = None  # [max_loras, slices * rank, in]: slice s uses rows s*rank..(s+1)*rank
    b: list[Tensor] = field(default_factory=list)  # per slice [max_loras, out, rank]
    used: list[bool] = field(default_factory=list)  # per slot: its adapter adapts this projection

    @property
    def rank(self) -> int:
        return self.b[0].shape[2] if self.b else 0


Busy = Callable[[], set[str]]


class AdapterSlots:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_rank must be positive")
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras or 2 * max_loras, max_loras)
        self.dtype = dtype
        self.device = torch.device(device)
        self.stacks: list[dict[str, LoraStack]] = [
            {
                fused: LoraStack(
                    module_shape(cfg, modules[0])[0],
                    [module_shape(cfg, m)[1] for m in modules],
                    used=[False] * max_loras,
                )
                for fused, modules in FUSED.items()
            }
            for _ in range(cfg.num_layers)
        ]
        self._rank = 0  # R of every allocated stack
        self._registered: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._resident: OrderedDict[str, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._free = list(range(max_loras - 1, -1, -1))
        # Read from other threads (heartbeats, the worker's API): replaced, never mutated.
        self.ids: tuple[str, ...] = ()

    # --- the registry -------------------------------------------------------------------------

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._registered

    @property
    def resident(self) -> list[str]:
        return list(self._resident)

    def get(self, adapter_id: str) -> LoraAdapter:
        adapter = self._registered.get(adapter_id)
        if adapter is None:
            raise AdapterError(f"adapter {adapter_id!r} is not loaded")
        return adapter

    def add(self, adapter: LoraAdapter, in_use: Busy) -> list[str]:
        """Register an adapter (a copy kept on the CPU until it needs a slot), evicting the
        least recently used unused ones if the registry is full; returns the evicted ids.
        AdapterBusy if every registered adapter is in use."""
        if adapter.rank > self.max_rank:
            raise AdapterError(
                f"adapter {adapter.adapter_id!r} has rank {adapter.rank}; this engine's maximum is "
                f"{self.max_rank}"
            )
        if adapter.adapter_id in self._registered:
            # Ids name immutable files (a new upload is a new id), so this is the same adapter.
            self._registered.move_to_end(adapter.adapter_id)
            return []
        evicted = []
        if len(self._registered) >= self.max_cpu_loras:
            busy = in_use()
            victim = next((i for i in self._registered if i not in busy), None)
            if victim is None:
                raise AdapterBusy(
                    f"cannot load adapter {adapter.adapter_id!r}: all {self.max_cpu_loras} loaded adapters "
                    "are in use"
                )
            self._drop(victim)
            evicted.append(victim)
        self._registered[adapter.adapter_id] = adapter
        self.ids = tuple(self._registered)
        return evicted

    def remove(self, adapter_id: str, in_use: Busy) -> None:
        """Forget an adapter; AdapterError if it is not loaded, AdapterBusy if requests use it."""
        self.get(adapter_id)
        if adapter_id in in_use():
            raise AdapterBusy(f"adapter {adapter_id!r} is in use by unfinished requests")
        self._drop(adapter_id)

    def _drop(self, adapter_id: str) -> None:
        del self._registered[adapter_id]
        slot = self._resident.pop(adapter_id, None)
        if slot is not None:
            self._free.append(slot)  # its weights are overwritten when the slot is reused
        self.ids = tuple(self._registered)

    # --- the device slots -----------------------------------------------------------------------

    def slot_of(self, adapter_id: str) -> int:
        """The slot of a resident adapter (KeyError if it has none)."""
        return self._resident[adapter_id]

    def acquire(self, adapter_id: str, busy: Busy) -> bool:
        """Make a registered adapter resident, evicting the least recently used slot whose
        adapter no running sequence uses; False if there is no such slot now."""
        slot = self._resident.get(adapter_id)
        if slot is not None:
            self._resident.move_to_end(adapter_id)
            self._registered.move_to_end(adapter_id)
            return True
        adapter = self.get(adapter_id)
        if self._free:
            slot = self._free.pop()
        else:
            running = busy()
            victim = next((i for i in self._resident if i not in running), None)
            if victim is None:
                return False
            slot = self._resident.pop(victim)
        self._write(slot, adapter)
        self._resident[adapter_id] = slot
        self._registered.move_to_end(adapter_id)
        return True

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        if adapter.rank > self._rank:
            self._grow(adapter.rank)
        # Invariant: a slot region not `used` is all zeros, so only used regions need clearing.
        for layer in self.stacks:
            for stack in layer.values():
                if stack.used[slot]:
                    assert stack.a is not None
                    stack.a[slot].zero_()
                    for b in stack.b:
                        b[slot].zero_()
                    stack.used[slot] = False
        rank = self._rank
        for (layer, module), (a, b) in adapter.weights.items():
            fused, s = SLICES[module]
            stack = self.stacks[layer][fused]
            if stack.a is None:
                self._allocate(stack)
            assert stack.a is not None
            r = a.shape[0]
            stack.a[slot, s * rank : s * rank + r].copy_(a)
            stack.b[s][slot, :, :r].copy_(b)
            stack.used[slot] = True

    def _allocate(self, stack: LoraStack) -> None:
        n, rank = self.max_loras, self._rank
        opts = {"dtype": self.dtype, "device": self.device}
        stack.a = torch.zeros(n, len(stack.out_sizes) * rank, stack.in_features, **opts)
        stack.b = [torch.zeros(n, out, rank, **opts) for out in stack.out_sizes]

    def _grow(self, rank: int) -> None:
        """Widen every allocated stack to hold rank `rank` (a power of two, for the kernels'
        tiles, within max_rank); the weights already there keep their place per slice."""
        new = min(self.max_rank, max(8, 1 << (rank - 1).bit_length()))
        old = self._rank
        self._rank = new
        for layer in self.stacks:
            for stack in layer.values():
                if stack.a is None:
                    continue
                a, b = stack.a, stack.b
                self._allocate(stack)
                assert stack.a is not None
                slices = len(stack.out_sizes)
                stack.a.view(self.max_loras, slices, new, -1)[:, :, :old].copy_(
                    a.view(self.max_loras, slices, old, -1)
                )
                for dst, src in zip(stack.b, b, strict=True):
                    dst[:, :, :old].copy_(src)
