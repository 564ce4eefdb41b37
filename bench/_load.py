"""A load generator for when `wrk` is not installed: keep-alive POSTs from N connections.

    python -m bench._load URL --connections 32 --seconds 20 --body FILE [--header 'name: value']...
        [--ids FILE]

Each connection sends the next request as soon as the previous answer is read, for the
given time, on uvloop with the gateway's own lean HTTP client (httpx would cost more CPU
than the server under test). Prints one line `BENCH-JSON {...}` with the fields the wrk
script of bench/gateway.py prints. It costs more CPU per request than wrk, and shares the
cores with the servers it measures.

With `--ids`, it writes one line per answer, `<status> <request id>`, like the wrk script of
bench/gateway.py: the request id is read from the completion's `id` (`chatcmpl-<hex>` for
request `req_<hex>`: the lean client does not keep headers), `-` for an answer without one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from urllib.parse import urlsplit

import msgspec
import uvloop

from gateway.upstream import Upstream, UpstreamError


class _Answer(msgspec.Struct):
    id: str = ""


_answer = msgspec.json.Decoder(_Answer)


def request_id(status: int, body: bytes) -> str:
    """The gateway's request id of an answer (`req_<hex>` from a completion's `<kind>-<hex>`)."""
    if not 200 <= status < 300:
        return "-"
    try:
        object_id = _answer.decode(body).id
    except msgspec.DecodeError:
        return "-"
    _, sep, tail = object_id.partition("-")
    return f"req_{tail}" if sep and tail else "-"


async def run(
    url: str,
    connections: int,
    seconds: float,
    body: bytes,
    headers: dict[str, str],
    answers: list[str] | None = None,
) -> dict[str, float]:
    u = urlsplit(url)
    address, path = f"{u.scheme}://{u.netloc}", u.path or "/"
    client = Upstream()
    latencies: list[float] = []
    errors = {"connect": 0, "read": 0, "write": 0, "status": 0, "timeout": 0}
    start = time.perf_counter()
    deadline = start + seconds

    async def connection() -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                async with client.post(address, path, body, headers) as r:
                    content = await r.read()
                    if not 200 <= r.status_code < 400:
                        errors["status"] += 1
                    if answers is not None:
                        answers.append(f"{r.status_code} {request_id(r.status_code, content)}\n")
            except UpstreamError:
                errors["read"] += 1
                await asyncio.sleep(0.01)
                continue
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(connection() for _ in range(connections)))
    elapsed = time.perf_counter() - start
    await client.aclose()
    latencies.sort()

    def pct(p: float) -> int:
        return (
            int(latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] * 1e6) if latencies else 0
        )

    mean = sum(latencies) / len(latencies) * 1e6 if latencies else 0.0
    return {
        "requests": len(latencies),  # every answer, error statuses included (as wrk counts)
        "duration_us": int(elapsed * 1e6),
        **errors,
        "p50_us": pct(50),
        "p90_us": pct(90),
        "p99_us": pct(99),
        "mean_us": mean,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--body", required=True, help="file holding the request body")
    p.add_argument("--header", action="append", default=[], help="'name: value', repeatable")
    p.add_argument("--ids", help="write '<status> <request id>' per answer to this file")
    args = p.parse_args()
    with open(args.body, "rb") as f:
        body = f.read()
    headers = dict(h.split(": ", 1) for h in args.header)
    answers: list[str] | None = [] if args.ids else None
    result = uvloop.run(run(args.url, args.connections, args.seconds, body, headers, answers))
    if args.ids and answers is not None:
        with open(args.ids, "w") as f:
            f.writelines(answers)
    print("BENCH-JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
