"""The whole app (gateway, admin API, dashboard) on a migrated database of either kind,
served on the test's loop, and browsers-without-a-browser: httpx clients signed in to the
dashboard the way a browser is (the login form, its CSRF token, the session cookie)."""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.control_plane.conftest import AdminEnv, make_admin_env

PASSWORD = "correct horse battery staple"
_CSRF = re.compile(r'name="_csrf_token" value="([^"]+)"')


def csrf_of(html: str) -> str:
    found = _CSRF.search(html)
    assert found, "no CSRF token in the page"
    return found.group(1)


@dataclass
class Session:
    """An httpx client signed in to the dashboard as one user."""

    client: httpx.AsyncClient
    email: str
    token: str = ""

    async def get(self, path: str, **kwargs: Any) -> httpx.Response:
        r = await self.client.get("/dashboard" + path, **kwargs)
        if "_csrf_token" in r.text:
            self.token = csrf_of(r.text)
        return r

    async def post(self, path: str, data: dict[str, Any] | None = None, **kwargs: Any) -> httpx.Response:
        if not self.token:
            await self.get("/")
        return await self.client.post(
            "/dashboard" + path, data={**(data or {}), "_csrf_token": self.token}, **kwargs
        )


async def sign_in(base_url: str, email: str, password: str = PASSWORD) -> Session:
    client = httpx.AsyncClient(base_url=base_url, timeout=60)
    r = await client.get("/dashboard/login")
    assert r.status_code == 200, r.text
    r = await client.post(
        "/dashboard/login", data={"email": email, "password": password, "_csrf_token": csrf_of(r.text)}
    )
    assert r.status_code == 303, r.text
    return Session(client, email)


async def add_user(env: AdminEnv, org_id: str, email: str, role: str) -> dict[str, Any]:
    r = await env.client.post(
        f"/admin/v1/organizations/{org_id}/users",
        headers=env.root,
        json={"email": email, "password": PASSWORD, "role": role},
    )
    assert r.status_code == 201, r.text
    return dict(r.json())


@pytest.fixture
async def env(tmp_path: Path, model_cache: Path, sqlite_url: str) -> AsyncIterator[AdminEnv]:
    """On SQLite (the embedded database)."""
    async with make_admin_env(tmp_path, model_cache, sqlite_url) as admin_env:
        yield admin_env


@pytest.fixture
async def admin_env(tmp_path: Path, model_cache: Path, db_url: str) -> AsyncIterator[AdminEnv]:
    """On SQLite and on PostgreSQL."""
    async with make_admin_env(tmp_path, model_cache, db_url) as admin_env:
        yield admin_env


@pytest.fixture
def chromium() -> str:
    """Debian's Chromium, which `make test` installs (never Playwright's own download)."""
    from tests.dashboard.browser import CHROMIUM

    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: `make test` installs Debian's (apt-get install chromium)")
    return CHROMIUM


@pytest.fixture(scope="session", autouse=True)
def fresh_artifacts() -> None:
    """Screenshots and downloads of this run only: the folder is emptied once, before the
    first dashboard test, and every browser test adds its own (a module emptying it would
    delete the pages of the modules before it)."""
    from tests.dashboard.browser import ARTIFACTS

    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
