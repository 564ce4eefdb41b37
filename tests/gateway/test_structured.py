"""Structured outputs and tools at the gateway (issue 7), against fake workers: what reaches
the worker (a grammar in the sampling parameters, tools in the prompt) and the 400s that
stop bad schemas, tools and choices before anything is admitted. The real model answers in
tests/e2e/test_structured_api.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.conftest import Env
from tests.gateway.test_api import HELLO, MODEL, sdk
from tokenmill.modelstore import resolve_model
from tokenmill.settings import BUNDLED_MODEL
from tokenmill.tokenization import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


async def test_response_formats_reach_the_worker_as_grammars(gateway_env: Env) -> None:
    worker = await gateway_env.add_worker()
    client = sdk(gateway_env)
    await client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    await client.chat.completions.create(model=MODEL, messages=HELLO, response_format={"type": "json_object"})
    await client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"guided_regex": "[0-9]+"})
    await client.completions.create(model=MODEL, prompt="Pick:", extra_body={"guided_choice": ["yes", "no"]})
    await client.chat.completions.create(model=MODEL, messages=HELLO, response_format={"type": "text"})
    grammars = [r.sampling.grammar for r in worker.received]
    assert grammars[0] is not None and grammars[0].kind == "json_schema"
    # strict: objects admit no other properties
    assert json.loads(grammars[0].spec) == {**PERSON, "additionalProperties": False}
    assert grammars[1] is not None and grammars[1].kind == "json_object"
    assert grammars[2] is not None and (grammars[2].kind, grammars[2].spec) == ("regex", "[0-9]+")
    assert grammars[3] is not None and (grammars[3].kind, grammars[3].spec) == ("lark", 'start: "yes" | "no"')
    assert grammars[4] is None


async def test_tools_are_offered_in_the_prompt_and_enforced_by_a_grammar(
    gateway_env: Env, model_dir: Path
) -> None:
    worker = await gateway_env.add_worker()
    client = sdk(gateway_env)
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}, "none"):
        await client.chat.completions.create(
            model=MODEL, messages=HELLO, tools=[WEATHER], tool_choice=choice, max_tokens=5
        )
    tok = Tokenizer.from_dir(model_dir)
    auto, required, named, none = worker.received
    # SmolLM2's template knows no tools: a system preamble describes them and the format.
    prompt = tok.decode(auto.prompt_token_ids, skip_special_tokens=False)
    assert "get_weather" in prompt and "<tool_call>" in prompt
    assert auto.sampling.grammar is not None and "start: answer | calls" in auto.sampling.grammar.spec
    assert required.sampling.grammar is not None and "start: calls" in required.sampling.grammar.spec
    assert named.sampling.grammar is not None and "call_0" in named.sampling.grammar.spec
    # "none": plain text, and the tools are not even mentioned.
    assert none.sampling.grammar is None
    assert "get_weather" not in tok.decode(none.prompt_token_ids, skip_special_tokens=False)


@pytest.fixture
def model_dir(model_cache: Path) -> Path:
    return resolve_model(BUNDLED_MODEL, model_cache)


def _schema_format(schema: object, name: str = "x") -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}


def _weather_with(parameters: object) -> dict[str, Any]:
    return {"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": parameters}}]}


def _choose(name: str) -> dict[str, Any]:
    return {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": name}}}


BAD: list[tuple[dict[str, Any], str]] = [
    # response_format and guided_*
    (_schema_format({"type": "nope"}), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    (_schema_format({}, name="bad name!"), "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "start: missing"}, "guided_grammar"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    # tools and tool_choice
    (_weather_with({"type": "object", "properties": {"city": {"type": 5}}}), "tools[0].function.parameters"),
    (_weather_with({"type": "string"}), "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    (_choose("get_time"), "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "guided_regex": "a+"}, "guided_regex"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
        "messages",
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD)
async def test_bad_schemas_and_tools_are_400_with_the_param(
    gateway_env: Env, body: dict[str, Any], param: str
) -> None:
    worker = await gateway_env.add_worker()
    r = await gateway_env.client.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {gateway_env.admin_key}"},
        json={"model": MODEL, "messages": HELLO, **body},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] is not None and err["param"].startswith(param), err
    assert not worker.received  # refused before admission: nothing generated, nothing billed


async def test_sdk_sees_a_bad_schema_as_bad_request(gateway_env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(gateway_env).chat.completions.create(
            model=MODEL, messages=HELLO, extra_body={"guided_json": {"type": "object", "minProperties": "x"}}
        )
    assert err.value.body["param"] == "guided_json"  # type: ignore[index]
