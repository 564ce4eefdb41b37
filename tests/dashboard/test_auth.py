"""Signing in and out: the session cookie, CSRF protection, the login rate limit, roles, and
what every page's response carries (security headers, server timing, no caching)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from control_plane.bootstrap import bootstrap
from tests.control_plane.conftest import MODEL, AdminEnv, make_admin_env
from tests.dashboard.conftest import PASSWORD, add_user, csrf_of, sign_in
from tokenmill.settings import BUNDLED_MODEL

LOGIN = "/dashboard/login"


async def _login_form(client: httpx.AsyncClient) -> str:
    r = await client.get(LOGIN)
    assert r.status_code == 200
    return csrf_of(r.text)


async def test_pages_need_a_session_and_send_you_back_after_login(env: AdminEnv) -> None:
    await add_user(env, env.default_org, "root@example.com", "platform_admin")
    async with httpx.AsyncClient(base_url=str(env.client.base_url)) as c:
        r = await c.get("/dashboard/keys?org=" + env.default_org)
        assert r.status_code == 303
        assert r.headers["location"] == f"{LOGIN}?next=/dashboard/keys?org={env.default_org}"
        token = await _login_form(c)
        r = await c.post(
            LOGIN,
            data={
                "email": "ROOT@example.com ",  # addresses compare case-insensitively
                "password": PASSWORD,
                "next": f"/dashboard/keys?org={env.default_org}",
                "_csrf_token": token,
            },
        )
        assert r.status_code == 303 and r.headers["location"] == f"/dashboard/keys?org={env.default_org}"
        cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("tm_session="))
        assert "HttpOnly" in cookie and "samesite=lax" in cookie.lower() and "Path=/dashboard" in cookie
        assert "Secure" not in cookie  # plain http here; an https TOKENMILL_PUBLIC_URL turns it on
        r = await c.get(f"/dashboard/keys?org={env.default_org}")
        assert r.status_code == 200 and "bootstrap admin" in r.text


async def test_login_refuses_wrong_passwords_members_and_other_sites(env: AdminEnv) -> None:
    await add_user(env, env.default_org, "ops@example.com", "org_admin")
    await add_user(env, env.default_org, "dev@example.com", "member")
    async with httpx.AsyncClient(base_url=str(env.client.base_url)) as c:
        token = await _login_form(c)
        r = await c.post(LOGIN, data={"email": "ops@example.com", "password": "wrong", "_csrf_token": token})
        assert r.status_code == 401 and "Incorrect email or password." in r.text
        r = await c.post(LOGIN, data={"email": "nobody@example.com", "password": "x", "_csrf_token": token})
        assert r.status_code == 401 and "Incorrect email or password." in r.text  # same answer
        r = await c.post(LOGIN, data={"email": "dev@example.com", "password": PASSWORD, "_csrf_token": token})
        assert r.status_code == 403 and "members use API keys" in r.text
        assert "tm_session=" not in r.headers.get("set-cookie", "")
        # after login, only ever back into the dashboard
        for target in ("https://evil.example/", "//evil.example/dashboard/", "/admin/v1/keys"):
            r = await c.post(
                LOGIN,
                data={"email": "ops@example.com", "password": PASSWORD, "next": target, "_csrf_token": token},
            )
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/", target


async def test_forms_without_the_csrf_token_are_refused(env: AdminEnv) -> None:
    await add_user(env, env.default_org, "root@example.com", "platform_admin")
    async with httpx.AsyncClient(base_url=str(env.client.base_url)) as c:
        await _login_form(c)
        r = await c.post(LOGIN, data={"email": "root@example.com", "password": PASSWORD})
        assert r.status_code == 403 and "expired" in r.text
    s = await sign_in(str(env.client.base_url), "root@example.com")
    for token in (None, "forged", csrf_of((await s.get("/keys")).text)[:-2] + "xx"):
        data = {"org": env.default_org, "name": "csrf"} | ({"_csrf_token": token} if token else {})
        r = await s.client.post("/dashboard/keys", data=data)
        assert r.status_code == 403, token
    r = await s.client.post("/dashboard/logout")
    assert r.status_code == 403  # not even signing out, so a third-party page cannot do it
    keys = (await env.client.get(f"/admin/v1/organizations/{env.default_org}/keys", headers=env.root)).json()
    assert [k["name"] for k in keys] == ["bootstrap admin"]
    # a script sends the token as a header (the adapter upload does)
    token = csrf_of((await s.get("/keys")).text)
    r = await s.client.post(
        "/dashboard/keys", data={"org": env.default_org, "name": "by-header"}, headers={"x-csrftoken": token}
    )
    assert r.status_code == 303 and r.headers["location"].endswith("/created")  # to the secret's page
    keys = (await env.client.get(f"/admin/v1/organizations/{env.default_org}/keys", headers=env.root)).json()
    assert "by-header" in [k["name"] for k in keys]
    await s.client.aclose()


async def test_login_attempts_are_rate_limited(env: AdminEnv) -> None:
    await add_user(env, env.default_org, "ops@example.com", "org_admin")
    await add_user(env, env.default_org, "other@example.com", "org_admin")
    async with httpx.AsyncClient(base_url=str(env.client.base_url)) as c:
        token = await _login_form(c)
        for _ in range(5):
            r = await c.post(
                LOGIN, data={"email": "ops@example.com", "password": "guess", "_csrf_token": token}
            )
            assert r.status_code == 401
        # the sixth within 5 minutes is refused, even with the right password
        r = await c.post(LOGIN, data={"email": "ops@example.com", "password": PASSWORD, "_csrf_token": token})
        assert r.status_code == 429 and "Too many sign-in attempts" in r.text
        assert 1 <= int(r.headers["retry-after"]) <= 300
        # another account from the same address still may
        r = await c.post(
            LOGIN, data={"email": "other@example.com", "password": PASSWORD, "_csrf_token": token}
        )
        assert r.status_code == 303


async def test_too_many_accounts_from_one_address_are_limited_too(
    tmp_path: Path, model_cache: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENMILL_DASHBOARD_LOGIN_ATTEMPTS_PER_ADDRESS", "3")
    async with (
        make_admin_env(tmp_path, model_cache, sqlite_url) as env,
        httpx.AsyncClient(base_url=str(env.client.base_url)) as c,
    ):
        token = await _login_form(c)
        codes = []
        for i in range(4):
            data = {"email": f"u{i}@example.com", "password": "x", "_csrf_token": token}
            codes.append((await c.post(LOGIN, data=data)).status_code)
        assert codes == [401, 401, 401, 429]


async def test_one_account_is_limited_from_any_number_of_addresses(
    tmp_path: Path, model_cache: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guesses spread over many addresses (each under its own limits) still meet the
    account's limit; other accounts are not affected."""
    monkeypatch.setenv("TOKENMILL_DASHBOARD_LOGIN_ATTEMPTS_PER_ACCOUNT", "4")
    async with make_admin_env(tmp_path, model_cache, sqlite_url) as env:
        await add_user(env, env.default_org, "ops@example.com", "org_admin")
        await add_user(env, env.default_org, "other@example.com", "org_admin")

        async def attempt(source: str, email: str, password: str) -> httpx.Response:
            transport = httpx.AsyncHTTPTransport(local_address=source)
            async with httpx.AsyncClient(base_url=str(env.client.base_url), transport=transport) as c:
                token = await _login_form(c)
                return await c.post(LOGIN, data={"email": email, "password": password, "_csrf_token": token})

        codes = [(await attempt(f"127.0.3.{i}", "ops@example.com", "guess")).status_code for i in range(1, 5)]
        assert codes == [401] * 4
        r = await attempt("127.0.3.9", "ops@example.com", PASSWORD)  # a fresh address, the right password
        assert r.status_code == 429 and "Too many sign-in attempts" in r.text
        assert 1 <= int(r.headers["retry-after"]) <= 300
        assert (await attempt("127.0.3.9", "other@example.com", PASSWORD)).status_code == 303


