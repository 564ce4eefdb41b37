"""The KV pool's default size on the CPU (a capped share of the host's memory over the engines
running there), the registry the engines count each other with, and the lazily zeroed pool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.engine import kv_cache
from workers.engine.config import ModelConfig
from workers.engine.kv_cache import EngineRegistry, allocate_kv_cache, kv_budget_bytes

GIB = 2**30


def test_default_cpu_budget_is_a_capped_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "host_memory_bytes", lambda: 10 * GIB)
    assert kv_budget_bytes("cpu") == int(kv_cache.CPU_KV_FRACTION * 10 * GIB)
    assert kv_budget_bytes("cpu", engines=4) == int(kv_cache.CPU_KV_FRACTION * 10 * GIB / 4)
    monkeypatch.setattr(kv_cache, "host_memory_bytes", lambda: 1000 * GIB)
    assert kv_budget_bytes("cpu") == int(kv_cache.CPU_KV_CAP_GIB * GIB)
    assert kv_budget_bytes("cpu", cpu_gib=0.5, engines=8) == GIB // 2  # an explicit size wins


def test_host_memory_is_at_most_the_machines() -> None:
    import os

    assert 0 < kv_cache.host_memory_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_registry_counts_live_engines(tmp_path: Path) -> None:
    a, b = EngineRegistry(tmp_path), EngineRegistry(tmp_path)
    assert a.register() == 1
    assert a.register() == 1  # joining twice is joining once
    assert b.register() == 2
    # An engine in another process counts while it runs; its lock goes with it.
    code = (
        "import sys, time; from workers.engine.kv_cache import EngineRegistry; "
        f"r = EngineRegistry({str(tmp_path)!r}); print(r.register(), flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "3"
    assert a.count() == 3
    child.kill()
    child.wait()
    assert a.count() == 2  # a dead engine's file is not counted (and is removed)
    assert len(list(tmp_path.glob("engine-*.lock"))) == 2
    b.close()
    assert a.count() == 1
    a.close()


def test_cpu_pool_is_zeroed_and_writable() -> None:
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 16,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 32,
        }
    )
    for dtype in (torch.float32, torch.bfloat16):
        caches = allocate_kv_cache(cfg, 7, 4, dtype, "cpu")
        assert len(caches) == 3
        for k, v in caches:
            assert k.shape == v.shape == (7, 4, 1, 8) and k.dtype == dtype
            assert not k.any() and not v.any()
        caches[1][0][2, 3, 0, 5] = 1.5  # layers and k/v do not overlap
        assert caches[1][0].sum() == 1.5 and not caches[0][0].any() and not caches[1][1].any()
        assert not caches[2][0].any()


def test_a_worker_stores_the_kv_dtype_its_settings_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydantic import ValidationError

    from tokenmill.settings import Settings
    from workers.main import engine_config

    assert engine_config(Settings(), tmp_path).kv_cache_dtype is None  # the model's
    monkeypatch.setenv("TOKENMILL_KV_CACHE_DTYPE", "float16")
    assert engine_config(Settings(), tmp_path).kv_cache_dtype == torch.float16
    monkeypatch.setenv("TOKENMILL_KV_CACHE_DTYPE", "fp8")
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        Settings()
