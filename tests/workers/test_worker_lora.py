"""LoRA adapters on a worker: its /adapters API, on-demand loading by /generate from the
storage the control plane writes to, LRU eviction, and heartbeats listing what is loaded.

A tiny random Llama keeps this fast; the adapters are PEFT's own files, stored as the control
plane stores them (`adapters/<org>/<adapter id>/`).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch

from tests.engine.test_engine import _byte_tokenizer
from tests.engine.test_lora import Reference, hf_greedy, make_adapters
from tokenmill.protocol import GenerateDelta, GenerateRequest, Heartbeat, SamplingParams
from tokenmill.settings import Settings
from tokenmill.storage import LocalStorage
from workers.adapters import AdapterFetcher
from workers.engine import EngineConfig
from workers.generator import EngineGenerator
from workers.server import RecentTtft, WorkerInfo, create_app

TOKEN = "internal-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ORG = "org_1"
PROMPT = list(range(40, 60))


@dataclass(slots=True)
class World:
    model: Path
    hf: torch.nn.Module
    refs: dict[str, Reference]  # adapter id -> its PEFT files and merged reference
    storage: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(model)
    _byte_tokenizer(model)
    made = make_adapters(hf, tmp_path_factory.mktemp("peft"), std=0.1)
    refs = {"ad_a": made["A"], "ad_b": made["B"], "ad_c": made["A"]}  # ad_c: A's files again
    storage = tmp_path_factory.mktemp("storage")
    for adapter_id, ref in refs.items():
        folder = storage / "adapters" / ORG / adapter_id
        folder.mkdir(parents=True)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(ref.path / name, folder / name)
    return World(model, hf, refs, storage)


def _generator(world: World, cache: Path, process: bool = False, **lora: Any) -> EngineGenerator:
    options = {"max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": 2} | lora
    config = EngineConfig(model=str(world.model), num_blocks=32, **options)
    return EngineGenerator(
        config, fetch_adapter=AdapterFetcher(lambda: LocalStorage(world.storage), cache), process=process
    )


# The engine on a thread (the library's way) and in a process of its own (a served worker's):
# adapters are read here and handed over either way.
@pytest.fixture(params=[False, True], ids=["thread", "process"])
def generator(world: World, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[EngineGenerator]:
    gen = _generator(world, tmp_path, process=request.param)
    yield gen
    gen.close()


@pytest.fixture
async def client(generator: EngineGenerator) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(generator, token=TOKEN, info=WorkerInfo("w-lora", "tiny", "dep-lora"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker", headers=AUTH) as c:
        yield c


async def _generate(client: httpx.AsyncClient, **fields: Any) -> tuple[int, list[int], dict[str, Any]]:
    req = GenerateRequest(
        request_id="r",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        **fields,
    )
    resp = await client.post("/generate", content=msgspec.json.encode(req))
    if resp.status_code != 200:
        return resp.status_code, [], resp.json()["error"]
    deltas = [msgspec.json.decode(line, type=GenerateDelta) for line in resp.text.splitlines() if line]
    assert deltas[-1].finish_reason == "length", deltas[-1]
    return 200, [t for d in deltas for t in d.token_ids], {}


async def test_load_list_unload(client: httpx.AsyncClient, world: World) -> None:
    assert (await client.get("/adapters")).json() == {"adapters": []}
    # By id alone: the worker finds adapters/<org>/ad_a/ in its storage.
    resp = await client.post("/adapters", json={"id": "ad_a"})
    assert resp.status_code == 200, resp.text
    assert resp.json() | {"adapters": None} == {"id": "ad_a", "loaded": True, "evicted": [], "adapters": None}
    resp = await client.post("/adapters", json={"id": "ad_b", "key": f"adapters/{ORG}/ad_b/"})
    assert resp.json()["adapters"] == ["ad_a", "ad_b"]
    # Room for two: a third evicts the least recently used.
    resp = await client.post("/adapters", json={"id": "ad_c", "key": f"adapters/{ORG}/ad_c"})
    assert resp.json()["evicted"] == ["ad_a"] and resp.json()["adapters"] == ["ad_b", "ad_c"]
    resp = await client.delete("/adapters/ad_b")
    assert resp.status_code == 200 and resp.json()["adapters"] == ["ad_c"]
    resp = await client.delete("/adapters/ad_b")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "adapter_not_loaded"
    for body, code in (
        ({"id": "ad_zz"}, "adapter_not_found"),
        ({"id": "ad_a", "key": f"adapters/{ORG}/ad_b/"}, "invalid_adapter_key"),  # the key names another
        ({"id": "ad_a", "key": "models/smollm2"}, "invalid_adapter_key"),
    ):
        resp = await client.post("/adapters", json=body)
        assert resp.status_code in (400, 404) and resp.json()["error"]["code"] == code, resp.text
    assert (await client.post("/adapters", json={"key": "x"})).status_code == 400


async def test_generate_loads_on_demand(client: httpx.AsyncClient, world: World) -> None:
    """A request naming an adapter the worker has not loaded fetches it first; the output is the
    merged model's; a second adapter takes the one slot over once the first is idle."""
    for adapter_id in ("ad_b", "ad_a"):
        status, tokens, _ = await _generate(
            client, adapter=adapter_id, adapter_key=f"adapters/{ORG}/{adapter_id}/"
        )
        assert status == 200
        assert tokens == hf_greedy(world.refs[adapter_id].merged, PROMPT, 4)[0]
    assert (await client.get("/adapters")).json() == {"adapters": ["ad_b", "ad_a"]}
    status, tokens, _ = await _generate(client)  # and without one
    assert tokens == hf_greedy(world.hf, PROMPT, 4)[0]
    # What cannot be served is the caller's 400 (the gateway passes it on, no retry).
    status, _, err = await _generate(client, adapter="ad_zz")
    assert (status, err["code"], err["param"]) == (400, "adapter_not_found", "adapter")
    status, _, err = await _generate(client, adapter="ad_a", adapter_key=f"adapters/{ORG}/ad_c/")
    assert (status, err["code"]) == (400, "invalid_adapter_key")


