"""The paged KV cache: how many blocks fit a memory budget, and allocating them.

Per layer a (k_cache, v_cache) pair, each [num_blocks, block_size, num_kv_heads, head_dim]
(vLLM's layout); a token at position p lives in slot block_table[p // block_size] *
block_size + p % block_size.

On the CPU the pool defaults to a share of the host's memory: CPU_KV_FRACTION of what the host
(or the container's memory limit) has, divided among the engines running on the host, at most
CPU_KV_CAP_GIB. Engines count each other through lock files in a host-wide directory
(`EngineRegistry`). The pool is allocated as zero pages the OS fills in on first write, so a
large one costs nothing at start and memory is only taken as blocks are used.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from workers.engine.config import ModelConfig

log = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.4
CPU_KV_CAP_GIB = 8.0


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def kv_budget_bytes(
    device: str | torch.device,
    *,
    gpu_fraction: float = 0.9,
    cpu_gib: float | None = None,
    model_bytes: int = 0,
    engines: int = 1,
) -> int:
    """Memory for the KV cache: on CUDA a fraction of the free device memory, less
    `model_bytes` of weights not yet loaded there (0 once the model is resident); on the CPU
    `cpu_gib` when given, else the default share: CPU_KV_FRACTION of the host's (or the
    container's) memory over the `engines` on the host, at most CPU_KV_CAP_GIB (weights live
    outside that budget)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(0, int(free * gpu_fraction) - model_bytes)
    if cpu_gib is not None:
        return int(cpu_gib * 2**30)
    share = CPU_KV_FRACTION * host_memory_bytes() / max(1, engines)
    return int(min(share, CPU_KV_CAP_GIB * 2**30))


def host_memory_bytes() -> int:
    """The memory this process may use: the host's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            limit = Path(path).read_text().strip()
            if limit != "max":
                total = min(total, int(limit))
    return total


class EngineRegistry:
    """The engines running on this host, as lock files in a host-wide directory: each engine
    holds an exclusive lock on its own file for its lifetime (the OS drops it when the process
    dies, however it dies), and counting the files still locked counts the live engines."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.dir = Path(directory or _registry_dir())
        self._fd: int | None = None

    def register(self) -> int:
        """Join (once) and return how many engines run here now, this one included."""
        if self._fd is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, _ = tempfile.mkstemp(prefix=f"engine-{os.getpid()}-", suffix=".lock", dir=self.dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._fd = fd
        return self.count()

    def count(self) -> int:
        live = 0
        for path in self.dir.glob("engine-*.lock"):
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue  # removed meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live += 1  # held by a live engine (ours too: locks belong to open files)
            else:
                path.unlink(missing_ok=True)  # its engine is gone
            finally:
                os.close(fd)
        return live

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _registry_dir() -> Path:
    # /dev/shm is host-wide and in memory (nothing left on disk); elsewhere the temp dir.
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"tokenmill-engines-{os.getuid()}"


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return budget_bytes // block_bytes(cfg, block_size, dtype)


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
) -> list[tuple[Tensor, Tensor]]:
    """One zeroed allocation for the whole cache, handed out as per-layer views. Zeroed, not
    empty: padded attention multiplies masked-out values by 0, and NaN garbage * 0 is NaN."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    full = (cfg.num_layers, 2, *shape)
    if torch.device(device).type == "cpu":
        # Fresh anonymous memory: the OS maps zero pages and fills them in on first write, where
        # torch.zeros would write every byte now (about a second per GiB here). Not calloc: it
        # may recycle (and so clear, and commit) freed heap, which the engine keeps (host_memory).
        nbytes = int(np.prod(full)) * torch.empty((), dtype=dtype).element_size()
        if hasattr(mmap, "MAP_ANONYMOUS"):
            buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)  # 2 MiB pages: 512x fewer faults and TLB misses
            cache = torch.frombuffer(buf, dtype=dtype).view(full)  # the tensor keeps `buf` open
        else:
            cache = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(full)
    else:
        cache = torch.zeros(full, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]
