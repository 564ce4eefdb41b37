"""The request path: who is calling, what serves the model, tokens in, deltas out, usage.

A request is first admitted (`admit`: its request count, the model, the prompt prepared
off the event loop when large, then its tokens, concurrency and budget hold), then served
(`stream` / `embed`: routed, retried before the first token, settled and metered once
however it ends). Nothing expensive happens before the request is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.catalog.services import CatalogService
from gateway.admission import Admitter, Ticket
from gateway.embeddings import check_dimensions, vector_size
from gateway.fleet import FleetView, WorkerState
from gateway.keys import Caller, KeyCache
from gateway.prep import Prep
from gateway.upstream import Upstream, UpstreamError
from tokenmill.bus import Publisher
from tokenmill.errors import APIError
from tokenmill.hashing import extra_keys, hash_blocks
from tokenmill.modelstore import resolve_model
from tokenmill.openai_shapes import Prompt, chat_prompt, completion_prompt, embedding_inputs, model_not_found
from tokenmill.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tokenmill.protocol import USAGE, EmbedRequest, EmbedResponse, GenerateDelta, GenerateRequest, UsageRecord
from tokenmill.request_limits import RequestLimits, check_chat, check_completion, check_embedding
from tokenmill.settings import Settings
from tokenmill.storage import open_storage
from tokenmill.tokenization import Tokenizer

log = logging.getLogger("tokenmill.gateway")

MAX_ATTEMPTS = 3
# How long a resolved model name is reused without reading the catalogue again, and how many
# (organisation, name) pairs are kept.
CATALOG_TTL = 5.0
CATALOG_MAX = 10_000


@dataclass(slots=True, frozen=True)
class Target:
    deployment_id: str
    model: str  # the public name the caller asked for
    model_id: str
    source: str
    context_length: int
    defaults: dict[str, float]  # sampling parameters a request leaves out
    adapter_id: str | None = None
    kind: str = "generate"  # of the deployment: generate | embed
    dedicated: bool = False  # billed by GPU-hour, so its tokens cost nothing per token
    adapter_key: str | None = None  # storage folder of the adapter's files, for the worker

    @property
    def priced_model(self) -> str | None:
        """The model whose token prices this request pays, if any."""
        return None if self.dedicated else self.model_id


@dataclass(slots=True)
class Admitted:
    """A request let through admission, with everything needed to serve it."""

    request_id: str
    caller: Caller
    target: Target
    ticket: Ticket
    prompt: Prompt | None = None  # generation
    inputs: list[list[int]] | None = None  # embeddings

    @property
    def headers(self) -> dict[str, str]:
        """What every answer to it carries: `x-ratelimit-*` (and `x-request-id`)."""
        return {**self.ticket.headers, "x-request-id": self.request_id}


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        sessionmaker: async_sessionmaker[AsyncSession],
        fleet: FleetView,
        keys: KeyCache,
        admitter: Admitter,
        publisher: Publisher,
        upstream: Upstream,
        prep: Prep,
    ) -> None:
        self.settings = settings
        self.sessionmaker = sessionmaker
        self.fleet = fleet
        self.keys = keys
        self.admitter = admitter
        self.publisher = publisher
        self.upstream = upstream
        self.prep = prep
        self.limits = RequestLimits.from_settings(settings)
        self._settling: set[asyncio.Future[None]] = set()  # held so they are not collected mid-way
        self._internal = {
            "authorization": f"Bearer {settings.worker_credential}",
            "content-type": "application/json",
        }
        self._tokenizers: dict[str, asyncio.Future[Tokenizer]] = {}
        # Length of the vectors an embedding model makes, per source, read with its tokenizer.
        self._dimensions: dict[str, int | None] = {}
        self._targets: dict[tuple[str, str], tuple[Target, float]] = {}
        self._resolving: dict[tuple[str, str], asyncio.Future[Target]] = {}
        self._delta = msgspec.json.Decoder(GenerateDelta)
        self._embedded = msgspec.json.Decoder(EmbedResponse)

    # --- who and what ------------------------------------------------------------------

    async def authenticate(self, authorization: str | None) -> Caller:
        return await self.keys.caller(authorization)

    async def models(self, caller: Caller) -> list[tuple[str, int, str]]:
        """(name, created, owner) of every model the caller may use: deployments it can see
        and its organisation's own adapters."""
        async with self.sessionmaker() as session:
            catalog = CatalogService(session)
            rows = await catalog.visible_deployments(caller.org_id)
            adapters = await catalog.adapters(caller.org_id)
        served = {m.id for d, m in rows if d.kind == "generate" and d.org_id is None}
        out = [(d.name, int(d.created_at.timestamp()), d.org_id or "tokenmill") for d, _ in rows]
        out += [(a.name, int(a.created_at.timestamp()), a.org_id) for a in adapters if a.model_id in served]
        return sorted(o for o in out if caller.may_use(o[0]))

    async def model(self, caller: Caller, name: str) -> tuple[str, int, str]:
        """(name, created, owner) of one model the caller may use: `models` filtered, so
        retrieving follows the listing's rules exactly; 404 for anything it does not list."""
        for found in await self.models(caller):
            if found[0] == name:
                return found
        raise model_not_found(name)

    async def resolve(self, caller: Caller, name: str, kind: str = "generate") -> Target:
        target = await self._resolve(caller.org_id, name)
        if not caller.may_use(name):
            raise model_not_found(name)
        if target.kind != kind:
            does = "generate text" if kind == "generate" else "compute embeddings"
            raise APIError(400, f"The model '{name}' does not {does}.", param="model")
        return target

    async def _resolve(self, org_id: str, name: str) -> Target:
        """What `name` means to `org_id`, from the catalogue read at most once per
        `CATALOG_TTL` seconds. Only hits are cached: a model that appears is usable at once,
        a changed or removed one serves its old meaning for at most the TTL."""
        key = (org_id, name)
        hit = self._targets.get(key)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        # Concurrent misses (every request in flight, when an entry expires) share one read.
        fut = self._resolving.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._load_target(org_id, name))
            self._resolving[key] = fut
            fut.add_done_callback(lambda _: self._resolving.pop(key, None))
        return await asyncio.shield(fut)

    async def _load_target(self, org_id: str, name: str) -> Target:
        async with self.sessionmaker() as session:
            dep, model, adapter = await CatalogService(session).resolve(name, org_id)
        target = Target(
            dep.id,
            name,
            model.id,
            model.source,
            model.context_length,
            (dep.config or {}).get("sampling") or {},
            adapter.id if adapter else None,
            dep.kind,
            dep.type == "dedicated",
            adapter_key=adapter.storage_key if adapter else None,
        )
        if len(self._targets) >= CATALOG_MAX:  # many orgs x names: start over rather than grow
            self._targets.clear()
        self._targets[(org_id, name)] = (target, time.monotonic() + CATALOG_TTL)
        return target

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
        # A stored model (`store:`) is fetched once, like a worker fetches it.
        storage = lambda: open_storage(self.settings)  # noqa: E731 - opened only for `store:`
        path = resolve_model(source, self.settings.cache_dir, storage=storage)
        self._dimensions[source] = vector_size(path)
        return Tokenizer.from_dir(path)

    async def embedding_dimensions(self, target: Target) -> int | None:
        """How long the vectors of `target`'s model are (None if its files do not say)."""
        await self.tokenizer(target)
        return self._dimensions.get(target.source)

    # --- admission -----------------------------------------------------------------------

    async def admit(
        self,
        caller: Caller,
        request_id: str,
        body: ChatCompletionRequest | CompletionRequest | EmbeddingRequest,
    ) -> Admitted:
        """Count the request, then resolve its model, prepare its prompt and admit its tokens;
        raises APIError (with the `x-ratelimit-*` headers known so far) when it may not run.
        What this returns holds limits and a budget hold: serve it with `stream` or `embed`,
        which give them back however the request ends."""
        headers = await self.admitter.count(caller, request_id)
        try:
            admitted = await self._prepare(caller, request_id, body)
        except APIError as exc:
            exc.headers = {**headers, **exc.headers}
            raise
        admitted.ticket.headers = {**headers, **admitted.ticket.headers}
        return admitted

    async def _prepare(
        self,
        caller: Caller,
        request_id: str,
        body: ChatCompletionRequest | CompletionRequest | EmbeddingRequest,
    ) -> Admitted:
        """`admit` once the request is counted: its model, its prompt (prepared off the event
        loop when large), then its tokens, concurrency and budget hold."""
        org, limits = caller.org_id, self.limits
        if isinstance(body, EmbeddingRequest):
            target = await self.resolve(caller, body.model, kind="embed")
            size = check_embedding(body, limits)
            tok = await self.tokenizer(target)
            if body.dimensions is not None:
                check_dimensions(body.dimensions, target.model, await self.embedding_dimensions(target))
            inputs = await self.prep.run(
                org, size, embedding_inputs, body, tok, context_length=target.context_length
            )
            ticket = await self._admit(caller, target.priced_model, request_id, sum(map(len, inputs)), 0)
            return Admitted(request_id, caller, target, ticket, inputs=inputs)
        target = await self.resolve(caller, body.model)
        chat = isinstance(body, ChatCompletionRequest)
        size = check_chat(body, limits) if chat else check_completion(body, limits)  # type: ignore[arg-type]
        tok = await self.tokenizer(target)
        prompt = await self.prep.run(
            org,
            size,
            chat_prompt if chat else completion_prompt,  # type: ignore[arg-type]
            body,
            tok,
            context_length=target.context_length,
            defaults=target.defaults,
        )
        ticket = await self._admit(
            caller, target.priced_model, request_id, len(prompt.token_ids), prompt.sampling.max_tokens
        )
        return Admitted(request_id, caller, target, ticket, prompt=prompt)

    async def _admit(
        self, caller: Caller, model_id: str | None, request_id: str, prompt_tokens: int, max_tokens: int
    ) -> Ticket:
        """`Admitter.admit`, given back if the caller is cancelled while it runs: a client
        leaving at that instant must not keep a concurrency slot and a budget hold until they
        expire on their own."""
        task = asyncio.ensure_future(
            self.admitter.admit(caller, model_id, request_id, prompt_tokens, max_tokens)
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._give_back)
            raise

    def _give_back(self, task: asyncio.Future[Ticket]) -> None:
        if not task.cancelled() and task.exception() is None:
            settle = asyncio.ensure_future(self.admitter.settle(task.result(), 0, 0, 0))
            self._settling.add(settle)
            settle.add_done_callback(self._settling.discard)

    # --- generation ----------------------------------------------------------------------

    async def stream(self, admitted: Admitted) -> AsyncGenerator[GenerateDelta, None]:
        """Deltas from a worker; retried on another worker until the first token arrives.

        Exactly one usage event is published however this ends (finish, error, client
        gone), and the limits and budget hold are settled. Whoever admitted the request must
        start this generator at once (`respond` does): its `finally` is what settles.
        """
        caller, target, prompt = admitted.caller, admitted.target, admitted.prompt
        request_id = admitted.request_id
        assert prompt is not None
        started = time.monotonic()
        deadline = started + self.settings.max_stream_seconds
        ttft: float | None = None
        # Only what a worker reports is billed: a request no worker took costs nothing.
        last = GenerateDelta()
        status = "error"
        try:
            body = msgspec.json.encode(
                GenerateRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt.token_ids,
                    sampling=prompt.sampling,
                    adapter=target.adapter_id,
                    cache_salt=caller.cache_salt,
                    fairness_key=caller.org_id,
                    adapter_key=target.adapter_key,
                )
            )
            # The prompt's chained block hashes, salted per organisation (and adapter) exactly
            # as the engine salts them, so the router can find the worker that holds its prefix.
            extra = extra_keys(caller.cache_salt, target.adapter_id)
            hashes = [h.hex() for h in hash_blocks(prompt.token_ids, self.settings.block_size, extra)]
            tried: set[str] = set()
            while True:
                worker = await self._worker(target, request_id, tried, hashes)
                tried.add(worker.worker_id)
                worker.inflight += 1
                try:
                    async for delta in self._stream(worker, body):
                        if ttft is None:
                            ttft = time.monotonic() - started
                        elif time.monotonic() > deadline:
                            # A rollout waits this long for streams in flight: none may outlast it.
                            raise APIError(
                                504,
                                f"The response ran longer than the {self.settings.max_stream_seconds:g} "
                                "seconds a request may last; ask for fewer tokens.",
                                code="stream_too_long",
                            )
                        last = delta
                        yield delta
                    status = "ok" if last.finish_reason not in ("error", "abort") else last.finish_reason
                    return
                except (UpstreamError, _WorkerFailed) as exc:
                    self.fleet.forget(worker.worker_id)
                    if ttft is not None or len(tried) >= MAX_ATTEMPTS:
                        log.warning("worker %s failed mid-request %s: %s", worker.worker_id, request_id, exc)
                        raise _worker_failure(exc, "The model worker") from exc
                    log.info("worker %s failed before the first token; retrying elsewhere", worker.worker_id)
                finally:
                    worker.inflight -= 1
        except (GeneratorExit, asyncio.CancelledError):
            status = "cancelled"
            raise
        finally:
            await self._finish(admitted, last, status, ttft, time.monotonic() - started)

    async def embed(self, admitted: Admitted) -> EmbedResponse:
        """Embeddings of the admitted inputs from a worker of the embed deployment, retried on
        another worker when one fails, metered once like a generation."""
        target, request_id, inputs = admitted.target, admitted.request_id, admitted.inputs
        assert inputs is not None
        started = time.monotonic()
        done = GenerateDelta()
        status = "error"
        try:
            body = msgspec.json.encode(EmbedRequest(request_id=request_id, inputs=inputs))
            tried: set[str] = set()
            while True:
                worker = await self._worker(target, request_id, tried, [])
                tried.add(worker.worker_id)
                worker.inflight += 1
                try:
                    async with self.upstream.post(worker.address, "/embed", body, self._internal) as r:
                        content = await r.read()
                    if r.status_code == 400:  # the worker's own validation: the caller's fault
                        err = msgspec.json.decode(content).get("error", {})
                        raise APIError(400, err.get("message", "Invalid input."), param="input")
                    if r.status_code != 200:
                        raise _WorkerFailed(f"status {r.status_code}: {content[:300]!r}")
                    result = self._embedded.decode(content)
                    done = GenerateDelta(prompt_tokens=result.prompt_tokens)
                    status = "ok"
                    return result
                except (UpstreamError, _WorkerFailed) as exc:
                    self.fleet.forget(worker.worker_id)
                    if len(tried) >= MAX_ATTEMPTS:
                        raise _worker_failure(exc, "The embedding worker") from exc
                    log.info("worker %s failed on embeddings; retrying elsewhere", worker.worker_id)
                finally:
                    worker.inflight -= 1
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            await self._finish(admitted, done, status, None, time.monotonic() - started)

    async def _worker(
        self, target: Target, request_id: str, tried: set[str], hashes: list[str]
    ) -> WorkerState:
        wait = self.settings.worker_wait_seconds if not tried else 2 * self.settings.heartbeat_seconds
        worker = await self.fleet.wait_for(
            target.deployment_id,
            wait,
            exclude=tried,
            hashes=hashes,
            request_id=request_id,
            adapter=target.adapter_id,
        )
        if worker is None:
            raise APIError(
                503,
                f"No worker is serving '{target.model}' right now; please retry shortly.",
                code="no_worker_available",
            )
        return worker

    async def _stream(self, worker: WorkerState, body: bytes) -> AsyncIterator[GenerateDelta]:
        async with self.upstream.post(worker.address, "/generate", body, self._internal) as r:
            if r.status_code == 400:  # the engine's own validation: the caller's fault, not the worker's
                err = msgspec.json.decode(await r.read()).get("error", {})
                raise APIError(400, err.get("message", "Invalid request."), param=err.get("param"))
            if r.status_code != 200:
                detail = (await r.read())[:500]
                raise _WorkerFailed(f"status {r.status_code}: {detail!r}")
            async for line in r.lines():
                yield self._delta.decode(line)

    async def _finish(
        self, admitted: Admitted, last: GenerateDelta, status: str, ttft: float | None, duration: float
    ) -> None:
        ticket, caller, target = admitted.ticket, admitted.caller, admitted.target
        record = UsageRecord(
            request_id=ticket.request_id,
            org_id=caller.org_id,
            api_key_id=caller.key_id,
            model=target.model,
            adapter=target.adapter_id,
            deployment_id=target.deployment_id,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            completion_tokens=last.completion_tokens,
            ttft_ms=None if ttft is None else ttft * 1000,
            duration_ms=duration * 1000,
            status=status,
            ts=time.time(),
        )
        # Both at once (on Redis they go out in one write), shielded: a cancelled request
        # (client gone) must still settle and be metered.
        settle = self.admitter.settle(ticket, last.prompt_tokens, last.cached_tokens, last.completion_tokens)
        await asyncio.shield(asyncio.gather(settle, self._publish(record)))

    async def _publish(self, record: UsageRecord) -> None:
        try:
            await self.publisher.publish(USAGE, record)
        except Exception:
            log.exception("could not publish usage event %s", record.request_id)


class _WorkerFailed(Exception):
    pass


def _worker_failure(exc: Exception, who: str) -> APIError:
    """503 for a worker that failed, 504 for one that stopped answering (its timeouts)."""
    if isinstance(exc, UpstreamError) and exc.timeout:
        return APIError(504, f"{who} did not answer in time; please retry.", code="worker_timeout")
    return APIError(503, f"{who} failed; please retry.", code="worker_error")
