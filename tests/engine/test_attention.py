"""TorchAttention against a naive dense reference, on random mixed prefill/decode batches
over a paged cache with shuffled block tables."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from workers.engine.attention import (
    KERNEL_MAX_QUERY,
    AttentionMetadata,
    CpuAttention,
    TorchAttention,
    select_backend,
    store_kv,
)

HEAD_DIM = 32


@dataclass(slots=True)
class Case:
    meta: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    contexts: list[tuple[torch.Tensor, torch.Tensor]]  # full K, V per sequence ([seq_len, kvh, d])
    real: list[bool]  # False: a padding sequence whose tokens all have slot -1


def make_case(
    rng: random.Random,
    shapes: list[tuple[int, int]],  # (cached tokens, new tokens) per sequence
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    padding_seq: bool = False,
    head_dim: int = HEAD_DIM,
    kv_dtype: torch.dtype | None = None,
) -> Case:
    """A batch whose cached context is already in the cache (random values at each sequence's
    slots) and whose new tokens' k/v are still to be stored by the backend; the cache holds
    `kv_dtype` (default `dtype`), and the contexts are what it holds after the store."""
    if padding_seq:  # like a CUDA-graph pad: tokens with slot -1, never stored
        shapes = [*shapes, (0, 3)]
    need = sum(-(-(c + n) // block_size) for c, n in shapes)
    num_blocks = need + 5
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(kv_dtype or dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(kv_dtype or dtype)
    width = max(-(-(c + n) // block_size) for c, n in shapes)
    tables, slots, contexts, qs, ks, vs, real = [], [], [], [], [], [], []
    for i, (cached, new) in enumerate(shapes):
        is_pad = padding_seq and i == len(shapes) - 1
        table = [] if is_pad else [ids.pop() for _ in range(-(-(cached + new) // block_size))]
        tables.append(table + [0] * (width - len(table)))
        positions = torch.arange(cached + new)
        seq_slots = (
            torch.full((cached + new,), -1)
            if is_pad
            else torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        )
        slots.append(seq_slots[cached:])
        q = torch.randn(new, num_heads, head_dim).to(dtype)
        k = torch.randn(new, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(new, num_kv_heads, head_dim).to(dtype)
        old = seq_slots[:cached]
        # in the cache's dtype even with nothing cached: the context is what the cache holds
        ck = k_cache.view(-1, num_kv_heads, head_dim)[old]
        cv = v_cache.view(-1, num_kv_heads, head_dim)[old]
        contexts.append((torch.cat([ck, k.to(ck.dtype)]), torch.cat([cv, v.to(cv.dtype)])))
        qs.append(q)
        ks.append(k)
        vs.append(v)
        real.append(not is_pad)
    q_lens = torch.tensor([n for _, n in shapes])
    seq_lens = torch.tensor([c + n for c, n in shapes])
    meta = AttentionMetadata(
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int(),
        seq_lens=seq_lens.int(),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.cat(slots).long(),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return Case(meta, torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, contexts, real)


def dense_reference(case: Case, scale: float) -> list[torch.Tensor]:
    """Per sequence, float64: query i at position seq_len - q_len + i attends keys 0..it."""
    out = []
    bounds = case.meta.query_start_loc.tolist()
    num_heads, num_kv_heads = case.q.shape[1], case.k.shape[1]
    for s, (k, v) in enumerate(case.contexts):
        q = case.q[bounds[s] : bounds[s + 1]].double()
        kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)
        k, v = k.double()[:, kv_head], v.double()[:, kv_head]  # [L, H, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        seq_len, q_len = k.shape[0], q.shape[0]
        pos = torch.arange(seq_len - q_len, seq_len)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > pos[:, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return out


def check(case: Case, backend: object, atol: float) -> None:
    scale = case.q.shape[-1] ** -0.5
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    bounds = case.meta.query_start_loc.tolist()
    for s, ref in enumerate(dense_reference(case, scale)):
        if case.real[s]:
            torch.testing.assert_close(out[bounds[s] : bounds[s + 1]].double(), ref, atol=atol, rtol=0)
    # The cache changed exactly at the stored slots, to the new k/v; slot -1 wrote nothing.
    slots = case.meta.slot_mapping
    keep = slots >= 0
    for cache, before, new in ((case.k_cache, k_before, case.k), (case.v_cache, v_before, case.v)):
        flat, flat_before = cache.view(-1, *cache.shape[2:]), before.view(-1, *before.shape[2:])
        assert torch.equal(flat[slots[keep]], new[keep].to(cache.dtype))
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[keep]] = False
        assert torch.equal(flat[untouched], flat_before[untouched])


def random_shapes(rng: random.Random, num_seqs: int) -> list[tuple[int, int]]:
    shapes = []
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "prefill", "chunk"])
        if kind == "decode":
            shapes.append((rng.randint(0, 150), 1))
        elif kind == "prefill":  # no cached context
            shapes.append((0, rng.randint(2, 40)))
        else:  # a prefill chunk over cached context
            shapes.append((rng.randint(1, 100), rng.randint(2, 40)))
    return shapes


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
def test_mixed_batches_match_dense_reference(block_size: int, heads: tuple[int, int]) -> None:
    rng = random.Random(block_size * 100 + heads[0])
    backend = TorchAttention()
    for trial in range(8):
        torch.manual_seed(trial)
        shapes = random_shapes(rng, rng.randint(1, 6))
        case = make_case(rng, shapes, *heads, block_size, padding_seq=trial % 2 == 1)
        check(case, backend, atol=1e-5)


def test_pure_decode_batches_in_length_groups() -> None:
    """Many decoding sequences of very different lengths take the grouped decode path (sorted
    into length groups, output scattered back): both it and the single-group path are exact."""
    rng = random.Random(7)
    backend = TorchAttention()
    for lengths in ([rng.randint(0, 900) for _ in range(40)], [300] * 12, [0, 5, 1, 17]):
        case = make_case(rng, [(n, 1) for n in lengths], 6, 2, 16)
        check(case, backend, atol=1e-5)
    # Decodes in groups plus prefill chunks in the same step.
    shapes = [(rng.randint(0, 900), 1) for _ in range(30)] + [(40, 9), (0, 20)]
    rng.shuffle(shapes)
    check(make_case(rng, shapes, 8, 2, 32), backend, atol=1e-5)


def test_plan_is_rebuilt_for_each_step() -> None:
    """One backend object serves every step; a new metadata object must not reuse the last plan."""
    rng = random.Random(3)
    backend = TorchAttention()
    for _ in range(3):
        check(make_case(rng, random_shapes(rng, 4), 4, 2, 16), backend, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    rng = random.Random(11)
    case = make_case(rng, [(30, 1), (0, 12), (50, 7), (200, 1)], 6, 2, 16, dtype=dtype)
    check(case, TorchAttention(), atol=2e-2)


def test_store_kv_skips_minus_one() -> None:
    k_cache, v_cache = torch.zeros(4, 2, 1, 3), torch.zeros(4, 2, 1, 3)
    k, v = torch.ones(3, 1, 3), 2 * torch.ones(3, 1, 3)
    store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(8, 3)[[0, 5]].eq(1).all() and v_cache.view(8, 3)[[0, 5]].eq(2).all()
    assert k_cache.view(8, 3).sum() == 6  # nothing else written


def test_select_backend() -> None:
    # The machines here have a C compiler: the default CPU backend is the kernel's.
    assert type(select_backend("cpu")) is CpuAttention
    assert type(select_backend(torch.device("cpu"), "torch")) is TorchAttention
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("cpu", "flash")


def test_no_compiler_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_failed", False)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    assert type(select_backend("cpu")) is TorchAttention


# --- the CPU kernel (workers/engine/csrc/paged_attention.c) ------------------------------------


@pytest.fixture(scope="module")
def kernel() -> CpuAttention:
    backend = select_backend("cpu")
    assert isinstance(backend, CpuAttention), "the C kernel did not build"
    return backend


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2), (12, 1)], ids=["gqa1", "gqa3", "gqa4", "mqa"])
def test_kernel_mixed_batches_match_dense_reference(
    kernel: CpuAttention, block_size: int, heads: tuple[int, int]
) -> None:
    """Decodes, short multi-token queries (verified drafts) and prefill chunks in one step: the
    kernel takes the short ones, SDPA the rest; both exact against the dense reference."""
    rng = random.Random(block_size * 1000 + heads[0])
    for trial in range(8):
        torch.manual_seed(trial)
        shapes = random_shapes(rng, rng.randint(1, 6))
        shapes += [(rng.randint(0, 300), rng.randint(1, KERNEL_MAX_QUERY)) for _ in range(3)]
        rng.shuffle(shapes)
        case = make_case(rng, shapes, *heads, block_size, padding_seq=trial % 2 == 1)
        check(case, kernel, atol=1e-5)


def test_kernel_equals_plain_path(kernel: CpuAttention) -> None:
    """The kernel against TorchAttention (the plain path) on a decode batch like the served one:
    64 sequences of 1..900 tokens, SmolLM2's heads (9 query, 3 kv, head_dim 32 here)."""
    rng = random.Random(5)
    shapes = [(rng.randint(0, 900), 1) for _ in range(64)]
    case = make_case(rng, shapes, 9, 3, 16)
    args = (case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, HEAD_DIM**-0.5)
    fast = kernel.forward(*args)
    plain = TorchAttention().forward(*args)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)
    check(case, kernel, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_kernel_gives_a_row_the_same_bits_alone_as_in_a_batch(
    kernel: CpuAttention, lib: object, kv_dtype: torch.dtype, head_dim: int
) -> None:
    """A batch of 64 decodes gives the C kernel rows enough for every thread, so each work item
    is a row with all its kv heads; a row alone is split by kv head. Each kv head's arithmetic is
    the same either way: every row's output is bit for bit the one it gets alone."""
    from workers.engine import cpu_kernels

    rng = random.Random(head_dim)
    shapes = [(rng.randint(0, 700), 1) for _ in range(64)]
    case = make_case(rng, shapes, 9, 3, 16, head_dim=head_dim, kv_dtype=kv_dtype)
    kernel.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, 0.125)  # stores k, v
    meta = case.meta
    row_seq = torch.arange(len(shapes), dtype=torch.int32)
    args = (case.k_cache, case.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    batch = torch.full_like(case.q, float("nan"))
    cpu_kernels.paged_attention(lib, case.q, *args, None, row_seq, 0.125, batch)  # type: ignore[arg-type]
    alone = torch.full_like(case.q, float("nan"))
    for r in range(len(shapes)):
        one = torch.tensor([r], dtype=torch.int32)
        cpu_kernels.paged_attention(lib, case.q, *args, one, one, 0.125, alone)  # type: ignore[arg-type]
    assert torch.equal(batch, alone)
    check(case, kernel, atol=1e-5 if kv_dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40, 12])
