"""What the gateway's product path costs: one `tokenmill gateway` in front of an instant worker.

    .venv/bin/python -m bench.gateway             # 32 connections for 20 s per target
    .venv/bin/python -m bench.gateway --quick     # 5 s per target, to check that it runs
    .venv/bin/python -m bench.gateway --compare /path/to/other/checkout   # A/B two gateways
    .venv/bin/python -m bench.gateway --compare HEAD --rounds 3   # this tree against a revision

Processes (each its own; this machine has 2 cores, which they all share):

- a private `redis-server` (no persistence) for limits, the bus and the fleet view;
- PostgreSQL: the local server (`--database-url`, default postgres@127.0.0.1:5432), in a
  fresh `tm_bench_*` database that is migrated, used and dropped;
- `bench._fake_worker`: the real worker protocol, answering instantly, heartbeating on Redis;
- `tokenmill gateway`, the real path: API key (cache + HMAC check), Redis admission with
  limits ON (requests/min, tokens/min and concurrency of the key and of its organisation's
  plan, plus a hard monthly budget hold: all far above what the load reaches), chat template
  and tokenizer of SmolLM2, prefix-aware routing, the usage event to Redis (spooling publisher);
- `tokenmill control-plane`, whose usage consumer writes every event into the ledger
  (checked at the end: every answered request is in it, by request id; the run exits 1 if one
  is not);
- `bench._forwarder`: a bare Litestar endpoint that only forwards to the worker (the reference);
- `wrk` (one thread) as the load generator: non-streaming `/v1/chat/completions`, a short
  prompt, `max_tokens` 8 (the worker answers 1-8 tokens).

For each target: a warm-up, then `--connections` (32) for `--seconds` (20), then one
connection for `--latency-seconds` (5) to see the added latency without queueing. The
worker is also loaded directly (the floor). CPU per request is the utime + stime delta of
each process (from /proc) over the run, divided by the requests wrk completed. Without
`wrk`, `bench._load` (an asyncio client on uvloop, in its own process) generates the load.

`--compare` runs the gateway of another source tree beside this one's, on the same
services: a directory, or a git revision of this repository (checked out into a temporary
worktree, removed afterwards). With `--rounds N` the gateways take turns, in alternating
order, and the table ends with each gateway's median own CPU per request over the rounds and
its ratio to this tree's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec

from tokenmill.modelstore import model_name, resolve_model
from tokenmill.protocol import GenerateRequest, SamplingParams
from tokenmill.settings import BUNDLED_MODEL, Settings

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SECRET, INTERNAL = "bench-secret", "bench-internal"
MODEL = model_name(BUNDLED_MODEL)
MAX_TOKENS = 8
PROMPT = "Write one short sentence about the sea."
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The process whose CPU is a target's own, by target name (gateways are named as their process).
# py-spy comes with the dev extras, in the venv beside this Python (not necessarily on PATH).
PY_SPY = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
OWN = {"worker (direct)": "worker", "bare forwarder": "bare", "bare forwarder (httpx)": "bare-httpx"}

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = %(auth)s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH-JSON {\\"requests\\": %%d, \\"duration_us\\": %%d, \\"connect\\": %%d, \\"read\\": %%d, " ..
    "\\"write\\": %%d, \\"status\\": %%d, \\"timeout\\": %%d, \\"p50_us\\": %%d, \\"p90_us\\": %%d, " ..
    "\\"p99_us\\": %%d, \\"mean_us\\": %%.1f}\\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
"""
# Appended for the gateway: every answer's status and x-request-id, one file per wrk thread
# (`<path>.<thread>`, the path given after `--`), so the ledger can be checked id by id.
WRK_IDS = """
local threads = 0
setup = function(thread)
  thread:set("thread_index", threads)
  threads = threads + 1
end
init = function(args)
  ids = assert(io.open(args[1] .. "." .. thread_index, "w"))
end
response = function(status, headers, body)
  local rid = headers["x-request-id"]
  if rid == nil then
    for k, v in pairs(headers) do
      if string.lower(k) == "x-request-id" then rid = v end
    end
  end
  ids:write(status, " ", rid or "-", "\\n")
end
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lua_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def postgres_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == "postgres":
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def group_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):  # a backend that ended meanwhile
            total += cpu_seconds(pid)
    return total


@dataclass
class Run:
    target: str
    connections: int
    seconds: float
    requests: int
    errors: dict[str, int]
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)
    machine_busy_cores: float = 0.0


@dataclass
class Target:
    name: str
    url: str
    body: bytes
    auth: str
    pid: int | None  # the process under test, whose CPU is "the" figure


class Bench:
    def __init__(self, tmp: Path, wrk: str | None) -> None:
        self.tmp = tmp
        self.wrk = wrk
        self.watched: dict[str, int] = {}  # process name -> pid, for CPU accounting

    def load(
        self,
        target: Target,
        connections: int,
        seconds: float,
        answers: list[tuple[int, str]] | None = None,
    ) -> Run:
        """One run of the load generator. With `answers`, the (status, request id) of every
        answer it got is appended there (costs the load generator a little CPU)."""
        auth = f"Bearer {target.auth}"
        ids = self.tmp / "ids"
        for old in self.tmp.glob("ids*"):
            old.unlink()
        if self.wrk is not None:
            script = self.tmp / f"wrk-{OWN.get(target.name, target.name)}.lua"
            script.write_text(
                WRK_SCRIPT % {"body": lua_string(target.body.decode()), "auth": lua_string(auth)}
                + (WRK_IDS if answers is not None else "")
            )
            cmd = [self.wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
                   "-s", str(script), target.url]  # fmt: skip
            if answers is not None:
                cmd += ["--", str(ids)]
        else:
            body = self.tmp / "body"
            body.write_bytes(target.body)
            headers = ["--header", "Content-Type: application/json", "--header", f"Authorization: {auth}"]
            cmd = [sys.executable, "-m", "bench._load", target.url, "--connections", str(connections),
                   "--seconds", str(seconds), "--body", str(body), *headers]  # fmt: skip
            if answers is not None:
                cmd += ["--ids", f"{ids}.0"]
        out_path = self.tmp / "wrk.out"
        pg = postgres_pids()
        before = {name: cpu_seconds(pid) for name, pid in self.watched.items()}
        pg_before = group_cpu(pg)
        busy0, total0 = machine_busy()
        with out_path.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        busy1, total1 = machine_busy()
        after = {name: cpu_seconds(pid) for name, pid in self.watched.items()}
        text = out_path.read_text()
        line = next((ln for ln in text.splitlines() if ln.startswith("BENCH-JSON ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"the load generator failed ({proc.returncode}):\n{text}")
        r = json.loads(line.removeprefix("BENCH-JSON "))
        if answers is not None:
            got = read_answers(sorted(self.tmp.glob("ids.*")))
            if len(got) != r["requests"]:  # the ledger check would be off by as many
                raise RuntimeError(f"the load generator wrote {len(got)} ids for {r['requests']} answers")
            answers += got
        n = max(1, r["requests"])
        cpu = {name: (after[name] - before[name]) * 1000 / n for name in self.watched}
        cpu["postgres"] = max(0.0, group_cpu(pg) - pg_before) * 1000 / n  # exited backends take theirs along
        cpu["loadgen"] = (usage.ru_utime + usage.ru_stime) * 1000 / n
        elapsed = r["duration_us"] / 1e6
        return Run(
            target=target.name,
            connections=connections,
            seconds=round(elapsed, 2),
            requests=r["requests"],
            errors={k: r[k] for k in ("connect", "read", "write", "status", "timeout") if r[k]},
            rps=r["requests"] / elapsed,
            p50_ms=r["p50_us"] / 1000,
            p90_ms=r["p90_us"] / 1000,
            p99_ms=r["p99_us"] / 1000,
            mean_ms=r["mean_us"] / 1000,
            cpu_ms_per_request={k: round(v, 4) for k, v in cpu.items()},
            machine_busy_cores=round((busy1 - busy0) / max(1, total1 - total0) * (os.cpu_count() or 1), 2),
        )


def read_answers(paths: list[Path]) -> list[tuple[int, str]]:
    """(status, request id) per line `<status> <x-request-id or ->` of the load generator's files."""
    out: list[tuple[int, str]] = []
    for path in paths:
        for line in path.read_text().splitlines():
            status, _, request_id = line.partition(" ")
            out.append((int(status), request_id))
    return out


