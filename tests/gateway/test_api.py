"""The OpenAI surface of the gateway, driven by the official SDK against fake workers."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from sqlalchemy import select

from billing.models import UsageEvent
from tests.gateway.conftest import Env
from tokenmill.hashing import extra_keys, hash_blocks
from tokenmill.protocol import KV, KvEvents, KvOp
from tokenmill.tokenization import Tokenizer

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Say hello."}]


def sdk(env: Env, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{env.client.base_url}/v1",
        api_key=key or env.admin_key,
        http_client=env.client,
        max_retries=0,
    )


async def ledger(env: Env, n: int) -> list[UsageEvent]:
    # A deadline, not a count of polls: on a loaded 2-core machine the consumer's batch can
    # take seconds to land (one full-suite run saw 200 polls pass first).
    deadline = time.monotonic() + 30
    while True:
        async with env.app.state.sessionmaker() as s:
            rows = list((await s.execute(select(UsageEvent).order_by(UsageEvent.id))).scalars())
        if len(rows) >= n or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    if len(rows) >= n:
        return rows
    raise AssertionError(f"ledger has {len(rows)} rows, wanted {n}")


async def test_models_lists_the_served_model(gateway_env: Env) -> None:
    models = await sdk(gateway_env).models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_sends_template_tokens_and_meters(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    raw = await sdk(gateway_env).chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=3, temperature=0
    )
    reply = raw.parse()
    assert raw.headers["x-request-id"].startswith("req_")
    assert reply.choices[0].message.content == "word0 word1 word2 "
    assert reply.choices[0].finish_reason == "length"
    # the gateway rendered the chat template and tokenized once; the worker got token ids
    tok: Tokenizer = await gateway_env.app.state.gateway.catalog.tokenizer(
        await gateway_env.app.state.gateway.catalog.resolve(
            await gateway_env.app.state.gateway.authenticate(f"Bearer {gateway_env.admin_key}"), MODEL
        )
    )
    sent = w.received[0]
    assert sent.prompt_token_ids == tok.encode(tok.apply_chat_template(HELLO, add_generation_prompt=True))
    assert sent.sampling.max_tokens == 3 and sent.sampling.temperature == 0
    assert sent.cache_salt  # the organisation's salt goes with every request
    assert reply.usage.prompt_tokens == len(sent.prompt_token_ids)
    assert reply.usage.completion_tokens == 3
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    (row,) = await ledger(gateway_env, 1)
    assert row.request_id == raw.headers["x-request-id"]
    assert (row.prompt_tokens, row.completion_tokens, row.status) == (reply.usage.prompt_tokens, 3, "ok")


async def test_streaming_chat(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    stream = await sdk(gateway_env).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "word0 word1 word2 word3 "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


async def test_sse_wire_format_ends_with_done(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    r = await gateway_env.client.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {gateway_env.admin_key}"},
        json={"model": MODEL, "messages": HELLO, "max_tokens": 2, "stream": True},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


async def test_text_completion(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    c = await sdk(gateway_env).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2)
    assert c.choices[0].text == "word0 word1 " and c.usage.completion_tokens == 2
    assert w.received[0].prompt_token_ids  # tokenized by the gateway


@pytest.mark.parametrize("key", ["", "sk-not-ours", "tm-" + "x" * 48])
async def test_bad_keys_get_openai_401(gateway_env: Env, key: str) -> None:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = await gateway_env.client.post("/v1/chat/completions", headers=headers, json={"model": MODEL})
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error" and err["message"]
    with pytest.raises(openai.AuthenticationError):
        await sdk(gateway_env, key="tm-" + "y" * 48).models.list()


async def test_unknown_model_is_404(gateway_env: Env) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await sdk(gateway_env).chat.completions.create(model="gpt-17", messages=HELLO)
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HELLO, "temperature": 5}, "temperature"),
        ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": HELLO, "n": 0}, "n"),
        ({}, "messages"),
    ],
)
async def test_invalid_requests_name_the_param(gateway_env: Env, body: dict, param: str) -> None:
    r = await gateway_env.client.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {gateway_env.admin_key}"},
        json={"model": MODEL, **body},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] is not None and err["param"].startswith(param), err


async def test_malformed_json_is_400(gateway_env: Env) -> None:
    r = await gateway_env.client.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {gateway_env.admin_key}", "content-type": "application/json"},
        content=b"{not json",
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_context_length_exceeded(gateway_env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=9000)
    assert err.value.body["code"] == "context_length_exceeded"


async def test_no_worker_is_a_clean_503(gateway_env: Env) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO)
    assert err.value.status_code == 503 and err.value.body["code"] == "no_worker_available"


async def test_failed_worker_is_retried_elsewhere(gateway_env: Env) -> None:
    bad = await gateway_env.add_worker(fail=True)
    good = await gateway_env.add_worker()
    # make the failing worker look idle so it is picked first
    await gateway_env.beat(good, running=5)
    reply = await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert reply.choices[0].message.content == "word0 word1 "
    assert len(bad.received) == 1 and len(good.received) == 1
    rows = await ledger(gateway_env, 1)
    assert len(rows) == 1 and rows[0].status == "ok"


async def test_admin_keys_lifecycle_and_tenant_isolation(gateway_env: Env) -> None:
    c, admin = gateway_env.client, {"authorization": f"Bearer {gateway_env.admin_key}"}
    org = (await c.post("/admin/v1/organizations", headers=admin, json={"name": "acme"})).json()
    created = await c.post(
        f"/admin/v1/organizations/{org['id']}/keys", headers=admin, json={"role": "org_admin"}
    )
    assert created.status_code == 201
    secret = created.json()["secret"]
    acme = {"authorization": f"Bearer {secret}"}
    listed = (await c.get(f"/admin/v1/organizations/{org['id']}/keys", headers=acme)).json()
    assert [k["prefix"] for k in listed] == [secret[:11]] and "secret" not in listed[0]
    # acme's admin cannot see the default organisation's keys, nor create organisations
    default_org = (await c.get("/admin/v1/organizations", headers=admin)).json()[0]["id"]
    assert (await c.get(f"/admin/v1/organizations/{default_org}/keys", headers=acme)).status_code == 404
    assert (await c.post("/admin/v1/organizations", headers=acme, json={"name": "x"})).status_code == 403
    assert [o["name"] for o in (await c.get("/admin/v1/organizations", headers=acme)).json()] == ["acme"]
    # the new key works on the API until revoked
    assert (await c.get("/v1/models", headers=acme)).status_code == 200
    assert (await c.delete(f"/admin/v1/keys/{created.json()['id']}", headers=admin)).status_code == 200
    r = await c.get("/v1/models", headers=acme)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_admin_api_refuses_bad_input(gateway_env: Env) -> None:
    c, admin = gateway_env.client, {"authorization": f"Bearer {gateway_env.admin_key}"}
    assert (await c.post("/admin/v1/organizations", headers=admin, json={"name": ""})).status_code == 400
    await c.post("/admin/v1/organizations", headers=admin, json={"name": "dup"})
    dup = await c.post("/admin/v1/organizations", headers=admin, json={"name": "dup"})
    assert dup.status_code == 409 and dup.json()["error"]["param"] == "name"
    assert (await c.get("/admin/v1/organizations")).status_code == 401
    r = await c.post("/admin/v1/organizations/org_nope/keys", headers=admin, json={})
    assert r.status_code == 404 and "error" in r.json()


async def test_deployment_defaults_fill_omitted_sampling(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=1.5)
    first, second = w.received
    assert (first.sampling.temperature, first.sampling.top_p) == (0.3, 0.8)
    assert (second.sampling.temperature, second.sampling.top_p) == (1.5, 0.8)
    await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO)
    await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=7)
    assert [r.sampling.max_tokens for r in w.received[2:]] == [5, 7]


async def test_openapi_document_describes_the_api(gateway_env: Env) -> None:
    doc = (await gateway_env.client.get("/openapi.json")).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(doc["paths"])
    assert "/internal/bus/{stream}" not in doc["paths"]


async def test_client_gone_stops_generation_and_meters_what_was_made(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    w.delay, w.max_tokens = 0.05, 1000
    with pytest.raises(httpx.ReadTimeout):
        await gateway_env.client.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {gateway_env.admin_key}"},
            json={"model": MODEL, "messages": HELLO, "max_tokens": 1000},
            timeout=0.5,
        )
    (row,) = await ledger(gateway_env, 1)
    assert row.status == "cancelled"
    assert 0 < row.completion_tokens < 100  # billed for what was generated, then stopped


async def test_routes_to_the_worker_holding_the_prompt_prefix(gateway_env: Env) -> None:
    gw = gateway_env.app.state.gateway
    caller = await gw.authenticate(f"Bearer {gateway_env.admin_key}")
    target = await gw.catalog.resolve(caller, MODEL)
    tok = await gw.catalog.tokenizer(target)
    ids = tok.encode(tok.apply_chat_template(HELLO, add_generation_prompt=True))
    hashes = [h.hex() for h in hash_blocks(ids, 16, extra_keys(caller.cache_salt, None))]
    assert hashes  # the chat prompt fills at least one block
    idle, warm = await gateway_env.add_worker(), await gateway_env.add_worker()
    await gateway_env.app.state.bus.publish(
        KV, KvEvents(warm.worker_id, gateway_env.deployment_id, [KvOp("stored", hashes)])
    )
    for _ in range(100):
        if gw.fleet.overlap(warm.worker_id, hashes):
            break
        await asyncio.sleep(0.01)
    for _ in range(3):
        await sdk(gateway_env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert (len(warm.received), len(idle.received)) == (3, 0)


# --- issue 18: model retrieval, client request ids, and what a request may name --------------


async def test_models_retrieve_gives_the_listed_object_or_404(gateway_env: Env) -> None:
    client = sdk(gateway_env)
    (listed,) = (await client.models.list()).data
    raw = await client.models.with_raw_response.retrieve(MODEL)
    assert raw.parse() == listed and listed.owned_by == "tokenmill" and listed.object == "model"
    assert raw.headers["x-request-id"].startswith("req_")
    for name in ("gpt-17", "org/some-model"):  # a name with '/' goes percent-encoded
        with pytest.raises(openai.NotFoundError) as err:
            await client.models.retrieve(name)
        assert err.value.body == {
            "message": f"The model '{name}' does not exist or you do not have access to it.",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
        assert err.value.response.headers["x-request-id"].startswith("req_")


async def test_client_request_id_is_echoed_and_checked(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    client = sdk(gateway_env)
    mine = "my-trace 42 " + "x" * 500  # printable ASCII, 512 characters
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=1, extra_headers={"X-Client-Request-Id": mine}
    )
    assert raw.headers["x-client-request-id"] == mine
    # the server's own id is still minted, and keys the ledger
    (row,) = await ledger(gateway_env, 1)
    assert row.request_id == raw.headers["x-request-id"] != mine
    # errors carry it too, and answers to callers that sent none do not
    with pytest.raises(openai.NotFoundError) as err:
        await client.models.retrieve("gpt-17", extra_headers={"X-Client-Request-Id": "abc"})
    assert err.value.response.headers["x-client-request-id"] == "abc"
    assert "x-client-request-id" not in (await client.models.with_raw_response.list()).headers
    # longer than 512 characters, or not printable ASCII (a tab, a raw UTF-8 byte): refused
    for bad in ("x" * 513, "a\tb", "caf\xe9".encode("latin-1")):
        r = await gateway_env.client.get(
            "/v1/models",
            headers={"authorization": f"Bearer {gateway_env.admin_key}", "x-client-request-id": bad},  # type: ignore[dict-item]
        )
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "X-Client-Request-Id"
        assert r.headers["x-request-id"].startswith("req_") and "x-client-request-id" not in r.headers


# (endpoint, a valid body without the extra name)
ENDPOINTS = {
    "/v1/chat/completions": {"model": MODEL, "messages": HELLO, "max_tokens": 1},
    "/v1/completions": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1},
    "/v1/embeddings": {"model": "all-MiniLM-L6-v2", "input": "hello"},
}


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/chat/completions", "temprature"),
        ("/v1/completions", "max_new_tokens"),
        ("/v1/embeddings", "dimension"),
    ],
)
async def test_unknown_request_fields_are_refused_by_name(gateway_env: Env, path: str, name: str) -> None:
    w = await gateway_env.add_worker()
    r = await gateway_env.client.post(
        path,
        headers={"authorization": f"Bearer {gateway_env.admin_key}"},
        json={**ENDPOINTS[path], name: 1},
    )
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": {
            "message": f"Unrecognized request argument supplied: {name}",
            "type": "invalid_request_error",
            "param": name,
            "code": None,
        }
    }
    assert r.headers["x-request-id"].startswith("req_") and w.received == []


async def test_openai_parameters_we_ignore_are_accepted(gateway_env: Env) -> None:
    from tokenmill.openai_types import IGNORED_CHAT

    w = await gateway_env.add_worker()
    client = sdk(gateway_env)
    ignored = {
        "store": True,
        "metadata": {"team": "search"},
        "prompt_cache_key": "user-42",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
        "safety_identifier": "hashed-user-42",
        "reasoning_effort": "low",
        "verbosity": "low",
        "modalities": ["text"],
        "audio": {"voice": "alloy", "format": "mp3"},
        "prediction": {"type": "content", "content": "Hello"},
        "web_search_options": {"search_context_size": "low"},
    }
    assert set(ignored) == set(IGNORED_CHAT)  # every one the schemas module lists, and only those
    reply = await client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2, parallel_tool_calls=False, **ignored
    )
    assert reply.choices[0].message.content == "word0 word1 "
    plain = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    # ignored means ignored: the worker got the very same request
    with_them, without = w.received
    assert (with_them.prompt_token_ids, with_them.sampling) == (without.prompt_token_ids, without.sampling)
    assert plain.choices[0].message.content == reply.choices[0].message.content
    # an assistant message as OpenAI returns it, sent back as history, has fields of no use here
    history = [*HELLO, {"role": "assistant", "content": "Hi!", "refusal": None, "annotations": []}, *HELLO]
    await client.chat.completions.create(model=MODEL, messages=history, max_tokens=1)  # type: ignore[arg-type]
    # text completions: `best_of` equal to `n` (what LangChain sends) changes nothing
    await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, best_of=1)
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, best_of=3)
    assert err.value.body["param"] == "best_of"
    assert len(w.received) == 4


async def test_extensions_are_accepted_and_reach_the_worker(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    extensions = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True}
    await sdk(gateway_env).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=1, extra_body=extensions
    )
    await sdk(gateway_env).completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body=extensions)
    for sent in w.received:
        s = sent.sampling
        assert (s.top_k, s.min_p, s.repetition_penalty, s.ignore_eos) == (5, 0.1, 1.2, True)


@pytest.mark.parametrize("name", ["functions", "function_call", "moderation"])
async def test_openai_parameters_we_refuse_are_named(gateway_env: Env, name: str) -> None:
    w = await gateway_env.add_worker()
    value = {"functions": [{"name": "f"}], "function_call": "auto", "moderation": {"model": "m"}}[name]
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(gateway_env).chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=1, extra_body={name: value}
        )
    assert err.value.body["param"] == name
    assert "Unrecognized" not in err.value.body["message"] and "not supported" in err.value.body["message"]
    assert w.received == []


def test_every_openai_parameter_is_known_and_nothing_else_is() -> None:
    """The official SDK's request parameters, endpoint by endpoint, against the gateway's
    schemas: each is declared (acted on, refused by value, or ignored) or refused by name,
    and every declared name is OpenAI's or a listed extension."""
    from typing import Any

    import msgspec
    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    from tokenmill.openai_types import (
        PARAMETERS,
        ChatCompletionRequest,
        CompletionRequest,
        EmbeddingRequest,
    )

    def names(*typed: Any) -> set[str]:
        return {n for t in typed for n in t.__annotations__}

    sdk_params = {
        ChatCompletionRequest: names(
            chat_create_params.CompletionCreateParamsBase, chat_create_params.CompletionCreateParamsStreaming
        ),
        CompletionRequest: names(
            completion_create_params.CompletionCreateParamsBase,
            completion_create_params.CompletionCreateParamsStreaming,
        ),
        EmbeddingRequest: names(embedding_create_params.EmbeddingCreateParams),
    }
    for body, openai_names in sdk_params.items():
        declared = {f.encode_name for f in msgspec.structs.fields(body)}
        known = PARAMETERS[body]
        assert body.__struct_config__.forbid_unknown_fields, body
        assert openai_names - declared == set(known.refused), body
        assert declared - openai_names == set(known.extensions), body
        assert set(known.ignored) <= declared and not set(known.refused) & declared, body
