"""The vLLM worker (`tokenmill worker --engine vllm`) against a real vLLM: the CPU build in
.venv-vllm serving the converted SmolLM2 (conftest's session fixture `vllm_server`, one
server for the whole run).

The worker's app (workers.server.create_app) serves a `VllmGenerator` over real HTTP, as
tests/workers/test_worker.py does for the builtin engine: deltas with vLLM's counts, greedy
tokens equal to our engine's, stops, grammars, cached tokens per salt, load figures from
vLLM's /metrics in heartbeats, aborts on disconnect, adapters, the builtin worker's 400s, and
the worker process draining on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest

from tests.vllm_server import BLOCK_SIZE, MAX_LORA_RANK, RunningVllm
from tests.workers.test_worker import READY, _FakeBus, _start, _Stderr
from tokenmill.hashing import extra_keys, hash_blocks
from tokenmill.protocol import GenerateDelta, GenerateRequest, Grammar, Heartbeat, SamplingParams
from tokenmill.settings import Settings
from tokenmill.storage import LocalStorage
from tokenmill.tokenization import Tokenizer
from workers.adapters import AdapterFetcher
from workers.main import _beat, _Identity
from workers.server import RecentTtft, Traffic, WorkerInfo, create_app
from workers.vllm.generator import VllmFailed, VllmGenerator, _Logprobs, structured_outputs, wire_logprobs
from workers.vllm.kv_events import KvEventMapper
from workers.vllm.metrics import parse_figures
from workers.vllm.server import VllmServer, child_env, server_args
from workers.vllm.worker import vocab_size

pytestmark = pytest.mark.slow

TOKEN = "internal-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ORG = "org_vllm"


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("storage")


@pytest.fixture(scope="module")
async def generator(
    vllm_server: RunningVllm, storage: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VllmGenerator]:
    tokenizer = Tokenizer.from_dir(vllm_server.model_dir)
    gen = VllmGenerator(
        vllm_server.server,
        tokenizer,
        vocab_size=vocab_size(vllm_server.model_dir, tokenizer),
        fetch_adapter=AdapterFetcher(lambda: LocalStorage(storage), tmp_path_factory.mktemp("adapters")),
        kv_events=KvEventMapper(vllm_server.server.kv_events_endpoint or "", vllm_server.settings.block_size),
        poll_seconds=0.2,
    )
    background = asyncio.create_task(gen.run())  # vLLM's figures, its KV events, the child watch
    yield gen
    background.cancel()
    await asyncio.gather(background, return_exceptions=True)
    await gen.aclose()  # not close(): the server is the session's


@pytest.fixture(scope="module")
def traffic() -> Traffic:
    """The worker's request counts (its heartbeats' `arrived` and `finished`)."""
    return Traffic()


@pytest.fixture(scope="module")
async def worker_url(
    generator: VllmGenerator, vllm_server: RunningVllm, traffic: Traffic
) -> AsyncIterator[str]:
    info = WorkerInfo("w-vllm", vllm_server.name, "dep-vllm")
    app = create_app(generator, token=TOKEN, info=info, traffic=traffic)
    url, server, task = await _start(app)
    yield url
    server.should_exit = True
    await task


@pytest.fixture
async def client(worker_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=worker_url, timeout=120) as c:
        yield c


def _chat(tok: Tokenizer, content: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]))


async def _generate(
    client: httpx.AsyncClient, prompt: list[int], *, salt: str | None = None, **sampling: Any
) -> tuple[list[GenerateDelta], str]:
    req = GenerateRequest(
        request_id="t", prompt_token_ids=prompt, sampling=SamplingParams(**sampling), cache_salt=salt
    )
    async with client.stream("POST", "/generate", content=msgspec.json.encode(req), headers=AUTH) as resp:
        assert resp.status_code == 200, await resp.aread()
        deltas = [msgspec.json.decode(line, type=GenerateDelta) async for line in resp.aiter_lines() if line]
    assert deltas[-1].error is None, deltas[-1].error
    return deltas, "".join(d.text for d in deltas)


async def _vllm(url: str, **body: Any) -> dict[str, Any]:
    """vLLM's own non-streaming /v1/completions answer."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        resp = await c.post("/v1/completions", json={"return_token_ids": True, **body})
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def _until(condition: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def _running_is(generator: VllmGenerator, n: int) -> Any:
    """A condition for `_until`: vLLM's /metrics, read now, shows `n` requests running. A poll
    that fails counts as not yet, as it does for the worker's poller (on a loaded CI machine one
    connect to vLLM once took over 5 s)."""

    async def check() -> bool:
        try:
            return (await generator.poll_metrics()).running == n
        except httpx.TransportError:
            return False

    return check


# --- generation --------------------------------------------------------------------------------


async def test_stream_has_vllms_tokens_and_counts(
    client: httpx.AsyncClient, generator: VllmGenerator, vllm_server: RunningVllm
) -> None:
    prompt = _chat(generator.tokenizer, "What is the capital of France?")
    deltas, text = await _generate(client, prompt, temperature=0, max_tokens=24)
    assert "Paris" in text and len(deltas) > 1  # streamed, token by token
    assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert [d.completion_tokens for d in deltas] == sorted(d.completion_tokens for d in deltas)
    last = deltas[-1]
    ids = [t for d in deltas for t in d.token_ids]
    assert last.completion_tokens == len(ids) and all(d.prompt_tokens == len(prompt) for d in deltas)

    ref = await _vllm(vllm_server.url, model=vllm_server.name, prompt=prompt, max_tokens=24, temperature=0)
    choice, usage = ref["choices"][0], ref["usage"]
    assert (ids, text, last.finish_reason) == (choice["token_ids"], choice["text"], choice["finish_reason"])
    assert (last.prompt_tokens, last.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


async def test_greedy_tokens_equal_our_engines(
    client: httpx.AsyncClient, generator: VllmGenerator, vllm_server: RunningVllm
) -> None:
    """Same weights, both fp32: greedy decoding agrees with the builtin engine (a few tokens:
    the two sum in different orders, so a near tie far out may go either way)."""
    from workers.engine import LLM
    from workers.engine import SamplingParams as EngineParams

    prompts = [
        _chat(generator.tokenizer, "Name three colours."),
        generator.tokenizer.encode("The quick brown fox"),
    ]
    llm = LLM(str(vllm_server.model_dir), kv_cache_gib=0.1)
    params = EngineParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    del llm  # its weights and KV cache: nothing else here needs them
    for prompt, expected in zip(prompts, ours, strict=True):
        deltas, _ = await _generate(client, prompt, temperature=0, max_tokens=8, ignore_eos=True)
        assert [t for d in deltas for t in d.token_ids] == expected


async def test_logprobs_per_token_id_and_logit_bias(
    client: httpx.AsyncClient, generator: VllmGenerator, vllm_server: RunningVllm
) -> None:
    """vLLM's logprobs come back as ours (per token id: its logprob and the k likeliest, best
    first), with our engine's values: raw logprobs of the same fp32 weights. A logit_bias of -100
    on the greedy first token makes vLLM pick another, while the logprobs stay the model's."""
    from workers.engine import LLM
    from workers.engine import SamplingParams as EngineParams

    prompt = _chat(generator.tokenizer, "What is the capital of France?")
    deltas, _ = await _generate(client, prompt, temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    assert len(deltas) > 1
    for d in deltas:
        assert d.logprobs is not None and d.top_logprobs is not None
        assert len(d.logprobs) == len(d.top_logprobs) == len(d.token_ids)
        for token, lp, top in zip(d.token_ids, d.logprobs, d.top_logprobs, strict=True):
            assert len(top) == 3 and top[0] == (token, pytest.approx(lp))  # greedy: the best one
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    ids = [t for d in deltas for t in d.token_ids]
    tops = [top for d in deltas for top in d.top_logprobs or []]

    llm = LLM(str(vllm_server.model_dir), kv_cache_gib=0.1)
    (ref,) = llm.generate([prompt], EngineParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    del llm
    ours = ref.outputs[0]
    assert ids == ours.token_ids and ours.top_logprobs is not None
    for got, want in zip(tops, ours.top_logprobs, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-3)

    # logprobs=0: the sampled token's logprob only.
    deltas, _ = await _generate(client, prompt, temperature=0, max_tokens=3, logprobs=0)
    assert all(d.logprobs is not None and len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert all(d.top_logprobs == [[] for _ in d.token_ids] for d in deltas)

    first = ids[0]
    deltas, _ = await _generate(
        client, prompt, temperature=0, max_tokens=3, logprobs=3, logit_bias={first: -100.0}
    )
    assert deltas[0].token_ids[0] == tops[0][1][0]  # the runner-up
    assert deltas[0].top_logprobs is not None and deltas[0].top_logprobs[0][0][0] == first  # raw
    # and the token vLLM sampled is reported with its own logprob, outside the top k or not
    assert deltas[0].logprobs is not None and deltas[0].logprobs[0] == pytest.approx(tops[0][1][1], abs=1e-4)


async def test_flex_requests_reach_vllm_at_batch_priority(
    client: httpx.AsyncClient, generator: VllmGenerator, vllm_server: RunningVllm
) -> None:
    """The worker starts vLLM scheduling by priority, so a flex request's priority reaches it
    (vLLM refuses any priority when it schedules first come, first served)."""
    prompt = _chat(generator.tokenizer, "What is the capital of France?")
    req = GenerateRequest(
        request_id="flex", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4), priority=1
    )
    assert generator.body(req, "x")["priority"] == 1
    async with client.stream("POST", "/generate", content=msgspec.json.encode(req), headers=AUTH) as resp:
        assert resp.status_code == 200, await resp.aread()
        deltas = [msgspec.json.decode(line, type=GenerateDelta) async for line in resp.aiter_lines() if line]
    assert deltas[-1].error is None and deltas[-1].completion_tokens == 4, deltas[-1]


async def test_stop_string(client: httpx.AsyncClient, generator: VllmGenerator) -> None:
    prompt = _chat(generator.tokenizer, "Tell me a short story about a cat.")
    _, full = await _generate(client, prompt, temperature=0, max_tokens=20, ignore_eos=True)
    words = full.split(" ")
    assert len(words) > 6, full
    stop = " " + words[5]
    deltas, text = await _generate(client, prompt, temperature=0, max_tokens=20, stop=[stop])
    assert deltas[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)] and stop not in text


async def test_json_schema_grammar_yields_valid_json(
    client: httpx.AsyncClient, generator: VllmGenerator
) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    prompt = _chat(generator.tokenizer, "Describe a person as JSON with a name and an age.")
    grammar = Grammar("json_schema", json.dumps(schema))
    deltas, text = await _generate(client, prompt, temperature=0, max_tokens=60, grammar=grammar)
    assert deltas[-1].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    assert '": ' in text and "\n" not in text  # our engine's layout, through llguidance's x-guidance


@pytest.mark.parametrize(
    ("kind", "spec", "pattern"),
    [
        ("regex", r"[0-9]{3}-[0-9]{4}", r"[0-9]{3}-[0-9]{4}"),
        ("lark", 'start: "yes" | "no"', r"yes|no"),
        ("json_object", "", r"\{.*"),
    ],
)
async def test_other_grammars(
    client: httpx.AsyncClient, generator: VllmGenerator, kind: str, spec: str, pattern: str
) -> None:
    prompt = _chat(generator.tokenizer, "Answer please.")
    deltas, text = await _generate(client, prompt, temperature=0, max_tokens=16, grammar=Grammar(kind, spec))
    assert re.fullmatch(pattern, text, re.DOTALL), text
    if kind == "json_object":  # a whole object, or one cut short by max_tokens
        assert deltas[-1].finish_reason == "length" or isinstance(json.loads(text), dict), text


async def test_cached_tokens_are_per_salt(client: httpx.AsyncClient, generator: VllmGenerator) -> None:
    """vLLM salts its prefix cache with the tenant's salt: a repeat hits, another tenant does not."""
    run = uuid.uuid4().hex
    prompt = generator.tokenizer.encode(f"Request {run}: " + "a long shared preamble of words " * 12)
    assert len(prompt) >= 64
    salt_a, salt_b = f"salt_a_{run}", f"salt_b_{run}"
    first, _ = await _generate(client, prompt, salt=salt_a, temperature=0, max_tokens=2)
    again, _ = await _generate(client, prompt, salt=salt_a, temperature=0, max_tokens=2)
    other, _ = await _generate(client, prompt, salt=salt_b, temperature=0, max_tokens=2)
    unsalted, _ = await _generate(client, prompt, temperature=0, max_tokens=2)
    assert first[-1].cached_tokens == 0
    cached = again[-1].cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached < len(prompt), cached
    assert other[-1].cached_tokens == 0 and unsalted[-1].cached_tokens == 0
    assert again[-1].prompt_tokens == len(prompt)


async def test_kv_events_carry_our_salted_hashes(client: httpx.AsyncClient, generator: VllmGenerator) -> None:
    """The blocks vLLM stores for a prompt come out as tokenmill.hashing's hashes, salted."""
    run = uuid.uuid4().hex
    prompt = generator.tokenizer.encode(f"Events {run}: " + "the blocks of this prompt are hashed " * 12)
    salt = f"salt_kv_{run}"
    generator.drain_kv_events()
    await _generate(client, prompt, salt=salt, temperature=0, max_tokens=2)
    expected = {h.hex() for h in hash_blocks(prompt, BLOCK_SIZE, extra_keys(salt, None))}
    stored: set[str] = set()

    async def published() -> bool:
        for op in generator.drain_kv_events():
            if op.op == "stored":
                stored.update(op.hashes)
        return expected <= stored

    await _until(published, 5, "the prompt's blocks in the KV events")
    assert len(expected) == len(prompt) // BLOCK_SIZE >= 2


# --- load: vLLM's /metrics in heartbeats and ours ------------------------------------------------


class _Capture:
    """A bus publisher that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def publish(self, stream: str, event: Any) -> str:
        self.events.append(event)
        return "0-0"

    async def close(self) -> None:
        pass


async def _long_stream(client: httpx.AsyncClient, prompt: list[int]) -> tuple[Any, Any]:
    """A streaming /generate far too long to finish during a test: (response, its lines)."""
    req = GenerateRequest(
        "long", prompt, SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True), cache_salt="s1"
    )
    ctx = client.stream("POST", "/generate", content=msgspec.json.encode(req), headers=AUTH)
    resp = await ctx.__aenter__()
    assert resp.status_code == 200
    return ctx, resp.aiter_lines()


async def test_heartbeats_and_metrics_carry_vllms_load(
    client: httpx.AsyncClient, generator: VllmGenerator, vllm_server: RunningVllm, traffic: Traffic
) -> None:
    ctx, lines = await _long_stream(client, _chat(generator.tokenizer, "Count to one thousand."))
    try:
        assert msgspec.json.decode(await anext(lines), type=GenerateDelta).token_ids
        await _until(_running_is(generator, 1), 30, "vLLM's running count to reach 1")
        assert generator.running == 1 and generator.kv_usage > 0 and generator.prefix_cache_queries > 0

        bus: Any = _Capture()  # what _beat uses of a publisher
        settings = Settings(heartbeat_seconds=0.05)
        identity = _Identity("w-vllm", "dep-vllm", "http://127.0.0.1:1", vllm_server.name)
        beat = asyncio.create_task(
            _beat(
                bus, settings, identity, generator, RecentTtft(), asyncio.Event(), generator, traffic=traffic
            )
        )

        def busy() -> list[Heartbeat]:
            return [e for e in bus.events if isinstance(e, Heartbeat) and e.running == 1]

        # A heartbeat carries the figures of the last poll of vLLM's /metrics (every 0.2 s
        # here); on a loaded machine one poll may read a gauge vLLM has not updated yet.
        try:
            await _until(_async(lambda: bool(busy())), 10, "a heartbeat with vLLM's running request")
        finally:
            beat.cancel()
        heartbeat = busy()[0]
        assert heartbeat.waiting == 0 and 0 < heartbeat.kv_usage < 1
        # Arrivals and ends are counted by the worker, as for our engine: the long one is open.
        assert heartbeat.arrived == traffic.arrived and heartbeat.arrived - heartbeat.finished == 1

        text = (await client.get("/metrics", headers=AUTH)).text
        model = vllm_server.name
        assert f'vllm:num_requests_running{{model_name="{model}"}} 1.0' in text
        assert (
            f'tokenmill_worker_requests_arrived_total{{model_name="{model}"}} {float(traffic.arrived)}'
            in text
        )
        hits = re.search(rf'vllm:prefix_cache_queries_total{{model_name="{model}"}} (\S+)', text)
        assert hits and float(hits.group(1)) == generator.prefix_cache_queries > 0
    finally:
        await ctx.__aexit__(None, None, None)


def _async(check: Any) -> Any:
    async def run() -> bool:
        return bool(check())

    return run


async def test_disconnect_aborts_in_vllm(client: httpx.AsyncClient, generator: VllmGenerator) -> None:
    idle = _running_is(generator, 0)
    await _until(idle, 30, "vLLM to be idle")
    ctx, lines = await _long_stream(client, _chat(generator.tokenizer, "Write a very long essay."))
    for _ in range(3):
        assert msgspec.json.decode(await anext(lines), type=GenerateDelta).token_ids
    await _until(_running_is(generator, 1), 30, "vLLM's running count to reach 1")
    await ctx.__aexit__(None, None, None)  # the client goes away
    # 4000 tokens would take many minutes here: back to 0 within seconds means vLLM aborted it.
    await _until(idle, 30, "vLLM to abort the request")


# --- adapters -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter(vllm_server: RunningVllm, storage: Path) -> str:
    """A PEFT LoRA for SmolLM2 (random, strong enough to change greedy output), stored as the
    control plane stores adapters."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32)
    config = LoraConfig(r=MAX_LORA_RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    adapter_id = "ad_vllm_test"
    model.save_pretrained(storage / "adapters" / ORG / adapter_id)
    return adapter_id


async def test_adapter_load_generate_unload(
    client: httpx.AsyncClient, generator: VllmGenerator, adapter: str
) -> None:
    prompt = _chat(generator.tokenizer, "Say hello.")
    base, _ = await _generate(client, prompt, temperature=0, max_tokens=8, ignore_eos=True)
    assert (await client.get("/adapters", headers=AUTH)).json() == {"adapters": []}
    resp = await client.post("/adapters", json={"id": adapter}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.json()["adapters"] == [adapter] and generator.adapters == [adapter]

    req = GenerateRequest(
        "a",
        prompt,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        adapter=adapter,
        adapter_key=f"adapters/{ORG}/{adapter}/",
    )
    resp = await client.post("/generate", content=msgspec.json.encode(req), headers=AUTH)
    deltas = [msgspec.json.decode(line, type=GenerateDelta) for line in resp.text.splitlines() if line]
    assert deltas[-1].finish_reason == "length", deltas[-1]
    tuned = [t for d in deltas for t in d.token_ids]
    assert len(tuned) == 8 and tuned != [t for d in base for t in d.token_ids]

    assert (await client.delete(f"/adapters/{adapter}", headers=AUTH)).json()["adapters"] == []
    # A request naming it loads it again from storage on demand (its key says where).
    resp = await client.post("/generate", content=msgspec.json.encode(req), headers=AUTH)
    again = [msgspec.json.decode(line, type=GenerateDelta) for line in resp.text.splitlines() if line]
    assert [t for d in again for t in d.token_ids] == tuned and generator.adapters == [adapter]
    missing = await client.post("/adapters", json={"id": "ad_nowhere"}, headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "adapter_not_found"


# --- errors: the builtin worker's -------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"prompt_token_ids": [5] * 9000}, "prompt_token_ids", "maximum context length is 8192"),
        ({"prompt_token_ids": [1, 49152]}, "prompt_token_ids", "token ids in [0, 49152)"),
        ({"prompt_token_ids": []}, "prompt_token_ids", "must not be empty"),
        ({"sampling": {"temperature": -1}}, "temperature", "temperature must be non-negative"),
        ({"sampling": {"top_p": 0}}, "top_p", "top_p must be in (0, 1]"),
        ({"sampling": {"grammar": {"kind": "json_schema", "spec": "{"}}}, "grammar", "invalid json_schema"),
        ({"sampling": {"logit_bias": {"49152": 5}}}, "logit_bias", "out of vocabulary (size 49152)"),
        ({"sampling": {"logit_bias": {"7": -100.5}}}, "logit_bias", "must be in [-100, 100]"),
    ],
)
async def test_bad_requests_get_the_builtin_workers_400(
    client: httpx.AsyncClient, change: dict[str, Any], param: str, message: str
) -> None:
    body = {"request_id": "bad", "prompt_token_ids": [1, 2, 3], **change}
    resp = await client.post("/generate", json=body, headers=AUTH)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and message in error["message"], error


async def test_openai_endpoint_of_the_worker(client: httpx.AsyncClient, vllm_server: RunningVllm) -> None:
    body = {
        "model": vllm_server.name,
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    resp = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["usage"]["completion_tokens"] <= 5 and out["choices"][0]["message"]["content"]


async def test_unreachable_vllm_fails_in_band_and_adapters_503(
    tmp_path: Path, vllm_server: RunningVllm
) -> None:
    """A vLLM that does not answer: the stream ends with an error delta (the gateway's view of
    a failed engine), an adapter load is a 503 (another worker may do)."""
    dead = VllmServer("http://127.0.0.1:9", vllm_server.name, 8192, None, True)
    tokenizer = Tokenizer.from_dir(vllm_server.model_dir)
    (tmp_path / "adapters" / ORG / "ad_x").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / "adapters" / ORG / "ad_x" / name).write_text("{}")
    gen = VllmGenerator(
        dead,
        tokenizer,
        vocab_size=49152,
        fetch_adapter=AdapterFetcher(lambda: LocalStorage(tmp_path), tmp_path / "cache"),
    )
    app = create_app(gen, token=TOKEN, info=WorkerInfo("w-dead", vllm_server.name))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            req = GenerateRequest("x", [1, 2, 3], SamplingParams(max_tokens=2))
            resp = await c.post("/generate", content=msgspec.json.encode(req), headers=AUTH)
            assert resp.status_code == 200
            last = msgspec.json.decode(resp.text.splitlines()[-1], type=GenerateDelta)
            assert last.finish_reason == "error" and "127.0.0.1:9" in (last.error or "")
            resp = await c.post("/adapters", json={"id": "ad_x"}, headers=AUTH)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "adapter_unavailable"
    finally:
        await gen.aclose()


# --- the worker process: `tokenmill worker --engine vllm` ------------------------------------------


@pytest.fixture
async def fake_bus() -> AsyncIterator[tuple[_FakeBus, str]]:
    bus = _FakeBus()
    url, server, task = await _start(bus.app)
    yield bus, f"{url}/internal/bus"
    server.should_exit = True
    await task


async def test_worker_process_on_vllm_drains_on_sigterm(
    fake_bus: tuple[_FakeBus, str], vllm_server: RunningVllm, model_cache: Path, tmp_path: Path
) -> None:
    """The CLI's worker on the shared vLLM (TOKENMILL_VLLM_URL): announces, beats with vLLM's
    load, serves, publishes KV events in our hashes, finishes in-flight streams on SIGTERM,
    departs; the vLLM server it did not start keeps running."""
    bus, bus_url = fake_bus
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") and k != "REDIS_URL"}
    env.update(
        TOKENMILL_BUS_URL=bus_url,
        TOKENMILL_INTERNAL_TOKEN=TOKEN,
        TOKENMILL_MODEL_CACHE=str(model_cache),
        TOKENMILL_HOME=str(tmp_path),
        TOKENMILL_HEARTBEAT_SECONDS="0.2",
        TOKENMILL_WORKER_ENGINE="vllm",
        TOKENMILL_BLOCK_SIZE=str(BLOCK_SIZE),
        TOKENMILL_VLLM_URL=vllm_server.url,
        TOKENMILL_VLLM_KV_EVENTS_ENDPOINT=vllm_server.server.kv_events_endpoint or "",
        PYTHONUNBUFFERED="1",
    )
    cmd = [sys.executable, "-m", "tokenmill.cli", "worker", "--model", "bundled:smollm2"]
    cmd += ["--deployment", "dep-v", "--worker-id", "w-vproc"]
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stderr=asyncio.subprocess.PIPE)
    stderr = _Stderr(proc.stderr)  # type: ignore[arg-type]
    try:
        match = READY.fullmatch(await asyncio.wait_for(stderr.ready, 120))
        assert match, stderr.lines[-1]
        _, address, model = match.groups()
        assert model == vllm_server.name
        await bus.wait_for(lambda: len(bus.of_type("heartbeat")) >= 1, 15)

        run = uuid.uuid4().hex
        # Long enough that the heartbeats' 0.2 s polls of vLLM's /metrics see it running on a
        # loaded CI machine: in one CI run no heartbeat showed a 40-token request within 10 s.
        tokens = 240
        tok = Tokenizer.from_dir(vllm_server.model_dir)
        prompt = tok.encode(f"Process {run}: " + "these words fill a few blocks " * 12)
        req = GenerateRequest(
            "p",
            prompt,
            SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
            cache_salt=f"s_{run}",
        )
        async with (
            httpx.AsyncClient(base_url=address, timeout=120) as c,
            c.stream("POST", "/generate", content=msgspec.json.encode(req), headers=AUTH) as resp,
        ):
            lines = resp.aiter_lines()
            first = msgspec.json.decode(await anext(lines), type=GenerateDelta)
            await bus.wait_for(lambda: any(b["running"] >= 1 for b in bus.of_type("heartbeat")), 30)
            proc.send_signal(signal.SIGTERM)
            rest = [msgspec.json.decode(line, type=GenerateDelta) async for line in lines if line]
        assert first.token_ids and rest[-1].finish_reason == "length" and rest[-1].completion_tokens == tokens

        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await bus.wait_for(lambda: bus.of_type("departure"), 5)
        assert bus.events[-1]["worker_id"] == "w-vproc" and bus.events[-1]["deployment_id"] == "dep-v"
        assert any(b["draining"] for b in bus.of_type("heartbeat"))
        expected = {h.hex() for h in hash_blocks(prompt, BLOCK_SIZE, extra_keys(f"s_{run}", None))}
        stored = {h for e in bus.kv for op, hashes in e["ops"] if op == "stored" for h in hashes}
        assert expected and expected <= stored
        assert vllm_server.server.exited() is None  # not the worker's to stop
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await stderr.task
        print("worker stderr:", *stderr.lines, sep="\n")  # shown by pytest on failure


# --- no vLLM needed: the flags, the environment, the figures -------------------------------------


def test_server_flags(tmp_path: Path) -> None:
    settings = Settings(block_size=32, prefix_caching=False, max_lora_rank=16, model_cache=tmp_path)
    args = server_args(
        settings,
        Path("/m"),
        "M",
        1234,
        "ipc:///x",
        {"tensor_parallel_size": 2, "max_loras": 2, "dtype": "float32"},
    )
    line = " ".join(args)
    assert "--model /m --served-model-name M --host 127.0.0.1 --port 1234 --block-size 32" in line
    assert "--enable-prompt-tokens-details" in args and "--no-enable-prefix-caching" in args
    assert "--tensor-parallel-size 2" in line and "--dtype float32" in line and "--max-loras 2" in line
    assert "--enable-lora" in args and "--max-lora-rank 16" in line  # LoRA on: the deployment set max_loras
    kv = json.loads(args[args.index("--kv-events-config") + 1])
    assert kv == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///x"}
    plain = server_args(settings, Path("/m"), "M", 1, "ipc:///x", {"enable_prefix_caching": True})
    assert "--enable-lora" not in plain and "--no-enable-prefix-caching" not in plain


def test_child_environment(tmp_path: Path) -> None:
    settings = Settings(kv_cache_gib=1.5, torch_threads=1, model_cache=tmp_path)
    base = {
        "PATH": "/bin",
        "TOKENMILL_INTERNAL_TOKEN": "secret",
        "PYTHONPATH": "/ours",
        "VLLM_CACHE_ROOT": "/x",
    }
    env = child_env(settings, base)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["VLLM_CACHE_ROOT"] == "/x"
    assert "TOKENMILL_INTERNAL_TOKEN" not in env and "PYTHONPATH" not in env and env["PATH"] == "/bin"
    assert child_env(settings, {})["VLLM_CACHE_ROOT"] == str(tmp_path / ".vllm")


def test_figures_from_vllms_metrics() -> None:
    text = """
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 320.0
"""
    f = parse_figures(text)
    assert (f.running, f.waiting, f.kv_usage) == (3, 4, 0.375)
    assert (f.prefix_cache_queries, f.prefix_cache_hits, f.spec_draft_tokens) == (640, 320, 0)


def test_logprobs_from_vllms_chunks() -> None:
    """vLLM's dict holds the sampled token first, then the top k: k + 1 entries when the
    sampled one is not among them (dropped from our top k), k when it is (sorted back)."""
    chunk = _Logprobs(
        token_logprobs=[-2.5, -0.1],
        top_logprobs=[
            {"token_id:9": -2.5, "token_id:4": -0.3, "token_id:7": -1.2},
            {"token_id:5": -0.1, "token_id:6": -3.0},
        ],
    )
    assert wire_logprobs([9, 5], chunk, 2) == ([-2.5, -0.1], [[(4, -0.3), (7, -1.2)], [(5, -0.1), (6, -3.0)]])
    assert wire_logprobs([9], _Logprobs([-2.5], [{"token_id:9": -2.5}]), 0) == ([-2.5], [[]])
    with pytest.raises(VllmFailed):
        wire_logprobs([9, 5], None, 2)
    with pytest.raises(VllmFailed):
        wire_logprobs([9], _Logprobs([-2.5], [{"Paris": -2.5}]), 0)


def test_grammars_as_vllm_structured_outputs() -> None:
    schema = structured_outputs("json_schema", '{"type": "object"}')["json"]
    assert schema["type"] == "object" and schema["x-guidance"]["key_separator"] == ": "
    own = {"type": "string", "x-guidance": {"whitespace_flexible": True}}
    assert structured_outputs("json_schema", json.dumps(own)) == {"json": own}  # theirs wins
    assert structured_outputs("regex", "a+") == {"regex": "a+"}
    assert structured_outputs("lark", 'start: "a"') == {"grammar": 'start: "a"'}
