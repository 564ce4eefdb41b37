"""Structured outputs and tool calls, the OpenAI side: requests in, a grammar for the engine
out; generated text in, OpenAI `tool_calls` out.

Shared by the gateway and a worker's own OpenAI endpoints (through `openai_shapes`). The
engine only ever sees a `protocol.Grammar`; every grammar is compiled here once with
llguidance (no tokenizer needed) so a bad schema is a 400 naming its field, never a failure
on the worker.

Tool calls have one format whatever the model, the one the grammar enforces:

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

`auto` lets the model choose between that and plain text (which then may not start with
"<"); `required` and a named function allow only the call. A chat template that knows
`tools` renders them itself; otherwise (SmolLM2's ChatML) a system preamble describes the
functions and this format.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

import llguidance

from tokenmill.errors import APIError
from tokenmill.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    ToolCall,
)
from tokenmill.protocol import Grammar

TOOL_CALL_TAG = "<tool_call>"
# Generated JSON layout (as the engine lays out json_schema grammars): compact with one space.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# --- response_format and guided_* ----------------------------------------------------------


def response_grammar(req: ChatCompletionRequest | CompletionRequest) -> Grammar | None:
    """The grammar a request's response_format or guided_* option asks for (400 if invalid)."""
    option = _response_option(req)
    return option[1] if option else None


def _response_option(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, Grammar] | None:
    """(the request field, its grammar) of the structured output option given, if any."""
    given: list[tuple[str, Grammar]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", Grammar("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(
                400, "response_format of type 'json_schema' needs 'json_schema'.", param="response_format"
            )
        schema = fmt.json_schema.schema if fmt.json_schema.schema is not None else {}
        if fmt.json_schema.strict:
            schema = strict_schema(schema)
        given.append(("response_format.json_schema.schema", Grammar("json_schema", json.dumps(schema))))
    if req.guided_json is not None:
        given.append(("guided_json", Grammar("json_schema", json.dumps(req.guided_json))))
    if req.guided_regex is not None:
        given.append(("guided_regex", Grammar("regex", req.guided_regex)))
    if req.guided_choice is not None:
        given.append(
            ("guided_choice", Grammar("lark", "start: " + " | ".join(map(_lark_str, req.guided_choice))))
        )
    if req.guided_grammar is not None:
        given.append(("guided_grammar", Grammar("lark", req.guided_grammar)))
    if len(given) > 1:
        raise APIError(
            400,
            f"Give one structured output option, not {', '.join(p for p, _ in given)}.",
            param=given[1][0],
        )
    return (given[0][0], check(given[0][1], given[0][0])) if given else None


def strict_schema(schema: Any) -> Any:
    """A copy where objects that do not say otherwise admit no extra properties: OpenAI's
    `strict` (which also requires every property to be listed as required; that is left to
    the schema rather than refused). Walks only where JSON Schema puts subschemas, so a
    property that happens to be named "properties" is not mistaken for one."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(v) for v in out[key]]
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def source(g: Grammar) -> str:
    """llguidance's grammar text of `g` (the engine builds the same, with its JSON layout)."""
    if g.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(g.spec)
    if g.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if g.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(g.spec)
    if g.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(g.spec)
    raise ValueError(f"unknown grammar kind {g.kind!r}")


def check(g: Grammar, param: str) -> Grammar:
    """`g`, if it compiles; else a 400 naming `param`."""
    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source(g))
    except ValueError as exc:  # e.g. a schema that is not a JSON object
        failed, messages = True, [str(exc)]
    if failed:  # warnings (an unsupported "format", say) are not worth refusing the request
        raise APIError(400, f"Invalid {param}: {' '.join(messages).strip()}", param=param)
    return g


def _lark_str(text: str) -> str:
    # A JSON string literal is a valid Lark string literal.
    return json.dumps(text)


# --- tools ----------------------------------------------------------------------------------


