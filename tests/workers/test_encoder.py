"""The embed worker: the BERT encoder against HF `transformers` + sentence-transformers' pooling,
the batcher under concurrency, and `/embed` over real HTTP.

The reference is computed as sentence-transformers defines all-MiniLM-L6-v2 (modules.json:
Transformer, mean Pooling, Normalize), with HF's own tokenizer and model, so the whole path the
gateway and the worker take (our tokenizer, our encoder, our pooling) is checked end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch
import uvicorn
from litestar import Litestar

from tokenmill.modelstore import model_name, resolve_model
from tokenmill.protocol import EmbedRequest, EmbedResponse
from tokenmill.settings import BUNDLED_EMBED_MODEL
from tokenmill.tokenization import Tokenizer
from workers.encoder import EmbedBatcher, Encoder, InvalidInput, Pooling, is_embedding_model
from workers.server import WorkerInfo, create_app

pytestmark = pytest.mark.slow

TOKEN = "internal-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NAME = "all-MiniLM-L6-v2"

SHORT = "Hi"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    SHORT,
    "Tokenmill serves embeddings from a small batched encoder; Ünïcödé, 東京 and emoji 😀 too.",
    "A mill grinds grain into flour. " * 12,
    "What is the capital of France?",
]


def _long_text(tok: Tokenizer, target: int) -> str:
    """A text of about `target` tokens with [CLS] and [SEP] (distinct words, no repetition)."""
    words = [f"w{i} lorem ipsum" for i in range(target)]
    for n in range(len(words), 0, -1):
        text = " ".join(words[:n])
        if len(tok.encode(text, add_special_tokens=True)) <= target:
            return text
    raise AssertionError("unreachable")


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(model_cache: Path) -> Path:
    return resolve_model(BUNDLED_EMBED_MODEL, model_cache)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> Encoder:
    return Encoder(model_dir)


@pytest.fixture(scope="module")
def texts(tok: Tokenizer) -> list[str]:
    # One input right at the context length, so padding spans nearly the whole position table.
    return [*TEXTS, _long_text(tok, 512)]


def _reference(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' definition with HF's tokenizer and model: one padded batch,
    mean over the attention mask, L2 normalisation."""
    from transformers import AutoModel, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = hf_tok(texts, padding=True, truncation=False, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1)


# --- tokenizer and model -----------------------------------------------------------------------


def test_is_an_embedding_model(model_dir: Path, model_cache: Path) -> None:
    assert is_embedding_model(model_dir)
    assert Pooling.from_dir(model_dir) == Pooling(mode="mean", normalize=True)
    assert model_name(BUNDLED_EMBED_MODEL) == NAME


def test_tokenizer_matches_hf_with_special_tokens(model_dir: Path, tok: Tokenizer, texts: list[str]) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    for text in [*texts, "", "[CLS] written out [SEP]", "  spaces\tand\nnewlines  "]:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == hf_tok(text)["input_ids"], text
        assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
    # tokenizer.json asks for truncation at 128 and padding to 128: neither may apply.
    long_ids = tok.encode(texts[-1], add_special_tokens=True)
    assert 500 < len(long_ids) <= 512 and 0 not in long_ids
    assert tok.context_length == 512


def test_embeddings_equal_the_reference(
    encoder: Encoder, tok: Tokenizer, model_dir: Path, texts: list[str]
) -> None:
    inputs = [tok.encode(t, add_special_tokens=True) for t in texts]
    assert len({len(ids) for ids in inputs}) == len(inputs)  # all different lengths
    ours = encoder.encode(inputs)
    ref = _reference(model_dir, texts)
    assert ours.shape == ref.shape == (len(texts), 384)
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=1)
    assert cosine.min().item() > 0.9999
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(texts)), atol=1e-5)
    # Related texts are closer than unrelated ones (the vectors mean something).
    flour = encoder.encode([tok.encode("Flour mills grind wheat.", add_special_tokens=True)])[0]
    assert (ours[3] @ flour).item() > 0.5 > (ours[3] @ ours[0]).item()


def test_padding_and_sub_batches_do_not_change_results(
    encoder: Encoder, tok: Tokenizer, texts: list[str]
) -> None:
    inputs = [tok.encode(t, add_special_tokens=True) for t in texts]
    together = encoder.encode(inputs)
    alone = torch.cat([encoder.encode([ids]) for ids in inputs])
    assert (together - alone).abs().max().item() < 1e-5
    saved = encoder.max_batch_tokens
    encoder.max_batch_tokens = 64  # forces many small sub-batches, and the long input alone
    try:
        split = encoder.encode(inputs)
    finally:
        encoder.max_batch_tokens = saved
    assert (together - split).abs().max().item() < 1e-5


