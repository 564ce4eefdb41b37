"""What a model name means to an organisation: the models it may list and use, the
deployment (and adapter) a name resolves to, and that model's tokenizer, each cached so the
request path reads the catalogue and the model files rarely."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.catalog.services import CatalogService
from gateway.embeddings import vector_size
from gateway.keys import Caller
from tokenmill import logs
from tokenmill.errors import APIError
from tokenmill.modelstore import resolve_model
from tokenmill.openai_shapes import model_not_found
from tokenmill.settings import Settings
from tokenmill.storage import open_storage
from tokenmill.tokenization import Tokenizer

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
    # The catalogue name of the model it runs (an adapter's base model): what metrics are
    # labelled by, never `model`, which may name a tenant's adapter.
    base_model: str = ""

    @property
    def priced_model(self) -> str | None:
        """The model whose token prices this request pays, if any."""
        return None if self.dedicated else self.model_id


class Catalog:
    def __init__(self, settings: Settings, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self.settings = settings
        self.sessionmaker = sessionmaker
        self._tokenizers: dict[str, asyncio.Future[Tokenizer]] = {}
        # Length of the vectors an embedding model makes, per source, read with its tokenizer.
        self._dimensions: dict[str, int | None] = {}
        self._targets: dict[tuple[str, str], tuple[Target, float]] = {}
        self._resolving: dict[tuple[str, str], asyncio.Future[Target]] = {}

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
        logs.bind(model=name)  # on the request's log lines from here on
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
            base_model=model.name,
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
