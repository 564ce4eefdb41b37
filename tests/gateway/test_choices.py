"""Choices, log probabilities, logit bias and echo at the gateway: `n` and several prompts fanned
out into one sequence per choice and merged back, metered as one request; OpenAI's shapes of
logprobs, streamed and not. The official SDK against fake workers (tests/gateway/conftest.py);
tests/e2e/test_openai_surface.py runs the same against the real model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.conftest import Env
from tests.gateway.test_admission import new_key
from tests.gateway.test_api import HELLO, MODEL, ledger, sdk
from tokenmill.modelstore import resolve_model
from tokenmill.openai_shapes import spelling
from tokenmill.settings import BUNDLED_MODEL
from tokenmill.tokenization import Tokenizer

PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):"]


async def tokenizer(env: Env) -> Tokenizer:
    gw = env.app.state.gateway
    caller = await gw.authenticate(f"Bearer {env.admin_key}")
    return await gw.catalog.tokenizer(await gw.catalog.resolve(caller, MODEL))


def post(env: Env, path: str, body: dict[str, Any]) -> Any:
    return env.client.post(
        path, headers={"authorization": f"Bearer {env.admin_key}"}, json={"model": MODEL, **body}
    )


async def sse(env: Env, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The `data:` objects of a streamed answer (without the final [DONE])."""
    r = await post(env, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# --- n ----------------------------------------------------------------------------------------


async def test_n_choices_are_sequences_of_their_own_metered_as_one_request(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    raw = await sdk(gateway_env).chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=2, n=3, seed=7
    )
    reply, rid = raw.parse(), raw.headers["x-request-id"]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content == "word0 word1 " and c.finish_reason == "length" for c in reply.choices)
    # one generate request per choice, each with an id of its own and a seed of its own
    assert sorted(r.request_id for r in w.received) == [f"{rid}.0", f"{rid}.1", f"{rid}.2"]
    assert sorted(r.sampling.seed for r in w.received) == [7, 8, 9]  # type: ignore[type-var]
    prompt = len(w.received[0].prompt_token_ids)
    assert all(r.prompt_token_ids == w.received[0].prompt_token_ids for r in w.received)
    # the prompt is billed once, the completions of all three choices
    u = reply.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (prompt, 6, prompt + 6)
    (row,) = await ledger(gateway_env, 1)
    assert row.request_id == rid
    assert (row.prompt_tokens, row.completion_tokens, row.status) == (prompt, 6, "ok")
    await asyncio.sleep(0.2)
    assert len(await ledger(gateway_env, 1)) == 1  # one usage event, not one per sequence


async def test_without_a_seed_no_seed_is_made_up(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, n=2)
    assert [r.sampling.seed for r in w.received] == [None, None]


async def test_streamed_choices_interleave_each_with_its_index(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    chunks = await sse(
        gateway_env,
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 3, "n": 2, "stream_options": {"include_usage": True}},
    )
    *deltas, end = chunks
    for index in (0, 1):
        mine = [c["choices"][0] for c in deltas if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"  # each choice's first chunk has the role
        assert all("role" not in c["delta"] for c in mine[1:])
        assert "".join(c["delta"].get("content") or "" for c in mine) == "word0 word1 word2 "
        assert [c["finish_reason"] for c in mine][-1] == "length"
    assert all(len(c["choices"]) == 1 for c in deltas)
    assert end["choices"] == [] and end["usage"]["completion_tokens"] == 6  # one usage, summed
    assert end["usage"]["prompt_tokens"] == (await ledger(gateway_env, 1))[0].prompt_tokens


async def test_choices_are_retried_elsewhere_each_on_its_own(gateway_env: Env) -> None:
    good = await gateway_env.add_worker()
    await gateway_env.add_worker(fail=True)
    reply = await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, n=4)
    assert [c.message.content for c in reply.choices] == ["word0 word1 "] * 4
    assert len(good.received) == 4 and reply.usage.completion_tokens == 8


async def test_client_gone_stops_every_choice_and_meters_them_once(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    w.delay, w.max_tokens = 0.05, 1000
    request = asyncio.create_task(
        gateway_env.client.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {gateway_env.admin_key}"},
            json={"model": MODEL, "messages": HELLO, "max_tokens": 1000, "n": 3},
        )
    )
    # The client leaves once every choice has streamed (not after a fixed time: on a loaded
    # machine the choices may not have started by then).
    for _ in range(3000):
        if len(w.streamed) == 3 and min(w.streamed) >= 2:
            break
        await asyncio.sleep(0.01)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    (row,) = await ledger(gateway_env, 1)
    assert row.status == "cancelled"
    assert 3 <= row.completion_tokens < 100  # what the three made before they were stopped
    for _ in range(100):  # and all three worker streams were closed
        if w.streaming == 0:
            break
        await asyncio.sleep(0.02)
    assert w.streaming == 0 and len(w.received) == 3
    assert all(s.inflight == 0 for s in gateway_env.app.state.gateway.fleet.workers.values())


