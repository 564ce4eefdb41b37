"""OpenAI requests in, OpenAI responses out: the one translation the gateway and workers share.

An OpenAI chat or text completion request becomes prompt token ids and wire sampling
parameters; a stream of `GenerateDelta` becomes a `ChatCompletion` / `Completion` or SSE
chunks ending in `data: [DONE]`. Both the gateway and a worker used on its own answer
through `respond()`, so their responses cannot drift apart.

Everything above the last section is free of HTTP; `respond()` is the thin Litestar glue.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from litestar import Request, Response
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIHeader, OpenAPIMediaType, OpenAPIResponse, Operation, Schema
from litestar.openapi.spec.enums import OpenAPIType
from litestar.response import Stream

from tokenmill.errors import APIError
from tokenmill.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ErrorResponse,
    FinishReason,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from tokenmill.protocol import GenerateDelta, SamplingParams
from tokenmill.request_limits import check_prompt, check_prompt_length
from tokenmill.structured import (
    arguments_schema,
    may_be_tool_call,
    parse_tool_calls,
    render_tool_calls,
    response_grammar,
    tool_plan,
    tool_preamble,
)
from tokenmill.tokenization import Tokenizer

OpenAIRequest = ChatCompletionRequest | CompletionRequest


def model_not_found(name: str) -> APIError:
    # One wording whoever answers, so a client cannot tell a hidden model from a missing one.
    return APIError(
        404,
        f"The model '{name}' does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


# --- prompts: OpenAI request -> token ids + sampling ---------------------------------------


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    sampling: SamplingParams


def chat_prompt(
    req: ChatCompletionRequest, tok: Tokenizer, *, context_length: int, defaults: Mapping[str, float]
) -> Prompt:
    """Render the chat template and tokenize; `defaults` fill sampling fields the request omits.

    Tools and response formats become the grammar the engine holds the output to.
    """
    reject_unsupported(req.n, bool(req.logprobs))
    plan = tool_plan(req)
    # A template that renders `tools` itself gets them (and history in HF's shape); others
    # get a system preamble and history in Tokenmill's tool-call format (tokenmill.structured).
    native = "tools" in (tok.chat_template or "")
    messages = [message_dict(m, native_tools=native) for m in req.messages]
    tools = None
    if plan is not None and native:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": f.name,
                    "description": f.description or "",
                    "parameters": arguments_schema(f),
                },
            }
            for f in plan.offered
        ]
    elif plan is not None:
        messages = with_system(messages, tool_preamble(plan))
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except Exception as exc:  # a template may raise on e.g. wrong role order
        raise APIError(400, f"Could not render the chat template: {exc}", param="messages") from exc
    max_tokens = req.max_completion_tokens or req.max_tokens
    ids = encode_prompt(tok, text, context_length, "messages", max_tokens)
    sampling = sampling_params(req, ids, max_tokens, context_length=context_length, defaults=defaults)
    sampling.grammar = plan.grammar if plan is not None else response_grammar(req)
    return Prompt(ids, sampling)


def encode_prompt(
    tok: Tokenizer, text: str, context_length: int, param: str, max_tokens: int | None = None
) -> list[int]:
    """`text`'s token ids, checked to fit the context with `max_tokens` after them; a text
    that cannot fit is refused before the work of tokenizing it (a megabyte costs a second
    of CPU)."""
    check_prompt_length(
        tok.min_tokens(text), context_length, param=param, max_tokens=max_tokens, at_least=True
    )
    ids = tok.encode(text)
    check_prompt(ids, context_length, param=param, max_tokens=max_tokens)
    return ids


def with_system(messages: list[dict[str, object]], text: str) -> list[dict[str, object]]:
    """`text` appended to the system message, or as one at the start if there is none."""
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def uses_tools(req: OpenAIRequest) -> bool:
    """Whether the answer may be tool calls (then the text is parsed for them)."""
    return isinstance(req, ChatCompletionRequest) and bool(req.tools) and req.tool_choice != "none"


def new_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


def embedding_inputs(req: EmbeddingRequest, tok: Tokenizer, *, context_length: int) -> list[list[int]]:
    """Each input as the full sequence the encoder reads (special tokens included)."""
    raw = [req.input] if isinstance(req.input, str) else req.input
    if not raw:
        raise APIError(400, "'input' must not be empty.", param="input")
    if all(isinstance(x, int) for x in raw):
        raw = [raw]  # type: ignore[list-item]  # one input given as token ids
    if not (all(isinstance(x, str) for x in raw) or all(isinstance(x, list) for x in raw)):
        raise APIError(
            400, "'input' must be a string, strings, token ids, or lists of token ids.", param="input"
        )
    bare = tok.encode("", add_special_tokens=True)  # what the tokenizer wraps every text in
    texts = [x for x in raw if isinstance(x, str)]
    for i, x in enumerate(texts):
        if not x:
            raise APIError(400, f"Input {i} is an empty string.", param="input")
        check_prompt_length(
            tok.min_tokens(x),
            context_length,
            param="input",
            completion=False,
            at_least=True,
            what=f"tokens in input {i}",
        )
    # One batch call: it tokenizes in parallel and without holding the GIL.
    encoded = iter(tok.encode_batch(texts, add_special_tokens=True) if texts else [])
    out = []
    for i, x in enumerate(raw):
        what = f"tokens in input {i}"
        if isinstance(x, str):
            ids = next(encoded)
            check_prompt_length(len(ids), context_length, param="input", completion=False, what=what)
        else:  # token ids, wrapped as a text is
            check_prompt(
                x,
                context_length,
                param="input",
                completion=False,
                vocab_size=tok.vocab_size,
                extra=len(bare),
                name=f"Input {i}",
                what=what,
            )
            ids = [*bare[:1], *x, *bare[1:]]  # type: ignore[misc]
        out.append(ids)
    return out


def embedding_list(
    req: EmbeddingRequest, model: str, vectors: list[list[float]], prompt_tokens: int
) -> EmbeddingList:
    if req.dimensions is not None and vectors and req.dimensions != len(vectors[0]):
        raise APIError(
            400,
            f"The model '{model}' only makes {len(vectors[0])}-dimensional embeddings.",
            param="dimensions",
        )
    data = [
        Embedding(
            i,
            base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
            if req.encoding_format == "base64"
            else v,
        )
        for i, v in enumerate(vectors)
    ]
    return EmbeddingList(data, model, EmbeddingUsage(prompt_tokens, prompt_tokens))


def completion_prompt(
    req: CompletionRequest, tok: Tokenizer, *, context_length: int, defaults: Mapping[str, float]
) -> Prompt:
    """Tokenize a text prompt (or take token ids as they are)."""
    reject_unsupported(req.n, req.logprobs is not None)
    if req.echo or req.suffix:
        raise APIError(400, "'echo' and 'suffix' are not supported yet.", param="echo")
    if req.best_of is not None and req.best_of != req.n:
        # Equal to `n` (what clients such as LangChain send by default) it changes nothing.
        raise APIError(400, "'best_of' other than 'n' is not supported.", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt) and prompt:
        if len(prompt) != 1:
            raise APIError(400, "Send one prompt per request for now.", param="prompt")
        prompt = prompt[0]
    max_tokens = req.max_tokens or 16
    if isinstance(prompt, str):
        ids = encode_prompt(tok, prompt, context_length, "prompt", max_tokens)
    else:  # token ids
        check_prompt(prompt, context_length, param="prompt", max_tokens=max_tokens, vocab_size=tok.vocab_size)
        ids = prompt  # type: ignore[assignment]  # all ints: checked
    sampling = sampling_params(req, ids, max_tokens, context_length=context_length, defaults=defaults)
    sampling.grammar = response_grammar(req)  # guided_json / guided_regex / ...
    return Prompt(ids, sampling)


def sampling_params(
    req: OpenAIRequest,
    ids: list[int],
    max_tokens: int | None,
    *,
    context_length: int,
    defaults: Mapping[str, float],
) -> SamplingParams:
    """Wire sampling parameters of a prompt checked to fit the context (`check_prompt`)."""
    room = context_length - len(ids)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    d = defaults

    def pick(value: float | None, name: str, fallback: float) -> float:
        return value if value is not None else float(d.get(name, fallback))

    return SamplingParams(
        # Left out, max_tokens runs to the end of the context (or the deployment's cap).
        max_tokens=max_tokens or min(room, int(d.get("max_tokens", room))),
        temperature=pick(req.temperature, "temperature", 1.0),
        top_p=pick(req.top_p, "top_p", 1.0),
        top_k=max(int(pick(req.top_k, "top_k", 0)), 0),
        min_p=pick(req.min_p, "min_p", 0.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
        seed=req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
    )


def message_dict(m: ChatMessage, native_tools: bool = False) -> dict[str, object]:
    """A message as chat templates expect it: plain text content, `developer` read as `system`.

    Earlier tool calls go to a template that knows tools in HF's shape (arguments as an
    object); otherwise they are written into the content as the model is asked to write them.
    """
    content = m.content
    if isinstance(content, list):
        if any(p.type != "text" for p in content):
            raise APIError(400, "Only text content parts are supported.", param="messages")
        content = "".join(p.text or "" for p in content)
    out: dict[str, object] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name:
        out["name"] = m.name
    if m.tool_calls and native_tools:
        out["tool_calls"] = [_hf_tool_call(c) for c in m.tool_calls]
    elif m.tool_calls:
        out["content"] = f"{out['content']}{render_tool_calls(m.tool_calls)}"
    if m.tool_call_id and native_tools:
        out["tool_call_id"] = m.tool_call_id
    return out


def _hf_tool_call(c: ToolCall) -> dict[str, object]:
    try:
        arguments: object = msgspec.json.decode(c.function.arguments)
    except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deeply to decode
        arguments = c.function.arguments
    return {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}}


def reject_unsupported(n: int, logprobs: bool) -> None:
    # Refused up front rather than silently ignored: a client relying on them must know.
    if n != 1:
        raise APIError(400, "Only n = 1 is supported for now.", param="n")
    if logprobs:
        raise APIError(400, "logprobs are not supported yet.", param="logprobs")


# --- responses: deltas -> OpenAI objects and SSE -------------------------------------------


class Shape(msgspec.Struct, frozen=True):
    """How one endpoint turns deltas into its objects."""

    kind: str  # prefix of the object id: chatcmpl-..., cmpl-...
    final: Callable[[str, int, str, str, FinishReason | None, Usage], msgspec.Struct]
    chunk: Callable[[str, int, str, str | None, FinishReason | None, bool], msgspec.Struct]
    usage_chunk: Callable[[str, int, str, Usage], msgspec.Struct]


CHAT = Shape(
    kind="chatcmpl",
    final=lambda i, c, m, text, fin, u: ChatCompletion(
        id=i,
        created=c,
        model=m,
        usage=u,
        choices=[ChatChoice(index=0, message=AssistantMessage(content=text), finish_reason=fin)],
    ),
    chunk=lambda i, c, m, text, fin, first: ChatCompletionChunk(
        id=i,
        created=c,
        model=m,
        choices=[
            ChunkChoice(
                index=0, delta=Delta(role="assistant" if first else None, content=text), finish_reason=fin
            )
        ],
    ),
    usage_chunk=lambda i, c, m, u: ChatCompletionChunk(id=i, created=c, model=m, choices=[], usage=u),
)

TEXT = Shape(
    kind="cmpl",
    final=lambda i, c, m, text, fin, u: Completion(
        id=i, created=c, model=m, usage=u, choices=[CompletionChoice(index=0, text=text, finish_reason=fin)]
    ),
    chunk=lambda i, c, m, text, fin, _first: Completion(
        id=i, created=c, model=m, choices=[CompletionChoice(index=0, text=text or "", finish_reason=fin)]
    ),
    usage_chunk=lambda i, c, m, u: Completion(id=i, created=c, model=m, choices=[], usage=u),
)


def shape_of(req: OpenAIRequest) -> Shape:
    return CHAT if isinstance(req, ChatCompletionRequest) else TEXT


def usage(d: GenerateDelta) -> Usage:
    """OpenAI usage from a delta's running totals (the last delta holds the final ones)."""
    return Usage(
        prompt_tokens=d.prompt_tokens,
        completion_tokens=d.completion_tokens,
        total_tokens=d.prompt_tokens + d.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=d.cached_tokens),
    )