# --- services --------------------------------------------------------------------------------


class Processes:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []

    def start(
        self, name: str, cmd: list[str], env: dict[str, str], cwd: Path = ROOT
    ) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("wb")
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, proc, log))
        return proc

    def check(self) -> None:
        for name, proc, _ in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}); see {self.tmp / (name + '.log')}:\n"
                                   + (self.tmp / f"{name}.log").read_text()[-3000:])  # fmt: skip

    def stop(self) -> None:
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, log in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def wait_redis(port: int) -> None:
    import redis

    deadline = time.monotonic() + 20
    while True:
        try:
            with redis.Redis(port=port, socket_timeout=1) as r:
                if r.ping():
                    return
        except redis.exceptions.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


@contextmanager
def database(server_url: str) -> Iterator[str]:
    """A fresh database on the server of `server_url` (a maintenance database URL), dropped after."""
    import asyncpg

    name = f"tm_bench_{secrets.token_hex(4)}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(_dsn(server_url))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    base = _dsn(server_url).rsplit("/", 1)[0]
    try:
        yield f"{base.replace('postgresql://', 'postgresql+asyncpg://', 1)}/{name}"
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@dataclass
class Tenant:
    secret: str
    org_id: str
    deployment_id: str


async def setup_tenant(db_url: str) -> Tenant:
    """The catalogue (the bundled model, priced), a plan with every limit on but far above the
    load, an organisation on it and a key with its own limits."""
    from sqlalchemy import update

    import migrations
    from billing.models import Price
    from control_plane.bootstrap import bootstrap
    from control_plane.orgs.keys import ApiKeyService
    from control_plane.orgs.models import ApiKey, Organization
    from control_plane.orgs.services import OrganizationService
    from control_plane.plans.models import Plan
    from tokenmill.db import make_engine, make_sessionmaker

    await asyncio.to_thread(migrations.upgrade, db_url)
    engine = make_engine(db_url)
    try:
        sm = make_sessionmaker(engine)
        boot = await bootstrap(
            sm,
            secret_key=SECRET,
            model_name=MODEL,
            model_source=BUNDLED_MODEL,
            model_format="gguf",
            context_length=8192,
        )
        async with sm() as s, s.begin():
            s.add(
                Price(
                    model_id=boot.model.id,
                    input_per_mtok=Decimal("0.10"),
                    cached_input_per_mtok=Decimal("0.05"),
                    output_per_mtok=Decimal("0.20"),
                )
            )
            plan = Plan(
                name="bench",
                requests_per_minute=100_000_000,
                tokens_per_minute=2_000_000_000,
                max_concurrent=100_000,
                monthly_budget=Decimal("1000000"),
                budget_mode="hard",
            )
            s.add(plan)
            org = await OrganizationService(session=s).create_org("bench")
            await s.flush()
            await s.execute(update(Organization).where(Organization.id == org.id).values(plan_id=plan.id))
            created = await ApiKeyService(session=s).create_key(
                org_id=org.id, secret_key=SECRET, name="bench"
            )
            await s.execute(
                update(ApiKey)
                .where(ApiKey.id == created.key.id)
                .values(
                    requests_per_minute=50_000_000, tokens_per_minute=1_000_000_000, max_concurrent=50_000
                )
            )
        return Tenant(created.secret, org.id, boot.deployment.id)
    finally:
        await engine.dispose()


