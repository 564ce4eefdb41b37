"""Issue 16, acceptance 2: one scenario through each front door — the admin API, the
dashboard and the `tokenmill admin` CLI — against a production-shaped platform: two
`tokenmill gateway` replicas and a `tokenmill control-plane` (admin API and dashboard) on one
PostgreSQL database and one Redis bus, driven as their users drive them (the openai SDK,
HTTP with admin keys, the dashboard's forms with their CSRF token, the CLI as a subprocess).

Through every door alike:
- a revoked key is refused by both gateways within a second;
- a suspended organisation's key is refused by both gateways within a second, its admin is
  refused on the admin API and the dashboard (but still reads invoices and usage), the
  operator cannot put it back to work through the CLI, and its dedicated deployment is held
  at zero replicas — and resuming brings key and replicas back;
- a dedicated deployment beyond the plan's replica quota is refused, with the service's own
  message (naming the quota) on every door.

The platform is started once for the module; each case makes its own organisations.
"""

from __future__ import annotations

import asyncio
import html
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

import migrations
from autoscaler.leader import SoleLease
from autoscaler.reconciler import Reconciler
from billing.models import Price
from control_plane.bootstrap import bootstrap
from control_plane.catalog.schemas import DeploymentCreate
from control_plane.orgs.models import ApiKey
from control_plane.plans.models import Plan
from control_plane.policy import SYSTEM, QuotaDefaults, check_dedicated_quota
from control_plane.unit import UnitOfWork
from control_plane.wire import parse
from tests import databases
from tests.autoscaler.test_reconciler import Recorder
from tests.conftest import _free_port
from tests.control_plane.conftest import GPU, MODEL
from tests.control_plane.test_admin_api import API, bearer, error
from tests.dashboard.conftest import PASSWORD, Session, sign_in
from tokenmill.app import catalog_config
from tokenmill.bus import MemoryBus
from tokenmill.db import make_engine, make_sessionmaker, utcnow
from tokenmill.errors import APIError
from tokenmill.settings import BUNDLED_MODEL, Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SECRET, INTERNAL = "three-doors-secret", "three-doors-internal"
ROOT_EMAIL = "root@three-doors.test"
# The plan of the quota case: two dedicated replicas in all.
QUOTA = 2
# What "at once" means for a change the gateways cache (the acceptance).
WITHIN = 1.0
_FLASH = re.compile(r'<p class="flash (ok|error)"[^>]*>(.*?)</p>', re.S)


@dataclass
class Tenant:
    """An organisation as setup made it (not through any door under test)."""

    id: str
    name: str
    admin_key: str  # an org_admin API key, for the admin API
    admin_email: str  # an org_admin user, for the dashboard
    key_id: str
    key: str  # a member key, for the gateways
    dep_id: str = ""  # its dedicated deployment, if any