def finish_reason(d: GenerateDelta) -> FinishReason | None:
    # OpenAI clients know only stop and length; an abort or error still ends the choice.
    if d.finish_reason is None:
        return None
    return "length" if d.finish_reason == "length" else "stop"


async def collect(first: GenerateDelta, rest: AsyncIterator[GenerateDelta]) -> tuple[str, GenerateDelta]:
    """The whole text and the last delta (which carries finish reason and usage)."""
    parts, last = [first.text], first
    async for d in rest:
        parts.append(d.text)
        last = d
    return "".join(parts), last


async def sse_events(
    shape: Shape,
    object_id: str,
    created: int,
    model: str,
    first: GenerateDelta,
    deltas: AsyncGenerator[GenerateDelta, None],
    include_usage: bool,
    tools: bool = False,
) -> AsyncIterator[bytes]:
    """SSE `data:` lines for `first` then `deltas`, ending in `data: [DONE]`; closes `deltas`.

    With `tools`, text that is (or may still become) a tool call is held back; a complete call
    goes out as one `tool_calls` delta, anything else as the text it is.
    """
    last, is_first = first, True
    held: str | None = "" if tools else None  # None once the answer is known to be text
    try:
        async for d in _achain(first, deltas):
            last = d
            fin = finish_reason(d)
            text = d.text
            if held is not None:
                held += text
                calls = parse_tool_calls(held) if fin else None
                if calls:
                    for chunk in tool_call_chunks(object_id, created, model, calls, is_first):
                        yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                    is_first = False
                    continue
                if fin is None and may_be_tool_call(held):
                    text = ""
                else:
                    text, held = held, None
            # Empty deltas (e.g. a token held back as a possible stop string) are skipped,
            # but the first chunk always goes out: it carries the assistant role.
            if text or fin or is_first:
                chunk = shape.chunk(object_id, created, model, text, fin, is_first)
                yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                is_first = False
        if include_usage:
            u = shape.usage_chunk(object_id, created, model, usage(last))
            yield b"data: " + msgspec.json.encode(u) + b"\n\n"
    except APIError as exc:  # the status line is long gone: report in-band
        yield b"data: " + msgspec.json.encode(exc.body()) + b"\n\n"
    finally:
        await deltas.aclose()
    yield b"data: [DONE]\n\n"


