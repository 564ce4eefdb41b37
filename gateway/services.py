"""The request path: who is calling, what serves the model, tokens in, deltas out, usage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.services import CatalogService
from gateway.admission import Admitter, Ticket
from gateway.fleet import FleetView, WorkerState
from gateway.keys import Caller, KeyCache
from gateway.upstream import Upstream, UpstreamError
from tokenmill.bus import Publisher
from tokenmill.errors import APIError
from tokenmill.hashing import extra_keys, hash_blocks
from tokenmill.modelstore import resolve_model
from tokenmill.openai_shapes import Prompt, model_not_found
from tokenmill.protocol import USAGE, EmbedRequest, EmbedResponse, GenerateDelta, GenerateRequest, UsageRecord
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
    ) -> None:
        self.settings = settings
        self.sessionmaker = sessionmaker
        self.fleet = fleet
        self.keys = keys
        self.admitter = admitter
        self.publisher = publisher
        self.upstream = upstream
        self._internal = {
            "authorization": f"Bearer {settings.internal_token}",
            "content-type": "application/json",
        }
        self._tokenizers: dict[str, asyncio.Future[Tokenizer]] = {}
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
        return Tokenizer.from_dir(resolve_model(source, self.settings.cache_dir, storage=storage))

    # --- generation ----------------------------------------------------------------------

    async def generate(
        self,
        caller: Caller,
        target: Target,
        request_id: str,
        prompt: Prompt,
        headers: dict[str, str] | None = None,
    ) -> AsyncGenerator[GenerateDelta, None]:
        """Deltas from a worker; retried on another worker until the first token arrives.

        Admission (limits, budget) comes first and its `x-ratelimit-*` headers go into
        `headers`. Once admitted, exactly one usage event is published however this ends
        (finish, error, client gone), and the limits and budget hold are settled.
        """
        ticket = await self.admitter.admit(
            caller, target.priced_model, request_id, len(prompt.token_ids), prompt.sampling.max_tokens
        )
        if headers is not None:
            headers.update(ticket.headers)
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
        # The prompt's chained block hashes, salted per organisation (and adapter) exactly as
        # the engine salts them, so the router can find the worker that holds its prefix.
        extra = extra_keys(caller.cache_salt, target.adapter_id)
        hashes = [h.hex() for h in hash_blocks(prompt.token_ids, self.settings.block_size, extra)]
        started = time.monotonic()
        ttft: float | None = None
        # Only what a worker reports is billed: a request no worker took costs nothing.
        last = GenerateDelta()
        status = "error"
        tried: set[str] = set()
        try:
            while True:
                worker = await self._worker(target, request_id, tried, hashes)
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
                except (UpstreamError, _WorkerFailed) as exc:
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
            await self._finish(ticket, caller, target, last, status, ttft, time.monotonic() - started)

    async def embed(
        self,
        caller: Caller,
        target: Target,
        request_id: str,
        inputs: list[list[int]],
        headers: dict[str, str] | None = None,
    ) -> EmbedResponse:
        """Embeddings of tokenized inputs from a worker of the embed deployment; admitted,
        retried on another worker when one fails, metered once like a generation."""
        tokens = sum(len(i) for i in inputs)
        ticket = await self.admitter.admit(caller, target.priced_model, request_id, tokens, 0)
        if headers is not None:
            headers.update(ticket.headers)
        body = msgspec.json.encode(EmbedRequest(request_id=request_id, inputs=inputs))
        started = time.monotonic()
        done = GenerateDelta()
        status = "error"
        tried: set[str] = set()
        try:
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
                        raise APIError(
                            503, "The embedding worker failed; please retry.", code="worker_error"
                        ) from exc
                    log.info("worker %s failed on embeddings; retrying elsewhere", worker.worker_id)
                finally:
                    worker.inflight -= 1
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            await self._finish(ticket, caller, target, done, status, None, time.monotonic() - started)

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
        self,
        ticket: Ticket,
        caller: Caller,
        target: Target,
        last: GenerateDelta,
        status: str,
        ttft: float | None,
        duration: float,
    ) -> None:
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
