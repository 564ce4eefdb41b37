"""What one request may ask for (issue 14): each bound a clear 400 naming its field, refused
before a worker sees anything; bodies over the cap a 413; streams that outlast
`max_stream_seconds` cut; request ids on every answer; fail-open only on outages."""

from __future__ import annotations

import asyncio
import logging
import random
import threading

import httpx
import pytest

from gateway.prep import INLINE_CHARS, Prep
from tests.gateway.conftest import Env
from tests.gateway.test_admission import new_key
from tests.gateway.test_api import HELLO, MODEL, ledger
from tokenmill.tokenization import Tokenizer


async def post(
    env: Env, key: str, body: dict[str, object], path: str = "/v1/chat/completions"
) -> httpx.Response:
    return await env.client.post(path, json=body, headers={"authorization": f"Bearer {key}"})


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 2, **extra}


deep: object = {"type": "string"}
for _ in range(40):
    deep = {"type": "object", "properties": {"a": deep}}

TOO_MUCH = {
    "messages": {"messages": HELLO * 2049},
    "stop": {"stop": ["a", "b", "c", "d", "e"]},
    "n": {"n": 17},
    "logit_bias": {"logit_bias": {str(i): 1.0 for i in range(301)}},
    "top_logprobs": {"logprobs": True, "top_logprobs": 21},
    "guided_choice": {"guided_choice": [f"c{i}" for i in range(1025)]},
    "guided_json": {"guided_json": deep},
    "tools": {
        "tools": [
            {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
            for i in range(129)
        ]
    },
    "response_format.json_schema.schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "big", "schema": {"enum": ["x" * 100] * 700}},
        }
    },
}


@pytest.mark.parametrize("field", list(TOO_MUCH))
async def test_each_bound_is_a_400_naming_its_field_before_any_worker_call(
    gateway_env: Env, field: str
) -> None:
    worker = await gateway_env.add_worker()
    key = await new_key(gateway_env)
    r = await post(gateway_env, key, chat(**TOO_MUCH[field]))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error
    assert r.headers["x-request-id"].startswith("req_")
    assert worker.received == []
    # within the bounds, the same request shape is served
    assert (await post(gateway_env, key, chat(stop=["a", "b", "c", "d"]))).status_code == 200


