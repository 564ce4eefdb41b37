"""The model, loader and runner against HF transformers (the correctness reference).

Tiny random-weight models (conftest.py) are run through our runner in several ways —
one prefill, chunked prefill over cached context, one-token decode steps, mixed batches —
and compared with HF's full-sequence logits at every position. The bundled SmolLM2 is
loaded from its GGUF and from the converted HF directory and greedy-decoded against HF
`generate`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from tokenmill.modelstore import bundled_path, resolve_model
from workers.engine import linear
from workers.engine.attention import CpuAttention, TorchAttention, select_backend
from workers.engine.config import ModelConfig
from workers.engine.kv_cache import allocate_kv_cache, block_bytes, kv_budget_bytes, num_blocks_for_budget
from workers.engine.loader import load_model, unpermute_qk
from workers.engine.models.llama import LlamaForCausalLM, rope_inv_freq
from workers.engine.runner import ModelRunner

if TYPE_CHECKING:
    from tests.engine.conftest import TinyModel

ATOL = 1e-4  # fp32 logits, ours vs HF's


@dataclass(slots=True)
class Seq:
    """The fields of workers.engine.sequence.Sequence that the runner reads."""

    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class Blocks:
    """A stand-in for the block manager: hands out shuffled block ids, so block tables are
    never contiguous runs."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def cover(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self.free.pop())


def make_runner(model: LlamaForCausalLM, cfg: ModelConfig, block_size: int, num_blocks: int = 256):
    kv = allocate_kv_cache(cfg, num_blocks, block_size, torch.float32, "cpu")
    return ModelRunner(model, cfg, kv, block_size, "cpu"), Blocks(num_blocks, block_size)


@torch.inference_mode()
def step_all_logits(runner: ModelRunner, blocks: Blocks, batch: list[tuple[Seq, int]]) -> list[torch.Tensor]:
    """Run one step and return the logits of every new token, per sequence; advance them."""
    for seq, n in batch:
        blocks.cover(seq, seq.num_computed_tokens + n)
    input_ids, positions, meta = runner.prepare(batch)
    logits = runner.model.compute_logits(runner.forward(input_ids, positions, meta))
    bounds = meta.query_start_loc.tolist()
    for seq, n in batch:
        seq.num_computed_tokens += n
    return [logits[a:b] for a, b in itertools.pairwise(bounds)]