@dataclass
class Platform:
    tmp: Path
    db_url: str
    redis_url: str
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    settings: Settings
    root_key: str = ""  # the bootstrap platform-admin key
    model_id: str = ""
    plan_id: str = ""  # the plan with the QUOTA
    gateways: list[str] = field(default_factory=list)
    control: str = ""  # the control plane: admin API and dashboard
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    sessions: dict[str, Session] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DATABASE_URL": self.db_url,
            "REDIS_URL": self.redis_url,
            "TOKENMILL_SECRET_KEY": SECRET,
            "TOKENMILL_INTERNAL_TOKEN": INTERNAL,
            "TOKENMILL_HOME": str(self.tmp / "home"),
            "TOKENMILL_LOG_LEVEL": "WARNING",
        }

    def start(self, command: str, model_cache: Path) -> str:
        port = _free_port()
        env = self.env() | {
            "TOKENMILL_PORT": str(port),
            "TOKENMILL_MODEL_CACHE": str(model_cache),
            "TOKENMILL_SPOOL_DIR": str(self.tmp / f"spool-{port}"),
        }
        log = open(self.tmp / f"{command}-{port}.log", "wb")  # noqa: SIM115 - lives as long as the process
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tokenmill.cli", command], env=env, cwd=ROOT, stdout=log, stderr=log
            )
        )
        return f"http://127.0.0.1:{port}"

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log")
        )

    # --- setup, through the services (no door under test) ----------------------------------

    async def tenant(
        self, name: str, *, plan_id: str | None = None, replicas: tuple[int, int] | None = None
    ) -> Tenant:
        async with UnitOfWork.open(self.sessionmaker, catalog=catalog_config(self.settings, None)) as unit:
            org = await unit.orgs.create_org(name, plan_id=plan_id)
            email = f"admin@{name}.test"
            await unit.users.create_user(org_id=org.id, email=email, password=PASSWORD, role="org_admin")
            admin = await unit.keys.create_key(org_id=org.id, secret_key=SECRET, role="org_admin")
            member = await unit.keys.create_key(org_id=org.id, secret_key=SECRET, name="app")
            tenant = Tenant(org.id, name, admin.secret, email, member.key.id, member.secret)
            if replicas is not None:
                body = {"name": f"{name}-dep", "model": MODEL, "org_id": org.id, "gpu_type": GPU}
                body |= {"min_replicas": replicas[0], "max_replicas": replicas[1]}
                dep = await unit.deployments.create_deployment(parse(body, DeploymentCreate), SYSTEM)
                tenant.dep_id = dep.id
        return tenant

    # --- the doors' clients ------------------------------------------------------------------

    async def api(
        self, method: str, path: str, key: str, body: dict[str, Any] | None = None
    ) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.control, timeout=30) as client:
            return await client.request(method, API + path, headers=bearer(key), json=body)

    async def dashboard(self, email: str) -> Session:
        """Signed in through the login form once per user, as a browser keeps its session."""
        if email not in self.sessions:
            self.sessions[email] = await sign_in(self.control, email)
        return self.sessions[email]

    async def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tokenmill.cli", "admin", *args,
            env=self.env(), cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
        assert proc.returncode is not None
        return subprocess.CompletedProcess(list(args), proc.returncode, out.decode(), err.decode())

    # --- what the gateways and the reconciler make of it ------------------------------------

    def _sdk(self, gateway: str, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=10)

    async def accepted(self, key: str, within: float = 0.0) -> None:
        """Every gateway lists the model for `key` (and caches the key, so that a refusal
        afterwards shows the change was announced, not re-read after the cache's 30 s)."""

        async def on(gateway: str) -> None:
            deadline = time.monotonic() + within
            async with self._sdk(gateway, key) as client:
                while True:
                    try:
                        models = await client.models.list()
                        break
                    except openai.APIStatusError:
                        if time.monotonic() >= deadline:
                            raise
                    await asyncio.sleep(0.02)
            assert MODEL in [m.id for m in models.data], gateway

        await asyncio.gather(*(on(g) for g in self.gateways))

    async def refused(self, key: str, status: int, code: str) -> None:
        """Every gateway refuses `key` (`status`, error `code`) to a request sent within
        WITHIN seconds of now (when the door's change has returned)."""
        deadline = time.monotonic() + WITHIN

        async def on(gateway: str) -> openai.APIStatusError | None:
            async with self._sdk(gateway, key) as client:
                while True:
                    try:
                        await client.models.list()
                    except openai.APIStatusError as exc:
                        return exc
                    if time.monotonic() >= deadline:
                        return None
                    await asyncio.sleep(0.02)

        for gateway, exc in zip(
            self.gateways, await asyncio.gather(*(on(g) for g in self.gateways)), strict=True
        ):
            assert exc is not None, f"{gateway} still accepts the key {WITHIN} s after the change"
            assert (exc.status_code, exc.body["code"]) == (status, code), (gateway, exc.body)  # type: ignore[index]

    async def desired(self, dep_id: str) -> int:
        """The replicas the reconciler wants for `dep_id` now (one tick against the database)."""
        provider = Recorder()
        reconciler = Reconciler(
            MemoryBus(), self.sessionmaker, provider, SoleLease(), interval=1, worker_timeout=3
        )
        await reconciler.tick()
        assert reconciler.decisions[dep_id].desired == provider.counts[dep_id]
        return provider.counts[dep_id]

    async def deployment(self, dep_id: str) -> dict[str, Any]:
        r = await self.api("GET", f"/deployments/{dep_id}", self.root_key)
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def key_names(self, org_id: str) -> list[str]:
        async with self.sessionmaker() as s:
            return list(await s.scalars(select(ApiKey.name).where(ApiKey.org_id == org_id)))


