"""The unit of work: one transaction of the control plane and what must follow it.

Every front door (the admin API and billing's endpoints, the dashboard, the `tokenmill admin`
CLI, Stripe's webhook) makes its changes through a `UnitOfWork`: its services share one
session, collect domain events in that session's outbox (control_plane/events.py), and
`commit` commits and then delivers them: gateways are told to drop what they cached (a
revoked key, a suspended organisation), a deleted adapter's files are removed. A change is
announced only once it is committed, so a gateway that re-reads sees the new row; and if
the transaction does not commit, what was done outside it is undone (an upload's files).
No door commits or publishes by itself, so all of them behave alike by construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from functools import cached_property
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from control_plane.audit.services import AuditService
from control_plane.catalog.adapters import AdapterService
from control_plane.catalog.config import CatalogConfig
from control_plane.catalog.deployments import DeploymentService
from control_plane.catalog.services import ModelService
from control_plane.events import Event, FilesOrphaned, outbox
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.services import OrganizationService, UserService
from control_plane.orgs.sessions import DashboardSessionService
from control_plane.plans.services import PlanService
from tokenmill.bus import Publisher
from tokenmill.protocol import KEYS, KeysChanged

log = logging.getLogger("tokenmill.control_plane")


class UnitOfWork:
    """The services of one transaction. `publisher` carries announcements to the gateways
    (None: nobody to tell); `catalog` is what the catalogue's rules need from outside the
    control plane (only units that change deployments or adapters need it)."""

    def __init__(
        self,
        session: AsyncSession,
        *,
        catalog: CatalogConfig | None = None,
        publisher: Publisher | None = None,
    ) -> None:
        self.session = session
        self.catalog = catalog
        self.publisher = publisher
        # Announcements that could not be delivered after the last commit (the bus was
        # down): the change stands, and gateways re-read what they cache within 30 s.
        self.undelivered: list[KeysChanged] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, sessionmaker: async_sessionmaker[AsyncSession], **kwargs: Any
    ) -> AsyncIterator[UnitOfWork]:
        """A unit on a new session: committed when the block ends, rolled back if it raises."""
        async with sessionmaker() as session:
            unit = cls(session, **kwargs)
            try:
                yield unit
            except BaseException:
                await unit.rollback()
                raise
            await unit.commit()

    # --- the services, all on this unit's session -------------------------------------------

    @cached_property
    def orgs(self) -> OrganizationService:
        return OrganizationService(session=self.session)

    @cached_property
    def users(self) -> UserService:
        return UserService(session=self.session)

    @cached_property
    def dashboard_sessions(self) -> DashboardSessionService:
        return DashboardSessionService(self.session)

    @cached_property
    def keys(self) -> ApiKeyService:
        return ApiKeyService(session=self.session)

    @cached_property
    def plans(self) -> PlanService:
        return PlanService(session=self.session)

    @cached_property
    def models(self) -> ModelService:
        return ModelService(session=self.session)

    @cached_property
    def deployments(self) -> DeploymentService:
        return DeploymentService(session=self.session, config=self._catalog())

    @cached_property
    def adapters(self) -> AdapterService:
        return AdapterService(session=self.session, config=self._catalog())

    def _catalog(self) -> CatalogConfig:
        if self.catalog is None:
            raise RuntimeError("this unit of work was opened without the catalogue's configuration")
        return self.catalog

    @cached_property
    def audit(self) -> AuditService:
        return AuditService(self.session)

    # --- settling the transaction -------------------------------------------------------------

    async def commit(self) -> None:
        box = outbox(self.session)
        try:
            await self.session.commit()
        except BaseException:
            await self.rollback()
            raise
        events = list(box.committed)
        box.clear()
        await self._deliver(events)

    async def rollback(self) -> None:
        box = outbox(self.session)
        events = list(box.rolled_back)
        box.clear()
        try:
            await self.session.rollback()
        finally:
            await self._deliver(events)

    async def _deliver(self, events: list[Event]) -> None:
        self.undelivered = []
        for event in events:
            if isinstance(event, FilesOrphaned):
                await asyncio.to_thread(event.remove)
            elif self.publisher is not None:
                try:
                    await self.publisher.publish(KEYS, event)
                except Exception as exc:
                    # Committed is committed: failing the request now would report a change
                    # that happened as one that did not.
                    log.warning("gateways not told of %s (%r); they re-read within 30 s", event, exc)
                    self.undelivered.append(event)
            else:
                self.undelivered.append(event)
