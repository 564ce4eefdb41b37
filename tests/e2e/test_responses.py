"""OpenAI's Responses API (issue 18, acceptance 2) through `tokenmill serve` with the real
SmolLM2 worker, driven by the official `openai` SDK as a client written for OpenAI would:
create, stream, parse, a function tool, continuing with `previous_response_id` (served from
the prefix cache), and stored responses kept per organisation, deletable, or not kept."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel

from tests.e2e.serve import MODEL, Server
from tokenmill.modelstore import resolve_model
from tokenmill.settings import BUNDLED_MODEL
from tokenmill.tokenization import Tokenizer

pytestmark = pytest.mark.slow

CAPITAL = "What is the capital of France?"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": CITY,
}


class Capital(BaseModel):
    city: str
    country: str


@pytest.fixture(scope="module")
def server(shared_server: Server) -> Server:
    return shared_server.for_org("responses")


@pytest.fixture(scope="module")
def tok(model_cache: Path) -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(BUNDLED_MODEL, model_cache))


def usage_events(server: Server, request_id: str) -> list[tuple[object, ...]]:
    """The ledger's rows of one request, once the billing consumer has written them."""
    deadline = time.monotonic() + 30
    while True:
        rows = server.query(
            "SELECT prompt_tokens, completion_tokens FROM usage_events WHERE request_id = ?", request_id
        )
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_create_answers_and_is_metered_once(server: Server) -> None:
    raw = server.client().responses.with_raw_response.create(
        model=MODEL, input=CAPITAL, temperature=0, max_output_tokens=60
    )
    r = raw.parse()
    assert r.status == "completed" and "Paris" in r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage is not None and r.usage.input_tokens > 10 and r.usage.output_tokens > 0
    # one usage event, under the request's id, with the response's counts
    request_id = raw.headers["x-request-id"]
    assert r.id == "resp_" + request_id.removeprefix("req_")
    assert usage_events(server, request_id) == [(r.usage.input_tokens, r.usage.output_tokens)]


def test_stream_deltas_add_up_to_the_final_text(server: Server) -> None:
    kinds: list[str] = []
    deltas: list[str] = []
    with server.client().responses.stream(
        model=MODEL, input=CAPITAL, temperature=0, max_output_tokens=60
    ) as s:
        for event in s:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert len(deltas) > 2 and "".join(deltas) == final.output_text and "Paris" in final.output_text
    assert server.client().responses.retrieve(final.id).output_text == final.output_text


async def test_the_async_client(server: Server) -> None:
    async with server.aclient() as client:
        r = await client.responses.create(model=MODEL, input=CAPITAL, temperature=0, max_output_tokens=60)
        assert "Paris" in r.output_text
        async with client.responses.stream(
            model=MODEL, input=CAPITAL, temperature=0, max_output_tokens=60
        ) as s:
            deltas = [e.delta async for e in s if e.type == "response.output_text.delta"]
            final = await s.get_final_response()
        assert "".join(deltas) == final.output_text == r.output_text  # greedy: the same answer


def test_parse_with_a_pydantic_model(server: Server) -> None:
    """The SDK sends `text.format` as a strict JSON schema; the engine's grammar holds the
    output to it, so it always parses, streamed or not."""
    prompt = "Which city is the capital of France, and in which country is it? Answer as JSON."
    r = server.client().responses.parse(
        model=MODEL, input=prompt, text_format=Capital, temperature=0, max_output_tokens=80
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Capital) and r.output_parsed.city == "Paris"
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    with server.client().responses.stream(
        model=MODEL, input=prompt, text_format=Capital, temperature=0, max_output_tokens=80
    ) as s:
        final = s.get_final_response()
    assert final.output_parsed == r.output_parsed


def test_a_function_tool_call_and_its_output(server: Server) -> None:
    client = server.client()
    r = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0,
        max_output_tokens=40,
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    # streamed, the call arrives as a function_call item with its arguments events
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0,
        max_output_tokens=40,
    ) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_response()
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    assert streamed.output[0].type == "function_call" and streamed.output[0].arguments == call.arguments
    # the call's result goes back as the next turn: the model answers in text
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees."}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",  # a model this small would call again; the answer is wanted now
        temperature=0,
        max_output_tokens=16,  # some text is all that is checked
    )
    assert answer.output[0].type == "message" and answer.output_text
    kinds = [i.type for i in client.responses.input_items.list(answer.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]


def test_previous_response_id_continues_from_the_prefix_cache(server: Server, tok: Tokenizer) -> None:
    client = server.client()
    first = client.responses.create(
        model=MODEL,
        input="My name is Ada and I live in Lyon. Say hello to me.",
        temperature=0,
        max_output_tokens=30,
    )
    second = client.responses.create(
        model=MODEL,
        input="Where do I live?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=3,  # what it read is checked, not what it answered
    )
    items = client.responses.input_items.list(second.id, order="asc").data
    texts = [(i.role, i.content[0].text) for i in items]  # type: ignore[union-attr]
    assert texts == [
        ("user", "My name is Ada and I live in Lyon. Say hello to me."),
        ("assistant", first.output_text),
        ("user", "Where do I live?"),
    ]
    # the prompt the model read is that whole conversation...
    conversation = [{"role": role, "content": text} for role, text in texts]
    prompt = tok.encode(tok.apply_chat_template(conversation, add_generation_prompt=True))
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens == len(prompt) > first.usage.input_tokens + first.usage.output_tokens
    # ...and its start, the first request's prompt, came from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= 16


def test_another_organisation_gets_404(server: Server, other_org_client: openai.OpenAI) -> None:
    mine = server.client().responses.create(model=MODEL, input="Keep this private.", max_output_tokens=5)
    with pytest.raises(openai.NotFoundError):
        other_org_client.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as err:
        other_org_client.responses.create(model=MODEL, input="Go on.", previous_response_id=mine.id)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other_org_client.responses.delete(mine.id)
    assert server.client().responses.retrieve(mine.id).id == mine.id


def test_store_false_keeps_nothing_and_delete_removes(server: Server) -> None:
    client = server.client()
    unkept = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=3)
    assert server.query("SELECT count(*) FROM stored_responses WHERE id = ?", unkept.id) == [(0,)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Again", previous_response_id=unkept.id)
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert server.query("SELECT count(*) FROM stored_responses WHERE id = ?", kept.id) == [(1,)]
    client.responses.delete(kept.id)
    assert server.query("SELECT count(*) FROM stored_responses WHERE id = ?", kept.id) == [(0,)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
