"""Prefix-cache-aware routing against round robin, on a real local fleet.

    .venv/bin/python -m bench.routing                    # the full workload (about 5 minutes here)
    .venv/bin/python -m bench.routing --quick            # a small one, to check that it runs
    .venv/bin/python -m bench.routing --engine vllm      # the same on vLLM workers (about 12 minutes)

For each routing policy a fresh stack is started: `tokenmill serve --no-worker` (gateway,
admin API and the in-memory bus, in a temporary TOKENMILL_HOME) with TOKENMILL_ROUTING set,
and three `tokenmill worker` processes on the bundled SmolLM2 (1 torch thread each, KV pool
sized to hold about three of the prompts) that publish heartbeats and KV events to the
server's internal bus endpoint. Eight organisations are created through the admin API, each
with its own ~512-token system prompt. A seeded sequence of chat requests (each
organisation's system prompt plus a short varied question, greedy, `max_tokens` 8 so that
prefill dominates) is sent by a few concurrent streaming clients. Measured: prefix-cache hit
tokens (the sum of `usage.prompt_tokens_details.cached_tokens`, cross-checked against the
workers' `vllm:prefix_cache_hits`) and the client-side time to the first content chunk.

`--engine vllm` runs the three workers as `tokenmill worker --engine vllm` (vLLM's CPU build
from `.venv-vllm`, `make vllm`), each bound to one core of its own (worker i on core i mod the
cores there are) with 1 GiB of KV cache, fp32 and eager (no torch.compile), and blocks of 32
tokens for the router and the workers alike (vLLM's CPU attention takes multiples of 32 only).
Their prefix caches reach the router through vLLM's KV events, restated in our block hashes by
workers/vllm/kv_events.py. 1 GiB of fp32 KV is 728 blocks here, 23,296 tokens: about eleven
~2,000-token system prompts. What the comparison needs is a fleet whose combined cache holds
every organisation's prompt while one worker's holds well under half of them, as in the
builtin variant (eight prompts, pools of three): so 27 organisations with 2,048-token system
prompts, 2.4 workers' worth of KV. Prefix-aware routing can keep nine organisations on each
worker, all cached; round robin sends each organisation everywhere, so each worker cycles
through all 27 and keeps a prompt only if its organisation came by recently, and every
organisation also misses once on every worker rather than once in all. 216 requests (8 per
organisation) make the first sights a small part of the prefix-aware run, as real traffic
(many requests per tenant) would; far more requests per organisation would also shrink round
robin's three first sights, far fewer would measure little but those.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.modelstore import model_name, resolve_model
from tokenmill.settings import BUNDLED_MODEL
from tokenmill.tokenization import Tokenizer

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
MODEL = BUNDLED_MODEL
BLOCK_SIZE = 16  # the platform default; the router and the workers must agree
STARTUP_TIMEOUT = 180.0  # seconds for the server and the workers to come up (model loads on 2 cores)

# The vLLM variant. Its CPU attention takes blocks of a multiple of 32 tokens only.
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_BLOCK_SIZE = 32
VLLM_KV_CACHE_GIB = 1  # per worker; vLLM's CPU backend takes whole GiB
# fp32 as the builtin engine runs; eager skips minutes of torch.compile per worker at start.
VLLM_ENGINE_ARGS: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "seed": 0}
# Three vLLM servers loading at once on 2 cores: 1-3 minutes each alone, more together.
VLLM_STARTUP_TIMEOUT = 900.0


@dataclass(frozen=True, slots=True)
class Engine:
    """What the workers run on, and the workload's defaults for it."""

    name: str  # builtin | vllm
    block_size: int
    startup_timeout: float
    orgs: int
    prefix_tokens: int
    requests: int
    quick_orgs: int  # --quick: enough repeats in 24 requests for hits to show


ENGINES = {
    "builtin": Engine("builtin", BLOCK_SIZE, STARTUP_TIMEOUT, 8, 512, 96, 8),
    "vllm": Engine("vllm", VLLM_BLOCK_SIZE, VLLM_STARTUP_TIMEOUT, 27, 2048, 216, 6),
}

