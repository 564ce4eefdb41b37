"""Sampling: greedy, temperature, top_k/top_p/min_p, penalties, logit_bias, seeds, logprobs, params."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from tokenmill import protocol
from workers.engine.sampling import (
    Sampler,
    SampleRow,
    SamplingParams,
    apply_logit_bias,
    apply_penalties,
    filtered_probs,
    greedy,
    make_generator,
)

V = 64
sampler = Sampler()


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    probs = filtered_probs(logits, params)
    return probs / probs.sum(-1, keepdim=True)


def row(
    prompt: list[int] | None = None, output: list[int] | None = None, index: int = 0, **kw: object
) -> SampleRow:
    params = SamplingParams(**kw)  # type: ignore[arg-type]
    return SampleRow(params, prompt or [], output or [], make_generator(params.seed, index))


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(8, V, generator=torch.Generator().manual_seed(0)) * 3


# --- greedy and its limits -----------------------------------------------------------------


def test_greedy_is_argmax(logits: torch.Tensor) -> None:
    out = sampler(logits, [row(temperature=0) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "kw", [{"temperature": 1e-3}, {"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=lambda kw: str(kw)
)
def test_limits_equal_greedy(logits: torch.Tensor, kw: dict[str, float]) -> None:
    for _ in range(5):
        out = sampler(logits, [row(**kw) for _ in range(8)])
        assert out.token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_stay_greedy(logits: torch.Tensor) -> None:
    rows = [row(temperature=0) if i % 2 else row(temperature=5.0) for i in range(8)]
    out = sampler(logits, rows)
    assert out.token_ids[1::2] == logits.argmax(-1)[1::2].tolist()


# --- filtered distributions -----------------------------------------------------------------


def test_top_k_keeps_k_most_likely(logits: torch.Tensor) -> None:
    probs = sampling_probs(logits, [SamplingParams(top_k=5)] * 8)
    kept = probs > 0
    assert kept.sum(-1).tolist() == [5] * 8
    assert torch.equal(kept, torch.zeros_like(kept).scatter(1, logits.topk(5).indices, True))


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = sampling_probs(logits, [SamplingParams(top_p=0.7)])
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = sampling_probs(logits, [SamplingParams(top_p=0.9)])
    assert torch.allclose(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_top_p_applies_to_the_top_k_distribution() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # Renormalised top-2 is [4/7, 3/7]: 4/7 already reaches 0.5, so one token stays.
    assert (sampling_probs(logits, [SamplingParams(top_k=2, top_p=0.5)]) > 0).sum() == 1
    assert (sampling_probs(logits, [SamplingParams(top_p=0.5)]) > 0).sum() == 2


def _reference_keep(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """top_k then top_p by a full sort, one row at a time."""
    probs, order = logits.softmax(-1).sort(descending=True)
    if k:
        probs[k:] = 0
    probs = probs / probs.sum()
    kept = ((probs.cumsum(0) - probs) < p) & (probs > 0)
    return torch.zeros_like(kept).scatter(0, order, kept)


def test_top_k_top_p_match_full_sort_for_wide_nuclei() -> None:
    # A flat distribution over 6000 tokens: nuclei wider than the first candidates (256) and than
    # the second round (4096), so every widening path runs, mixed with top_k rows in one batch.
    logits = torch.randn(6, 6000, generator=torch.Generator().manual_seed(3)) * 0.5
    settings = [(0, 0.3), (0, 0.9), (0, 0.999), (50, 1.0), (1000, 0.8), (10, 0.5)]
    probs = filtered_probs(logits, [SamplingParams(top_k=k, top_p=p) for k, p in settings])
    for i, (k, p) in enumerate(settings):
        expected = _reference_keep(logits[i], k, p)
        assert torch.equal(probs[i] > 0, expected), (k, p, int((probs[i] > 0).sum()), int(expected.sum()))
    assert (probs[2] > 0).sum() > 4096


def test_min_p_keeps_tokens_above_fraction_of_max(logits: torch.Tensor) -> None:
    min_p = 0.1
    p = logits.softmax(-1)
    expected = p >= min_p * p.amax(-1, keepdim=True)
    probs = sampling_probs(logits, [SamplingParams(min_p=min_p)] * 8)
    assert torch.equal(probs > 0, expected)
    assert torch.allclose(probs, torch.where(expected, p, 0) / (p * expected).sum(-1, keepdim=True))
    # And the sampler never draws outside it.
    big = logits[:1].expand(4000, V)
    out = sampler(big, [row(min_p=min_p) for _ in range(4000)])
    assert expected[0, out.token_ids].all()


def test_per_row_params_in_one_batch(logits: torch.Tensor) -> None:
    params = [SamplingParams(top_k=3), SamplingParams(), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2)]
    probs = sampling_probs(logits[:4], params)
    for i, p in enumerate(params):
        alone = sampling_probs(logits[i : i + 1], [p])
        assert torch.equal(probs[i], alone[0])
    assert (probs[0] > 0).sum() == 3 and (probs[1] > 0).all()


def test_temperature_one_matches_distribution() -> None:
    target = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 20_000
    torch.manual_seed(0)  # unseeded rows share the global RNG; pin it so the test cannot flake
    out = sampler(target.log().expand(n, 4).contiguous(), [row() for _ in range(n)])
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4) / n
    assert torch.allclose(freq, target, atol=0.015), freq


def test_temperature_sharpens_and_flattens() -> None:
    target = torch.tensor([0.5, 0.25, 0.15, 0.1])
    for t in (0.5, 2.0):
        probs = sampling_probs(target.log().unsqueeze(0), [SamplingParams(temperature=t)])
        expected = target ** (1 / t) / (target ** (1 / t)).sum()
        assert torch.allclose(probs[0], expected, atol=1e-6)


# --- logit processing ----------------------------------------------------------------------


def test_penalties_hand_computed() -> None:
    x = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    # prompt has token 0; output has 1 twice and 2 once; 3 and 4 unseen.
    r = row(
        prompt=[0], output=[1, 2, 1], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    apply_penalties(x, [r])
    expected = [
        2.0 / 2,  # prompt only: repetition (positive → divide), no presence/frequency
        -1.0 * 2 - 0.5 - 0.25 * 2,  # output twice: negative → multiply, then presence + 2·frequency
        0.5 / 2 - 0.5 - 0.25 * 1,
        -3.0,
        1.0,
    ]
    assert x[0].tolist() == pytest.approx(expected)


def test_penalties_only_touch_their_rows() -> None:
    x = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    apply_penalties(x, [row(output=[0]), row(output=[0, 0, 0], frequency_penalty=1.0)])
    assert x.tolist() == [[1.0, 1.0, 1.0], [-2.0, 1.0, 1.0]]


def test_logit_bias_added_and_forces_token(logits: torch.Tensor) -> None:
    x = torch.zeros(2, 4)
    apply_logit_bias(x, [row(logit_bias={1: 2.5, 3: -1.0}), row()])
    assert x.tolist() == [[0, 2.5, 0, -1.0], [0, 0, 0, 0]]
    least = logits.argmin(-1).tolist()
    rows = [row(logit_bias={t: 100.0}) for t in least]
    assert sampler(logits, rows).token_ids == least
    greedy = [row(temperature=0, logit_bias={t: 100.0}) for t in least]
    assert sampler(logits, greedy).token_ids == least


def test_logit_bias_batched_rows_and_out_of_vocab(logits: torch.Tensor) -> None:
    """Biased rows interleaved with unbiased ones: each gets exactly its own bias, unbiased rows
    and the raw logits are untouched; ids past the logits' width are skipped, not an error."""
    rows = [row(), row(logit_bias={0: -3.0, V - 1: 1.5}), row(), row(logit_bias={2: 7.0, V + 5: 1.0})]
    x = logits[:4].clone()
    apply_logit_bias(x, rows)
    expected = logits[:4].clone()
    expected[1, 0] -= 3.0
    expected[1, V - 1] += 1.5
    expected[3, 2] += 7.0
    assert torch.equal(x, expected)
    # The sampler: -100 on each greedy token hands that row the runner-up, the others keep theirs.
    best = logits[:4].topk(2, dim=-1).indices.tolist()
    banned = [
        row(temperature=0, logit_bias={best[i][0]: -100.0}) if i % 2 else row(temperature=0) for i in range(4)
    ]
    assert sampler(logits[:4], banned).token_ids == [best[i][1] if i % 2 else best[i][0] for i in range(4)]