def test_too_long_and_bad_inputs_are_refused(encoder: Encoder) -> None:
    assert encoder.context_length == encoder.max_tokens == 512 and encoder.dimensions == 384
    encoder.encode([[101] + [1037] * 510 + [102]])  # exactly 512: fine
    with pytest.raises(InvalidInput, match="input 1 has 513 tokens; the model's context length is 512"):
        encoder.encode([[101, 102], [101] + [1037] * 511 + [102]])
    with pytest.raises(InvalidInput, match="no tokens"):
        encoder.encode([[101, 102], []])
    with pytest.raises(InvalidInput, match=r"\[0, 30522\)"):
        encoder.encode([[101, 30522, 102]])
    with pytest.raises(InvalidInput, match="must not be empty"):
        encoder.encode([])


# --- the batcher -------------------------------------------------------------------------------


async def test_batcher_splits_results_back_under_concurrency(
    encoder: Encoder, tok: Tokenizer, texts: list[str]
) -> None:
    batcher = EmbedBatcher(encoder, max_wait=0.05, max_inputs=64)
    try:
        pool = [tok.encode(t, add_special_tokens=True) for t in texts]
        # Requests of 1, 2 and 3 inputs, each a different slice of the pool.
        requests = [[pool[(i + j) % len(pool)] for j in range(i % 3 + 1)] for i in range(12)]
        results = await asyncio.gather(*(batcher.encode(r) for r in requests))
        assert batcher.batches < len(requests)  # they really were batched together
        for inputs, vectors in zip(requests, results, strict=True):
            expected = encoder.encode(inputs)
            assert len(vectors) == len(inputs)
            assert (torch.tensor(vectors) - expected).abs().max().item() < 1e-5
        assert batcher.running == 0 and batcher.waiting == 0
    finally:
        batcher.close()


class _RecordingEncoder:
    """Stands in for `Encoder`: records each forward pass; embeds ids as [len, first id]."""

    context_length = 512

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[list[int]]] = []
        self.fail_on = fail_on
        self.release = threading.Event()
        self.release.set()

    def validate(self, inputs: list[list[int]]) -> None:
        if not inputs or any(not ids for ids in inputs):
            raise InvalidInput("empty")

    def encode(self, inputs: list[list[int]]) -> torch.Tensor:
        self.release.wait(10)
        self.batches.append(inputs)
        if self.fail_on is not None and any(ids[0] == self.fail_on for ids in inputs):
            raise RuntimeError("boom")
        return torch.tensor([[float(len(ids)), float(ids[0])] for ids in inputs])


async def test_batcher_respects_max_inputs_and_keeps_requests_whole() -> None:
    fake = _RecordingEncoder()
    batcher = EmbedBatcher(fake, max_wait=0.05, max_inputs=4)  # type: ignore[arg-type]
    try:
        requests = [[[i, 1], [i, 2, 3], [i]] for i in range(4)]  # 3 inputs each
        big = [[9, k] for k in range(10)]  # bigger than max_inputs: still one pass, whole
        results = await asyncio.gather(*(batcher.encode(r) for r in [*requests, big]))
        for inputs, vectors in zip([*requests, big], results, strict=True):
            assert vectors == [[float(len(ids)), float(ids[0])] for ids in inputs]
        # 3 + 3 > 4: one request per pass; the 10-input request alone in its own.
        assert sorted(len(b) for b in fake.batches) == [3, 3, 3, 3, 10]
    finally:
        batcher.close()


async def test_batcher_failures_and_cancellation() -> None:
    fake = _RecordingEncoder(fail_on=7)
    batcher = EmbedBatcher(fake, max_wait=0.05, max_inputs=64)  # type: ignore[arg-type]
    try:
        # A request the encoder refuses fails alone, before it joins a batch.
        with pytest.raises(InvalidInput):
            await batcher.encode([[1], []])
        # A forward pass that fails fails every request in it, and only those.
        same_pass = [batcher.encode([[1, 2]]), batcher.encode([[7]])]
        results = await asyncio.gather(*same_pass, return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results) and len(fake.batches[-1]) == 2
        assert await batcher.encode([[5, 5, 5]]) == [[3.0, 5.0]]  # the batcher lives on

        # A request cancelled while waiting (client gone) is skipped; the others are served.
        fake.release.clear()  # hold the first pass so the next requests queue up behind it
        first = asyncio.create_task(batcher.encode([[1]]))
        await asyncio.sleep(0.1)
        assert batcher.running == 1
        gone = asyncio.create_task(batcher.encode([[2]]))
        kept = asyncio.create_task(batcher.encode([[3, 3]]))
        await asyncio.sleep(0.01)
        assert batcher.waiting == 2
        gone.cancel()
        fake.release.set()
        assert await first == [[1.0, 1.0]] and await kept == [[2.0, 3.0]]
        assert [[2]] not in fake.batches and fake.batches[-1] == [[3, 3]]
    finally:
        fake.release.set()
        batcher.close()