# The words system prompts are made of: ordinary English, so the BPE tokenizer sees text
# like a real policy document rather than noise. (A text block reads better than a
# 150-item list literal.)
WORDS = """account action address agent answer apply approve area article assist balance
basic billing branch budget business call case change charge check claim client close
contact contract cost country credit customer data date deadline delivery department
detail device discount document email employee error escalate exchange expense export
feature fee file finance form free guarantee guide handle help holiday hour identity
import incident invoice issue item language late level licence limit local manager
market member message method month notice number offer office order owner package
partner password payment period permit phone plan policy price priority privacy process
product project purchase quality question quote receipt record refund region renewal
report request reserve resolve response return review right risk rule safety sale
schedule security service setting shipment signature size software staff standard
status storage store subscription supplier support system tax team term ticket time
training transfer travel upgrade user value vendor version warranty week weight window
work year""".split()  # noqa: SIM905

TOPICS = """refunds shipping invoices passwords upgrades discounts warranties returns
deliveries renewals exports holidays receipts licences deadlines""".split()  # noqa: SIM905
QUESTIONS = [
    "What is the rule for {t}?",
    "How do I ask about {t} this week?",
    "Can you summarise the policy on {t}?",
    "Who handles {t} for a new customer?",
    "Is there a fee for {t}?",
    "What should I do about late {t}?",
    "Give me one sentence on {t}.",
    "Which team owns {t}?",
]


@dataclass(slots=True)
class Org:
    name: str
    key: str
    system: str


@dataclass(slots=True)
class Result:
    org: str
    ttft: float
    latency: float
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


@dataclass(slots=True)
class PolicyRun:
    policy: str
    requests: int
    errors: int
    wall_seconds: float
    hit_tokens: int  # sum of usage.prompt_tokens_details.cached_tokens
    prompt_tokens: int
    worker_hit_tokens: int  # the same, from the workers' vllm:prefix_cache_hits
    mean_ttft: float
    p50_ttft: float
    p90_ttft: float
    per_worker_requests: list[int] = field(default_factory=list)
    kv_tokens: list[int | None] = field(default_factory=list)  # per worker, as vLLM logged it


def system_prompt(tok: Tokenizer, rng: random.Random, org: str, tokens: int) -> str:
    """About `tokens` tokens of policy text for one organisation (distinct per organisation)."""
    text = f"You are the support assistant of {org}. Follow the policy below exactly."
    while len(tok.encode(text)) < tokens:
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
        text += " " + " ".join(words).capitalize() + "."
    # Cut at the token boundary; decoding and re-encoding may move it by a token or so.
    return tok.decode(tok.encode(text)[:tokens])