async def test_admission_charges_every_choice(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    key = await new_key(gateway_env, tokens_per_minute=500)
    client = sdk(gateway_env, key)
    await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=200)  # fits alone
    with pytest.raises(openai.BadRequestError) as err:  # 3 x 200 completion tokens do not
        await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=200, n=3)
    assert err.value.body["code"] == "request_too_large"


# --- several prompts --------------------------------------------------------------------------


async def test_several_prompts_get_n_choices_each_and_one_usage(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    tok = await tokenizer(gateway_env)
    raw = await sdk(gateway_env).completions.with_raw_response.create(
        model=MODEL, prompt=PROMPTS, max_tokens=2, n=2
    )
    reply, rid = raw.parse(), raw.headers["x-request-id"]
    assert [c.index for c in reply.choices] == list(range(6))
    assert all(c.text == "word0 word1 " for c in reply.choices)
    # choice i answers prompt i // n
    sent = {r.request_id: r.prompt_token_ids for r in w.received}
    assert sent == {f"{rid}.{i}": tok.encode(PROMPTS[i // 2]) for i in range(6)}
    prompt_tokens = sum(len(tok.encode(p)) for p in PROMPTS)  # each prompt once
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 12)
    (row,) = await ledger(gateway_env, 1)
    assert (row.request_id, row.prompt_tokens, row.completion_tokens) == (rid, prompt_tokens, 12)


async def test_prompts_of_token_ids(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    reply = await sdk(gateway_env).completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=1)
    assert [c.index for c in reply.choices] == [0, 1]
    assert sorted(r.prompt_token_ids for r in w.received) == [[1, 2, 3], [4, 5]]
    assert reply.usage.prompt_tokens == 5
    one = await sdk(gateway_env).completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
    assert len(one.choices) == 1  # a list of ints is one prompt


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (["a", 1], "must be a text, texts, token ids, or lists of token ids"),
        ([[1, 2], "a"], "must be a text, texts, token ids, or lists of token ids"),
        (["x"] * 17, "Too many prompts in 'prompt': 17 given, at most 16 allowed."),
        ([[1], []], "must not be empty"),
        ([[1], [10**6]], "must be token ids in [0, 49152)"),
    ],
)
async def test_bad_prompt_lists_are_400(gateway_env: Env, prompt: list[Any], message: str) -> None:
    r = await post(gateway_env, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and message in err["message"]


# --- logprobs ---------------------------------------------------------------------------------


async def test_chat_logprobs_have_openais_shape(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    tok = await tokenizer(gateway_env)
    reply = await sdk(gateway_env).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=3, logprobs=True, top_logprobs=2, n=2
    )
    for choice in reply.choices:
        lp = choice.logprobs
        assert lp is not None and lp.refusal is None and lp.content is not None
        assert [t.token for t in lp.content] == ["t", "u", "v"]  # tokens 100, 101, 102
        assert [t.logprob for t in lp.content] == pytest.approx([-0.5, -0.6, -0.7])
        assert all(t.bytes == list(t.token.encode()) for t in lp.content)
        first = lp.content[0].top_logprobs
        assert [(t.token, t.logprob) for t in first] == [("t", -0.5), (tok.decode([300]), -2.0)]
    # without top_logprobs: each token's own, none beside it
    plain = await sdk(gateway_env).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2, logprobs=True
    )
    assert plain.choices[0].logprobs is not None
    assert [t.top_logprobs for t in plain.choices[0].logprobs.content or []] == [[], []]
    # not asked: null, and the worker was not asked either
    none = await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert none.choices[0].logprobs is None
    assert [r.sampling.logprobs for r in gateway_env.workers[0].received][-4:] == [2, 2, 0, None]


async def test_streamed_chat_logprobs_are_those_of_each_chunk(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    body = {"messages": HELLO, "max_tokens": 3, "logprobs": True, "top_logprobs": 5}
    chunks = await sse(gateway_env, "/v1/chat/completions", body)
    whole = (await post(gateway_env, "/v1/chat/completions", body)).json()["choices"][0]["logprobs"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert all(s is not None and s["refusal"] is None for s in streamed)
    assert [len(s["content"]) for s in streamed] == [1, 1, 1]  # each chunk carries its own token
    assert [e for s in streamed for e in s["content"]] == whole["content"]
    assert [len(e["top_logprobs"]) for e in whole["content"]] == [5, 5, 5]


async def test_completion_logprobs_have_the_legacy_shape(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    reply = await sdk(gateway_env).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=3, logprobs=2
    )
    lp = reply.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["t", "u", "v"]
    assert lp.token_logprobs == pytest.approx([-0.5, -0.6, -0.7])
    assert lp.text_offset == [0, 1, 2]
    # the two likeliest and the sampled one (here the likeliest itself), by text
    assert lp.top_logprobs is not None and len(lp.top_logprobs) == 3
    assert set(lp.top_logprobs[0]) == {"t", "om"} and lp.top_logprobs[0]["t"] == -0.5
    chunks = await sse(
        gateway_env, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3, "logprobs": 2}
    )
    pieces = [c["choices"][0]["logprobs"] for c in chunks]
    assert [p["tokens"] for p in pieces] == [["t"], ["u"], ["v"]]
    assert [p["text_offset"] for p in pieces] == [[0], [1], [2]]  # offsets run on across chunks


async def test_a_worker_without_logprobs_is_not_trusted_with_them(gateway_env: Env) -> None:
    old = await gateway_env.add_worker()
    old.no_logprobs = True
    with pytest.raises(openai.InternalServerError) as err:
        await sdk(gateway_env).chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=2, logprobs=True
        )
    # tried, found wanting and left aside: no other worker serves the model
    assert err.value.status_code == 503 and len(old.received) == 1
    new = await gateway_env.add_worker()  # a second worker computes them: the request goes there
    reply = await sdk(gateway_env).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2, logprobs=True
    )
    assert reply.choices[0].logprobs is not None and len(new.received) == 1