@pytest.fixture(scope="module")
async def platform(
    tmp_path_factory: pytest.TempPathFactory, pg_server_url: str, redis_url: str, model_cache: Path
) -> AsyncIterator[Platform]:
    tmp = tmp_path_factory.mktemp("three-doors")
    db_name = f"tm_test_{secrets.token_hex(6)}"  # the harness's pattern: only these are dropped
    await databases.create(pg_server_url, db_name)
    db_url = make_url(pg_server_url).set(drivername="postgresql+asyncpg", database=db_name)
    db = db_url.render_as_string(hide_password=False)
    engine = make_engine(db)
    settings = Settings(home=tmp / "home", database_url=db, secret_key=SECRET, model_cache=model_cache)
    p = Platform(tmp, db, redis_url, engine, make_sessionmaker(engine), settings)
    try:
        await asyncio.to_thread(migrations.upgrade, db)
        boot = await bootstrap(
            p.sessionmaker,
            secret_key=SECRET,
            model_name=MODEL,
            model_source=BUNDLED_MODEL,
            model_format="gguf",
            context_length=8192,
        )
        assert boot.admin_secret
        p.root_key, p.model_id = boot.admin_secret, boot.model.id
        # Started first, so the rest of the setup overlaps their start.
        p.gateways = [p.start("gateway", model_cache) for _ in range(2)]
        p.control = p.start("control-plane", model_cache)
        async with UnitOfWork.open(p.sessionmaker) as unit:
            unit.session.add(
                Price(gpu_type=GPU, gpu_hour=Decimal("0.80"), effective_from=utcnow() - timedelta(days=1))
            )
            plan = Plan(name="two-replicas", max_dedicated_replicas=QUOTA)
            unit.session.add(plan)
            await unit.session.flush()
            p.plan_id = plan.id
            await unit.users.create_user(
                org_id=boot.org.id, email=ROOT_EMAIL, password=PASSWORD, role="platform_admin"
            )
        await _ready(p)
        yield p
    finally:
        for session in p.sessions.values():
            await session.client.aclose()
        for proc in p.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in p.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        await engine.dispose()
        await databases.drop(pg_server_url, db_name)


async def _ready(p: Platform) -> None:
    """Each gateway answers the platform admin's key, and the control plane its admin API."""
    urls = [f"{g}/v1/models" for g in p.gateways] + [f"{p.control}{API}/organizations"]
    deadline = time.monotonic() + 120
    async with httpx.AsyncClient(timeout=10) as client:
        for url in urls:
            while True:
                try:
                    if (await client.get(url, headers=bearer(p.root_key))).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or any(proc.poll() is not None for proc in p.procs):
                    raise AssertionError(f"{url} never became ready\n{p.logs()}")
                await asyncio.sleep(0.2)


# --- the doors --------------------------------------------------------------------------------


class Door(Protocol):
    async def revoke(self, p: Platform, t: Tenant) -> None: ...
    async def set_suspended(self, p: Platform, t: Tenant, suspended: bool) -> None: ...
    async def exceed_quota(self, p: Platform, t: Tenant) -> list[str]:
        """Create a second dedicated deployment, then scale the first, each past the quota:
        the two refusals' messages, as this door shows them."""
        ...


class AdminApiDoor:
    async def revoke(self, p: Platform, t: Tenant) -> None:
        r = await p.api("DELETE", f"/keys/{t.key_id}", p.root_key)
        assert r.status_code == 200 and r.json()["revoked_at"], r.text

    async def set_suspended(self, p: Platform, t: Tenant, suspended: bool) -> None:
        r = await p.api("POST", f"/organizations/{t.id}/{'suspend' if suspended else 'resume'}", p.root_key)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == ("suspended" if suspended else "active")

    async def exceed_quota(self, p: Platform, t: Tenant) -> list[str]:
        # The tenant's own admin, who is the one a quota holds back.
        new = {"name": f"{t.name}-more", "model": MODEL, "gpu_type": GPU, "max_replicas": QUOTA}
        created = error(await p.api("POST", "/deployments", t.admin_key, new), 403, "max_replicas")
        scaled = error(
            await p.api("PATCH", f"/deployments/{t.dep_id}", t.admin_key, {"max_replicas": QUOTA + 1}),
            403,
            "max_replicas",
        )
        assert created["code"] == scaled["code"] == "quota_exceeded"
        return [created["message"], scaled["message"]]


