"""bench/gateway.py checks that every gateway request it got an answer to is in the ledger.

These run the benchmark itself, shortened (1 s loads at 32 connections, no reference
targets): its own redis-server, the test PostgreSQL server, the fake worker, `tokenmill
gateway`, `tokenmill control-plane` with the real usage consumer, and the load generator.

Issue 14 saw "ledger: 14754 usage events for 14755 answered gateway requests" although no
event was lost: the run subtracted a ledger count taken *after* its first (readiness) request,
so whether that request's usage event counted depended on whether the consumer had written it
yet. The tests make that happen every time, by waiting for the readiness request's event
before the load starts, as a slower start of the other targets does in a full run.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import bench.gateway as bench_gateway

SHORT = ["--no-bare", "--warmup", "0.5", "--seconds", "1", "--latency-seconds", "0.5", "--connections", "32"]


def _dsn(db_url: str) -> str:
    return db_url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def _await_metered(db_url: str, request_id: str, *, then_delete: bool) -> None:
    """Wait until `request_id` is in the ledger; with `then_delete`, remove it again (an event
    lost after the fact, as far as the benchmark can tell)."""
    conn = await asyncpg.connect(_dsn(db_url))
    try:
        deadline = time.monotonic() + 30
        while not await conn.fetchval("SELECT 1 FROM usage_events WHERE request_id = $1", request_id):
            assert time.monotonic() < deadline, f"{request_id} never reached the ledger"
            await asyncio.sleep(0.05)
        if then_delete:
            await conn.execute("DELETE FROM usage_events WHERE request_id = $1", request_id)
    finally:
        await conn.close()


def _run_bench(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    pg_server_url: str,
    model_cache: Path,
    extra: list[str],
    *,
    lose_readiness_event: bool = False,
) -> tuple[int, dict[str, Any], list[str]]:
    """bench.gateway's main() (in a thread: it runs its own event loops) -> (exit code,
    the result's "ledger" section, the readiness requests' ids)."""
    databases: list[str] = []
    readiness: list[str] = []
    real_setup: Callable[..., Any] = bench_gateway.setup_tenant
    real_wait_ready: Callable[..., Any] = bench_gateway.wait_ready

    async def setup_tenant(db_url: str) -> Any:
        databases.append(db_url)
        return await real_setup(db_url)

    def wait_ready(url: str, *args: Any, **kwargs: Any) -> Any:
        r = real_wait_ready(url, *args, **kwargs)
        request_id = r.headers.get("x-request-id")
        if request_id is not None:  # a gateway (the bare forwarder sends none)
            readiness.append(request_id)
            asyncio.run(_await_metered(databases[0], request_id, then_delete=lose_readiness_event))
        return r

    monkeypatch.setattr(bench_gateway, "setup_tenant", setup_tenant)
    monkeypatch.setattr(bench_gateway, "wait_ready", wait_ready)
    monkeypatch.setenv("TOKENMILL_MODEL_CACHE", str(model_cache))
    # The run's own directory (logs, kept when the check fails) under the test's.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "result.json"
    argv = ["bench.gateway", *SHORT, *extra, "--database-url", pg_server_url, "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            pool.submit(bench_gateway.main).result()
            code = 0
        except SystemExit as exc:
            code = 0 if exc.code in (None, 0) else 1
    return code, json.loads(out.read_text())["ledger"], readiness


def _need_wrk() -> None:
    if shutil.which("wrk") is None:
        pytest.fail("wrk not found: install it (Debian: apt-get install wrk)", pytrace=False)


@pytest.mark.slow
@pytest.mark.parametrize("loadgen", ["wrk", "bench._load"])
def test_every_answered_request_is_counted_once_even_if_metered_before_the_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pg_server_url: str, model_cache: Path, loadgen: str
) -> None:
    if loadgen == "wrk":
        _need_wrk()
    code, ledger, readiness = _run_bench(
        monkeypatch, tmp_path, pg_server_url, model_cache, ["--no-wrk"] if loadgen != "wrk" else []
    )
    assert len(readiness) == 1
    assert ledger["answered"] > 32  # the warm-up, loaded and one-connection runs plus readiness
    assert ledger["usage_events"] == ledger["answered"], ledger
    assert ledger["missing"] == []
    assert code == 0


@pytest.mark.slow
def test_an_answered_request_missing_from_the_ledger_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pg_server_url: str, model_cache: Path
) -> None:
    code, ledger, readiness = _run_bench(
        monkeypatch,
        tmp_path,
        pg_server_url,
        model_cache,
        ["--no-wrk", "--ledger-wait", "3"],  # the event will not come: do not wait 120 s for it
        lose_readiness_event=True,
    )
    assert code != 0
    assert ledger["missing"] == readiness
    assert ledger["usage_events"] == ledger["answered"] - 1
    # and the logs of the failed run are kept for a look
    assert [p.name for p in tmp_path.glob("tm-bench-gw-*/gateway.log")] == ["gateway.log"]