async def test_a_long_stop_string_and_too_many_embedding_inputs_are_refused(gateway_env: Env) -> None:
    key = await new_key(gateway_env)
    r = await post(gateway_env, key, chat(stop=["x" * 1001]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    await gateway_env.add_embed_worker(await gateway_env.embed_deployment())
    body = {"model": "all-MiniLM-L6-v2", "input": ["hi"] * 2049}
    r = await post(gateway_env, key, body, "/v1/embeddings")
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


async def test_a_body_over_the_cap_is_a_413_that_names_the_limit(gateway_env: Env) -> None:
    key = await new_key(gateway_env)
    limit = gateway_env.app.state.settings.max_request_bytes
    r = await post(gateway_env, key, chat(messages=[{"role": "user", "content": "x" * limit}]))
    assert r.status_code == 413
    assert str(limit) in r.json()["error"]["message"] and r.json()["error"]["code"] == "request_too_large"
    assert r.headers["x-request-id"].startswith("req_")


async def test_every_answer_carries_a_fresh_request_id(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    key = await new_key(gateway_env, requests_per_minute=1, request_burst=1)
    auth = {"authorization": f"Bearer {key}"}
    ids, statuses = [], []
    for r in (
        await gateway_env.client.get("/v1/models", headers=auth),
        await gateway_env.client.get(f"/v1/models/{MODEL}", headers=auth),
        await gateway_env.client.get("/v1/models", headers={"authorization": "Bearer tm-nope"}),
        await gateway_env.client.get(f"/v1/models/{MODEL}"),  # no key at all
        await gateway_env.client.get("/v1/models/no-such-model", headers=auth),
        await post(gateway_env, key, chat(temprature=0)),  # a name no endpoint knows
        await post(gateway_env, key, chat(temperature=7)),  # out of range
        # what Litestar answers before any route runs: a path or a method it does not serve
        await gateway_env.client.get("/v1/no-such-endpoint", headers=auth),
        await gateway_env.client.delete("/v1/models", headers=auth),
        await post(gateway_env, key, chat(model="no-such-model")),
        await post(gateway_env, key, chat()),  # over the 1 request a minute
    ):
        assert r.headers["x-request-id"].startswith("req_"), (r.status_code, r.headers)
        ids.append(r.headers["x-request-id"])
        statuses.append(r.status_code)
    assert statuses == [200, 200, 401, 401, 404, 400, 400, 404, 405, 404, 429]
    assert len(set(ids)) == len(ids)


async def test_a_wrong_embeddings_dimensions_is_refused_before_any_worker_call(gateway_env: Env) -> None:
    """The gateway knows the model's vector size from the model's own config (MiniLM: 384)
    and the encoder cannot shorten vectors: any other `dimensions` is a 400 before a worker
    computes anything, so nothing is metered."""
    worker = await gateway_env.add_embed_worker(await gateway_env.embed_deployment())
    worker.dim = 384
    key = await new_key(gateway_env)
    for dimensions, words in (
        (1000, "'all-MiniLM-L6-v2' makes 384-dimensional embeddings: 'dimensions' cannot be more than 384"),
        (385, "cannot be more than 384"),
        (128, "cannot shorten its 384-dimensional embeddings"),
        (0, "Expected `int` >= 1"),
        (-3, "Expected `int` >= 1"),
        (1.5, "Expected `int"),
        ("many", "Expected `int"),
    ):
        body = {"model": "all-MiniLM-L6-v2", "input": "hello", "dimensions": dimensions}
        r = await post(gateway_env, key, body, "/v1/embeddings")
        assert r.status_code == 400, (dimensions, r.text)
        assert r.json()["error"]["param"] == "dimensions" and words in r.json()["error"]["message"], r.text
        assert r.headers["x-request-id"].startswith("req_")
    assert worker.received == []
    # the model's own size is what it gives anyway
    body = {"model": "all-MiniLM-L6-v2", "input": "hello", "dimensions": 384}
    r = await post(gateway_env, key, body, "/v1/embeddings")
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) == 384 and len(worker.received) == 1
    # one usage event in all: the refused requests left none (the consumer reads in order)
    rows = await ledger(gateway_env, 1)
    assert [row.request_id for row in rows] == [r.headers["x-request-id"]]


async def test_a_stream_longer_than_allowed_is_cut_with_an_error(gateway_env: Env) -> None:
    worker = await gateway_env.add_worker()
    worker.delay = 0.2
    gateway_env.app.state.gateway.settings.max_stream_seconds = 0.5
    key = await new_key(gateway_env)
    async with gateway_env.client.stream(
        "POST",
        "/v1/chat/completions",
        json=chat(max_tokens=8, stream=True),
        headers={"authorization": f"Bearer {key}"},
    ) as r:
        events = [line async for line in r.aiter_lines() if line]
    assert r.status_code == 200
    assert events[-1] == "data: [DONE]"
    assert "stream_too_long" in events[-2], events[-2:]
    assert sum("word" in e for e in events) < 8


async def test_unexpected_errors_are_500s_with_the_request_id_logged_once(
    gateway_env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    key = await new_key(gateway_env)

    async def broken(*_: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gateway_env.app.state.gateway.catalog, "tokenizer", broken)
    with caplog.at_level(logging.ERROR):
        r = await post(gateway_env, key, chat())
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "a bug" not in r.text  # no internals to the caller
    rid = r.headers["x-request-id"]
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


async def test_the_limiter_fails_open_only_on_outage_errors(
    gateway_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    await gateway_env.add_worker()
    key = await new_key(gateway_env)
    limiter = gateway_env.app.state.gateway.admitter.limiter

    async def outage(*_: object, **__: object) -> None:
        raise ConnectionError("redis is down")

    monkeypatch.setattr(limiter, "admit", outage)
    assert (await post(gateway_env, key, chat())).status_code == 200

    async def bug(*_: object, **__: object) -> None:
        raise KeyError("a bug in the limiter")

    monkeypatch.setattr(limiter, "admit", bug)
    assert (await post(gateway_env, key, chat())).status_code == 500


async def test_prompts_are_held_to_the_context_before_and_after_tokenizing(
    gateway_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule (prompt + max_tokens within the context, ids within the vocabulary) for a
    text on its lower bound before tokenizing, on its tokens after, and on token ids sent."""
    worker = await gateway_env.add_worker()
    key = await new_key(gateway_env)
    completion = {"model": MODEL, "max_tokens": 2}
    # token ids as sent: served when they fit with max_tokens, refused (no worker call) when not
    assert (await post(gateway_env, key, {**completion, "prompt": [5] * 8190}, "/v1/completions")).is_success
    assert worker.received[-1].prompt_token_ids == [5] * 8190
    for prompt, code in (([5] * 8191, "context_length_exceeded"), ([5, 49152], None), ([5, "x"], None)):
        r = await post(gateway_env, key, {**completion, "prompt": prompt}, "/v1/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert r.json()["error"]["code"] == code, r.text
    # a text whose lower bound already leaves no room for max_tokens is never tokenized
    gateway = gateway_env.app.state.gateway
    caller = await gateway.authenticate(f"Bearer {key}")
    tok = await gateway.catalog.tokenizer(await gateway.catalog.resolve(caller, MODEL))
    assert tok.max_token_chars and tok.vocab_size == 49152
    text = "x" * (tok.max_token_chars * 8000)
    assert tok.min_tokens(text) == 8000

    def never(*_: object, **__: object) -> list[int]:
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(tok, "encode", never)
    r = await post(gateway_env, key, {**completion, "prompt": text, "max_tokens": 500}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "at least 8000 prompt tokens plus 500 completion tokens" in r.json()["error"]["message"]
    assert len(worker.received) == 1


# --- the pieces ------------------------------------------------------------------------------


def test_min_tokens_never_exceeds_the_real_count(model_cache: object) -> None:
    """The bound that refuses long prompts without tokenizing them must never refuse one that
    fits: checked on prose, code, whitespace runs, the vocabulary's longest pieces and noise."""
    from tokenmill.modelstore import resolve_model
    from tokenmill.settings import BUNDLED_MODEL

    tok = Tokenizer.from_dir(resolve_model(BUNDLED_MODEL, model_cache))  # type: ignore[arg-type]
    assert tok.max_token_chars is not None
    longest = sorted(tok.backend.get_vocab(), key=len)[-50:]
    rng = random.Random(7)
    samples = [
        "The mill grinds grain. " * 200,
        " " * 5000,
        "\n" + " " * 4000 + "\n",
        "#" * 9000,
        "-" * 9000,
        "def f(x):\n    return x\n" * 100,
        "".join(rng.choice(longest).replace("Ġ", " ").replace("Ċ", "\n") for _ in range(300)),
        "".join(chr(rng.randrange(32, 0x3000)) for _ in range(3000)),
        "<|im_start|>" * 300,
    ]
    for text in samples:
        assert tok.min_tokens(text) <= len(tok.encode(text)), text[:40]


async def test_large_jobs_run_off_the_loop_one_at_a_time_per_organisation() -> None:
    prep = Prep(threads=2)
    running: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}
    threads: set[str] = set()
    lock = threading.Lock()

    def job(org: str) -> str:
        with lock:
            running[org] += 1
            most[org] = max(most[org], running[org])
        threads.add(threading.current_thread().name)
        threading.Event().wait(0.05)
        with lock:
            running[org] -= 1
        return org

    big = INLINE_CHARS
    results = await asyncio.gather(*(prep.run(o, big, job, o) for o in "aaaabbbb"))
    assert results == list("aaaabbbb")
    assert most == {"a": 1, "b": 1}  # each organisation queued behind itself
    assert all(t.startswith("gateway-prep") for t in threads)
    # a small job is not worth a thread: it runs inline
    assert await prep.run("a", 10, threading.current_thread) is threading.current_thread()
    prep.close()


async def test_a_request_cancelled_during_admission_gives_its_slot_back(
    gateway_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.openai_types import ChatCompletionRequest, ChatMessage

    key = await new_key(gateway_env, max_concurrent=1)
    gateway = gateway_env.app.state.gateway
    caller = await gateway.authenticate(f"Bearer {key}")
    limiter = gateway.admitter.limiter
    original = limiter.admit
    entered = asyncio.Event()

    async def slow(limits: object, slots: object = (), hold: object = None) -> object:
        result = await original(limits, slots, hold)
        if slots:  # the step that takes the concurrency slot: cancelled while it is in flight
            entered.set()
            await asyncio.sleep(0.2)
        return result

    monkeypatch.setattr(limiter, "admit", slow)
    body = ChatCompletionRequest(model=MODEL, messages=[ChatMessage(role="user", content="hi")], max_tokens=2)
    task = asyncio.create_task(gateway.admit(caller, "req_cancelled", body))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.setattr(limiter, "admit", original)
    for _ in range(100):  # the slot comes back once the cancelled step has finished
        if not any(limiter._slots.values()):
            break
        await asyncio.sleep(0.02)
    admitted = await gateway.admit(caller, "req_next", body)
    await gateway.admitter.settle(admitted.ticket, 0, 0, 0)


def test_one_rule_decides_whether_a_prompt_fits() -> None:
    from tokenmill.errors import APIError
    from tokenmill.request_limits import check_prompt, check_prompt_length

    def refusal(check: object, *args: object, **kwargs: object) -> APIError:
        with pytest.raises(APIError) as err:
            check(*args, **kwargs)  # type: ignore[operator]
        assert err.value.status == 400 and err.value.param == "p"
        return err.value

    # a completion needs room for max_tokens, or for one token when it is left out
    check_prompt_length(90, 100, param="p", max_tokens=10)
    check_prompt_length(99, 100, param="p")
    e = refusal(check_prompt_length, 91, 100, param="p", max_tokens=10)
    assert e.code == "context_length_exceeded"
    assert e.message.endswith("requested 91 prompt tokens plus 10 completion tokens.")
    assert refusal(check_prompt_length, 100, 100, param="p").code == "context_length_exceeded"
    # an encoder's input only has to fit
    check_prompt_length(100, 100, param="p", completion=False)
    e = refusal(
        check_prompt_length, 101, 100, param="p", completion=False, at_least=True, what="tokens in input 2"
    )
    assert e.message.endswith("requested at least 101 tokens in input 2.")
    # token ids: none, too many (before looking at each), or not of the vocabulary
    check_prompt([0, 9], 100, param="p", vocab_size=10)
    assert refusal(check_prompt, [], 100, param="p").message == "The prompt must not be empty."
    assert refusal(check_prompt, ["x"] * 101, 100, param="p", vocab_size=10).code == "context_length_exceeded"
    check_prompt([8, 9], 100, param="p", extra=98, completion=False)  # e.g. an encoder's special tokens
    e = refusal(check_prompt, [8, 9], 100, param="p", extra=99, completion=False)
    assert e.code == "context_length_exceeded" and "requested 101 prompt tokens" in e.message
    for bad in ([0, 10], [-1, 0], [0, "x"], ["x"]):
        e = refusal(check_prompt, bad, 100, param="p", vocab_size=10, name="Input 3")
        assert e.message == "Input 3 must be token ids in [0, 10).", bad
