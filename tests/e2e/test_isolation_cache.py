"""Prefix-cache isolation on the real engine (issue 4, acceptance 8).

The gateway (real app and server, SQLite) routes two organisations' requests to one real
worker serving the bundled SmolLM2. Organisation B's prompt is cached for B only: B's
second request is served partly from the prefix cache, A's identical prompt is not,
because the gateway and the engine both salt every block hash with the organisation's
cache salt. The hashes the gateway routes with are recorded, and compared with the ones
the engine says it stored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.conftest import INTERNAL, Env, gateway_env, serve
from tokenmill.modelstore import resolve_model
from workers.engine import EngineConfig
from workers.generator import EngineGenerator
from workers.server import WorkerInfo, create_app

pytestmark = pytest.mark.slow

__all__ = ["gateway_env"]  # the fixture, imported for pytest to find

MODEL = "SmolLM2-135M-Instruct"  # the bundled model's name in `gateway_env`'s catalogue
BLOCK = 16  # tokens per KV block: the gateway's setting and the engine's default
# Long enough for several full blocks once the chat template is around it.
PROMPT = [
    {
        "role": "user",
        "content": "Here is a long story about a lighthouse keeper who lived alone on a rocky "
        "island far from the coast, kept a logbook of every ship that passed, fed the gulls "
        "each morning, repaired the great lamp each winter, and wrote letters to his sister "
        "that he could only post when the supply boat came twice a year. Summarise it.",
    }
]


@pytest.fixture(scope="module")
def generator(model_cache: Path) -> Iterator[EngineGenerator]:
    gen = EngineGenerator(
        EngineConfig(model=str(resolve_model("bundled:smollm2", model_cache)), kv_cache_gib=0.25)
    )
    assert gen.engine.config.block_size == BLOCK
    yield gen
    gen.close()


@dataclass
class Routed:
    """The block hashes the gateway handed to the router, one list per request."""

    hashes: list[list[str]]


@pytest.fixture
async def real_worker(gateway_env: Env, generator: EngineGenerator) -> AsyncIterator[Routed]:
    info = WorkerInfo("real-worker", MODEL, gateway_env.deployment_id)
    async with serve(create_app(generator, token=INTERNAL, info=info)) as url:
        await gateway_env.announce(info.worker_id, url, gateway_env.deployment_id, model=MODEL)
        generator.drain_kv_events()  # only what these requests store counts
        fleet = gateway_env.app.state.gateway.fleet
        routed = Routed([])
        wait_for = fleet.wait_for

        async def recording(*args: Any, **kwargs: Any) -> Any:
            routed.hashes.append(list(kwargs["hashes"]))
            return await wait_for(*args, **kwargs)

        fleet.wait_for = recording
        try:
            yield routed
        finally:
            fleet.wait_for = wait_for


async def cached_tokens(env: Env, key: str) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of one chat request with `key`."""
    r = await env.client.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": MODEL, "messages": PROMPT, "max_tokens": 2, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def stored(gen: EngineGenerator) -> set[str]:
    """Hashes of the blocks the engine stored in its prefix cache since the last call."""
    return {h for op in gen.drain_kv_events() if op.op == "stored" for h in op.hashes}


def full_blocks(hashes: Sequence[str], prompt_tokens: int) -> None:
    assert len(hashes) == prompt_tokens // BLOCK >= 3, (len(hashes), prompt_tokens)


async def test_one_organisations_prompt_is_never_a_cache_hit_for_another(
    gateway_env: Env, generator: EngineGenerator, real_worker: Routed
) -> None:
    env = gateway_env
    a, b = await env.tenant("org-a"), await env.tenant("org-b")

    # B twice: the second time, B's own blocks come from the prefix cache.
    n, first = await cached_tokens(env, b.key)
    assert first == 0
    b_stored = stored(generator)
    n2, second = await cached_tokens(env, b.key)
    assert n2 == n and 3 * BLOCK <= second < n, (n, second)

    # A, the very same prompt: nothing of B's is found.
    n_a, cached_a = await cached_tokens(env, a.key)
    assert n_a == n and cached_a == 0
    a_stored = stored(generator)

    # The router saw per-organisation hashes: B's twice the same, A's all different.
    b1, b2, a1 = real_worker.hashes
    full_blocks(b1, n)
    assert b1 == b2 and len(a1) == len(b1)
    assert not set(a1) & set(b1)
    # ...and they are the engine's: B's prompt blocks are what it stored for B; A's were
    # not there before A's request (so A could not hit them) and were stored for A.
    assert set(b1) <= b_stored and not set(a1) & b_stored
    assert set(a1) <= a_stored

    # A's cache works as well, for A: its second request hits its own blocks.
    assert (await cached_tokens(env, a.key))[1] == second


async def test_unrelated_keys_of_one_organisation_share_its_cache(
    gateway_env: Env, real_worker: Routed
) -> None:
    # The salt is the organisation's, not the key's: a second key of B hits B's cache.
    env = gateway_env
    b = await env.tenant("org-b")
    other_key = await env.key(b.org_id)
    n, first = await cached_tokens(env, b.key)
    _, second = await cached_tokens(env, other_key)
    assert first == 0 and 3 * BLOCK <= second < n
    assert real_worker.hashes[0] == real_worker.hashes[1]
