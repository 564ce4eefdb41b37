"""Server time of the dashboard's heaviest pages over a large ledger (issue 8, acceptance 3).

    .venv/bin/python -m bench.dashboard                 # 100,000 usage rows, SQLite and PostgreSQL
    .venv/bin/python -m bench.dashboard --quick         # 10,000 rows, 5 requests a page
    .venv/bin/python -m bench.dashboard --backends sqlite

For each database (a fresh SQLite file, the embedded default; a fresh migrated database on
the local PostgreSQL, `--database-url`): 20 organisations with 5 keys each, the bundled
model priced, `--rows` usage events spread evenly over the last 30 days (through billing's
`record_usage`, as the ledger consumer writes them), and the hourly rollups of those days.
The app (`create_app` with the admin API and the dashboard) is served by uvicorn on
loopback; a platform admin and one organisation's admin sign in through the login form.
Each page is requested twice to warm up, then `--requests` times; the server time is the
`Server-Timing` header the dashboard adds (from the request reaching the dashboard to the
first byte of the rendered page: queries, aggregation, template), the wall time is the
client's. Target: every page's p95 server time under 300 ms.

The lists (issue 21): `--keys` API keys in that one organisation (10,000) and `--audit`
audit entries (100,000, half of them the organisation's, the rest spread over the others),
written in bulk; the keys and audit-log pages are measured on their first page, on a page
half-way down (through its cursor), with a search that finds a few rows and with one that
finds none (the whole list read), as a platform admin and as the organisation's admin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
DEFAULT_SERVER = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
TARGET_MS = 300.0
PASSWORD = "bench password 1234"
SECRET = "bench-secret"
MODEL = "SmolLM2-135M-Instruct"
DAYS = 30
ORGS = 20
KEYS_PER_ORG = 5


@dataclass
class PageResult:
    backend: str
    page: str
    path: str
    role: str
    rows_in_range: int
    requests: int
    server_p50_ms: float
    server_p95_ms: float
    server_max_ms: float
    wall_p50_ms: float
    met: bool


@dataclass
class World:
    org_ids: list[str]
    key_ids: list[str]
    tenant_email: str
    tenant_org: str
    seed_seconds: float


@dataclass
class Lists:
    """The bulk lists and the cursors of the pages half-way down them."""

    keys: int
    audit: int
    tenant_audit: int
    key_cursor: str  # the key the keys page (newest first) reaches after keys/2 rows
    audit_cursor: int  # the entry the audit page (newest first) reaches after audit/2 rows
    seed_seconds: float


# --- the data -------------------------------------------------------------------------------


async def seed(db_url: str, rows: int, home: Path) -> World:
    """Organisations, keys, users, a price, `rows` ledger rows over DAYS days, their rollups."""
    from billing.ledger.services import record_usage
    from billing.prices.services import PriceBook
    from billing.rollups.services import store_rollups
    from control_plane.bootstrap import bootstrap
    from control_plane.orgs.keys import ApiKeyService
    from control_plane.orgs.services import OrganizationService, UserService
    from tokenmill.db import make_engine, make_sessionmaker
    from tokenmill.protocol import UsageRecord

    started = time.perf_counter()
    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    boot = await bootstrap(
        sm,
        secret_key=SECRET,
        model_name=MODEL,
        model_source="bundled:smollm2",
        model_format="gguf",
        context_length=8192,
    )
    org_ids, key_ids = [], []
    async with sm() as session, session.begin():
        orgs = OrganizationService(session=session)
        keys = ApiKeyService(session=session)
        for i in range(ORGS):
            org = await orgs.create_org(f"bench-org-{i:02d}")
            org_ids.append(org.id)
            for k in range(KEYS_PER_ORG):
                created = await keys.create_key(org_id=org.id, secret_key=SECRET, name=f"key-{k}")
                key_ids.append(created.key.id)
        users = UserService(session=session)
        await users.create_user(
            org_id=boot.org.id, email="root@bench.test", password=PASSWORD, role="platform_admin"
        )
        await users.create_user(
            org_id=org_ids[0], email="admin@bench.test", password=PASSWORD, role="org_admin"
        )
        await PriceBook(session).add_model_price(
            model_ref=MODEL,
            input_per_mtok=Decimal("0.5"),
            output_per_mtok=Decimal("1.5"),
            effective_from=datetime.now(UTC) - timedelta(days=DAYS + 5),
        )
    rng = random.Random(8)
    now = time.time()
    span = DAYS * 86400
    batch: list[UsageRecord] = []
    for i in range(rows):
        key = rng.randrange(len(key_ids))
        batch.append(
            UsageRecord(
                request_id=f"bench-{i}",
                org_id=org_ids[key // KEYS_PER_ORG],
                api_key_id=key_ids[key],
                model=MODEL,
                deployment_id=boot.deployment.id,
                prompt_tokens=rng.randint(20, 2000),
                cached_tokens=rng.randint(0, 16),
                completion_tokens=rng.randint(1, 400),
                ttft_ms=rng.uniform(20, 400),
                duration_ms=rng.uniform(100, 4000),
                status="ok" if rng.random() > 0.02 else "error",
                ts=now - span * (i + 0.5) / rows,  # evenly over the last DAYS days
            )
        )
        if len(batch) == 2000 or i == rows - 1:
            async with sm() as session, session.begin():
                await record_usage(session, batch)
            batch = []
    async with sm() as session, session.begin():
        end = datetime.now(UTC) + timedelta(hours=1)
        await store_rollups(session, end - timedelta(days=DAYS + 1), end)
    await engine.dispose()
    return World(org_ids, key_ids, "admin@bench.test", org_ids[0], time.perf_counter() - started)


async def seed_lists(db_url: str, world: World, keys: int, entries: int) -> Lists:
    """`keys` API keys in the tenant organisation (created ten to a second, so timestamps
    tie) and `entries` audit entries over DAYS days, half of them the tenant's, with the
    snapshots a key's change writes, all by bulk insert."""
    from sqlalchemy import insert, select

    from control_plane.audit.models import AuditEntry
    from control_plane.audit.services import ACTIONS, RESOURCE_TYPES
    from control_plane.orgs.models import ApiKey, User
    from tokenmill.db import make_engine, make_sessionmaker, new_id

    started = time.perf_counter()
    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    rng = random.Random(21)
    start = datetime.now(UTC) - timedelta(days=DAYS)
    key_ids: list[str] = []
    async with sm() as session, session.begin():
        users = list(await session.scalars(select(User.id)))
        for lo in range(0, keys, 5000):
            rows = []
            for i in range(lo, min(keys, lo + 5000)):
                key_ids.append(new_id("key"))
                rows.append(
                    {
                        "id": key_ids[-1],
                        "org_id": world.tenant_org,
                        "name": f"bulk-key-{i:05d}",
                        "prefix": f"tm-b{i:07d}",
                        "hash": "0" * 64,
                        "role": "member",
                        "created_at": start + timedelta(seconds=i // 10),
                    }
                )
            await session.execute(insert(ApiKey), rows)
    actors = key_ids[:200] + world.key_ids
    tenant = 0
    async with sm() as session, session.begin():
        for lo in range(0, entries, 5000):
            rows = []
            for i in range(lo, min(entries, lo + 5000)):
                mine = i % 2 == 0
                tenant += mine
                org = world.tenant_org if mine else world.org_ids[1 + i % (len(world.org_ids) - 1)]
                by_user = rng.random() < 0.3
                snap = {"id": rng.choice(key_ids), "org_id": org, "name": f"bulk-key-{i % keys:05d}",
                        "max_concurrent": rng.randint(1, 9), "revoked_at": None}  # fmt: skip
                rows.append(
                    {
                        "at": start + timedelta(seconds=i * DAYS * 86400 / entries),
                        "actor_user_id": rng.choice(users) if by_user else None,
                        "actor_key_id": None if by_user else rng.choice(actors),
                        "org_id": org,
                        "action": rng.choice(ACTIONS),
                        "resource_type": rng.choice(RESOURCE_TYPES),
                        "resource_id": snap["id"],
                        "before": snap,
                        "after": snap | {"max_concurrent": snap["max_concurrent"] + 1},
                    }
                )
            await session.execute(insert(AuditEntry), rows)
    async with sm() as session:
        newest_first = select(ApiKey.id).where(ApiKey.org_id == world.tenant_org)
        newest_first = newest_first.order_by(ApiKey.created_at.desc(), ApiKey.id.desc())
        key_cursor = await session.scalar(newest_first.offset(keys // 2).limit(1))
        audit_cursor = await session.scalar(
            select(AuditEntry.id).order_by(AuditEntry.id.desc()).offset(entries // 2).limit(1)
        )
    await engine.dispose()
    assert key_cursor is not None and audit_cursor is not None
    return Lists(keys, entries, tenant, key_cursor, audit_cursor, time.perf_counter() - started)


# --- the server -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serve(db_url: str, home: Path) -> AsyncIterator[str]:
    import uvicorn

    from tokenmill.app import Parts, create_app
    from tokenmill.db import make_engine
    from tokenmill.settings import Settings

    settings = Settings(home=home, database_url=db_url, internal_token="bench", secret_key=SECRET)
    app = create_app(settings, make_engine(db_url), Parts(admin=True))
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def sign_in(base: str, email: str) -> httpx.AsyncClient:
    client = httpx.AsyncClient(base_url=base, timeout=60)
    page = await client.get("/dashboard/login")
    token = re.search(r'name="_csrf_token" value="([^"]+)"', page.text)
    assert token, "no CSRF token on the login page"
    r = await client.post(
        "/dashboard/login", data={"email": email, "password": PASSWORD, "_csrf_token": token.group(1)}
    )
    assert r.status_code == 303, r.text
    return client


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(client: httpx.AsyncClient, path: str, n: int) -> tuple[list[float], list[float]]:
    server, wall = [], []
    for i in range(n + 2):
        t0 = time.perf_counter()
        r = await client.get(path)
        elapsed = (time.perf_counter() - t0) * 1000
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
        found = re.fullmatch(r"app;dur=([\d.]+)", r.headers.get("server-timing", ""))
        assert found, r.headers
        if i >= 2:  # the first two warm caches and pools
            server.append(float(found.group(1)))
            wall.append(elapsed)
    return server, wall


async def bench_backend(
    backend: str, db_url: str, rows: int, n: int, home: Path, keys: int, entries: int
) -> tuple[list[PageResult], str]:
    import migrations

    await asyncio.to_thread(migrations.upgrade, db_url)
    version = await _version(db_url)
    world = await seed(db_url, rows, home)
    print(
        f"[{backend}] seeded {rows:,} usage rows and their rollups in {world.seed_seconds:.1f}s", flush=True
    )
    lists = await seed_lists(db_url, world, keys, entries)
    print(f"[{backend}] seeded {keys:,} keys and {entries:,} audit entries in {lists.seed_seconds:.1f}s")
    tenant_keys = f"/dashboard/keys?org={world.tenant_org}"
    today = datetime.now(UTC).date()
    month = f"from={(today - timedelta(days=DAYS)).isoformat()}&to={today.isoformat()}"
    per_org = rows // ORGS
    pages = [
        ("overview", "/dashboard/", "platform_admin", rows // DAYS),
        ("overview 30d", "/dashboard/?range=30d", "platform_admin", rows),
        ("usage", "/dashboard/usage", "platform_admin", rows * 7 // DAYS),
        ("usage 31 days", f"/dashboard/usage?{month}", "platform_admin", rows),
        ("usage 31 days, one key", f"/dashboard/usage?{month}&key={world.key_ids[7]}", "platform_admin",
         rows // len(world.key_ids)),
        # spend of a model name: the ledger priced hour by hour (the rollups are per base model)
        ("usage 31 days, one model", f"/dashboard/usage?{month}&model={MODEL}", "platform_admin", rows),
        ("overview", "/dashboard/", "org_admin", per_org // DAYS),
        ("usage 31 days", f"/dashboard/usage?{month}", "org_admin", per_org),
        # the lists: a first page, a page half-way down by its cursor, a search finding ten
        # rows and one finding none (every row read)
        ("keys, first page", tenant_keys, "platform_admin", keys),
        ("keys, page by cursor", f"{tenant_keys}&after={lists.key_cursor}", "platform_admin", keys),
        ("keys, search", f"{tenant_keys}&q=key-0420", "platform_admin", keys),
        ("keys, search, no match", f"{tenant_keys}&q=nothing-like-it", "platform_admin", keys),
        ("keys, first page", "/dashboard/keys", "org_admin", keys),
        ("keys, search", "/dashboard/keys?q=key-0420", "org_admin", keys),
        ("audit, first page", "/dashboard/audit", "platform_admin", entries),
        ("audit, page by cursor", f"/dashboard/audit?after={lists.audit_cursor}", "platform_admin", entries),
        ("audit, search", "/dashboard/audit?q=bulk-key-0001", "platform_admin", entries),
        ("audit, search, no match", "/dashboard/audit?q=nothing-like-it", "platform_admin", entries),
        ("audit, type and action", "/dashboard/audit?resource_type=plan&action=rotate", "platform_admin",
         entries),
        ("audit, first page", "/dashboard/audit", "org_admin", lists.tenant_audit),
        ("audit, page by cursor", f"/dashboard/audit?after={lists.audit_cursor}", "org_admin",
         lists.tenant_audit),
        ("audit, search, no match", "/dashboard/audit?q=nothing-like-it", "org_admin", lists.tenant_audit),
    ]  # fmt: skip
    results = []
    async with serve(db_url, home) as base:
        clients = {
            "platform_admin": await sign_in(base, "root@bench.test"),
            "org_admin": await sign_in(base, world.tenant_email),
        }
        try:
            for name, path, role, in_range in pages:
                server, wall = await measure(clients[role], path, n)
                p95 = _pct(server, 0.95)
                results.append(
                    PageResult(
                        backend=backend,
                        page=name,
                        path=path,
                        role=role,
                        rows_in_range=in_range,
                        requests=n,
                        server_p50_ms=round(statistics.median(server), 1),
                        server_p95_ms=round(p95, 1),
                        server_max_ms=round(max(server), 1),
                        wall_p50_ms=round(statistics.median(wall), 1),
                        met=p95 < TARGET_MS,
                    )
                )
                r = results[-1]
                print(f"[{backend}] {role:14} {name:24} p95 {r.server_p95_ms:6.1f} ms", flush=True)
        finally:
            for c in clients.values():
                await c.aclose()
    return results, version


@contextlib.contextmanager
def _sqlite(tmp: Path) -> Iterator[str]:
    yield f"sqlite+aiosqlite:///{tmp / 'bench.db'}"


def report(results: list[PageResult]) -> str:
    head = (
        f"{'backend':11} {'role':15} {'page':24} {'rows':>8} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} "
        f"{'wall':>7}  target"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.backend:11} {r.role:15} {r.page:24} {r.rows_in_range:8,} {r.server_p50_ms:8.1f} "
            f"{r.server_p95_ms:8.1f} {r.server_max_ms:8.1f} {r.wall_p50_ms:7.1f}  "
            f"{'MET' if r.met else 'NOT MET'} (p95 < {TARGET_MS:.0f} ms)"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int)
    p.add_argument("--requests", type=int)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--backends", default="sqlite,postgresql")
    p.add_argument("--keys", type=int, default=10_000, help="API keys in one organisation")
    p.add_argument("--audit", type=int, default=100_000, help="audit entries")
    p.add_argument("--database-url", default=DEFAULT_SERVER, help="a maintenance database on the server")
    args = p.parse_args()
    rows = args.rows or (10_000 if args.quick else 100_000)
    n = args.requests or (5 if args.quick else 20)
    os.environ.setdefault("TQDM_DISABLE", "1")
    results: list[PageResult] = []
    versions: dict[str, str] = {}
    for backend in args.backends.split(","):
        tmp = Path(tempfile.mkdtemp(prefix="tm-bench-dashboard-"))
        try:
            if backend == "postgresql":
                from bench.gateway import database

                ctx: Any = database(args.database_url)
            else:
                ctx = _sqlite(tmp)
            with ctx as db_url:
                found, versions[backend] = asyncio.run(
                    bench_backend(backend, db_url, rows, n, tmp, args.keys, args.audit)
                )
                results += found
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(report(results))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("dashboard-quick.json" if args.quick else "dashboard.json")
    payload = {
        "conditions": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "databases": versions,
            "usage_rows": rows,
            "days": DAYS,
            "organisations": ORGS,
            "keys": ORGS * KEYS_PER_ORG,
            "bulk_keys_in_one_organisation": args.keys,
            "audit_entries": args.audit,
            "requests_per_page": n,
            "server_time": "Server-Timing header: request in to first byte out, in the dashboard app",
            # Other processes share the 2 cores: the load says how much they took.
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "target_ms": TARGET_MS,
        "pages": [asdict(r) for r in results],
        "met": all(r.met for r in results),
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path.relative_to(ROOT)}")
    missed = [f"{r.backend} {r.role} {r.page}: p95 {r.server_p95_ms} ms" for r in results if not r.met]
    if missed:
        raise SystemExit("NOT MET: " + "; ".join(missed))


async def _version(db_url: str) -> str:
    from sqlalchemy import text

    from tokenmill.db import make_engine

    if db_url.startswith("sqlite"):
        import sqlite3

        return f"SQLite {sqlite3.sqlite_version}"
    engine = make_engine(db_url)
    try:
        async with engine.connect() as conn:
            return "PostgreSQL " + str((await conn.execute(text("SHOW server_version"))).scalar()).split()[0]
    finally:
        await engine.dispose()


if __name__ == "__main__":
    main()
