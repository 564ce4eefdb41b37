"""Multi-LoRA in the engine against HF + PEFT with the adapter merged into the weights.

Two random PEFT adapters (different projections, ranks, alphas; one rsLoRA with an
alpha_pattern) run in one batch with a request that uses none; each request must produce the
tokens (and, on the tiny Llama, the logprobs) of its own merged model. Then: slots and their
LRU eviction, the prefix cache keyed by adapter, on-demand loading and refused adapters.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.engine.conftest import TinyModel
from tests.engine.test_engine import _byte_tokenizer
from tokenmill.modelstore import resolve_model
from workers.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from workers.engine.config import ModelConfig
from workers.engine.lora import AdapterBusy, AdapterError, LoraAdapter, load_adapter
from workers.engine.lora_slots import AdapterSlots

LLAMA = pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)

# name -> (target modules, rank, alpha, extra LoraConfig arguments)
ADAPTERS = {
    "A": (["q_proj", "v_proj", "down_proj"], 4, 8, {}),
    "B": (
        ["k_proj", "o_proj", "gate_proj", "up_proj"],
        8,
        16,
        {"use_rslora": True, "alpha_pattern": {"o_proj": 4}},
    ),
}


@dataclass(slots=True)
class Reference:
    path: Path  # the PEFT directory
    merged: torch.nn.Module  # HF model with the adapter merged into its weights


def make_adapters(hf: torch.nn.Module, root: Path, std: float) -> dict[str, Reference]:
    """Save ADAPTERS as PEFT directories with random A and B (PEFT initialises B to zero),
    and merge each into a copy of `hf` as the reference."""
    from peft import LoraConfig, get_peft_model

    refs = {}
    for i, (name, (targets, rank, alpha, extra)) in enumerate(ADAPTERS.items()):
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **extra)
        model = get_peft_model(copy.deepcopy(hf), config)
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        path = root / name
        model.save_pretrained(path)
        refs[name] = Reference(path, model.merge_and_unload().eval())
    return refs


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, one full forward per token (no cache to get wrong)."""
    ids, logprobs = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt) :], logprobs


def run(
    engine: LLMEngine, requests: list[tuple[list[int], str | None]], params: SamplingParams
) -> dict[str, tuple[list[int], list[float]]]:
    """Every request to completion, all added before the first step (so they share batches)."""
    for i, (prompt, adapter) in enumerate(requests):
        engine.add_request(str(i), prompt, params, adapter_id=adapter)
    out: dict[str, tuple[list[int], list[float]]] = {str(i): ([], []) for i in range(len(requests))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprobs or [])
    return out


def prompts(n: int, length: int, vocab: int = 256, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + 3 * i,), generator=gen).tolist() for i in range(n)]


@dataclass(slots=True)
class Tiny:
    path: Path
    hf: torch.nn.Module
    refs: dict[str, Reference]

    def engine(self, **config: object) -> LLMEngine:
        options = {"max_loras": 2, "max_lora_rank": 8, "num_blocks": 64} | config
        engine = LLMEngine(EngineConfig(model=str(self.path), **options))  # type: ignore[arg-type]
        for name, ref in self.refs.items():
            engine.add_adapter(ref.path, name)
        return engine


