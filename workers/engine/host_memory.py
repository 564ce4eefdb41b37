"""Host memory on the CPU path: the KV pool faulted in ahead of use, and freed activations
kept in the process's heap. Both move page faults out of the steps: on a VM a first write to
a page costs 1-2 us per 4 KiB (the host backs it too), measured here as 4-5 s of kernel time
in the 60 s of `bench/engine.py`'s workload, about 90% of it gone with the two."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

from torch import Tensor

log = logging.getLogger(__name__)

_CHUNK = 2 << 20  # one huge page of every region at a time (the pool is THP-advised)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_heap() -> None:
    """Stop glibc from handing freed memory back to the OS: a prefill step's activations (tens
    of MB) were mmap'd and unmapped, or trimmed off the heap's top, every step, and faulted in
    again the next. Large blocks up to glibc's limit (32 MiB) come from the heap, which keeps
    what it had at its peak. No-op where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return
    mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))
    mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(32 << 20))


class Prefault:
    """Faults in the first blocks of the pool, `limit` bytes in all, on a background thread at
    the lowest priority (the C library's tm_prefault, which runs without the GIL), in the order
    the block manager first hands out blocks: the same share of every layer's k and v cache.
    `stop()` ends it early (at most one chunk later); `join()` waits for it."""

    def __init__(self, lib: ctypes.CDLL, kv_caches: list[tuple[Tensor, Tensor]], limit: int) -> None:
        views = [t for pair in kv_caches for t in pair]
        size = min(t.numel() * t.element_size() for t in views)
        self.bytes = min(limit // len(views), size)  # per region
        self.done = 0  # bytes per region populated once the thread ends; -1: not supported
        self._flag = ctypes.c_int32(0)
        self._views = views  # the pool must outlive the thread
        self._regions = (ctypes.c_void_p * len(views))(*(t.data_ptr() for t in views))
        self._lib = lib
        self._thread = threading.Thread(target=self._run, name="kv-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        flag = ctypes.byref(self._flag)
        done = self._lib.tm_prefault(self._regions, len(self._views), self.bytes, _CHUNK, flag)
        if done < 0:
            log.info("cannot map the KV pool in ahead (Linux < 5.14 or not Linux): pages map in on first use")
        self.done = done

    def stop(self) -> None:
        self._flag.value = 1

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
