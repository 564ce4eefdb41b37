"""Refused requests and keys' last use (gateway/accounting.py): each refusal's reason, counts
per organisation, key, reason and minute kept in memory and added to `refusals` by flushes,
the gateway's metrics, and `last_used_at` written in batches, never moving back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from litestar import Litestar, Response, post
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.models import Refusal
from control_plane.orgs.models import ApiKey
from control_plane.plans.limits import Rate
from gateway.accounting import Accounting, reason_of
from gateway.admission import _refusal
from gateway.keys import KeyCache
from gateway.metrics import REASONS, GatewayMetrics
from tests.gateway.conftest import Env, serve
from tests.gateway.test_admission import new_key
from tests.gateway.test_api import HELLO, MODEL
from tokenmill.errors import APIError
from tokenmill.limits import Admission, Decision, Limit, Slot
from tokenmill.openai_shapes import model_not_found
from tokenmill.security import key_prefix

# --- reasons ----------------------------------------------------------------------------------


def _decision(allowed: bool) -> Decision:
    return Decision(allowed, 10, 0 if not allowed else 5, 1.0, 0.0 if allowed else 2.0)


def _limit(key: str) -> tuple[Limit, Rate, str]:
    return Limit(key, 60), Rate(60, 10), "key"


def test_each_refusal_of_admission_has_its_own_reason() -> None:
    """Every 429 of the limits says `rate_limit_exceeded`: the reason tells them apart."""
    requests, tokens, slot = [_limit("rpm")], [_limit("tpm")], [Slot("conc", 4)]
    refused = {
        "rate_limit_requests": _refusal(Admission(False, [_decision(False)], []), requests, [], [], {}),
        "rate_limit_tokens": _refusal(Admission(False, [_decision(False)], []), [], tokens, [], {}),
        "concurrency": _refusal(Admission(False, [_decision(True)], [False]), [], tokens, slot, {}),
        "budget": _refusal(Admission(False, [], [], budget_ok=False), [], [], [], {}),
    }
    for reason, exc in refused.items():
        assert exc.status == 429 and exc.code in ("rate_limit_exceeded", "insufficient_quota")
        assert reason_of(429, exc) == reason


def test_reasons_of_other_refusals() -> None:
    cases: list[tuple[int, BaseException | None, str]] = [
        (401, APIError(401, "Incorrect API key provided.", code="invalid_api_key"), "auth"),
        (429, APIError(429, "Too many.", code="too_many_authentication_failures"), "auth"),
        (401, None, "auth"),
        (403, APIError(403, "suspended", code="organization_suspended"), "permission"),
        (403, APIError(403, "no", code="insufficient_permissions"), "permission"),
        (404, model_not_found("nope"), "not_found"),
        (404, APIError(404, "No such File object", code="not_found"), "not_found"),
        (404, NotFoundException(), "not_found"),  # a path no route serves
        (400, APIError(400, "too long", code="context_length_exceeded"), "context_length"),
        (400, APIError(400, "too big", code="request_too_large"), "too_large"),
        (413, APIError(413, "too big", code="file_too_large"), "too_large"),
        (413, HTTPException(status_code=413), "too_large"),
        (400, APIError(400, "too many", code="too_many_lines"), "too_large"),
        (400, ValidationException("bad"), "validation"),
        (400, APIError(400, "Invalid value for 'n'", param="n"), "validation"),
        (405, HTTPException(status_code=405), "validation"),
        (415, None, "validation"),
        (409, APIError(409, "not running", code="batch_not_running"), "validation"),
    ]
    for status, exc, reason in cases:
        assert reason_of(status, exc) == reason, (status, exc)
        assert reason in REASONS


# --- counting and flushing --------------------------------------------------------------------


class _Keys:
    """What the accounting reads of the key cache."""

    def __init__(self) -> None:
        self.used: dict[str, float] = {}

    def take_used(self) -> dict[str, float]:
        used, self.used = self.used, {}
        return used


def _scope(caller: Any = None, exc: BaseException | None = None, path: str = "/v1/chat/completions") -> Any:
    state: dict[str, Any] = {"refused_by": exc}
    if caller is not None:
        state["caller"] = caller
    return {"state": state, "path_template": path}


class _Caller:
    def __init__(self, org_id: str, key_id: str) -> None:
        self.org_id, self.key_id = org_id, key_id


async def _rows(sm: async_sessionmaker[AsyncSession]) -> list[tuple[str, str, str, datetime, int]]:
    async with sm() as s:
        found = await s.execute(
            select(
                Refusal.org_id, Refusal.api_key_id, Refusal.reason, Refusal.minute, Refusal.count
            ).order_by(Refusal.org_id, Refusal.api_key_id, Refusal.reason, Refusal.minute)
        )
        return [tuple(r) for r in found]  # type: ignore[misc]


@pytest.fixture
def frozen_minute(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The accounting's clock, set by the test: [epoch seconds]."""
    now = [datetime(2026, 3, 4, 5, 6, 30, tzinfo=UTC).timestamp()]
    monkeypatch.setattr("gateway.accounting.time.time", lambda: now[0])
    yield now


