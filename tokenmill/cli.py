"""The `tokenmill` command: serve, run one part, migrate, and the operator's admin commands.

With tokenmill/app.py (the composition root, which assembles the app), the only module of
`tokenmill/` that knows the other packages; it imports them lazily (inside functions) so
`tokenmill --help` stays fast and a worker never loads the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import click

from tokenmill import __version__, logs
from tokenmill.app import Parts, create_app, local_worker_env
from tokenmill.settings import Settings

T = TypeVar("T")

if TYPE_CHECKING:
    from litestar import Litestar

    from autoscaler.reconciler import Reconciler
    from control_plane.bootstrap import EmbedSpec
    from control_plane.unit import UnitOfWork
    from tokenmill.bus import Publisher

log = logging.getLogger("tokenmill")

# The platform admin `serve` creates on first start, to sign in to the dashboard with.
DASHBOARD_ADMIN = "admin@tokenmill.local"


def _settings(**overrides: Any) -> Settings:
    # Server logs are no place for \r-redrawn progress bars (the GGUF reader draws one with
    # plain tqdm, which reads this variable only when it is first imported).
    os.environ.setdefault("TQDM_DISABLE", "1")
    settings = Settings()
    for name, value in overrides.items():
        if value is not None:
            setattr(settings, name, value)
    logs.configure(settings.log_level, settings.log_format)
    return settings


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _bind(host: str, port: int) -> socket.socket:
    from tokenmill.net import bind

    try:
        return bind(host, port)
    except OSError as exc:
        _fail(f"cannot listen on {host}:{port}: {exc.strerror}. Set TOKENMILL_PORT to another port.")
        raise


def _say(message: str) -> None:
    """A line on stderr that cannot stop a shutdown: when whatever read the server's output
    has gone (a closed pipe), the write fails, and in a signal handler that failure left the
    server running, its workers restarted, through every later SIGTERM."""
    with contextlib.suppress(OSError):
        click.echo(message, err=True)


async def _serve_app(
    app: Litestar,
    sock: socket.socket,
    settings: Settings,
    before_exit: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM. `before_exit` runs first, while the server still
    answers, so local workers can drain their streams and say goodbye on the bus."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises the stopping signal after shutdown, which would kill the
            # process before our cleanup; the handlers below replace its own.
            yield

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            # What start-up built (modules, the app, tokenizers, caches) lives as long as the
            # process: out of the collector's reach, its full passes under load stay short.
            gc.freeze()

    config = uvicorn.Config(
        app,
        log_config=None,
        # One line per request (method, path, status; never headers) when debugging.
        access_log=settings.log_level.upper() == "DEBUG",
        # Streams in flight may run TOKENMILL_MAX_STREAM_SECONDS; a rollout must not cut them.
        timeout_graceful_shutdown=math.ceil(settings.graceful_shutdown_seconds),
        lifespan="on",
        # The peer stays the peer: uvicorn would take X-Forwarded-For from any local process.
        # tokenmill.clients believes the header only from TOKENMILL_TRUSTED_PROXIES.
        proxy_headers=False,
    )
    server = Server(config)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    async def stop() -> None:
        if before_exit is not None:
            await before_exit()
        server.should_exit = True

    def on_signal() -> None:
        if stopping:  # a second Ctrl-C: stop now
            server.force_exit = True
            server.should_exit = True
            return
        stopping.append(asyncio.create_task(stop()))
        _say("Stopping...")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await server.serve(sockets=[sock])
    for task in stopping:
        await task


async def _migrate(settings: Settings) -> None:
    import migrations

    settings.secure_home(create_db=True)
    await asyncio.to_thread(migrations.upgrade, settings.db_url)


# --- commands ---------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tokenmill")
def main() -> None:
    """Tokenmill: a self-hostable, OpenAI-compatible LLM inference platform."""


@main.command()
@click.option("--host", help="Listen address [env TOKENMILL_HOST, default 127.0.0.1].")
@click.option("--port", type=int, help="Listen port [env TOKENMILL_PORT, default 8000].")
@click.option("--model", help="Model to serve [env TOKENMILL_MODEL, default the bundled SmolLM2].")
@click.option(
    "--embed-model",
    help="Embedding model to serve; '' for none [env TOKENMILL_EMBED_MODEL, default the bundled MiniLM].",
)
@click.option("--no-worker", is_flag=True, help="Do not start local workers.")
def serve(
    host: str | None, port: int | None, model: str | None, embed_model: str | None, no_worker: bool
) -> None:
    """Run everything in one process: gateway, admin API, bus, billing and local workers (one
    for the chat model, one for the embedding model).

    State (SQLite database, converted models, secrets) lives under TOKENMILL_HOME.
    """
    settings = _settings(host=host, port=port, model=model, embed_model=embed_model)
    if no_worker:
        settings.spawn_worker = False
    settings.ensure_secrets()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(settings))


async def _serve(settings: Settings) -> None:
    from control_plane.bootstrap import bootstrap
    from tokenmill.db import make_engine, make_sessionmaker
    from tokenmill.modelstore import model_name, resolve_model, sampling_defaults
    from tokenmill.storage import open_storage
    from tokenmill.tokenization import Tokenizer

    sock = _bind(settings.host, settings.port)
    click.echo(
        f"Preparing {settings.model} (the first start converts it; later starts are instant)...", err=True
    )
    try:
        model_dir = await asyncio.to_thread(
            resolve_model, settings.model, settings.cache_dir, storage=lambda: open_storage(settings)
        )
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    context_length = Tokenizer.from_dir(model_dir).context_length or 2048
    embed = await _embed_spec(settings) if settings.embed_model else None
    await _migrate(settings)
    engine = make_engine(settings.db_url)
    boot = await bootstrap(
        make_sessionmaker(engine),
        secret_key=settings.secret_key or "",
        model_name=model_name(settings.model),
        model_source=settings.model,
        model_format="gguf" if settings.model.endswith((".gguf", "smollm2")) else "hf",
        context_length=context_length,
        sampling=sampling_defaults(settings.model, model_dir),
        embed=embed,
        dashboard_admin=DASHBOARD_ADMIN,
    )
    url = f"http://{settings.host}:{settings.port}"
    parts = Parts(gateway=True, admin=True, internal_bus=settings.redis_url is None, consumers=True)
    parts.scheduler = settings.scheduler
    # The reconciler starts the deployments' workers (the bundled models' included) and
    # scales them; with TOKENMILL_AUTOSCALER=none the bundled models get one worker each.
    parts.autoscaler = settings.spawn_worker
    app = create_app(settings, engine, parts)
    reconciler: Reconciler | None = app.state.get("reconciler")
    fixed = None
    if settings.spawn_worker and reconciler is None:
        from autoscaler.local import LocalProcessProvider

        fixed = LocalProcessProvider(env=local_worker_env(settings))
        fixed.start(boot.deployment.id, settings.model)
        if boot.embed_deployment is not None:
            fixed.start(boot.embed_deployment.id, settings.embed_model)

    async def stop_workers() -> None:
        # The reconciler first, or it would replace the workers being stopped.
        if reconciler is not None:
            await reconciler.stop()
            await reconciler.provider.close()
        if fixed is not None:
            await fixed.close()

    if boot.admin_secret:
        click.echo(
            "\nCreated organisation 'default' and an admin API key. It is shown only once; keep it:\n\n"
            f"{boot.admin_secret}\n"
        )
    if boot.admin_login:
        email, password = boot.admin_login
        click.echo(
            f"Dashboard {url}/dashboard: sign in as {email} with this password (shown only once):\n\n"
            f"{password}\n"
        )
    else:
        click.echo(f"Dashboard: {url}/dashboard")
    served = boot.model.name + (f" and {boot.embed_model.name}" if boot.embed_model else "")
    click.echo(f"Tokenmill {__version__} serving {served} on {url}  (OpenAI base URL: {url}/v1)")
    try:
        await _serve_app(app, sock, settings, before_exit=stop_workers)
    finally:
        await stop_workers()  # no-op unless serving failed
        _say("Tokenmill stopped.")


async def _embed_spec(settings: Settings) -> EmbedSpec:
    """The embedding model's catalogue entry; a bad TOKENMILL_EMBED_MODEL stops `serve` at once
    rather than leaving a worker that dies after the server said it was ready."""
    from control_plane.bootstrap import EmbedSpec
    from tokenmill.modelstore import model_name, resolve_model
    from tokenmill.storage import open_storage
    from tokenmill.tokenization import Tokenizer

    source = settings.embed_model
    try:
        model_dir = await asyncio.to_thread(
            resolve_model, source, settings.cache_dir, storage=lambda: open_storage(settings)
        )
        context_length = Tokenizer.from_dir(model_dir).context_length
    except (FileNotFoundError, ValueError) as exc:
        _fail(f"embedding model: {exc} (set TOKENMILL_EMBED_MODEL= to serve none)")
        raise
    # Only what the encoder's position table holds; the gateway refuses longer inputs.
    return EmbedSpec(name=model_name(source), source=source, context_length=context_length or 512)


@main.command()
@click.option("--host", help="Listen address [env TOKENMILL_HOST].")
@click.option("--port", type=int, help="Listen port [env TOKENMILL_PORT].")
def gateway(host: str | None, port: int | None) -> None:
    """Run a gateway replica (production: needs DATABASE_URL and REDIS_URL)."""
    settings = _settings(host=host, port=port)
    _require_production(settings)
    _run_server(settings, Parts(gateway=True), uvloop=True)


@main.command("control-plane")
@click.option("--host", help="Listen address [env TOKENMILL_HOST].")
@click.option("--port", type=int, help="Listen port [env TOKENMILL_PORT].")
def control_plane(host: str | None, port: int | None) -> None:
    """Run the admin API and the ledger consumers (production: needs DATABASE_URL and REDIS_URL)."""
    settings = _settings(host=host, port=port)
    _require_production(settings)
    _run_server(settings, Parts(admin=True, consumers=True))


@main.command()
@click.option("--host", help="Listen address of /health and /metrics [env TOKENMILL_HOST].")
@click.option("--port", type=int, help="Listen port [env TOKENMILL_PORT].")
def autoscaler(host: str | None, port: int | None) -> None:
    """Run the reconciler: start, scale and replace workers for the control plane's deployments
    through TOKENMILL_AUTOSCALER (kubernetes or local). Run several for failover: a Redis lease
    lets one act at a time (production: needs DATABASE_URL and REDIS_URL)."""
    settings = _settings(host=host, port=port)
    _require_production(settings)
    if settings.autoscaler == "none":
        _fail("TOKENMILL_AUTOSCALER is 'none': set it to 'kubernetes' or 'local'", 2)
    _run_server(settings, Parts(autoscaler=True))


def _require_production(settings: Settings) -> None:
    missing = [
        n for n, v in (("DATABASE_URL", settings.database_url), ("REDIS_URL", settings.redis_url)) if not v
    ]
    missing += [
        f"TOKENMILL_{n.upper()}" for n in ("internal_token", "secret_key") if not getattr(settings, n)
    ]
    if missing:
        _fail(f"set {', '.join(missing)} (or use `tokenmill serve` for the all-in-one server)", 2)


def _run_server(settings: Settings, parts: Parts, *, uvloop: bool = False) -> None:
    """Serve `parts` until stopped; on uvloop when asked and installed (a gateway spends
    much of each request in the event loop and its transports, which uvloop runs in C)."""
    from tokenmill.db import make_engine

    async def run() -> None:
        sock = _bind(settings.host, settings.port)
        app = create_app(settings, make_engine(settings.db_url), parts)
        await _serve_app(app, sock, settings)

    loop_factory = None
    if uvloop:
        try:
            from uvloop import new_event_loop as loop_factory
        except ImportError:
            log.info("uvloop is not installed; serving on the standard asyncio loop")
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())


@main.command()
@click.option(
    "--model",
    help="Model source: bundled:smollm2, bundled:minilm (embeddings), an HF directory or a .gguf file; "
    "an embedding model (sentence-transformers/BERT) makes an embed worker.",
)
@click.option(
    "--deployment",
    "deployment_id",
    envvar="TOKENMILL_DEPLOYMENT_ID",
    help="Deployment id this worker serves [env TOKENMILL_DEPLOYMENT_ID].",
)
@click.option("--host", help="Listen address [env TOKENMILL_WORKER_HOST].")
@click.option("--port", type=int, help="Listen port; 0 picks a free one [env TOKENMILL_WORKER_PORT].")
@click.option(
    "--worker-id",
    envvar="TOKENMILL_WORKER_ID",
    help="Worker id [env TOKENMILL_WORKER_ID; default generated].",
)
@click.option("--exit-with-parent", is_flag=True, help="Exit when the parent process exits.")
@click.option(
    "--engine",
    type=click.Choice(["builtin", "vllm"]),
    envvar="TOKENMILL_WORKER_ENGINE",
    help="What generates: our engine (builtin, the default) or a vLLM OpenAI server, started as a "
    "child process (TOKENMILL_VLLM_COMMAND, TOKENMILL_VLLM_ENGINE_ARGS) or reached at "
    "TOKENMILL_VLLM_URL [env TOKENMILL_WORKER_ENGINE].",
)
def worker(
    model: str | None,
    deployment_id: str | None,
    host: str | None,
    port: int | None,
    worker_id: str | None,
    exit_with_parent: bool,
    engine: str | None,
) -> None:
    """Run one model worker; it joins the fleet through the bus."""
    settings = _settings(model=model, worker_host=host, worker_port=port, worker_engine=engine)
    if not settings.worker_credential:
        _fail("set TOKENMILL_WORKER_TOKEN or TOKENMILL_INTERNAL_TOKEN (workers need a token)", 2)
    from workers.main import run_worker

    sys.exit(
        run_worker(
            settings,
            model=settings.model,
            deployment_id=deployment_id,
            host=settings.worker_host,
            port=settings.worker_port,
            worker_id=worker_id,
            exit_with_parent=exit_with_parent,
        )
    )


@main.command()
@click.argument("action", type=click.Choice(["upgrade", "downgrade", "current"]), default="upgrade")
@click.option("--revision", default=None, help="Target revision (upgrade: head, downgrade: one step back).")
def migrate(action: str, revision: str | None) -> None:
    """Apply database migrations (DATABASE_URL, or the embedded SQLite file)."""
    settings = _settings()
    import migrations

    if not settings.database_url:
        settings.secure_home(create_db=True)
    try:
        if action == "upgrade":
            migrations.upgrade(settings.db_url, revision or "head")
            if settings.app_database_url:
                # The services' own role: rows only, no DDL (the migration Job runs as the owner).
                from migrations.roles import ensure_app_role

                role = asyncio.run(ensure_app_role(settings.db_url, settings.app_database_url))
                click.echo(f"granted the application's role {role} data access")
        elif action == "downgrade":
            migrations.downgrade(settings.db_url, revision or "-1")
        else:
            click.echo(f"database at revision {migrations.current(settings.db_url) or 'none (empty)'}")
            return
    except Exception as exc:  # alembic and drivers raise many kinds; the message is what matters
        _fail(f"migration failed: {exc}")
    click.echo(f"database at revision {migrations.current(settings.db_url) or 'none (empty)'}")


# --- celery -----------------------------------------------------------------------------


@main.group()
def celery() -> None:
    """Celery worker and beat for the periodic billing jobs (production: needs DATABASE_URL and
    REDIS_URL or TOKENMILL_CELERY_BROKER_URL). Further arguments go to celery."""


def _celery_main(command: str, args: tuple[str, ...]) -> None:
    settings = _settings()
    missing = [] if settings.database_url else ["DATABASE_URL"]
    if not (settings.celery_broker_url or settings.redis_url):
        missing.append("REDIS_URL (or TOKENMILL_CELERY_BROKER_URL)")
    if missing:
        _fail(f"set {', '.join(missing)}; `tokenmill serve` runs the jobs in-process instead", 2)
    from billing.celery_app import app

    sys.exit(app.start(argv=[command, *args]))


@celery.command("worker", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def celery_worker(args: tuple[str, ...]) -> None:
    """Run a Celery worker for the billing jobs (e.g. --concurrency 2)."""
    _celery_main("worker", args)


@celery.command("beat", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def celery_beat(args: tuple[str, ...]) -> None:
    """Run Celery beat, which sends the billing jobs on schedule; run exactly one."""
    _celery_main("beat", args)


# --- admin ------------------------------------------------------------------------------


@main.group()
def admin() -> None:
    """Manage organisations, API keys and deployments directly in the database, as the
    platform operator (the same rules as the admin API; changes are audited as the system's)."""


def _admin_run(fn: Callable[[UnitOfWork, Settings], Awaitable[Any]]) -> Any:
    """Run fn(unit, settings) in one unit of work on the configured database (migrated first,
    so this works before the first `serve`): committed at the end, and what gateways cache
    (a revoked key, a suspended organisation) announced to them then, on Redis or the
    embedded server's bus. APIErrors become clean exits."""
    from control_plane.unit import UnitOfWork
    from tokenmill.app import catalog_config
    from tokenmill.db import make_engine, make_sessionmaker
    from tokenmill.errors import APIError
    from tokenmill.storage import open_storage

    settings = _settings()
    if not (settings.database_url and settings.redis_url):
        settings.ensure_secrets()  # the embedded database, or the embedded server's bus token
    if not settings.secret_key:
        _fail("set TOKENMILL_SECRET_KEY (the key API keys are hashed with)", 2)

    async def run() -> Any:
        await _migrate(settings)
        engine = make_engine(settings.db_url)
        publisher = _operator_publisher(settings)
        catalog = catalog_config(settings, open_storage(settings))
        try:
            async with UnitOfWork.open(
                make_sessionmaker(engine), catalog=catalog, publisher=publisher
            ) as unit:
                result = await fn(unit, settings)
        finally:
            await publisher.close()
            await engine.dispose()
        if unit.undelivered:
            click.echo("note: no running gateway was told; gateways re-read keys within 30 s", err=True)
        return result

    try:
        return asyncio.run(run())
    except APIError as exc:
        _fail(exc.message, 1)


def _operator_publisher(settings: Settings) -> Publisher:
    """Where the CLI's changes are announced: Redis, or the embedded server's bus endpoint."""
    from tokenmill.bus import HttpPublisher, RedisBus
    from tokenmill.net import http_address

    if settings.redis_url:
        return RedisBus.from_url(settings.redis_url)
    url = settings.bus_url or f"{http_address(settings.host, settings.port)}/internal/bus"
    return HttpPublisher(url, settings.internal_token or "")


def _body(data: dict[str, Any], kind: type[T]) -> T:
    """Options as one of the admin API's bodies, with the API's validation."""
    from control_plane.wire import parse

    return parse({k: v for k, v in data.items() if v is not None}, kind)


@admin.command("export")
@click.argument("what", type=click.Choice(["usage", "refusals", "rollups", "invoices"]))
@click.option("--format", "fmt", type=click.Choice(["csv", "json"]), default="csv", show_default=True)
@click.option("--from", "start", help="Start, ISO 8601 date or time, UTC [default: this month's start].")
@click.option("--to", "end", help="End, exclusive [default: now].")
@click.option("--org", "org_ref", help="Organisation id or name [default: all].")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Write to a file [default: stdout].")
def export(
    what: str, fmt: str, start: str | None, end: str | None, org_ref: str | None, output: str | None
) -> None:
    """Export per-request usage, refused requests (per key, reason and minute), hourly rollups
    or invoices as CSV or JSON, streamed from the database (any range in bounded memory)."""
    from billing.exports.services import export_query, stream_export

    async def go(unit: UnitOfWork, _: Settings) -> None:
        org_id = (await unit.orgs.by_ref(org_ref)).id if org_ref else None
        query = export_query(what, fmt, start, end, org_id)
        with click.open_file(output or "-", "wb") as out:  # "-": stdout, left open
            async for chunk in stream_export(unit.session, query):
                out.write(chunk)

    _admin_run(go)


@admin.command("create-org")
@click.argument("name")
def create_org(name: str) -> None:
    """Create an organisation."""
    org = _admin_run(lambda unit, _: unit.orgs.create_org(name))
    click.echo(f"{org.id}\t{org.name}")


@admin.command("suspend-org")
@click.argument("org_ref", metavar="ORG")
def suspend_org(org_ref: str) -> None:
    """Suspend an organisation (id or name): its keys, admins and dashboard users are refused
    (but for reading invoices and usage) and its deployments scale to zero."""
    from control_plane.policy import SYSTEM

    changed = _admin_run(lambda unit, _: unit.orgs.suspend(org_ref, SYSTEM))
    click.echo(f"suspended {org_ref}" if changed else f"{org_ref} was already suspended")


@admin.command("resume-org")
@click.argument("org_ref", metavar="ORG")
def resume_org(org_ref: str) -> None:
    """Resume a suspended organisation: its keys work again and its deployments come back."""
    from control_plane.policy import SYSTEM

    changed = _admin_run(lambda unit, _: unit.orgs.resume(org_ref, SYSTEM))
    click.echo(f"resumed {org_ref}" if changed else f"{org_ref} was not suspended")


@admin.command("create-key")
@click.option("--org", "org_ref", required=True, help="Organisation id or name.")
@click.option("--name", default="", help="A label for the key.")
@click.option("--role", type=click.Choice(["member", "org_admin", "platform_admin"]), default="member")
@click.option("--scope", "scopes", multiple=True, help="Allowed model (repeat); default all.")
def create_key(org_ref: str, name: str, role: str, scopes: tuple[str, ...]) -> None:
    """Create an API key; the secret is printed once."""

    async def go(unit: UnitOfWork, settings: Settings) -> Any:
        org = await unit.orgs.by_ref(org_ref)
        return await unit.keys.create_key(
            org_id=org.id,
            secret_key=settings.secret_key or "",
            name=name,
            role=role,
            scopes=list(scopes) or None,
        )

    created = _admin_run(go)
    click.echo(f"created key {created.key.id} ({created.key.prefix}...) for {org_ref}", err=True)
    click.echo(created.secret)


@admin.command("list-keys")
@click.option("--org", "org_ref", required=True, help="Organisation id or name.")
def list_keys(org_ref: str) -> None:
    """List an organisation's API keys (never their secrets)."""

    async def go(unit: UnitOfWork, _: Settings) -> Any:
        return await unit.keys.list_for_org((await unit.orgs.by_ref(org_ref)).id)

    for k in _admin_run(go):
        status = "revoked" if k.revoked_at else "active"
        click.echo(f"{k.id}\t{k.prefix}...\t{k.role}\t{status}\t{k.name}")


@admin.command("revoke-key")
@click.argument("key")
def revoke_key(key: str) -> None:
    """Revoke an API key by id or prefix; running gateways refuse it within a second."""
    revoked = _admin_run(lambda unit, _: unit.keys.revoke(key))
    click.echo(f"revoked {revoked.id} ({revoked.prefix}...)")


# --- admin deployments ----------------------------------------------------------------------


@admin.group()
def deployments() -> None:
    """Create, change and list deployments (dedicated ones need a GPU type from the price book
    and must fit their organisation's quotas)."""


def _print_deployment(dep: Any) -> None:
    """id, name, owner, engine, engine args (JSON), GPU type, GPUs per replica, replicas, status."""
    import json

    replicas = f"{dep.min_replicas}-{dep.max_replicas}"
    owner = dep.org_id or "(serverless)"
    args = json.dumps(dep.engine_args or {}, separators=(",", ":"))
    click.echo(
        f"{dep.id}\t{dep.name}\t{owner}\t{dep.engine}\t{args}\t{dep.gpu_type or '-'}\t"
        f"{dep.gpus_per_replica}\t{replicas}\t{dep.status}"
    )


def _engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--engine, --engine-arg and --gpus-per-replica, alike on create and update."""
    fn = click.option(
        "--gpus-per-replica",
        type=int,
        default=None,
        help="GPUs one worker holds [default: tensor x pipeline parallel size; 0 without a GPU type].",
    )(fn)
    fn = click.option(
        "--engine-arg",
        "engine_args",
        multiple=True,
        metavar="NAME=VALUE",
        help="A vLLM engine argument, e.g. tensor_parallel_size=2 (repeat; replaces them all).",
    )(fn)
    return click.option(
        "--engine", type=click.Choice(["builtin", "vllm"]), default=None, help="[default: builtin]"
    )(fn)


def _engine_body(engine: str | None, engine_args: tuple[str, ...], gpus: int | None) -> dict[str, Any]:
    from control_plane.catalog.engines import parse_assignments

    body: dict[str, Any] = {"engine": engine, "gpus_per_replica": gpus}
    if engine_args:
        body["engine_args"] = parse_assignments(engine_args)
    return body


@deployments.command("create")
@click.option("--name", required=True, help="The name clients use as `model`.")
@click.option("--model", required=True, help="Base model id or name.")
@click.option("--org", "org_ref", help="Owner of a dedicated deployment (id or name).")
@click.option("--type", "kind", type=click.Choice(["dedicated", "serverless"]), default="dedicated")
@click.option("--gpu-type", help="GPU type, priced in the price book (dedicated).")
@click.option("--min-replicas", type=int, default=None, help="[default: 1]")
@click.option("--max-replicas", type=int, default=None, help="[default: 1]")
@click.option("--status", type=click.Choice(["active", "stopped"]), default=None, help="[default: active]")
@click.option("--adapter", "adapters", multiple=True, help="Adapter id to pin (repeat).")
@_engine_options
def create_deployment(
    name: str,
    model: str,
    org_ref: str | None,
    kind: str,
    gpu_type: str | None,
    min_replicas: int | None,
    max_replicas: int | None,
    status: str | None,
    adapters: tuple[str, ...],
    engine: str | None,
    engine_args: tuple[str, ...],
    gpus_per_replica: int | None,
) -> None:
    """Create a deployment; prints it as `list` does."""
    from control_plane.catalog.schemas import DeploymentCreate
    from control_plane.policy import SYSTEM

    async def go(unit: UnitOfWork, _: Settings) -> Any:
        org_id = (await unit.orgs.by_ref(org_ref)).id if org_ref else None
        body = {"name": name, "model": model, "type": kind, "org_id": org_id, "gpu_type": gpu_type}
        body |= {"min_replicas": min_replicas, "max_replicas": max_replicas, "status": status}
        body["adapters"] = list(adapters)
        body |= _engine_body(engine, engine_args, gpus_per_replica)
        return await unit.deployments.create_deployment(_body(body, DeploymentCreate), SYSTEM)

    _print_deployment(_admin_run(go))


@deployments.command("update")
@click.argument("deployment_id")
@click.option("--gpu-type", help="GPU type, priced in the price book.")
@click.option("--min-replicas", type=int, default=None)
@click.option("--max-replicas", type=int, default=None)
@click.option("--status", type=click.Choice(["active", "stopped"]), default=None)
@_engine_options
@click.option("--clear-engine-args", is_flag=True, help="Remove every vLLM engine argument.")
def update_deployment(
    deployment_id: str,
    gpu_type: str | None,
    min_replicas: int | None,
    max_replicas: int | None,
    status: str | None,
    engine: str | None,
    engine_args: tuple[str, ...],
    gpus_per_replica: int | None,
    clear_engine_args: bool,
) -> None:
    """Change a deployment's GPU type, replicas, status, engine, engine arguments or GPUs per
    replica; prints it as `list` does."""
    from control_plane.catalog.schemas import DeploymentUpdate
    from control_plane.policy import SYSTEM

    if clear_engine_args and engine_args:
        _fail("--clear-engine-args and --engine-arg contradict each other", 2)

    async def go(unit: UnitOfWork, _: Settings) -> Any:
        dep = await unit.deployments.visible(deployment_id, SYSTEM)
        body = {"gpu_type": gpu_type, "min_replicas": min_replicas, "max_replicas": max_replicas}
        body["status"] = status
        body |= _engine_body(engine, engine_args, gpus_per_replica)
        update = _body(body, DeploymentUpdate)
        if clear_engine_args:
            update.engine_args = {}
        return await unit.deployments.update_deployment(dep, update, SYSTEM)

    _print_deployment(_admin_run(go))


@deployments.command("list")
@click.option("--org", "org_ref", help="Only this organisation's dedicated deployments (id or name).")
def list_deployments(org_ref: str | None) -> None:
    """Every deployment (or an organisation's): id, name, owner, engine, engine arguments,
    GPU type, GPUs per replica, replicas, status."""
    from control_plane.policy import SYSTEM

    async def go(unit: UnitOfWork, _: Settings) -> Any:
        org_id = (await unit.orgs.by_ref(org_ref)).id if org_ref else None
        return await unit.deployments.list_visible(SYSTEM, org_id)

    for dep in _admin_run(go):
        _print_deployment(dep)


if __name__ == "__main__":
    main()