def tool_call_completion(
    object_id: str, created: int, model: str, calls: list[ToolCall], u: Usage
) -> ChatCompletion:
    message = AssistantMessage(content=None, tool_calls=calls)
    choice = ChatChoice(index=0, message=message, finish_reason="tool_calls")
    return ChatCompletion(id=object_id, created=created, model=model, usage=u, choices=[choice])


def tool_call_chunks(
    object_id: str, created: int, model: str, calls: list[ToolCall], first: bool
) -> list[ChatCompletionChunk]:
    """The calls in one delta (each whole: OpenAI splits arguments, clients join either), then
    the end of the choice."""
    deltas = [ToolCallDelta(index=i, id=c.id, function=c.function) for i, c in enumerate(calls)]
    return [
        ChatCompletionChunk(
            id=object_id,
            created=created,
            model=model,
            choices=[
                ChunkChoice(index=0, delta=Delta(role="assistant" if first else None, tool_calls=deltas))
            ],
        ),
        ChatCompletionChunk(
            id=object_id,
            created=created,
            model=model,
            choices=[ChunkChoice(index=0, delta=Delta(), finish_reason="tool_calls")],
        ),
    ]


Receive = Callable[[], Awaitable[Mapping[str, Any]]]


async def collect_unless_gone(
    first: GenerateDelta, deltas: AsyncGenerator[GenerateDelta, None], receive: Receive
) -> tuple[str, GenerateDelta] | None:
    """`collect()`, or None (with `deltas` closed, which aborts the generation) if the
    client disconnects first. `receive` is the ASGI receive callable of a request whose
    body has been read, so the next message it yields can only be the disconnect."""
    # Collected in this task, with one watcher task that cancels it when the client leaves
    # (cheaper per request than a task for each and `asyncio.wait` on both). The cancellation
    # can only land inside `collect()`: the watcher runs while this task waits there.
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        with contextlib.suppress(Exception):  # a broken connection is as good as gone
            await _disconnected(receive)
        left = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await collect(first, deltas)
    except asyncio.CancelledError:
        if not left:  # this handler is being cancelled: not ours to swallow
            raise
        task.uncancel()
        return None
    except Exception:
        if not left:
            raise
        return None  # the generation failed as the client left: nobody hears it now
    finally:
        watcher.cancel()
        if left:
            await deltas.aclose()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _achain(first: GenerateDelta, rest: AsyncIterator[GenerateDelta]) -> AsyncIterator[GenerateDelta]:
    yield first
    async for d in rest:
        yield d


