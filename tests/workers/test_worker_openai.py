"""One worker used alone: OpenAI's /v1 endpoints on the real engine, driven by the official SDK."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from litestar import Litestar

from tokenmill.modelstore import model_name, resolve_model
from workers.engine import EngineConfig
from workers.generator import EngineGenerator
from workers.server import WorkerInfo, create_app

pytestmark = pytest.mark.slow

TOKEN = "internal-test-token"
SOURCE = "bundled:smollm2"
MODEL = model_name(SOURCE)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


class _TestServer(uvicorn.Server):
    # Leave the process's signal handlers to pytest.
    def capture_signals(self) -> Any:
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def generator(model_cache: Path) -> Iterator[EngineGenerator]:
    gen = EngineGenerator(EngineConfig(model=str(resolve_model(SOURCE, model_cache)), kv_cache_gib=0.25))
    yield gen
    gen.close()


@pytest.fixture(scope="module")
async def worker_url(generator: EngineGenerator) -> AsyncIterator[str]:
    app: Litestar = create_app(generator, token=TOKEN, info=WorkerInfo("w-test", MODEL))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound before serving, so port 0 yields a known port
    server = _TestServer(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), "test server failed to start"
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    await task


@pytest.fixture
async def sdk(worker_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{worker_url}/v1", api_key=TOKEN, max_retries=0) as client:
        yield client


async def test_chat_completion(sdk: openai.AsyncOpenAI) -> None:
    resp = await sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=40
    )
    assert resp.headers["x-request-id"].startswith("req_")
    chat = resp.parse()
    assert chat.object == "chat.completion" and chat.model == MODEL and chat.id.startswith("chatcmpl-")
    assert "Paris" in (chat.choices[0].message.content or "")
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.prompt_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


async def test_streaming_chat(sdk: openai.AsyncOpenAI) -> None:
    stream = await sdk.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 2  # streamed token by token, not in one piece
    assert text_chunks[0].choices[0].delta.role == "assistant"
    assert text_chunks[-1].choices[0].finish_reason == "stop"
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in text_chunks)
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage  # include_usage: a last chunk with usage and no choices
    assert usage is not None and usage.completion_tokens > 0 and not chunks[-1].choices


async def test_text_completion(sdk: openai.AsyncOpenAI) -> None:
    done = await sdk.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5
    )
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 5
    assert "Paris" in done.choices[0].text


async def test_wrong_token_is_401(worker_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{worker_url}/v1", api_key="not-the-token", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            await bad.chat.completions.create(model=MODEL, messages=FRANCE)
    assert info.value.status_code == 401


async def test_unknown_model_is_404(sdk: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await sdk.chat.completions.create(model="gpt-nonexistent", messages=FRANCE)
    assert info.value.code == "model_not_found" and info.value.param == "model"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 10**6}, "messages"),  # prompt + max_tokens beyond the context length
        ({"n": 2}, "n"),
    ],
)
async def test_bad_input_is_400_naming_the_param(
    sdk: openai.AsyncOpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(model=MODEL, messages=FRANCE, **kwargs)
    assert info.value.param == param
    assert info.value.type == "invalid_request_error"


async def _idle(generator: EngineGenerator) -> bool:
    for _ in range(100):
        if generator.running == 0 and generator.waiting == 0:
            return True
        await asyncio.sleep(0.05)
    return False


LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}


async def test_client_gone_aborts_generation(worker_url: str, generator: EngineGenerator) -> None:
    # Non-streaming: nothing is sent until the end, so the worker must watch for the disconnect.
    async with httpx.AsyncClient(base_url=worker_url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=LONG, headers={"authorization": f"Bearer {TOKEN}"})
    assert await _idle(generator)


async def test_stream_closed_aborts_generation(worker_url: str, generator: EngineGenerator) -> None:
    async with (
        httpx.AsyncClient(base_url=worker_url, timeout=30) as client,
        client.stream(
            "POST",
            "/v1/completions",
            json={**LONG, "stream": True},
            headers={"authorization": f"Bearer {TOKEN}"},
        ) as resp,
    ):
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            assert line.startswith("data: {")
            assert generator.running == 1
            break
    assert await _idle(generator)
