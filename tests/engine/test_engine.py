"""The engine end to end: the same tokens whatever the cache, budget, pool or backend;
stop strings, seeds, n > 1, logprobs and logit_bias on the real SmolLM2."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tests.engine.conftest import TinyModel
from tokenmill.modelstore import resolve_model
from workers.engine import LLM, SamplingParams
from workers.engine.sampling import InvalidParam

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _byte_tokenizer(path: Path) -> None:
    """A 256-token byte-level tokenizer, so the tiny random models can detokenize."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: ord(c))
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))


@pytest.fixture(scope="module")
def tiny(tiny_model: TinyModel) -> Path:
    _byte_tokenizer(tiny_model.path)
    return tiny_model.path


def _prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 256) for _ in range(40)]  # a shared prefix: the cache has work
    return [
        shared[: rng.randint(17, 40)] + [rng.randrange(3, 256) for _ in range(rng.randint(3, 25))]
        for _ in range(n)
    ]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
def test_same_tokens_with_cache_budget_and_tiny_pool(tiny: Path) -> None:
    prompts = _prompts()
    base_llm = LLM(str(tiny), enable_prefix_caching=False)
    base = _tokens(base_llm, prompts)
    assert all(len(t) == GREEDY.max_tokens for t in base)

    cached = LLM(str(tiny))
    assert _tokens(cached, prompts) == base
    assert _tokens(cached, prompts) == base  # again, now mostly from the prefix cache
    assert cached.engine.block_manager.hits > 0

    chunked = LLM(str(tiny), max_num_batched_tokens=8)  # prompts split over several steps
    assert _tokens(chunked, prompts) == base
    assert chunked.engine.stats.steps > 2 * GREEDY.max_tokens

    # 8 blocks of 16 tokens cannot hold six sequences of ~50 tokens: some must be preempted
    # and recomputed, and must still produce the same tokens.
    small = LLM(str(tiny), num_blocks=8)
    assert _tokens(small, prompts) == base
    assert small.engine.scheduler.preemptions > 0


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
def test_triton_backend_gives_the_same_tokens(tiny: Path) -> None:
    """The Triton kernels wired into the engine (under the interpreter here) match PyTorch."""
    prompts = _prompts(3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    torch_tokens = _tokens(LLM(str(tiny), attention_backend="torch"), prompts, params)
    triton = LLM(str(tiny), attention_backend="triton", max_num_batched_tokens=16)
    assert type(triton.engine.model.model.layers[0].self_attn.backend).__name__ == "TritonAttention"
    assert _tokens(triton, prompts, params) == torch_tokens


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
def test_fp16_kv_cache_gives_the_same_tokens_on_every_backend(tiny: Path) -> None:
    """kv_cache_dtype float16 under an fp32 model: the C kernel, PyTorch and the Triton kernels
    (interpreted here) read the same rounded cache in fp32 arithmetic, so they agree."""
    prompts = _prompts(3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    half = {"kv_cache_dtype": torch.float16, "max_num_batched_tokens": 16}
    cpu = LLM(str(tiny), **half)
    assert type(cpu.engine.model.model.layers[0].self_attn.backend).__name__ == "CpuAttention"
    assert cpu.engine.runner.kv_caches[0][0].dtype == torch.float16
    tokens = _tokens(cpu, prompts, params)
    assert _tokens(LLM(str(tiny), attention_backend="torch", **half), prompts, params) == tokens
    assert _tokens(LLM(str(tiny), attention_backend="triton", **half), prompts, params) == tokens
    with pytest.raises(ValueError, match=r"kv_cache_dtype torch\.int8 is not one of"):
        LLM(str(tiny), kv_cache_dtype=torch.int8)


# --- the real model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(model_cache: Path) -> LLM:
    torch.set_num_threads(2)
    return LLM(str(resolve_model("bundled:smollm2", model_cache)), kv_cache_gib=0.25)


def _chat(llm: LLM, text: str) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.mark.slow
def test_stop_strings(smol: LLM) -> None:
    prompt = _chat(smol, "Count from 1 to 10, separated by commas.")
    free = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "6" in free.text
    cut = free.text.index("6")
    stopped = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=["6"]))[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:cut]  # cut before the stop string, which is not shown


@pytest.mark.slow
def test_seeds(smol: LLM) -> None:
    prompt = _chat(smol, "Write a sentence about the sea.")

    def sample(seed: int) -> str:
        params = SamplingParams(temperature=1.0, max_tokens=24, seed=seed, ignore_eos=True)
        return smol.generate([prompt], params)[0].outputs[0].text

    first = sample(42)
    assert sample(42) == first
    assert sample(43) != first
    # the same seed in a batch with other requests gives the same text
    mixed = smol.generate(
        [_chat(smol, "Hi!"), prompt], SamplingParams(temperature=1.0, max_tokens=24, seed=42, ignore_eos=True)
    )
    assert mixed[1].outputs[0].text == first