async def test_flushes_add_per_minute(
    migrated_db: async_sessionmaker[AsyncSession], frozen_minute: list[float]
) -> None:
    metrics = GatewayMetrics.create()
    acc = Accounting(migrated_db, metrics, cast(KeyCache, _Keys()))
    a, b = _Caller("org_a", "key_a"), _Caller("org_b", "key_b")
    limited = APIError(
        429, "slow down", code="rate_limit_exceeded", type="requests", reason="rate_limit_requests"
    )
    for _ in range(1000):
        acc.refused(429, _scope(a, limited))
    acc.refused(404, _scope(b, model_not_found("x")))
    acc.refused(401, _scope(None, APIError(401, "who?", code="invalid_api_key")))  # no caller: no row
    acc.refused(499, _scope(a))  # the client left: counted as cancelled by the gateway, not here
    served = APIError(400, "the worker says no")
    served.metered = True
    acc.refused(400, _scope(a, served))  # a worker ran it: metered, not a refusal
    await acc.flush_refusals()
    minute = datetime(2026, 3, 4, 5, 6, tzinfo=UTC)
    assert await _rows(migrated_db) == [
        ("org_a", "key_a", "rate_limit_requests", minute, 1000),
        ("org_b", "key_b", "not_found", minute, 1),
    ]
    # The same minute again, then the next: added to the row, then a row of its own.
    for _ in range(5):
        acc.refused(429, _scope(a, limited))
    await acc.flush_refusals()
    frozen_minute[0] += 60
    acc.refused(429, _scope(a, limited))
    await acc.flush_refusals()
    await acc.flush_refusals()  # nothing new: nothing written
    assert await _rows(migrated_db) == [
        ("org_a", "key_a", "rate_limit_requests", minute, 1005),
        ("org_a", "key_a", "rate_limit_requests", minute + timedelta(minutes=1), 1),
        ("org_b", "key_b", "not_found", minute, 1),
    ]
    value = metrics.registry.get_sample_value
    assert value("tokenmill_gateway_refusals_total", {"reason": "rate_limit_requests"}) == 1006
    assert value("tokenmill_gateway_refusals_total", {"reason": "auth"}) == 1
    assert value("tokenmill_gateway_refusals_total", {"reason": "validation"}) is None
    labels = {"endpoint": "chat", "model": "", "deployment": "", "status_class": "4xx"}
    assert value("tokenmill_gateway_requests_total", labels) == 1008


