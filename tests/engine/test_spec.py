"""Speculative decoding: the n-gram proposer, greedy outputs identical with and without it
(tiny Llama and SmolLM2), KV rollback of rejected drafts, auto-off on large batches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import TinyModel
from tests.engine.test_engine import _byte_tokenizer
from tokenmill.modelstore import resolve_model
from workers.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence
from workers.engine.spec import NgramProposer

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

# --- the proposer ---------------------------------------------------------------------------


def test_proposer_takes_what_followed_the_longest_recent_match() -> None:
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 5, 9, 9, 1, 2, 3]) == [4, 5, 9]  # 3-gram "1 2 3"
    assert p.propose([1, 2, 3, 4, 5, 7, 2, 3]) == [4, 5, 7]  # 2-gram "2 3"
    assert p.propose([5, 1, 8, 5, 2, 8, 5]) == [2, 8, 5]  # 2-gram "8 5": most recent match
    assert p.propose([1, 2, 3], k=2) == []  # no earlier occurrence
    assert p.propose([4, 4], k=0) == []
    # A repeating pattern: the most recent match would run into the tail; take a full one.
    assert p.propose([7, 7, 7, 7, 7, 7, 7]) == [7, 7, 7]
    assert NgramProposer(k=5, min_n=2, max_n=2).propose([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert NgramProposer(k=5, min_n=2, max_n=2).propose([1, 3, 1, 2]) == []  # only a 1-gram
    with pytest.raises(ValueError):
        NgramProposer(k=2, min_n=3, max_n=2)


# --- block rollback -------------------------------------------------------------------------


def test_truncate_gives_back_the_blocks_of_rejected_tokens() -> None:
    bm = BlockManager(8, 4)
    seq = Sequence(0, "r", list(range(6)), 6, GREEDY)
    assert bm.allocate(seq, 6)
    bm.commit(seq, 6)  # block 0 is full and cached
    seq.num_computed_tokens = 6
    assert bm.allocate(seq, 1 + 5)  # last token + 5 drafts: positions 6..11, blocks 1 and 2
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.truncate(seq, 7)  # one draft kept: 8 tokens computed... 7 of them valid
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.truncate(seq, 8)  # nothing past block 1 any more
    assert len(seq.block_table) == 2
    bm.free(seq)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


# --- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model: TinyModel) -> Path:
    _byte_tokenizer(tiny_model.path)
    return tiny_model.path


def _copy_prompts(n: int) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup has something to find."""
    rng = random.Random(5)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 256) for _ in range(rng.randint(6, 12))]
        out.append(phrase * 3 + phrase[: rng.randint(2, 5)])
    return out


