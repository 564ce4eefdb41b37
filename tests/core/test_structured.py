"""tokenmill.structured and the tool-call shaping of openai_shapes, without a model: what the
grammars built from OpenAI requests accept and refuse (checked with llguidance on the bundled
tokenizer), and how generated text becomes `tool_calls`, whole or streamed."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import llguidance
import msgspec
import pytest

from tokenmill.openai_shapes import CHAT, sse_events
from tokenmill.openai_types import ChatCompletionRequest, FunctionCall, ToolCall
from tokenmill.protocol import GenerateDelta, Grammar
from tokenmill.structured import (
    TOOL_CALL_TAG,
    may_be_tool_call,
    parse_tool_calls,
    render_tool_calls,
    response_grammar,
    source,
    strict_schema,
    tool_plan,
)
from tokenmill.tokenization import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
# A pydantic-style schema with $defs: its $ref must resolve inside the function's own block.
STOCK = {
    "type": "function",
    "function": {
        "name": "get_stock",
        "parameters": {
            "$defs": {"Ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}},
            "type": "object",
            "properties": {"ticker": {"$ref": "#/$defs/Ticker"}},
            "required": ["ticker"],
        },
    },
}


def request(**body: Any) -> ChatCompletionRequest:
    return msgspec.convert(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, ChatCompletionRequest
    )


@pytest.fixture(scope="module")
def ll_tokenizer(model_cache: Path) -> llguidance.LLTokenizer:
    from tokenmill.modelstore import resolve_model

    tok = Tokenizer.from_dir(resolve_model("bundled:smollm2", model_cache))
    return llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_ids)


def accepts(ll: llguidance.LLTokenizer, g: Grammar, text: str) -> bool:
    """Whether `text` is a complete output of `g` (fed as the model would: token by token)."""
    m = llguidance.LLMatcher(ll, source(g), log_level=0)
    return m.consume_tokens(ll.tokenize_str(text)) and m.is_accepting()


def call(name: str, arguments: dict[str, Any]) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def test_required_allows_only_valid_calls(ll_tokenizer: llguidance.LLTokenizer) -> None:
    plan = tool_plan(request(tools=[WEATHER, STOCK], tool_choice="required"))
    assert plan is not None and plan.choice == "required"
    g = plan.grammar
    ok = f"{TOOL_CALL_TAG}[{call('get_weather', {'city': 'Paris'})}]"
    assert accepts(ll_tokenizer, g, ok)
    both = [call("get_weather", {"city": "Oslo", "unit": "C"}), call("get_stock", {"ticker": "ACME"})]
    two = f"{TOOL_CALL_TAG}[{', '.join(both)}]"
    assert accepts(ll_tokenizer, g, two)
    assert not accepts(ll_tokenizer, g, "Sunny, I think.")
    assert not accepts(ll_tokenizer, g, f"{TOOL_CALL_TAG}[{call('get_time', {})}]")
    assert not accepts(ll_tokenizer, g, f"{TOOL_CALL_TAG}[{call('get_weather', {'town': 'Paris'})}]")
    assert not accepts(
        ll_tokenizer, g, f"{TOOL_CALL_TAG}[{call('get_weather', {'city': 'Oslo', 'unit': 'K'})}]"
    )
    assert not accepts(ll_tokenizer, g, f"{TOOL_CALL_TAG}[{call('get_stock', {'ticker': 'acme'})}]")  # $ref
    assert not accepts(ll_tokenizer, g, f"{TOOL_CALL_TAG}[]")


def test_named_and_single_call(ll_tokenizer: llguidance.LLTokenizer) -> None:
    named = {"type": "function", "function": {"name": "get_stock"}}
    plan = tool_plan(request(tools=[WEATHER, STOCK], tool_choice=named, parallel_tool_calls=False))
    assert plan is not None and [f.name for f in plan.callable] == ["get_stock"]
    one = f"{TOOL_CALL_TAG}[{call('get_stock', {'ticker': 'ACME'})}]"
    assert accepts(ll_tokenizer, plan.grammar, one)
    assert not accepts(
        ll_tokenizer, plan.grammar, f"{TOOL_CALL_TAG}[{call('get_weather', {'city': 'Oslo'})}]"
    )
    assert not accepts(ll_tokenizer, plan.grammar, one[:-1] + ", " + one[len(TOOL_CALL_TAG) + 1 :])


def test_auto_allows_text_or_a_call(ll_tokenizer: llguidance.LLTokenizer) -> None:
    plan = tool_plan(request(tools=[WEATHER]))
    assert plan is not None and plan.choice == "auto"
    assert accepts(ll_tokenizer, plan.grammar, "It is sunny in Paris.\nEnjoy!")
    assert accepts(ll_tokenizer, plan.grammar, f"{TOOL_CALL_TAG}[{call('get_weather', {'city': 'Paris'})}]")
    assert not accepts(ll_tokenizer, plan.grammar, f"{TOOL_CALL_TAG} I will not call")
    # With a JSON response format, the text answer is that JSON.
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": {"type": "object", "required": ["x"]}},
    }
    plan = tool_plan(request(tools=[WEATHER], response_format=fmt))
    assert plan is not None
    assert accepts(ll_tokenizer, plan.grammar, '{"x": 1}')
    assert not accepts(ll_tokenizer, plan.grammar, "plain text")


def test_none_and_no_tools_mean_plain_text() -> None:
    assert tool_plan(request(tools=[WEATHER], tool_choice="none")) is None
    assert tool_plan(request()) is None


def test_strict_closes_objects_but_not_properties_named_like_keywords() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {"type": "string"}}}},
        "$defs": {"D": {"type": "object"}},
        "additionalProperties": True,
    }
    out = strict_schema(schema)
    assert out["additionalProperties"] is True  # said explicitly: kept
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]  # the property map itself untouched
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert schema["$defs"]["D"] == {"type": "object"}  # a copy


def test_guided_options_compile(ll_tokenizer: llguidance.LLTokenizer) -> None:
    g = response_grammar(request(guided_choice=['say "hi"', "bye"]))
    assert g is not None and accepts(ll_tokenizer, g, 'say "hi"') and not accepts(ll_tokenizer, g, "hi")
    g = response_grammar(request(guided_regex=r"\d{3}"))
    assert g is not None and accepts(ll_tokenizer, g, "123") and not accepts(ll_tokenizer, g, "12a")


def test_parse_tool_calls() -> None:
    text = f'{TOOL_CALL_TAG}[{{"name": "f", "arguments": {{"a": "é"}}}}, {{"name": "g", "arguments": {{}}}}]'
    calls = parse_tool_calls(text)
    assert calls is not None and [c.function.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].function.arguments) == {"a": "é"}
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("plain") is None
    assert parse_tool_calls(f'{TOOL_CALL_TAG}[{{"name": "f", "argu') is None  # cut short
    assert may_be_tool_call("") and may_be_tool_call("<tool") and may_be_tool_call(text)
    assert not may_be_tool_call("<b>") and not may_be_tool_call("Hi")
    # written back into a prompt in the same format
    back = render_tool_calls([ToolCall(id="call_1", function=FunctionCall("f", '{"a": 1}'))])
    assert back == f'{TOOL_CALL_TAG}[{{"name": "f", "arguments": {{"a": 1}}}}]'


async def _deltas(*parts: str) -> AsyncGenerator[GenerateDelta, None]:
    for i, p in enumerate(parts):
        yield GenerateDelta(text=p, finish_reason="stop" if i == len(parts) - 1 else None)


async def stream(*parts: str, tools: bool = True) -> list[dict[str, Any]]:
    deltas = _deltas(*parts)
    first = await anext(deltas)
    events = [e async for e in sse_events(CHAT, "chatcmpl-1", 0, "m", first, deltas, False, tools)]
    assert events[-1] == b"data: [DONE]\n\n"
    return [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]


async def test_streamed_tool_call_is_held_back_then_sent_whole() -> None:
    chunks = await stream("<to", "ol_call>[", '{"name": "f", ', '"arguments": {"a": 1}}', "]")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}  # the role goes out at once
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert all("content" not in d or d["content"] == "" for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_streamed_text_flows_once_it_cannot_be_a_call() -> None:
    chunks = await stream("<", "b>Hello", " world")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "<b>Hello world"
    assert chunks[1]["choices"][0]["delta"]["content"] == "<b>Hello"  # released as soon as known
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # A call cut short is returned as the text it is.
    chunks = await stream("<tool_call>", '[{"name": "f"')
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == '<tool_call>[{"name": "f"'
    )
