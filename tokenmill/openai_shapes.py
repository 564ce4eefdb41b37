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
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    ErrorResponse,
    FinishReason,
    PromptTokensDetails,
    ServiceTier,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
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
    echo: str = ""  # the text each of its choices starts with (`echo`), else ""


def chat_prompt(
    req: ChatCompletionRequest,
    tok: Tokenizer,
    *,
    context_length: int,
    defaults: Mapping[str, float],
    single: bool = True,
) -> Prompt:
    """Render the chat template and tokenize; `defaults` fill sampling fields the request omits.

    Tools and response formats become the grammar the engine holds the output to. `single`:
    the caller streams one sequence as is (`one_sequence`); the gateway passes False.
    """
    if single:
        one_sequence(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
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
    sampling = sampling_params(
        req, ids, max_tokens, tok.vocab_size, context_length=context_length, defaults=defaults
    )
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
    """The one prompt of a request served as one sequence (`one_sequence`): a worker's own
    endpoint."""
    one_sequence(req)
    if len(prompt_list(req.prompt)) != 1:
        raise APIError(400, f"{_ONE} serves one prompt per request; {_GATEWAY}", param="prompt")
    (prompt,) = completion_prompts(req, tok, context_length=context_length, defaults=defaults)
    return prompt


def completion_prompts(
    req: CompletionRequest, tok: Tokenizer, *, context_length: int, defaults: Mapping[str, float]
) -> list[Prompt]:
    """Tokenize each text prompt (or take token ids as they are): one `Prompt` per prompt of
    the request, in order, each to be served as `n` choices."""
    if req.suffix:
        raise APIError(
            400,
            "'suffix' is not supported: the models here continue a prompt, they do not fill in "
            "text before a suffix.",
            param="suffix",
        )
    if req.best_of is not None and req.best_of != req.n:
        # Equal to `n` (what clients such as LangChain send by default) it changes nothing.
        raise APIError(400, "'best_of' other than 'n' is not supported.", param="best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(
            400,
            "'echo' with 'logprobs' is not supported: it would need the log probabilities of "
            "the prompt's tokens, which are not computed. Send one of them.",
            param="echo",
        )
    max_tokens = req.max_tokens or 16
    grammar = response_grammar(req)  # guided_json / guided_regex / ...
    prompts = []
    for prompt in prompt_list(req.prompt):
        if isinstance(prompt, str):
            ids, echo = encode_prompt(tok, prompt, context_length, "prompt", max_tokens), prompt
        else:  # token ids
            check_prompt(
                prompt, context_length, param="prompt", max_tokens=max_tokens, vocab_size=tok.vocab_size
            )
            ids = prompt
            echo = tok.decode(ids, skip_special_tokens=False) if req.echo else ""
        sampling = sampling_params(
            req, ids, max_tokens, tok.vocab_size, context_length=context_length, defaults=defaults
        )
        sampling.grammar = grammar
        prompts.append(Prompt(ids, sampling, echo if req.echo else ""))
    return prompts


def prompt_list(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """The prompts of a text completion request: a text, texts, token ids (one prompt), or
    lists of token ids. (An empty list is one empty prompt, refused as such.)"""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]  # all ints
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt  # type: ignore[return-value]  # all texts, or all lists of ints
    raise APIError(400, "'prompt' must be a text, texts, token ids, or lists of token ids.", param="prompt")


# A worker's own OpenAI endpoints stream one sequence as it comes; the gateway in front of the
# workers fans a request out into its choices and shapes what needs the model's tokenizer.
_ONE = "A worker's own endpoint"
_GATEWAY = "send the request to the gateway, which serves it."


def one_sequence(req: OpenAIRequest) -> None:
    """Refuse what one sequence streamed as it comes cannot answer: `n` choices, log
    probabilities (spelt with the tokenizer) and `echo`."""
    if req.n != 1:
        raise APIError(400, f"{_ONE} serves n = 1 only; {_GATEWAY}", param="n")
    if req.logprobs if isinstance(req, ChatCompletionRequest) else req.logprobs is not None:
        raise APIError(400, f"{_ONE} does not return logprobs; {_GATEWAY}", param="logprobs")
    if isinstance(req, CompletionRequest) and req.echo:
        raise APIError(400, f"{_ONE} does not echo prompts; {_GATEWAY}", param="echo")


def sampling_params(
    req: OpenAIRequest,
    ids: list[int],
    max_tokens: int | None,
    vocab_size: int,
    *,
    context_length: int,
    defaults: Mapping[str, float],
) -> SamplingParams:
    """Wire sampling parameters of a prompt checked to fit the context (`check_prompt`), for
    a model of `vocab_size` tokens."""
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
        # How many likeliest tokens to return beside each sampled one (None: no logprobs).
        logprobs=((req.top_logprobs or 0) if req.logprobs else None)
        if isinstance(req, ChatCompletionRequest)
        else req.logprobs,
        logit_bias=logit_bias(req.logit_bias, vocab_size),
    )


