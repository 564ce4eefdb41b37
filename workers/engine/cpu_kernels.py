"""CPU kernels in plain C (workers/engine/csrc): paged attention and the Llama block's fused
elementwise work, built once with the system's C compiler and loaded with ctypes.

Plain C and no torch headers: a build takes about a second (a torch C++ extension takes a
minute on two cores), and the library is cached under a key of its source, the compiler and the
CPU's flags (it is built with -march=native), in `TOKENMILL_KERNEL_CACHE` or the cache dir the
engine is given (beside the converted models), else ~/.cache/tokenmill/kernels. Without a
compiler the engine falls back to its PyTorch path; nothing here is required to run.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))
# No errno and no FP traps (nothing here reads either): gcc then vectorises the loops with
# selects and rounding in them (tm_math.h's expf). Not -ffast-math: see tm_math.h.
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c11",
]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (what the build was made for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def has_bf16_dot() -> bool:
    """Whether the CPU has bf16 dot-product instructions (AMX tiles, or AVX-512 BF16 as on Zen 4),
    where oneDNN's bf16 products run at about twice its fp32 rate; without them it emulates bf16."""
    flags = cpu_flags().split()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _cache_dir(cache: str | Path | None) -> Path:
    env = os.environ.get("TOKENMILL_KERNEL_CACHE")
    if env:
        return Path(env)
    if cache is not None:
        return Path(cache) / ".kernels"
    return Path("~/.cache/tokenmill/kernels").expanduser()