def step_last_logits(runner: ModelRunner, blocks: Blocks, batch: list[tuple[Seq, int]]) -> torch.Tensor:
    """`ModelRunner.execute`: the last new token's logits per sequence; advance them."""
    for seq, n in batch:
        blocks.cover(seq, seq.num_computed_tokens + n)
    logits = runner.execute(batch)
    for seq, n in batch:
        seq.num_computed_tokens += n
    return logits


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _cpu_ops_model(path: Path) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The CPU fast path, as the engine runs it: the C attention kernel, the fused elementwise
    C ops and the projections from oneDNN-packed weights."""
    backend = select_backend("cpu")
    assert isinstance(backend, CpuAttention), "the CPU kernels did not build"
    model, cfg = load_model(path, backend=backend)
    model.use_cpu_ops(backend.lib)
    assert linear.pack(model) == 4 * cfg.num_layers + 1  # every projection and the lm_head
    return model, cfg


# Every test against HF runs twice: the plain PyTorch path (the reference) and the CPU one.
@pytest.fixture(scope="module", params=["plain", "cpu-ops"])
def loaded(
    tiny_model: TinyModel, request: pytest.FixtureRequest
) -> tuple[TinyModel, LlamaForCausalLM, ModelConfig]:
    if request.param == "plain":
        model, cfg = load_model(tiny_model.path, backend=TorchAttention())
    else:
        model, cfg = _cpu_ops_model(tiny_model.path)
    return tiny_model, model, cfg


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def test_config_from_hf(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig]) -> None:
    tiny, _, cfg = loaded
    hf = tiny.hf.config
    assert cfg.num_layers == hf.num_hidden_layers and cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.head_dim == 16 and cfg.vocab_size == 256
    assert cfg.attention_bias == (tiny.name == "qwen2-bias")
    assert cfg.tie_word_embeddings == (tiny.name == "llama3-rope")
    if tiny.name == "llama3-rope":
        assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None
        assert cfg.rope_scaling["rope_type"] == "llama3"
        # The scaling really changes the frequencies, so the comparisons below exercise it.
        plain = ModelConfig.from_dir(tiny.path)
        plain.rope_scaling = None
        assert not torch.allclose(rope_inv_freq(cfg), rope_inv_freq(plain))


def test_config_variants() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
    }
    # Older configs: rope_theta + rope_scaling with "type"; eos from generation_config.
    old = ModelConfig.from_hf(
        {**base, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": 2},
        {"eos_token_id": [2, 7]},
    )
    assert old.rope_scaling == {"rope_type": "linear", "factor": 2.0} and old.eos_token_ids == [2, 7]
    assert old.num_kv_heads == 2 and old.head_dim == 4
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope scaling"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    # Sliding windows are not implemented: the usable context is capped at the window.
    mistral = ModelConfig.from_hf(
        {**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}
    )
    assert mistral.max_position_embeddings == 64


# --------------------------------------------------------------------------------------------
# Tiny models vs HF, position by position
# --------------------------------------------------------------------------------------------

PROMPT_LEN = 70  # past llama3-rope's original_max_position_embeddings (64)


def test_whole_prompt_prefill(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig]) -> None:
    tiny, model, cfg = loaded
    ids = prompt(PROMPT_LEN, seed=1)
    runner, blocks = make_runner(model, cfg, block_size=16)
    (ours,) = step_all_logits(runner, blocks, [(Seq(ids), len(ids))])
    torch.testing.assert_close(ours, hf_logits(tiny.hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig], block_size: int) -> None:
    tiny, model, cfg = loaded
    ids = prompt(PROMPT_LEN, seed=2)
    runner, blocks = make_runner(model, cfg, block_size)
    seq = Seq(ids)
    chunks = [
        step_all_logits(runner, blocks, [(seq, min(3, len(ids) - c))])[0] for c in range(0, len(ids), 3)
    ]
    torch.testing.assert_close(torch.cat(chunks), hf_logits(tiny.hf, ids), atol=ATOL, rtol=0)


def test_decode_steps(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig]) -> None:
    tiny, model, cfg = loaded
    ids = prompt(PROMPT_LEN, seed=3)
    runner, blocks = make_runner(model, cfg, block_size=4)
    seq = Seq(ids)
    first = step_last_logits(runner, blocks, [(seq, 5)])
    rest = [step_last_logits(runner, blocks, [(seq, 1)]) for _ in range(len(ids) - 5)]
    ref = hf_logits(tiny.hf, ids)
    torch.testing.assert_close(first[0], ref[4], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(rest), ref[5:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batches(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig], block_size: int) -> None:
    """Decodes and prefill chunks share steps: A and C first prefill part of their prompts
    together, then feed the rest one token per step (decode) while B prefills in chunks of 7;
    every position of every sequence is compared."""
    tiny, model, cfg = loaded
    a, b, c = Seq(prompt(40, seed=4)), Seq(prompt(45, seed=5)), Seq(prompt(60, seed=6))
    runner, blocks = make_runner(model, cfg, block_size)
    got: dict[int, list[torch.Tensor]] = {id(s): [] for s in (a, b, c)}

    def run(batch: list[tuple[Seq, int]]) -> None:
        for (seq, _), logits in zip(batch, step_all_logits(runner, blocks, batch), strict=True):
            got[id(seq)].append(logits)

    run([(a, 12), (c, 50)])
    while any(s.num_computed_tokens < len(s.token_ids) for s in (a, b, c)):
        batch = [(s, 1) for s in (a, c) if s.num_computed_tokens < len(s.token_ids)]  # decodes first
        if b.num_computed_tokens < len(b.token_ids):
            batch.append((b, min(7, len(b.token_ids) - b.num_computed_tokens)))
        run(batch)
    for seq in (a, b, c):
        torch.testing.assert_close(
            torch.cat(got[id(seq)]), hf_logits(tiny.hf, seq.token_ids), atol=ATOL, rtol=0
        )


def test_execute_returns_last_token_logits(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig]) -> None:
    tiny, model, cfg = loaded
    a, b = Seq(prompt(9, seed=7)), Seq(prompt(30, seed=8))
    runner, blocks = make_runner(model, cfg, block_size=4)
    step_last_logits(runner, blocks, [(a, 8)])
    out = step_last_logits(runner, blocks, [(a, 1), (b, 30)])
    assert out.dtype == torch.float32 and out.shape == (2, cfg.vocab_size)
    torch.testing.assert_close(out[0], hf_logits(tiny.hf, a.token_ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(tiny.hf, b.token_ids)[-1], atol=ATOL, rtol=0)


def test_last_layer_runs_sampled_rows_only(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig]) -> None:
    """`execute` asks the model for the sampled rows only; the CPU fast path then runs the last
    layer's o_proj and MLP on those rows alone, and their logits equal the every-row forward's."""
    _, model, cfg = loaded
    fresh = [Seq(prompt(20, seed=11)), Seq(prompt(33, seed=12))]
    runner, blocks = make_runner(model, cfg, block_size=4)
    rows: list[int] = []
    down = model.model.layers[-1].mlp.down_proj
    hook = down.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
    try:
        got = step_last_logits(runner, blocks, [(seq, len(seq.token_ids)) for seq in fresh])
    finally:
        hook.remove()
    assert rows == [2 if model.cpu_ops is not None else 53]
    again = [Seq(seq.token_ids) for seq in fresh]
    runner, blocks = make_runner(model, cfg, block_size=4)
    every = step_all_logits(runner, blocks, [(seq, len(seq.token_ids)) for seq in again])
    torch.testing.assert_close(got, torch.stack([logits[-1] for logits in every]), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------
# Greedy decoding vs HF generate
# --------------------------------------------------------------------------------------------

TIE_GAP = 1e-3  # HF top-1/top-2 logit gaps below this may flip under another summation order


@dataclass(slots=True)
class Comparison:
    compared: int = 0  # positions whose tokens had to match
    cut: int = 0  # prompts where a near-tie in HF's logits ended the comparison early
    max_logprob_diff: float = 0.0  # over HF's top-5 tokens at compared positions


def greedy(runner: ModelRunner, blocks: Blocks, prompts: list[list[int]], steps: list[int]):
    """Greedy-decode all prompts as one continuous batch (sequences leave when done);
    returns the new tokens and the fp32 logits they were picked from, per prompt."""
    seqs = [Seq(list(p)) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        batch = [(seqs[i], len(seqs[i].token_ids) - seqs[i].num_computed_tokens) for i in live]
        out = step_last_logits(runner, blocks, batch)
        for i, row in zip(live, out, strict=True):
            tok = int(row.argmax())
            tokens[i].append(tok)
            logits[i].append(row)
            seqs[i].token_ids.append(tok)
        live = [i for i in live if len(tokens[i]) < steps[i]]
    return tokens, logits


Reference = tuple[list[int], list[torch.Tensor]]  # HF's greedy tokens and their raw logits


@torch.inference_mode()
def hf_greedy(hf: torch.nn.Module, prompts: list[list[int]], max_new: int) -> list[Reference]:
    """HF `generate`, greedy, one prompt at a time (no padding to perturb the numerics), for
    exactly `max_new` tokens (the comparison wants every position, also past an EOS)."""
    config = GenerationConfig(
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=[],  # never stop at EOS: HF then generates exactly max_new tokens
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        refs.append((out.sequences[0, len(p) :].tolist(), [x[0].float() for x in out.logits]))
    return refs


def compare_greedy(
    runner: ModelRunner, blocks: Blocks, prompts: list[list[int]], refs: list[Reference]
) -> Comparison:
    """Our greedy tokens must equal HF's up to the first position where HF's own top-1/top-2
    logit gap is below TIE_GAP; there the comparison of that prompt stops."""
    tokens, logits = greedy(runner, blocks, prompts, [len(ref) for ref, _ in refs])
    result = Comparison()
    for (ref, ref_logits), ours, our_logits in zip(refs, tokens, logits, strict=True):
        for pos, (want, hf_row) in enumerate(zip(ref, ref_logits, strict=True)):
            top2 = hf_row.topk(2).values
            if float(top2[0] - top2[1]) < TIE_GAP:
                result.cut += 1
                break
            assert ours[pos] == want, f"position {pos}: {ours[pos]} != HF {want}; ours {ours}, HF {ref}"
            result.compared += 1
            top5 = hf_row.topk(5).indices
            diff = (hf_row.log_softmax(-1)[top5] - our_logits[pos].log_softmax(-1)[top5]).abs().max()
            result.max_logprob_diff = max(result.max_logprob_diff, float(diff))
    return result


def test_greedy_matches_hf_generate(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig]) -> None:
    tiny, model, cfg = loaded
    prompts = [prompt(n, seed=10 + n) for n in (3, 17, 40)]
    runner, blocks = make_runner(model, cfg, block_size=4)
    result = compare_greedy(runner, blocks, prompts, hf_greedy(tiny.hf, prompts, max_new=32))
    print(
        f"{tiny.name}: compared {result.compared} positions ({result.cut} cut at near-ties), "
        f"max top-5 logprob diff {result.max_logprob_diff:.2e}"
    )
    assert result.compared >= 32
    assert result.max_logprob_diff < 1e-3


# --------------------------------------------------------------------------------------------
# The bundled SmolLM2 (GGUF and converted HF directory) vs HF generate
# --------------------------------------------------------------------------------------------

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a five year old.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
]
TEXTS = [
    "def fibonacci(n):\n    ",
    "The history of the Roman Empire began",
    "Q: How many legs does a spider have?\nA:",
]
MAX_NEW = 64


def chat(question: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@dataclass(slots=True)
class SmolLM2:
    hf_dir: Path  # the GGUF converted by transformers (tokenmill.modelstore)
    prompts: list[list[int]]
    refs: list[Reference]  # HF generate on hf_dir
    ours: dict[str, tuple[LlamaForCausalLM, ModelConfig]]  # our loader: "gguf", "hf-dir"


@pytest.fixture(scope="module")
def smollm2(model_cache: Path) -> SmolLM2:
    from tokenizers import Tokenizer

    torch.set_num_threads(2)
    hf_dir = resolve_model("bundled:smollm2", model_cache)
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    texts = [chat(q) for q in QUESTIONS] + TEXTS
    prompts = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    refs = hf_greedy(hf, prompts, MAX_NEW)
    del hf
    ours = {
        "gguf": load_model(bundled_path("smollm2"), backend=TorchAttention()),
        "hf-dir": load_model(hf_dir, backend=TorchAttention()),
        "hf-dir-cpu-ops": _cpu_ops_model(hf_dir),
    }
    return SmolLM2(hf_dir, prompts, refs, ours)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["gguf", "hf-dir", "hf-dir-cpu-ops"])
def test_smollm2_greedy_matches_hf(smollm2: SmolLM2, source: str) -> None:
    model, cfg = smollm2.ours[source]
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2]
    n = len(smollm2.prompts)
    runner, blocks = make_runner(model, cfg, block_size=16, num_blocks=n * (MAX_NEW + 80) // 16)
    result = compare_greedy(runner, blocks, smollm2.prompts, smollm2.refs)
    print(
        f"SmolLM2 ({source}): compared {result.compared} of {n * MAX_NEW} positions "
        f"({result.cut} prompts cut at near-ties), max top-5 logprob diff {result.max_logprob_diff:.2e}"
    )
    assert result.compared >= n * MAX_NEW // 2
    assert result.max_logprob_diff < 1e-3


@pytest.mark.slow
def test_gguf_weights_equal_transformers_conversion(smollm2: SmolLM2) -> None:
    """Our GGUF path (dequantize + undo llama.cpp's q/k permutation) gives exactly the weights
    transformers' own GGUF loader produced for the converted directory."""
    ours = smollm2.ours["gguf"][0].state_dict()
    ref = smollm2.ours["hf-dir"][0].state_dict()
    assert ours.keys() == ref.keys()
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name


def test_unpermute_qk_inverts_llama_cpp_permute() -> None:
    """llama.cpp's convert_hf_to_gguf.py permute, written out, is undone by unpermute_qk."""
    heads, head_dim, cols = 3, 8, 5
    w = torch.randn(heads * head_dim, cols)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, heads), w)