# OpenAI's bounds of a `logit_bias` value: -100 all but bans a token, 100 all but forces it.
MAX_BIAS = 100.0


def logit_bias(bias: Mapping[str, float] | None, vocab_size: int) -> dict[int, float]:
    """`logit_bias` as the engine takes it: a 400 naming it for a key that is not a token id
    of the model's vocabulary (as a string of digits) or a value outside [-100, 100]. (How
    many entries it may have is `request_limits`' to check.)"""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) < 12 and int(key) < vocab_size):
            raise APIError(
                400,
                f"'logit_bias' keys must be token ids of the model's vocabulary, from 0 to "
                f"{vocab_size - 1}; '{key[:32]}' is not one.",
                param="logit_bias",
            )
        if not -MAX_BIAS <= value <= MAX_BIAS:  # NaN included
            raise APIError(
                400,
                f"'logit_bias' values must be between -100 and 100; token {key} has {value}.",
                param="logit_bias",
            )
        out[int(key)] = value
    return out


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


# --- responses: deltas -> OpenAI objects and SSE -------------------------------------------


class ChoiceDelta(NamedTuple):
    """A delta of one choice of a request: the gateway streams a request's sequences merged,
    each delta tagged with its choice. A plain `GenerateDelta` (a worker's own endpoint
    streams its one sequence so) is choice 0."""

    index: int
    delta: GenerateDelta


AnyDelta = ChoiceDelta | GenerateDelta


def _tagged(item: AnyDelta) -> ChoiceDelta:
    return item if isinstance(item, ChoiceDelta) else ChoiceDelta(0, item)


@dataclass(slots=True, frozen=True)
class Choices:
    """How a request's sequences become its choices: choice i answers prompt i // n."""

    n: int = 1
    echo: tuple[str, ...] = ()  # per prompt, the text its choices start with (`echo`), or none
    logprobs: int | None = None  # likeliest tokens shown beside each one; None: no logprobs
    tokenizer: Tokenizer | None = None  # spells the tokens of logprobs

    @classmethod
    def of(cls, req: OpenAIRequest, prompts: Sequence[Prompt], tok: Tokenizer) -> Choices:
        echo = isinstance(req, CompletionRequest) and req.echo
        return cls(req.n, tuple(p.echo for p in prompts) if echo else (), prompts[0].sampling.logprobs, tok)


ONE = Choices()


def total(lasts: Mapping[int, GenerateDelta], n: int) -> GenerateDelta:
    """A request's token counts from the last delta of each of its choices (running totals):
    the completion tokens of every choice, but each prompt and its cached part once, from
    its first choice that reported (OpenAI bills the prompt of `n` choices once)."""
    prompt = cached = completion = 0
    counted: set[int] = set()
    for index in sorted(lasts):
        d = lasts[index]
        completion += d.completion_tokens
        if index // n not in counted:
            counted.add(index // n)
            prompt += d.prompt_tokens
            cached += d.cached_tokens
    return GenerateDelta(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)


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


# --- log probabilities -----------------------------------------------------------------------


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's `bytes_to_unicode`), read backwards: the byte each
    character of a vocabulary entry stands for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + extra)
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_of_char()