# --- HTTP: the one response path of /v1/chat/completions and /v1/completions ---------------


async def respond(
    request: Request[Any, Any, Any],
    body: OpenAIRequest,
    model: str,
    request_id: str,
    deltas: AsyncGenerator[GenerateDelta, None],
    *,
    headers: Mapping[str, str] | None = None,
) -> Response[Any]:
    """Answer `body` from `deltas`: one JSON object, or an SSE stream.

    `request_id` goes out as `x-request-id` (and into the object ids), after `headers`
    (e.g. `x-ratelimit-*`), on the answer and on its errors alike. Closing `deltas`
    must stop the generation, which happens when the client goes away; so must a
    generator that was never started, which is why this starts it at once.
    """
    shape = shape_of(body)
    object_id, created = f"{shape.kind}-{request_id[4:]}", int(time.time())
    sent = {**(headers or {}), "x-request-id": request_id}
    # Wait for the first delta before answering, so failures before the first token
    # (no worker, a refused request) are proper HTTP errors rather than a broken stream.
    try:
        first = await anext(deltas)
    except APIError as exc:
        exc.headers.update(sent)
        raise
    if not body.stream:
        # Nothing is sent until the end, so watch for the client leaving: then stop the
        # generation instead of finishing it for nobody.
        try:
            collected = await collect_unless_gone(first, deltas, request.receive)
        except APIError as exc:  # failed after the first token, still before any byte was sent
            exc.headers.update(sent)
            raise
        if collected is None:
            return Response(b"", status_code=499, headers=sent)  # nobody is listening
        text, last = collected
        calls = parse_tool_calls(text) if uses_tools(body) else None
        if calls:
            obj: msgspec.Struct = tool_call_completion(object_id, created, model, calls, usage(last))
        else:
            obj = shape.final(object_id, created, model, text, finish_reason(last), usage(last))
        return Response(msgspec.json.encode(obj), media_type="application/json", headers=sent)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Stream(
        sse_events(shape, object_id, created, model, first, deltas, include_usage, uses_tools(body)),
        media_type="text/event-stream",
        headers={**sent, "cache-control": "no-cache", "x-accel-buffering": "no"},
    )


