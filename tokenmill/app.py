"""The composition root: what one process serves, assembled on one Litestar app.

The one module of `tokenmill/` (with the commands in cli.py) that knows the other packages;
it imports them lazily (inside functions) so `tokenmill --help` stays fast and a worker never
loads the gateway. It also hands each package what it may not import itself: the control
plane's catalogue rules get billing's price book as a lookup (`catalog_config`), since the
arrows run core <- control_plane <- billing.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill import __version__, tracing
from tokenmill.net import http_address
from tokenmill.settings import Settings

if TYPE_CHECKING:
    from litestar import Litestar
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

    from autoscaler.reconciler import Reconciler
    from control_plane.catalog.config import CatalogConfig
    from tokenmill.bus import EventBus
    from tokenmill.storage import Storage


@dataclass(slots=True)
class Parts:
    """What one process serves: the embedded server turns everything on."""

    gateway: bool = False
    admin: bool = False
    internal_bus: bool = False
    consumers: bool = False
    # The periodic billing jobs in-process (`serve` only; production runs Celery beat).
    scheduler: bool = False
    # The reconciler, starting and stopping workers through the `TOKENMILL_AUTOSCALER` provider.
    autoscaler: bool = False


def create_app(settings: Settings, engine: AsyncEngine, parts: Parts) -> Litestar:
    from litestar import Litestar, Router
    from litestar.di import Provide
    from litestar.openapi import OpenAPIConfig

    from tokenmill.bodies import Request as BodyRequest
    from tokenmill.bus import make_bus
    from tokenmill.db import make_sessionmaker, provide_db_session
    from tokenmill.errors import exception_handlers
    from tokenmill.ops import health, metrics, openapi_json

    sessionmaker = make_sessionmaker(engine)
    bus = make_bus(settings, host=True)
    handlers: list[Any] = []
    before_send: list[Any] = []  # hooks on every message the app sends
    after_exception: list[Any] = []  # hooks on every exception, before it is answered
    middleware: list[Any] = []
    dependencies: dict[str, Provide] = {"db_session": Provide(provide_db_session)}
    services: list[Any] = []  # objects with start()/stop()
    closers: list[Callable[[], Awaitable[None]]] = []
    # Prometheus registries of this app, served by `/metrics` beside the process's default one
    # (one set per app: tests build many apps in one process).
    registries: list[Any] = []
    state: dict[str, Any] = {
        "settings": settings,
        "sessionmaker": sessionmaker,
        "bus": bus,
        "metrics_registries": registries,
    }
    consumer = f"{socket.gethostname()}-{os.getpid()}"

    if parts.gateway:
        from gateway.accounting import Accounting, note_exception
        from gateway.admission import Admitter
        from gateway.batches import BatchesController
        from gateway.controllers import OpenAIController, stamp_request_ids
        from gateway.files import FilesController
        from gateway.fleet import FleetView
        from gateway.keys import KeyCache
        from gateway.metrics import GatewayMetrics
        from gateway.prep import Prep
        from gateway.responses import ResponsesController
        from gateway.services import Gateway
        from gateway.upstream import Upstream
        from tokenmill.bus import Publisher, RedisBus
        from tokenmill.limits import RateLimiter, RedisRateLimiter, make_limiter
        from tokenmill.resp import RespClient, RespPublisher
        from tokenmill.spool import SpoolingPublisher
        from tokenmill.storage import open_storage

        # The files of /v1/files (and, with the admin API, adapter files): one store per app.
        state["storage"] = open_storage(settings)
        gateway_metrics = GatewayMetrics.create()
        registries.append(gateway_metrics.registry)
        fleet = FleetView(
            bus, timeout=settings.worker_timeout_seconds, routing=settings.routing, metrics=gateway_metrics
        )
        keys = KeyCache(settings, bus, sessionmaker, metrics=gateway_metrics)
        limiter: RateLimiter
        publisher: Publisher
        try:
            redis = (
                RespClient.from_url(
                    settings.redis_url,
                    connect_timeout=settings.redis_timeout_seconds,
                    reply_timeout=settings.redis_timeout_seconds,
                )
                if settings.redis_url
                else None
            )
        except ValueError:  # a URL only redis-py reads (e.g. sentinel)
            redis = None
        if redis is not None:
            # The three Redis calls of every request (admission, settling, the usage event)
            # share one lean pipelined connection; the bus keeps redis-py for its readers.
            limiter = RedisRateLimiter(redis)
            assert isinstance(bus, RedisBus)
            # trimmed exactly as the bus trims
            publisher = RespPublisher(redis, maxlen=bus.maxlen, stream_maxlen=bus.stream_maxlen)
            closers.append(redis.aclose)
        else:
            limiter, publisher = make_limiter(settings), bus
        # Usage events wait on disk while the bus is unreachable, and are replayed in order.
        usage = SpoolingPublisher(publisher, settings.spool_path)
        gateway_metrics.spool_depth.set_function(usage.pending)
        services += [fleet, keys, usage]
        upstream = Upstream(  # keep-alive connections to the workers
            connect_timeout=settings.upstream_connect_timeout_seconds,
            first_byte_timeout=settings.upstream_first_byte_timeout_seconds,
            idle_timeout=settings.upstream_idle_timeout_seconds,
        )
        prep = Prep(settings.prep_threads)  # large requests are prepared off the event loop

        async def close_prep() -> None:
            prep.close()

        closers += [limiter.close, upstream.aclose, close_prep]
        state["gateway"] = Gateway(
            settings,
            sessionmaker=sessionmaker,
            fleet=fleet,
            keys=keys,
            admitter=Admitter(limiter, sessionmaker),
            publisher=usage,
            upstream=upstream,
            prep=prep,
            metrics=gateway_metrics,
        )
        # Bodies over the cap are refused (413) while they arrive, before any parsing.
        handlers.append(
            Router(
                "/",
                route_handlers=[OpenAIController, ResponsesController, FilesController, BatchesController],
                request_max_body_size=settings.max_request_bytes,
            )
        )
        # x-request-id on every answer of /v1, also those Litestar gives before any route runs.
        before_send.append(stamp_request_ids)
        if tracing.setup("tokenmill-gateway"):  # OTEL_* settings; off, no tracing code runs
            from litestar.middleware import DefineMiddleware

            from gateway.tracing import TRACED_PATHS, instrument

            instrument(state["gateway"])
            middleware.append(DefineMiddleware(tracing.ServerSpans, paths=TRACED_PATHS))
        # Refused requests (counted by `stamp_request_ids`, their exception noted first) and
        # keys' last use, written in batches.
        state["accounting"] = accounting = Accounting(
            sessionmaker,
            gateway_metrics,
            keys,
            flush_seconds=settings.refusals_flush_seconds,
            last_used_seconds=settings.key_last_used_seconds,
        )
        services.append(accounting)
        after_exception.append(note_exception)
    if parts.admin:
        from billing.router import billing_router
        from billing.stripe.controllers import StripeWebhookController
        from control_plane.deps import UNIT_DEPENDENCIES
        from control_plane.router import admin_router
        from dashboard.app import mount as mount_dashboard
        from tokenmill.storage import open_storage

        # Adapter (and weight) files: one store per app, used by the catalogue's services.
        storage = state.get("storage") or open_storage(settings)
        catalog = catalog_config(settings, storage)
        state.update(storage=storage, catalog=catalog)
        # Every admin request (the control plane's and billing's) is one unit of work: its
        # session commits when the handler returns, then its changes are announced.
        dependencies.update(UNIT_DEPENDENCIES)
        handlers.append(admin_router())
        handlers.append(billing_router())  # prices, rollups, invoices, exports
        handlers.append(StripeWebhookController)  # POST /webhooks/stripe (signed by Stripe, no API key)
        # The admin web UI at /dashboard: its own small app (templates, sessions, CSRF).
        dashboard = mount_dashboard(settings, sessionmaker=sessionmaker, bus=bus, catalog=catalog)
        handlers.append(dashboard.handler)
        services += dashboard.services
        closers += dashboard.closers
    if parts.consumers:
        from billing.ledger.metrics import LedgerMetrics
        from billing.ledger.services import UsageConsumer
        from control_plane.catalog.lifetimes import WorkerLifetimes

        ledger_metrics = LedgerMetrics.create()
        registries.append(ledger_metrics.registry)
        services += [
            UsageConsumer(bus, sessionmaker, consumer, metrics=ledger_metrics),
            WorkerLifetimes(bus, sessionmaker, consumer),
        ]
    if parts.scheduler:
        from billing.schedule import InProcessScheduler

        scheduler = InProcessScheduler(
            settings, sessionmaker, state_path=settings.home_dir / "scheduler-state.json"
        )
        services.append(scheduler)
        state["scheduler"] = scheduler
        if parts.gateway:
            from billing.batches import BatchRunner
            from control_plane.batches.services import batch_service

            assert settings.internal_token
            # The batches' lines go to this server's own gateway. The runner's name is this
            # server's (host and home), so after a restart it takes its batches back at once
            # rather than waiting out its own lease.
            runner = BatchRunner(
                batch_service(settings, sessionmaker, state["storage"]),
                gateway_url=settings.gateway_url or local_address(settings),
                token=settings.internal_token,
                bus=bus,
                concurrency=settings.batch_concurrency,
                owner=f"serve@{socket.gethostname()}:{settings.home_dir}",
            )
            services.append(runner)
            state["batch_runner"] = runner
    if parts.autoscaler and settings.autoscaler != "none":
        reconciler = build_reconciler(settings, bus, sessionmaker, consumer)
        registries.append(reconciler.metrics.registry)
        services.append(reconciler)
        closers.append(reconciler.provider.close)
        state["reconciler"] = reconciler
    if parts.internal_bus:
        from tokenmill.internal import internal_router

        assert settings.internal_token
        handlers.append(internal_router(bus, settings.internal_token, worker_token=settings.worker_token))

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        for service in services:
            await service.start()
        try:
            yield
        finally:
            for service in reversed(services):
                await service.stop()
            for close in closers:
                await close()
            await bus.close()
            await engine.dispose()

    app = Litestar(
        route_handlers=[*handlers, health, metrics, openapi_json],
        dependencies=dependencies,
        exception_handlers=exception_handlers(),
        before_send=before_send,
        after_exception=after_exception,
        middleware=middleware,
        lifespan=[lifespan],
        openapi_config=OpenAPIConfig(title="Tokenmill", version=__version__, path="/docs"),
        logging_config=None,  # keep the process's logging set up by the CLI
        request_class=BodyRequest,  # undecodable JSON and forms are 400s, never 500s
        debug=False,
    )
    app.state.update(state)
    return app


def build_reconciler(
    settings: Settings, bus: EventBus, sessionmaker: async_sessionmaker[AsyncSession], holder: str
) -> Reconciler:
    from autoscaler.leader import Lease, RedisLease, SoleLease
    from autoscaler.providers import Provider
    from autoscaler.reconciler import Reconciler

    provider: Provider
    if settings.autoscaler == "kubernetes":
        from autoscaler.kubernetes import KubernetesProvider

        provider = KubernetesProvider.from_settings(settings)
    else:
        from autoscaler.local import LocalProcessProvider

        provider = LocalProcessProvider(env=local_worker_env(settings))
    lease: Lease = SoleLease()
    if settings.redis_url:
        from tokenmill.bus import redis_client

        # A lease of a few intervals: a dead leader is replaced that quickly, and a slow
        # tick or two does not cost a live one its lease.
        ttl = max(5.0, 3 * settings.autoscale_interval_seconds)
        lease = RedisLease(
            redis_client(settings.redis_url, timeout=settings.redis_timeout_seconds), holder, ttl
        )
    return Reconciler(
        bus,
        sessionmaker,
        provider,
        lease,
        interval=settings.autoscale_interval_seconds,
        worker_timeout=settings.worker_timeout_seconds,
    )


def local_worker_env(settings: Settings) -> dict[str, str]:
    """What a worker started on this machine needs beyond our own environment."""
    env = {
        # A worker holds the worker token only (heartbeats and KV events, never usage); with no
        # separate one configured that is the internal token, as before.
        "TOKENMILL_WORKER_TOKEN": settings.worker_credential or "",
        "TOKENMILL_INTERNAL_TOKEN": "" if settings.worker_token else settings.internal_token or "",
        "TOKENMILL_HOME": str(settings.home_dir),
        "TOKENMILL_MODEL_CACHE": str(settings.cache_dir),
        "TOKENMILL_HEARTBEAT_SECONDS": str(settings.heartbeat_seconds),
    }
    if not settings.redis_url:  # the embedded bus, hosted by this server
        env["TOKENMILL_BUS_URL"] = f"{local_address(settings)}/internal/bus"
    return env


def local_address(settings: Settings) -> str:
    """This server's address as seen from this machine (a wildcard bind reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(settings.host, settings.host)
    return http_address(host, settings.port)


def catalog_config(settings: Settings, storage: Storage | None) -> CatalogConfig:
    """What the catalogue's rules need from outside the control plane, the same for every
    front door: billing's price book (is a GPU type priced now?), the settings (default
    quotas, the LoRA rank limit, the model cache) and where adapters are stored."""
    from billing.prices.services import price_at
    from control_plane.catalog.config import CatalogConfig
    from tokenmill.db import utcnow

    async def gpu_priced(session: AsyncSession, gpu_type: str) -> bool:
        return await price_at(session, gpu_type=gpu_type, at=utcnow()) is not None

    return CatalogConfig(gpu_priced=gpu_priced, settings=settings, storage=storage)
