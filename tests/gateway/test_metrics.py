"""The gateway's Prometheus metrics (`/metrics`, behind the internal token), read as Prometheus
reads them, after requests through the real app against fake workers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import EMBED_NAME, INTERNAL, Env
from tests.gateway.test_api import sdk
from tokenmill.protocol import USAGE, UsageRecord

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Say hello."}]
SCRAPER = {"authorization": f"Bearer {INTERNAL}"}


class Scrape:
    """One `/metrics` answer, parsed: the sum of the samples of `name` whose labels include
    `labels` (0.0 when there is none)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def __call__(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.samples)


async def scrape(env: Env) -> Scrape:
    r = await env.client.get("/metrics", headers=SCRAPER)
    assert r.status_code == 200, r.text
    return Scrape(r.text)


async def until(env: Env, check: Callable[[Scrape], bool], within: float = 10.0) -> Scrape:
    """The first scrape that passes `check` (the server records some things after answering)."""
    deadline = time.monotonic() + within
    while True:
        m = await scrape(env)
        if check(m) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.05)


def where(env: Env, endpoint: str = "chat") -> dict[str, str]:
    return {"endpoint": endpoint, "model": MODEL, "deployment": env.deployment_id}


async def test_metrics_need_the_internal_token(gateway_env: Env) -> None:
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Bearer {gateway_env.admin_key}"},
    ):
        r = await gateway_env.client.get("/metrics", headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_internal_token"
        assert r.headers["www-authenticate"] == "Bearer"
    m = await scrape(gateway_env)
    # The process's own metrics, the gateway's and (this app runs the consumer) the ledger's.
    assert m.has("python_info") and m.has("tokenmill_gateway_spool_depth")
    assert m.has("tokenmill_ledger_batches_total")


async def test_answered_requests_count_and_time(gateway_env: Env) -> None:
    env = gateway_env
    await env.add_worker()
    client = sdk(env)
    await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    chunks = [c async for c in await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True)]
    assert chunks
    await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1)
    m = await until(env, lambda m: m("tokenmill_gateway_requests_total") == 3)

    assert m("tokenmill_gateway_requests_total", **where(env), status_class="2xx") == 2
    assert m("tokenmill_gateway_requests_total", **where(env, "completions"), status_class="2xx") == 1
    assert m("tokenmill_gateway_requests_total", status_class="5xx") == 0
    assert m("tokenmill_gateway_requests_total", status_class="cancelled") == 0
    # Every answered request is timed once; TPOT only where there was more than one token.
    assert m("tokenmill_gateway_request_duration_seconds_count", **where(env)) == 2
    assert m("tokenmill_gateway_request_duration_seconds_count", **where(env, "completions")) == 1
    assert m("tokenmill_gateway_time_to_first_token_seconds_count", model=MODEL) == 3
    assert m("tokenmill_gateway_time_per_output_token_seconds_count", model=MODEL) == 2
    assert (
        0
        < m("tokenmill_gateway_time_to_first_token_seconds_sum")
        <= m("tokenmill_gateway_request_duration_seconds_sum")
    )
    # The fake worker's tokens: 4, then the deployment's default of 5, then 1.
    assert m("tokenmill_gateway_tokens_total", model=MODEL, kind="completion") == 4 + 5 + 1
    assert m("tokenmill_gateway_tokens_total", kind="prompt") > 10
    assert m("tokenmill_gateway_admission_seconds_count") == 3
    # The admin key was read once, then found in the cache.
    assert m("tokenmill_gateway_key_cache_lookups_total", outcome="miss") >= 1
    assert m("tokenmill_gateway_key_cache_lookups_total", outcome="hit") >= 2
    # Routing: each request once, by the default policy.
    assert m("tokenmill_gateway_routing_decisions_total", policy="prefix") == 3
    assert m("tokenmill_gateway_spool_depth") == 0
    assert 0 <= m("tokenmill_gateway_bus_lag_seconds") < 5
    # Never a tenant in a label: neither the key, nor the organisation.
    caller = await env.app.state.gateway.authenticate(f"Bearer {env.admin_key}")
    assert caller.key_id not in m.text and caller.org_id not in m.text


async def test_a_repeated_prompt_is_routed_to_its_prefix(gateway_env: Env) -> None:
    env = gateway_env
    await env.add_worker()
    await env.add_worker()
    long = [{"role": "user", "content": "Tell me about the sea. " * 20}]
    for _ in range(2):
        await sdk(env).chat.completions.create(model=MODEL, messages=long, max_tokens=1)
    m = await scrape(env)
    assert m("tokenmill_gateway_routing_decisions_total", policy="prefix", outcome="no_hit") == 1
    assert m("tokenmill_gateway_routing_decisions_total", policy="prefix", outcome="prefix_hit") == 1
    routed = m("tokenmill_gateway_routed_prompt_tokens_total", model=MODEL, deployment=env.deployment_id)
    hit = m("tokenmill_gateway_prefix_hit_tokens_total", model=MODEL, deployment=env.deployment_id)
    # The second prompt's whole blocks were where the first went; its last partial block was not.
    assert routed > 2 * 16 * 5 and routed / 2 - 16 < hit <= routed / 2 and hit % 16 == 0