@pytest.mark.slow
def test_n_samples(smol: LLM) -> None:
    prompt = _chat(smol, "Name an animal.")
    (result,) = smol.generate(
        [prompt], SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5, ignore_eos=True)
    )
    a, b = result.outputs
    assert len(a.token_ids) == len(b.token_ids) == 16
    assert a.token_ids != b.token_ids


@pytest.mark.slow
def test_logprobs_match_hf(smol: LLM) -> None:
    from transformers import AutoModelForCausalLM

    prompt = _chat(smol, "What is the capital of France?")
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5)
    out = smol.generate([prompt], params)[0].outputs[0]
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    hf = AutoModelForCausalLM.from_pretrained(smol.engine.config.model, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1)
    for i, (tok, top) in enumerate(zip(out.token_ids, out.top_logprobs, strict=True)):
        assert len(top) == 5 and top[0][0] == tok  # greedy: the sampled token is the top one
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-3)
        hf_top = torch.topk(ref[i], 5)
        assert [t for t, _ in top] == hf_top.indices.tolist()
        for (_, lp), ref_lp in zip(top, hf_top.values.tolist(), strict=True):
            assert lp == pytest.approx(ref_lp, abs=1e-3)


def test_fp16_kv_cache_holds_twice_the_tokens_and_stays_close_to_fp32(smol: LLM) -> None:
    """The same memory holds twice the blocks; greedy tokens and logprobs stay those of the fp32
    cache within fp16's rounding of the keys and values."""
    half = LLM(smol.engine.config.model, kv_cache_gib=0.25, kv_cache_dtype=torch.float16)
    assert half.engine.block_manager.num_blocks == 2 * smol.engine.block_manager.num_blocks
    prompt = _chat(smol, "Write one sentence about windmills.")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    want = smol.generate([prompt], params)[0].outputs[0]
    got = half.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=2e-2)
    assert got.logprobs != want.logprobs  # the rounding is real: not the fp32 cache again


@pytest.mark.slow
def test_logit_bias_bans_and_forces_tokens(smol: LLM) -> None:
    prompt = _chat(smol, "What is the capital of France?")
    plain = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=2))[0].outputs[0]
    assert plain.top_logprobs is not None
    first, runner_up = (t for t, _ in plain.top_logprobs[0])
    assert first == plain.token_ids[0]

    # -100 on the greedy first token: the runner-up comes first instead.
    banned = SamplingParams(temperature=0, max_tokens=4, logit_bias={first: -100.0}, logprobs=2)
    out = smol.generate([prompt], banned)[0].outputs[0]
    assert out.token_ids[0] == runner_up
    assert out.logprobs is not None  # still the model's own: the banned token keeps its logprob
    assert out.logprobs[0] == pytest.approx(plain.top_logprobs[0][1][1], abs=1e-4)
    assert out.top_logprobs is not None and out.top_logprobs[0][0][0] == first

    # +100 on an unlikely token forces it at every step.
    forced = smol.tokenizer.encode(" banana")
    assert len(forced) == 1
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={forced[0]: 100.0})
    assert smol.generate([prompt], params)[0].outputs[0].token_ids == forced * 5


@pytest.mark.slow
def test_logit_bias_refused_out_of_range(smol: LLM) -> None:
    prompt = _chat(smol, "Hi!")
    vocab = smol.engine.model_config.vocab_size
    with pytest.raises(InvalidParam) as err:
        smol.engine.add_request("bad", prompt, SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias" and "out of vocabulary" in str(err.value)
    assert not smol.engine.has_unfinished()
    for bias in (100.5, -101.0, float("nan")):
        with pytest.raises(InvalidParam, match="logit_bias"):
            SamplingParams(logit_bias={5: bias})


@pytest.mark.slow
def test_biased_rows_leave_their_batch_neighbours_alone(smol: LLM) -> None:
    prompts = [_chat(smol, q) for q in ("Name a colour.", "What is 2+2?", "Say hello.", "Name a fruit.")]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [smol.generate([p], plain)[0].outputs[0].token_ids for p in prompts]
    # Rows 1 and 3 ban their own greedy first token; rows 0 and 2 have no bias.
    each = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={alone[i][0]: -100.0})
        if i % 2
        else plain
        for i in range(len(prompts))
    ]
    mixed = [r.outputs[0].token_ids for r in smol.generate(prompts, each)]
    assert mixed[0] == alone[0] and mixed[2] == alone[2]
    assert mixed[1][0] != alone[1][0] and mixed[3][0] != alone[3][0]
