"""Tenant isolation on the API (issue 4, acceptance 8): what one organisation owns, another
can neither use nor see, and a key scoped to some models reaches those only.

Organisations and keys are made through the admin API; a dedicated deployment is a row of
the catalogue served by its own fake worker. That prefix caches are never shared is shown on
the real engine in tests/e2e/test_isolation_cache.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai
import pytest
from sqlalchemy import select

from control_plane.catalog.models import Adapter, Model
from tests.gateway.conftest import BUNDLED_NAME, Env, FakeWorker, Tenant
from tests.gateway.test_api import sdk

PRIVATE = "b-private-smollm2"  # B's dedicated deployment
HELLO = [{"role": "user", "content": "Say hello."}]


@dataclass
class World:
    """Two organisations; B owns a dedicated deployment, served by its own worker."""

    env: Env
    a: Tenant
    b: Tenant
    b_worker: FakeWorker
    shared_worker: FakeWorker


@pytest.fixture
async def world(gateway_env: Env) -> World:
    a = await gateway_env.tenant("org-a")
    b = await gateway_env.tenant("org-b")
    dep = await gateway_env.dedicated(PRIVATE, b.org_id)
    b_worker = await gateway_env.add_worker_for(dep)
    shared = await gateway_env.add_worker()
    return World(gateway_env, a, b, b_worker, shared)


# Keys as plain strings: pytest imports conftest.py under its own module name, so an
# isinstance check against the `Tenant` imported here would not recognise its instances.


async def chat(env: Env, key: str, model: str) -> httpx.Response:
    return await env.client.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": model, "messages": HELLO, "max_tokens": 2},
    )


async def complete(env: Env, key: str, model: str) -> httpx.Response:
    return await env.client.post(
        "/v1/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": model, "prompt": "Once upon a time", "max_tokens": 2},
    )


async def listed(env: Env, key: str) -> list[str]:
    r = await env.client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def assert_not_found(r: httpx.Response, model: str) -> None:
    # The same answer as for a model that does not exist: nothing to probe.
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {
        "message": f"The model '{model}' does not exist or you do not have access to it.",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


# --- dedicated deployments ----------------------------------------------------------------


async def test_owner_sees_and_uses_its_dedicated_deployment(world: World) -> None:
    assert PRIVATE in await listed(world.env, world.b.key)
    for send in (chat, complete):
        r = await send(world.env, world.b.key, PRIVATE)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == PRIVATE
    # served by the dedicated deployment's own worker, on B's account
    assert len(world.b_worker.received) == 2 and world.shared_worker.received == []
    assert {req.fairness_key for req in world.b_worker.received} == {world.b.org_id}


async def test_other_organisation_can_neither_use_nor_see_it(world: World) -> None:
    assert PRIVATE not in await listed(world.env, world.a.key)
    assert_not_found(await chat(world.env, world.a.key, PRIVATE), PRIVATE)
    assert_not_found(await complete(world.env, world.a.key, PRIVATE), PRIVATE)
    # ...and the refusal is indistinguishable from a model that does not exist
    assert_not_found(await chat(world.env, world.a.key, "no-such-model"), "no-such-model")
    assert world.b_worker.received == []
    # the shared model still works for A, and is served by the shared worker
    r = await chat(world.env, world.a.key, BUNDLED_NAME)
    assert r.status_code == 200, r.text
    assert len(world.shared_worker.received) == 1 and world.b_worker.received == []


async def test_tenants_get_different_cache_salts(world: World) -> None:
    assert (await chat(world.env, world.a.key, BUNDLED_NAME)).status_code == 200
    assert (await chat(world.env, world.b.key, BUNDLED_NAME)).status_code == 200
    salt_a, salt_b = (req.cache_salt for req in world.shared_worker.received)
    assert salt_a and salt_b and salt_a != salt_b


# --- scoped keys --------------------------------------------------------------------------


async def test_key_scoped_to_one_model_uses_and_lists_only_it(world: World) -> None:
    env = world.env
    shared_only = await env.key(world.b.org_id, scopes=[BUNDLED_NAME])
    private_only = await env.key(world.b.org_id, scopes=[PRIVATE])
    # B's unscoped key sees both; each scoped key sees exactly its model
    assert {BUNDLED_NAME, PRIVATE} <= set(await listed(env, world.b.key))
    assert await listed(env, shared_only) == [BUNDLED_NAME]
    assert await listed(env, private_only) == [PRIVATE]
    # and may use nothing else, not even its own organisation's deployment
    assert_not_found(await chat(env, shared_only, PRIVATE), PRIVATE)
    assert_not_found(await complete(env, shared_only, PRIVATE), PRIVATE)
    assert_not_found(await chat(env, private_only, BUNDLED_NAME), BUNDLED_NAME)
    assert_not_found(await complete(env, private_only, BUNDLED_NAME), BUNDLED_NAME)
    assert world.b_worker.received == [] and world.shared_worker.received == []
    assert (await chat(env, shared_only, BUNDLED_NAME)).status_code == 200
    assert (await chat(env, private_only, PRIVATE)).status_code == 200
    assert len(world.shared_worker.received) == 1 and len(world.b_worker.received) == 1


async def test_scope_naming_another_tenants_model_grants_nothing(world: World) -> None:
    # A scope narrows what a key's organisation may use; it never widens it.
    sneaky = await world.env.key(world.a.org_id, scopes=[PRIVATE])
    assert await listed(world.env, sneaky) == []
    assert_not_found(await chat(world.env, sneaky, PRIVATE), PRIVATE)
    assert world.b_worker.received == []


# --- adapters -----------------------------------------------------------------------------
# Adapter isolation (A cannot use or list B's LoRA adapters, nor hit their cache) joins here
# once the gateway resolves adapters: a `World` field for B's adapter and tests alike.


# --- retrieving one model (GET /v1/models/{model}) ------------------------------------------


async def retrieve(env: Env, key: str, model: str) -> httpx.Response:
    return await env.client.get(f"/v1/models/{model}", headers={"authorization": f"Bearer {key}"})


async def test_retrieving_a_model_follows_the_listing_rules(world: World) -> None:
    """What `/v1/models` lists, `/v1/models/{id}` gives; anything else is a 404 exactly as for
    a model that does not exist. B owns a dedicated deployment and a LoRA adapter."""
    env = world.env
    async with env.app.state.sessionmaker() as s, s.begin():
        base = await s.scalar(select(Model.id).where(Model.name == BUNDLED_NAME))
        s.add(Adapter(org_id=world.b.org_id, model_id=base, name="b-support-bot", source="x"))
    for model in (PRIVATE, "b-support-bot", BUNDLED_NAME):
        card = await sdk(env, world.b.key).models.retrieve(model)
        assert card.id == model and card.object == "model"
        assert card.owned_by == ("tokenmill" if model == BUNDLED_NAME else world.b.org_id)
        assert model in await listed(env, world.b.key)
    for model in (PRIVATE, "b-support-bot"):
        assert model not in await listed(env, world.a.key)
        assert_not_found(await retrieve(env, world.a.key, model), model)
        with pytest.raises(openai.NotFoundError):
            await sdk(env, world.a.key).models.retrieve(model)
    assert_not_found(await retrieve(env, world.a.key, "no-such-model"), "no-such-model")
    assert (await retrieve(env, world.a.key, BUNDLED_NAME)).status_code == 200
    # a scoped key retrieves what it lists, and nothing else of its own organisation
    scoped = await env.key(world.b.org_id, scopes=[BUNDLED_NAME])
    assert (await retrieve(env, scoped, BUNDLED_NAME)).json()["id"] == BUNDLED_NAME
    assert_not_found(await retrieve(env, scoped, PRIVATE), PRIVATE)
    assert_not_found(await retrieve(env, scoped, "b-support-bot"), "b-support-bot")