async def test_a_failed_worker_is_an_upstream_error_and_a_retry(gateway_env: Env) -> None:
    env = gateway_env
    bad = await env.add_worker(fail=True)
    good = await env.add_worker()
    await env.beat(good, running=3)  # the failing one looks idler: tried first
    await sdk(env).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert len(bad.received) == 1 and len(good.received) == 1
    m = await until(env, lambda m: m("tokenmill_gateway_requests_total") == 1)
    labels = {"model": MODEL, "deployment": env.deployment_id}
    assert m("tokenmill_gateway_upstream_errors_total", **labels, kind="failed") == 1
    assert m("tokenmill_gateway_upstream_errors_total", kind="timeout") == 0
    assert m("tokenmill_gateway_upstream_retries_total", **labels) == 1
    assert m("tokenmill_gateway_requests_total", **where(env), status_class="2xx") == 1
    assert m("tokenmill_gateway_routing_decisions_total") == 2  # the first try, then the retry


async def test_no_worker_is_a_5xx_and_a_routing_outcome(gateway_env: Env) -> None:
    env = gateway_env
    with pytest.raises(openai.InternalServerError):
        await sdk(env).chat.completions.create(model=MODEL, messages=HELLO)
    m = await until(env, lambda m: m("tokenmill_gateway_requests_total") == 1)
    assert m("tokenmill_gateway_requests_total", **where(env), status_class="5xx") == 1
    assert m("tokenmill_gateway_routing_decisions_total", policy="prefix", outcome="no_worker") == 1
    # Not answered: not timed.
    assert m("tokenmill_gateway_request_duration_seconds_count") == 0
    assert m("tokenmill_gateway_time_to_first_token_seconds_count") == 0


async def test_a_client_that_leaves_is_cancelled_not_answered(gateway_env: Env) -> None:
    env = gateway_env
    w = await env.add_worker()
    w.delay, w.max_tokens = 0.05, 1000
    async with env.client.stream(
        "POST",
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {env.admin_key}"},
        json={"model": MODEL, "messages": HELLO, "max_tokens": 1000, "stream": True},
    ) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then gone
    m = await until(env, lambda m: m("tokenmill_gateway_requests_total") == 1)
    assert m("tokenmill_gateway_requests_total", **where(env), status_class="cancelled") == 1
    assert m("tokenmill_gateway_time_to_first_token_seconds_count") == 0
    assert m("tokenmill_gateway_request_duration_seconds_count") == 0
    # What was generated is still counted (and billed).
    assert 0 < m("tokenmill_gateway_tokens_total", kind="completion") < 1000


async def test_embeddings_responses_and_dedicated_deployments_are_labelled_by_base_model(
    gateway_env: Env,
) -> None:
    env = gateway_env
    await env.add_worker()
    embed_dep = await env.embed_deployment()
    await env.add_embed_worker(embed_dep)
    tenant = await env.tenant("acme")
    dedicated = await env.dedicated("acme-private-llm", tenant.org_id)
    await env.add_worker_for(dedicated)

    await sdk(env).embeddings.create(model=EMBED_NAME, input=["one", "two"])
    r = await env.client.post(
        "/v1/responses",
        headers={"authorization": f"Bearer {env.admin_key}"},
        json={"model": MODEL, "input": "Say hello.", "max_output_tokens": 2},
    )
    assert r.status_code == 200, r.text
    await sdk(env, tenant.key).chat.completions.create(model="acme-private-llm", messages=HELLO, max_tokens=2)
    m = await until(env, lambda m: m("tokenmill_gateway_requests_total") == 3)

    embed = {"endpoint": "embeddings", "model": EMBED_NAME, "deployment": embed_dep}
    assert m("tokenmill_gateway_requests_total", **embed, status_class="2xx") == 1
    assert m("tokenmill_gateway_request_duration_seconds_count", **embed) == 1
    assert m("tokenmill_gateway_tokens_total", model=EMBED_NAME, kind="prompt") > 0
    # Embeddings have no first token.
    assert m("tokenmill_gateway_time_to_first_token_seconds_count", model=EMBED_NAME) == 0
    assert m("tokenmill_gateway_requests_total", **where(env, "responses"), status_class="2xx") == 1
    private = {"endpoint": "chat", "model": MODEL, "deployment": dedicated}
    assert m("tokenmill_gateway_requests_total", **private, status_class="2xx") == 1
    # The tenant's deployment is known by its id only: its name and its owner stay out.
    assert "acme-private-llm" not in m.text and tenant.org_id not in m.text
    assert m("tokenmill_gateway_time_to_first_token_seconds_count") == 2


async def test_the_ledger_consumer_reports_throughput_and_lag(gateway_env: Env) -> None:
    env = gateway_env
    before = await scrape(env)
    sent = time.time() - 3.0  # as if published three seconds ago
    for i in range(5):
        record = UsageRecord(request_id=f"req_metrics_{i}", org_id="org", model="m", ts=sent)
        await env.app.state.bus.publish(USAGE, record)
    done: Callable[[Scrape], bool] = lambda m: (  # noqa: E731
        m("tokenmill_ledger_events_total") - before("tokenmill_ledger_events_total") == 5
    )
    m = await until(env, done)
    assert done(m)
    assert m("tokenmill_ledger_batches_total") > before("tokenmill_ledger_batches_total")
    assert 3.0 <= m("tokenmill_ledger_lag_seconds") < 30