class TokenSpelling:
    """Each token as log probabilities show it: its text and its bytes. The bytes are exact
    for a byte-level BPE, whose token may hold part of a character (its text then shows
    U+FFFD for that part: the bytes of consecutive tokens join into the character); other
    tokenizers' tokens are decoded one by one. Filled as tokens are met; one per tokenizer
    (`spelling`)."""

    def __init__(self, tok: Tokenizer) -> None:
        backend = tok.backend
        self._backend = backend
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._byte_level = type(backend.decoder).__name__ == "ByteLevel"
        self._known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._spell(token_id)
        return known

    def _spell(self, token_id: int) -> tuple[str, list[int]]:
        text = self._added.get(token_id)
        if text is None and self._byte_level:
            piece = self._backend.id_to_token(token_id) or ""
            if all(c in _BYTE_OF for c in piece):
                raw = bytes(_BYTE_OF[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
        if text is None:
            text = self._backend.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode())


_SPELLINGS: weakref.WeakKeyDictionary[Tokenizer, TokenSpelling] = weakref.WeakKeyDictionary()


def spelling(tok: Tokenizer) -> TokenSpelling:
    found = _SPELLINGS.get(tok)
    if found is None:
        found = _SPELLINGS[tok] = TokenSpelling(tok)
    return found


def _logprob(value: float) -> float:
    # JSON has no -inf (nor NaN): OpenAI's stand-in for "very unlikely".
    return value if value >= -9999.0 else -9999.0


class _Logprobs:
    """The log probabilities of one choice's tokens, as its endpoint shows them: piece by
    piece for chunks (`take`), or all of them for the whole response (`whole`)."""

    __slots__ = ("chat", "entries", "k", "offset", "spell", "taken")

    def __init__(self, chat: bool, k: int, spell: TokenSpelling) -> None:
        self.chat, self.k, self.spell = chat, k, spell
        self.entries: list[Any] = []  # ChatTokenLogprob, or (token, logprob, top, offset)
        self.taken = 0
        self.offset = 0  # characters of the choice's text before the next token

    def add(self, d: GenerateDelta) -> None:
        # One entry per token the worker gave a logprob (the gateway refuses a worker's
        # delta without them when they were asked for).
        tops = d.top_logprobs or ()
        for j, (token_id, lp) in enumerate(zip(d.token_ids, d.logprobs or (), strict=False)):
            top = tops[j][: self.k] if j < len(tops) else ()
            text, raw = self.spell(token_id)
            if self.chat:
                best = [TopLogprob(*_pair(self.spell(i), v)) for i, v in top]
                self.entries.append(ChatTokenLogprob(text, _logprob(lp), raw, best))
            else:
                # Legacy completions list the likeliest tokens and the sampled one, by text.
                likeliest = {self.spell(i)[0]: _logprob(v) for i, v in reversed(top)}
                likeliest.setdefault(text, _logprob(lp))
                self.entries.append((text, _logprob(lp), likeliest, self.offset))
                self.offset += len(text)

    def take(self) -> ChatLogprobs | CompletionLogprobs | None:
        """The entries added since the last take (None if none): what a chunk carries."""
        new = self.entries[self.taken :]
        self.taken = len(self.entries)
        return self._shaped(new) if new else None

    def whole(self) -> ChatLogprobs | CompletionLogprobs:
        return self._shaped(self.entries)

    def _shaped(self, entries: list[Any]) -> ChatLogprobs | CompletionLogprobs:
        if self.chat:
            return ChatLogprobs(content=entries)
        return CompletionLogprobs(
            tokens=[e[0] for e in entries],
            token_logprobs=[e[1] for e in entries],
            top_logprobs=[e[2] for e in entries],
            text_offset=[e[3] for e in entries],
        )


def _pair(spelt: tuple[str, list[int]], logprob: float) -> tuple[str, float, list[int]]:
    return spelt[0], _logprob(logprob), spelt[1]


# --- choices ---------------------------------------------------------------------------------


class Shape(msgspec.Struct, frozen=True):
    """Which objects one endpoint answers with."""

    kind: str  # prefix of the object id: chatcmpl-..., cmpl-...
    chat: bool


CHAT = Shape(kind="chatcmpl", chat=True)
TEXT = Shape(kind="cmpl", chat=False)


def shape_of(req: OpenAIRequest) -> Shape:
    return CHAT if isinstance(req, ChatCompletionRequest) else TEXT


@dataclass(slots=True)
class ChoiceState:
    """One choice's way through a response."""

    last: GenerateDelta
    echo: str = ""  # still to be sent before its text
    logprobs: _Logprobs | None = None
    parts: list[str] = field(default_factory=list)  # its text so far (a whole response)
    first: bool = True  # nothing of it sent yet (a stream)
    held: str | None = None  # text held back as a possible tool call (a stream)

    @property
    def text(self) -> str:
        """The choice's whole text (`collect`ed): its echoed prompt, then what was generated."""
        return self.echo + "".join(self.parts)


def _choice(shape: Shape, choices: Choices, index: int, first: GenerateDelta, tools: bool) -> ChoiceState:
    k, tok = choices.logprobs, choices.tokenizer
    return ChoiceState(
        first,
        echo=choices.echo[index // choices.n] if choices.echo else "",
        logprobs=_Logprobs(shape.chat, k, spelling(tok)) if k is not None and tok is not None else None,
        held="" if tools else None,
    )


def _chunk(
    shape: Shape,
    object_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    fin: FinishReason | None,
    first: bool,
    logprobs: ChatLogprobs | CompletionLogprobs | None,
    tier: ServiceTier,
) -> msgspec.Struct:
    if shape.chat:
        delta = Delta(role="assistant" if first else None, content=text)
        choice = ChunkChoice(index=index, delta=delta, finish_reason=fin, logprobs=logprobs)  # type: ignore[arg-type]
        return ChatCompletionChunk(
            id=object_id, created=created, model=model, choices=[choice], service_tier=tier
        )
    one = CompletionChoice(index=index, text=text, finish_reason=fin, logprobs=logprobs)  # type: ignore[arg-type]
    return Completion(id=object_id, created=created, model=model, choices=[one])


def _usage_chunk(
    shape: Shape, object_id: str, created: int, model: str, u: Usage, tier: ServiceTier
) -> msgspec.Struct:
    if shape.chat:
        return ChatCompletionChunk(
            id=object_id, created=created, model=model, choices=[], usage=u, service_tier=tier
        )
    return Completion(id=object_id, created=created, model=model, choices=[], usage=u)


async def collect(
    first: AnyDelta, rest: AsyncIterator[AnyDelta], shape: Shape = CHAT, choices: Choices = ONE
) -> dict[int, ChoiceState]:
    """Every choice, by index: its whole text, log probabilities and last delta (which
    carries its finish reason and counts)."""
    out: dict[int, ChoiceState] = {}
    async for item in _achain(first, rest):
        index, d = _tagged(item)
        c = out.get(index)
        if c is None:
            c = out[index] = _choice(shape, choices, index, d, False)
        c.parts.append(d.text)
        c.last = d
        if c.logprobs is not None:
            c.logprobs.add(d)
    return out


def final_object(
    shape: Shape,
    object_id: str,
    created: int,
    model: str,
    collected: Mapping[int, ChoiceState],
    choices: Choices = ONE,
    tools: bool = False,
    tier: ServiceTier = "default",
) -> msgspec.Struct:
    """The whole response of `collect`ed choices; with `tools`, a choice whose text is tool
    calls answers them as such. `tier`: the service tier a chat completion ran at."""
    u = usage(total({i: c.last for i, c in collected.items()}, choices.n))
    ordered = [(i, collected[i]) for i in sorted(collected)]
    if not shape.chat:
        texts = [
            CompletionChoice(
                index=i,
                text=c.text,
                finish_reason=finish_reason(c.last),
                logprobs=c.logprobs.whole() if c.logprobs else None,  # type: ignore[arg-type]
            )
            for i, c in ordered
        ]
        return Completion(id=object_id, created=created, model=model, choices=texts, usage=u)
    out = []
    for i, c in ordered:
        text = c.text
        lp = c.logprobs.whole() if c.logprobs else None
        calls = parse_tool_calls(text) if tools else None
        if calls:
            message, fin = AssistantMessage(content=None, tool_calls=calls), "tool_calls"
        else:
            message, fin = AssistantMessage(content=text), finish_reason(c.last)
        out.append(ChatChoice(index=i, message=message, finish_reason=fin, logprobs=lp))  # type: ignore[arg-type]
    return ChatCompletion(id=object_id, created=created, model=model, choices=out, usage=u, service_tier=tier)


async def sse_events(
    shape: Shape,
    object_id: str,
    created: int,
    model: str,
    first: AnyDelta,
    deltas: AsyncGenerator[AnyDelta, None],
    include_usage: bool,
    tools: bool = False,
    choices: Choices = ONE,
    tier: ServiceTier = "default",
) -> AsyncIterator[bytes]:
    """SSE `data:` lines for `first` then `deltas`, ending in `data: [DONE]`; closes `deltas`.

    Each chunk holds one choice's delta (and the log probabilities of its tokens); a choice's
    first chunk goes out at once (it carries the assistant role, or its `echo`ed prompt).
    With `tools`, text that is (or may still become) a tool call is held back; a complete call
    goes out as one `tool_calls` delta, anything else as the text it is.
    """
    states: dict[int, ChoiceState] = {}
    try:
        async for item in _achain(first, deltas):
            index, d = _tagged(item)
            c = states.get(index)
            if c is None:
                c = states[index] = _choice(shape, choices, index, d, tools)
            c.last = d
            if c.logprobs is not None:
                c.logprobs.add(d)
            fin = finish_reason(d)
            text = d.text
            if c.held is not None:
                c.held += text
                calls = parse_tool_calls(c.held) if fin else None
                if calls:
                    lp = c.logprobs.take() if c.logprobs is not None else None
                    calling = tool_call_chunks(object_id, created, model, calls, c.first, index, lp, tier)  # type: ignore[arg-type]
                    for chunk in calling:
                        yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                    c.first = False
                    continue
                if fin is None and may_be_tool_call(c.held):
                    text = ""
                else:
                    text, c.held = c.held, None
            if c.echo:
                text, c.echo = c.echo + text, ""
            # Empty deltas (e.g. a token held back as a possible stop string) are skipped;
            # their tokens' logprobs go out with the next chunk of the choice.
            if text or fin or c.first:
                lp = c.logprobs.take() if c.logprobs is not None else None
                chunk = _chunk(shape, object_id, created, model, index, text, fin, c.first, lp, tier)
                yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                c.first = False
        if include_usage:
            u = usage(total({i: c.last for i, c in states.items()}, choices.n))
            end = _usage_chunk(shape, object_id, created, model, u, tier)
            yield b"data: " + msgspec.json.encode(end) + b"\n\n"
    except APIError as exc:  # the status line is long gone: report in-band
        yield b"data: " + msgspec.json.encode(exc.body()) + b"\n\n"
    finally:
        await deltas.aclose()
    yield b"data: [DONE]\n\n"


def tool_call_chunks(
    object_id: str,
    created: int,
    model: str,
    calls: list[ToolCall],
    first: bool,
    index: int = 0,
    logprobs: ChatLogprobs | None = None,
    tier: ServiceTier = "default",
) -> list[ChatCompletionChunk]:
    """The calls in one delta (each whole: OpenAI splits arguments, clients join either), then
    the end of the choice."""
    deltas = [ToolCallDelta(index=i, id=c.id, function=c.function) for i, c in enumerate(calls)]
    delta = Delta(role="assistant" if first else None, tool_calls=deltas)
    return [
        ChatCompletionChunk(
            id=object_id,
            created=created,
            model=model,
            choices=[ChunkChoice(index=index, delta=delta, logprobs=logprobs)],
            service_tier=tier,
        ),
        ChatCompletionChunk(
            id=object_id,
            created=created,
            model=model,
            choices=[ChunkChoice(index=index, delta=Delta(), finish_reason="tool_calls")],
            service_tier=tier,
        ),
    ]


Receive = Callable[[], Awaitable[Mapping[str, Any]]]


async def collect_unless_gone(
    first: AnyDelta,
    deltas: AsyncGenerator[AnyDelta, None],
    receive: Receive,
    shape: Shape = CHAT,
    choices: Choices = ONE,
) -> dict[int, ChoiceState] | None:
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
        return await collect(first, deltas, shape, choices)
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


async def _achain(first: AnyDelta, rest: AsyncIterator[AnyDelta]) -> AsyncIterator[AnyDelta]:
    yield first
    async for d in rest:
        yield d


# --- HTTP: the one response path of /v1/chat/completions and /v1/completions ---------------


async def respond(
    request: Request[Any, Any, Any],
    body: OpenAIRequest,
    model: str,
    request_id: str,
    deltas: AsyncGenerator[AnyDelta, None],
    *,
    headers: Mapping[str, str] | None = None,
    choices: Choices = ONE,
    tier: ServiceTier = "default",
) -> Response[Any]:
    """Answer `body` from `deltas`: one JSON object, or an SSE stream.

    `deltas` are those of one sequence (plain deltas), or of all the request's sequences
    merged, each tagged with its choice (`ChoiceDelta`); `choices` says how they become
    choices. `request_id` goes out as `x-request-id` (and into the object ids), after
    `headers` (e.g. `x-ratelimit-*`), on the answer and on its errors alike. Closing `deltas`
    must stop the generation, which happens when the client goes away; so must a generator
    that was never started, which is why this starts it at once. `tier`: the service tier
    the request runs at, which chat completions report.
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
            collected = await collect_unless_gone(first, deltas, request.receive, shape, choices)
        except APIError as exc:  # failed after the first token, still before any byte was sent
            exc.headers.update(sent)
            raise
        if collected is None:
            return Response(b"", status_code=499, headers=sent)  # nobody is listening
        obj = final_object(shape, object_id, created, model, collected, choices, uses_tools(body), tier)
        return Response(msgspec.json.encode(obj), media_type="application/json", headers=sent)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Stream(
        sse_events(
            shape, object_id, created, model, first, deltas, include_usage, uses_tools(body), choices, tier
        ),
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
