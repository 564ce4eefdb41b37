"""What one request may ask for, checked before any expensive work.

A multi-tenant API must refuse a request that would cost far more than it is worth before
it spends on it: 40,000 stop strings are checked against every generated token, 100,000
`guided_choice` entries take seconds to compile, 200,000 messages take seconds to render.
Every bound here is a setting with OpenAI's own limit as the default where it has one,
and breaking one is a 400 naming the field. The checks walk what msgspec already decoded
and cost microseconds; they run on the gateway's event loop, and on a worker for what
reaches it directly (its OpenAI endpoints and `/generate`).

`check_prompt` and `check_prompt_length` hold the one rule of whether a prompt fits a
model: the gateway and a worker apply it before tokenizing (on a bound of the token count),
after tokenizing, and to token ids a client sends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from tokenmill.errors import APIError
from tokenmill.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ServiceTier

if TYPE_CHECKING:
    from tokenmill.protocol import SamplingParams
    from tokenmill.settings import Settings


@dataclass(slots=True, frozen=True)
class RequestLimits:
    messages: int = 2048
    stop: int = 4
    stop_chars: int = 1000
    logit_bias: int = 300
    tools: int = 128
    guided_choices: int = 1024
    schema_bytes: int = 64 * 1024
    schema_depth: int = 32
    n: int = 16
    prompts: int = 16
    top_logprobs: int = 20
    embedding_inputs: int = 2048

    @classmethod
    def from_settings(cls, s: Settings) -> RequestLimits:
        return cls(
            messages=s.max_messages,
            stop=s.max_stop,
            stop_chars=s.max_stop_chars,
            logit_bias=s.max_logit_bias,
            tools=s.max_tools,
            guided_choices=s.max_guided_choices,
            schema_bytes=s.max_schema_bytes,
            schema_depth=s.max_schema_depth,
            n=s.max_n,
            prompts=s.max_prompts,
            top_logprobs=s.max_top_logprobs,
            embedding_inputs=s.max_embedding_inputs,
        )


def _too_many(param: str, given: int, limit: int, what: str) -> APIError:
    return APIError(
        400,
        f"Too many {what} in '{param}': {given} given, at most {limit} allowed.",
        code="request_too_large",
        param=param,
    )


def _count(param: str, given: int, limit: int, what: str) -> None:
    if given > limit:
        raise _too_many(param, given, limit, what)


def _check_stop(stop: str | list[str] | None, limits: RequestLimits) -> int:
    """The characters the stop strings hold (they are checked against every token)."""
    stops = [stop] if isinstance(stop, str) else stop or []
    _count("stop", len(stops), limits.stop, "stop strings")
    for s in stops:
        if len(s) > limits.stop_chars:
            raise APIError(
                400,
                f"A stop string may have at most {limits.stop_chars} characters; one has {len(s)}.",
                code="request_too_large",
                param="stop",
            )
    return sum(map(len, stops))


def _check_schema(param: str, schema: Any, limits: RequestLimits) -> int:
    """Bytes of a JSON schema (or other grammar source), refused when too big or too deep."""
    size = len(schema.encode()) if isinstance(schema, str) else len(msgspec.json.encode(schema))
    if size > limits.schema_bytes:
        raise APIError(
            400,
            f"'{param}' is {size} bytes; at most {limits.schema_bytes} are allowed.",
            code="request_too_large",
            param=param,
        )
    if not isinstance(schema, str) and _depth(schema) > limits.schema_depth:
        raise APIError(
            400,
            f"'{param}' is nested more than {limits.schema_depth} levels deep.",
            code="request_too_large",
            param=param,
        )
    return size


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, without recursion (a deep value must not crash us)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _check_common(req: ChatCompletionRequest | CompletionRequest, limits: RequestLimits) -> int:
    _count("n", req.n, limits.n, "choices")
    if req.logit_bias is not None:
        _count("logit_bias", len(req.logit_bias), limits.logit_bias, "entries")
    size = _check_stop(req.stop, limits)
    if req.guided_choice is not None:
        _count("guided_choice", len(req.guided_choice), limits.guided_choices, "choices")
        size += _check_schema("guided_choice", req.guided_choice, limits)
    if req.guided_json is not None:
        size += _check_schema("guided_json", req.guided_json, limits)
    for param in ("guided_regex", "guided_grammar"):
        text = getattr(req, param)
        if text is not None:
            size += _check_schema(param, text, limits)
    return size


# What `service_tier` may ask for -> the tier the request runs at. OpenAI's `auto` means the
# project's tier, which here is always the default one.
SERVICE_TIERS: dict[str, ServiceTier] = {"auto": "default", "default": "default", "flex": "flex"}


def service_tier(requested: str | None) -> ServiceTier:
    """The tier a chat request runs at; 400 naming `service_tier` for a tier this server does
    not have (OpenAI's `priority` and `scale` among them), saying which it has."""
    if requested is None:
        return "default"
    tier = SERVICE_TIERS.get(requested)
    if tier is None:
        raise APIError(
            400,
            f"Invalid service_tier '{requested}': the tiers are 'auto' and 'default' (standard) "
            "and 'flex' (runs behind standard requests when the model is busy).",
            param="service_tier",
        )
    return tier


def check_chat(req: ChatCompletionRequest, limits: RequestLimits) -> int:
    """Refuse a chat request beyond the limits (400); else how many characters it carries
    (what rendering and tokenizing it will cost, roughly)."""
    _count("messages", len(req.messages), limits.messages, "messages")
    service_tier(req.service_tier)
    if req.top_logprobs is not None:
        _count("top_logprobs", req.top_logprobs, limits.top_logprobs, "log probabilities")
    size = _check_common(req, limits)
    if req.tools:
        _count("tools", len(req.tools), limits.tools, "tools")
        # The tools become one grammar, so their schemas share one size bound.
        schemas = [t.function.parameters or {} for t in req.tools]
        size += _check_schema("tools", schemas, limits)
    fmt = req.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema is not None:
        size += _check_schema("response_format.json_schema.schema", fmt.json_schema.schema, limits)
    return size + sum(_content_chars(m.content) for m in req.messages)


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.text or "") for p in content)
    return 0


