"""Each request's context reaches its usage event: OpenAI's `user`, the caller's
X-Client-Request-Id and the service tier; `flex` runs at the engine's batch priority.
Driven by the official SDK against fake workers, which record the `/generate` they got."""

from __future__ import annotations

import openai
import pytest

from billing.models import UsageEvent
from tests.gateway.conftest import EMBED_NAME, Env
from tests.gateway.test_api import HELLO, MODEL, ledger, sdk


def _context(row: UsageEvent) -> tuple[str | None, str | None, str]:
    return (row.user, row.client_request_id, row.service_tier)


async def test_user_client_id_and_tier_reach_the_usage_event(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    client = sdk(gateway_env)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=2,
        user="end-user-17",
        service_tier="flex",
        extra_headers={"X-Client-Request-Id": "trace-flex"},
    )
    assert raw.parse().service_tier == "flex"  # the tier it ran at, as OpenAI reports it
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
        service_tier="auto",
        extra_headers={"X-Client-Request-Id": "trace-auto"},
    )
    chunks = [c async for c in stream]
    assert {c.service_tier for c in chunks} == {"default"}  # on every chunk, usage's included
    await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, user="u2")
    await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, service_tier="default")

    # flex is batch work to the engine; auto, default and no tier at all are the default tier
    assert [r.priority for r in w.received] == [1, 0, 0, 0]
    rows = await ledger(gateway_env, 4)
    assert rows[0].request_id == raw.headers["x-request-id"]
    assert [_context(r) for r in rows] == [
        ("end-user-17", "trace-flex", "flex"),
        (None, "trace-auto", "default"),
        ("u2", None, "default"),
        (None, None, "default"),
    ]


async def test_embeddings_record_the_user(gateway_env: Env) -> None:
    await gateway_env.add_embed_worker(await gateway_env.embed_deployment())
    await sdk(gateway_env).embeddings.create(
        model=EMBED_NAME, input="hello", user="embedder-1", extra_headers={"X-Client-Request-Id": "e-1"}
    )
    (row,) = await ledger(gateway_env, 1)
    assert _context(row) == ("embedder-1", "e-1", "default")


@pytest.mark.parametrize("tier", ["priority", "scale", "fast", "Flex", ""])
async def test_tiers_this_server_lacks_are_refused_naming_those_it_has(gateway_env: Env, tier: str) -> None:
    w = await gateway_env.add_worker()
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(gateway_env).chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=1,
            service_tier=tier,  # type: ignore[arg-type]
        )
    body = err.value.body
    assert body["param"] == "service_tier" and body["type"] == "invalid_request_error"
    assert all(f"'{t}'" in body["message"] for t in ("auto", "default", "flex")), body["message"]
    assert w.received == []


async def test_user_is_at_most_256_characters(gateway_env: Env) -> None:
    w = await gateway_env.add_worker()
    client = sdk(gateway_env)
    await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, user="u" * 256)
    (row,) = await ledger(gateway_env, 1)
    assert row.user == "u" * 256
    for call in (
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, user="u" * 257),
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, user="u" * 257),
        client.embeddings.create(model=EMBED_NAME, input="hello", user="u" * 257),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            await call
        assert err.value.body["param"] == "user"
        assert "256" in err.value.body["message"]
    assert len(w.received) == 1
