"""Responses <-> chat: a `/v1/responses` request as the chat completion the gateway serves,
and what that chat completion generated as Responses output items and objects (its event
stream: gateway/response_events.py).

No HTTP and no database here (gateway/response_service.py does the IO). A Responses request is
served as a chat completion so it goes through the very same admission, limits, budget,
routing, templates, grammars and metering as `/v1/chat/completions`.

Conversation items are kept in the shape `input_items` answers (every item with an id):
messages (`input_text` parts, or `output_text` for the assistant's), `function_call` and
`function_call_output`.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec

from tokenmill.errors import APIError
from tokenmill.openai_responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseCreateRequest,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from tokenmill.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
    Usage,
)

Item = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# --- request: input items ------------------------------------------------------------------


def input_items(req: ResponseCreateRequest) -> list[Item]:
    """The request's `input` as conversation items, each with an id (one given is kept)."""
    if req.input is None or req.input == [] or req.input == "":
        raise APIError(400, "'input' is required: a text, or a list of input items.", param="input")
    if isinstance(req.input, str):
        return [_message("user", [req.input], None)]
    return [_item(item, f"input[{i}]") for i, item in enumerate(req.input)]


def _item(item: Item, param: str) -> Item:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise APIError(
                400, "A message's role must be user, system, developer or assistant.", param=f"{param}.role"
            )
        return _message(role, _texts(item.get("content"), f"{param}.content"), item.get("id"))
    if kind == "function_call":
        call_id, name = _string(item, "call_id", param), _string(item, "name", param)
        arguments = _string(item, "arguments", param)
        return {
            "id": _given_id(item) or item_id("fc"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": "completed",
        }
    if kind == "function_call_output":
        call_id = _string(item, "call_id", param)
        output = item.get("output")
        if not isinstance(output, str):
            output = "".join(_texts(output, f"{param}.output"))
        return {
            "id": _given_id(item) or item_id("fco"),
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
    raise APIError(
        400,
        f"Input items of type '{kind}' are not supported here: send messages, function_call and "
        "function_call_output items.",
        param=f"{param}.type",
    )


def _message(role: str, texts: list[str], given_id: object) -> Item:
    part = "output_text" if role == "assistant" else "input_text"
    content: list[Item] = [
        {"type": part, "text": t, **({"annotations": []} if role == "assistant" else {})} for t in texts
    ]
    return {
        "id": given_id if isinstance(given_id, str) and given_id else item_id("msg"),
        "type": "message",
        "role": role,
        "content": content,
        "status": "completed",
    }


def _texts(content: object, param: str) -> list[str]:
    """The texts of a message's content: a string, or text parts (images, files and audio
    are refused: no model here reads them)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise APIError(400, "Content must be a string or a list of content parts.", param=param)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            out.append(_string(part, "text", f"{param}[{j}]"))
        elif kind == "refusal":
            out.append(_string(part, "refusal", f"{param}[{j}]"))
        else:
            raise APIError(
                400, f"Only text content is supported; '{kind}' parts are not.", param=f"{param}[{j}].type"
            )
    return out


def _string(item: Item, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"'{key}' must be a string.", param=f"{param}.{key}")
    return value


def _given_id(item: Item) -> str | None:
    value = item.get("id")
    return value if isinstance(value, str) and value else None


def continued(previous_items: list[Item], previous: dict[str, Any], items: list[Item]) -> list[Item]:
    """The conversation of a response that continues another (its conversation and its
    Response object): what that one answered, what it said, then the new input."""
    said = [i for i in previous.get("output", []) if i.get("type") in ("message", "function_call")]
    return [*previous_items, *said, *items]


# --- request: as a chat completion ---------------------------------------------------------


def chat_request(req: ResponseCreateRequest, conversation: list[Item]) -> ChatCompletionRequest:
    """The chat completion that answers `req` with this conversation (400 for what cannot be)."""
    _refuse_by_value(req)
    return ChatCompletionRequest(
        model=req.model,
        messages=chat_messages(req.instructions, conversation),
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format(req),
        user=req.user,
        service_tier=req.service_tier,
        prompt_cache_key=req.prompt_cache_key,
        safety_identifier=req.safety_identifier,
    )


def chat_messages(instructions: str | None, conversation: list[Item]) -> list[ChatMessage]:
    """`instructions` as the system message, then the conversation: calls right after an
    assistant message (or after each other) are that message's tool calls, a call's output is
    a tool message."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    turn: ChatMessage | None = None  # the assistant turn that function calls following it join
    for item in conversation:
        kind = item["type"]
        if kind == "message":
            text = "".join(p.get("text") or p.get("refusal") or "" for p in item["content"])
            message = ChatMessage(role=item["role"], content=text)
            messages.append(message)
            turn = message if item["role"] == "assistant" else None
        elif kind == "function_call":
            call = ToolCall(id=item["call_id"], function=FunctionCall(item["name"], item["arguments"]))
            if turn is None:
                turn = ChatMessage(role="assistant", content=None)
                messages.append(turn)
            turn.tool_calls = [*(turn.tool_calls or []), call]
        else:
            messages.append(ChatMessage(role="tool", tool_call_id=item["call_id"], content=item["output"]))
            turn = None
    return messages


def _refuse_by_value(req: ResponseCreateRequest) -> None:
    if req.background:
        raise APIError(
            400, "Background responses are not supported: send 'background': false.", param="background"
        )
    if req.truncation == "auto":
        raise APIError(
            400,
            "'truncation': 'auto' is not supported: a conversation is never cut; one too long for "
            "the model's context is refused.",
            param="truncation",
        )
    if req.top_logprobs:
        raise APIError(400, "'top_logprobs' is not supported on /v1/responses yet.", param="top_logprobs")
    if req.include and "message.output_text.logprobs" in req.include:
        raise APIError(
            400, "'message.output_text.logprobs' is not supported on /v1/responses yet.", param="include"
        )


def chat_tools(tools: list[Item] | None) -> list[Tool] | None:
    """Responses' flat function tools as chat tools (strict unless they say otherwise, as
    OpenAI's Responses API defaults them). Hosted tools are refused: none run here."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"Only function tools are supported; '{kind}' tools do not run on this server.",
                param=f"tools[{i}].type",
            )
        fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        fields["strict"] = fields.get("strict") is not False
        try:
            function = msgspec.convert(fields, FunctionDefinition)
        except msgspec.ValidationError as exc:
            raise APIError(400, f"Invalid function tool: {exc}", param=f"tools[{i}]") from exc
        out.append(Tool(type="function", function=function))
    return out


def chat_tool_choice(choice: str | Item | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(type="function", function=FunctionName(choice["name"]))
    raise APIError(
        400,
        "'tool_choice' must be none, auto, required or {'type': 'function', 'name': ...}.",
        param="tool_choice",
    )


def response_format(req: ResponseCreateRequest) -> ResponseFormat | None:
    """`text.format` as chat's `response_format` (Responses flattens the JSON schema into it)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.get("type") == "json_schema":
        fields = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        try:
            schema = msgspec.convert(fields, JsonSchemaFormat)
        except msgspec.ValidationError as exc:
            raise APIError(400, f"Invalid text.format: {exc}", param="text.format") from exc
        return ResponseFormat(type="json_schema", json_schema=schema)
    raise APIError(
        400, "'text.format' must be of type text, json_object or json_schema.", param="text.format"
    )


# --- response: the Response object ---------------------------------------------------------


def draft(
    req: ResponseCreateRequest, response_id: str, model: str, chat: ChatCompletionRequest
) -> ResponseObject:
    """The Response object of `req` before anything was generated (status in_progress): what
    every later state of it shares."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
    return ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        status="in_progress",
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=model,
        output=[],
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        service_tier="default",  # until admitted: the tier it runs at
        store=req.store is not False,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        text={"format": fmt, "verbosity": "medium"},
        tool_choice=req.tool_choice or "auto",
        tools=[_echo_tool(t) for t in chat.tools or []],
        user=req.user,
        metadata=req.metadata or {},
        max_tool_calls=req.max_tool_calls,
        prompt_cache_key=req.prompt_cache_key,
        safety_identifier=req.safety_identifier,
    )


def _echo_tool(tool: Tool) -> Item:
    f = tool.function
    return {
        "type": "function",
        "name": f.name,
        "description": f.description,
        "parameters": f.parameters,
        "strict": f.strict,
    }


def response_usage(u: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens),
        output_tokens=u.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=u.total_tokens,
    )


def output_items(text: str, calls: list[ToolCall] | None, truncated: bool) -> list[OutputItem]:
    """What the model said: its calls, or one message."""
    if calls:
        return [call_item(c, "completed") for c in calls]
    status = "incomplete" if truncated else "completed"
    return [OutputMessage(id=item_id("msg"), status=status, content=[OutputText(text=text)])]


def call_item(call: ToolCall, status: str) -> FunctionCallItem:
    return FunctionCallItem(
        id=item_id("fc"),
        call_id=call.id,
        name=call.function.name,
        arguments=call.function.arguments,
        status=status,  # type: ignore[arg-type]
    )


def finished(base: ResponseObject, output: list[OutputItem], usage: Usage, truncated: bool) -> ResponseObject:
    """`base` once generation ended: completed, or incomplete when `max_output_tokens` (or the
    context) cut it short."""
    return msgspec.structs.replace(
        base,
        status="incomplete" if truncated else "completed",
        completed_at=int(time.time()),
        incomplete_details=IncompleteDetails("max_output_tokens") if truncated else None,
        output=output,
        usage=response_usage(usage),
    )


def failed(base: ResponseObject, output: list[OutputItem], exc: APIError) -> ResponseObject:
    code = "rate_limit_exceeded" if exc.status == 429 else "server_error"
    error = ResponseError(code, exc.message)
    return msgspec.structs.replace(base, status="failed", error=error, output=output)
