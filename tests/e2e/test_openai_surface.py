"""Issue 18's sampling surface through `tokenmill serve` with the real SmolLM2 worker, driven by
the official SDK (sync and async, streamed and not): `n`, `logprobs`/`top_logprobs` against the
engine's own values and HF's, `logit_bias`, `echo`, and several prompts in one request. On the
shared server, as an organisation of its own; the engine in this process is the reference."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.e2e.serve import MODEL, Server
from tokenmill.modelstore import resolve_model
from tokenmill.settings import BUNDLED_MODEL
from workers.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Name three fruits."}]
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
CLOSE = 1e-3  # logprobs of the same fp32 model under another batch differ by far less


@pytest.fixture(scope="module")
def server(shared_server: Server) -> Server:
    return shared_server.for_org("openai-surface")


@pytest.fixture(scope="module")
def model_dir(model_cache: Path) -> Path:
    return resolve_model(BUNDLED_MODEL, model_cache)  # what the served worker loads


@pytest.fixture(scope="module")
def engine(model_dir: Path, model_cache: Path) -> LLM:
    """The engine in this process, on the served model's files: the reference."""
    return LLM(str(model_dir), kv_cache_gib=0.25, compile_cache=str(model_cache))


def chat_ids(engine: LLM, messages: list[dict[str, str]]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def usage_row(server: Server, request_id: str) -> tuple[int, int, int]:
    """(rows, prompt tokens, completion tokens) of the request in the ledger, once it is there."""
    deadline = time.monotonic() + 30
    while True:
        rows = server.query(
            "SELECT prompt_tokens, completion_tokens FROM usage_events WHERE request_id = ?", request_id
        )
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rows, f"no usage event for {request_id}"
    time.sleep(0.5)  # a second event would have come with the first
    ((count,),) = server.query("SELECT count(*) FROM usage_events WHERE request_id = ?", request_id)
    return count, rows[0][0], rows[0][1]


def test_n_choices_are_the_engines_and_all_their_tokens_are_billed(server: Server, engine: LLM) -> None:
    params: dict[str, Any] = {"max_tokens": 12, "temperature": 0.9, "top_p": 1.0, "seed": 5}
    raw = server.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, n=3, logprobs=True, **params
    )
    reply = raw.parse()
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    # the engine's own n = 3 with the same seed: choice k samples with seed + k
    (ref,) = engine.generate([chat_ids(engine, ASK)], SamplingParams(n=3, **params))
    assert texts == [o.text for o in ref.outputs] and len(set(texts)) > 1
    counts = [len(c.logprobs.content or []) for c in reply.choices if c.logprobs]
    assert counts == [len(o.token_ids) for o in ref.outputs]
    u = reply.usage
    assert u.completion_tokens == sum(counts)  # every choice's tokens
    assert u.prompt_tokens == len(ref.prompt_token_ids)  # the prompt once
    assert usage_row(server, raw.headers["x-request-id"]) == (1, u.prompt_tokens, u.completion_tokens)

    async def streamed() -> list[Any]:
        async with server.aclient() as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=ASK, n=3, stream=True, stream_options={"include_usage": True}, **params
            )
            return [c async for c in stream]

    *chunks, end = asyncio.run(streamed())
    got = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(3)
    ]
    assert got == texts
    assert end.usage is not None and end.usage.completion_tokens == u.completion_tokens