async def test_counts_survive_a_failed_write(
    migrated_db: async_sessionmaker[AsyncSession], frozen_minute: list[float]
) -> None:
    """While the database cannot be written, counts are kept (and added to) for the next flush."""
    real = migrated_db

    def broken() -> Any:
        raise ConnectionError("database down")

    acc = Accounting(cast(Any, broken), GatewayMetrics.create(), cast(KeyCache, _Keys()))
    a = _Caller("org_a", "key_a")
    acc.refused(403, _scope(a, APIError(403, "no", code="insufficient_permissions")))
    await acc.flush_refusals()
    acc.refused(403, _scope(a, APIError(403, "no", code="insufficient_permissions")))
    acc.sessionmaker = real
    await acc.flush_refusals()
    assert [r[2:] for r in await _rows(real)] == [("permission", datetime(2026, 3, 4, 5, 6, tzinfo=UTC), 2)]


async def test_the_loop_flushes_and_stop_writes_the_rest(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    keys = _Keys()
    async with migrated_db() as s, s.begin():
        from control_plane.orgs.keys import ApiKeyService
        from control_plane.orgs.services import OrganizationService

        org = await OrganizationService(session=s).create_org("acme")
        key_id = (await ApiKeyService(session=s).create_key(org_id=org.id, secret_key="x")).key.id
    acc = Accounting(
        migrated_db, GatewayMetrics.create(), cast(KeyCache, keys), flush_seconds=0.05, last_used_seconds=0.1
    )
    a = _Caller(org.id, key_id)
    await acc.start()
    try:
        acc.refused(429, _scope(a, APIError(429, "", code="insufficient_quota")))
        used = time.time()
        keys.used[key_id] = used
        for _ in range(100):
            await asyncio.sleep(0.05)
            async with migrated_db() as s:
                last = await s.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id))
            if last is not None and await _rows(migrated_db):
                break
        assert last is not None and abs(last.timestamp() - used) < 0.001
        assert [r[2] for r in await _rows(migrated_db)] == ["budget"]
        acc.refused(429, _scope(a, APIError(429, "", code="insufficient_quota")))
        keys.used[key_id] = used + 5
    finally:
        await acc.stop()  # before the next tick: written by stop itself
    assert [r[2::2] for r in await _rows(migrated_db)] == [("budget", 2)]
    async with migrated_db() as s:
        last = await s.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id))
    assert last is not None and abs(last.timestamp() - (used + 5)) < 0.001


# --- through the gateway ------------------------------------------------------------------------


def _metric(env: Env, name: str, labels: dict[str, str]) -> float:
    return env.app.state.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


async def _refusal_rows(env: Env) -> list[tuple[str, str, str, datetime, int]]:
    return await _rows(env.app.state.sessionmaker)


async def test_a_flood_of_429s_is_a_row_per_minute(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    key = await new_key(gateway_env, requests_per_minute=1, request_burst=1)
    async with gateway_env.app.state.sessionmaker() as s:
        found = await s.execute(select(ApiKey.id, ApiKey.org_id).where(ApiKey.prefix == key_prefix(key)))
        key_id, org_id = found.one()
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
    c = gateway_env.client
    first = await c.post("/v1/chat/completions", headers=headers, json=body)
    assert first.status_code == 200, first.text
    statuses = [
        (await c.post("/v1/chat/completions", headers=headers, json=body)).status_code for _ in range(60)
    ]
    assert statuses == [429] * 60
    accounting = gateway_env.app.state.accounting
    await accounting.flush_refusals()
    rows = await _refusal_rows(gateway_env)
    # One row per minute the flood spanned (one, unless it crossed a minute's end), not per request.
    assert 1 <= len(rows) <= 2 and len({r[3] for r in rows}) == len(rows)
    assert {r[:3] for r in rows} == {(org_id, key_id, "rate_limit_requests")}
    assert sum(r[4] for r in rows) == 60
    assert _metric(gateway_env, "tokenmill_gateway_refusals_total", {"reason": "rate_limit_requests"}) == 60
    labels = {"endpoint": "chat", "model": "", "deployment": "", "status_class": "4xx"}
    assert _metric(gateway_env, "tokenmill_gateway_requests_total", labels) == 60

    # The key's last use is written at the next write, once, for all those requests.
    async with gateway_env.app.state.sessionmaker() as s:
        assert await s.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id)) is None
    await accounting.flush_last_used()
    async with gateway_env.app.state.sessionmaker() as s:
        last = await s.scalar(select(ApiKey.last_used_at).where(ApiKey.id == key_id))
    assert last is not None and abs((datetime.now(UTC) - last).total_seconds()) < 60


