"""`/v1/responses` on the gateway (real app and server, SQLite), driven by the official SDK
against fake workers: served through the chat path (same prompt, one usage event), kept
per organisation, continued, listed, deleted, and refused as OpenAI refuses. The real model
end to end is tests/e2e/test_responses.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from sqlalchemy import func, select

from billing.models import UsageEvent
from control_plane.responses.models import StoredResponse
from tests.gateway.conftest import Env
from tokenmill.tokenization import Tokenizer

MODEL = "SmolLM2-135M-Instruct"
EVENT = TypeAdapter(ResponseStreamEvent)


def sdk(env: Env, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{env.client.base_url}/v1",
        api_key=key or env.admin_key,
        http_client=env.client,
        max_retries=0,
    )


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def ledger(env: Env, n: int) -> list[UsageEvent]:
    for _ in range(200):
        async with env.app.state.sessionmaker() as s:
            rows = list(await s.scalars(select(UsageEvent).order_by(UsageEvent.id)))
        if len(rows) >= n:
            return rows
        await asyncio.sleep(0.02)
    raise AssertionError(f"ledger has {len(rows)} rows, wanted {n}")


async def stored_count(env: Env) -> int:
    async with env.app.state.sessionmaker() as s:
        return int(await s.scalar(select(func.count()).select_from(StoredResponse)) or 0)


async def tokenizer(env: Env) -> Tokenizer:
    gw = env.app.state.gateway
    return await gw.catalog.tokenizer(
        await gw.catalog.resolve(await gw.authenticate(f"Bearer {env.admin_key}"), MODEL)
    )


async def test_a_response_is_a_chat_completion_underneath_and_is_kept(gateway_env: Env) -> None:
    env = gateway_env
    w = await env.add_worker()
    raw = await env.client.post(
        "/v1/responses",
        headers=auth(env.admin_key),
        json={"model": MODEL, "input": "Say hello.", "instructions": "Be brief.", "max_output_tokens": 3},
    )
    assert raw.status_code == 200, raw.text
    r = Response.model_validate_json(raw.content, strict=True)  # exactly the SDK's type
    request_id = raw.headers["x-request-id"]
    assert r.id == "resp_" + request_id.removeprefix("req_") and r.model == MODEL
    assert r.output_text == "word0 word1 word2 " and r.output[0].type == "message"
    # The fake worker stops at max_tokens: OpenAI's "incomplete" for max_output_tokens.
    assert (
        r.status == "incomplete"
        and r.incomplete_details
        and r.incomplete_details.reason == "max_output_tokens"
    )
    assert r.instructions == "Be brief." and raw.json()["store"] is True
    # The very prompt /v1/chat/completions would send: instructions as the system message.
    tok = await tokenizer(env)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    (sent,) = w.received
    assert sent.prompt_token_ids == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    assert sent.sampling.max_tokens == 3
    assert (
        r.usage is not None
        and r.usage.input_tokens == len(sent.prompt_token_ids)
        and r.usage.output_tokens == 3
    )
    # Metered like chat: one usage event, under the request's id.
    (row,) = await ledger(env, 1)
    assert (row.request_id, row.prompt_tokens, row.completion_tokens) == (request_id, r.usage.input_tokens, 3)
    # Kept: the same object back, and the conversation it answered.
    client = sdk(env)
    assert (await client.responses.retrieve(r.id)) == r
    items = await client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say hello.")]


async def test_the_event_stream_is_openais_and_ends_with_the_kept_response(gateway_env: Env) -> None:
    env = gateway_env
    await env.add_worker()
    events: list[Any] = []
    async with env.client.stream(
        "POST",
        "/v1/responses",
        headers=auth(env.admin_key),
        json={"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        request_id = r.headers["x-request-id"]
        body = (await r.aread()).decode()
    for block in body.strip().split("\n\n"):
        head, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        events.append(EVENT.validate_python(payload, strict=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4:8] == ["response.output_text.delta"] * 4
    assert kinds[8:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == "word0 word1 word2 word3 "
    assert (await sdk(env).responses.retrieve(final.id)) == final
    assert final.id == "resp_" + request_id.removeprefix("req_")
    (row,) = await ledger(env, 1)  # metered once, as a chat completion is
    assert (row.request_id, row.completion_tokens) == (request_id, final.usage.output_tokens)


async def test_previous_response_id_continues_the_conversation(gateway_env: Env) -> None:
    env = gateway_env
    w = await env.add_worker()
    client = sdk(env)
    first = await client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=2)
    second = await client.responses.create(
        model=MODEL, input="Another one?", previous_response_id=first.id, max_output_tokens=2
    )
    assert second.previous_response_id == first.id
    tok = await tokenizer(env)
    conversation = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "word0 word1 "},
        {"role": "user", "content": "Another one?"},
    ]
    assert w.received[1].prompt_token_ids == tok.encode(
        tok.apply_chat_template(conversation, add_generation_prompt=True)
    )
    # its input items: the first exchange, then the new input; paged as OpenAI pages them
    items = await client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message"] * 3
    assert [i.content[0].text for i in items.data] == ["Name a colour.", "word0 word1 ", "Another one?"]
    assert items.data[1].id == first.output[0].id and items.data[1].role == "assistant"
    page = await client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in page.data] == [items.data[2].id, items.data[1].id] and page.has_more
    rest = await client.responses.input_items.list(second.id, limit=2, after=page.data[-1].id)
    assert [i.id for i in rest.data] == [items.data[0].id] and not rest.has_more
    # a third turn carries the whole conversation; deleting the first breaks nothing
    await client.responses.delete(first.id)
    third = await client.responses.create(model=MODEL, input="And a third?", previous_response_id=second.id)
    assert len((await client.responses.input_items.list(third.id)).data) == 5


async def test_store_false_keeps_nothing(gateway_env: Env) -> None:
    env = gateway_env
    w = await env.add_worker()
    client = sdk(env)
    r = await client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=1)
    assert r.output_text == "word0 " and await stored_count(env) == 0
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        await client.responses.create(model=MODEL, input="Again", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"
    assert len(w.received) == 1  # the refused continuation never reached a worker


async def test_another_organisation_never_sees_a_response(gateway_env: Env) -> None:
    env = gateway_env
    w = await env.add_worker()
    mine = await sdk(env).responses.create(model=MODEL, input="Secret plans.", max_output_tokens=1)
    other = sdk(env, (await env.tenant("other-org")).key)
    for call in (
        other.responses.retrieve(mine.id),
        other.responses.input_items.list(mine.id),
        other.responses.delete(mine.id),
        other.responses.create(model=MODEL, input="Go on.", previous_response_id=mine.id),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            await call
        # the same answer as for an id that never existed
        assert err.value.body["message"] == f"No response found with id '{mine.id}'."
    assert len(w.received) == 1
    assert (await sdk(env).responses.retrieve(mine.id)).id == mine.id  # still there for its owner


async def test_delete(gateway_env: Env) -> None:
    env = gateway_env
    await env.add_worker()
    client = sdk(env)
    r = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    deleted = await env.client.delete(f"/v1/responses/{r.id}", headers=auth(env.admin_key))
    assert deleted.status_code == 200 and deleted.json() == {
        "id": r.id,
        "object": "response.deleted",
        "deleted": True,
    }
    assert await stored_count(env) == 0
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"temprature": 0.5}, "temprature", "Unrecognized request argument supplied: temprature"),
        ({"conversation": "conv_1"}, "conversation", "continue a conversation with 'previous_response_id'"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "'prompt' is not supported"),
        ({"background": True}, "background", "Background responses are not supported"),
        (
            {"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
            "tools[0].type",
            "function tools",
        ),
    ],
)
async def test_what_is_not_served_is_refused_before_any_work(
    gateway_env: Env, extra: dict[str, Any], param: str, message: str
) -> None:
    env = gateway_env
    w = await env.add_worker()
    r = await env.client.post(
        "/v1/responses", headers=auth(env.admin_key), json={"model": MODEL, "input": "Hi", **extra}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    )
    assert w.received == []


async def test_openais_parameters_that_mean_nothing_here_are_accepted_and_change_nothing(
    gateway_env: Env,
) -> None:
    from tokenmill.openai_responses import IGNORED_RESPONSES

    env = gateway_env
    w = await env.add_worker()
    ignored = {
        "reasoning": {"effort": "low", "summary": "auto"},
        "max_tool_calls": 3,
        "stream_options": {"include_obfuscation": False},
        "prompt_cache_key": "user-42",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "implicit"},
        "safety_identifier": "hashed-user-42",
        "image": {"context_compression": "auto"},
        "access_programs": {"cyber": "standard"},
        "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
    }
    assert set(ignored) == set(IGNORED_RESPONSES)
    client = sdk(env)
    plain = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    loaded = await client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, truncation="disabled", extra_body=ignored
    )
    assert loaded.output_text == plain.output_text
    a, b = w.received
    assert (a.prompt_token_ids, a.sampling) == (b.prompt_token_ids, b.sampling)


def test_every_openai_responses_parameter_is_known_and_nothing_else_is() -> None:
    """The SDK's parameters of `responses.create` against the request's schema: each is
    declared (acted on, refused by value, or ignored) or refused by name."""
    import msgspec
    from openai.types.responses import response_create_params as params

    from tokenmill.openai_responses import RESPONSES_PARAMETERS, ResponseCreateRequest

    openai_names = {
        n
        for t in (params.ResponseCreateParamsBase, params.ResponseCreateParamsStreaming)
        for n in t.__annotations__
    }
    declared = {f.encode_name for f in msgspec.structs.fields(ResponseCreateRequest)}
    known = RESPONSES_PARAMETERS
    assert ResponseCreateRequest.__struct_config__.forbid_unknown_fields
    assert openai_names - declared == set(known.refused)
    assert declared - openai_names == set(known.extensions) == set()
    assert set(known.ignored) <= declared and not set(known.refused) & declared


async def test_text_format_and_tools_reach_the_worker_as_grammars(gateway_env: Env) -> None:
    env = gateway_env
    w = await env.add_worker()
    client = sdk(env)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    await client.responses.create(
        model=MODEL,
        input="Give me a.",
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}},
        max_output_tokens=2,
    )
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    r = await client.responses.create(model=MODEL, input="Weather?", tools=[tool], max_output_tokens=2)
    fmt, calls = w.received
    assert fmt.sampling.grammar is not None and fmt.sampling.grammar.kind == "json_schema"
    assert json.loads(fmt.sampling.grammar.spec) == schema
    assert calls.sampling.grammar is not None and calls.sampling.grammar.kind == "lark"
    assert "get_weather" in (await tokenizer(env)).decode(calls.prompt_token_ids)  # offered in the prompt
    # the tools answered back in Responses' flat shape, strict by default
    assert [(t.type, t.name, t.strict) for t in r.tools] == [("function", "get_weather", True)]


async def test_an_expired_response_is_404_everywhere(gateway_env: Env) -> None:
    from datetime import timedelta

    from sqlalchemy import update

    from tokenmill.db import utcnow

    env = gateway_env
    w = await env.add_worker()
    client = sdk(env)
    r = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    expected = utcnow() + timedelta(days=env.app.state.settings.response_retention_days)
    async with env.app.state.sessionmaker() as s, s.begin():
        row = await s.get(StoredResponse, r.id)
        assert row is not None and abs((row.expires_at - expected).total_seconds()) < 60  # 30 days by default
        await s.execute(update(StoredResponse).values(expires_at=utcnow() - timedelta(seconds=1)))
    for call in (
        client.responses.retrieve(r.id),
        client.responses.input_items.list(r.id),
        client.responses.delete(r.id),
        client.responses.create(model=MODEL, input="More", previous_response_id=r.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    assert len(w.received) == 1
