"""Billing's two volume paths: the usage ledger's ingest and the streamed CSV export.

    .venv/bin/python -m bench.billing             # 200,000 events, 1,000,000 exported rows
    .venv/bin/python -m bench.billing --quick     # 20,000 events, 100,000 rows, to check that it runs
    .venv/bin/python -m bench.billing --compare   # also the consumer as it was before tuning

Processes (each its own; this machine has 2 cores, which they all share):

- a private `redis-server` (no persistence) carrying the USAGE stream;
- PostgreSQL: the local server (`--database-url`, default postgres@127.0.0.1:5432), in a
  fresh `tm_bench_*` database that is migrated, used and dropped;
- ingest: the real ledger consumer (`billing.ledger.services.UsageConsumer`, consumer group,
  ack after commit) in its own process (`python -m bench.billing consume`). The N events
  are published to the stream first (one pipeline, the payload `RedisBus.publish` writes),
  the consumer is started and set going, and the clock runs from "go" until all N rows
  are in `usage_events` and none is pending in the group. CPU is the consumer's own
  utime + stime (from /proc) over that span, plus PostgreSQL's (all its processes).
- export: the ledger filled with `--export-rows` rows (generate_series, one statement),
  then `tokenmill admin export usage --format csv -o FILE` runs as its own process
  (through a wrapper that records, at exit, whether `torch` was ever imported). Peak RSS
  is the process's VmHWM (polled from /proc) and ru_maxrss from wait4; the CSV's data rows
  are counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.gateway import cpu_seconds, database, free_port, group_cpu, postgres_pids, wait_redis

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SECRET = "bench-secret"
DEFAULT_SERVER = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
TARGET_EVENTS_PER_S = 5000
MAX_EXPORT_RSS_MB = 200
EXPORT_FROM, EXPORT_TO = "2026-01-01", "2026-02-01"


# --- the consumer process -----------------------------------------------------------------


def _baseline_consumer() -> type:
    """UsageConsumer as it was before tuning (issue 5): batches of 500, one multi-row
    INSERT ... VALUES built per batch by SQLAlchemy Core. Only for `--compare`."""
    import msgspec
    from sqlalchemy.dialects import postgresql

    from billing.ledger.services import UsageConsumer, _row
    from billing.models import UsageEvent
    from tokenmill.protocol import UsageRecord

    class Baseline(UsageConsumer):
        count = 500

        async def handle(self, entries: list[Any]) -> None:
            records = []
            for _, raw in entries:
                with contextlib.suppress(msgspec.ValidationError):
                    records.append(self._decoder.decode(raw))
            if not records:
                return
            async with self.sessionmaker() as session, session.begin():
                await session.execute(
                    postgresql.insert(UsageEvent)
                    .values([_row(r) for r in records])
                    .on_conflict_do_nothing(index_elements=["request_id"])
                )

    assert UsageRecord  # the payload type the decoder above reads
    return Baseline


async def _consume(variant: str) -> None:
    """Run one ledger consumer until stdin closes: connect, say READY, wait for GO."""
    from billing.ledger.services import UsageConsumer
    from tokenmill.bus import RedisBus
    from tokenmill.db import make_engine, make_sessionmaker

    name, _, count = variant.partition(":")
    cls = _baseline_consumer() if name == "baseline" else UsageConsumer
    if count:
        cls = type(cls.__name__, (cls,), {"count": int(count)})
    engine = make_engine(os.environ["TOKENMILL_DATABASE_URL"])
    bus = RedisBus.from_url(os.environ["TOKENMILL_REDIS_URL"])
    consumer = cls(bus, make_sessionmaker(engine), "bench-ledger")
    async with engine.connect():  # warm one pooled connection, as a long-running server has
        pass
    loop = asyncio.get_running_loop()
    print("READY", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # GO
    await consumer.start()
    await loop.run_in_executor(None, sys.stdin.readline)  # EOF or STOP
    await consumer.stop()
    await bus.close()
    await engine.dispose()


# --- helpers ------------------------------------------------------------------------------


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


async def _sql(url: str, sql: str, *args: Any) -> Any:
    import asyncpg

    conn = await asyncpg.connect(_dsn(url))
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


def _env(db_url: str, redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
    env.update(
        TOKENMILL_DATABASE_URL=db_url,
        TOKENMILL_SECRET_KEY=SECRET,
        TOKENMILL_INTERNAL_TOKEN="bench-internal",
        TOKENMILL_HOME=str(Path(tempfile.gettempdir()) / "tm-bench-billing-home"),
        PYTHONPATH=str(ROOT),
    )
    if redis_url:
        env["TOKENMILL_REDIS_URL"] = redis_url
    return env


def publish(redis_url: str, n: int, run: str) -> float:
    """N usage records onto the USAGE stream, as `RedisBus.publish` writes them."""
    import redis

    from tokenmill.bus import FIELD, STREAM_MAXLEN, encode
    from tokenmill.protocol import USAGE, UsageRecord

    start = time.perf_counter()
    base = time.time() - 3600
    with redis.Redis.from_url(redis_url) as r:
        r.delete(USAGE)
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            rec = UsageRecord(
                request_id=f"req-{run}-{i:08d}",
                org_id=f"org_{i % 50:03d}",
                model="HuggingFaceTB/SmolLM2-135M-Instruct",
                api_key_id=f"key_{i % 200:04d}",
                adapter="support-bot" if i % 7 == 0 else None,
                deployment_id="dep_shared",
                prompt_tokens=30 + i % 900,
                cached_tokens=(i % 900) // 2,
                completion_tokens=1 + i % 256,
                ttft_ms=12.5 + i % 40,
                duration_ms=80.25 + i % 400,
                ts=base + i * 0.001,
            )
            pipe.xadd(USAGE, {FIELD: encode(rec)}, maxlen=STREAM_MAXLEN[USAGE], approximate=True)
            if len(pipe) >= 5000:
                pipe.execute()
        pipe.execute()
        assert r.xlen(USAGE) == n
    return time.perf_counter() - start


@dataclass
class Ingest:
    variant: str
    events: int
    seconds: float
    events_per_s: float
    startup_s: float
    consumer_cpu_s: float
    postgres_cpu_s: float
    consumer_cpu_ms_per_1k: float
    batch: int


def ingest(db_url: str, redis_url: str, n: int, variant: str) -> Ingest:
    import redis

    from tokenmill.protocol import USAGE

    asyncio.run(_sql(db_url, "TRUNCATE usage_events"))
    with redis.Redis.from_url(redis_url) as r:
        r.flushall()
    publish(redis_url, n, variant)
    spawned = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.billing", "consume", "--variant", variant],
        env=_env(db_url, redis_url),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin and proc.stdout
    try:
        line = proc.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"consumer did not start (exit {proc.poll()}): {line!r}")
        startup = time.perf_counter() - spawned
        pg = postgres_pids()
        cpu0, pg0 = cpu_seconds(proc.pid), group_cpu(pg)
        start = time.perf_counter()
        proc.stdin.write("GO\n")
        proc.stdin.flush()

        async def wait_done() -> None:
            import asyncpg

            conn = await asyncpg.connect(_dsn(db_url))
            try:
                with redis.Redis.from_url(redis_url) as r:
                    while True:
                        if proc.poll() is not None:
                            raise RuntimeError(f"consumer exited ({proc.returncode})")
                        rows = await conn.fetchval("SELECT count(*) FROM usage_events")
                        if rows >= n and r.xpending(USAGE, "billing-ledger")["pending"] == 0:
                            return
                        if time.perf_counter() - start > 600:
                            raise RuntimeError(f"timed out with {rows} of {n} rows")
                        await asyncio.sleep(0.02)
            finally:
                await conn.close()

        asyncio.run(wait_done())
        seconds = time.perf_counter() - start
        cpu, pg_cpu = cpu_seconds(proc.pid) - cpu0, group_cpu(pg) - pg0
        batch = _batch(variant)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    rows = asyncio.run(_sql(db_url, "SELECT count(DISTINCT request_id) FROM usage_events"))
    assert rows == n, (rows, n)
    return Ingest(variant, n, seconds, n / seconds, startup, cpu, pg_cpu, cpu / n * 1e6, batch)


def _batch(variant: str) -> int:
    from billing.ledger.services import UsageConsumer

    name, _, count = variant.partition(":")
    return int(count) if count else 500 if name == "baseline" else UsageConsumer.count


@dataclass
class Export:
    rows: int
    seconds: float
    rows_per_s: float
    csv_rows: int
    csv_mb: float
    peak_rss_mb: float
    ru_maxrss_mb: float
    torch_imported: bool
    fill_seconds: float


FILL_SQL = """
INSERT INTO usage_events (request_id, org_id, api_key_id, model, adapter, deployment_id,
    prompt_tokens, cached_tokens, completion_tokens, ttft_ms, duration_ms, status, created_at)