def test_tokens_are_spelt_with_their_own_bytes(model_cache: Path) -> None:
    tok = Tokenizer.from_dir(resolve_model(BUNDLED_MODEL, model_cache))
    spell = spelling(tok)
    assert spelling(tok) is spell  # one per tokenizer
    # a byte-level token holding part of a character: its bytes exactly, U+FFFD as its text
    assert spell(321) == ("\ufffd", [0xE2, 0x80])
    ids = tok.encode(" ☃ snow")
    assert b"".join(bytes(spell(i)[1]) for i in ids).decode() == " ☃ snow"
    assert spell(tok.encode("<|im_end|>")[0]) == ("<|im_end|>", list(b"<|im_end|>"))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ],
)
async def test_bad_chat_logprobs_are_400(gateway_env: Env, body: dict[str, Any], param: str) -> None:
    r = await post(gateway_env, "/v1/chat/completions", {"messages": HELLO, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


# --- logit_bias -------------------------------------------------------------------------------


async def test_logit_bias_reaches_the_worker_as_token_ids(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    bias = {"100": -100, "49151": 100, "7": 0.5}
    await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, logit_bias=bias)
    await sdk(gateway_env).completions.create(model=MODEL, prompt="Hi", max_tokens=1, logit_bias=bias)
    assert [r.sampling.logit_bias for r in w.received] == [{100: -100.0, 49151: 100.0, 7: 0.5}] * 2


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"hello": 1}, "'hello' is not one"),
        ({"-1": 1}, "'-1' is not one"),
        ({"49152": 1}, "from 0 to 49151; '49152' is not one"),
        ({"1" * 5000: 1}, "is not one"),
        ({"12": 100.5}, "between -100 and 100; token 12 has 100.5"),
        ({"12": -101}, "between -100 and 100"),
        ({str(i): 1 for i in range(301)}, "Too many entries in 'logit_bias': 301 given, at most 300"),
    ],
)
async def test_bad_logit_bias_is_400_naming_it(gateway_env: Env, bias: dict[str, Any], message: str) -> None:
    w = await gateway_env.add_worker()
    for path, body in (
        ("/v1/chat/completions", {"messages": HELLO}),
        ("/v1/completions", {"prompt": "Hi"}),
    ):
        r = await post(gateway_env, path, {**body, "logit_bias": bias, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and message in err["message"], err
    assert w.received == []


# --- echo, suffix, best_of --------------------------------------------------------------------


async def test_echo_puts_the_prompt_before_each_choice(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    tok = await tokenizer(gateway_env)
    client = sdk(gateway_env)
    reply = await client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=2, n=2, echo=True)
    assert [c.text for c in reply.choices] == [f"{PROMPTS[i // 2]}word0 word1 " for i in range(4)]
    ids = tok.encode("<|im_start|>Hello")
    by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True)
    assert by_ids.choices[0].text == "<|im_start|>Helloword0 "  # decoded, special tokens kept
    chunks = await sse(gateway_env, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "echo": True})
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[0] == f"{PROMPTS[0]}word0 " and "".join(texts) == f"{PROMPTS[0]}word0 word1 "
    assert reply.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS[:2])  # not billed twice


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"echo": True, "logprobs": 1}, "echo", "'echo' with 'logprobs' is not supported"),
        ({"suffix": "the end"}, "suffix", "'suffix' is not supported"),
        ({"n": 2, "best_of": 3}, "best_of", "'best_of' other than 'n'"),
    ],
)
async def test_refused_completion_options_are_named(
    gateway_env: Env, body: dict[str, Any], param: str, message: str
) -> None:
    r = await post(gateway_env, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"]


async def test_best_of_equal_to_n_is_accepted(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    reply = await sdk(gateway_env).completions.create(model=MODEL, prompt="Hi", max_tokens=1, n=2, best_of=2)
    assert len(reply.choices) == 2
