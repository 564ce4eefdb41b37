"""Host memory on the CPU path (workers/engine/host_memory.py): the KV pool faulted in by a
background thread, within its limit, in block order, leaving the pool zeroed; freed
activations kept in the heap instead of being mapped in again every step."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import threading
from pathlib import Path

import torch

from workers.engine.config import ModelConfig
from workers.engine.host_memory import Prefault, keep_freed_heap
from workers.engine.kv_cache import allocate_kv_cache

MIB = 2**20


def _pool(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # SmolLM2's kv shape (3 heads of 64): a block of 16 tokens is 12 KiB per layer's k or v.
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 576,
            "num_hidden_layers": 4,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 32,
        }
    )
    return allocate_kv_cache(cfg, num_blocks, 16, torch.float32, "cpu")


def _resident(t: torch.Tensor) -> int:
    """Bytes of the pages under `t` that are mapped in (mincore)."""
    page = resource.getpagesize()
    lo = t.data_ptr() // page * page
    hi = t.data_ptr() + t.numel() * t.element_size()
    pages = -(-(hi - lo) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


def test_prefault_maps_the_pool_in_and_leaves_it_zero(lib: object) -> None:
    caches = _pool(2048)  # 24 MiB per region, 192 MiB in all
    region = caches[0][0].numel() * 4
    base = caches[0][0]
    whole = torch.empty(0).set_(base.untyped_storage(), 0, (len(caches) * 2 * base.numel(),))
    before = _resident(whole)
    assert before < 16 * MIB  # fresh anonymous memory: nothing mapped in yet
    limit = 6 * MIB  # of each of the 8 regions (every layer's k and v)
    job = Prefault(lib, caches, 8 * limit)  # type: ignore[arg-type]
    job.join(60)
    assert job.done == job.bytes == limit < region
    # The first `limit` bytes of each region, no more (huge pages round each up).
    grown = _resident(whole) - before
    assert 8 * limit <= grown <= 8 * (limit + 4 * MIB)
    for k, v in caches:
        assert not k.any() and not v.any()


def test_prefault_stops_when_asked_and_lowers_only_its_own_threads_priority(lib: object) -> None:
    caches = _pool(64)
    regions = (ctypes.c_void_p * 2)(caches[0][0].data_ptr(), caches[0][1].data_ptr())
    stop = ctypes.c_int32(1)
    got: dict[str, int] = {}

    def run() -> None:
        got["done"] = lib.tm_prefault(regions, 2, caches[0][0].numel() * 4, 2 * MIB, ctypes.byref(stop))  # type: ignore[attr-defined]
        got["nice"] = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux: this thread's

    # On a thread of its own, as Prefault runs it: called here it would have left this test
    # process's main thread at nice 19 for the rest of the run, starved by any busy server
    # (the vLLM worker tests' timeouts in CI).
    before = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert got == {"done": 0, "nice": 19}
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_freed_activations_stay_mapped() -> None:
    keep_freed_heap()

    def step() -> None:  # a prefill step's activations: 96 MiB held at once, then freed
        held = [torch.empty(6 * MIB).fill_(1.0) for _ in range(4)]
        del held

    for _ in range(5):  # the heap grows to the peak once
        step()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
    # glibc's default trims the freed top of the heap (over 64 MiB) back to the OS, and every
    # step faults its 24,576 pages in again (seen: 122,570 faults in these 10 steps).
    assert faults < 96 * MIB // resource.getpagesize() // 10


def test_a_worker_maps_in_what_its_settings_say(tmp_path: Path) -> None:
    from tokenmill.settings import Settings
    from workers.engine import EngineConfig
    from workers.main import engine_config

    assert EngineConfig(model="m").kv_prefault_gib == 0  # a library engine maps in lazily
    assert engine_config(Settings(), tmp_path).kv_prefault_gib == 2
    assert engine_config(Settings(kv_prefault_gib=0.5), tmp_path).kv_prefault_gib == 0.5
