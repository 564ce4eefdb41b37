"""LoRA shrink/expand kernels (SGMV) against a per-token PyTorch reference, and the Triton
LoRA backend against the PyTorch one, on batches mixing adapter slots and tokens without one.

On CPU the kernels run under Triton's interpreter, which must be switched on before triton (or
the kernels) is imported, hence the assignment above the imports. The gpu-marked test re-runs
this file in a child process with the kernels compiled on CUDA.
"""

import os

_DEVICE = os.environ.get("TOKENMILL_KERNEL_TEST_DEVICE", "cpu")
if _DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from workers.engine.kernels import lora_expand, lora_shrink  # noqa: E402
from workers.engine.lora_layers import LoraBatch, TorchLora, make_lora_batch  # noqa: E402
from workers.engine.lora_slots import LoraStack  # noqa: E402
from workers.engine.triton_lora import TritonLora  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}
SLOTS = 3

# (tokens per sequence, slot per sequence): prefill chunks and decodes, interleaved adapters.
MIXED = ([5, 1, 17, 1, 3, 1, 2], [1, -1, 0, 1, -1, 2, 0])
CASES = {
    "mixed": MIXED,
    "one adapter for all": ([4, 1, 1], [2, 2, 2]),
    "decodes": ([1] * 9, [0, 1, -1, 2, 0, 0, -1, 1, 2]),
    "big group": ([40, 1], [1, -1]),  # more than one BLOCK_M tile of tokens in a group
}


def grouping(q_lens: list[int], slots: list[int]) -> LoraBatch:
    batch = make_lora_batch(slots, q_lens, torch.device(_DEVICE))
    assert batch is not None
    return batch


def token_slots(q_lens: list[int], slots: list[int]) -> list[int]:
    return [s for s, n in zip(slots, q_lens, strict=True) for _ in range(n)]


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=_DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_shrink_matches_reference(case: str, dtype: torch.dtype) -> None:
    q_lens, slots = CASES[case]
    t, k, n = sum(q_lens), 96, 24  # K spans two BLOCK_K tiles, N is not a power of two
    x = rand(t, k, dtype=dtype, seed=1)
    a = rand(SLOTS, n, k, dtype=dtype, seed=2, scale=0.1)
    out = torch.full((t, n), float("nan"), dtype=torch.float32, device=_DEVICE)
    batch = grouping(q_lens, slots)
    lora_shrink(x, a, out, batch.sorted_tokens, batch.num_tokens, batch.starts, batch.lora_ids,
                batch.max_tokens, scaling=0.5)  # fmt: skip
    for i, slot in enumerate(token_slots(q_lens, slots)):
        if slot < 0:  # rows of tokens without an adapter are not written
            assert out[i].isnan().all()
        else:
            want = 0.5 * (x[i].float() @ a[slot].float().T)
            torch.testing.assert_close(out[i], want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_expand_matches_reference(case: str, dtype: torch.dtype) -> None:
    """A qkv-like output: three slices of different widths after an offset, added into `out`."""
    q_lens, slots = CASES[case]
    t, rank, widths, offset = sum(q_lens), 8, [40, 16, 16], 5
    h = rand(t, len(widths) * rank, dtype=torch.float32, seed=3)
    bs = [rand(SLOTS, w, rank, dtype=dtype, seed=4 + i, scale=0.1) for i, w in enumerate(widths)]
    base = rand(t, offset + sum(widths) + 3, dtype=dtype, seed=9)
    out = base.clone()
    batch = grouping(q_lens, slots)
    lora_expand(h, bs, out, batch.sorted_tokens, batch.num_tokens, batch.starts, batch.lora_ids,
                batch.max_tokens, offset_start=offset)  # fmt: skip
    want = base.float().clone()
    for i, slot in enumerate(token_slots(q_lens, slots)):
        if slot < 0:
            continue
        col = offset
        for s, b in enumerate(bs):
            want[i, col : col + b.shape[1]] += (
                h[i, s * rank : (s + 1) * rank].to(dtype).float() @ b[slot].float().T
            )
            col += b.shape[1]
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    # Tokens without an adapter, and the columns outside the slices, are untouched.
    untouched = torch.tensor([s < 0 for s in token_slots(q_lens, slots)], device=_DEVICE)
    assert torch.equal(out[untouched], base[untouched])
    assert torch.equal(out[:, :offset], base[:, :offset]) and torch.equal(out[:, -3:], base[:, -3:])


def test_expand_overwrites_without_add_inputs() -> None:
    q_lens, slots = [3, 2], [0, 1]
    h = rand(5, 8, dtype=torch.float32, seed=5)
    b = rand(2, 20, 8, dtype=torch.float32, seed=6)
    out = torch.full((5, 20), 7.0, device=_DEVICE)
    batch = grouping(q_lens, slots)
    lora_expand(h, [b], out, batch.sorted_tokens, batch.num_tokens, batch.starts, batch.lora_ids,
                batch.max_tokens, add_inputs=False)  # fmt: skip
    want = torch.stack([h[i] @ b[s].T for i, s in enumerate(token_slots(q_lens, slots))])
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def make_stack(
    in_features: int, widths: list[int], rank: int, dtype: torch.dtype, used: list[bool]
) -> LoraStack:
    stack = LoraStack(in_features, widths, used=used)
    stack.a = rand(len(used), len(widths) * rank, in_features, dtype=dtype, seed=11, scale=0.1)
    stack.b = [rand(len(used), w, rank, dtype=dtype, seed=12 + i, scale=0.1) for i, w in enumerate(widths)]
    for slot, u in enumerate(used):  # the slots' invariant: an unused slot is all zeros
        if not u:
            stack.a[slot].zero_()
            for b in stack.b:
                b[slot].zero_()
    return stack


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_backend_matches_torch_backend(dtype: torch.dtype) -> None:
    """Both backends on a SmolLM2-like fused qkv (576 -> 576 + 192 + 192), slot 1 unused."""
    q_lens, slots = MIXED
    stack = make_stack(576, [576, 192, 192], 16, dtype, [True, False, True])
    x = rand(sum(q_lens), 576, dtype=dtype, seed=13)
    base = rand(sum(q_lens), 960, dtype=dtype, seed=14)
    batch = grouping(q_lens, slots)
    out_triton, out_torch = base.clone(), base.clone()
    TritonLora().apply(x, out_triton, stack, batch)
    TorchLora().apply(x, out_torch, stack, batch)
    torch.testing.assert_close(out_triton.float(), out_torch.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert not torch.equal(out_torch, base)


@pytest.mark.gpu
def test_kernels_compiled_on_cuda() -> None:
    """Every comparison above, with the kernels compiled for CUDA (a child process: this one
    defined them interpreted)."""
    if _DEVICE == "cuda":
        pytest.skip("already running on CUDA")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TOKENMILL_KERNEL_TEST_DEVICE"] = "cuda"
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
