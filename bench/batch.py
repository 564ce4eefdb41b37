"""Interactive latency while a batch runs (issue 19): `/v1/batches` on spare capacity only.

    .venv/bin/python -m bench.batch                            # 2,000 lines (about 12 minutes here)
    .venv/bin/python -m bench.batch --lines 200 --duration 20  # a short one (about 2 minutes)

Acceptance: while a 2,000-line batch runs, interactive requests' TTFT p50 stays within 1.5x of
its value with no batch running.

One `tokenmill serve` (the bundled SmolLM2 on CPU, no embeddings worker) in a fresh
TOKENMILL_HOME, as bench/served.py starts it, with TOKENMILL_BATCH_CONCURRENCY from
`--concurrency`. After bench/served.py's warm-up, the same interactive load runs twice:
streamed chat completions (a short system prompt and a short seeded question, greedy,
`--interactive-max-tokens`), one sent every `--interval` seconds whatever the answers do (an
open loop: a slow server gets no relief from its clients), each timed to its first content
chunk by bench/routing.py's client.

- Phase A, the baseline: `--duration` seconds of it with nothing else running.
- Phase B: a JSONL file of `--lines` chat lines (seeded questions, `--max-tokens` each) is
  uploaded and a batch created with the `openai` SDK; once its first lines have run, the
  same load for `--duration` seconds (cut short if the batch ends first: only requests sent
  while it ran count). Then the batch is waited for, up to `--timeout`.

The batch is polled every half second throughout (`request_counts`, `usage.output_tokens`).
Reported: TTFT p50 / p95 of both phases and the ratio of the p50s (target <= 1.5); the
batch's lines/s and output tokens/s while it was `in_progress` (output tokens from the output
file's `usage`, checked against the batch's) and during phase B alone; its wall time from
creation to `completed`; and whether it completed with every line answered (request_counts
and the output file agree with the input). Writes bench/results/batch.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

from bench.routing import QUESTIONS, TOPICS, WORDS, Org, Result, chat
from bench.served import RESULTS, ROOT, Server, free_port, percentile, wait_http, warm_up
from tokenmill.modelstore import model_name, resolve_model
from tokenmill.settings import BUNDLED_MODEL

MODEL = BUNDLED_MODEL
SYSTEM = "You are a helpful support assistant. Answer in one or two sentences."
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
POLL = 0.5  # seconds between looks at the batch


def questions(seed: int, n: int) -> list[str]:
    """`n` short seeded questions, varied enough that the prefix cache shares little more than
    the system prompt and the chat template between them."""
    rng = random.Random(seed)
    return [
        f"{rng.choice(QUESTIONS).format(t=rng.choice(TOPICS))} "
        f"Mention the {rng.choice(WORDS)} and the {rng.choice(WORDS)}."
        for _ in range(n)
    ]


def batch_file(seed: int, lines: int, max_tokens: int) -> bytes:
    """The batch's input file: `lines` chat completion lines in OpenAI's batch format."""
    rows = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model_name(MODEL),
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i, q in enumerate(questions(seed, lines))
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


# --- the interactive load -------------------------------------------------------------------


@dataclass(slots=True)
class Phase:
    name: str
    requests: int
    errors: int
    ttft_p50: float
    ttft_p95: float
    ttft_mean: float
    seconds: float  # from the first request sent to the last one sent


def phase(name: str, results: list[Result], seconds: float) -> Phase:
    ok = [r.ttft for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    if errors:
        print(f"  {name}: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    return Phase(
        name=name,
        requests=len(results),
        errors=len(errors),
        ttft_p50=percentile(ok, 50),
        ttft_p95=percentile(ok, 95),
        ttft_mean=sum(ok) / len(ok) if ok else 0.0,
        seconds=seconds,
    )


async def interactive(
    http: httpx.AsyncClient,
    url: str,
    org: Org,
    prompts: list[str],
    duration: float,
    interval: float,
    max_tokens: int,
    keep_going: Callable[[], bool] = lambda: True,
) -> tuple[list[Result], float]:
    """One request every `interval` seconds for `duration` seconds (or until `keep_going` says
    no), each on its own: (results of all sent, seconds from the first sent to the last)."""
    tasks: list[asyncio.Task[Result]] = []
    start = time.perf_counter()
    last = start
    for i in range(max(1, int(duration / interval))):
        await asyncio.sleep(max(0.0, start + i * interval - time.perf_counter()))
        if not keep_going():
            break
        last = time.perf_counter()
        tasks.append(asyncio.create_task(chat(http, url, org, prompts[i % len(prompts)], max_tokens)))
    return list(await asyncio.gather(*tasks)), last - start


# --- the batch ------------------------------------------------------------------------------


@dataclass(slots=True)
class Progress:
    t: float  # seconds since the batch was created
    status: str
    completed: int
    failed: int
    output_tokens: int


class Follower:
    """Polls the batch every POLL seconds, keeping what it saw."""

    def __init__(self, sdk: AsyncOpenAI, batch_id: str, created: float) -> None:
        self.sdk = sdk
        self.batch_id = batch_id
        self.created = created
        self.seen: list[Progress] = []

    async def run(self) -> None:
        while True:
            b = await self.sdk.batches.retrieve(self.batch_id)
            counts, usage = b.request_counts, b.usage
            self.seen.append(
                Progress(
                    round(time.perf_counter() - self.created, 3),
                    b.status,
                    counts.completed if counts else 0,
                    counts.failed if counts else 0,
                    usage.output_tokens if usage else 0,
                )
            )
            if b.status in ENDED:
                return
            await asyncio.sleep(POLL)

    def running(self) -> bool:
        return bool(self.seen) and self.seen[-1].status == "in_progress"

    async def until(self, ok: Callable[[Progress], bool], task: asyncio.Task[None], within: float) -> bool:
        """Wait until a look at the batch satisfies `ok`; False if time ran out first or the
        batch ended without it."""
        deadline = time.monotonic() + within
        while not (self.seen and ok(self.seen[-1])):
            if task.done():
                task.result()  # a failed look is the run's failure
                return False
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True


def done(p: Progress) -> int:
    return p.completed + p.failed


def rate(seen: list[Progress], start: float, end: float) -> tuple[float, float, float]:
    """(lines/s, output tokens/s, seconds) between the looks nearest after `start` and before
    `end` (seconds since creation), from the batch's live counts."""
    inside = [p for p in seen if start <= p.t <= end]
    if len(inside) < 2 or inside[-1].t <= inside[0].t:
        return 0.0, 0.0, 0.0
    a, b = inside[0], inside[-1]
    dt = b.t - a.t
    return (done(b) - done(a)) / dt, (b.output_tokens - a.output_tokens) / dt, dt