@pytest.fixture(scope="module")
def tiny(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    _byte_tokenizer(tiny_model.path)
    refs = make_adapters(tiny_model.hf, tmp_path_factory.mktemp("adapters"), std=0.1)
    return Tiny(tiny_model.path, tiny_model.hf, refs)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


@LLAMA
def test_mixed_batch_matches_peft_merged(tiny: Tiny) -> None:
    """Adapter A, adapter B and no adapter in one batch: each equals its merged HF model."""
    ps = prompts(4, 20)
    requests = [(ps[0], "A"), (ps[1], "B"), (ps[2], None), (ps[3], "A")]
    engine = tiny.engine()
    groups: list[set[int]] = []
    execute = engine.runner.execute

    def spy(batch: list) -> torch.Tensor:
        logits = execute(batch)
        lora_batch = engine.runner.lora.batch  # type: ignore[union-attr]
        groups.append(set() if lora_batch is None else {slot for slot, _ in lora_batch.groups})
        return logits

    engine.runner.execute = spy  # type: ignore[method-assign]
    got = run(engine, requests, GREEDY)
    # One step ran both adapters' tokens and plain tokens together.
    assert groups[0] == {engine.adapters.slot_of("A"), engine.adapters.slot_of("B")}  # type: ignore[union-attr]
    assert engine.stats.steps == GREEDY.max_tokens
    base_tokens = hf_greedy(tiny.hf, ps[0], 8)[0]
    for i, (prompt, adapter) in enumerate(requests):
        model = tiny.hf if adapter is None else tiny.refs[adapter].merged
        tokens, logprobs = hf_greedy(model, prompt, GREEDY.max_tokens)
        assert got[str(i)][0] == tokens, (i, adapter)
        torch.testing.assert_close(torch.tensor(got[str(i)][1]), torch.tensor(logprobs), atol=1e-4, rtol=0)
    assert got["0"][0] != base_tokens  # the adapter changes what the model says


@LLAMA
def test_triton_lora_backend_gives_the_same_tokens(tiny: Tiny) -> None:
    """The SGMV kernels wired into the engine (under the interpreter here) match PyTorch."""
    ps = prompts(3, 18, seed=7)
    requests = [(ps[0], "B"), (ps[1], None), (ps[2], "A")]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    torch_tokens = run(tiny.engine(lora_backend="torch"), requests, params)
    triton_tokens = run(tiny.engine(lora_backend="triton"), requests, params)
    assert triton_tokens == torch_tokens


@LLAMA
def test_one_slot_swaps_adapters_lru(tiny: Tiny) -> None:
    """With one slot, A and B requests take turns (never both running) and stay correct."""
    ps = prompts(3, 20, seed=9)
    requests = [(ps[0], "A"), (ps[1], "B"), (ps[2], "A")]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = run(tiny.engine(), requests, params)
    engine = tiny.engine(max_loras=1)
    for i, (prompt, adapter) in enumerate(requests):
        engine.add_request(str(i), prompt, params, adapter_id=adapter)
    got: dict[str, list[int]] = {str(i): [] for i in range(3)}
    order = []
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.token_ids
        running = {s.adapter_id for s in engine.scheduler.running}
        assert len(running) <= 1
        order += [a for a in running if not order or order[-1] != a]
    assert got == {k: v[0] for k, v in want.items()}
    assert order == ["A", "B"]  # both A requests ran first (the second went ahead of B), then B
    assert engine.adapters.resident == ["B"]  # type: ignore[union-attr]
    assert engine.adapter_ids == ("A", "B")  # both stay loaded on the CPU


@LLAMA
def test_preemption_and_swapping_keep_the_tokens(tiny: Tiny) -> None:
    """A pool too small for the batch (preemption by recompute) and one slot for two adapters
    (sequences wait for it, later ones go ahead): the same tokens as a roomy engine."""
    ps = prompts(6, 24, seed=13)
    requests = list(zip(ps, ["A", "B", None, "B", "A", None], strict=True))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = run(tiny.engine(), requests, params)
    small = tiny.engine(max_loras=1, num_blocks=8)
    assert run(small, requests, params) == want
    assert small.scheduler.preemptions > 0


@LLAMA
def test_llm_generate_takes_adapters(tiny: Tiny) -> None:
    llm = LLM(str(tiny.path), num_blocks=32, max_loras=2, max_lora_rank=8)
    llm.add_adapter("B", str(tiny.refs["B"].path))
    prompt = prompts(1, 20, seed=17)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with_b, plain = llm.generate([prompt, prompt], params, adapters=["B", None])
    assert with_b.outputs[0].token_ids == hf_greedy(tiny.refs["B"].merged, prompt, 4)[0]
    assert plain.outputs[0].token_ids == hf_greedy(tiny.hf, prompt, 4)[0]


@LLAMA
def test_prefix_cache_is_keyed_by_adapter(tiny: Tiny) -> None:
    engine = tiny.engine()
    prompt = prompts(1, 40, seed=11)[0]  # two full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def cached(adapter: str | None) -> int:
        rid = f"r{time.monotonic_ns()}"
        engine.add_request(rid, prompt, params, adapter_id=adapter)
        hits = 0
        while engine.has_unfinished():
            for o in engine.step():
                hits = o.cached_tokens
        return hits

    assert cached("A") == 0
    assert cached(None) == 0  # same tokens, no adapter: a different cache key
    assert cached("B") == 0
    assert cached("A") == 32  # A's own blocks are found again
    assert cached(None) == 32


@LLAMA
def test_on_demand_loading_and_refusals(tiny: Tiny, tmp_path: Path) -> None:
    asked: list[str] = []

    def loader(adapter_id: str) -> Path:
        asked.append(adapter_id)
        if adapter_id not in tiny.refs:
            raise FileNotFoundError(f"no adapter {adapter_id}")
        return tiny.refs[adapter_id].path

    config = EngineConfig(model=str(tiny.path), num_blocks=16, max_loras=1, max_lora_rank=8)
    engine = LLMEngine(config, adapter_loader=loader)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params, adapter_id="B")
    assert asked == ["B"] and engine.adapter_ids == ("B",)
    with pytest.raises(AdapterError, match="cannot be found"):
        engine.add_request("b", [5, 6, 7], params, adapter_id="nope")
    with pytest.raises(AdapterBusy):  # request "a" still uses it
        engine.remove_adapter("B")
    while engine.has_unfinished():
        engine.step()
    engine.remove_adapter("B")
    assert engine.adapter_ids == ()
    with pytest.raises(AdapterError, match="not loaded"):
        engine.remove_adapter("B")

    plain = LLMEngine(EngineConfig(model=str(tiny.path), num_blocks=16))  # LoRA off
    with pytest.raises(AdapterError, match="max_loras"):
        plain.add_request("c", [5, 6, 7], params, adapter_id="A")
    with pytest.raises(AdapterError, match="rank 8 exceeds"):
        LLMEngine(
            EngineConfig(model=str(tiny.path), num_blocks=16, max_loras=1, max_lora_rank=4)
        ).add_adapter(tiny.refs["B"].path, "B")


