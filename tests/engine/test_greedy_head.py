"""Greedy tokens from a bf16 screen of the head (workers/engine/greedy_head.py) against the argmax
of the full fp32 logits: the screen's error within its bound, the same tokens for random and
crafted heads (exact ties, near ties, outlier columns, large and tiny activations), the rows that
fall back to the full logits, and the whole engine's greedy tokens with the head on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.modelstore import resolve_model
from workers.engine import cpu_kernels, linear
from workers.engine.greedy_head import GreedyHead, bound, plain
from workers.engine.linear import PANEL_ROWS, Linear
from workers.engine.llm import LLM
from workers.engine.sampling import SamplingParams, greedy
from workers.engine.structured import Grammar

LIB = cpu_kernels.load()
# The head repeats the panels' sums and screens in oneDNN's bf16 (fast with AMX or AVX-512 BF16,
# where the engine turns it on; these tests run it wherever oneDNN has bf16 at all). The pick is
# AVX-512 code: built for AVX2 it hands every row back, which would pass these tests unscreened.
RUNS = (
    LIB is not None
    and "avx512f" in cpu_kernels.cpu_flags().split()
    and torch.backends.mkldnn.is_available()
    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)
pytestmark = pytest.mark.skipif(not RUNS, reason="no AVX-512 or no oneDNN bf16")


def _head(vocab: int, hidden: int, seed: int, std: float = 0.1) -> Linear:
    torch.manual_seed(seed)
    head = Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, std)
    assert linear.pack(head, lib=LIB) == 1 and head.panels is not None
    return head


def test_the_screen_is_within_its_bound() -> None:
    """|bf16 screen - fp32 logit| <= c * |h| * |w_j| for every column, however the magnitudes
    spread (a few outlier features, as in real activations)."""
    head = _head(4096, 576, 0)
    gh = GreedyHead(head, LIB)
    h = torch.randn(64, 576)
    h[:, :4] *= 50  # outlier features
    h[:8] *= 1e-3
    s = torch.ops.mkldnn._linear_pointwise(h.bfloat16(), gh.screen, None, "none", [], "").double()
    exact = h.double() @ head.weight.double().T
    err = (s - exact).abs()
    limit = bound(576) * h.double().norm(dim=1, keepdim=True) * head.weight.double().norm(dim=1)
    assert (err <= limit).all()
    assert err.max() > 1e-4 * limit.max()  # the screen is really bf16: the bound is not idle


@pytest.mark.parametrize("rows", [1, 7, 64, PANEL_ROWS])
def test_tokens_are_the_full_heads_argmax(rows: int) -> None:
    head = _head(8192, 576, rows)
    gh = GreedyHead(head, LIB)
    torch.manual_seed(100 + rows)
    h = torch.randn(rows, 576)
    h[:, 7] *= 30
    assert gh(h) == greedy(head(h)).tolist()


def test_exact_and_near_ties_go_to_the_first_largest() -> None:
    """Columns equal to a row's best one (duplicated weights: the same exact logit) and columns a
    last-bit away: the fp32 path's pick, which is the first index of the maximum."""
    head = _head(2048, 64, 1)
    torch.manual_seed(1)
    h = torch.randn(32, 64)
    best = greedy(head(h))
    with torch.no_grad():
        for r in range(0, 32, 2):  # an exact copy of a row's winner after it, and one before it
            j = int(best[r])
            head.weight[(j + 97) % 2048] = head.weight[j]
            head.weight[(j - 131) % 2048] = head.weight[j]
        for r in range(1, 32, 2):  # a column nudged by one ulp of its largest weight
            j = int(best[r])
            w = head.weight[j].clone()
            i = int(w.abs().argmax())
            w[i] = torch.nextafter(w[i], w[i] * 2)
            head.weight[(j + 5) % 2048] = w
    linear.pack(head, lib=LIB)
    gh = GreedyHead(head, LIB)
    assert gh(h) == greedy(head(h)).tolist()


def test_rows_that_cannot_be_screened_take_the_full_logits() -> None:
    """A row of zeros (every logit tied: more candidates than the cap), one with an infinity and
    one with a NaN get what the full head's argmax gives, beside ordinary rows."""
    head = _head(1024, 128, 2)
    gh = GreedyHead(head, LIB)
    h = torch.randn(6, 128)
    h[1] = 0
    h[3, 5] = float("inf")
    h[4, 9] = float("nan")
    assert gh(h) == greedy(head(h)).tolist()
    assert gh(h)[1] == 0


def test_only_rows_that_read_nothing_but_the_argmax_are_plain() -> None:
    assert plain(SamplingParams(temperature=0))
    assert not plain(SamplingParams(temperature=0.7))
    assert not plain(SamplingParams(temperature=0, logprobs=0))
    assert not plain(SamplingParams(temperature=0, logit_bias={5: 1.0}))
    assert not plain(SamplingParams(temperature=0, repetition_penalty=1.1))
    assert not plain(SamplingParams(temperature=0, grammar=Grammar(kind="regex", spec="a+")))


@pytest.fixture(scope="module")
def smol(model_cache: Path) -> LLM:
    torch.set_num_threads(2)
    return LLM(str(resolve_model("bundled:smollm2", model_cache)), kv_cache_gib=0.25)


def test_engine_greedy_tokens_are_the_same_with_the_head_on_and_off(smol: LLM) -> None:
    """The engine's own head where the CPU has bf16 dot products, else one made for the test; a batch mixing
    plain greedy rows with rows that want logprobs or sample (which take the full logits)."""
    engine = smol.engine
    own = engine.greedy_head
    assert (own is not None) == cpu_kernels.has_bf16_dot()
    engine.greedy_head = own or GreedyHead(engine.model.lm_head, engine.model.cpu_ops)
    torch.manual_seed(3)
    prompts = ["The capital of France is", "def fibonacci(n):", torch.randint(0, 49152, (40,)).tolist()]
    plain_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    logprobs = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    mixed = [plain_params, logprobs, plain_params]
    try:
        fast = [r.outputs[0].token_ids for r in smol.generate(prompts, plain_params)]
        fast_mixed = [r.outputs[0].token_ids for r in smol.generate(prompts, mixed)]
        engine.greedy_head = None
        full = [r.outputs[0].token_ids for r in smol.generate(prompts, plain_params)]
    finally:
        engine.greedy_head = own
    assert fast == full == fast_mixed and all(len(t) == 40 for t in fast)
