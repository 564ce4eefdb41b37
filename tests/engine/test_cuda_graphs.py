"""CUDA graphs for decode: the captured batch sizes, the padding to them (on the CPU: padded
batches through the real model give the unpadded outputs), and, on CUDA, graph replay against
the eager path."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.engine.conftest import TinyModel
from tests.engine.test_attention import check, make_case
from tests.engine.test_engine import _byte_tokenizer
from workers.engine import LLM, SamplingParams
from workers.engine.attention import AttentionMetadata, CpuAttention, TorchAttention, select_backend
from workers.engine.cuda_graphs import capture_sizes, pad_decode, padded_size


def test_capture_sizes() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(9) == [1, 2, 4, 8, 16]
    assert capture_sizes(100)[-2:] == [96, 104]  # the largest batch fits
    for n in range(1, 300):
        sizes = capture_sizes(n)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and n <= sizes[-1] < n + 8
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_size() -> None:
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 63, 64)] == [
        1, 2, 4, 8, 8, 16, 16, 24, 64, 64,
    ]  # fmt: skip
    assert padded_size(65, sizes) is None  # past the largest graph: eager


def _decode_case(rng: random.Random, lengths: list[int]) -> tuple[object, Tensor, Tensor]:
    case = make_case(rng, [(n, 1) for n in lengths], 6, 2, 16)
    positions = case.meta.seq_lens.long() - 1
    ids = torch.tensor([rng.randrange(256) for _ in lengths])
    return case, ids, positions


@pytest.mark.parametrize("backend", [TorchAttention, "cpu"], ids=["torch", "cpu-kernel"])
def test_padding_changes_nothing_real(backend: Callable[[], object] | str) -> None:
    """Attention over a padded batch: the real rows' outputs are the unpadded ones (the PyTorch
    path groups padded lengths differently, so to rounding; the kernel to the bit),
    the cache changes exactly as without padding, and the padding rows are finite."""
    rng = random.Random(4)
    make = (lambda: select_backend("cpu")) if backend == "cpu" else backend
    for lengths, size, width in (([5, 40, 17], 8, 12), ([100] * 9, 16, 7), ([0], 1, 1), ([31, 2], 4, 3)):
        case, ids, positions = _decode_case(rng, lengths)
        p_ids, p_pos, padded = pad_decode(ids, positions, case.meta, size, width)
        assert p_ids.shape == p_pos.shape == (size,) and padded.block_tables.shape == (size, width)
        assert torch.equal(p_ids[: len(lengths)], ids) and torch.equal(p_pos[: len(lengths)], positions)
        assert padded.slot_mapping[len(lengths) :].eq(-1).all()
        pad = size - len(lengths)
        q = torch.cat([case.q, torch.randn(pad, *case.q.shape[1:])])
        k = torch.cat([case.k, torch.randn(pad, *case.k.shape[1:])])
        v = torch.cat([case.v, torch.randn(pad, *case.v.shape[1:])])
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = make().forward(q, k, v, k_cache, v_cache, padded, 0.2)
        check(case, make(), atol=1e-5)  # the unpadded step, on the original caches
        expected = make().forward(case.q, case.k, case.v, k_cache.clone(), v_cache.clone(), case.meta, 0.2)
        exact = backend == "cpu"
        torch.testing.assert_close(out[: len(lengths)], expected, atol=0 if exact else 1e-6, rtol=0)
        assert torch.isfinite(out).all()
        # Only the real rows' slots were written: the caches match the unpadded step's.
        assert torch.equal(k_cache, case.k_cache) and torch.equal(v_cache, case.v_cache)


def test_pad_decode_refuses_what_does_not_fit() -> None:
    rng = random.Random(1)
    case, ids, positions = _decode_case(rng, [20, 30, 3])
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode(ids, positions, case.meta, 2, 8)
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode(ids, positions, case.meta, 4, 1)
    prefill = make_case(rng, [(0, 3)], 6, 2, 16)
    with pytest.raises(ValueError, match="pure decode"):
        pad_decode(prefill.q[:1, 0, 0].long(), torch.zeros(1).long(), prefill.meta, 4, 4)


class _EagerGraphs:
    """A stand-in for CudaGraphDecode on the CPU: the same choice of size and the same padding,
    then the model's eager forward on the padded batch (what a graph replays on CUDA)."""

    def __init__(
        self, forward: Callable[[Tensor, Tensor, AttentionMetadata], Tensor], sizes: list[int]
    ) -> None:
        self.forward, self.sizes, self.width, self.sizes_run = forward, sizes, 64, []

    def can_run(self, num_seqs: int, width: int) -> bool:
        return padded_size(num_seqs, self.sizes) is not None and width <= self.width

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        size = padded_size(input_ids.shape[0], self.sizes)
        assert size is not None
        self.sizes_run.append(size)
        ids, pos, padded = pad_decode(input_ids, positions, meta, size, self.width)
        return self.forward(ids, pos, padded)[: input_ids.shape[0]]


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_runner_pads_decode_steps(tiny_model: TinyModel, attention: str) -> None:
    """The runner's graph path on the CPU (the graph replaced by an eager forward of the padded
    batch): the same greedy tokens as the plain path, decode steps through it, prefills not."""
    _byte_tokenizer(tiny_model.path)
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 30))] for _ in range(11)]
    # Outputs of different lengths: the batch shrinks from 11 (eager) through every size.
    params = [SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True) for i in range(11)]
    plain = LLM(str(tiny_model.path), attention_backend=attention, num_blocks=128)
    padded = LLM(str(tiny_model.path), attention_backend=attention, num_blocks=128)
    runner = padded.engine.runner
    assert isinstance(runner.model.model.layers[0].self_attn.backend, CpuAttention) == (attention == "cpu")
    fake = _EagerGraphs(runner.forward, capture_sizes(8))  # 11 sequences: some steps too big
    runner.graphs = fake  # type: ignore[assignment]
    expected = [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    assert [r.outputs[0].token_ids for r in padded.generate(prompts, params)] == expected
    assert runner.graph_steps == len(fake.sizes_run) > 0
    assert set(fake.sizes_run) <= {1, 2, 4, 8} and any(s > 1 for s in fake.sizes_run)


@pytest.mark.gpu
@pytest.mark.parametrize("tiny_model", ["llama-gqa", "qwen2-bias"], indirect=True)
def test_cuda_graphs_match_eager(tiny_model: TinyModel, tmp_path: Path) -> None:
    """On CUDA with the Triton backend: decode steps replay captured graphs and give the eager
    path's greedy tokens (fp32, so the two agree to the token)."""
    _byte_tokenizer(tiny_model.path)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 40))] for _ in range(13)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = dict(device="cuda", dtype=torch.float32, num_blocks=256, max_num_seqs=16)
    eager = LLM(str(tiny_model.path), cuda_graphs=False, **common)
    graphs = LLM(str(tiny_model.path), cuda_graphs=True, **common)
    assert eager.engine.runner.graphs is None and graphs.engine.runner.graphs is not None
    expected = [r.outputs[0].token_ids for r in eager.generate(prompts, params)]
    assert [r.outputs[0].token_ids for r in graphs.generate(prompts, params)] == expected
    assert graphs.engine.runner.graph_steps > 0
