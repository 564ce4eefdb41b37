"""The gateway's metrics after a scripted mix of requests against `tokenmill serve` (issue 20,
acceptance 1).

A server of its own (a worker of it is killed): successes (streamed and not, chat and
completions), a 401, a 404, a 429 (a key allowed one request a minute), a context-length 400,
a client that leaves mid-stream and a worker killed mid-stream. Then `/metrics`, scraped with
the internal token as Prometheus would, must show each in the right counter, and the TTFT and
duration histograms exactly one observation per answered request.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.serve import MODEL, Server, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SERVE_ENV = {
    "TOKENMILL_EMBED_MODEL": "",
    "TOKENMILL_KV_CACHE_GIB": "0.25",
    "TOKENMILL_SCHEDULER": "false",
}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
# A stream that lasts: far more tokens than the test waits for, whatever the model would say.
LONG = {"model": MODEL, "messages": ASK, "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("observability"), model_cache, SERVE_ENV)
    try:
        yield s
    finally:
        s.close()


class Metrics:
    """One scrape, parsed as Prometheus parses it: `m(name, **labels)` sums the samples of
    `name` whose labels include `labels`."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def __call__(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())


def scrape(server: Server) -> Metrics:
    token = json.loads((server.home / "secrets.json").read_text())["internal_token"]
    r = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return Metrics(r.text)


def until(server: Server, check: Callable[[Metrics], bool], within: float = 60) -> Metrics:
    deadline = time.monotonic() + within
    while True:
        m = scrape(server)
        if check(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def first_chunk_then(server: Server, then: Callable[[httpx.Response], None]) -> list[str]:
    """Stream LONG; after its first chunk, `then(response)`; the events read until the stream
    ends (nothing more when `then` closes the response: the client leaves)."""
    events: list[str] = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {server.key}"},
        json=LONG,
        timeout=120,
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(line)
                break
        then(r)
        if not r.is_closed:
            events += [ln for ln in lines if ln]
    return events


def test_a_scripted_mix_lands_in_the_right_counters(server: Server) -> None:
    anonymous = httpx.get(f"{server.url}/metrics", timeout=30)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_internal_token"
    before = scrape(server)
    client = server.client()

    # Answered: two alike (the second finds the first's prefix), a stream, a completion.
    for _ in range(2):
        assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4).choices
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, stream=True))
    assert chunks
    assert client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3).choices
    # Refused: a made-up key (401), a model nobody serves (404), a second request within a
    # minute on a key allowed one (429, after its first is answered), a prompt plus
    # max_tokens beyond the context (400).
    with pytest.raises(openai.AuthenticationError):
        server.client("tm-nobody-has-this-key").chat.completions.create(model=MODEL, messages=ASK)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=ASK)
    slow = server.client(server.create_org_key("metrics-rpm", requests_per_minute=1, request_burst=1))
    assert slow.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).choices
    with pytest.raises(openai.RateLimitError):
        slow.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100_000)
    assert too_long.value.code == "context_length_exceeded"
    answered = 2 + 1 + 1 + 1

    # The client leaves after the first chunk.
    assert len(first_chunk_then(server, lambda r: r.close())) == 1
    # The worker is killed after the first chunk: the stream ends with an error event.
    (worker,) = [p for p in server.children() if b"worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
    events = first_chunk_then(server, lambda _: os.kill(worker, signal.SIGKILL))
    assert any('"error"' in e for e in events[1:]), events[-3:]

    def delta(m: Metrics, name: str, **labels: str) -> float:
        return m(name, **labels) - before(name, **labels)

    m = until(
        server,
        lambda m: (
            delta(m, "tokenmill_gateway_requests_total", status_class="cancelled") >= 1
            and delta(m, "tokenmill_gateway_requests_total", status_class="5xx") >= 1
            and delta(m, "tokenmill_ledger_events_total") >= answered + 2
        ),
    )
    requests = "tokenmill_gateway_requests_total"
    chat = {"endpoint": "chat", "model": MODEL}
    assert delta(m, requests, **chat, status_class="2xx") == 4
    assert delta(m, requests, endpoint="completions", model=MODEL, status_class="2xx") == 1
    assert delta(m, requests, **chat, status_class="cancelled") == 1
    assert delta(m, requests, **chat, status_class="5xx") == 1
    # Only answered requests are timed, each once.
    assert delta(m, "tokenmill_gateway_request_duration_seconds_count") == answered
    assert delta(m, "tokenmill_gateway_time_to_first_token_seconds_count") == answered
    assert delta(m, "tokenmill_gateway_time_per_output_token_seconds_count") == answered - 1  # 1 token: none
    # The killed worker's stream: one failed call, not retried (it had sent tokens).
    assert delta(m, "tokenmill_gateway_upstream_errors_total", model=MODEL, kind="failed") == 1
    assert delta(m, "tokenmill_gateway_upstream_retries_total") == 0
    # Every request that reached a worker was routed once, by the default policy.
    routed = answered + 2
    assert delta(m, "tokenmill_gateway_routing_decisions_total", policy="prefix") == routed
    assert delta(m, "tokenmill_gateway_routing_decisions_total", outcome="prefix_hit") >= 1
    hit = delta(m, "tokenmill_gateway_prefix_hit_tokens_total", model=MODEL)
    assert 0 < hit < delta(m, "tokenmill_gateway_routed_prompt_tokens_total", model=MODEL)
    assert delta(m, "tokenmill_gateway_admission_seconds_count") == routed
    assert delta(m, "tokenmill_gateway_tokens_total", model=MODEL, kind="completion") > answered
    assert delta(m, "tokenmill_gateway_key_cache_lookups_total", outcome="hit") > 0
    assert m("tokenmill_gateway_spool_depth") == 0
    # The ledger consumer of this server took every usage event (refusals have none).
    assert delta(m, "tokenmill_ledger_events_total") == routed
    assert delta(m, "tokenmill_ledger_batches_total") >= 1
    assert 0 <= m("tokenmill_ledger_lag_seconds") < 60

    # Refusals, by reason, and as 4xx requests.
    refusals = "tokenmill_gateway_refusals_total"
    for reason in ("auth", "not_found", "rate_limit_requests", "context_length"):
        assert delta(m, refusals, reason=reason) == 1, (reason, m.text)
    assert delta(m, refusals) == 4
    assert delta(m, requests, status_class="4xx") == 4