def test_kernel_paths_of_each_head_dim_match_the_dense_reference(
    kernel: CpuAttention, head_dim: int, block_size: int
) -> None:
    """The kernel's vector paths (with AVX-512, a block's scores in one register when head_dim
    is 32, 64 or 128 and blocks hold at most 16 tokens; with AVX2, scores 8 keys at a time when
    head_dim is a multiple of 8, the weighted values in registers when it is a multiple of 64)
    and its scalar path otherwise, with contexts that end inside a group of 8 keys and inside a
    block, and blocks read ahead past a short context's end."""
    rng = random.Random(head_dim * 100 + block_size)
    shapes = [(c, 1) for c in (0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 300)]
    shapes += [(rng.randint(0, 500), 2)]
    check(make_case(rng, shapes, 9, 3, block_size, head_dim=head_dim), kernel, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 40])
def test_kernel_over_an_fp16_cache_equals_the_plain_path(
    kernel: CpuAttention, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 queries over an fp16 cache (kv_cache_dtype float16): the kernel's fp16 build and its
    fp16 store against TorchAttention on the same cache, which widens what it reads, and both
    against the dense reference over the rounded context. Head dims 32 and 64 take the vector
    paths (AVX2: 8 keys at a time; the values in registers at 64), 40 the scalar one; decodes,
    verified drafts and a prefill chunk after cached context in one step."""
    rng = random.Random(head_dim)
    shapes = [(rng.randint(0, 900), 1) for _ in range(40)] + [(120, 3), (0, 9), (64, 20)]
    case = make_case(rng, shapes, 9, 3, 16, head_dim=head_dim, kv_dtype=torch.float16)
    assert case.k_cache.dtype == torch.float16
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    scale = head_dim**-0.5
    from workers.engine import cpu_kernels

    read: list[torch.dtype] = []  # the caches the C kernel was handed (not the PyTorch fallback)
    real = cpu_kernels.paged_attention
    monkeypatch.setattr(
        cpu_kernels, "paged_attention", lambda lib, q, kc, *a: (read.append(kc.dtype), real(lib, q, kc, *a))
    )
    fast = kernel.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, scale)
    assert read == [torch.float16]
    slow = TorchAttention().forward(case.q, case.k, case.v, k_cache, v_cache, case.meta, scale)
    assert fast.dtype == torch.float32
    # The plain path gives a whole prompt (the 9-token one, rows 43..51) its own fp32 k/v; the
    # kernel reads every context from the cache, rounded: that prompt is within fp16's rounding.
    prompt = torch.zeros(len(fast), dtype=torch.bool)
    prompt[43:52] = True
    torch.testing.assert_close(fast[~prompt], slow[~prompt], atol=1e-5, rtol=0)
    torch.testing.assert_close(fast[prompt], slow[prompt], atol=5e-3, rtol=0)
    assert torch.equal(case.k_cache, k_cache) and torch.equal(case.v_cache, v_cache)  # same rounding
    # Against the dense reference over the rounded context: exact, prompts included.
    check(make_case(rng, shapes, 9, 3, 16, head_dim=head_dim, kv_dtype=torch.float16), kernel, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40])
def test_prefill_kernel_matches_the_dense_reference_and_the_plain_path(
    kernel: CpuAttention, head_dim: int, block_size: int, kv_dtype: torch.dtype
) -> None:
    """Prefill chunks through the C kernel (csrc/paged_attention.c, tm_prefill_attention): whole
    prompts and chunks after cached context, of lengths around its runs of rows (32 rows: 10
    positions of a 3-head group) and around blocks, each head dim's paths (AVX2: a block's scores
    for four rows at a time when head_dim is a multiple of 8 and blocks hold at most 16 tokens,
    the weighted values in registers when it is a multiple of 64; scalar loops otherwise).
    Against the dense reference over what the cache holds, and for an fp32 cache against
    TorchAttention, the plain path (SDPA per sequence)."""
    from workers.engine import cpu_kernels

    rng = random.Random(head_dim * 100 + block_size)
    shapes = [(0, n) for n in (9, 10, 11, 21, 33, 100)]  # whole prompts
    shapes += [(1, 9), (15, 17), (40, 31), (250, 64)]  # chunks after cached context
    shapes += [(rng.randint(0, 40), 1) for _ in range(3)]  # decodes in the same step
    rng.shuffle(shapes)
    case = make_case(rng, shapes, 9, 3, block_size, head_dim=head_dim, kv_dtype=kv_dtype)
    seen: list[list[int]] = []  # the sequences the prefill kernel was handed
    real = cpu_kernels.prefill_attention

    def spy(lib: object, *a: Any) -> None:
        seen.append(a[6].tolist())  # q, caches, tables, query starts, seq lens, then the sequences
        real(lib, *a)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "prefill_attention", spy)
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        check(case, kernel, atol=1e-5)
    assert seen == [[s for s, (_, n) in enumerate(shapes) if n > KERNEL_MAX_QUERY]]
    if kv_dtype == torch.float32:
        scale = head_dim**-0.5
        args = (case.q, case.k, case.v)
        fast = kernel.forward(*args, k_cache.clone(), v_cache.clone(), case.meta, scale)
        plain = TorchAttention().forward(*args, k_cache, v_cache, case.meta, scale)
        torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)


def test_kernel_declines_what_it_does_not_cover(kernel: CpuAttention) -> None:
    """Half precision and head groups beyond the kernel's limits take the PyTorch path."""
    rng = random.Random(13)
    check(make_case(rng, [(30, 1), (0, 12), (200, 1)], 6, 2, 16, dtype=torch.bfloat16), kernel, atol=2e-2)
    check(make_case(rng, [(30, 1), (0, 12), (70, 1)], 34, 1, 16), kernel, atol=1e-5)  # group 34 > 16