def test_grammar_mask_wins_over_logit_bias(logits: torch.Tensor) -> None:
    """+100 on a token the grammar forbids cannot bring it back; among the allowed, bias counts."""
    from tests.engine.test_structured import _bitmask

    allowed = [3, 9]
    forced = next(t for t in range(V) if t not in allowed)
    weaker = min(allowed, key=lambda t: float(logits[0, t]))
    bias = {forced: 100.0, weaker: 50.0}
    r = SampleRow(SamplingParams(temperature=0, logit_bias=bias), [], [], None, _bitmask(allowed, V))
    assert sampler(logits[:1], [r]).token_ids == [weaker]


def test_sampler_leaves_input_logits_untouched(logits: torch.Tensor) -> None:
    before = logits.clone()
    sampler(logits, [row(output=[1, 2], repetition_penalty=1.5, logit_bias={0: 5.0}) for _ in range(8)])
    assert torch.equal(logits, before)


# --- seeds ---------------------------------------------------------------------------------


def _steps(seed: int, others: int, position: int, steps: int = 6) -> list[int]:
    """Tokens of one seeded sequence over several steps, at `position` among unseeded rows whose
    settings (top_k 300) change how the batch is filtered."""
    vocab = 2048
    g = make_generator(seed)
    mine = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(1))
    tokens = []
    for s in range(steps):
        step_logits = torch.randn(others + 1, vocab)  # the rest of the batch: anything
        step_logits[position] = mine[s]
        rows = [row(temperature=0.8, top_k=300) for _ in range(others)]
        rows.insert(position, SampleRow(SamplingParams(seed=seed, temperature=1.5, top_p=0.95), [], [], g))
        tokens.append(sampler(step_logits, rows).token_ids[position])
    return tokens