def check_completion(req: CompletionRequest, limits: RequestLimits) -> int:
    """As `check_chat`, for a text completion."""
    if req.logprobs is not None:
        _count("logprobs", req.logprobs, limits.top_logprobs, "log probabilities")
    size = _check_common(req, limits)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        # Texts or lists of token ids: several prompts, each served as `n` sequences.
        _count("prompt", len(prompt), limits.prompts, "prompts")
    return size + (len(prompt) if isinstance(prompt, str) else sum(_lengths(prompt)))


def _lengths(items: Iterable[str | int | list[int]]) -> Iterable[int]:
    return (len(p) if isinstance(p, str | list) else 1 for p in items)


def check_embedding(req: EmbeddingRequest, limits: RequestLimits) -> int:
    """As `check_chat`, for embeddings: the number of inputs, then their characters."""
    raw = req.input
    if isinstance(raw, str):
        return len(raw)
    if raw and not all(isinstance(x, int) for x in raw):
        _count("input", len(raw), limits.embedding_inputs, "inputs")
    return sum(len(x) if isinstance(x, str | list) else 1 for x in raw)


def check_sampling(sampling: SamplingParams, limits: RequestLimits) -> None:
    """The bounds a worker holds its `/generate` requests to (the gateway checked the same
    on the OpenAI request; an internal caller could still send anything)."""
    _check_stop(sampling.stop, limits)
    if sampling.logprobs is not None:
        _count("logprobs", sampling.logprobs, limits.top_logprobs, "log probabilities")


# --- the prompt against the model ------------------------------------------------------------


def check_prompt_length(
    tokens: int,
    context_length: int,
    *,
    param: str,
    max_tokens: int | None = None,
    completion: bool = True,
    at_least: bool = False,
    what: str = "prompt tokens",
) -> None:
    """Refuse (400 `context_length_exceeded`) a prompt of `tokens` that the model cannot read:
    with a completion to follow, the context must also hold `max_tokens` (at least one
    token); an encoder's input only has to fit. `at_least`: `tokens` is a lower bound known
    without tokenizing (`Tokenizer.min_tokens`), so a text that cannot fit is refused before
    the work of tokenizing it."""
    reserve = max(max_tokens or 0, 1) if completion else 0
    if tokens + reserve <= context_length:
        return
    count = f"at least {tokens}" if at_least else str(tokens)
    asked = f" plus {max_tokens} completion tokens" if completion and max_tokens else ""
    raise APIError(
        400,
        f"This model's maximum context length is {context_length} tokens. "
        f"However, you requested {count} {what}{asked}.",
        code="context_length_exceeded",
        param=param,
    )


def check_prompt(
    ids: Sequence[object],
    context_length: int,
    *,
    param: str,
    max_tokens: int | None = None,
    completion: bool = True,
    vocab_size: int | None = None,
    extra: int = 0,
    name: str = "The prompt",
    what: str = "prompt tokens",
) -> None:
    """Refuse (400) token ids that cannot be a model's input: none, more than fit the context
    (`check_prompt_length`, with `extra` tokens the model reads besides them, e.g. an
    encoder's special tokens), or, given `vocab_size`, anything but ids of the vocabulary
    (a client's list may mix in strings). The length comes first, so a million ids are
    refused without looking at each."""
    if not ids:
        raise APIError(400, f"{name} must not be empty.", param=param)
    check_prompt_length(
        len(ids) + extra, context_length, param=param, max_tokens=max_tokens, completion=completion, what=what
    )
    if vocab_size is not None:
        try:
            ok = min(ids) >= 0 and max(ids) < vocab_size  # type: ignore[type-var, operator]
        except TypeError:  # not all numbers
            ok = False
        if not ok:
            raise APIError(400, f"{name} must be token ids in [0, {vocab_size}).", param=param)