async def test_concurrent_requests_share_one_load(
    client: httpx.AsyncClient, generator: EngineGenerator
) -> None:
    calls = []
    fetch = generator._fetch
    assert fetch is not None

    def counting(adapter_id: str, key: str | None) -> Path:
        calls.append(adapter_id)
        time.sleep(0.05)
        return fetch(adapter_id, key)

    generator._fetch = counting
    results = await asyncio.gather(*(_generate(client, adapter="ad_a") for _ in range(3)))
    assert [r[0] for r in results] == [200] * 3 and results[0][1] == results[1][1] == results[2][1]
    assert calls == ["ad_a"]


async def test_worker_without_lora_refuses_adapters(world: World, tmp_path: Path) -> None:
    gen = _generator(world, tmp_path, max_loras=0)
    try:
        app = create_app(gen, token=TOKEN, info=WorkerInfo("w-plain", "tiny"))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://worker", headers=AUTH
        ) as client:
            status, _, err = await _generate(client, adapter="ad_a")
            assert (status, err["param"]) == (400, "adapter") and "does not serve adapters" in err["message"]
            resp = await client.post("/adapters", json={"id": "ad_a"})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "adapters_disabled"
    finally:
        gen.close()


class _Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    async def publish(self, stream: str, event: Any) -> str:
        self.events.append(event)
        return str(len(self.events))

    async def close(self) -> None:
        pass


async def test_heartbeats_list_loaded_adapters(generator: EngineGenerator) -> None:
    from workers.main import _beat, _Identity

    await generator.load_adapter("ad_b", f"adapters/{ORG}/ad_b/")
    recorder = _Recorder()
    settings = Settings(heartbeat_seconds=0.01)
    identity = _Identity("w-lora", "dep-lora", "http://worker", "tiny")
    beat = asyncio.create_task(
        _beat(recorder, settings, identity, generator, RecentTtft(), asyncio.Event(), generator)  # type: ignore[arg-type]
    )
    try:
        for _ in range(200):
            if any(isinstance(e, Heartbeat) for e in recorder.events):
                break
            await asyncio.sleep(0.01)
    finally:
        beat.cancel()
    beats = [e for e in recorder.events if isinstance(e, Heartbeat)]
    assert beats and beats[0].adapters == ["ad_b"]


async def test_request_for_an_unloaded_adapter_loads_it(generator: EngineGenerator, world: World) -> None:
    """An adapter evicted between the server's `load_adapter` and the request reaching the
    engine: on a thread the engine fetches it itself; an engine process (whose fetcher here does
    not pickle) refuses it, and the generator loads it and sends the request again."""
    req = GenerateRequest(
        request_id="r",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        adapter="ad_a",
        adapter_key=f"adapters/{ORG}/ad_a/",
    )
    assert generator.adapters == []
    deltas = [d async for d in generator.generate(req)]
    assert [t for d in deltas for t in d.token_ids] == hf_greedy(world.refs["ad_a"].merged, PROMPT, 4)[0]
    assert generator.adapters == ["ad_a"]