async def _follow(session: Session, r: httpx.Response, to: str) -> tuple[str, str]:
    """A form's 303 back to `to`, followed as a browser does: the page's one-line message."""
    assert r.status_code == 303, r.text
    assert r.headers["location"] == f"/dashboard{to}", r.headers["location"]
    page = await session.get(to)
    assert page.status_code == 200, page.text
    flashes = _FLASH.findall(page.text)
    assert len(flashes) == 1, flashes
    kind, text = flashes[0]
    return kind, html.unescape(text).strip()


class DashboardDoor:
    async def revoke(self, p: Platform, t: Tenant) -> None:
        root = await p.dashboard(ROOT_EMAIL)
        page = await root.get(f"/keys?org={t.id}")
        action = f"/dashboard/keys/{t.key_id}/revoke"
        assert page.status_code == 200 and f'action="{action}"' in page.text  # the page's own form
        r = await root.post(f"/keys/{t.key_id}/revoke")
        kind, text = await _follow(root, r, f"/keys?org={t.id}")
        assert kind == "ok" and text.startswith("Revoked key "), text

    async def set_suspended(self, p: Platform, t: Tenant, suspended: bool) -> None:
        root = await p.dashboard(ROOT_EMAIL)
        page = await root.get(f"/orgs/{t.id}")
        status = "suspended" if suspended else "active"
        assert page.status_code == 200 and f'name="status" value="{status}"' in page.text
        r = await root.post(f"/orgs/{t.id}/status", {"status": status})
        kind, text = await _follow(root, r, f"/orgs/{t.id}")
        assert (kind, text) == ("ok", f"{t.name} is {status}."), text

    async def exceed_quota(self, p: Platform, t: Tenant) -> list[str]:
        admin = await p.dashboard(t.admin_email)
        assert (await admin.get("/deployments")).status_code == 200
        new = {"name": f"{t.name}-more", "model": p.model_id, "gpu_type": GPU}
        r = await admin.post("/deployments", new | {"min_replicas": "0", "max_replicas": str(QUOTA)})
        created = await _follow(admin, r, "/deployments")  # not the new deployment's page
        r = await admin.post(
            f"/deployments/{t.dep_id}", {"min_replicas": "1", "max_replicas": str(QUOTA + 1)}
        )
        scaled = await _follow(admin, r, f"/deployments/{t.dep_id}")
        assert created[0] == scaled[0] == "error"
        return [created[1], scaled[1]]


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    # Told to the running gateways over Redis, not left to their 30 s cache.
    assert "no running gateway was told" not in done.stderr, done.stderr
    return done.stdout.strip()


def _refused(done: subprocess.CompletedProcess[str]) -> str:
    """A clean refusal: exit status 1 and one `error: <the service's message>` line."""
    assert done.returncode == 1 and not done.stdout, done.stdout + done.stderr
    line = done.stderr.strip()
    assert line.startswith("error: ") and "\n" not in line and "Traceback" not in line, done.stderr
    return line.removeprefix("error: ")


class CliDoor:
    async def revoke(self, p: Platform, t: Tenant) -> None:
        prefix = t.key[:11]
        assert _ok(await p.cli("revoke-key", prefix)) == f"revoked {t.key_id} ({prefix}...)"

    async def set_suspended(self, p: Platform, t: Tenant, suspended: bool) -> None:
        verb, done = ("suspend", "suspended") if suspended else ("resume", "resumed")
        assert _ok(await p.cli(f"{verb}-org", t.name)) == f"{done} {t.name}"

    async def exceed_quota(self, p: Platform, t: Tenant) -> list[str]:
        created, scaled = await asyncio.gather(
            p.cli(
                "deployments", "create", "--org", t.name, "--name", f"{t.name}-more", "--model", MODEL,
                "--gpu-type", GPU, "--max-replicas", str(QUOTA),
            ),
            p.cli("deployments", "update", t.dep_id, "--max-replicas", str(QUOTA + 1)),
        )  # fmt: skip
        return [_refused(created), _refused(scaled)]


DOORS: dict[str, Door] = {"admin_api": AdminApiDoor(), "dashboard": DashboardDoor(), "cli": CliDoor()}
doors = pytest.mark.parametrize("door", list(DOORS))


# --- the scenario -----------------------------------------------------------------------------


@doors
async def test_a_revoked_key_is_refused_by_every_gateway_within_a_second(
    platform: Platform, door: str
) -> None:
    t = await platform.tenant(f"revoke-{door.replace('_', '-')}")
    await platform.accepted(t.key)
    await DOORS[door].revoke(platform, t)
    await platform.refused(t.key, 401, "invalid_api_key")