async def test_unknown_keys_are_in_the_metrics_only(gateway_env: Env) -> None:
    c = gateway_env.client
    for secret in ("tm-madeup-0123456789abcdef0123456789abcdef", "not-even-a-key"):
        r = await c.post("/v1/chat/completions", headers={"authorization": f"Bearer {secret}"}, json={})
        assert r.status_code == 401, r.text
    assert (await c.get("/v1/models")).status_code == 401  # no key at all
    await gateway_env.app.state.accounting.flush_refusals()
    assert await _refusal_rows(gateway_env) == []
    assert _metric(gateway_env, "tokenmill_gateway_refusals_total", {"reason": "auth"}) == 3
    labels = {"endpoint": "models", "model": "", "deployment": "", "status_class": "4xx"}
    assert _metric(gateway_env, "tokenmill_gateway_requests_total", labels) == 1


async def test_refusals_of_a_known_caller_by_reason(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    key = await new_key(gateway_env)
    headers = {"authorization": f"Bearer {key}"}
    c = gateway_env.client
    asks: list[tuple[str, str, dict[str, Any] | None, int]] = [
        ("POST", "/v1/chat/completions", {"model": "no-such-model", "messages": HELLO}, 404),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 9000}, 400),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "not a list"}, 400),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "n": 99}, 400),
        ("GET", "/v1/no/such/path", None, 404),
        ("DELETE", "/v1/chat/completions", None, 405),
    ]
    for method, path, body, status in asks:
        r = await c.request(method, path, headers=headers, json=body)
        assert r.status_code == status, (path, r.text)
    await gateway_env.app.state.accounting.flush_refusals()
    by_reason = {r[2]: r[4] for r in await _refusal_rows(gateway_env)}
    # A path no route serves, and a method it does not, are refused before the key is checked.
    # n over the cap is one of the size caps (`request_too_large`), like a body too large.
    assert by_reason == {"not_found": 1, "context_length": 1, "validation": 1, "too_large": 1}
    for reason, n in {"not_found": 2, "context_length": 1, "validation": 2, "too_large": 1}.items():
        assert _metric(gateway_env, "tokenmill_gateway_refusals_total", {"reason": reason}) == n, reason
    other = {"endpoint": "other", "model": "", "deployment": "", "status_class": "4xx"}
    assert _metric(gateway_env, "tokenmill_gateway_requests_total", other) == 2


async def test_a_workers_400_is_metered_not_refused(gateway_env: Env) -> None:
    """A request the worker found invalid ran through admission and routing and is in the
    ledger with its error: the gateway counts it once, with the answered requests."""

    @post("/generate", status_code=200)
    async def generate() -> Response[Any]:
        return Response({"error": {"message": "bad sampling", "param": "top_k"}}, status_code=400)

    async with serve(Litestar([generate])) as url:
        await gateway_env.announce("picky", url, gateway_env.deployment_id)
        key = await new_key(gateway_env)
        r = await gateway_env.client.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": MODEL, "messages": HELLO, "max_tokens": 1},
        )
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad sampling"
    await gateway_env.app.state.accounting.flush_refusals()
    assert await _refusal_rows(gateway_env) == []
    assert _metric(gateway_env, "tokenmill_gateway_refusals_total", {"reason": "validation"}) == 0
    served = {
        "endpoint": "chat",
        "model": MODEL,
        "deployment": gateway_env.deployment_id,
        "status_class": "4xx",
    }
    unresolved = {"endpoint": "chat", "model": "", "deployment": "", "status_class": "4xx"}
    assert _metric(gateway_env, "tokenmill_gateway_requests_total", served) == 1
    assert _metric(gateway_env, "tokenmill_gateway_requests_total", unresolved) == 0