# --- OpenAPI: what the document says these endpoints answer --------------------------------

ERRORS: dict[int, str] = {
    400: "The request is invalid: malformed JSON, a value out of range, an option this server "
    "does not support, a prompt that does not fit the model's context, or an invalid "
    "X-Client-Request-Id header.",
    401: "No API key, or one that is wrong, revoked or expired.",
    403: "The key may not do this, or its organisation is suspended.",
    404: "No model by this name that this key may use.",
    429: "A rate limit or the organisation's budget is exhausted; retry later.",
    500: "An unexpected server error.",
    503: "No worker serves the model right now, or it failed before answering; retry shortly.",
}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAI-style error bodies (`tokenmill.errors`) for these statuses, for a handler's `responses=`."""
    return {
        s: ResponseSpec(data_container=ErrorResponse, description=ERRORS[s], generate_examples=False)
        for s in statuses
    }


def completion_responses(final: type[msgspec.Struct]) -> dict[int, ResponseSpec]:
    """`responses=` of a completion endpoint: its object as JSON, and every error it can answer.
    (`streaming_operation` adds the SSE form of the 200.)"""
    ok = ResponseSpec(
        data_container=final,
        description="The completion; with `stream: true`, a `text/event-stream` of chunks instead.",
        generate_examples=False,
    )
    return {200: ok, **error_responses(400, 401, 403, 404, 429, 500, 503)}


def streaming_operation(chunk: type[msgspec.Struct]) -> type[Operation]:
    """An `operation_class` documenting the other form of the 200: server-sent events whose
    `data` is a JSON `chunk` (or, when generation fails mid-stream, an error object), ending
    with `data: [DONE]`. Litestar's response specs hold one media type per status, hence this."""
    event = Schema(
        type=OpenAPIType.OBJECT,
        required=["data"],
        properties={
            "data": Schema(
                any_of=[
                    Schema(type=OpenAPIType.STRING, const="[DONE]"),
                    Schema(
                        type=OpenAPIType.STRING,
                        content_media_type="application/json",
                        # Self-contained (no $ref), so it needs nothing registered in components.
                        content_schema={"anyOf": _inline_schemas(chunk, ErrorResponse)},  # type: ignore[arg-type]
                    ),
                ]
            )
        },
        description="One server-sent event.",
    )
    request_id = OpenAPIHeader(
        schema=Schema(type=OpenAPIType.STRING),
        description="This request's id, as the usage ledger records it.",
    )

    @dataclass
    class StreamingOperation(Operation):
        def __post_init__(self) -> None:
            ok = (self.responses or {}).get("200")
            if isinstance(ok, OpenAPIResponse):
                ok.content = {**(ok.content or {}), "text/event-stream": OpenAPIMediaType(schema=event)}
                ok.headers = {**(ok.headers or {}), "x-request-id": request_id}

    return StreamingOperation


def _inline_schemas(*types: Any) -> list[Any]:
    """msgspec's JSON schemas of `types` with every `$ref` replaced by its definition."""
    schemas, defs = msgspec.json.schema_components(types, ref_template="{name}")

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return [inline(s) for s in schemas]
