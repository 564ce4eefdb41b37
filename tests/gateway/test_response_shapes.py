"""Responses <-> chat (gateway/response_shapes.py), without a server: a Responses request as
the chat completion the gateway serves, and what the chat path generates as the Responses
objects and event stream, read back with the official SDK's own types and stream
accumulator (what `client.responses.stream` runs on each event)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.response_events import Chunk, response_events
from gateway.response_shapes import (
    chat_request,
    continued,
    draft,
    input_items,
)
from tokenmill.errors import APIError
from tokenmill.openai_responses import ResponseCreateRequest, ResponseObject
from tokenmill.openai_types import NamedToolChoice, Usage
from tokenmill.structured import TOOL_CALL_TAG

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def request(**body: Any) -> ResponseCreateRequest:
    return msgspec.convert({"model": "m", **body}, ResponseCreateRequest)


def test_a_text_input_is_one_user_message() -> None:
    req = request(input="Hi there", instructions="Be brief.", max_output_tokens=7, temperature=0.2)
    items = input_items(req)
    assert [(i["type"], i["role"], i["content"]) for i in items] == [
        ("message", "user", [{"type": "input_text", "text": "Hi there"}])
    ]
    assert items[0]["id"].startswith("msg_")
    chat = chat_request(req, items)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi there")]
    assert (chat.max_completion_tokens, chat.temperature, chat.tools, chat.response_format) == (
        7,
        0.2,
        None,
        None,
    )


def test_calls_and_their_outputs_become_assistant_tool_calls_and_tool_messages() -> None:
    req = request(
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
            {"type": "message", "role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "get_weather",
                "arguments": '{"city": "Rome"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    items = input_items(req)
    assert [i["type"] for i in items] == ["message"] * 3 + ["function_call"] * 2 + [
        "function_call_output"
    ] * 2
    assert items[1]["content"] == [{"type": "input_text", "text": "Weather in Paris and Rome?"}]
    assert items[2]["content"] == [{"type": "output_text", "text": "Let me check.", "annotations": []}]
    assert items[6]["output"] == "rain"
    chat = chat_request(req, items)
    roles = [m.role for m in chat.messages]
    assert roles == ["developer", "user", "assistant", "tool", "tool"]
    assistant = chat.messages[2]
    assert assistant.content == "Let me check."
    assert [(c.id, c.function.arguments) for c in assistant.tool_calls or []] == [
        ("c1", '{"city": "Paris"}'),
        ("c2", '{"city": "Rome"}'),
    ]
    assert [(m.tool_call_id, m.content) for m in chat.messages[3:]] == [("c1", "sunny"), ("c2", "rain")]
    # Responses' flat function tools, strict unless they say otherwise (OpenAI's default there).
    (tool,) = chat.tools or []
    assert (tool.function.name, tool.function.strict) == ("get_weather", True)
    assert tool.function.parameters == WEATHER["parameters"]
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "get_weather"


def test_a_json_schema_text_format_is_the_chat_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    chat = chat_request(request(input="x", text={"format": fmt}), input_items(request(input="x")))
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    js = chat.response_format.json_schema
    assert js is not None and (js.name, js.schema, js.strict) == ("thing", schema, True)
    obj = chat_request(request(input="x", text={"format": {"type": "json_object"}}), [])
    assert obj.response_format is not None and obj.response_format.type == "json_object"


def test_a_continued_conversation_is_the_previous_input_its_output_then_the_new_input() -> None:
    first = input_items(request(input="Name a colour."))
    said = {"id": "msg_out", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]}  # fmt: skip
    previous = {"id": "resp_1", "output": [said]}
    new = input_items(request(input="Another?"))
    conversation = continued(first, previous, new)
    assert [i["id"] for i in conversation] == [first[0]["id"], "msg_out", new[0]["id"]]
    chat = chat_request(request(input="Another?"), conversation)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("user", "Name a colour."),
        ("assistant", "Blue."),
        ("user", "Another?"),
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0]"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    req = request(**body)
    with pytest.raises(APIError) as err:
        chat_request(req, input_items(req))
    assert (err.value.status, err.value.param) == (400, param), err.value.message


# --- the event stream ------------------------------------------------------------------------


async def generated(
    *texts: str, finish: str = "stop", fail: APIError | None = None
) -> AsyncGenerator[Chunk, None]:
    """What the chat path yields for a generation of these texts (running usage totals)."""
    for i, text in enumerate(texts):
        done = i == len(texts) - 1 and fail is None
        yield text, done, done and finish == "length", Usage(20, i + 1, 21 + i)
    if fail is not None:
        raise fail


def base(req: ResponseCreateRequest) -> ResponseObject:
    return draft(req, "resp_test", "m", chat_request(req, input_items(req)))


async def run(
    req: ResponseCreateRequest, chunks: AsyncGenerator[Chunk, None], tools: bool = False
) -> tuple[list[Any], list[ResponseObject]]:
    """The events as the SDK parses them (strictly, each `event:` its `data`'s type), and what
    was stored."""
    stored: list[ResponseObject] = []

    async def store(final: ResponseObject) -> None:
        stored.append(final)

    events = []
    async for raw in response_events(base(req), chunks, tools, store):
        head, data = raw.decode().removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        events.append(EVENT.validate_python(payload, strict=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, stored


async def test_text_streams_as_one_message_and_the_sdk_accumulates_it() -> None:
    req = request(input="Hi", store=True)
    events, stored = await run(req, generated("Hello", "", " world", "!"))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,  # the empty delta is not sent
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    state = ResponseStreamState(input_tools=[], text_format=omit)
    for e in events:
        state.handle_event(e)
    final = state._completed_response
    assert final is not None and final.output_text == "Hello world!"
    assert final.status == "completed" and final.usage is not None and final.usage.output_tokens == 4
    # stored before the last event, exactly as answered
    (kept,) = stored
    assert Response.model_validate(msgspec.to_builtins(kept), strict=True) == events[-1].response


async def test_a_cut_short_answer_ends_incomplete() -> None:
    events, stored = await run(request(input="Hi"), generated("a", "b", finish="length"))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete" and stored[0].status == "incomplete"


async def test_tool_calls_are_held_back_and_stream_as_function_call_items() -> None:
    req = request(input="Weather?", tools=[WEATHER])
    call = TOOL_CALL_TAG + '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    events, _ = await run(req, generated(call[:5], call[5:20], call[20:]), tools=True)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    state = ResponseStreamState(input_tools=[WEATHER], text_format=omit)  # type: ignore[list-item]
    for e in events:
        state.handle_event(e)
    final = state._completed_response
    assert final is not None
    (item,) = final.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Paris"} and item.call_id.startswith("call_")


async def test_text_that_only_looked_like_a_call_is_answered_as_text() -> None:
    events, _ = await run(request(input="Hi", tools=[WEATHER]), generated("<", "b>bold</b>"), tools=True)
    final = events[-1].response
    assert final.output_text == "<b>bold</b>" and final.output[0].type == "message"


async def test_a_failure_mid_stream_ends_with_an_error_event_and_response_failed() -> None:
    fail = APIError(503, "The model worker failed; please retry.", code="worker_error")
    events, stored = await run(request(input="Hi"), generated("Hel", "lo", fail=fail))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == fail.message and events[-2].code == "worker_error"
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    assert stored == []  # a failed response is not kept