async def ledger_ids(db_url: str, org_id: str) -> tuple[dict[str, str], int]:
    """The organisation's ledger: request id -> status, and the completion tokens in all."""
    from sqlalchemy import select

    from billing.models import UsageEvent
    from tokenmill.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as s:
            rows = (
                await s.execute(
                    select(UsageEvent.request_id, UsageEvent.status, UsageEvent.completion_tokens).where(
                        UsageEvent.org_id == org_id
                    )
                )
            ).all()
            return {r[0]: r[1] for r in rows}, sum(r[2] for r in rows)
    finally:
        await engine.dispose()


@dataclass
class LedgerCheck:
    """Every request the gateway answered (2xx) must be in the ledger, once: the ledger is
    compared with the answers' request ids, not with a count, because it also rightly holds
    requests no client saw answered: those cut off when a load run stopped (wrk leaves up to
    one per connection in flight; the gateway meters them) and those answered with an error
    after admission (a 503 from a failing worker)."""

    answered: int  # distinct request ids of 2xx answers
    metered: int  # of those, in the ledger
    missing: list[str]  # answered, not in the ledger
    errored: int  # non-2xx answers that are in the ledger
    unseen: int  # ledger rows of requests no client saw answered
    unseen_bound: int  # how many requests can have been cut off or failed on the client side
    problems: list[str]

    @classmethod
    def of(cls, answers: list[tuple[int, str]], ledger: dict[str, str], unseen_bound: int) -> LedgerCheck:
        ok = [rid for status, rid in answers if 200 <= status < 300]
        answered = set(ok)
        other = {rid for status, rid in answers if not 200 <= status < 300} & ledger.keys()
        missing = sorted(answered - ledger.keys())
        unseen = len(ledger.keys() - answered - other)
        problems: list[str] = []
        if "-" in answered:
            problems.append("answers without an x-request-id")
        if len(answered) != len(ok):
            problems.append(f"{len(ok) - len(answered)} request ids answered more than once")
        if missing:
            some = ", ".join(missing[:10])
            problems.append(f"{len(missing)} answered requests have no usage event in the ledger: {some}")
        if unseen > unseen_bound:
            problems.append(
                f"{unseen} usage events of requests no client saw answered, "
                f"more than the {unseen_bound} that can have been cut off"
            )
        return cls(
            answered=len(answered),
            metered=len(answered) - len(missing),
            missing=missing,
            errored=len(other),
            unseen=unseen,
            unseen_bound=unseen_bound,
            problems=problems,
        )