# --- loading PEFT files ---------------------------------------------------------------------

CFG = ModelConfig.from_hf(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 24,
    }
)
STEM = "base_model.model.model.layers.{}.self_attn.{}"


def write(path: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4} | config)
    )
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_load_adapter_scaling_and_naming(tmp_path: Path) -> None:
    a, b = torch.randn(2, 16), torch.randn(16, 2)
    tensors = {
        STEM.format(0, "q_proj.lora_A.default.weight"): a,  # older PEFT keeps the adapter name
        STEM.format(0, "q_proj.lora_B.default.weight"): b,
        STEM.format(1, "o_proj.lora_A.weight"): a.clone(),
        STEM.format(1, "o_proj.lora_B.weight"): b.clone(),
    }
    plain = load_adapter(write(tmp_path / "p", {}, tensors), CFG, adapter_id="p", max_rank=8)
    assert plain.target_modules == ["q_proj", "o_proj"] and plain.rank == 2
    torch.testing.assert_close(plain.weights[(0, "q_proj")][1], b * 2)  # alpha / r
    rs = load_adapter(
        write(tmp_path / "r", {"use_rslora": True, "alpha_pattern": {"o_proj": 8}}, tensors),
        CFG,
        adapter_id="r",
        max_rank=8,
    )
    torch.testing.assert_close(rs.weights[(0, "q_proj")][1], b * 4 / 2**0.5)
    torch.testing.assert_close(rs.weights[(1, "o_proj")][1], b * 8 / 2**0.5)
    # fan_in_fan_out with the pair written transposed (as for a Conv1D base) is turned back.
    flipped = {k: v.T.contiguous() for k, v in tensors.items()}
    ff = load_adapter(
        write(tmp_path / "f", {"fan_in_fan_out": True}, flipped), CFG, adapter_id="f", max_rank=8
    )
    torch.testing.assert_close(ff.weights[(0, "q_proj")][0], a)


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"use_dora": True}, None, "use_dora"),
        ({"peft_type": "IA3"}, None, "only LoRA"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({}, {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 16)}, "not a LoRA weight"),
        ({}, {STEM.format(0, "q_proj.lora_A.weight"): torch.zeros(2, 16)}, "in pairs"),
        (
            {},
            {
                STEM.format(5, "q_proj.lora_A.weight"): torch.zeros(2, 16),
                STEM.format(5, "q_proj.lora_B.weight"): torch.zeros(16, 2),
            },
            "2 layers",
        ),
        (
            {},
            {
                STEM.format(0, "k_proj.lora_A.weight"): torch.zeros(2, 16),
                STEM.format(0, "k_proj.lora_B.weight"): torch.zeros(16, 2),
            },
            "do not fit",
        ),
        (
            {},
            {
                STEM.format(0, "q_proj.lora_A.weight"): torch.zeros(9, 16),
                STEM.format(0, "q_proj.lora_B.weight"): torch.zeros(16, 9),
            },
            "exceeds",
        ),
    ],
)
def test_load_adapter_refuses(
    tmp_path: Path, config: dict[str, object], tensors: dict[str, torch.Tensor] | None, message: str
) -> None:
    tensors = tensors or {
        STEM.format(0, "q_proj.lora_A.weight"): torch.zeros(2, 16),
        STEM.format(0, "q_proj.lora_B.weight"): torch.zeros(16, 2),
    }
    with pytest.raises(AdapterError, match=message):
        load_adapter(write(tmp_path, config, tensors), CFG, adapter_id="x", max_rank=8)