@dataclass(slots=True)
class ToolPlan:
    """How a request's tools are offered and enforced."""

    choice: str  # auto | required | named
    offered: list[FunctionDefinition]  # described to the model
    callable: list[FunctionDefinition]  # what the grammar lets it call
    grammar: Grammar


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """None when the model answers in plain text (no tools, or tool_choice "none")."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    functions = [t.function for t in req.tools]
    names = [f.name for f in functions]
    for i, f in enumerate(functions):
        if names.index(f.name) != i:
            raise APIError(400, f"Two tools are named '{f.name}'.", param=f"tools[{i}].function.name")
        param = f"tools[{i}].function.parameters"
        if f.parameters is not None and f.parameters.get("type", "object") != "object":
            raise APIError(400, "Function parameters must be the JSON schema of an object.", param=param)
        check(Grammar("json_schema", json.dumps(arguments_schema(f))), param)
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names the function '{choice.function.name}', which is not among the tools.",
                param="tool_choice",
            )
        named = [functions[names.index(choice.function.name)]]
        plan = ToolPlan("named", named, named, Grammar("lark"))
    else:
        plan = ToolPlan(choice or "auto", functions, functions, Grammar("lark"))
    answer = _answer_rule(req) if plan.choice == "auto" else None
    spec = _calls_grammar(plan.callable, req.parallel_tool_calls is not False, answer)
    plan.grammar = check(Grammar("lark", spec), "tools")
    return plan


def arguments_schema(f: FunctionDefinition) -> dict[str, Any]:
    """The JSON schema a call's arguments must match (an object; strict as OpenAI's)."""
    schema = dict(f.parameters) if f.parameters is not None else {}
    schema.setdefault("type", "object")
    return strict_schema(schema) if f.strict else schema


def _answer_rule(req: ChatCompletionRequest) -> str:
    """What `auto` allows besides calls: free text not starting with "<" (so the tag decides),
    or, with a JSON response format, that JSON."""
    option = _response_option(req)
    if option is None:
        return r"/[^<](.|\n)*/"
    param, g = option
    if g.kind == "json_object":
        return "%json " + json.dumps({"x-guidance": _LAYOUT, "type": "object"})
    if g.kind == "json_schema":
        schema = json.loads(g.spec)
        if isinstance(schema, dict):
            return "%json " + json.dumps({"x-guidance": _LAYOUT, **schema})
    raise APIError(
        400, "With tools, only a JSON schema can shape the text answer.", param=param.split(".")[0]
    )


def _calls_grammar(functions: list[FunctionDefinition], parallel: bool, answer: str | None) -> str:
    """A Lark grammar: the tag, then a JSON array of calls, each function's arguments under
    its own schema (a `%json` block of its own, so the schema's `$ref`s keep their root)."""
    lines = ["start: answer | calls", f"answer: {answer}"] if answer is not None else ["start: calls"]
    more = '("," " " call)*' if parallel else ""
    lines.append(f'calls: {_lark_str(TOOL_CALL_TAG)} "[" call {more} "]"')
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, f in enumerate(functions):
        head = _lark_str('{"name": ' + json.dumps(f.name) + ', "arguments": ')
        lines.append(f'call_{i}: {head} args_{i} "}}"')
        lines.append(f"args_{i}: %json " + json.dumps({"x-guidance": _LAYOUT, **arguments_schema(f)}))
    return "\n".join(lines) + "\n"


def tool_preamble(plan: ToolPlan) -> str:
    """The system text that offers the tools to a model whose chat template cannot."""
    described = "\n".join(
        json.dumps(
            {"name": f.name, "description": f.description or "", "parameters": arguments_schema(f)},
            ensure_ascii=False,
        )
        for f in plan.offered
    )
    rule = {
        "auto": "If a function helps to answer, call it; otherwise answer in plain text.",
        "required": "You must call at least one function now.",
        "named": f"You must call the function {plan.callable[0].name} now.",
    }[plan.choice]
    example = TOOL_CALL_TAG + '[{"name": "' + plan.callable[0].name + '", "arguments": {...}}]'
    return (
        "You can call these functions (one a line: name, description and the JSON schema of "
        f"its arguments):\n{described}\n\n"
        f"To call functions, reply with {TOOL_CALL_TAG} followed by a JSON list of calls and "
        f"nothing else, for example: {example}. Take the argument values from the conversation. " + rule
    )


# --- generated text -> tool calls ------------------------------------------------------------


def parse_tool_calls(text: str) -> list[ToolCall] | None:
    """The calls in a generated text, or None if it is not (or not a complete) call."""
    if not text.startswith(TOOL_CALL_TAG):
        return None
    try:
        calls = json.loads(text[len(TOOL_CALL_TAG) :])
    except ValueError:
        return None  # cut short (max_tokens, a stop string): the caller returns it as text
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for c in calls:
        if not (
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)
        ):
            return None
        arguments = json.dumps(c["arguments"], ensure_ascii=False)
        out.append(ToolCall(id=f"call_{secrets.token_hex(12)}", function=FunctionCall(c["name"], arguments)))
    return out


def may_be_tool_call(text: str) -> bool:
    """Whether a text generated so far is, or may still become, a tool call."""
    return text.startswith(TOOL_CALL_TAG) or TOOL_CALL_TAG.startswith(text)


def render_tool_calls(calls: list[ToolCall]) -> str:
    """An assistant message's calls, written back into a prompt in the format above."""
    items = []
    for c in calls:
        try:
            arguments = json.loads(c.function.arguments)
        except (ValueError, RecursionError):  # malformed, or nested too deeply to decode
            arguments = c.function.arguments  # passed through: the model sees what was sent
        items.append({"name": c.function.name, "arguments": arguments})
    return TOOL_CALL_TAG + json.dumps(items, ensure_ascii=False)