def workload(orgs: list[Org], n: int, seed: int) -> list[tuple[Org, str]]:
    """`n` requests, the organisations equally often, in a seeded random order."""
    rng = random.Random(seed)
    order = [orgs[i % len(orgs)] for i in range(n)]
    rng.shuffle(order)
    return [(org, rng.choice(QUESTIONS).format(t=rng.choice(TOPICS))) for org in order]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_bind(workers: int) -> list[int]:
    """The core each vLLM worker binds its OpenMP thread to: worker i on the i-th allowed core,
    round the cores again when there are more workers than cores."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[i % len(cpus)] for i in range(workers)]


# --- the stack ------------------------------------------------------------------------------


class Stack:
    """One server and its workers, all subprocesses of this benchmark, in a temporary home."""

    def __init__(self, home: Path, cache: Path, policy: str, kv_cache_gib: float, engine: Engine) -> None:
        self.home = home
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "TOKENMILL_HOME": str(home),
            "TOKENMILL_MODEL_CACHE": str(cache),
            "TOKENMILL_PORT": str(self.port),
            "TOKENMILL_ROUTING": policy,
            "TOKENMILL_EMBED_MODEL": "",  # no embedding worker: only the chat fleet runs here
            "TOKENMILL_LOG_LEVEL": "WARNING",
            "TOKENMILL_BLOCK_SIZE": str(engine.block_size),
            "TOKENMILL_KV_CACHE_GIB": repr(kv_cache_gib),
            "TOKENMILL_TORCH_THREADS": "1",  # 3 workers on 2 cores: more threads only contend
            "OMP_NUM_THREADS": "1",
        }
        for name in ("REDIS_URL", "DATABASE_URL", "TOKENMILL_REDIS_URL", "TOKENMILL_DATABASE_URL"):
            self.env.pop(name, None)  # the embedded mode: SQLite and the in-memory bus
        if engine.name == "vllm":
            self.env.update(
                {
                    "TOKENMILL_VLLM_VENV": str(VLLM_VENV),
                    "TOKENMILL_VLLM_ENGINE_ARGS": json.dumps(VLLM_ENGINE_ARGS),
                    "TOKENMILL_VLLM_STARTUP_TIMEOUT_SECONDS": repr(engine.startup_timeout),
                }
            )
            for name in ("TOKENMILL_VLLM_URL", "TOKENMILL_VLLM_COMMAND", "VLLM_CPU_OMP_THREADS_BIND"):
                self.env.pop(name, None)  # each worker starts its own vLLM, bound below
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []
        self.worker_urls: list[str] = []
        self.worker_procs: list[subprocess.Popen[bytes]] = []

    def _spawn(
        self, args: list[str], log_name: str, env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[bytes]:
        log = open(self.home / log_name, "wb")  # noqa: SIM115 (closed in stop())
        self.logs.append(log)
        kw.setdefault("stdout", log)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", *args],
            env={**self.env, **(env or {})},
            stderr=log,
            **kw,
        )
        self.procs.append(proc)
        return proc

    def start_server(self) -> str:
        """Start `serve --no-worker`; return the bootstrap admin key it prints."""
        proc = self._spawn(["serve", "--no-worker"], "server.log", stdout=subprocess.PIPE)
        assert proc.stdout is not None
        secret = None
        for raw in proc.stdout:
            line = raw.decode().strip()
            if line.startswith("tm-"):
                secret = line
            if line.startswith("Tokenmill") and "serving" in line:
                break
        if secret is None:
            raise RuntimeError(f"the server printed no admin key; see {self.home / 'server.log'}")
        return secret

    def start_workers(self, deployment_id: str, count: int) -> None:
        secrets = json.loads((self.home / "secrets.json").read_text())
        self.env["TOKENMILL_INTERNAL_TOKEN"] = secrets["internal_token"]
        self.env["TOKENMILL_BUS_URL"] = f"{self.url}/internal/bus"
        bind = cpu_bind(count)
        for i in range(count):
            port = free_port()
            self.worker_urls.append(f"http://127.0.0.1:{port}")
            args = [
                "worker", "--model", MODEL, "--deployment", deployment_id,
                "--worker-id", f"bench-w{i}", "--port", str(port), "--exit-with-parent",
                "--engine", self.engine.name,
            ]  # fmt: skip
            env = None
            if self.engine.name == "vllm":
                # Left to the worker, every vLLM would bind the first TOKENMILL_TORCH_THREADS
                # cores of its affinity, i.e. all three core 0: one core each, in turn.
                env = {"VLLM_CPU_OMP_THREADS_BIND": str(bind[i])}
            self._spawn(args, f"worker-{i}.log", env)
            self.worker_procs.append(self.procs[-1])

    def worker_exits(self) -> list[tuple[int, int]]:
        """(worker index, exit code) of the workers that have exited."""
        return [(i, p.returncode) for i, p in enumerate(self.worker_procs) if p.poll() is not None]

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.home / name).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def kv_tokens(self, i: int) -> int | None:
        """The KV cache size (tokens) worker i's vLLM logged, None if it logged none."""
        try:
            text = (self.home / f"worker-{i}.log").read_text(errors="replace")
        except OSError:
            return None
        found = re.search(r"KV cache size: ([\d,]+) tokens", text)
        return int(found.group(1).replace(",", "")) if found else None

    def stop(self) -> None:
        # Workers first (they say goodbye on the server's bus), then the server.
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


