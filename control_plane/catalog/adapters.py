"""LoRA adapters: files in storage, a row per adapter, each owned by one organisation.

An upload stores its files before its row exists; if the unit of work does not commit, the
files are removed again (an `FilesOrphaned` event on rollback), so a failed upload leaves
nothing behind. A deleted adapter's files go once the deletion is committed.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from advanced_alchemy.repository import SQLAlchemyAsyncRepository
from advanced_alchemy.service import SQLAlchemyAsyncRepositoryService
from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.audit.services import delete_recorded, record_change
from control_plane.catalog import lora
from control_plane.catalog.config import CatalogConfig
from control_plane.catalog.models import Adapter, Deployment, Model
from control_plane.catalog.services import deployment_adapters, model_ref
from control_plane.common import flush_unique, not_found
from control_plane.events import FilesOrphaned, outbox
from control_plane.paging import Page, PageQuery, contains, keyset_page
from control_plane.policy import Principal
from tokenmill.db import new_id
from tokenmill.errors import APIError
from tokenmill.storage import Storage


@dataclass(slots=True)
class AdapterFiles:
    """An adapter as PEFT saves it, as it arrived: its name, base model (id or name), the
    config's bytes and the weights (an open file of `weights_size` bytes)."""

    name: str
    model: str
    config: bytes
    weights: IO[bytes]
    weights_size: int


_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


def _base_shapes(source: str, cache_dir: Path, storage: Storage) -> lora.BaseShapes:
    """Shapes of a base model's linear layers, from its config.json (blocking: resolving
    may fetch a stored model or convert a GGUF, once)."""
    from tokenmill.modelstore import resolve_model

    model_dir = resolve_model(source, cache_dir, storage=storage)
    return lora.BaseShapes.from_config(json.loads((model_dir / "config.json").read_text()))


class AdapterService(SQLAlchemyAsyncRepositoryService[Adapter]):
    class Repo(SQLAlchemyAsyncRepository[Adapter]):
        model_type = Adapter

    repository_type = Repo

    def __init__(self, session: AsyncSession, *, config: CatalogConfig, **kwargs: Any) -> None:
        super().__init__(session=session, **kwargs)
        self.config = config

    @property
    def storage(self) -> Storage:
        if self.config.storage is None:
            raise RuntimeError("this process has no adapter storage (TOKENMILL_STORAGE_URL)")
        return self.config.storage

    async def list_for_org(self, org_id: str) -> list[Adapter]:
        return list(await self.get_many(Adapter.org_id == org_id, order_by=[(Adapter.name, False)]))

    async def page_for_org(self, org_id: str, query: PageQuery) -> Page[Adapter]:
        """A page of the organisation's adapters by name, searched by name. `org_id` is one
        the caller may see."""
        return await keyset_page(
            self.repository.session,
            select(Adapter).where(Adapter.org_id == org_id),
            query,
            by=[(Adapter.name, False), (Adapter.id, False)],
            search=lambda text: contains(Adapter.name, text),
        )

    async def visible(self, adapter_id: str, actor: Principal) -> Adapter:
        adapter = await self.get_one_or_none(Adapter.id == adapter_id)
        if adapter is None or not actor.sees(adapter.org_id):
            raise not_found("adapter", adapter_id)
        return adapter

    async def _base(self, ref: str) -> tuple[Model, lora.BaseShapes]:
        """The base model an adapter is for, and its layer shapes (400 if it takes none)."""
        model = await model_ref(self.repository.session, ref)
        if model.kind != "generate":
            raise APIError(
                400, f"Model '{model.name}' computes embeddings; it takes no adapters.", param="model"
            )
        try:
            shapes = await asyncio.to_thread(_base_shapes, model.source, self.config.cache_dir, self.storage)
        except (OSError, ValueError) as exc:
            raise APIError(
                400, f"The base model '{model.name}' cannot be checked for adapters: {exc}", param="model"
            ) from None
        return model, shapes

    async def weights_limit(self, ref: str) -> tuple[str, int]:
        """(base model name, size of the largest weights file `upload` accepts for it): what
        an upload may send before it is refused, decided before its files arrive."""
        model, shapes = await self._base(ref)
        return model.name, lora.max_weights_size(shapes, self.config.max_lora_rank)

    async def upload(self, org_id: str, files: AdapterFiles, actor: Principal) -> Adapter:
        """Validate the two PEFT files against the base model, store them, add the row. The
        files are written before the row; if the row cannot be added, or the unit of work
        does not commit, they are removed again."""
        session = self.repository.session
        name = files.name.strip()
        config_raw, weights = files.config, files.weights
        if not _ADAPTER_NAME.match(name):
            raise APIError(
                400,
                "name must be 1-200 letters, digits or . _ : / @ + - (starting with a letter or digit).",
                param="name",
            )
        if await self.exists(org_id=org_id, name=name):
            raise APIError(409, f"This organisation already has an adapter named '{name}'.", param="name")
        visible_names = select(Deployment.id).where(
            Deployment.name == name, or_(Deployment.org_id.is_(None), Deployment.org_id == org_id)
        )
        if await session.scalar(visible_names.limit(1)) is not None:
            raise APIError(409, f"A deployment named '{name}' exists; pick another name.", param="name")
        base, shapes = await self._base(files.model)
        max_rank = self.config.max_lora_rank
        size = files.weights_size
        info = await asyncio.to_thread(lora.validate, config_raw, weights, size, shapes, max_rank)

        storage = self.storage
        adapter_id = new_id("adapter")
        prefix = f"adapters/{org_id}/{adapter_id}/"
        stored = FilesOrphaned(storage, prefix)

        def store() -> int:
            weights.seek(0)
            size = storage.put(prefix + lora.CONFIG_FILE, config_raw)
            return size + storage.put(prefix + lora.WEIGHTS_FILE, weights)

        try:
            size = await asyncio.to_thread(store)
            adapter = Adapter(
                id=adapter_id,
                org_id=org_id,
                model_id=base.id,
                name=name,
                source=storage.uri(prefix.rstrip("/")),
                rank=info.rank,
                target_modules=info.target_modules,
                storage_key=prefix,
                size_bytes=size,
                sha256=info.sha256,
            )
            session.add(adapter)
            await flush_unique(session, f"This organisation already has an adapter named '{name}'.", "name")
            await record_change(session, actor, "create", "adapter", adapter.id, org_id=org_id, after=adapter)
        except BaseException:
            await asyncio.to_thread(stored.remove)
            raise
        outbox(session).rolled_back.append(stored)
        return adapter

    async def delete_adapter(self, adapter: Adapter, actor: Principal) -> None:
        """Remove the row (refused while a deployment pins it); its files go once the deletion
        is committed."""
        session = self.repository.session
        deps = await session.scalars(
            select(Deployment).where(Deployment.org_id == adapter.org_id, Deployment.config.is_not(None))
        )
        for dep in deps:
            if adapter.id in deployment_adapters(dep):
                raise APIError(
                    409,
                    f"Deployment '{dep.name}' serves this adapter; remove it from the deployment first.",
                    code="conflict",
                )
        await delete_recorded(session, actor, adapter, "adapter", org_id=adapter.org_id)
        if adapter.storage_key:
            outbox(session).committed.append(FilesOrphaned(self.storage, adapter.storage_key))
