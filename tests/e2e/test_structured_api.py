"""Structured outputs and tool calls end to end (issue 7, acceptance 2): the official `openai`
SDK through the gateway (real app, SQLite) to a real worker serving the bundled SmolLM2.

`chat.completions.parse` with pydantic models (as a response format and as a tool), JSON
mode, vLLM-style guided regex and choice, every `tool_choice`, streamed tool calls, and a
conversation that sends the calls and their results back.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.gateway.conftest import INTERNAL, Env, gateway_env, serve
from tokenmill.modelstore import resolve_model
from tokenmill.protocol import GenerateRequest, Grammar, SamplingParams
from workers.engine import EngineConfig
from workers.generator import EngineGenerator, InvalidRequest
from workers.server import WorkerInfo, create_app

pytestmark = pytest.mark.slow

__all__ = ["gateway_env"]  # the fixture, imported for pytest to find

MODEL = "SmolLM2-135M-Instruct"  # the bundled model's name in `gateway_env`'s catalogue

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
STOCK_PARAMS = {
    "type": "object",
    "properties": {"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}},
    "required": ["ticker"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_stock_price",
            "description": "Latest price of a stock.",
            "parameters": STOCK_PARAMS,
        },
    },
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_stock_price": STOCK_PARAMS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Berlin right now?"}]


class Person(BaseModel):
    name: str
    age: int


class Weather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def generator(model_cache: Path) -> Iterator[EngineGenerator]:
    gen = EngineGenerator(
        EngineConfig(model=str(resolve_model("bundled:smollm2", model_cache)), kv_cache_gib=0.25)
    )
    yield gen
    gen.close()


@pytest.fixture
async def client(gateway_env: Env, generator: EngineGenerator) -> AsyncIterator[openai.AsyncOpenAI]:
    info = WorkerInfo("real-worker", MODEL, gateway_env.deployment_id)
    async with serve(create_app(generator, token=INTERNAL, info=info)) as url:
        await gateway_env.announce(info.worker_id, url, gateway_env.deployment_id, model=MODEL)
        yield openai.AsyncOpenAI(
            base_url=f"{gateway_env.client.base_url}/v1",
            api_key=gateway_env.admin_key,
            http_client=gateway_env.client,
            max_retries=0,
            timeout=120,
        )


def check_calls(calls: list[Any] | None, names: set[str]) -> list[dict[str, Any]]:
    """Each call's arguments, after checking ids, names and arguments against their schema."""
    assert calls, "no tool calls"
    out = []
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function" and c.function.name in names
        arguments = json.loads(c.function.arguments)
        jsonschema.validate(arguments, PARAMS[c.function.name])
        out.append(arguments)
    return out


async def test_parse_with_a_pydantic_model(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.parse(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": 'Extract the person as JSON with keys "name" and "age".\n'
                "Text: Maria Garcia is 37 years old and teaches music.",
            }
        ],
        response_format=Person,
        temperature=0,
        max_tokens=60,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert message.parsed == Person(name="Maria Garcia", age=37)


async def test_json_mode_and_guided_regex_and_choice(client: openai.AsyncOpenAI) -> None:
    ask = [{"role": "user", "content": "Describe a cat as a JSON object."}]
    r = await client.chat.completions.create(
        model=MODEL, messages=ask, response_format={"type": "json_object"}, temperature=0, max_tokens=80
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)

    phone = [{"role": "user", "content": "Give me a phone number."}]
    r = await client.chat.completions.create(
        model=MODEL,
        messages=phone,
        temperature=0,
        max_tokens=20,
        extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"},
    )
    # (Rust regex syntax: `\d` would be any Unicode digit, which this model happily picks.)
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].message.content or "")
    assert r.choices[0].finish_reason == "stop"

    r2 = await client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        temperature=0,
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r2.choices[0].text in ("yes", "no")


async def test_tool_choice_required_and_named(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80
    )
    choice = choice_of(r)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (args,) = check_calls(choice.message.tool_calls, {"get_weather", "get_stock_price"})
    assert args == {"city": "Berlin"}  # the model picks the weather and takes the city from the question

    ask_stock = [{"role": "user", "content": "How much is AAPL trading at?"}]
    r = await client.chat.completions.create(
        model=MODEL,
        messages=ask_stock,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_stock_price"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    choice = choice_of(r)
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls or []) == 1
    (args,) = check_calls(choice.message.tool_calls, {"get_stock_price"})
    assert args["ticker"] == "AAPL"


def choice_of(r: Any) -> Any:
    assert len(r.choices) == 1
    return r.choices[0]


async def test_tool_choice_none_and_auto(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")

    # auto: the model decides; whichever it does must be well formed.
    r = await client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, temperature=0, max_tokens=60
    )
    choice = choice_of(r)
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, {"get_weather", "get_stock_price"})
    else:
        assert choice.message.content and not choice.message.content.startswith("<")


async def test_streamed_tool_calls(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and all(d.id and d.function and d.function.name for d in deltas)
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    arguments = json.loads(deltas[0].function.arguments or "")  # type: ignore[union-attr]
    jsonschema.validate(arguments, PARAMS[deltas[0].function.name or ""])  # type: ignore[union-attr]

    # The SDK's stream helper puts the same call together.
    async with client.chat.completions.stream(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=80,
    ) as helper:
        final = await helper.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    (args,) = check_calls(final.choices[0].message.tool_calls, {"get_weather"})
    assert args["city"] == "Berlin"


async def test_parse_with_a_pydantic_tool_and_send_the_result_back(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "How warm is it in Madrid, in celsius?"}],
        tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    message = completion.choices[0].message
    assert message.tool_calls
    call = message.tool_calls[0]
    assert call.function.parsed_arguments == Weather(city="Madrid", unit="celsius")

    # The call and its result go back; with tool_choice "none" the model answers in text.
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "How warm is it in Madrid, in celsius?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 31, "unit": "celsius"}'},
        ],
        tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_worker_refuses_a_grammar_that_does_not_compile(generator: EngineGenerator) -> None:
    """The worker's own check, for /generate callers other than the gateway (which checks first)."""
    for grammar in (Grammar("regex", "[a-"), Grammar("json_schema", "{not json"), Grammar("cfg", "x")):
        req = GenerateRequest("r", [1, 2, 3], sampling=SamplingParams(grammar=grammar))
        with pytest.raises(InvalidRequest) as err:
            generator.validate(req)
        assert err.value.param == "grammar"
