"""Dashboard sessions live on the server (issue 16, acceptance 3): a captured session cookie,
replayed from another client, is dead once its owner signs out, once their password changes
(through the admin API or the dashboard), once they are disabled (and stays dead when they
are enabled again), and once it expires. The cookie names nobody and the database holds only
a hash of it. On SQLite and on PostgreSQL."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import httpx
from sqlalchemy import select, update

from control_plane.orgs.models import DashboardSession
from tests.control_plane.conftest import AdminEnv
from tests.dashboard.conftest import PASSWORD, Session, add_user, sign_in
from tokenmill.db import utcnow

LOGIN = "/dashboard/login"
NEW_PASSWORD = "a brand new passphrase"


def captured(s: Session) -> str:
    token = s.client.cookies.get("tm_session")
    assert token
    return token


async def alive(env: AdminEnv, token: str) -> bool:
    """Whether `token`, replayed from a client that never signed in, opens a page."""
    async with httpx.AsyncClient(base_url=str(env.client.base_url), cookies={"tm_session": token}) as c:
        r = await c.get("/dashboard/keys")
    if r.status_code == 303:
        assert r.headers["location"].startswith(LOGIN)
        return False
    assert r.status_code == 200, r.text
    return True


async def rows(env: AdminEnv) -> list[DashboardSession]:
    async with env.app.state.sessionmaker() as db:
        return list((await db.scalars(select(DashboardSession))).all())


async def test_the_cookie_is_an_opaque_token_and_only_its_hash_is_stored(admin_env: AdminEnv) -> None:
    env = admin_env
    ops = await add_user(env, env.default_org, "ops@example.com", "org_admin")
    s = await sign_in(str(env.client.base_url), "ops@example.com")
    token = captured(s)
    assert ops["id"] not in token and "ops" not in token and len(token) >= 40
    assert await alive(env, token)  # the token alone is the session, wherever it comes from
    [row] = await rows(env)
    assert row.user_id == ops["id"] and row.id == hashlib.sha256(token.encode()).hexdigest()
    assert token not in row.id
    # a made-up token, or a hash of a real one, opens nothing
    assert not await alive(env, "x" * 43)
    assert not await alive(env, row.id)
    await s.client.aclose()


async def test_signing_out_ends_a_captured_session_everywhere(admin_env: AdminEnv) -> None:
    env = admin_env
    await add_user(env, env.default_org, "ops@example.com", "org_admin")
    a = await sign_in(str(env.client.base_url), "ops@example.com")
    b = await sign_in(str(env.client.base_url), "ops@example.com")  # another browser
    token = captured(a)
    r = await a.post("/logout")
    assert r.status_code == 303 and r.headers["location"] == LOGIN
    assert "tm_session=" in r.headers["set-cookie"] and "max-age=0" in r.headers["set-cookie"].lower()
    assert not await alive(env, token)  # not only forgotten by this browser: gone
    assert await alive(env, captured(b))  # signing out ends one session, not the others
    assert len(await rows(env)) == 1
    for s in (a, b):
        await s.client.aclose()


async def test_a_password_changed_through_the_admin_api_ends_every_session_of_the_user(
    admin_env: AdminEnv,
) -> None:
    env = admin_env
    ops = await add_user(env, env.default_org, "ops@example.com", "org_admin")
    await add_user(env, env.default_org, "root@example.com", "platform_admin")
    sessions = [await sign_in(str(env.client.base_url), "ops@example.com") for _ in range(2)]
    root = await sign_in(str(env.client.base_url), "root@example.com")
    r = await env.client.patch(
        f"/admin/v1/users/{ops['id']}", headers=env.root, json={"password": NEW_PASSWORD}
    )
    assert r.status_code == 200, r.text
    for s in sessions:
        assert not await alive(env, captured(s))
    assert await alive(env, captured(root))  # someone else's password did not change
    # the new password signs in; the old one no longer does
    again = await sign_in(str(env.client.base_url), "ops@example.com", NEW_PASSWORD)
    assert await alive(env, captured(again))
    for s in (*sessions, root, again):
        await s.client.aclose()


async def test_a_password_changed_in_the_dashboard_ends_the_other_sessions(admin_env: AdminEnv) -> None:
    env = admin_env
    await add_user(env, env.default_org, "ops@example.com", "org_admin")
    here = await sign_in(str(env.client.base_url), "ops@example.com")
    elsewhere = await sign_in(str(env.client.base_url), "ops@example.com")
    old_here, old_elsewhere = captured(here), captured(elsewhere)
    page = await here.get("/account")
    assert page.status_code == 200 and "Change password" in page.text
    # refused without the current password, or with two different new ones: nothing ends
    for data in (
        {"current_password": "wrong", "password": NEW_PASSWORD, "again": NEW_PASSWORD},
        {"current_password": PASSWORD, "password": NEW_PASSWORD, "again": NEW_PASSWORD + "!"},
        {"current_password": PASSWORD, "password": "short", "again": "short"},
    ):
        r = await here.post("/account/password", data=data, follow_redirects=True)
        assert r.status_code == 200 and 'class="flash error"' in r.text, data
        assert await alive(env, old_elsewhere) and await alive(env, old_here)
    r = await here.post(
        "/account/password",
        data={"current_password": PASSWORD, "password": NEW_PASSWORD, "again": NEW_PASSWORD},
    )
    assert r.status_code == 303
    # every session that existed is over, this browser's old token included...
    assert not await alive(env, old_elsewhere) and not await alive(env, old_here)
    # ...but this browser carries on in a new one
    assert captured(here) != old_here and await alive(env, captured(here))
    r = await here.get("/account")
    assert r.status_code == 200 and "Password changed" in r.text
    assert (await elsewhere.get("/keys")).status_code == 303
    for s in (here, elsewhere):
        await s.client.aclose()


async def test_disabling_ends_the_sessions_and_enabling_does_not_revive_them(admin_env: AdminEnv) -> None:
    env = admin_env
    ops = await add_user(env, env.default_org, "ops@example.com", "org_admin")
    dev = await add_user(env, env.default_org, "dev@example.com", "org_admin")
    await add_user(env, env.default_org, "root@example.com", "platform_admin")
    root = await sign_in(str(env.client.base_url), "root@example.com")
    ops_s = await sign_in(str(env.client.base_url), "ops@example.com")
    dev_s = await sign_in(str(env.client.base_url), "dev@example.com")
    # through the admin API
    user_url = f"/admin/v1/users/{ops['id']}"
    assert (await env.client.patch(user_url, headers=env.root, json={"disabled": True})).status_code == 200
    assert not await alive(env, captured(ops_s))
    assert (await env.client.patch(user_url, headers=env.root, json={"disabled": False})).status_code == 200
    assert not await alive(env, captured(ops_s))
    # through the dashboard
    r = await root.post(f"/users/{dev['id']}", data={"disabled": "true"})
    assert r.status_code == 303
    assert not await alive(env, captured(dev_s))
    await root.post(f"/users/{dev['id']}", data={"disabled": "false"})
    assert not await alive(env, captured(dev_s))
    assert await alive(env, captured(root))
    for s in (root, ops_s, dev_s):
        await s.client.aclose()


async def test_a_demoted_user_is_signed_out_for_good(admin_env: AdminEnv) -> None:
    env = admin_env
    ops = await add_user(env, env.default_org, "ops@example.com", "org_admin")
    s = await sign_in(str(env.client.base_url), "ops@example.com")
    token = captured(s)
    user_url = f"/admin/v1/users/{ops['id']}"
    await env.client.patch(user_url, headers=env.root, json={"role": "member"})
    r = await s.get("/keys")
    assert r.status_code == 403 and "members use API keys" in r.text
    await env.client.patch(user_url, headers=env.root, json={"role": "org_admin"})
    assert not await alive(env, token)  # made an admin again: a new sign-in, not the old cookie
    await s.client.aclose()


async def test_an_expired_session_is_refused_and_cleared_at_a_later_sign_in(admin_env: AdminEnv) -> None:
    env = admin_env
    await add_user(env, env.default_org, "ops@example.com", "org_admin")
    await add_user(env, env.default_org, "dev@example.com", "org_admin")
    s = await sign_in(str(env.client.base_url), "ops@example.com")
    token = captured(s)
    async with env.app.state.sessionmaker() as db, db.begin():
        await db.execute(update(DashboardSession).values(expires_at=utcnow() - timedelta(seconds=1)))
    assert not await alive(env, token)
    r = await s.get("/keys")
    assert r.status_code == 303 and "max-age=0" in r.headers["set-cookie"].lower()  # the browser forgets it
    assert len(await rows(env)) == 1  # refused, and still there...
    other = await sign_in(str(env.client.base_url), "dev@example.com")
    [row] = await rows(env)  # ...until the next sign-in clears what has expired
    assert row.id == hashlib.sha256(captured(other).encode()).hexdigest()
    for c in (s, other):
        await c.client.aclose()