class StartError(RuntimeError):
    """The server or its workers did not come up."""


async def wait_until(
    what: str, check: Any, within: float = STARTUP_TIMEOUT, failed: Any = lambda: None
) -> None:
    """Poll `check()` until true; `failed()` returning a message gives up at once."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if await check():
                return
        message = failed()
        if message:
            raise StartError(f"{what}: {message}")
        await asyncio.sleep(0.5)
    raise StartError(f"timed out after {within:.0f}s waiting for {what}")


async def worker_counters(http: httpx.AsyncClient, url: str, token: str) -> dict[str, float]:
    """The worker's prefix-cache counters and finished-request count."""
    r = await http.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"})
    r.raise_for_status()
    out = {"hits": 0.0, "queries": 0.0, "requests": 0.0}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == "vllm:prefix_cache_hits_total":
                out["hits"] += sample.value
            elif sample.name == "vllm:prefix_cache_queries_total":
                out["queries"] += sample.value
            elif sample.name == "vllm:e2e_request_latency_seconds_count":
                out["requests"] += sample.value
    return out


async def setup_orgs(
    http: httpx.AsyncClient, url: str, admin: str, systems: list[tuple[str, str]]
) -> list[Org]:
    """Organisations and member keys through the admin API, as an operator would."""
    headers = {"authorization": f"Bearer {admin}"}
    orgs = []
    for name, system in systems:
        r = await http.post(f"{url}/admin/v1/organizations", json={"name": name}, headers=headers)
        r.raise_for_status()
        org_id = r.json()["id"]
        r = await http.post(
            f"{url}/admin/v1/organizations/{org_id}/keys", json={"name": "bench"}, headers=headers
        )
        r.raise_for_status()
        orgs.append(Org(name, r.json()["secret"], system))
    return orgs


async def deployment_id(home: Path, name: str) -> str:
    """The served model's shared deployment (what workers register for), read from the
    server's database: the admin API does not list deployments yet."""
    from sqlalchemy import select

    from control_plane.catalog.models import Deployment
    from tokenmill.db import make_engine
    from tokenmill.settings import Settings

    engine = make_engine(Settings(home=home).db_url)
    try:
        async with engine.connect() as conn:
            query = select(Deployment.id).where(Deployment.name == name, Deployment.org_id.is_(None))
            return str((await conn.execute(query)).scalar_one())
    finally:
        await engine.dispose()


# --- the clients ----------------------------------------------------------------------------