def _build(cache: str | Path | None) -> Path | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: the CPU attention kernel is off (PyTorch attention instead)")
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    parts = [*(p.read_text() for p in sorted(CSRC.iterdir())), cc, version, " ".join(FLAGS), cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    out = _cache_dir(cache) / f"cpu_ops-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: workers starting together never load half a file.
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    result = subprocess.run(
        [cc, *FLAGS, *map(str, SOURCES), "-o", str(partial), "-lm"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        log.warning(
            "building the CPU attention kernel failed (PyTorch attention instead):\n%s", result.stderr
        )
        return None
    partial.replace(out)
    return out


def load(cache: str | Path | None = None) -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None where it cannot be built."""
    global _lib, _failed
    with _lock:
        if _lib is not None or _failed:
            return _lib
        path = _build(cache)
        if path is None:
            _failed = True
            return None
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: calls release the GIL
        lib.tm_limits.argtypes = [_i64, _i64, _i64]
        lib.tm_limits.restype = ctypes.c_int
        lib.tm_paged_attention.argtypes = [_ptr] * 4 + [_i64] + [_ptr] * 4 + [_i64] * 5 + [_f32, _i64, _ptr]
        lib.tm_paged_attention.restype = None
        lib.tm_paged_attention_f16.argtypes = lib.tm_paged_attention.argtypes
        lib.tm_paged_attention_f16.restype = None
        lib.tm_prefill_attention.argtypes = [_ptr] * 4 + [_i64] + [_ptr] * 3 + [_i64] * 5 + [_f32, _i64, _ptr]
        lib.tm_prefill_attention.restype = None
        lib.tm_prefill_attention_f16.argtypes = lib.tm_prefill_attention.argtypes
        lib.tm_prefill_attention_f16.restype = None
        lib.tm_rms_norm.argtypes = [_ptr, _ptr, _ptr, _f32, _i64, _i64, _ptr, _i64]
        lib.tm_rope.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64]
        lib.tm_store_kv.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64]
        lib.tm_silu_mul.argtypes = [_ptr, _i64, _i64, _ptr, _i64]
        for fn in (lib.tm_rms_norm, lib.tm_rope, lib.tm_store_kv, lib.tm_silu_mul):
            fn.restype = None
        lib.tm_gemm_nr.argtypes = []
        lib.tm_gemm_nr.restype = _i64
        lib.tm_pack_panels.argtypes = [_ptr, _i64, _i64, _ptr]
        lib.tm_pack_panels.restype = None
        lib.tm_gemm.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64]
        lib.tm_gemm.restype = None
        lib.tm_greedy_pick.argtypes = [
            *(_ptr, _i64, _i64, _i64),  # h, its rows, k, row stride
            *(_ptr, _ptr, _i64),  # w, the screen, v
            *(_ptr, _ptr, _f32, _i64, _ptr, _i64),  # norms, bound, cap, out, threads
        ]
        lib.tm_greedy_pick.restype = None
        lib.tm_prefault.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
        lib.tm_prefault.restype = _i64
        _lib = lib
        return lib


# The cache dtypes the kernels read and write (queries and outputs are fp32 either way).
KV_DTYPES = (torch.float32, torch.float16)


def supports(lib: ctypes.CDLL, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    return bool(lib.tm_limits(num_heads // num_kv_heads, head_dim, block_size))


def paged_attention(
    lib: ctypes.CDLL,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start: Tensor,
    seq_lens: Tensor,
    rows: Tensor | None,
    row_seq: Tensor,
    scale: float,
    out: Tensor,
) -> None:
    """out[r] = attention of query row r (q [T, H, D]) over its sequence's context, read in
    place from the caches, for each r in `rows` (None: every row), whose sequence is the same
    entry of `row_seq`. int32 metadata, fp32 contiguous tensors on the CPU: the caller checks
    (the C side trusts every pointer and shape); the caches fp32 or fp16."""
    fn = lib.tm_paged_attention_f16 if k_cache.dtype == torch.float16 else lib.tm_paged_attention
    which = (None if rows is None else rows.data_ptr(), row_seq.data_ptr(), row_seq.shape[0])
    _attention(fn, q, k_cache, v_cache, block_tables, query_start, seq_lens, which, scale, out)


def prefill_attention(
    lib: ctypes.CDLL,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start: Tensor,
    seq_lens: Tensor,
    seqs: Tensor,
    scale: float,
    out: Tensor,
) -> None:
    """out's rows of the sequences `seqs` (int32) = their queries' causal attention over their
    contexts, read in place from the caches (this step's keys and values already stored): whole
    prompts and chunks after cached tokens alike. The same contract as `paged_attention`."""
    fn = lib.tm_prefill_attention_f16 if k_cache.dtype == torch.float16 else lib.tm_prefill_attention
    _attention(
        fn,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start,
        seq_lens,
        (seqs.data_ptr(), seqs.shape[0]),
        scale,
        out,
    )


def _attention(
    fn: Any,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start: Tensor,
    seq_lens: Tensor,
    which: tuple[int | None, ...],
    scale: float,
    out: Tensor,
) -> None:
    """The two kernels' common arguments around `which` (the rows or sequences to attend)."""
    fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        query_start.data_ptr(),
        seq_lens.data_ptr(),
        *which,
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        scale,
        torch.get_num_threads(),
        out.data_ptr(),
    )


# --- the fused elementwise ops (csrc/fused.c); fp32 CPU tensors whose last dim is contiguous --


def _rows(t: Tensor) -> int:
    """Elements between rows of a [n, ...] tensor whose rows are contiguous inside."""
    return t.stride(0)


def rms_norm(
    lib: ctypes.CDLL, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor:
    """RMSNorm of x ([n, d], contiguous); with `residual` ([n, d], contiguous), residual += x
    first, in place, and the norm is of the sum (the decoder layer's add + norm)."""
    n, d = x.shape
    out = torch.empty_like(x)
    lib.tm_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        eps,
        n,
        d,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def rope_(lib: ctypes.CDLL, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate-half RoPE in place on q [n, heads, d] and k [n, kv heads, d] (each head's d
    contiguous, heads adjacent: views into the qkv output), cos/sin [n, d] contiguous."""
    n, num_q, d = q.shape
    lib.tm_rope(
        q.data_ptr(),
        _rows(q),
        num_q,
        k.data_ptr(),
        _rows(k),
        k.shape[1],
        cos.data_ptr(),
        sin.data_ptr(),
        n,
        d,
        torch.get_num_threads(),
    )


def store_kv(lib: ctypes.CDLL, k: Tensor, v: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """k, v [n, kv heads, d] (rows may be views) into the caches' rows at `slots` (int64; -1 =
    padding, not stored); fp32 caches, or fp16 ones (each value rounded to the nearest half)."""
    n = k.shape[0]
    lib.tm_store_kv(
        k.data_ptr(),
        _rows(k),
        v.data_ptr(),
        _rows(v),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        n,
        k.shape[1] * k.shape[2],
        k_cache.dtype == torch.float16,
        torch.get_num_threads(),
    )


def pack_panels(lib: ctypes.CDLL, weight: Tensor) -> Tensor | None:
    """An fp32 Linear weight [n, k] in the panels `gemm` reads, or None where the CPU has neither
    AVX-512 nor AVX2 and FMA (csrc/gemm.c)."""
    width = lib.tm_gemm_nr()
    if not width:
        return None
    n, k = weight.shape
    w = weight.detach().contiguous()
    panels = torch.empty(-(-n // width) * width * k, dtype=torch.float32)
    lib.tm_pack_panels(w.data_ptr(), n, k, panels.data_ptr())
    return panels


def gemm(lib: ctypes.CDLL, x: Tensor, panels: Tensor, n: int) -> Tensor:
    """x [..., k] (fp32) times the weight `panels` holds ([n, k], `pack_panels`): [..., n]."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    threads = torch.get_num_threads()
    lib.tm_gemm(rows.data_ptr(), m, k, rows.stride(0), panels.data_ptr(), n, out.data_ptr(), n, threads)
    return out.view(*x.shape[:-1], n)


def silu_mul(lib: ctypes.CDLL, gate_up: Tensor) -> Tensor:
    """silu(gate) * up of the MLP's fused [n, 2 * inter] projection (contiguous)."""
    n, width = gate_up.shape
    out = torch.empty(n, width // 2, dtype=gate_up.dtype)
    lib.tm_silu_mul(gate_up.data_ptr(), n, width // 2, out.data_ptr(), torch.get_num_threads())
    return out
