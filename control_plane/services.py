"""Logic of the control plane: organisations, keys, the model catalogue, worker lifetimes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
from advanced_alchemy.repository import SQLAlchemyAsyncRepository
from advanced_alchemy.service import SQLAlchemyAsyncRepositoryService
from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.models import ROLES, Adapter, ApiKey, Deployment, Model, Organization, Plan, Worker
from tokenmill import security
from tokenmill.bus import Entry, EventBus
from tokenmill.db import utcnow
from tokenmill.errors import APIError
from tokenmill.protocol import WORKERS, Heartbeat, WorkerAnnounce, WorkerDeparture, WorkerEvent
from tokenmill.tasks import GroupConsumer

log = logging.getLogger("tokenmill.control_plane")


class OrganizationService(SQLAlchemyAsyncRepositoryService[Organization]):
    class Repo(SQLAlchemyAsyncRepository[Organization]):
        model_type = Organization

    repository_type = Repo

    async def create_org(self, name: str) -> Organization:
        name = name.strip()
        if not name:
            raise APIError(400, "Organisation name must not be empty.", param="name")
        if await self.exists(name=name):
            raise APIError(409, f"An organisation named '{name}' already exists.", param="name")
        return await self.create(Organization(name=name))

    async def by_ref(self, ref: str) -> Organization:
        """Find an organisation by id or by name."""
        org = await self.get_one_or_none(or_(Organization.id == ref, Organization.name == ref))
        if org is None:
            raise APIError(404, f"No organisation '{ref}'.", code="not_found")
        return org


@dataclass(slots=True)
class CreatedKey:
    key: ApiKey
    secret: str


class ApiKeyService(SQLAlchemyAsyncRepositoryService[ApiKey]):
    class Repo(SQLAlchemyAsyncRepository[ApiKey]):
        model_type = ApiKey

    repository_type = Repo

    async def create_key(
        self,
        *,
        org_id: str,
        secret_key: str,
        name: str = "",
        role: str = "member",
        scopes: list[str] | None = None,
        expires_at: datetime | None = None,
    ) -> CreatedKey:
        if role not in ROLES:
            raise APIError(400, f"role must be one of {', '.join(ROLES)}.", param="role")
        if expires_at is not None and expires_at <= utcnow():
            raise APIError(400, "expires_at must be in the future.", param="expires_at")
        new = security.generate_key(secret_key)
        key = ApiKey(
            org_id=org_id,
            name=name,
            prefix=new.prefix,
            hash=new.hash,
            role=role,
            scopes=scopes,
            expires_at=expires_at,
        )
        return CreatedKey(await self.create(key), new.secret)

    async def list_for_org(self, org_id: str) -> list[ApiKey]:
        return list(await self.get_many(ApiKey.org_id == org_id, order_by=[(ApiKey.created_at, False)]))

    async def revoke(self, ref: str, *, org_id: str | None = None) -> ApiKey:
        """Revoke by id or prefix; `org_id` confines the lookup to one tenant."""
        filters = [or_(ApiKey.id == ref, ApiKey.prefix == ref)]
        if org_id is not None:
            filters.append(ApiKey.org_id == org_id)
        key = await self.get_one_or_none(*filters)
        if key is None:
            raise APIError(404, f"No API key '{ref}'.", code="not_found")
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            key = await self.update(key)
        return key


async def find_key(session: AsyncSession, prefix: str) -> tuple[ApiKey, Organization, Plan | None] | None:
    """The key with this lookup prefix, its organisation and the organisation's plan."""
    result = await session.execute(
        select(ApiKey, Organization, Plan)
        .join(Organization, Organization.id == ApiKey.org_id)
        .outerjoin(Plan, Plan.id == Organization.plan_id)
        .where(ApiKey.prefix == prefix)
    )
    row = result.first()
    return None if row is None else (row[0], row[1], row[2])


