"""Unknown API keys cannot grow the gateway, and an address that keeps failing is throttled
(issue 14, acceptance 5).

A real gateway (uvicorn on the test's loop, SQLite) and raw HTTP/1.1 clients whose sockets
are bound to many loopback source addresses (127.x.y.z), so the server sees that many
different peers, as it would from many machines.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

import gateway.keys
from gateway.keys import KeyCache
from tests.gateway.conftest import Env
from tokenmill import security

UNKNOWN_KEYS = 20_000
ADDRESSES = 2_000  # 10 keys each: under the failure budget, so every key reaches the cache


def unknown_keys(n: int, start: int = 0) -> list[str]:
    """Well formed (so each is looked up), in no database, and with distinct prefixes."""
    return [f"{security.KEY_PREFIX}{start + i:08x}{secrets.token_hex(20)}" for i in range(n)]


async def send_pipelined(host: str, port: int, source: str, keys: list[str]) -> list[tuple[int, bytes]]:
    """GET /v1/models once per key on one keep-alive connection from `source`, pipelined:
    (status, raw head) of each answer."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    try:
        writer.write(
            b"".join(
                f"GET /v1/models HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {k}\r\n\r\n".encode()
                for k in keys
            )
        )
        await writer.drain()
        answers = []
        for _ in keys:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            answers.append((int(head.split(b" ", 2)[1]), head))
        return answers
    finally:
        writer.close()
        await writer.wait_closed()


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The prefixes the key cache reads from the database, in order."""
    reads: list[str] = []
    real: Callable[..., Awaitable[Any]] = gateway.keys.find_key

    async def counting(session: Any, prefix: str) -> Any:
        reads.append(prefix)
        return await real(session, prefix)

    monkeypatch.setattr(gateway.keys, "find_key", counting)
    return reads


@pytest.mark.timeout(300)
async def test_unknown_keys_from_many_addresses_leave_the_cache_at_its_bound(
    gateway_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys: KeyCache = gateway_env.app.state.gateway.keys
    settings = gateway_env.app.state.settings
    assert (
        (keys.size, keys.miss_size) == (settings.key_cache_size, settings.key_cache_misses) == (10_000, 1_000)
    )
    reads = count_reads(monkeypatch)
    url = urlsplit(str(gateway_env.client.base_url))
    host, port = url.hostname or "127.0.0.1", url.port or 80
    sources = [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(ADDRESSES)]
    assert len(set(sources)) == ADDRESSES
    per_address = UNKNOWN_KEYS // ADDRESSES
    gate = asyncio.Semaphore(32)
    statuses: dict[int, int] = {}

    async def one(n: int, source: str) -> None:
        async with gate:
            for status, _ in await send_pipelined(
                host, port, source, unknown_keys(per_address, n * per_address)
            ):
                statuses[status] = statuses.get(status, 0) + 1

    await asyncio.gather(*(one(n, s) for n, s in enumerate(sources)))
    # Every key was refused as unknown, each read once, and what is kept is the bound.
    assert statuses == {401: UNKNOWN_KEYS}
    assert len(reads) == len(set(reads)) == UNKNOWN_KEYS
    assert keys.held() == (0, keys.miss_size)
    # The failure counts are bounded too: at most one per address, fewer once some are idle.
    throttle = gateway_env.app.state.auth_failures
    assert 0 < len(throttle) <= min(ADDRESSES, throttle.max_addresses)
    # A real key still works, read once and then cached among the known keys.
    r = await gateway_env.client.get(
        "/v1/models", headers={"authorization": f"Bearer {gateway_env.admin_key}"}
    )
    assert r.status_code == 200
    assert keys.held() == (1, keys.miss_size)


async def test_repeated_failures_from_one_address_are_throttled_without_database_reads(
    gateway_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = gateway_env.app.state.settings.auth_failures_per_minute
    assert budget == 20
    reads = count_reads(monkeypatch)
    url = urlsplit(str(gateway_env.client.base_url))
    host, port = url.hostname or "127.0.0.1", url.port or 80
    bad = unknown_keys(budget + 5)
    answers = await send_pipelined(host, port, "127.0.7.7", bad)
    assert [s for s, _ in answers] == [401] * budget + [429] * 5
    assert len(reads) == budget  # the refused ones never reached the database
    retry = next(ln for ln in answers[-1][1].decode().lower().split("\r\n") if ln.startswith("retry-after:"))
    assert 1 <= int(retry.split(":")[1]) <= 3  # one more failure is allowed every 60/20 s
    # The answer is OpenAI's error shape, and the address is refused whatever key it sends:
    # a real one too, until its budget refills. Another address is not affected.
    async with httpx.AsyncClient(
        base_url=str(gateway_env.client.base_url),
        transport=httpx.AsyncHTTPTransport(local_address="127.0.7.7"),
    ) as same:
        r = await same.get("/v1/models", headers={"authorization": f"Bearer {gateway_env.admin_key}"})
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert r.json()["error"]["code"] == "too_many_authentication_failures"
    assert len(reads) == budget
    ok = await gateway_env.client.get(
        "/v1/models", headers={"authorization": f"Bearer {gateway_env.admin_key}"}
    )
    assert ok.status_code == 200
    # The admin API shares the count: the same address is refused there too.
    async with httpx.AsyncClient(
        base_url=str(gateway_env.client.base_url),
        transport=httpx.AsyncHTTPTransport(local_address="127.0.7.7"),
    ) as same:
        r = await same.get("/admin/v1/models", headers={"authorization": f"Bearer {bad[0]}"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