async def test_sign_out_and_a_disabled_or_demoted_user_is_out_at_once(env: AdminEnv) -> None:
    ops = await add_user(env, env.default_org, "ops@example.com", "org_admin")
    s = await sign_in(str(env.client.base_url), "ops@example.com")
    assert (await s.get("/")).status_code == 200
    # demoted to member: no dashboard from the next page on
    r = await env.client.patch(f"/admin/v1/users/{ops['id']}", headers=env.root, json={"role": "member"})
    assert r.status_code == 200
    r = await s.get("/keys")
    assert r.status_code == 403 and "members use API keys" in r.text
    # back to org admin, then disabled: signed out
    await env.client.patch(f"/admin/v1/users/{ops['id']}", headers=env.root, json={"role": "org_admin"})
    s = await sign_in(str(env.client.base_url), "ops@example.com")
    await env.client.patch(f"/admin/v1/users/{ops['id']}", headers=env.root, json={"disabled": True})
    r = await s.get("/keys")
    assert r.status_code == 303 and r.headers["location"].startswith(LOGIN)
    await env.client.patch(f"/admin/v1/users/{ops['id']}", headers=env.root, json={"disabled": False})
    # signing out ends the session (test_sessions.py: on the server too): the cookie is
    # cleared and the next page asks to sign in
    s = await sign_in(str(env.client.base_url), "ops@example.com")
    r = await s.post("/logout")
    assert r.status_code == 303 and r.headers["location"] == LOGIN
    assert re.search(r'tm_session="";[^\n]*max-age=0', r.headers.get("set-cookie", ""), re.IGNORECASE)
    assert (await s.get("/")).status_code == 303
    await s.client.aclose()