def check_key(secret: str, key: ApiKey | None, secret_key: str) -> ApiKey:
    """`key` if `secret` is its secret and it is usable now, else a 401 APIError.
    The hash comparison is constant-time."""
    if key is None or not security.verify_key(secret, key.hash, secret_key):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    if key.revoked_at is not None:
        raise APIError(401, "This API key has been revoked.", code="invalid_api_key")
    if key.expires_at is not None and key.expires_at <= utcnow():
        raise APIError(401, "This API key has expired.", code="invalid_api_key")
    return key


async def authenticate(session: AsyncSession, secret: str, secret_key: str) -> tuple[ApiKey, Organization]:
    """The key record and its organisation, or a 401 APIError."""
    prefix = security.key_prefix(secret)
    found = await find_key(session, prefix) if prefix is not None else None
    key = check_key(secret, found[0] if found else None, secret_key)
    assert found is not None
    return key, found[1]


class CatalogService:
    """Models and the deployments that serve them."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def ensure_model(
        self, *, name: str, source: str, format: str, kind: str, context_length: int
    ) -> Model:
        model = await self.session.scalar(select(Model).where(Model.name == name))
        if model is None:
            model = Model(name=name, source=source, format=format, kind=kind, context_length=context_length)
            self.session.add(model)
            await self.session.flush()
        return model

    async def ensure_serverless(self, model: Model, sampling: dict[str, float] | None = None) -> Deployment:
        """The shared deployment of a model; `sampling` holds defaults for parameters a
        request leaves out (as vLLM applies a model's generation config)."""
        dep = await self.session.scalar(
            select(Deployment).where(Deployment.name == model.name, Deployment.org_id.is_(None))
        )
        if dep is None:
            dep = Deployment(
                name=model.name,
                model_id=model.id,
                kind=model.kind,
                type="serverless",
                config={"sampling": sampling or {}},
            )
            self.session.add(dep)
            await self.session.flush()
        return dep

    async def visible_deployments(self, org_id: str) -> list[tuple[Deployment, Model]]:
        """Serverless deployments plus the organisation's own dedicated ones."""
        result = await self.session.execute(
            select(Deployment, Model)
            .join(Model, Model.id == Deployment.model_id)
            .where(Deployment.status == "active")
            .where(or_(Deployment.org_id.is_(None), Deployment.org_id == org_id))
            .order_by(Deployment.name)
        )
        return [(d, m) for d, m in result.all()]

    async def adapters(self, org_id: str) -> list[Adapter]:
        """The organisation's own LoRA adapters (no one else's, ever)."""
        result = await self.session.scalars(
            select(Adapter).where(Adapter.org_id == org_id).order_by(Adapter.name)
        )
        return list(result)

    async def resolve(self, name: str, org_id: str) -> tuple[Deployment, Model, Adapter | None]:
        """A model name as a caller of `org_id` sees it: a deployment it may use, or one of
        its own adapters, served by the shared deployment of the adapter's base model."""
        visible = await self.visible_deployments(org_id)
        for dep, model in visible:
            if dep.name == name:
                return dep, model, None
        adapter = await self.session.scalar(
            select(Adapter).where(Adapter.org_id == org_id, Adapter.name == name)
        )
        if adapter is not None:
            for dep, model in visible:
                if model.id == adapter.model_id and dep.org_id is None:
                    return dep, model, adapter
        raise APIError(
            404,
            f"The model '{name}' does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )


@dataclass(slots=True)
class EmbedSpec:
    """An embedding model the embedded server serves next to its chat model."""

    name: str
    source: str
    context_length: int
    format: str = "hf"


@dataclass(slots=True)
class Bootstrap:
    org: Organization
    admin_secret: str | None  # only on the very first start
    deployment: Deployment
    model: Model
    embed_deployment: Deployment | None = None
    embed_model: Model | None = None


async def bootstrap(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    secret_key: str,
    model_name: str,
    model_source: str,
    model_format: str,
    context_length: int,
    sampling: dict[str, float] | None = None,
    embed: EmbedSpec | None = None,
) -> Bootstrap:
    """First start: an organisation and a platform-admin key. Every start: the served model,
    and the embedding model (kind `embed`) with its serverless deployment when `embed` is given."""
    async with sessionmaker() as session, session.begin():
        orgs = OrganizationService(session=session)
        secret = None
        org = await orgs.get_one_or_none(name="default")
        if await orgs.count() == 0:
            org = await orgs.create_org("default")
            created = await ApiKeyService(session=session).create_key(
                org_id=org.id, secret_key=secret_key, name="bootstrap admin", role="platform_admin"
            )
            secret = created.secret
        elif org is None:
            org = (await orgs.get_many(order_by=[(Organization.created_at, False)]))[0]
        catalog = CatalogService(session)
        model = await catalog.ensure_model(
            name=model_name,
            source=model_source,
            format=model_format,
            kind="generate",
            context_length=context_length,
        )
        dep = await catalog.ensure_serverless(model, sampling)
        embed_model = embed_dep = None
        if embed is not None:
            embed_model = await catalog.ensure_model(
                name=embed.name,
                source=embed.source,
                format=embed.format,
                kind="embed",
                context_length=embed.context_length,
            )
            embed_dep = await catalog.ensure_serverless(embed_model)
    return Bootstrap(
        org=org,
        admin_secret=secret,
        deployment=dep,
        model=model,
        embed_deployment=embed_dep,
        embed_model=embed_model,
    )


class WorkerLifetimes(GroupConsumer):
    """Records each worker's start and stop (what dedicated deployments are billed on).

    Last-seen times are written at most every few seconds per worker.
    """

    name = "worker-lifetimes"
    stream = WORKERS
    group = "control-plane-workers"

    def __init__(self, bus: EventBus, sessionmaker: async_sessionmaker[AsyncSession], consumer: str) -> None:
        super().__init__(bus, consumer)
        self.sessionmaker = sessionmaker
        self._seen: dict[str, float] = {}
        self._decoder = msgspec.json.Decoder(WorkerEvent)

    async def handle(self, entries: list[Entry]) -> None:
        await self.apply([self._decoder.decode(raw) for _, raw in entries])

    async def apply(self, events: list[WorkerEvent]) -> None:
        async with self.sessionmaker() as session, session.begin():
            for ev in events:
                ts = datetime.fromtimestamp(ev.ts, UTC) if ev.ts else utcnow()
                if isinstance(ev, WorkerAnnounce | Heartbeat):
                    if isinstance(ev, Heartbeat) and ev.ts - self._seen.get(ev.worker_id, 0.0) < 5.0:
                        continue
                    self._seen[ev.worker_id] = ev.ts
                    worker = await session.get(Worker, ev.worker_id)
                    if worker is None:
                        session.add(
                            Worker(
                                id=ev.worker_id,
                                deployment_id=await _known_deployment(session, ev.deployment_id),
                                address=ev.address,
                                model=ev.model,
                                gpu_type=getattr(ev, "gpu_type", None),
                                started_at=ts,
                                last_seen_at=ts,
                            )
                        )
                        await session.flush()
                    elif worker.stopped_at is None:
                        worker.last_seen_at = ts
                elif isinstance(ev, WorkerDeparture):
                    self._seen.pop(ev.worker_id, None)
                    await session.execute(
                        update(Worker)
                        .where(Worker.id == ev.worker_id, Worker.stopped_at.is_(None))
                        .values(stopped_at=ts, last_seen_at=ts, status="stopped")
                    )


async def _known_deployment(session: AsyncSession, deployment_id: str | None) -> str | None:
    # A worker started by hand may name a deployment this database does not know.
    if deployment_id and await session.get(Deployment, deployment_id) is not None:
        return deployment_id
    return None