async def check_output(sdk: AsyncOpenAI, batch: Any, lines: int) -> dict[str, Any]:
    """What the output file says: answered lines, their output tokens, and whether every input
    line has exactly one 200 answer."""
    answered = ok = tokens = 0
    ids: set[str] = set()
    if batch.output_file_id:
        text = (await sdk.files.content(batch.output_file_id)).text
        for raw in text.splitlines():
            row = json.loads(raw)
            answered += 1
            ids.add(row.get("custom_id") or "")
            response = row.get("response") or {}
            if response.get("status_code") == 200:
                ok += 1
                tokens += int(((response.get("body") or {}).get("usage") or {}).get("completion_tokens") or 0)
    counts = batch.request_counts
    matches = (
        batch.status == "completed"
        and counts is not None
        and counts.total == counts.completed == lines
        and counts.failed == 0
        and answered == ok == lines
        and ids == {f"line-{i}" for i in range(lines)}
    )
    return {"answered": answered, "ok": ok, "output_tokens": tokens, "complete_and_matching": matches}


# --- one run --------------------------------------------------------------------------------


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="home-", dir=work))
    port = free_port()
    env = {
        **os.environ,
        "TOKENMILL_HOME": str(home),
        "TOKENMILL_MODEL_CACHE": str(args.cache),
        "TOKENMILL_PORT": str(port),
        "TOKENMILL_TORCH_THREADS": str(args.threads),
        "TOKENMILL_EMBED_MODEL": "",  # no second worker sharing the cores
        "TOKENMILL_BATCH_CONCURRENCY": str(args.concurrency),
        "TOKENMILL_LOG_LEVEL": "WARNING",
    }
    for var in ("DATABASE_URL", "REDIS_URL", "TOKENMILL_INTERNAL_TOKEN", "TOKENMILL_SECRET_KEY"):
        env.pop(var, None)
    url = f"http://127.0.0.1:{port}"
    server = Server(
        "tokenmill", [sys.executable, "-m", "tokenmill.cli", "serve"], env, ROOT, work / "serve.log"
    )
    try:
        await wait_http(server, f"{url}/health", lambda h: h.get("workers", 0) >= 1)
        key = next((ln for ln in server.lines if ln.startswith("tm-")), "")
        if not key:
            raise RuntimeError(f"serve printed no admin key; see {server.log_path}")
        await warm_up(url, model_name(MODEL), {"authorization": f"Bearer {key}"})
        org = Org("interactive", key, SYSTEM)
        prompts = questions(args.seed + 1, 1000)
        async with (
            AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2, timeout=120.0) as sdk,
            httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as http,
        ):
            for q in prompts[:2]:  # the chat path (template, stream) warm too
                await chat(http, url, org, q, args.interactive_max_tokens)

            print(f"== phase A: interactive load alone, {args.duration:g} s", file=sys.stderr)
            results, seconds = await interactive(
                http, url, org, prompts, args.duration, args.interval, args.interactive_max_tokens
            )
            alone = phase("no batch", results, seconds)

            print(f"== phase B: a {args.lines}-line batch, and the same load", file=sys.stderr)
            data = batch_file(args.seed, args.lines, args.max_tokens)
            upload = await sdk.files.create(file=("batch.jsonl", data), purpose="batch")
            created = time.perf_counter()
            batch = await sdk.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            follower = Follower(sdk, batch.id, created)
            follow = asyncio.create_task(follower.run())
            try:
                # From its first answered lines: the runner's lines are in the engine by then.
                started = await follower.until(
                    lambda p: p.status in ENDED or (p.status == "in_progress" and done(p) >= 1),
                    follow,
                    args.timeout,
                )
                if not started or not follower.running():
                    raise RuntimeError(f"the batch did not get going: {follower.seen[-1:]}")
                b_start = time.perf_counter() - created
                results, seconds = await interactive(
                    http,
                    url,
                    org,
                    prompts,
                    args.duration,
                    args.interval,
                    args.interactive_max_tokens,
                    follower.running,
                )
                b_end = b_start + seconds
                loaded = phase("batch running", results, seconds)
                if seconds < args.duration - args.interval - 1:
                    print(f"  the batch ended {seconds:.0f} s into phase B", file=sys.stderr)
                print(f"== waiting for the batch (up to {args.timeout:g} s)", file=sys.stderr)
                ended = await follower.until(lambda p: p.status in ENDED, follow, args.timeout)
                if not ended:
                    print(f"  the batch did not end in time: {follower.seen[-1:]}", file=sys.stderr)
                    await sdk.batches.cancel(batch.id)
            finally:
                follow.cancel()
                await asyncio.gather(follow, return_exceptions=True)
            final = await sdk.batches.retrieve(batch.id)
            output = await check_output(sdk, final, args.lines)
    finally:
        server.stop()

    # The batch's in_progress time: from the first look that saw it running to the first that
    # saw it past (finalizing or ended), or to the last look if it never got past.
    seen = follower.seen
    running = [p for p in seen if p.status == "in_progress"]
    first = running[0] if running else Progress(0.0, "", 0, 0, 0)
    past = [p for p in seen if p.status != "in_progress" and p.t > first.t and running]
    counts = final.request_counts
    end = past[0] if past else (running[-1] if running else first)
    end_lines = counts.completed + counts.failed if past else done(end)
    end_tokens = output["output_tokens"] if past else end.output_tokens
    run_seconds = end.t - first.t
    during_b = rate(seen, b_start, b_end)
    return {
        "phases": [asdict(alone), asdict(loaded)],
        "ttft_p50_ratio": loaded.ttft_p50 / alone.ttft_p50 if alone.ttft_p50 else 0.0,
        "batch": {
            "id": final.id,
            "status": final.status,
            "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
            "usage_output_tokens": final.usage.output_tokens if final.usage else 0,
            "wall_seconds": next((p.t for p in seen if p.status in ENDED), 0.0),
            "to_in_progress_seconds": first.t,
            "running_seconds": run_seconds,
            "lines_per_s": (end_lines - done(first)) / run_seconds if run_seconds > 0 else 0.0,
            "output_tokens_per_s": (
                (end_tokens - first.output_tokens) / run_seconds if run_seconds > 0 else 0.0
            ),
            "phase_b": {
                "lines_per_s": during_b[0],
                "output_tokens_per_s": during_b[1],
                "seconds": during_b[2],
            },
            "output_file": output,
            "progress": [asdict(p) for p in seen],
        },
    }