async def chat(http: httpx.AsyncClient, url: str, org: Org, question: str, max_tokens: int) -> Result:
    body = {
        "model": model_name(MODEL),
        "messages": [{"role": "system", "content": org.system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {org.key}"}
    start = time.perf_counter()
    ttft: float | None = None
    first_chunk: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return Result(org.name, 0.0, 0.0, 0, 0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(org.name, 0.0, 0.0, 0, 0, str(chunk["error"]))
                if chunk.get("choices"):
                    now = time.perf_counter() - start
                    first_chunk = first_chunk if first_chunk is not None else now
                    if ttft is None and chunk["choices"][0]["delta"].get("content"):
                        ttft = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as exc:
        return Result(org.name, 0.0, 0.0, 0, 0, f"{type(exc).__name__}: {exc}")
    if usage is None:
        return Result(org.name, 0.0, 0.0, 0, 0, "no usage chunk")
    # A first token held back (an empty delta) still came with the first chunk's timing.
    ttft = ttft if ttft is not None else first_chunk or 0.0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Result(org.name, ttft, time.perf_counter() - start, usage["prompt_tokens"], cached)


async def drive(
    url: str, requests: list[tuple[Org, str]], concurrency: int, max_tokens: int
) -> tuple[list[Result], float]:
    """Send `requests` in order from `concurrency` clients; (results in order, wall seconds)."""
    results: list[Result | None] = [None] * len(requests)
    queue = iter(enumerate(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:

        async def client() -> None:
            for i, (org, question) in queue:
                results[i] = await chat(http, url, org, question, max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return [r for r in results if r is not None], wall


def copy_logs(home: Path, dest: Path, policy: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for log in home.glob("*.log"):
        (dest / f"{policy}-{log.name}").write_bytes(log.read_bytes())


# --- one policy -----------------------------------------------------------------------------


async def run_policy(
    policy: str,
    engine: Engine,
    cache: Path,
    kv_cache_gib: float,
    workers: int,
    systems: list[tuple[str, str]],
    n: int,
    seed: int,
    concurrency: int,
    max_tokens: int,
    keep_logs: Path | None,
) -> tuple[PolicyRun, list[Result]]:
    with tempfile.TemporaryDirectory(prefix=f"tm-bench-{policy}-") as tmp:
        home = Path(tmp)
        stack = Stack(home, cache, policy, kv_cache_gib, engine)
        try:
            admin = await asyncio.to_thread(stack.start_server)
            async with httpx.AsyncClient(timeout=30.0) as http:
                dep = await deployment_id(home, model_name(MODEL))
                stack.start_workers(dep, workers)
                token = stack.env["TOKENMILL_INTERNAL_TOKEN"]
                auth = {"authorization": f"Bearer {token}"}

                async def fleet_ready() -> bool:
                    r = await http.get(f"{stack.url}/health")
                    return r.json().get("workers") == workers

                def worker_died() -> str | None:
                    exits = stack.worker_exits()
                    if not exits:
                        return None
                    i, code = exits[0]
                    tail = stack.log_tail(f"worker-{i}.log")
                    return f"worker {i} exited with {code}; the end of its log:\n{tail}"

                await wait_until(
                    f"{workers} workers in the gateway's fleet view",
                    fleet_ready,
                    engine.startup_timeout,
                    worker_died,
                )
                kv_tokens = [stack.kv_tokens(i) for i in range(workers)]
                # Warm each worker (first-call allocations) directly, with a prompt nobody
                # shares: it leaves one or two unrelated blocks in each cache.
                for w in stack.worker_urls:
                    r = await http.post(
                        f"{w}/v1/completions",
                        json={"model": model_name(MODEL), "prompt": "Warm up.", "max_tokens": 2},
                        headers=auth,
                        timeout=120.0,
                    )
                    r.raise_for_status()
                orgs = await setup_orgs(http, stack.url, admin, systems)
                # A vLLM worker serves vLLM's counters as of its last poll (every heartbeat,
                # 1 s): read them only once a poll has seen everything.
                settle = 2.5 if engine.name == "vllm" else 0.5
                await asyncio.sleep(settle)
                before = [await worker_counters(http, w, token) for w in stack.worker_urls]
                results, wall = await drive(stack.url, workload(orgs, n, seed), concurrency, max_tokens)
                await asyncio.sleep(settle)
                after = [await worker_counters(http, w, token) for w in stack.worker_urls]
        finally:
            await asyncio.to_thread(stack.stop)
            if keep_logs is not None:
                await asyncio.to_thread(copy_logs, home, keep_logs, policy)
    ok = [r for r in results if r.error is None]
    ttfts = sorted(r.ttft for r in ok)
    run = PolicyRun(
        policy=policy,
        requests=len(results),
        errors=len(results) - len(ok),
        wall_seconds=wall,
        hit_tokens=sum(r.cached_tokens for r in ok),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        worker_hit_tokens=int(sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))),
        mean_ttft=statistics.mean(ttfts) if ttfts else float("nan"),
        p50_ttft=ttfts[len(ttfts) // 2] if ttfts else float("nan"),
        p90_ttft=ttfts[int(len(ttfts) * 0.9)] if ttfts else float("nan"),
        per_worker_requests=[int(a["requests"] - b["requests"]) for a, b in zip(after, before, strict=True)],
        kv_tokens=kv_tokens if engine.name == "vllm" else [],
    )
    return run, results


@contextlib.contextmanager
def _status(message: str) -> Iterator[None]:
    print(message, end="", flush=True, file=sys.stderr)
    start = time.perf_counter()
    yield
    print(f" {time.perf_counter() - start:.0f}s", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small workload, to check that it runs")
    parser.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="builtin",
        help="what the workers run on: our engine, or vLLM's CPU build (1 GiB of KV each)",
    )
    parser.add_argument("--requests", type=int, default=None, help="default: 96 builtin, 216 vllm")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--orgs", type=int, default=None, help="default: 8 builtin, 27 vllm")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=None,
        help="system prompt length (default: 512 builtin, 2048 vllm)",
    )
    parser.add_argument(
        "--pool-prompts", type=float, default=3.0, help="builtin: KV pool size, in whole prompts"
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--policies", default="round_robin,prefix")
    parser.add_argument("--cache", type=Path, default=Path("~/.tokenmill/models").expanduser())
    parser.add_argument("--logs", type=Path, default=None, help="keep the servers' and workers' logs here")
    args = parser.parse_args()
    engine = ENGINES[args.engine]
    n = 24 if args.quick else args.requests or engine.requests
    n_orgs = args.orgs or (engine.quick_orgs if args.quick else engine.orgs)
    prefix_tokens = args.prefix_tokens or engine.prefix_tokens
    bs = engine.block_size
    if engine.name == "vllm" and not (VLLM_VENV / ".installed").exists():
        sys.exit(f"vLLM's CPU build is not installed in {VLLM_VENV}: run `make vllm`")

    model_dir = resolve_model(MODEL, args.cache)
    tok = Tokenizer.from_dir(model_dir)
    rng = random.Random(args.seed)
    names = [f"org-{i:02d}" for i in range(n_orgs)]
    systems = [(name, system_prompt(tok, rng, name, prefix_tokens)) for name in names]

    # A typical prompt's footprint in blocks (system + question + output).
    from workers.engine.config import ModelConfig
    from workers.engine.kv_cache import block_bytes

    example = tok.encode(
        tok.apply_chat_template(
            [{"role": "system", "content": systems[0][1]}, {"role": "user", "content": QUESTIONS[0]}]
        )
    )
    prompt_blocks = -(-(len(example) + args.max_tokens) // bs)
    import torch

    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    per_block = block_bytes(cfg, bs, torch.float32)
    if engine.name == "vllm":
        # Fixed at 1 GiB; vLLM divides it into blocks of the same layout (fp32, all layers).
        kv_cache_gib: float = VLLM_KV_CACHE_GIB
        pool_blocks = VLLM_KV_CACHE_GIB * 2**30 // per_block
        pool_prompts = pool_blocks / prompt_blocks
    else:
        # Size the pool in prompts, then express it as TOKENMILL_KV_CACHE_GIB, which the
        # worker turns back into whole blocks.
        pool_prompts = args.pool_prompts
        pool_blocks = round(pool_prompts * prompt_blocks)
        kv_cache_gib = (pool_blocks + 0.5) * per_block / 2**30  # +0.5: rounding down lands on pool_blocks
    # The organisations' prompts in workers' worth of KV: above 1 a worker cannot hold them
    # all (round robin thrashes), under `workers` the fleet can (prefix-aware need not).
    working_set = n_orgs * prompt_blocks / pool_blocks

    runs: list[PolicyRun] = []
    details: dict[str, list[dict[str, Any]]] = {}
    for policy in args.policies.split(","):
        with _status(
            f"{policy}: starting a server and {args.workers} {engine.name} workers, {n} requests..."
        ):
            try:
                run, results = asyncio.run(
                    run_policy(
                        policy,
                        engine,
                        args.cache,
                        kv_cache_gib,
                        args.workers,
                        systems,
                        n,
                        args.seed,
                        args.concurrency,
                        args.max_tokens,
                        args.logs,
                    )
                )
            except StartError as exc:
                print(f"\n{policy}: {exc}", file=sys.stderr)
                sys.exit(1)
        runs.append(run)
        details[policy] = [asdict(r) for r in results]
        for r in results:
            if r.error:
                print(f"  {policy}: {r.org}: {r.error}", file=sys.stderr)
        logged = {t for t in run.kv_tokens if t is not None}
        if logged and logged != {pool_blocks * bs}:
            print(
                f"  {policy}: vLLM logged KV caches of {sorted(logged)} tokens, not {pool_blocks * bs}",
                file=sys.stderr,
            )

    if engine.name == "vllm":
        print(
            f"\nbench/routing.py --engine vllm  ({args.workers} vLLM workers x 1 core, SmolLM2-135M fp32 "
            f"eager, {VLLM_KV_CACHE_GIB} GiB KV each = {pool_blocks} blocks of {bs} = {pool_prompts:.1f} "
            f"prompts of {prompt_blocks} blocks; {n_orgs} orgs x {prefix_tokens}-token system prompt = "
            f"{working_set:.2f} workers' KV; {n} requests, {args.concurrency} concurrent, "
            f"max_tokens {args.max_tokens})"
        )
    else:
        print(
            f"\nbench/routing.py  ({args.workers} workers x 1 thread, SmolLM2-135M fp32, KV pool "
            f"{pool_blocks} blocks = {pool_prompts:g} prompts of {prompt_blocks} blocks; {n_orgs} orgs x "
            f"{prefix_tokens}-token system prompt; {n} requests, {args.concurrency} concurrent, "
            f"max_tokens {args.max_tokens})"
        )
    header = ("policy", "hit tokens", "(workers)", "hit rate", "mean TTFT")
    header += ("p50", "p90", "wall", "per worker")
    print("  " + "  ".join(f"{h:>11}" for h in header))
    for r in runs:
        cells = [
            r.policy,
            str(r.hit_tokens),
            str(r.worker_hit_tokens),
            f"{r.hit_tokens / max(r.prompt_tokens, 1):.0%}",
            f"{r.mean_ttft:.3f}s",
            f"{r.p50_ttft:.3f}s",
            f"{r.p90_ttft:.3f}s",
            f"{r.wall_seconds:.0f}s",
            "/".join(map(str, r.per_worker_requests)),
        ]
        print("  " + "  ".join(f"{c:>11}" for c in cells))
    by = {r.policy: r for r in runs}
    summary: dict[str, float] = {}
    if "prefix" in by and "round_robin" in by:
        pa, rr = by["prefix"], by["round_robin"]
        summary = {
            "hit_tokens_prefix_over_round_robin": pa.hit_tokens / max(rr.hit_tokens, 1),
            "mean_ttft_round_robin_over_prefix": rr.mean_ttft / pa.mean_ttft,
        }
        print(
            f"  prefix-aware / round robin: {summary['hit_tokens_prefix_over_round_robin']:.2f}x the hit "
            f"tokens, mean TTFT {pa.mean_ttft:.3f}s vs {rr.mean_ttft:.3f}s "
            f"({summary['mean_ttft_round_robin_over_prefix']:.2f}x lower)"
        )
    RESULTS.mkdir(exist_ok=True)
    stem = "routing" + ("-vllm" if engine.name == "vllm" else "") + ("-quick" if args.quick else "")
    out = RESULTS / f"{stem}.json"
    out.write_text(
        json.dumps(
            {
                "engine": engine.name,
                "workload": {
                    "engine": engine.name,
                    "engine_args": VLLM_ENGINE_ARGS if engine.name == "vllm" else {},
                    "workers": args.workers,
                    "torch_threads": 1,
                    "vllm_cpu_bind": cpu_bind(args.workers) if engine.name == "vllm" else [],
                    "orgs": n_orgs,
                    "prefix_tokens": prefix_tokens,
                    "block_size": bs,
                    "kv_cache_gib": kv_cache_gib,
                    "prompt_blocks": prompt_blocks,
                    "pool_blocks": pool_blocks,
                    "pool_prompts": pool_prompts,
                    "working_set_workers": working_set,
                    "requests": n,
                    "concurrency": args.concurrency,
                    "max_tokens": args.max_tokens,
                    "seed": args.seed,
                },
                "results": [asdict(r) for r in runs],
                "summary": summary,
                "requests": details,
            },
            indent=2,
        )
    )
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
