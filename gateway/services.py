"""The request path: who is calling, what serves the model, tokens in, deltas out, usage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import httpx
import msgspec
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.services import CatalogService, authenticate
from gateway.fleet import FleetView, WorkerState
from tokenmill.bus import Publisher
from tokenmill.errors import APIError
from tokenmill.hashing import extra_keys, hash_blocks
from tokenmill.modelstore import resolve_model
from tokenmill.openai_shapes import Prompt, model_not_found
from tokenmill.protocol import USAGE, GenerateDelta, GenerateRequest, UsageRecord
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
            raise model_not_found(name)
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

    # --- generation ----------------------------------------------------------------------

    async def generate(
        self, caller: Caller, target: Target, request_id: str, prompt: Prompt
    ) -> AsyncGenerator[GenerateDelta, None]:
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
        # The prompt's chained block hashes, salted per organisation exactly as the engine
        # salts them, so the router can find the worker that already holds its prefix.
        extra = extra_keys(caller.cache_salt, None)
        hashes = [h.hex() for h in hash_blocks(prompt.token_ids, self.settings.block_size, extra)]
        started = time.monotonic()
        ttft: float | None = None
        last = GenerateDelta(prompt_tokens=len(prompt.token_ids))
        status = "error"
        tried: set[str] = set()
        try:
            while True:
                worker = await self._worker(target, tried, hashes)
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

    async def _worker(self, target: Target, tried: set[str], hashes: list[str]) -> WorkerState:
        wait = self.settings.worker_wait_seconds if not tried else 2 * self.settings.heartbeat_seconds
        worker = await self.fleet.wait_for(target.deployment_id, wait, exclude=tried, hashes=hashes)
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
