"""Keyset pagination and search of every list (control_plane/paging.py), through the services
the dashboard and the admin API call, on SQLite and PostgreSQL: walking the pages forward and
back reads every row exactly once, also when rows share their timestamp or name; a search
finds what it should and treats `%` and `_` as themselves; an organisation admin's pages and
searches never hold another organisation's rows, nor page from another's cursor."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from billing.invoices.services import list_invoices
from billing.models import Invoice
from control_plane.audit.models import AuditEntry
from control_plane.audit.services import AuditQuery, AuditService
from control_plane.catalog.models import Adapter, Deployment, Model
from control_plane.orgs.models import ApiKey, Organization
from control_plane.paging import Page, PageQuery
from control_plane.policy import Principal
from control_plane.unit import UnitOfWork
from tests.control_plane.conftest import AdminEnv
from tokenmill.errors import APIError

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
ROOT = Principal(role="platform_admin", org_id=None)

Lister = Callable[[UnitOfWork, PageQuery], Awaitable[Page[Any]]]


async def _seed(env: AdminEnv) -> dict[str, Any]:
    """Two organisations, alpha and bravo, with 23 keys, 7 adapters, 7 deployments, 6
    invoices and 40 audit entries each; timestamps come in runs of 4 equal ones and names
    repeat across organisations, so only the id tells rows apart."""
    sm = env.app.state.sessionmaker
    async with sm() as s, s.begin():
        model_id = (await s.scalars(select(Model.id))).first()
        orgs = {}
        for n, name in enumerate(("alpha", "bravo")):
            org = Organization(name=f"{name} corp", created_at=T0)
            s.add(org)
            await s.flush()
            orgs[name] = org.id
            for i in range(23):
                s.add(
                    ApiKey(
                        org_id=org.id,
                        name=f"{name}-key-{i % 5}",  # names repeat too
                        prefix=f"tm-{name[0]}{i:03d}_x",
                        hash="h",
                        created_at=T0 + timedelta(seconds=i // 4),
                    )
                )
            for i in range(7):
                s.add(Adapter(org_id=org.id, model_id=model_id, name=f"lora-{i:02d}", source="s3://x"))
                # the same names in both organisations: a platform admin's list has ties
                s.add(Deployment(name=f"dep-{i:02d}", model_id=model_id, org_id=org.id, type="dedicated"))
            s.add(Deployment(name=f"{name}-only", model_id=model_id, org_id=org.id, type="dedicated"))
            for month in range(6):
                start = datetime(2025, 1 + month // 2, 1, tzinfo=UTC)
                s.add(
                    Invoice(
                        org_id=org.id,
                        period_start=start,
                        period_end=start + timedelta(days=28),
                        currency="usd" if month % 2 == 0 else "eur",
                        status="finalized" if month == 0 else "draft",
                        number=101 + n if month == 0 else None,
                    )
                )
            for i in range(40):
                s.add(
                    AuditEntry(
                        at=T0 + timedelta(seconds=i // 4),
                        org_id=org.id,
                        action="update" if i % 3 else "create",
                        resource_type="api_key",
                        resource_id=f"key_{name}_{i:03d}",
                    )
                )
    return orgs


def _admin_of(org_id: str) -> Principal:
    return Principal(role="org_admin", org_id=org_id)


async def _walk(env: AdminEnv, lister: Lister, limit: int, **query: Any) -> tuple[list[str], list[str]]:
    """Every id, page by page forward, then backward from the last page."""
    sm = env.app.state.sessionmaker
    forward: list[list[str]] = []
    after = None
    while True:
        async with sm() as s:
            page = await lister(
                UnitOfWork(s, catalog=env.app.state.catalog), PageQuery(limit=limit, after=after, **query)
            )
        assert len(page.rows) <= limit
        forward.append([str(r.id) for r in page.rows])
        if page.next_after is None:
            break
        assert page.next_after == forward[-1][-1]
        after = page.next_after
    backward: list[list[str]] = [forward[-1]]
    before = forward[-1][0] if forward[-1] and len(forward) > 1 else None
    while before is not None:
        async with sm() as s:
            page = await lister(
                UnitOfWork(s, catalog=env.app.state.catalog), PageQuery(limit=limit, before=before, **query)
            )
        backward.insert(0, [str(r.id) for r in page.rows])
        before = page.prev_before
    return [i for p in forward for i in p], [i for p in backward for i in p]


async def _all(env: AdminEnv, lister: Lister, **query: Any) -> list[Any]:
    async with env.app.state.sessionmaker() as s:
        return (
            await lister(UnitOfWork(s, catalog=env.app.state.catalog), PageQuery(limit=None, **query))
        ).rows


def _listers(orgs: dict[str, str], actor: Principal = ROOT) -> dict[str, Lister]:
    alpha = orgs["alpha"]

    async def audit(u: UnitOfWork, q: PageQuery) -> Page[Any]:
        return await AuditService(u.session).page(AuditQuery(org_id=alpha), actor, q)

    async def invoices(u: UnitOfWork, q: PageQuery) -> Page[Any]:
        return await list_invoices(
            u.session, org_id=None if actor.is_platform_admin else actor.org_id, page=q
        )

    return {
        "organisations": lambda u, q: u.orgs.page_visible(actor, q),
        "keys": lambda u, q: u.keys.page_for_org(alpha, q),
        "adapters": lambda u, q: u.adapters.page_for_org(alpha, q),
        "deployments": lambda u, q: u.deployments.page_visible(actor, q),
        "invoices": invoices,
        "audit": audit,
    }


def _sort_key(name: str, row: Any) -> tuple[Any, ...]:
    """The order each list promises, written out independently of the service."""
    return {
        "organisations": lambda r: (r.created_at, r.id),
        "keys": lambda r: (r.created_at, r.id),
        "adapters": lambda r: (r.name, r.id),
        "deployments": lambda r: (r.name, r.id),
        "invoices": lambda r: (-r.period_start.timestamp(), r.org_id, r.currency, r.id),
        "audit": lambda r: (-r.id,),
    }[name](row)


@pytest.mark.parametrize("limit", [1, 3, 50])
async def test_pages_hold_every_row_once_in_order(admin_env: AdminEnv, limit: int) -> None:
    orgs = await _seed(admin_env)
    for name, lister in _listers(orgs).items():
        rows = await _all(admin_env, lister)
        expected = [str(r.id) for r in sorted(rows, key=lambda r, n=name: _sort_key(n, r))]
        assert [str(r.id) for r in rows] == expected, name  # the unpaged list is in that order
        assert len(expected) == len(set(expected)) >= 3, name
        forward, backward = await _walk(admin_env, lister, limit)
        assert forward == expected, name  # no duplicate, no gap, in order
        assert backward == expected, name  # and the same walking back from the end
        # descending: the mirror image, page by page
        down, _ = await _walk(admin_env, lister, limit, order="desc")
        if name in ("keys", "organisations", "adapters", "deployments"):
            assert down == expected[::-1], name


async def test_a_row_added_between_pages_shifts_nothing(admin_env: AdminEnv) -> None:
    orgs = await _seed(admin_env)
    sm = admin_env.app.state.sessionmaker
    async with sm() as s:
        first = await UnitOfWork(s).keys.page_for_org(orgs["alpha"], PageQuery(limit=10, order="desc"))
    async with sm() as s, s.begin():  # a new key: newest, so before the first page
        s.add(ApiKey(org_id=orgs["alpha"], name="late", prefix="tm-late000_x", hash="h"))
    async with sm() as s:
        second = await UnitOfWork(s).keys.page_for_org(
            orgs["alpha"], PageQuery(limit=10, order="desc", after=first.next_after)
        )
    seen = [k.id for k in first.rows + second.rows]
    assert len(set(seen)) == 20 and "late" not in {k.name for k in second.rows}


async def test_search_is_a_case_insensitive_substring_with_literal_wildcards(admin_env: AdminEnv) -> None:
    orgs = await _seed(admin_env)
    lists = _listers(orgs)

    async def names(name: str, q: str) -> set[str]:
        return {r.name for r in await _all(admin_env, lists[name], q=q)}

    assert await names("organisations", "ALPHA") == {"alpha corp"}
    assert await names("organisations", "corp") == {"alpha corp", "bravo corp"}
    assert await names("keys", "KEY-3") == {"alpha-key-3"}
    prefixes = {k.prefix for k in await _all(admin_env, lists["keys"], q="A007")}
    assert prefixes == {"tm-a007_x"}  # by prefix
    assert await names("adapters", "lora-0") == {f"lora-{i:02d}" for i in range(7)}
    assert await names("adapters", "%") == set()  # a wildcard is a character like any other
    assert await names("keys", "a_ke") == set()  # "_" too (it would match "a-ke" as a wildcard)
    assert await names("deployments", "VO-ON") == {"bravo-only"}
    assert len(await _all(admin_env, lists["deployments"], q="dep-03")) == 2  # alpha's and bravo's
    # deployments by their base model's name; the bootstrap model is SmolLM2-135M-Instruct
    assert len(await _all(admin_env, lists["deployments"], q="smollm2")) == len(
        await _all(admin_env, lists["deployments"])
    )
    # invoices: by number (as printed, or its digits), id, organisation name or id
    assert {i.number for i in await _all(admin_env, lists["invoices"], q="tm-000101")} == {101}
    by_digits = await _all(admin_env, lists["invoices"], q="102")
    assert 102 in {i.number for i in by_digits}
    # the same digits may stand in a random hex id too (about one run in ten): the only other hits
    assert all(i.number == 102 or "102" in i.id or "102" in i.org_id for i in by_digits)
    assert {i.org_id for i in await _all(admin_env, lists["invoices"], q="BRAVO")} == {orgs["bravo"]}
    one = (await _all(admin_env, lists["invoices"]))[3]
    assert [i.id for i in await _all(admin_env, lists["invoices"], q=one.id.upper())] == [one.id]
    # audit: action, resource id
    found = await _all(admin_env, lists["audit"], q="KEY_ALPHA_03")
    assert sorted(e.resource_id for e in found) == [f"key_alpha_{i:03d}" for i in range(30, 40)]
    assert {e.action for e in await _all(admin_env, lists["audit"], q="creat")} == {"create"}
    # a search pages like the whole list
    forward, backward = await _walk(admin_env, lists["keys"], 2, q="alpha-key-1")
    assert len(forward) == 5 and forward == backward


async def test_an_organisation_admin_pages_and_searches_their_own_only(admin_env: AdminEnv) -> None:
    orgs = await _seed(admin_env)
    alpha, bravo = orgs["alpha"], orgs["bravo"]
    lists = _listers(orgs, _admin_of(alpha))
    assert [o.id for o in await _all(admin_env, lists["organisations"])] == [alpha]
    assert await _all(admin_env, lists["organisations"], q="bravo") == []
    deps = await _all(admin_env, lists["deployments"])
    assert bravo not in {d.org_id for d in deps} and alpha in {d.org_id for d in deps}
    assert await _all(admin_env, lists["deployments"], q="bravo") == []
    assert {i.org_id for i in await _all(admin_env, lists["invoices"])} == {alpha}
    assert await _all(admin_env, lists["invoices"], q="bravo") == []
    # bravo's number: none of bravo's; alpha's own rows only where a random hex id holds the
    # digits (about one run in ten, as in the search test above)
    hits = await _all(admin_env, lists["invoices"], q="102")
    assert all(i.org_id == alpha and ("102" in i.id or "102" in i.org_id) for i in hits)
    assert {e.org_id for e in await _all(admin_env, lists["audit"])} == {alpha}
    assert await _all(admin_env, lists["audit"], q="key_bravo") == []
    # A cursor naming another organisation's row is "not found", wherever it would fall.
    sm = admin_env.app.state.sessionmaker
    async with sm() as s:
        bravo_key = (await s.scalars(select(ApiKey.id).where(ApiKey.org_id == bravo))).first()
        bravo_inv = (await s.scalars(select(Invoice.id).where(Invoice.org_id == bravo))).first()
        u = UnitOfWork(s)
        for call in (
            lambda: u.keys.page_for_org(alpha, PageQuery(after=bravo_key)),
            lambda: u.orgs.page_visible(_admin_of(alpha), PageQuery(before=bravo)),
            lambda: list_invoices(s, org_id=alpha, page=PageQuery(after=bravo_inv)),
        ):
            with pytest.raises(APIError) as err:
                await call()
            assert err.value.status == 400 and "No row" in err.value.message
        # naming bravo in the audit log is a 404, as on the admin API
        with pytest.raises(APIError) as err:
            await AuditService(s).page(AuditQuery(org_id=bravo), _admin_of(alpha), PageQuery())
        assert err.value.status == 404


async def test_bad_pages_are_400s_naming_the_parameter(admin_env: AdminEnv) -> None:
    for kwargs, param in (
        ({"limit": 0}, "limit"),
        ({"after": "a", "before": "b"}, "before"),
        ({"q": "x" * 201}, "q"),
        ({"order": "sideways"}, "order"),
    ):
        with pytest.raises(APIError) as err:
            PageQuery(**kwargs)
        assert (err.value.status, err.value.param) == (400, param)
    async with admin_env.app.state.sessionmaker() as s:
        with pytest.raises(APIError) as err:
            await AuditService(s).page(AuditQuery(), ROOT, PageQuery(after="not-a-number"))
        assert (err.value.status, err.value.param) == (400, "after")
