"""`VllmGenerator`: the worker's `Generator` (workers/server.py) on a vLLM OpenAI server.

A request goes to vLLM's streaming `/v1/completions` as it came from the gateway: the prompt
as token ids, the sampling parameters, the tenant's `cache_salt` (vLLM salts its prefix cache
with it, so tenants stay isolated there too), the adapter as the model, a grammar as vLLM's
`structured_outputs`, `logit_bias` and `logprobs` as they are. vLLM streams text with token
ids (`return_token_ids`), and logprobs keyed by token id (`return_tokens_as_token_ids`: ids,
not strings that several tokens may share); its last chunk carries the usage, `cached_tokens`
included (`--enable-prompt-tokens-details`). Deltas come out as the builtin worker's do, with
running counts, the same finish reasons, and the same raw logprobs (vLLM's default
`logprobs_mode`, computed before any logit processing, as our engine's).

Validation is the builtin worker's (context length, vocabulary, sampling ranges, grammars),
so a bad request gets the same 400 before the stream starts whichever engine serves it; what
vLLM still refuses afterwards ends the stream with its message, as an engine failure does.
Closing a delta stream (the client went away) closes its HTTP stream to vLLM, which aborts
the request there.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
import msgspec

from tokenmill import tracing
from tokenmill.errors import APIError
from tokenmill.protocol import GenerateDelta, GenerateRequest, KvOp
from tokenmill.request_limits import check_prompt
from tokenmill.tokenization import Tokenizer
from tokenmill.vllm_args import schedules_by_priority
from workers.adapters import AdapterProblem, FetchAdapter
from workers.engine.sampling import SamplingParams
from workers.engine.structured import JSON_LAYOUT
from workers.generator import InvalidRequest
from workers.vllm.lora import VllmAdapters
from workers.vllm.metrics import MetricsPoller, VllmFigures
from workers.vllm.server import VllmServer

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0
CALL_TIMEOUT = 30.0  # /metrics, adapters' unload: anything but a generation's stream
CHILD_POLL_SECONDS = 0.5
# vLLM's own limits on a cache salt (vllm/entrypoints/generate/base/protocol.py).
_SALT_MAX = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")
# vLLM's finish reasons -> ours (stop | length | abort | error); anything newer ended the
# output on the model's or the request's terms: a stop.
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class KvEvents(Protocol):
    """What the generator needs of `workers.vllm.kv_events.KvEventMapper`."""

    def note(self, req: GenerateRequest) -> None: ...

    def done(self, request_id: str) -> None: ...

    async def run(self) -> None: ...

    def drain(self) -> list[KvOp]: ...


class VllmFailed(RuntimeError):
    """vLLM failed a request after its stream began (the server turns it into an error delta)."""


class VllmServerExited(RuntimeError):
    """The vLLM child process exited: this worker cannot generate any more."""


# --- vLLM's stream, as much of it as we read ----------------------------------------------------


class _Logprobs(msgspec.Struct):
    token_logprobs: list[float | None] = []
    # Per token: {"token_id:<id>": logprob} of the sampled token and the `logprobs` likeliest.
    top_logprobs: list[dict[str, float] | None] = []


class _Choice(msgspec.Struct):
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def _error_message(body: bytes) -> tuple[str, str | None]:
    """(message, param) of a vLLM error body."""
    try:
        err = json.loads(body).get("error") or {}
        return str(err.get("message") or body[:500].decode(errors="replace")), err.get("param")
    except (ValueError, AttributeError):
        return body[:500].decode(errors="replace") or "no details", None


_TOKEN_ID_PREFIX = "token_id:"  # vLLM's spelling of a token under return_tokens_as_token_ids


def _token_id(key: str) -> int:
    if not key.startswith(_TOKEN_ID_PREFIX):
        raise VllmFailed(f"vLLM named a token {key[:50]!r}, not by its id")
    return int(key[len(_TOKEN_ID_PREFIX) :])


def wire_logprobs(
    token_ids: list[int], logprobs: _Logprobs | None, k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """vLLM's logprobs of a chunk's tokens as the wire's: per token its logprob, and its `k`
    likeliest (token id, logprob), best first. vLLM's dict per token holds the sampled token and
    the top k, so k + 1 entries when the sampled one is not among them: that one is dropped."""
    if logprobs is None or len(logprobs.token_logprobs) != len(token_ids):
        raise VllmFailed("vLLM's logprobs do not match its tokens")
    chosen: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for token, lp, top in zip(token_ids, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        if lp is None or top is None:
            raise VllmFailed("vLLM sent a token without its logprob")
        chosen.append(lp)
        entries = [(_token_id(key), value) for key, value in top.items()]
        if len(entries) > k:
            entries = [e for e in entries if e[0] != token]
        entries.sort(key=lambda e: -e[1])
        tops.append(entries[:k])
    return chosen, tops


def _salt_ok(salt: str) -> bool:
    return 0 < len(salt) <= _SALT_MAX and not (_SALT_FORBIDDEN & set(salt))


def structured_outputs(kind: str, spec: str) -> dict[str, Any]:
    """Our grammar as vLLM's `structured_outputs`. JSON gets our engine's layout (one space
    after ':' and ','): llguidance, vLLM's backend here, honours a schema's `x-guidance`."""
    if kind == "json_schema":
        schema = json.loads(spec)
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": JSON_LAYOUT}
        return {"json": schema}
    if kind == "json_object":
        return {"json": {"type": "object", "x-guidance": JSON_LAYOUT}}
    if kind == "regex":
        return {"regex": spec}
    return {"grammar": spec}  # lark: llguidance's dialect, as our engine's


class VllmGenerator:
    def __init__(
        self,
        server: VllmServer,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        fetch_adapter: FetchAdapter | None = None,
        kv_events: KvEvents | None = None,
        poll_seconds: float = 1.0,
        max_adapters: int = 8,
        stream_timeout: float = 600.0,
    ) -> None:
        """`poll_seconds`: how often vLLM's /metrics is read (the heartbeat interval);
        `max_adapters`: most adapters registered with vLLM at once; `stream_timeout`: longest
        silence inside a generation's stream (a request queued in vLLM sends nothing)."""
        self.server = server
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.kv_events = kv_events
        # One client, keep-alive, for every call: no connection set-up per request, and no
        # cap on connections (vLLM queues what it cannot run; the gateway limits concurrency).
        self._client = httpx.AsyncClient(
            base_url=server.url,
            timeout=httpx.Timeout(CALL_TIMEOUT, connect=CONNECT_TIMEOUT),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._stream_timeout = httpx.Timeout(
            CALL_TIMEOUT, connect=CONNECT_TIMEOUT, read=stream_timeout, pool=None
        )
        self._metrics = MetricsPoller(self._client, poll_seconds)
        self._adapters = VllmAdapters(self._client, fetch_adapter, enabled=server.lora, capacity=max_adapters)
        self._ids = itertools.count()
        # vLLM refuses a priority unless it schedules by priority (an engine argument).
        self._priorities = schedules_by_priority(server.engine_args)

    # --- load, for metrics and heartbeats: vLLM's own figures ---------------------------------------

    @property
    def figures(self) -> VllmFigures:
        return self._metrics.figures

    @property
    def running(self) -> int:
        return self._metrics.figures.running

    @property
    def waiting(self) -> int:
        return self._metrics.figures.waiting

    @property
    def kv_usage(self) -> float:
        return self._metrics.figures.kv_usage

    @property
    def prefix_cache_queries(self) -> int:
        return self._metrics.figures.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self._metrics.figures.prefix_cache_hits

    @property
    def spec_draft_tokens(self) -> int:
        return self._metrics.figures.spec_draft_tokens

    @property
    def spec_accepted_tokens(self) -> int:
        return self._metrics.figures.spec_accepted_tokens

    @property
    def context_length(self) -> int:
        """vLLM's max_model_len: most tokens (prompt + completion) one sequence may hold."""
        return self.server.max_model_len

    async def poll_metrics(self) -> VllmFigures:
        """Read vLLM's /metrics now (what `run` does every `poll_seconds`)."""
        return await self._metrics.poll()

    def drain_kv_events(self) -> list[KvOp]:
        return self.kv_events.drain() if self.kv_events is not None else []

    # --- life cycle ------------------------------------------------------------------------------

    async def run(self) -> None:
        """The worker's background work while it serves: vLLM's figures, its KV events, and a
        watch on the child. Returns (raising VllmServerExited) only if the child exits."""
        tasks = [asyncio.create_task(self._metrics.run(), name="vllm-metrics")]
        if self.kv_events is not None:
            tasks.append(asyncio.create_task(self.kv_events.run(), name="vllm-kv-events"))
        try:
            while (code := self.server.exited()) is None:
                for task in tasks:
                    if task.done():
                        task.result()  # a bug in a poller: fail loudly rather than go stale
                await asyncio.sleep(CHILD_POLL_SECONDS)
            raise VllmServerExited(f"the vLLM server exited with {code}")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        await self._client.aclose()

    def close(self) -> None:
        """Stop the vLLM child, if it is ours (after the worker has drained)."""
        self.server.stop()

    # --- LoRA adapters -------------------------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        return self._adapters.ids

    async def load_adapter(self, adapter_id: str, key: str | None = None) -> list[str]:
        return await self._adapters.load(adapter_id, key)

    async def unload_adapter(self, adapter_id: str) -> None:
        await self._adapters.unload(adapter_id)

    # --- requests ----------------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> None:
        """The builtin worker's checks, with vLLM's context length: the same 400s."""
        if req.adapter is not None and self._adapters.enabled is False:
            raise InvalidRequest("this worker does not serve adapters", "adapter")
        try:  # the gateway's check again: anything holding the internal token can call a worker
            check_prompt(
                req.prompt_token_ids,
                self.context_length,
                param="prompt_token_ids",
                vocab_size=self.vocab_size,
            )
        except APIError as exc:
            raise InvalidRequest(exc.message, exc.param) from exc
        try:
            params = SamplingParams.from_wire(req.sampling)
        except ValueError as exc:
            raise InvalidRequest(str(exc), getattr(exc, "param", None)) from exc
        try:
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "logit_bias") from exc
        if params.grammar is not None:
            try:  # compiled without the tokenizer (cheap); vLLM compiles it for real
                params.grammar.check()
            except ValueError as exc:
                raise InvalidRequest(str(exc), "grammar") from exc
        if req.cache_salt is not None and not _salt_ok(req.cache_salt):
            raise InvalidRequest("cache_salt is not one vLLM accepts", "cache_salt")

    def body(self, req: GenerateRequest, vllm_id: str) -> dict[str, Any]:
        """The `/v1/completions` request for `req`. Every sampling field is explicit, so the
        model's generation_config.json (vLLM's default for missing ones) changes nothing."""
        s = req.sampling
        room = self.context_length - len(req.prompt_token_ids)
        body: dict[str, Any] = {
            "model": req.adapter or self.server.model,
            "prompt": req.prompt_token_ids,
            "request_id": vllm_id,
            # As our engine: a completion stops at the end of the context ("length"), not a 400.
            "max_tokens": max(1, min(s.max_tokens, room)),
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty,
            "stop": list(s.stop),
            "stop_token_ids": list(s.stop_token_ids),
            "ignore_eos": s.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if s.seed is not None:
            # vLLM takes signed 64-bit seeds; ours may be any integer (the engine wraps it too).
            seed = s.seed & 0xFFFF_FFFF_FFFF_FFFF
            body["seed"] = seed - (1 << 64) if seed >= 1 << 63 else seed
        if s.grammar is not None:
            body["structured_outputs"] = structured_outputs(s.grammar.kind, s.grammar.spec)
        if s.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in s.logit_bias.items()}
        if s.logprobs is not None:
            body["logprobs"] = s.logprobs
            body["return_tokens_as_token_ids"] = True
        if req.cache_salt:
            body["cache_salt"] = req.cache_salt
        if self._priorities and req.priority:
            body["priority"] = req.priority
        return body

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Deltas of one request; the last carries finish_reason. Closing the iterator aborts."""
        # vLLM's id is ours: a client reusing an id must not collide with (or abort) another.
        vllm_id = f"{req.request_id}#{next(self._ids)}"
        if self.kv_events is not None:
            self.kv_events.note(msgspec.structs.replace(req, request_id=vllm_id))
        try:
            for attempt in range(2):
                if req.adapter is not None:
                    self._adapters.touch(req.adapter)
                try:
                    async for delta in self._stream(req, vllm_id):
                        yield delta
                    return
                except _AdapterGone:
                    # Unloaded between load_adapter and now (LRU, an operator): load it again, once.
                    assert req.adapter is not None
                    self._adapters.forget(req.adapter)
                    if attempt:
                        message = f"adapter {req.adapter!r} is not loaded on the vLLM server"
                        raise VllmFailed(message) from None
                    try:
                        await self._adapters.load(req.adapter, req.adapter_key)
                    except AdapterProblem as exc:
                        raise VllmFailed(str(exc)) from exc
        finally:
            if self.kv_events is not None:
                self.kv_events.done(vllm_id)

    async def _stream(self, req: GenerateRequest, vllm_id: str) -> AsyncIterator[GenerateDelta]:
        prompt_tokens = len(req.prompt_token_ids)
        k = req.sampling.logprobs
        payload = msgspec.json.encode(self.body(req, vllm_id))
        headers = {"content-type": "application/json"}
        tracing.inject(headers)  # vLLM's own spans (its --otlp-traces-endpoint) join the request's trace
        try:
            async with self._client.stream(
                "POST", "/v1/completions", content=payload, headers=headers, timeout=self._stream_timeout
            ) as resp:
                if resp.status_code != 200:
                    body = await resp.aread()
                    message, param = _error_message(body)
                    if resp.status_code == 404 and req.adapter is not None and param == "model":
                        raise _AdapterGone
                    if 400 <= resp.status_code < 500:
                        raise VllmFailed(f"vLLM refused the request: {message}")
                    raise VllmFailed(f"vLLM failed the request (HTTP {resp.status_code}): {message}")
                completion = 0
                final: GenerateDelta | None = None
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = _chunk_decoder.decode(data)
                    if chunk.error is not None:
                        message = chunk.error.get("message", chunk.error)
                        raise VllmFailed(f"vLLM failed the request: {message}")
                    if chunk.usage is not None and final is not None:
                        # The usage chunk follows the last choice: the counts vLLM bills by.
                        usage = chunk.usage
                        details = usage.prompt_tokens_details
                        final.prompt_tokens = usage.prompt_tokens
                        final.completion_tokens = usage.completion_tokens
                        final.cached_tokens = (details.cached_tokens or 0) if details else 0
                    for choice in chunk.choices:
                        ids = choice.token_ids or []
                        completion += len(ids)
                        delta = GenerateDelta(
                            text=choice.text,
                            token_ids=ids,
                            prompt_tokens=prompt_tokens,
                            completion_tokens=completion,
                        )
                        if k is not None:
                            delta.logprobs, delta.top_logprobs = (
                                wire_logprobs(ids, choice.logprobs, k) if ids else ([], [])
                            )
                        if choice.finish_reason is None:
                            if ids or choice.text:
                                yield delta
                        elif choice.finish_reason == "error":
                            raise VllmFailed("vLLM failed while generating")
                        else:  # held until the usage chunk brings cached_tokens
                            delta.finish_reason = _FINISH.get(choice.finish_reason, "stop")
                            final = delta
                if final is None:
                    raise VllmFailed("vLLM ended the stream without finishing the request")
                yield final
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            raise VllmFailed(f"the vLLM server at {self.server.url} failed: {reason}") from exc


class _AdapterGone(Exception):
    """vLLM does not know the adapter a request names (404 on its model)."""
