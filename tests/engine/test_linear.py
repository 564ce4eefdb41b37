"""The projections from packed weights (workers/engine/linear.py: oneDNN's layout, or the panels
of csrc/gemm.c on AVX-512 and AVX2 CPUs) against `F.linear` on the plain weights: every row count a step
can have (both sides of `PANEL_ROWS`), with and without bias, strided inputs, and the whole
engine's greedy tokens with the packing on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill.modelstore import resolve_model
from workers.engine import cpu_kernels, linear
from workers.engine.linear import PANEL_ROWS, Linear
from workers.engine.llm import LLM
from workers.engine.sampling import SamplingParams

# fp32 in another summation order: outputs of magnitude ~sqrt(in_features) differ by ~1e-5.
ATOL = 5e-4

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

LIB = cpu_kernels.load()
PANELS = LIB is not None and LIB.tm_gemm_nr() > 0  # AVX-512 or AVX2, the kernels built
# Each way of packing this machine has: oneDNN's always, the panels where they run.
WAYS = ["onednn", pytest.param("panels", marks=pytest.mark.skipif(not PANELS, reason="no AVX-512 or AVX2"))]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_f", "out_f"), [(576, 960), (1536, 576), (16, 256), (7, 3), (40, 45)])
def test_packed_projection_matches_f_linear_at_every_row_count(
    in_f: int, out_f: int, bias: bool, way: str
) -> None:
    torch.manual_seed(in_f + out_f)
    layer = Linear(in_f, out_f, bias=bias)
    assert linear.pack(layer, lib=LIB if way == "panels" else None) == 1
    assert layer.packed is not None and (layer.panels is not None) == (way == "panels")
    for rows in (1, 2, 7, 12, 13, 64, 65, 300, PANEL_ROWS, PANEL_ROWS + 1):
        x = torch.randn(rows, in_f)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=ATOL, rtol=0)
    # A strided view (a slice of a wider activation), as the model's reshapes can hand it, and
    # a batch with more dimensions.
    wide = torch.randn(9, 2 * in_f)
    for x in (wide[:, :in_f], wide[:, 1 : in_f + 1], torch.randn(3, 5, in_f)):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=ATOL, rtol=0)
    linear.unpack(layer)
    assert layer.packed is None and layer.panels is None


@pytest.mark.skipif(not PANELS, reason="no AVX-512 or AVX2")
def test_a_rows_panel_result_does_not_depend_on_the_rest_of_the_batch() -> None:
    """Each output of the panels is one sum over k in order: the same bits for a row alone, in
    a batch of 64, or at any place in the batch (what batch-invariant decoding needs)."""
    torch.manual_seed(0)
    layer = Linear(576, 960, bias=False)
    linear.pack(layer, lib=LIB)
    x = torch.randn(64, 576)
    batch = layer(x)
    for i in (0, 11, 12, 63):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])
    assert torch.equal(layer(x.flip(0)), batch.flip(0))


def test_only_fp32_cpu_weights_are_packed() -> None:
    half = Linear(8, 8).to(torch.float16)
    assert linear.pack(half) == 0 and half.packed is None
    plain = torch.nn.Linear(8, 8)  # not ours: left alone
    assert linear.pack(plain) == 0


def test_packed_copies_do_not_follow_weight_changes_until_repacked() -> None:
    """What `pack`'s docstring promises: after new weights, pack again."""
    layer = Linear(32, 16)
    linear.pack(layer)
    x = torch.randn(4, 32)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    torch.testing.assert_close(layer(x), before)
    linear.pack(layer)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def smol(model_cache: Path) -> LLM:
    torch.set_num_threads(2)
    return LLM(str(resolve_model("bundled:smollm2", model_cache)), kv_cache_gib=0.25)


def _greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


def test_engine_greedy_tokens_are_the_same_packed_and_plain(smol: LLM) -> None:
    model = smol.engine.model
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
    assert len(packed) == 4 * smol.engine.model_config.num_layers + 1  # the engine packs by default
    fast = _greedy(smol, prompts)
    linear.unpack(model)
    try:
        plain = _greedy(smol, prompts)
    finally:
        linear.pack(model, lib=model.cpu_ops)
    assert fast == plain and all(len(t) == 24 for t in fast)