# --- slots ----------------------------------------------------------------------------------


def fake(adapter_id: str, rank: int, value: float, modules: tuple[str, ...] = ("q_proj",)) -> LoraAdapter:
    shapes = {"q_proj": (16, 16), "k_proj": (16, 8), "down_proj": (24, 16)}
    weights = {
        (layer, m): (torch.full((rank, shapes[m][0]), value), torch.full((shapes[m][1], rank), value))
        for layer in range(2)
        for m in modules
    }
    return LoraAdapter(adapter_id, rank, weights)


def test_slots_lru_and_pins() -> None:
    slots = AdapterSlots(CFG, max_loras=2, max_rank=16, max_cpu_loras=3)
    none: set[str] = set()
    for i, name in enumerate("abc"):
        slots.add(fake(name, 2, i + 1.0), lambda: none)
    assert slots.ids == ("a", "b", "c") and slots.resident == []
    assert slots.acquire("a", lambda: none) and slots.acquire("b", lambda: none)
    assert not slots.acquire("c", lambda: {"a", "b"})  # both slots run requests: c waits
    assert slots.acquire("c", lambda: {"b"})  # a is least recently used and idle: evicted
    assert slots.resident == ["b", "c"] and slots.slot_of("c") == 0  # a's old slot
    # The registry: a fourth adapter evicts the least recently used unused one (a), and only
    # that; when every one is in use, loading is refused.
    assert slots.add(fake("d", 2, 4.0), lambda: {"b"}) == ["a"]
    with pytest.raises(AdapterBusy):
        slots.add(fake("e", 2, 5.0), lambda: {"b", "c", "d"})
    with pytest.raises(AdapterBusy):
        slots.remove("c", lambda: {"c"})
    slots.remove("c", lambda: none)
    assert "c" not in slots and slots.resident == ["b"]


def test_slots_write_zero_and_grow() -> None:
    """A slot reused by an adapter of other projections has nothing left of the old one; a
    larger rank widens every stack and keeps what was there."""
    slots = AdapterSlots(CFG, max_loras=2, max_rank=32)
    none: set[str] = set()
    slots.add(fake("q", 2, 1.0, ("q_proj", "k_proj")), lambda: none)
    slots.add(fake("d", 2, 2.0, ("down_proj",)), lambda: none)
    slots.add(fake("big", 12, 3.0), lambda: none)
    assert slots.acquire("q", lambda: none) and slots.acquire("d", lambda: none)
    qkv = slots.stacks[1]["qkv_proj"]
    assert qkv.rank == 8 and qkv.a is not None and qkv.used == [True, False]
    # q's rank-2 A sits in rows 0..2 of slice 0 and 8..10 of slice 1, the rest is padding.
    assert qkv.a[0, :2].eq(1).all() and qkv.a[0, 2:8].eq(0).all() and qkv.a[0, 8:10].eq(1).all()
    assert slots.acquire("big", lambda: {"d"})  # evicts q (slot 0), grows the rank to 16
    assert qkv.rank == 16 and qkv.used == [True, False]
    assert qkv.a[0, :12].eq(3).all() and qkv.a[0, 12:].eq(0).all()  # k's slice cleared
    assert qkv.b[1][0].eq(0).all()
    down = slots.stacks[0]["down_proj"]
    assert down.a is not None and down.a[1, :2].eq(2).all() and down.a[1, 2:].eq(0).all()


# --- SmolLM2 ----------------------------------------------------------------------------------


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Two torch threads on two shared cores spin against other processes' work: a SmolLM2
    forward then takes seconds instead of a tenth of one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@torch.no_grad()
def hf_generate(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_smollm2_mixed_batch_matches_peft_merged(model_cache: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    hf_dir = resolve_model("bundled:smollm2", model_cache)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    refs = make_adapters(hf, tmp_path, std=0.05)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, there"]
    ps = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    requests = [(ps[0], "A"), (ps[1], "B"), (ps[2], None)]
    engine = LLMEngine(EngineConfig(model=str(hf_dir), num_blocks=16, max_loras=2, max_lora_rank=8))
    for name, ref in refs.items():
        engine.add_adapter(ref.path, name)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = run(engine, requests, params)
    for i, (prompt, adapter) in enumerate(requests):
        model = hf if adapter is None else refs[adapter].merged
        assert got[str(i)][0] == hf_generate(model, prompt, params.max_tokens), (i, adapter)
    # The adapters really change the text (else the comparison above proves little).
    for i, adapter in ((0, "A"), (1, "B")):
        assert hf_generate(hf, ps[i], params.max_tokens) != got[str(i)][0], adapter