def wait_ready(
    url: str,
    body: bytes,
    auth: str,
    procs: Processes,
    timeout: float = 180,
    answers: list[tuple[int, str]] | None = None,
) -> httpx.Response:
    """Post until the answer is a 200. With `answers`, every answer's (status, x-request-id)
    is appended there: the gateway meters its readiness requests too."""
    deadline = time.monotonic() + timeout
    headers = {"authorization": f"Bearer {auth}", "content-type": "application/json"}
    last: Any = None
    while time.monotonic() < deadline:
        procs.check()
        try:
            r = httpx.post(url, content=body, headers=headers, timeout=30)
            if answers is not None:
                answers.append((r.status_code, r.headers.get("x-request-id", "-")))
            if r.status_code == 200:
                return r
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s: {last}")


# --- the benchmark -------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="5 s per target")
    p.add_argument("--seconds", type=float, default=20.0, help="loaded run per target")
    p.add_argument("--latency-seconds", type=float, default=5.0, help="one-connection run per target")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                   help="maintenance database of the PostgreSQL server to use")  # fmt: skip
    p.add_argument("--compare", action="append", default=[],
                   help="also run the gateway of this tree or git revision (A/B); repeatable")  # fmt: skip
    p.add_argument(
        "--rounds", type=int, default=1, help="repeat the gateway runs (alternating with --compare)"
    )
    p.add_argument("--ledger-wait", type=float, default=120.0,
                   help="seconds to wait for the usage consumer to meter every answered request")  # fmt: skip
    p.add_argument("--no-bare", action="store_true", help="skip the bare forwarder and the direct worker")
    p.add_argument("--bare-httpx", action="store_true", help="also a bare forwarder on httpx")
    p.add_argument("--no-wrk", action="store_true", help="load with bench._load even if wrk is installed")
    p.add_argument("--profile", type=Path, help="py-spy each server in its first loaded run, stacks here")
    p.add_argument("--out", type=Path, help="JSON result file (default bench/results/gateway[-quick].json)")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.latency_seconds, args.warmup = 5.0, 2.0, 1.0
    wrk = None if args.no_wrk else shutil.which("wrk")
    if wrk is None and not args.no_wrk:
        print("wrk not found (Debian: apt-get install wrk): loading with bench._load, which costs more CPU",
              file=sys.stderr)  # fmt: skip
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        sys.exit("bench.gateway needs redis-server (Debian: apt-get install redis-server)")

    cache = Settings().cache_dir
    print(f"preparing {BUNDLED_MODEL} in {cache} ...", file=sys.stderr)
    resolve_model(BUNDLED_MODEL, cache)

    tmp = Path(tempfile.mkdtemp(prefix="tm-bench-gw-"))
    procs = Processes(tmp)
    try:
        with checkouts(args.compare, tmp) as others, database(args.database_url) as db_url:
            trees = [("gateway", ROOT)] + [(f"gateway@{label}", tree) for label, tree in others]
            result = run(args, tmp, procs, db_url, cache, wrk, redis_server, trees)
    finally:
        procs.stop()
    RESULTS.mkdir(exist_ok=True)
    out = args.out or RESULTS / ("gateway-quick.json" if args.quick else "gateway.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    problems = result["ledger"]["problems"]
    if problems:
        # An answered request that is not metered is lost money: fail, and keep the logs.
        sys.exit(f"the ledger does not match the answered requests ({'; '.join(problems)}); logs in {tmp}")
    shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def checkouts(specs: list[str], tmp: Path) -> Iterator[list[tuple[str, Path]]]:
    """(label, source tree) of each `--compare`: a directory as it is, or a git revision of
    this repository checked out into a worktree under `tmp`, removed (also from git's list
    of worktrees) when the run ends however it ends."""
    trees: list[tuple[str, Path]] = []
    added: list[Path] = []

    def git(*cmd: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, check=True
        ).stdout

    try:
        for spec in specs:
            if Path(spec).is_dir():
                tree = Path(spec).resolve()
                trees.append((tree.name, tree))
                continue
            try:
                sha = git("rev-parse", "--verify", "--short", f"{spec}^{{commit}}").strip()
            except subprocess.CalledProcessError:
                sys.exit(f"--compare {spec}: neither a directory nor a git revision of {ROOT}")
            tree = tmp / f"rev-{sha}"
            git("worktree", "add", "--detach", "--quiet", str(tree), sha)
            added.append(tree)
            trees.append((spec if spec == sha else f"{spec} ({sha})", tree))
        yield trees
    finally:
        for tree in added:
            with contextlib.suppress(subprocess.CalledProcessError):
                git("worktree", "remove", "--force", str(tree))


def run(
    args: argparse.Namespace,
    tmp: Path,
    procs: Processes,
    db_url: str,
    cache: Path,
    wrk: str | None,
    redis_server: str,
    trees: list[tuple[str, Path]],
) -> dict[str, Any]:
    redis_port = free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    redis_proc = procs.start(
        "redis",
        [redis_server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp)],
        dict(os.environ),
    )  # fmt: skip
    wait_redis(redis_port)
    tenant = asyncio.run(setup_tenant(db_url))

    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "REDIS_URL": redis_url,
        "TOKENMILL_SECRET_KEY": SECRET,
        "TOKENMILL_INTERNAL_TOKEN": INTERNAL,
        "TOKENMILL_HOME": str(tmp / "home"),
        "TOKENMILL_MODEL_CACHE": str(cache),
    }
    worker_port = free_port()
    worker = procs.start(
        "worker",
        [sys.executable, "-m", "bench._fake_worker", "--redis", redis_url,
         "--deployment", tenant.deployment_id, "--port", str(worker_port), "--token", INTERNAL],
        env,
    )  # fmt: skip
    cp_port = free_port()
    control = procs.start(
        "control-plane",
        [sys.executable, "-m", "tokenmill.cli", "control-plane"],
        {**env, "TOKENMILL_PORT": str(cp_port)},
    )
    gateways: list[tuple[str, int, str]] = []
    for i, (name, tree) in enumerate(trees):
        port = free_port()
        genv = {**env, "TOKENMILL_PORT": str(port), "TOKENMILL_SPOOL_DIR": str(tmp / f"spool-{i}")}
        # Run from the tree's own directory so its packages are imported (they come first on sys.path).
        proc = procs.start(name, [sys.executable, "-m", "tokenmill.cli", "gateway"], genv, cwd=tree)
        gateways.append((name, proc.pid, f"http://127.0.0.1:{port}"))
    bares: list[tuple[str, str, int, subprocess.Popen[bytes]]] = []  # target, process, port
    if not args.no_bare:
        for target, name, client in [("bare forwarder", "bare", "upstream")] + (
            [("bare forwarder (httpx)", "bare-httpx", "httpx")] if args.bare_httpx else []
        ):
            port = free_port()
            proc = procs.start(
                name,
                [sys.executable, "-m", "bench._forwarder", "--port", str(port), "--worker",
                 f"http://127.0.0.1:{worker_port}", "--token", INTERNAL, "--client", client],
                env,
            )  # fmt: skip
            bares.append((target, name, port, proc))

    chat = msgspec.json.encode(
        {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS}
    )
    # (status, request id) of every answer any gateway gave, readiness requests included; the
    # organisation is new, so its ledger holds exactly the requests of this run.
    answers: list[tuple[int, str]] = []
    unseen_bound = 0  # requests the gateways may have metered that no client saw answered
    sanity = []
    for name, _, url in gateways:
        r = wait_ready(f"{url}/v1/chat/completions", chat, tenant.secret, procs, answers=answers)
        sanity.append((name, r))
    first = sanity[0][1]
    limited = sorted(h for h in first.headers if h.startswith("x-ratelimit-"))
    body = first.json()
    prompt_tokens = body["usage"]["prompt_tokens"]
    print(
        f"gateway answers: {body['choices'][0]['message']['content']!r}, usage {body['usage']}, "
        f"headers {', '.join(limited)}",
        file=sys.stderr,
    )
    assert limited, "no x-ratelimit-* headers: limits are not on"
    generate = msgspec.json.encode(
        GenerateRequest(
            request_id="bench",
            prompt_token_ids=list(range(100, 100 + prompt_tokens)),
            sampling=SamplingParams(max_tokens=MAX_TOKENS),
        )
    )
    worker_target = Target(
        "worker (direct)", f"http://127.0.0.1:{worker_port}/generate", generate, INTERNAL, worker.pid
    )
    for _, _, port, _ in bares:
        wait_ready(f"http://127.0.0.1:{port}/v1/chat/completions", chat, "x", procs)

    bench = Bench(tmp, wrk)
    bench.watched = {"worker": worker.pid, "redis": redis_proc.pid, "control-plane": control.pid}
    for name, pid, _ in gateways:
        bench.watched[name] = pid
    for _, name, _, proc in bares:
        bench.watched[name] = proc.pid

    runs: list[Run] = []

    def measure(target: Target, profile: Path | None = None) -> None:
        nonlocal unseen_bound
        procs.check()
        gateway = target.name.startswith("gateway")
        mine = answers if gateway else None
        warm = bench.load(target, args.connections, args.warmup, mine)
        spies = []
        if profile is not None and target.pid is not None:
            profile.mkdir(parents=True, exist_ok=True)
            own = OWN.get(target.name, target.name).replace("@", "-")
            watch = [(own, target.pid)]
            if target.name == "gateway":  # and what the usage events cost downstream
                watch.append(("control-plane", control.pid))
            for name, pid in watch:
                spies.append(subprocess.Popen(
                    [PY_SPY, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                     "--nonblocking",
                     "--duration", str(int(args.seconds)), "--output", str(profile / f"{name}.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                ))  # fmt: skip
        loaded = bench.load(target, args.connections, args.seconds, mine)
        for spy in spies:
            spy.wait()
        single = bench.load(target, 1, args.latency_seconds, mine)
        if gateway:
            # At most one request per connection is in flight when a run stops, and each
            # failed one (connect, read, write errors, timeouts) may have been served.
            unseen_bound += sum(r.connections + sum(r.errors.values()) for r in (warm, loaded, single))
        for r in (loaded, single):
            runs.append(r)
            print(_line(r, target.name), file=sys.stderr)

    if bares:
        measure(worker_target)
    for target, _, port, proc in bares:
        measure(
            Target(target, f"http://127.0.0.1:{port}/v1/chat/completions", chat, "x", proc.pid), args.profile
        )
    for round_ in range(args.rounds):
        for name, pid, url in gateways if round_ % 2 == 0 else list(reversed(gateways)):
            profile = args.profile if round_ == 0 else None
            measure(Target(name, f"{url}/v1/chat/completions", chat, tenant.secret, pid), profile)

    # Every answered request is metered: wait for the ledger to catch up, then compare it with
    # the answers' request ids.
    deadline = time.monotonic() + args.ledger_wait
    while True:
        ledger, tokens = asyncio.run(ledger_ids(db_url, tenant.org_id))
        check = LedgerCheck.of(answers, ledger, unseen_bound)
        if not check.missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(
        f"\nledger: {check.metered} usage events for {check.answered} answered gateway requests "
        f"(and {check.unseen} for requests cut off when a load run stopped, {check.errored} for "
        "requests answered with an error)",
        file=sys.stderr,
    )
    for problem in check.problems:
        print(f"ERROR: {problem}", file=sys.stderr)

    table = report(runs, args.connections)
    medians = (
        compare(runs, args.connections, [name for name, _, _ in gateways]) if len(gateways) > 1 else None
    )
    if medians is not None:
        table += "\n\n" + medians[0]
    print(table)
    return {
        "conditions": {
            "cores": os.cpu_count(),
            "connections": args.connections,
            "seconds": args.seconds,
            "latency_seconds": args.latency_seconds,
            "prompt_tokens": prompt_tokens,
            "max_tokens": MAX_TOKENS,
            "load_generator": "wrk -t1" if wrk else "bench._load (uvloop)",
            "database": "local PostgreSQL, fresh database",
            "redis": "private redis-server, no persistence",
        },
        "runs": [asdict(r) for r in runs],
        "ledger": {
            "usage_events": check.metered,  # of the answered requests
            "answered": check.answered,
            "missing": check.missing,
            "cut_off": check.unseen,
            "errored": check.errored,
            "ledger_rows": len(ledger),
            "completion_tokens": tokens,
            "problems": check.problems,
        },
        "comparison": None if medians is None else medians[1],
        "table": table,
    }


def _line(r: Run, name: str) -> str:
    cpu = r.cpu_ms_per_request
    own = OWN.get(name, name)
    return (
        f"{name:<22} c={r.connections:<3} {r.rps:8.0f} req/s  p50 {r.p50_ms:6.2f} ms  "
        f"p99 {r.p99_ms:6.2f} ms  cpu {cpu.get(own, 0):.3f} ms/req  busy {r.machine_busy_cores:.2f} cores  "
        f"errors {r.errors or 0}"
    )


def report(runs: list[Run], connections: int) -> str:
    by = {(r.target, r.connections): r for r in runs}
    direct = by.get(("worker (direct)", connections)), by.get(("worker (direct)", 1))
    lines = [
        f"| target | req/s ({connections} conns) | p50 / p99 ms | added p50 / p99 ms | added p50 ms (1 conn) "
        "| own CPU ms/req | all processes CPU ms/req | cores busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seen: list[str] = []
    for r in runs:
        if r.connections == connections and r.target not in seen:
            seen.append(r.target)
    for target in seen:
        rs = [r for r in runs if r.target == target and r.connections == connections]
        ones = [r for r in runs if r.target == target and r.connections == 1]
        r = max(rs, key=lambda x: x.rps)  # the best of the rounds
        one = ones[rs.index(r)] if len(ones) == len(rs) else ones[-1]
        own = OWN.get(target, target)
        if direct[0] is not None and target != "worker (direct)":
            added = f"{r.p50_ms - direct[0].p50_ms:.2f} / {r.p99_ms - direct[0].p99_ms:.2f}"
            added1 = f"{one.p50_ms - direct[1].p50_ms:.3f}" if direct[1] is not None else "-"
        else:
            added, added1 = "-", "-"
        total = sum(v for k, v in r.cpu_ms_per_request.items() if k != "loadgen")
        lines.append(
            f"| {target} | {r.rps:,.0f} | {r.p50_ms:.2f} / {r.p99_ms:.2f} | {added} | {added1} "
            f"| {r.cpu_ms_per_request.get(own, 0):.3f} | {total:.3f} | {r.machine_busy_cores:.2f} |"
        )
    gws = [t for t in seen if t.startswith("gateway")]
    bare = [r for r in runs if r.target == "bare forwarder" and r.connections == connections]
    if gws and bare:
        g = max(
            (r for r in runs if r.target == "gateway" and r.connections == connections), key=lambda x: x.rps
        )
        b = bare[0]
        lines.append("")
        lines.append(
            f"gateway / bare forwarder: {g.rps / b.rps:.2f}x the requests/s, "
            f"{g.cpu_ms_per_request['gateway'] / b.cpu_ms_per_request['bare']:.2f}x the CPU per request"
        )
    lines.append("")
    lines.append("CPU ms per request of every process during each loaded run:")
    for target in seen:
        r = max((x for x in runs if x.target == target and x.connections == connections), key=lambda x: x.rps)
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r.cpu_ms_per_request.items() if v >= 0.0005)
        lines.append(f"- {target}: {parts}")
    return "\n".join(lines)


def compare(runs: list[Run], connections: int, names: list[str]) -> tuple[str, dict[str, Any]]:
    """Each gateway's median over the rounds of its loaded runs, and the first one (this tree)
    against each other: the table and its figures."""
    lines = [
        f"| gateway | rounds | own CPU ms/req, median (each round) | req/s ({connections} conns), median "
        "| p50 ms, median |",
        "|---|---|---|---|---|",
    ]
    figures: dict[str, Any] = {}
    for name in names:
        rs = [r for r in runs if r.target == name and r.connections == connections]
        cpu = [r.cpu_ms_per_request.get(name, 0.0) for r in rs]
        figures[name] = {
            "rounds": len(rs),
            "cpu_ms_per_request": cpu,
            "cpu_ms_per_request_median": statistics.median(cpu),
            "rps_median": statistics.median(r.rps for r in rs),
            "p50_ms_median": statistics.median(r.p50_ms for r in rs),
        }
        f = figures[name]
        each = ", ".join(f"{c:.3f}" for c in cpu)
        lines.append(
            f"| {name} | {len(rs)} | {f['cpu_ms_per_request_median']:.3f} ({each}) "
            f"| {f['rps_median']:,.0f} | {f['p50_ms_median']:.2f} |"
        )
    base = figures[names[0]]["cpu_ms_per_request_median"]
    lines.append("")
    for name in names[1:]:
        ratio = base / figures[name]["cpu_ms_per_request_median"]
        figures[name]["ratio_of_first"] = ratio
        lines.append(f"{names[0]} / {name}: {ratio:.3f}x the CPU per request (medians)")
    return "\n".join(lines), figures


if __name__ == "__main__":
    main()
