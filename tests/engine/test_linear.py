"""The projections from oneDNN-packed weights (workers/engine/linear.py) against `F.linear` on
the plain weights: every row count a step can have, with and without bias, a LoRA-adapted
projection, and the whole engine's greedy tokens with the packing on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill.modelstore import resolve_model
from workers.engine import linear
from workers.engine.linear import Linear
from workers.engine.llm import LLM
from workers.engine.sampling import SamplingParams

# fp32 in another summation order: outputs of magnitude ~sqrt(in_features) differ by ~1e-5.
ATOL = 5e-4

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_f", "out_f"), [(576, 960), (1536, 576), (16, 256), (7, 3)])
def test_packed_projection_matches_f_linear_at_every_row_count(in_f: int, out_f: int, bias: bool) -> None:
    torch.manual_seed(in_f + out_f)
    layer = Linear(in_f, out_f, bias=bias)
    assert linear.pack(layer) == 1 and layer.packed is not None
    for rows in (1, 2, 7, 64, 65, 300):
        x = torch.randn(rows, in_f)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=ATOL, rtol=0)
    # A strided view (a slice of a wider activation), as the model's reshapes can hand it.
    wide = torch.randn(9, 2 * in_f)
    x = wide[:, :in_f]
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=ATOL, rtol=0)
    linear.unpack(layer)
    assert layer.packed is None


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
        linear.pack(model)
    assert fast == plain and all(len(t) == 24 for t in fast)