async def _refused_on_the_admin_api(p: Platform, t: Tenant) -> None:
    """No more changes, but what the organisation owes is still readable."""
    r = await p.api("POST", f"/organizations/{t.id}/keys", t.admin_key, {"name": "more", "role": "member"})
    assert error(r, 403)["code"] == "organization_suspended"
    assert (await p.api("GET", "/invoices", t.admin_key)).status_code == 200


async def _refused_on_the_dashboard(p: Platform, t: Tenant, admin: Session) -> None:
    r = await admin.post("/keys", {"org": t.id, "name": "from-the-dashboard"})
    assert r.status_code == 403 and "suspended" in r.text, r.text
    assert "from-the-dashboard" not in await p.key_names(t.id)
    for readable in ("/invoices", "/usage"):
        assert (await admin.get(readable)).status_code == 200, readable


async def _refused_on_the_cli(p: Platform, t: Tenant) -> None:
    """The CLI has no organisation admins: it is the platform operator, whom a suspension does
    not hold (control_plane.policy.admit). It still cannot put the organisation back to work,
    and a key it mints for it is refused where keys are used."""
    dep, key = await asyncio.gather(
        p.cli(
            "deployments", "create", "--org", t.name, "--name", f"{t.name}-again", "--model", MODEL,
            "--gpu-type", GPU,
        ),
        p.cli("create-key", "--org", t.name, "--name", "operator's"),
    )  # fmt: skip
    assert _refused(dep).startswith(
        f"Organisation '{t.name}' is suspended: its deployments stay scaled to zero"
    )
    await p.refused(_ok(key).splitlines()[-1], 403, "organization_suspended")


@doors
async def test_a_suspended_organisation_is_refused_everywhere_and_scaled_to_zero(
    platform: Platform, door: str
) -> None:
    t = await platform.tenant(f"suspend-{door.replace('_', '-')}", replicas=(1, 2))
    await platform.accepted(t.key)
    admin = await platform.dashboard(t.admin_email)
    assert (await admin.get("/keys")).status_code == 200  # signed in, and may work, until ...
    assert await platform.desired(t.dep_id) == 1

    await DOORS[door].set_suspended(platform, t, True)
    await platform.refused(t.key, 403, "organization_suspended")
    # Its admin is refused on every door; all at once, as the CLI is slow to start.
    await asyncio.gather(
        _refused_on_the_admin_api(platform, t),
        _refused_on_the_dashboard(platform, t, admin),
        _refused_on_the_cli(platform, t),
    )

    # its dedicated deployment is held at zero replicas, keeping its size for the resume
    dep = await platform.deployment(t.dep_id)
    assert (dep["status"], dep["min_replicas"], dep["max_replicas"]) == ("suspended", 1, 2)
    assert await platform.desired(t.dep_id) == 0

    await DOORS[door].set_suspended(platform, t, False)
    await platform.accepted(t.key, within=WITHIN)
    dep = await platform.deployment(t.dep_id)
    assert (dep["status"], dep["min_replicas"], dep["max_replicas"]) == ("active", 1, 2)
    assert await platform.desired(t.dep_id) == 1
    # and its admin is back at work on both doors
    assert (await admin.get("/keys")).status_code == 200
    assert (await platform.api("GET", f"/organizations/{t.id}/keys", t.admin_key)).status_code == 200


@doors
async def test_exceeding_the_replica_quota_is_refused_with_a_clear_message(
    platform: Platform, door: str
) -> None:
    t = await platform.tenant(f"quota-{door.replace('_', '-')}", plan_id=platform.plan_id, replicas=(1, 1))
    # The service's refusal, word for word: every door must show exactly this.
    with pytest.raises(APIError) as service:
        check_dedicated_quota(
            t.name, Plan(max_dedicated_replicas=QUOTA), QuotaDefaults(), replicas=(1, QUOTA + 1), gpus=(1, 1)
        )
    expected = service.value.message
    assert f"organisation '{t.name}'" in expected and f"quota max_dedicated_replicas is {QUOTA}" in expected

    assert await DOORS[door].exceed_quota(platform, t) == [expected, expected]
    # and nothing changed
    deps = (await platform.api("GET", f"/deployments?org_id={t.id}", platform.root_key)).json()
    assert [(d["name"], d["max_replicas"]) for d in deps] == [(f"{t.name}-dep", 1)]