def _run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    check: bool = True,
) -> list[list[int]]:
    """Generate to completion (`params` for all prompts, or one per prompt), checking after every
    step that each running sequence's blocks cover exactly its computed tokens (no block kept
    for rejected drafts, none missing)."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, each, strict=True)):
        engine.add_request(str(i), p, sp)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    bs = engine.block_manager.block_size
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        if check:
            refs = [0] * engine.block_manager.num_blocks
            for seq in engine.scheduler.running:
                assert not seq.spec_token_ids
                if not seq.is_prefill:
                    assert seq.num_computed_tokens == seq.num_tokens - 1
                    assert len(seq.block_table) == -(-seq.num_computed_tokens // bs)
                for b in seq.block_table:
                    refs[b] += 1
            assert [b.ref_count for b in engine.block_manager.blocks] == refs
    return [tokens[str(i)] for i in range(len(prompts))]


def _engine(path: Path, **config: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **config))  # type: ignore[arg-type]


@pytest.mark.parametrize("tiny_model", ["llama-gqa", "llama3-rope"], indirect=True)
def test_greedy_outputs_identical_with_and_without_speculation(tiny: Path) -> None:
    prompts = _copy_prompts(5)
    base = _run(_engine(tiny), prompts, GREEDY)
    spec = _engine(tiny, num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    assert _run(spec, prompts, GREEDY) == base
    stats = spec.stats
    # Both paths were taken: drafts kept (the random model loops, as greedy small models do) and
    # drafts rejected (rolled back).
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.steps < _steps(base)
    assert stats.generation_tokens == sum(len(t) for t in base)


def _steps(tokens: list[list[int]]) -> int:
    """Steps the engine takes without speculation: one prefill step, then one per token."""
    return max(len(t) for t in tokens)


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
def test_rollback_with_small_blocks_chunks_and_preemption(tiny: Path) -> None:
    """Rejected drafts that crossed into new blocks, prompts split in chunks, and a pool so
    small that sequences are preempted and recomputed: the same tokens as without drafts."""
    prompts = _copy_prompts(6)
    config = dict(block_size=4, num_blocks=40, max_num_batched_tokens=24)
    base = _run(_engine(tiny, **config), prompts, GREEDY)
    spec = _engine(tiny, num_speculative_tokens=5, prompt_lookup_min=1, **config)
    assert _run(spec, prompts, GREEDY) == base
    assert spec.scheduler.preemptions > 0 and spec.stats.spec_accepted_tokens > 0
    assert spec.block_manager.num_free_blocks == 40


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
def test_stops_inside_accepted_drafts(tiny: Path) -> None:
    """max_tokens, stop token ids and EOS landing among accepted drafts end the output exactly
    where decoding one token at a time ends it."""
    prompts = _copy_prompts(4)
    free = _run(_engine(tiny), prompts, GREEDY)
    cases = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 7, 13)]
    # A token each output produces somewhere in its middle, as a stop token.
    stop = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[0][9]], ignore_eos=True)
    for params in [*cases, stop]:
        base = _run(_engine(tiny), prompts, params)
        spec = _engine(tiny, num_speculative_tokens=6, prompt_lookup_min=1)
        assert _run(spec, prompts, params) == base
        assert not spec.has_unfinished() and not spec.scheduler.service.unfinished


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
def test_switched_off_for_large_batches_and_sampled_rows(tiny: Path) -> None:
    prompts = _copy_prompts(6)
    engine = _engine(tiny, num_speculative_tokens=4, prompt_lookup_min=1, speculative_disable_by_batch_size=3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40 + 10 * i, ignore_eos=True))
    drafted_with = []
    while engine.has_unfinished():
        before = engine.stats.spec_draft_tokens
        running = engine.scheduler.num_running
        engine.step()
        if engine.stats.spec_draft_tokens > before:
            drafted_with.append(running)
    # Six run at once: no drafts until at most three are left, then drafts again.
    assert drafted_with and max(drafted_with) <= 3

    sampled = _engine(tiny, num_speculative_tokens=4, prompt_lookup_min=1)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True)
    _run(sampled, prompts, params)
    assert sampled.stats.spec_draft_tokens == 0  # temperature > 0 decodes one token a step
    penalized = _engine(tiny, num_speculative_tokens=4, prompt_lookup_min=1)
    _run(penalized, prompts, SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2))
    assert penalized.stats.spec_draft_tokens == 0


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
def test_biased_and_logprob_rows_decode_alone_beside_drafting_ones(tiny: Path) -> None:
    """Greedy rows with a logit_bias or logprobs cannot be verified by the argmax of the raw
    logits, so they never draft; in a batch where plain greedy rows draft, they still get their
    bias and one logprob per token, and every row the tokens of the engine without drafts."""
    prompts = _copy_prompts(4)
    plain = _run(_engine(tiny), prompts, GREEDY)
    # Ban the token each biased row would produce first: without the bias applied it copies on.
    each = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias={plain[1][0]: -100.0}),
        GREEDY,
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
    ]
    base = _run(_engine(tiny), prompts, each)
    assert base[1][0] != plain[1][0] and base[3] == plain[3]
    spec = _engine(tiny, num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    for i, (p, sp) in enumerate(zip(prompts, each, strict=True)):
        spec.add_request(str(i), p, sp)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    multi: set[str] = set()  # rows that got several tokens in one step: accepted drafts
    while spec.has_unfinished():
        for out in spec.step():
            tokens[out.request_id] += out.token_ids
            if len(out.token_ids) > 1:
                multi.add(out.request_id)
            if out.request_id == "3":
                assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert [tokens[str(i)] for i in range(len(prompts))] == base
    assert spec.stats.spec_accepted_tokens > 0 and multi and multi <= {"0", "2"}


# --- the real model -------------------------------------------------------------------------

_DOC = (
    "The quarterly report shows that revenue grew by twelve percent, driven mostly by the new "
    "subscription plans. Operating costs stayed flat, while marketing spend increased slightly. "
    "The board approved a new budget for research and development."
)


@pytest.mark.slow
def test_smollm2_repeat_and_edit_is_identical(model_cache: Path) -> None:
    torch.set_num_threads(2)
    path = str(resolve_model("bundled:smollm2", model_cache))
    plain = LLM(path, kv_cache_gib=0.25)
    spec = LLM(path, kv_cache_gib=0.25, num_speculative_tokens=4)
    tok = plain.tokenizer
    asks = [
        f"Repeat this document exactly, replacing 'twelve' with 'fifteen':\n\n{_DOC}",
        f"Copy the text below word for word, then add one sentence about hiring.\n\n{_DOC}",
        "Count from 1 to 30, separated by commas.",
    ]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}])) for a in asks]
    params = SamplingParams(temperature=0, max_tokens=64, stop=["board"])  # EOS and a stop string
    for p in (params, SamplingParams(temperature=0, max_tokens=64)):
        want = [(r.outputs[0].token_ids, r.outputs[0].text) for r in plain.generate(prompts, p)]
        got = [(r.outputs[0].token_ids, r.outputs[0].text) for r in spec.generate(prompts, p)]
        assert got == want
    stats = spec.engine.stats
    # Copying accepts most drafts, counting few ("1, 2, 3" looks up ", 2, 3"): overall 0.46.
    assert stats.spec_accepted_tokens > 0.3 * stats.spec_draft_tokens