# --- /embed over HTTP --------------------------------------------------------------------------


class _TestServer(uvicorn.Server):
    # Leave the process's signal handlers to pytest.
    def capture_signals(self) -> Any:
        return contextlib.nullcontext()


async def _start(app: Litestar) -> tuple[str, uvicorn.Server, asyncio.Task[None]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _TestServer(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), "test server failed to start"
        await asyncio.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, task


@pytest.fixture(scope="module")
def batcher(encoder: Encoder) -> Iterator[EmbedBatcher]:
    b = EmbedBatcher(encoder)
    yield b
    b.close()


@pytest.fixture(scope="module")
async def client(batcher: EmbedBatcher) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(embedder=batcher, token=TOKEN, info=WorkerInfo("w-embed", NAME, "dep-embed"))
    url, server, task = await _start(app)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        yield c
    server.should_exit = True
    await task


async def _embed(client: httpx.AsyncClient, inputs: list[list[int]], **headers: str) -> httpx.Response:
    body = msgspec.json.encode(EmbedRequest(request_id="r", inputs=inputs))
    return await client.post("/embed", content=body, headers=headers or AUTH)


async def test_embed_over_http(
    client: httpx.AsyncClient, encoder: Encoder, tok: Tokenizer, texts: list[str]
) -> None:
    inputs = [tok.encode(t, add_special_tokens=True) for t in texts]
    resp = await _embed(client, inputs)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    body = msgspec.json.decode(resp.content, type=EmbedResponse)
    assert body.prompt_tokens == sum(len(ids) for ids in inputs)
    assert (torch.tensor(body.embeddings) - encoder.encode(inputs)).abs().max().item() < 1e-5

    # Concurrent requests come back each with its own vectors.
    single = [[ids] for ids in inputs]
    answers = await asyncio.gather(*(_embed(client, r) for r in single))
    for ids, answer in zip(inputs, answers, strict=True):
        vec = msgspec.json.decode(answer.content, type=EmbedResponse).embeddings
        assert (torch.tensor(vec) - encoder.encode([ids])).abs().max().item() < 1e-5


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x"])
async def test_embed_requires_the_internal_token(client: httpx.AsyncClient, auth: str | None) -> None:
    body = msgspec.json.encode(EmbedRequest(request_id="r", inputs=[[101, 102]]))
    resp = await client.post("/embed", content=body, headers={"Authorization": auth} if auth else {})
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_internal_token"


async def test_embed_bad_requests(client: httpx.AsyncClient) -> None:
    resp = await _embed(client, [[101] + [1037] * 511 + [102]])
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "inputs" and "513 tokens" in err["message"] and "512" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    resp = await client.post("/embed", content=b"{not json", headers=AUTH)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = await client.post("/embed", json={"request_id": "x"}, headers=AUTH)
    assert resp.status_code == 400 and "inputs" in resp.json()["error"]["message"]
    assert (await _embed(client, [])).status_code == 400
    assert (await _embed(client, [[101, 10**6]])).status_code == 400


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
async def test_an_embed_worker_refuses_generation(client: httpx.AsyncClient, path: str) -> None:
    resp = await client.post(path, json={"request_id": "x", "prompt_token_ids": [1, 2]}, headers=AUTH)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "wrong_model_kind" and NAME in err["message"] and "/embed" in err["message"]


async def test_health_and_metrics(client: httpx.AsyncClient) -> None:
    await _embed(client, [[101, 7592, 102]])
    health = (await client.get("/health", headers=AUTH)).json()
    assert health["kind"] == "embed" and health["model"] == NAME
    assert health["deployment_id"] == "dep-embed" and health["running"] == 0
    text = (await client.get("/metrics", headers=AUTH)).text
    label = f'{{model_name="{NAME}"}}'
    assert f"vllm:num_requests_running{label} 0.0" in text
    assert f"vllm:prompt_tokens_total{label}" in text
    assert f"vllm:e2e_request_latency_seconds_count{label}" in text
    assert "vllm:kv_cache_usage_perc" not in text  # an encoder has no KV cache
    assert (await client.get("/health")).status_code == 401