# --------------------------------------------------------------------------------------------
# KV cache sizing
# --------------------------------------------------------------------------------------------


def test_kv_cache_budget_and_layout(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig]) -> None:
    _, _, cfg = loaded
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    assert block_bytes(cfg, 16, torch.float32) == per_block
    assert block_bytes(cfg, 16, torch.bfloat16) == per_block // 2
    assert kv_budget_bytes("cpu", cpu_gib=0.5) == 2**29
    assert num_blocks_for_budget(cfg, 16, torch.float32, 10 * per_block + 1) == 10
    caches = allocate_kv_cache(cfg, 10, 16, torch.float32, "cpu")
    assert len(caches) == cfg.num_layers
    for k, v in caches:
        assert k.shape == v.shape == (10, 16, cfg.num_kv_heads, cfg.head_dim)
        assert k.is_contiguous() and not k.any()
    caches[0][0].fill_(1)  # views of one allocation, but never of each other
    assert not caches[0][1].any() and not caches[1][0].any()


def test_load_model_errors(tiny_model: TinyModel, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected an HF model directory"):
        load_model(tmp_path)
    # A checkpoint missing a tensor is refused rather than run with uninitialised weights.
    from safetensors.torch import load_file, save_file

    weights = load_file(tiny_model.path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    (tmp_path / "config.json").write_bytes((tiny_model.path / "config.json").read_bytes())
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights"):
        load_model(tmp_path)


def test_explicit_backend_is_used(loaded: tuple[TinyModel, LlamaForCausalLM, ModelConfig]) -> None:
    tiny, _, _ = loaded
    backend = TorchAttention()
    model, _ = load_model(tiny.path, backend=backend)
    assert all(layer.self_attn.backend is backend for layer in model.model.layers)


def test_sharded_checkpoint(tiny_model: TinyModel, tmp_path: Path) -> None:
    tiny_model.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded, _ = load_model(tmp_path)
    single, _ = load_model(tiny_model.path)
    for (name, a), b in zip(sharded.state_dict().items(), single.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