def table(result: dict[str, Any], target: float) -> str:
    lines = [
        "| interactive load | requests | errors | TTFT p50 (s) | TTFT p95 (s) | TTFT mean (s) |",
        "|---|---|---|---|---|---|",
    ]
    for p in result["phases"]:
        lines.append(
            f"| {p['name']} | {p['requests']} | {p['errors']} | {p['ttft_p50']:.3f} | "
            f"{p['ttft_p95']:.3f} | {p['ttft_mean']:.3f} |"
        )
    ratio = result["ttft_p50_ratio"]
    verdict = "met" if 0 < ratio <= target else "NOT met"
    lines.append(f"\nTTFT p50 with / without the batch: {ratio:.2f} (target <= {target:g}: {verdict})\n")
    b = result["batch"]
    c, out = b["request_counts"], b["output_file"]
    lines += [
        "| batch | status | completed / failed / total | wall (s) | in_progress (s) | lines/s "
        "| output tok/s | during phase B: lines/s, tok/s | complete and matching |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {b['id']} | {b['status']} | {c['completed']} / {c['failed']} / {c['total']} | "
        f"{b['wall_seconds']:.1f} | {b['running_seconds']:.1f} | {b['lines_per_s']:.2f} | "
        f"{b['output_tokens_per_s']:.1f} | {b['phase_b']['lines_per_s']:.2f}, "
        f"{b['phase_b']['output_tokens_per_s']:.1f} | {'yes' if out['complete_and_matching'] else 'NO'} |",
    ]
    if out["output_tokens"] != b["usage_output_tokens"]:
        lines.append(
            f"  output tokens: {out['output_tokens']} in the output file, "
            f"{b['usage_output_tokens']} in the batch's usage"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=2000, help="lines of the batch")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each batch line")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of interactive load per phase")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between interactive requests")
    parser.add_argument("--interactive-max-tokens", type=int, default=16)
    parser.add_argument(
        "--concurrency", type=int, default=8, help="TOKENMILL_BATCH_CONCURRENCY: batch lines in flight"
    )
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--threads", type=int, default=2, help="TOKENMILL_TORCH_THREADS of the worker")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds to wait for the batch")
    parser.add_argument("--target", type=float, default=1.5, help="the acceptance's TTFT p50 ratio")
    parser.add_argument("--cache", type=Path, default=Path("~/.tokenmill/models").expanduser())
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON output (default bench/results/batch.json)"
    )
    args = parser.parse_args()
    resolve_model(MODEL, args.cache)  # converted once, before any clock
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    print(
        f"\nbench/batch.py  (SmolLM2-135M on CPU, {args.threads} threads; interactive: 1 request / "
        f"{args.interval:g} s for {args.duration:g} s, max_tokens {args.interactive_max_tokens}; batch: "
        f"{args.lines} lines, max_tokens {args.max_tokens}, concurrency {args.concurrency})"
    )
    print(table(result, args.target))
    RESULTS.mkdir(exist_ok=True)
    out = args.out or RESULTS / "batch.json"
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out.write_text(json.dumps({"config": config, **result}, indent=2))
    print(f"  written to {out}")
    return 0 if result["batch"]["output_file"]["complete_and_matching"] else 1


if __name__ == "__main__":
    sys.exit(main())