@pytest.fixture
async def short_sessions(
    tmp_path: Path, model_cache: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[AdminEnv]:
    monkeypatch.setenv("TOKENMILL_DASHBOARD_SESSION_HOURS", str(1.5 / 3600))  # 1.5 s
    async with make_admin_env(tmp_path, model_cache, sqlite_url) as env:
        yield env


async def test_sessions_expire(short_sessions: AdminEnv) -> None:
    env = short_sessions
    await add_user(env, env.default_org, "ops@example.com", "org_admin")
    s = await sign_in(str(env.client.base_url), "ops@example.com")
    assert (await s.get("/")).status_code == 200
    await asyncio.sleep(1.6)
    assert (await s.get("/")).status_code == 303
    await s.client.aclose()


async def test_every_answer_carries_security_headers_and_server_time(env: AdminEnv) -> None:
    await add_user(env, env.default_org, "root@example.com", "platform_admin")
    s = await sign_in(str(env.client.base_url), "root@example.com")
    for path in ("/", "/login", "/nope"):
        r = await s.get(path, follow_redirects=True)
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-frame-options"] == "DENY"
        assert re.fullmatch(r"app;dur=\d+\.\d", r.headers["server-timing"])
    page = await s.get("/")
    assert "no-store" in page.headers["cache-control"]
    # every asset is ours, served by the app: no other host is referenced
    assert not re.search(r'(src|href)="(https?:)?//', page.text)
    css = await s.get("/static/dashboard.css")
    assert css.status_code == 200 and "max-age=3600" in css.headers["cache-control"]
    assert (await s.get("/static/dashboard.js")).status_code == 200
    missing = await s.get("/nope")
    assert missing.status_code == 404 and "text/html" in missing.headers["content-type"]
    await s.client.aclose()


async def test_bootstrap_creates_a_dashboard_login_once(env: AdminEnv) -> None:
    args: dict[str, Any] = {
        "secret_key": env.settings.secret_key or "",
        "model_name": MODEL,
        "model_source": BUNDLED_MODEL,
        "model_format": "gguf",
        "context_length": 8192,
        "dashboard_admin": "admin@tokenmill.local",
    }
    first = await bootstrap(env.app.state.sessionmaker, **args)
    assert first.admin_login is not None
    email, password = first.admin_login
    assert email == "admin@tokenmill.local" and len(password) >= 20
    assert (await bootstrap(env.app.state.sessionmaker, **args)).admin_login is None  # once
    s = await sign_in(str(env.client.base_url), email, password)
    page = await s.get("/orgs")
    assert page.status_code == 200 and "platform admin" in page.text
    # only a hash is kept, and the creation is in the audit log (without it)
    users = (
        await env.client.get(f"/admin/v1/organizations/{env.default_org}/users", headers=env.root)
    ).json()
    assert [u["email"] for u in users] == [email]
    audit = (
        await env.client.get("/admin/v1/audit", headers=env.root, params={"resource_type": "user"})
    ).json()
    assert audit["data"] and password not in str(audit)
    await s.client.aclose()
