"""The request path: who is calling, what serves the model, tokens in, deltas out, usage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.services import CatalogService, authenticate
from gateway.fleet import FleetView, WorkerState
from tokenmill.bus import Publisher
from tokenmill.errors import APIError
from tokenmill.modelstore import resolve_model
from tokenmill.openai_types import ChatCompletionRequest, ChatMessage, CompletionRequest
from tokenmill.protocol import USAGE, GenerateDelta, GenerateRequest, SamplingParams, UsageRecord
from tokenmill.settings import Settings
from tokenmill.tokenization import Tokenizer

log = logging.getLogger("tokenmill.gateway")

MAX_ATTEMPTS = 3


@dataclass(slots=True, frozen=True)
class Caller:
    key_id: str
    org_id: str
    role: str
    scopes: tuple[str, ...] | None
    cache_salt: str

    def may_use(self, model: str) -> bool:
        return self.scopes is None or model in self.scopes


@dataclass(slots=True, frozen=True)
class Target:
    deployment_id: str
    model: str  # the public name the caller asked for
    source: str
    context_length: int
    defaults: dict[str, float]  # sampling parameters a request leaves out


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    sampling: SamplingParams


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        sessionmaker: async_sessionmaker[AsyncSession],
        fleet: FleetView,
        publisher: Publisher,
        http: httpx.AsyncClient,
    ) -> None:
        self.settings = settings
        self.sessionmaker = sessionmaker
        self.fleet = fleet
        self.publisher = publisher
        self.http = http
        self._tokenizers: dict[str, asyncio.Future[Tokenizer]] = {}
        self._delta = msgspec.json.Decoder(GenerateDelta)

    # --- who and what ------------------------------------------------------------------

    async def authenticate(self, authorization: str | None) -> Caller:
        scheme, _, secret = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise APIError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer tm-...'.",
                code="invalid_api_key",
            )
        assert self.settings.secret_key
        async with self.sessionmaker() as session:
            key, org = await authenticate(session, secret.strip(), self.settings.secret_key)
        if org.status != "active":
            raise APIError(403, "This organisation is suspended.", code="organization_suspended")
        return Caller(key.id, org.id, key.role, tuple(key.scopes) if key.scopes else None, org.cache_salt)

    async def models(self, caller: Caller) -> list[tuple[str, int, str]]:
        """(name, created, owner) of every model the caller may use."""
        async with self.sessionmaker() as session:
            rows = await CatalogService(session).visible_deployments(caller.org_id)
        return [
            (d.name, int(d.created_at.timestamp()), d.org_id or "tokenmill")
            for d, _ in rows
            if d.kind == "generate" and caller.may_use(d.name)
        ]

    async def resolve(self, caller: Caller, name: str) -> Target:
        async with self.sessionmaker() as session:
            dep, model = await CatalogService(session).resolve(name, caller.org_id)
        if not caller.may_use(dep.name):
            raise APIError(
                404,
                f"The model '{name}' does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        if dep.kind != "generate":
            raise APIError(400, f"The model '{name}' does not generate text.", param="model")
        defaults = (dep.config or {}).get("sampling") or {}
        return Target(dep.id, dep.name, model.source, model.context_length, defaults)

    async def tokenizer(self, target: Target) -> Tokenizer:
        # One load per model, shared by concurrent first requests; resolving may convert
        # the model (seconds), so it runs in a thread.
        fut = self._tokenizers.get(target.source)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(self._load_tokenizer, target.source))
            self._tokenizers[target.source] = fut
        try:
            return await asyncio.shield(fut)
        except Exception:
            self._tokenizers.pop(target.source, None)
            raise

    def _load_tokenizer(self, source: str) -> Tokenizer:
        return Tokenizer.from_dir(resolve_model(source, self.settings.cache_dir))

    # --- prompts -----------------------------------------------------------------------

    def chat_prompt(self, req: ChatCompletionRequest, tok: Tokenizer, target: Target) -> Prompt:
        _reject_unsupported(req.n, req.tools, req.response_format, bool(req.logprobs))
        messages = [_message_dict(m) for m in req.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:  # a template may raise on e.g. wrong role order
            raise APIError(400, f"Could not render the chat template: {exc}", param="messages") from exc
        ids = tok.encode(text)
        max_tokens = req.max_completion_tokens or req.max_tokens
        return Prompt(ids, self._sampling(req, ids, max_tokens, target))

    def completion_prompt(self, req: CompletionRequest, tok: Tokenizer, target: Target) -> Prompt:
        _reject_unsupported(req.n, None, None, req.logprobs is not None)
        if req.echo or req.suffix:
            raise APIError(400, "'echo' and 'suffix' are not supported yet.", param="echo")
        prompt = req.prompt
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt) and prompt:
            if len(prompt) != 1:
                raise APIError(400, "Send one prompt per request for now.", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        elif all(isinstance(t, int) and 0 <= t < tok.vocab_size for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise APIError(
                400, "'prompt' must be a string, a list of strings or a list of token ids.", param="prompt"
            )
        if not ids:
            raise APIError(400, "The prompt must not be empty.", param="prompt")
        return Prompt(ids, self._sampling(req, ids, req.max_tokens or 16, target))

    def _sampling(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        ids: list[int],
        max_tokens: int | None,
        target: Target,
    ) -> SamplingParams:
        room = target.context_length - len(ids)
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = f" plus {max_tokens} completion tokens" if max_tokens else ""
            raise APIError(
                400,
                f"This model's maximum context length is {target.context_length} tokens. "
                f"However, you requested {len(ids)} prompt tokens{asked}.",
                code="context_length_exceeded",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        d = target.defaults

        def pick(value: float | None, name: str, fallback: float) -> float:
            return value if value is not None else float(d.get(name, fallback))

        return SamplingParams(
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

    # --- generation ----------------------------------------------------------------------

    async def generate(
        self, caller: Caller, target: Target, request_id: str, prompt: Prompt
    ) -> AsyncIterator[GenerateDelta]:
        """Deltas from a worker; retried on another worker until the first token arrives.

        Exactly one usage event is published however this ends (finish, error, client gone).
        """
        body = msgspec.json.encode(
            GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt.token_ids,
                sampling=prompt.sampling,
                cache_salt=caller.cache_salt,
                fairness_key=caller.org_id,
            )
        )
        started = time.monotonic()
        ttft: float | None = None
        last = GenerateDelta(prompt_tokens=len(prompt.token_ids))
        status = "error"
        tried: set[str] = set()
        try:
            while True:
                worker = await self._worker(target, tried)
                tried.add(worker.worker_id)
                worker.inflight += 1
                try:
                    async for delta in self._stream(worker, body):
                        if ttft is None:
                            ttft = time.monotonic() - started
                        last = delta
                        yield delta
                    status = "ok" if last.finish_reason not in ("error", "abort") else last.finish_reason
                    return
                except (httpx.TransportError, _WorkerFailed) as exc:
                    self.fleet.forget(worker.worker_id)
                    if ttft is not None or len(tried) >= MAX_ATTEMPTS:
                        log.warning("worker %s failed mid-request %s: %s", worker.worker_id, request_id, exc)
                        raise APIError(
                            503,
                            "The model worker failed while generating; please retry.",
                            code="worker_error",
                        ) from exc
                    log.info("worker %s failed before the first token; retrying elsewhere", worker.worker_id)
                finally:
                    worker.inflight -= 1
        except (GeneratorExit, asyncio.CancelledError):
            status = "cancelled"
            raise
        finally:
            await self._meter(caller, target, request_id, last, status, ttft, time.monotonic() - started)

    async def _worker(self, target: Target, tried: set[str]) -> WorkerState:
        wait = self.settings.worker_wait_seconds if not tried else 2 * self.settings.heartbeat_seconds
        worker = await self.fleet.wait_for(target.deployment_id, wait, exclude=tried)
        if worker is None:
            raise APIError(
                503,
                f"No worker is serving '{target.model}' right now; please retry shortly.",
                code="no_worker_available",
            )
        return worker

    async def _stream(self, worker: WorkerState, body: bytes) -> AsyncIterator[GenerateDelta]:
        headers = {
            "authorization": f"Bearer {self.settings.internal_token}",
            "content-type": "application/json",
        }
        async with self.http.stream("POST", f"{worker.address}/generate", content=body, headers=headers) as r:
            if r.status_code != 200:
                detail = (await r.aread())[:500]
                raise _WorkerFailed(f"status {r.status_code}: {detail!r}")
            async for line in r.aiter_lines():
                if line:
                    yield self._delta.decode(line)

    async def _meter(
        self,
        caller: Caller,
        target: Target,
        request_id: str,
        last: GenerateDelta,
        status: str,
        ttft: float | None,
        duration: float,
    ) -> None:
        record = UsageRecord(
            request_id=request_id,
            org_id=caller.org_id,
            api_key_id=caller.key_id,
            model=target.model,
            deployment_id=target.deployment_id,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            completion_tokens=last.completion_tokens,
            ttft_ms=None if ttft is None else ttft * 1000,
            duration_ms=duration * 1000,
            status=status,
            ts=time.time(),
        )
        try:
            await asyncio.shield(self.publisher.publish(USAGE, record))
        except Exception:
            log.exception("could not publish usage event %s", request_id)


class _WorkerFailed(Exception):
    pass


def _message_dict(m: ChatMessage) -> dict[str, object]:
    content = m.content
    if isinstance(content, list):
        if any(p.type != "text" for p in content):
            raise APIError(400, "Only text content parts are supported.", param="messages")
        content = "".join(p.text or "" for p in content)
    out: dict[str, object] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name:
        out["name"] = m.name
    return out


def _reject_unsupported(n: int, tools: object, response_format: dict | None, logprobs: bool) -> None:
    if n != 1:
        raise APIError(400, "Only n = 1 is supported for now.", param="n")
    if tools:
        raise APIError(400, "Tool calling is not supported yet.", param="tools")
    if response_format and response_format.get("type") not in (None, "text"):
        raise APIError(400, "Only response_format 'text' is supported yet.", param="response_format")
    if logprobs:
        raise APIError(400, "logprobs are not supported yet.", param="logprobs")