def test_seed_reproducible_whatever_the_batch() -> None:
    first = _steps(seed=7, others=0, position=0)
    assert _steps(seed=7, others=0, position=0) == first
    assert _steps(seed=7, others=5, position=0) == first
    assert _steps(seed=7, others=5, position=3) == first


def test_seeded_rows_independent_of_row_order(logits: torch.Tensor) -> None:
    rows = [row(seed=s) for s in range(8)]
    a = sampler(logits, rows).token_ids
    perm = [5, 2, 7, 0, 1, 6, 3, 4]
    b = sampler(logits[perm], [row(seed=s) for s in perm]).token_ids
    assert [a[i] for i in perm] == b


def test_different_seeds_differ() -> None:
    assert _steps(seed=1, others=0, position=0) != _steps(seed=2, others=0, position=0)


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(3, 1), make_generator(4)
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))  # index offsets the seed
    assert make_generator(-1) is not None and make_generator(2**70) is not None


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_raw_model_logprobs(logits: torch.Tensor) -> None:
    rows = [
        row(logprobs=5, temperature=0.7, top_k=3, repetition_penalty=1.3, output=[1]),
        row(logprobs=0),
        row(),
        row(logprobs=20, temperature=0, logit_bias={0: 50.0}),
    ]
    out = sampler(logits[:4], rows)
    raw = logits[:4].log_softmax(-1)
    assert len(out.logprobs) == 4
    for i in (0, 1, 3):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-5)
    assert math.isnan(out.logprobs[2])  # not asked for
    assert [len(t) for t in out.top_logprobs] == [5, 0, 0, 20]
    for i in (0, 3):
        values, ids = raw[i].topk(len(out.top_logprobs[i]))
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.token_ids[3] == 0


def test_top_logprobs_capped_by_vocab() -> None:
    out = sampler(torch.zeros(1, 4), [row(logprobs=20)])
    assert len(out.top_logprobs[0]) == 4
    assert all(lp == pytest.approx(math.log(0.25)) for _, lp in out.top_logprobs[0])


# --- params --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_validation_names_the_parameter(kw: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_top_k_minus_one_is_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_check_vocab() -> None:
    SamplingParams(logit_bias={3: 1.0}).check_vocab(4)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={4: 1.0}).check_vocab(4)


def test_from_wire_round_trip() -> None:
    wire = protocol.SamplingParams(
        max_tokens=99, temperature=0.3, top_p=0.8, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, seed=1234, stop=["\n\n", "END"],
        stop_token_ids=[2, 7], ignore_eos=True, logprobs=3, logit_bias={5: -100.0, 11: 2.5},
    )  # fmt: skip
    decoded = msgspec.json.decode(msgspec.json.encode(wire), type=protocol.SamplingParams)
    p = SamplingParams.from_wire(decoded)
    for name in protocol.SamplingParams.__struct_fields__:
        assert getattr(p, name) == getattr(wire, name), name
    assert p.n == 1 and p.logit_bias == {5: -100.0, 11: 2.5}  # JSON's string keys back to ids
    assert p.stop is not decoded.stop
    assert SamplingParams.from_wire(protocol.SamplingParams()) == SamplingParams()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_wire(protocol.SamplingParams(temperature=-1))


def test_greedy_is_argmax_ties_and_all() -> None:
    """`greedy` (max's indices, faster) picks exactly what argmax picks: the first of tied
    maxima, a NaN where one is, the first column of a row that is all -inf."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 3, (64, 4099), generator=g).float()  # many ties per row
    x[1] = -math.inf
    x[2, 17] = math.nan
    x[3, 4000:] = 5.0
    assert torch.equal(greedy(x), x.argmax(dim=-1))
    assert greedy(x)[:4].tolist() == [x[0].argmax().item(), 0, 17, 4000]
