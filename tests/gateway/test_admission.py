"""Admission on the request path: rate-limit headers and refusals, concurrency, budgets,
key revocation through the cache, key scopes and expiry, adapters. In-memory limiter and
fake workers here; tests/e2e/test_gateway_replicas.py runs the same over Redis across
processes."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from decimal import Decimal

import openai
import pytest
from litestar import Litestar, Response, post
from sqlalchemy import select, update

from billing.models import Price
from control_plane.catalog.models import Adapter
from control_plane.orgs.keys import ApiKeyService
from control_plane.orgs.models import ApiKey, Organization
from control_plane.orgs.services import OrganizationService
from control_plane.plans.models import Plan
from gateway.admission import _duration, units
from tests.gateway.conftest import Env, serve
from tests.gateway.test_api import HELLO, MODEL, ledger, sdk
from tokenmill.db import utcnow
from tokenmill.hashing import extra_keys, hash_blocks


async def new_key(env: Env, org_name: str = "acme", plan: Plan | None = None, **key_fields: object) -> str:
    """A fresh organisation (optionally on `plan`) and a member key with `key_fields` set."""
    async with env.app.state.sessionmaker() as s, s.begin():
        org = await OrganizationService(session=s).get_one_or_none(name=org_name)
        if org is None:
            org = await OrganizationService(session=s).create_org(org_name)
        if plan is not None:
            s.add(plan)
            await s.flush()
            org.plan_id = plan.id
        created = await ApiKeyService(session=s).create_key(org_id=org.id, secret_key="test-secret")
        if key_fields:
            await s.execute(update(ApiKey).where(ApiKey.id == created.key.id).values(**key_fields))
    return created.secret


async def chat(env: Env, key: str, **kw: object) -> openai.types.chat.ChatCompletion:
    params = {"model": MODEL, "messages": HELLO, "max_tokens": 2, **kw}
    return await sdk(env, key).chat.completions.create(**params)  # type: ignore[arg-type]


def test_reset_durations_read_like_openai() -> None:
    assert [_duration(s) for s in (0.0201, 1.5, 6.0, 360.0, 61.2)] == ["21ms", "1.5s", "6s", "6m0s", "1m1s"]


async def test_every_response_carries_ratelimit_headers(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    # The first request of a model loads its tokenizer after being counted: done here, so the
    # two counted below are not further apart than the 0.6 s in which one request refills.
    await chat(gateway_env, await new_key(gateway_env, "warm-up"))
    key = await new_key(gateway_env, requests_per_minute=100, tokens_per_minute=50_000)
    raw = await sdk(gateway_env, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=2
    )
    h = raw.headers
    assert h["x-ratelimit-limit-requests"] == "100" and h["x-ratelimit-remaining-requests"] == "99"
    assert h["x-ratelimit-limit-tokens"] == "50000"
    prompt = raw.parse().usage.prompt_tokens
    # charged prompt + max_tokens up front
    assert int(h["x-ratelimit-remaining-tokens"]) == 50_000 - prompt - 2
    assert h["x-ratelimit-reset-requests"].endswith("ms") or h["x-ratelimit-reset-requests"].endswith("s")
    second = await sdk(gateway_env, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=2
    )
    assert second.headers["x-ratelimit-remaining-requests"] == "98"


async def test_org_default_tier_applies_without_a_plan(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    raw = await sdk(gateway_env).chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=1
    )
    assert raw.headers["x-ratelimit-limit-requests"] == "600"
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000000"


async def test_requests_per_minute_refuse_with_retry_after(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    await chat(gateway_env, await new_key(gateway_env, "warm-up"))  # the tokenizer loads once, here
    w.received.clear()
    key = await new_key(gateway_env, requests_per_minute=60, request_burst=3)
    for _ in range(3):
        await chat(gateway_env, key)
    with pytest.raises(openai.RateLimitError) as err:
        await chat(gateway_env, key)
    r = err.value.response
    assert err.value.body["code"] == "rate_limit_exceeded" and err.value.body["type"] == "requests"
    assert r.headers["retry-after"] == "1"  # one request a second refills
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-request-id"].startswith("req_")
    assert len(w.received) == 3  # the refused request never reached a worker
    assert len(await ledger(gateway_env, 4)) == 4  # and is not metered (the warm-up is)


async def test_tokens_are_refunded_after_the_request(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    key = await new_key(gateway_env, tokens_per_minute=6000, token_burst=2000)
    first = await sdk(gateway_env, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=1000
    )
    used = first.parse().usage.total_tokens  # the fake worker stops after 8 tokens
    assert int(first.headers["x-ratelimit-remaining-tokens"]) <= 2000 - used - (1000 - 8)
    second = await sdk(gateway_env, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=1
    )
    # the unused ~992 tokens came back (plus a little refill), so only `used` is gone, not 1000+
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert 2000 - used - second.parse().usage.total_tokens <= remaining <= 2000


async def test_request_larger_than_token_burst_is_400(gateway_env: Env) -> None:
    key = await new_key(gateway_env, tokens_per_minute=500)
    with pytest.raises(openai.BadRequestError) as err:
        await chat(gateway_env, key, max_tokens=600)
    assert err.value.body["code"] == "request_too_large" and err.value.body["param"] == "max_tokens"


async def test_concurrency_limit(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    w.delay = 0.1
    key = await new_key(gateway_env, max_concurrent=1)
    slow = asyncio.create_task(chat(gateway_env, key, max_tokens=5))
    for _ in range(500):  # until the slow request holds the slot
        if w.received:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as err:
        await chat(gateway_env, key)
    assert "concurrent" in err.value.body["message"]
    await slow
    await chat(gateway_env, key)  # the slot came back


async def test_hard_budget_refuses_what_would_overshoot(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    async with gateway_env.app.state.sessionmaker() as s, s.begin():
        gw = gateway_env.app.state.gateway
        caller = await gw.authenticate(f"Bearer {gateway_env.admin_key}")
        target = await gw.catalog.resolve(caller, MODEL)
        s.add(Price(model_id=target.model_id, input_per_mtok=Decimal(1000), output_per_mtok=Decimal(2000)))
    plan = Plan(name="tiny", monthly_budget=Decimal("0.5"), budget_mode="hard")
    key = await new_key(gateway_env, plan=plan)
    ok = 0
    with pytest.raises(openai.RateLimitError) as err:
        for _ in range(100):
            await chat(gateway_env, key, max_tokens=8)
            ok += 1
    assert err.value.body["code"] == "insufficient_quota"
    rows = await ledger(gateway_env, ok)
    spent = sum(Decimal(r.prompt_tokens) * 1000 + Decimal(r.completion_tokens) * 2000 for r in rows) / 10**6
    assert ok > 0 and spent <= Decimal("0.5")
    # the refused request would have overshot: one more worst case does not fit
    worst = (Decimal(rows[0].prompt_tokens) * 1000 + 8 * 2000) / 10**6
    assert spent + worst > Decimal("0.5")


async def test_budget_counter_is_seeded_from_the_ledger(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    gw = gateway_env.app.state.gateway
    caller = await gw.authenticate(f"Bearer {gateway_env.admin_key}")
    target = await gw.catalog.resolve(caller, MODEL)
    async with gateway_env.app.state.sessionmaker() as s, s.begin():
        s.add(Price(model_id=target.model_id, input_per_mtok=Decimal(100), output_per_mtok=Decimal(100)))
    for _ in range(2):  # traffic before the organisation had a budget
        await chat(gateway_env, gateway_env.admin_key)
    rows = await ledger(gateway_env, 2)
    before = sum(Decimal(r.prompt_tokens + r.completion_tokens) * 100 for r in rows) / 10**6
    async with gateway_env.app.state.sessionmaker() as s, s.begin():
        plan = Plan(name="capped", monthly_budget=Decimal(10), budget_mode="soft")
        s.add(plan)
        await s.flush()
        await s.execute(update(Organization).where(Organization.id == caller.org_id).values(plan_id=plan.id))
    gw.keys._entries.clear()  # the plan changed: re-read (an org change event does this live)
    await chat(gateway_env, gateway_env.admin_key)
    limiter = gw.admitter.limiter
    (key,) = [k for k in limiter._spent if caller.org_id in k]
    last = (await ledger(gateway_env, 3))[-1]
    assert limiter._spent[key][0] == units(before) + units(
        Decimal(last.prompt_tokens + last.completion_tokens) * 100 / 10**6
    )


async def test_revoked_key_stops_working_at_once(gateway_env: Env) -> None:
    key = await new_key(gateway_env)
    assert (await sdk(gateway_env, key).models.list()).data  # now cached
    async with gateway_env.app.state.sessionmaker() as s:
        key_id = (await s.scalars(select(ApiKey.id).where(ApiKey.prefix == key[:11]))).one()
    r = await gateway_env.client.delete(
        f"/admin/v1/keys/{key_id}", headers={"authorization": f"Bearer {gateway_env.admin_key}"}
    )
    assert r.status_code == 200
    for _ in range(100):  # the revocation travels over the bus; well within a second
        try:
            await sdk(gateway_env, key).models.list()
        except openai.AuthenticationError:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the revoked key still works")


async def test_expired_key_is_401(gateway_env: Env) -> None:
    key = await new_key(gateway_env, expires_at=utcnow() - timedelta(seconds=1))
    with pytest.raises(openai.AuthenticationError) as err:
        await sdk(gateway_env, key).models.list()
    assert "expired" in err.value.body["message"]


async def test_scoped_key_sees_and_uses_only_its_models(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    key = await new_key(gateway_env, scopes=["something-else"])
    assert (await sdk(gateway_env, key).models.list()).data == []
    with pytest.raises(openai.NotFoundError):
        await chat(gateway_env, key)
    allowed = await new_key(gateway_env, scopes=[MODEL])
    assert [m.id for m in (await sdk(gateway_env, allowed).models.list()).data] == [MODEL]
    await chat(gateway_env, allowed)


async def test_adapters_belong_to_their_organisation(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    a_key = await new_key(gateway_env, "org-a")
    b_key = await new_key(gateway_env, "org-b")
    gw = gateway_env.app.state.gateway
    a = await gw.authenticate(f"Bearer {a_key}")
    target = await gw.catalog.resolve(a, MODEL)
    async with gateway_env.app.state.sessionmaker() as s, s.begin():
        adapter = Adapter(org_id=a.org_id, model_id=target.model_id, name="a-support-bot", source="x")
        adapter.storage_key = f"adapters/{a.org_id}/ad-1/"
        s.add(adapter)
    assert "a-support-bot" in [m.id for m in (await sdk(gateway_env, a_key).models.list()).data]
    assert "a-support-bot" not in [m.id for m in (await sdk(gateway_env, b_key).models.list()).data]
    with pytest.raises(openai.NotFoundError):
        await chat(gateway_env, b_key, model="a-support-bot")
    reply = await chat(gateway_env, a_key, model="a-support-bot")
    assert reply.model == "a-support-bot"
    sent = w.received[-1]
    assert sent.adapter == adapter.id and sent.cache_salt == a.cache_salt
    assert sent.adapter_key == adapter.storage_key  # where a worker without it fetches it
    # the adapter is part of the prefix-cache key: the same prompt hashes differently
    assert hash_blocks(list(range(32)), 16, extra_keys(a.cache_salt, adapter.id)) != hash_blocks(
        list(range(32)), 16, extra_keys(a.cache_salt, None)
    )
    (row,) = [r for r in await ledger(gateway_env, 1) if r.adapter]
    assert row.adapter == adapter.id and row.org_id == a.org_id


async def test_embeddings_are_tokenized_admitted_and_metered(gateway_env: Env) -> None:
    dep = await gateway_env.embed_deployment()
    w = await gateway_env.add_embed_worker(dep)
    (name,) = [m.id for m in (await sdk(gateway_env).models.list()).data if m.id != MODEL]
    raw = await sdk(gateway_env).embeddings.with_raw_response.create(
        model=name, input=["hello world", "a"], encoding_format="float"
    )
    emb = raw.parse()
    sent = w.received[-1]
    # the gateway wrapped each text in the encoder's special tokens ([CLS] ... [SEP])
    assert len(sent.inputs) == 2 and sent.inputs[0][0] == sent.inputs[1][0] and len(sent.inputs[1]) == 3
    assert emb.usage.prompt_tokens == sum(len(i) for i in sent.inputs) == emb.usage.total_tokens
    assert [d.index for d in emb.data] == [0, 1] and raw.headers["x-ratelimit-limit-requests"] == "600"
    # token ids are taken as they are, wrapped the same way
    await sdk(gateway_env).embeddings.create(model=name, input=[[5, 6, 7]], encoding_format="float")
    assert w.received[-1].inputs == [[sent.inputs[1][0], 5, 6, 7, sent.inputs[1][-1]]]
    rows = await ledger(gateway_env, 2)
    assert [r.prompt_tokens for r in rows] == [emb.usage.prompt_tokens, 5]
    assert all(r.completion_tokens == 0 and r.status == "ok" for r in rows)
    # a generation model is not an embedding model, and the reverse
    with pytest.raises(openai.BadRequestError):
        await sdk(gateway_env).embeddings.create(model=MODEL, input="x")
    with pytest.raises(openai.BadRequestError):
        await chat(gateway_env, gateway_env.admin_key, model=name)
    for bad in ("", [], [[]], [[10**9]]):
        with pytest.raises(openai.BadRequestError) as err:
            await sdk(gateway_env).embeddings.create(model=name, input=bad)  # type: ignore[arg-type]
        assert err.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(gateway_env).embeddings.create(model=name, input="x " * 600)
    assert err.value.body["code"] == "context_length_exceeded"


async def test_soft_budget_warns_once_and_never_refuses(gateway_env: Env) -> None:
    await gateway_env.add_worker()
    gw = gateway_env.app.state.gateway
    caller = await gw.authenticate(f"Bearer {gateway_env.admin_key}")
    target = await gw.catalog.resolve(caller, MODEL)
    async with gateway_env.app.state.sessionmaker() as s, s.begin():
        s.add(Price(model_id=target.model_id, input_per_mtok=Decimal(1000), output_per_mtok=Decimal(2000)))
    key = await new_key(
        gateway_env, plan=Plan(name="soft", monthly_budget=Decimal("0.05"), budget_mode="soft")
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("tokenmill.gateway.admission")
    logger.addHandler(handler)
    try:
        for _ in range(5):  # each costs ~0.05: over the budget from the second on, never refused
            await chat(gateway_env, key, max_tokens=8)
    finally:
        logger.removeHandler(handler)
    warnings = [r for r in records if "over its monthly budget" in r.getMessage()]
    assert len(warnings) == 1


async def test_dedicated_deployments_do_not_spend_the_token_budget(gateway_env: Env) -> None:
    """Dedicated deployments are billed by GPU-hour: their tokens must not use up a budget."""
    await gateway_env.add_worker()
    gw = gateway_env.app.state.gateway
    target = await gw.catalog.resolve(await gw.authenticate(f"Bearer {gateway_env.admin_key}"), MODEL)
    async with gateway_env.app.state.sessionmaker() as s, s.begin():
        s.add(Price(model_id=target.model_id, input_per_mtok=Decimal(10**6), output_per_mtok=Decimal(10**6)))
    key = await new_key(
        gateway_env, "dedi-org", plan=Plan(name="cent", monthly_budget=Decimal("0.01"), budget_mode="hard")
    )
    org_id = (await gw.authenticate(f"Bearer {key}")).org_id
    dep = await gateway_env.dedicated("dedi-smol", org_id)
    await gateway_env.add_worker_for(dep)
    for _ in range(3):
        await chat(gateway_env, key, model="dedi-smol")
    with pytest.raises(openai.RateLimitError) as err:  # one token of the shared model costs $1
        await chat(gateway_env, key)
    assert err.value.body["code"] == "insufficient_quota"


async def test_a_request_the_worker_refuses_is_a_400_not_a_retry(gateway_env: Env) -> None:
    """A worker's 400 (e.g. an adapter it cannot serve) is the caller's problem: passed on
    as is, not retried elsewhere as if the worker had failed."""
    calls: list[int] = []

    @post("/generate", status_code=200)
    async def refuse() -> Response:
        calls.append(1)
        body = {"error": {"message": "this worker does not serve adapters", "type": "invalid_request_error",
                          "param": "adapter", "code": None}}  # fmt: skip
        return Response(body, status_code=400)

    async with serve(Litestar([refuse])) as url:
        await gateway_env.announce("refuser", url, gateway_env.deployment_id)
        with pytest.raises(openai.BadRequestError) as err:
            await chat(gateway_env, gateway_env.admin_key)
    assert err.value.body["param"] == "adapter" and "adapters" in err.value.body["message"]
    assert calls == [1]