def test_logprobs_are_the_engines_and_hfs(server: Server, engine: LLM, model_dir: Path) -> None:
    ids = chat_ids(engine, ASK)
    (ref,) = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, logprobs=5))
    (out,) = ref.outputs
    assert out.logprobs is not None and out.top_logprobs is not None
    reply = server.client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(out.token_ids)
    tok = engine.tokenizer
    for entry, token, logprob, top in zip(
        content, out.token_ids, out.logprobs, out.top_logprobs, strict=True
    ):
        assert bytes(entry.bytes or []) == tok.decode([token], skip_special_tokens=False).encode()
        assert entry.logprob == pytest.approx(logprob, abs=CLOSE)
        assert [t.token for t in entry.top_logprobs] == [
            tok.decode([i], skip_special_tokens=False) for i, _ in top
        ]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in top], abs=CLOSE)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest was taken
    assert "".join(e.token for e in content) == reply.choices[0].message.content

    # HF's fp32 forward pass gives the same log-softmax at every position
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1].float()
    hf_logprobs = torch.log_softmax(logits, dim=-1)
    expected = [hf_logprobs[j, t].item() for j, t in enumerate(out.token_ids)]
    assert [e.logprob for e in content] == pytest.approx(expected, abs=CLOSE)

    # streamed: each chunk carries its own tokens', together the same as the whole
    async def streamed() -> list[Any]:
        async with server.aclient() as client:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                max_tokens=8,
                temperature=0,
                logprobs=True,
                top_logprobs=5,
                stream=True,
            )
            return [c async for c in stream]

    pieces = [
        e
        for c in asyncio.run(streamed())
        if c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in pieces] == [e.token for e in content]
    assert [e.logprob for e in pieces] == pytest.approx([e.logprob for e in content], abs=CLOSE)


def test_completion_logprobs_and_logit_bias(server: Server, engine: LLM) -> None:
    prompt = PROMPTS[0]
    (ref,) = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=5))
    (out,) = ref.outputs
    assert out.logprobs is not None

    async def ask(**kw: Any) -> Any:
        async with server.aclient() as client:
            return await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0, **kw
            )

    reply = asyncio.run(ask(logprobs=5))
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert reply.choices[0].text == out.text == "".join(lp.tokens)
    assert lp.token_logprobs == pytest.approx(out.logprobs, abs=CLOSE)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    assert all(5 <= len(top) <= 6 for top in lp.top_logprobs)  # the five likeliest and the sampled one
    # -100 on the greedy first token: another one comes first
    first = out.token_ids[0]
    biased = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logit_bias={str(first): -100}, logprobs=0
    )
    tokens = biased.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens and tokens[0] != lp.tokens[0] and biased.choices[0].text != out.text
    # the bias steers sampling only: the logprob reported for the token taken is the model's own
    assert biased.choices[0].logprobs.token_logprobs[0] < out.logprobs[0]  # type: ignore[union-attr, index]


def test_echo_and_several_prompts(server: Server, engine: LLM) -> None:
    refs = engine.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0))
    client = server.client()
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + refs[0].outputs[0].text
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True, stream=True
    )
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0].startswith(PROMPTS[0]) and "".join(texts) == echoed.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, echo=True, logprobs=1)
    assert err.value.body["param"] == "echo"

    async def several() -> Any:
        async with server.aclient() as client:
            return await client.completions.with_raw_response.create(
                model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0
            )

    raw = asyncio.run(several())
    reply = raw.parse()
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [r.outputs[0].text for r in refs]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in refs)
    completion_tokens = sum(len(r.outputs[0].token_ids) for r in refs)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert usage_row(server, raw.http_response.headers["x-request-id"]) == (
        1,
        prompt_tokens,
        completion_tokens,
    )


def test_refusals_carry_the_servers_request_id(server: Server) -> None:
    """A 401 and a 429 through the SDK carry a fresh `x-request-id` as an answer does, so a
    client can quote any failure to the operator."""
    with pytest.raises(openai.AuthenticationError) as denied:
        server.client("tm-nope").models.list()
    client = server.client(server.create_org_key("one-a-minute", requests_per_minute=1, request_burst=1))
    answered = client.chat.completions.with_raw_response.create(model=MODEL, messages=ASK, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    ids = [
        answered.headers["x-request-id"],
        denied.value.response.headers["x-request-id"],
        limited.value.response.headers["x-request-id"],
    ]
    assert all(i.startswith("req_") for i in ids) and len(set(ids)) == 3, ids