SELECT 'exp-' || lpad(g::text, 9, '0'), 'org_' || lpad((g % 50)::text, 3, '0'),
    'key_' || lpad((g % 200)::text, 4, '0'), 'HuggingFaceTB/SmolLM2-135M-Instruct',
    CASE WHEN g % 7 = 0 THEN 'support-bot' END, 'dep_shared', 30 + g % 900, (g % 900) / 2,
    1 + g % 256, 12.5 + g % 40, 80.25 + g % 400, CASE WHEN g % 97 = 0 THEN 'error' ELSE 'ok' END,
    timestamp '2026-01-01' + (g * interval '1 second') * (2678399.0 / $1)
FROM generate_series(1, $1::int) AS g
"""

WRAPPER = """
import atexit, json, runpy, sys
out = sys.argv[1]
def _report():
    with open(out, "w") as f:
        json.dump({"torch": "torch" in sys.modules, "modules": len(sys.modules)}, f)
atexit.register(_report)
sys.argv = ["tokenmill", *sys.argv[2:]]
runpy.run_module("tokenmill.cli", run_name="__main__", alter_sys=True)
"""


def export(db_url: str, rows: int, tmp: Path) -> Export:
    async def fill() -> None:
        import asyncpg

        conn = await asyncpg.connect(_dsn(db_url))
        try:
            await conn.execute("TRUNCATE usage_events")
            await conn.execute(FILL_SQL, rows)
            await conn.execute("ANALYZE usage_events")
        finally:
            await conn.close()

    t = time.perf_counter()
    asyncio.run(fill())
    fill_seconds = time.perf_counter() - t
    out, marker = tmp / "usage.csv", tmp / "modules.json"
    cmd = [sys.executable, "-c", WRAPPER, str(marker), "admin", "export", "usage", "--format", "csv",
           "--from", EXPORT_FROM, "--to", EXPORT_TO, "-o", str(out)]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(db_url, ""), cwd=ROOT, stderr=subprocess.PIPE)
    hwm = [0]
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            hwm[0] = max(hwm[0], int(line.split()[1]))
            except OSError:
                return
            time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    done.set()
    poller.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"export failed ({proc.returncode}):\n{err[-3000:]}")
    with out.open("rb") as f:
        header = f.readline()
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    assert header.startswith(b"request_id,created_at,"), header
    torch = json.loads(marker.read_text())["torch"]
    size = out.stat().st_size / 2**20
    out.unlink()
    return Export(
        rows, seconds, rows / seconds, lines, size, hwm[0] / 1024, usage.ru_maxrss / 1024, torch, fill_seconds
    )


# --- the run --------------------------------------------------------------------------------


def report(ingests: list[Ingest], exp: Export | None) -> str:
    lines = ["", "Ingest (Redis USAGE stream -> UsageConsumer -> usage_events)",
             f"{'variant':<14} {'batch':>6} {'events':>8} {'seconds':>8} {'events/s':>9} "
             f"{'consumer CPU ms/1k':>19} {'postgres CPU s':>15}"]  # fmt: skip
    for i in ingests:
        lines.append(
            f"{i.variant:<14} {i.batch:>6} {i.events:>8} {i.seconds:>8.2f} {i.events_per_s:>9.0f} "
            f"{i.consumer_cpu_ms_per_1k:>19.1f} {i.postgres_cpu_s:>15.2f}"
        )
    for prev, cur in itertools.pairwise(ingests):
        lines.append(f"{cur.variant} / {prev.variant}: {cur.events_per_s / prev.events_per_s:.2f}x events/s")
    if exp is not None:
        lines += ["", "Export (tokenmill admin export usage --format csv -o FILE)",
                  f"{'rows':>9} {'seconds':>8} {'rows/s':>9} {'CSV MB':>7} {'peak RSS MB':>12} "
                  f"{'ru_maxrss MB':>13} {'torch':>6}",
                  f"{exp.csv_rows:>9} {exp.seconds:>8.2f} {exp.rows_per_s:>9.0f} {exp.csv_mb:>7.1f} "
                  f"{exp.peak_rss_mb:>12.1f} {exp.ru_maxrss_mb:>13.1f} "
                  f"{exp.torch_imported!s:>6}"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "consume":
        p = argparse.ArgumentParser(prog="bench.billing consume")
        p.add_argument("consume")
        p.add_argument("--variant", default="current", help="current or baseline, optionally :BATCH")
        asyncio.run(_consume(p.parse_args().variant))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--events", type=int)
    p.add_argument("--export-rows", type=int)
    p.add_argument("--compare", action="store_true", help="also run the consumer as it was before tuning")
    p.add_argument("--variants", help="consumers to run, e.g. baseline,current:500,current")
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--database-url", default=DEFAULT_SERVER, help="a maintenance database on the server")
    args = p.parse_args()
    n = args.events or (20_000 if args.quick else 200_000)
    rows = args.export_rows or (100_000 if args.quick else 1_000_000)
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        sys.exit("redis-server is not on PATH")
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tm-bench-billing-"))
    redis_proc = subprocess.Popen(
        [redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    redis_url = f"redis://127.0.0.1:{port}/0"
    ingests: list[Ingest] = []
    exp: Export | None = None
    try:
        wait_redis(port)
        with database(args.database_url) as db_url:
            from migrations import upgrade

            upgrade(db_url)
            variants = ["baseline", "current"] if args.compare else ["current"]
            for variant in args.variants.split(",") if args.variants else variants:
                ingests.append(ingest(db_url, redis_url, n, variant))
                print(f"ingest {variant}: {ingests[-1].events_per_s:.0f} events/s", flush=True)
            if not args.no_export:
                exp = export(db_url, rows, tmp)
    finally:
        redis_proc.terminate()
        redis_proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(ingests, exp))
    pg_version = asyncio.run(_sql(args.database_url, "SHOW server_version"))
    result = {
        "conditions": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "postgres": pg_version,
            "database": "local PostgreSQL, fresh migrated database",
            "redis": "private redis-server, no persistence",
            "events": n,
            "export_rows": rows,
            "export_range": [EXPORT_FROM, EXPORT_TO],
        },
        "ingest": [asdict(i) for i in ingests],
        "export": asdict(exp) if exp else None,
        "targets": {"events_per_s": TARGET_EVENTS_PER_S, "export_peak_rss_mb": MAX_EXPORT_RSS_MB},
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("billing-quick.json" if args.quick else "billing.json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path.relative_to(ROOT)}")
    failed = []
    if ingests and ingests[-1].events_per_s < TARGET_EVENTS_PER_S:
        failed.append(f"ingest {ingests[-1].events_per_s:.0f} events/s < {TARGET_EVENTS_PER_S}")
    if exp is not None:
        if exp.csv_rows != rows:
            failed.append(f"CSV has {exp.csv_rows} data rows, not {rows}")
        if max(exp.peak_rss_mb, exp.ru_maxrss_mb) >= MAX_EXPORT_RSS_MB:
            failed.append(f"export peak RSS {max(exp.peak_rss_mb, exp.ru_maxrss_mb):.0f} MB")
        if exp.torch_imported:
            failed.append("the export imported torch")
    if failed:
        sys.exit("FAILED: " + "; ".join(failed))


if __name__ == "__main__":
    main()
