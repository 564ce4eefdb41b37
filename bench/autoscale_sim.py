"""The scaling policy against a simulated fleet, compared with a static fleet sized for the peak.

    .venv/bin/python -m bench.autoscale_sim

Trace (seeded): Poisson arrivals at BASE_RATE req/s for 2 h, with a 10× burst of 60 s in
every 10 minutes (starting 5 minutes in). Requests have prompts of 64-512 tokens and
outputs of 16-128 (uniform): short chat turns. The base rate of 1 req/s keeps about one
replica busy and the bursts need about nine, so the fleet has room to grow and shrink.

Replica model (0.1 s ticks), from bench/engine.py's measured figures: a replica spends
its compute on prefill first, one prompt at a time at the measured prefill rate (as the
engine's scheduler admits waiting prompts before decoding), and the rest on one decode
step for all running sequences, at batch b an aggregate min(b × single-stream rate, peak
decode rate) tokens/s; at most `max_num_seqs` sequences run, the others queue.
TTFT = queue wait + prefill. The gateway routes each request to the least-loaded ready
replica. The policy is called every 2 s with the fleet's samples; a new replica serves
after a 30 s cold start; a replica scaled down drains its requests before it goes.
Replica-seconds count every replica from the moment it is asked for until it is gone.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from autoscaler.policy import PolicyConfig, PolicyState, Sample, decide

RESULTS = Path(__file__).parent / "results"

SEED = 6
HOURS = 2.0
BASE_RATE = 1.0  # req/s
BURST = 10.0  # × base rate
BURST_LEN = 60.0
BURST_EVERY = 600.0
BURST_AT = 300.0  # offset of the burst in each period
PROMPT = (64, 512)
OUTPUT = (16, 128)
COLD_START = 30.0
TICK = 0.1
POLICY_EVERY = 2.0
TTFT_TARGET = 2.0  # s; the slowest prompt alone prefills in ~0.8 s on this replica
GOAL_ATTAIN = 0.95
GOAL_RATIO = 0.70

# The autoscaler under test, tuned on this trace (only the policy, never the trace). No
# config found meets both goals: the first 30 s of each burst (half of its requests) must be
# served by the replicas already up, since new ones take 30 s to start, so meeting TTFT in
# bursts needs a standing fleet near the static one. This one came closest on attainment
# (a small grid over target concurrency 4-16, min replicas 1-5, with and without TTFT).
POLICY = PolicyConfig(
    target_concurrency=8.0,
    target_ttft=None,
    stable_window=60.0,
    panic_window=6.0,
    panic_threshold=2.0,
    min_replicas=5,
    max_replicas=16,
    scale_down_cooldown=60.0,
)


@dataclass(slots=True, frozen=True)
class Service:
    prefill: float  # tokens/s
    decode_one: float  # tokens/s of one sequence alone (weight-read bound)
    decode_peak: float  # aggregate tokens/s at a full batch
    max_seqs: int
    source: str


def service() -> Service:
    """Per-replica rates from bench/results/engine.json, else README's measured figures."""
    path = RESULTS / "engine.json"
    if path.exists():
        res = json.loads(path.read_text())["results"]
        get = {k.split(" (")[0]: v for k, v in res.items()}
        ttft_off = next(v for k, v in res.items() if k.startswith("mean TTFT") and "cache off" in k)
        return Service(
            prefill=532 / ttft_off,  # 512-token prefix + ~20 own tokens, prefilled cold
            decode_one=get["memory bandwidth"] * 1e9 / (4 * 134.5e6),
            decode_peak=get["engine decode-only steps"],
            max_seqs=64,
            source=str(path),
        )
    # README "Engine performance" (2-core CPU, SmolLM2-135M fp32): cold TTFT 0.84 s for a
    # ~532-token prompt; decode-only steps 169 tok/s at batch up to 64; 24 GB/s memory
    # bandwidth, so one stream reads 4 × 134.5M bytes of weights per token: ~45 tok/s.
    return Service(
        prefill=532 / 0.84, decode_one=24e9 / (4 * 134.5e6), decode_peak=169.0, max_seqs=64, source="README"
    )


@dataclass(slots=True)
class Req:
    arrival: float
    prompt: int
    output: int
    left: float = 0.0  # prompt tokens still to prefill
    ttft: float | None = None
    burst: bool = False


def trace(seed: int = SEED) -> list[Req]:
    rng = np.random.default_rng(seed)
    reqs: list[Req] = []
    for sec in range(int(HOURS * 3600)):
        in_burst = BURST_AT <= sec % BURST_EVERY < BURST_AT + BURST_LEN
        rate = BASE_RATE * (BURST if in_burst else 1.0)
        for t in np.sort(sec + rng.random(rng.poisson(rate))):
            p = int(rng.integers(PROMPT[0], PROMPT[1] + 1))
            reqs.append(Req(float(t), p, int(rng.integers(OUTPUT[0], OUTPUT[1] + 1)), p, burst=in_burst))
    return reqs


@dataclass(slots=True)
class Replica:
    ready_at: float
    queue: deque[Req] = field(default_factory=deque)  # head is prefilling when there is a slot
    decoding: list[float] = field(default_factory=list)  # heap of `served` at which each finishes
    served: float = 0.0  # tokens each running sequence has decoded since this replica began
    draining: bool = False

    def load(self) -> int:
        return len(self.queue) + len(self.decoding)

    def step(self, svc: Service, now: float, dt: float) -> None:
        budget = dt
        while self.queue and budget > 0 and len(self.decoding) < svc.max_seqs:
            head = self.queue[0]
            need = head.left / svc.prefill
            if need > budget:
                head.left -= budget * svc.prefill
                budget = 0.0
                break
            budget -= need
            head.ttft = now + (dt - budget) - head.arrival
            heapq.heappush(self.decoding, self.served + head.output)
            self.queue.popleft()
        if self.decoding and budget > 0:
            b = len(self.decoding)
            self.served += budget * min(b * svc.decode_one, svc.decode_peak) / b
            while self.decoding and self.decoding[0] <= self.served:
                heapq.heappop(self.decoding)


@dataclass(slots=True)
class Run:
    name: str
    attain: float
    attain_burst: float
    p95_ttft: float
    replica_seconds: float
    peak_replicas: int
    mean_replicas: float


def simulate(svc: Service, reqs: list[Req], static: int | None, cfg: PolicyConfig = POLICY) -> Run:
    """`static` replicas all along, or (None) the policy's fleet starting at its minimum."""
    for r in reqs:
        r.left, r.ttft = r.prompt, None
    fleet = [Replica(0.0) for _ in range(static or cfg.min_replicas)]
    pending: deque[Req] = deque()  # arrived while no replica was ready
    samples: deque[Sample] = deque()
    state = PolicyState()
    firsts: list[float] = []  # TTFTs since the last sample
    i, rs, peak, end = 0, 0.0, len(fleet), HOURS * 3600
    ticks = int(end / TICK) + int(600 / TICK)  # run on after the trace to drain the queues
    per_policy = round(POLICY_EVERY / TICK)
    for k in range(ticks):
        now = k * TICK
        ready = [r for r in fleet if r.ready_at <= now and not r.draining]
        while i < len(reqs) and reqs[i].arrival < now + TICK:
            pending.append(reqs[i])
            i += 1
        while pending and ready:
            min(ready, key=Replica.load).queue.append(pending.popleft())
        for r in fleet:
            if r.ready_at <= now:
                queued = [q for q in r.queue if q.ttft is None]
                r.step(svc, now, TICK)
                firsts.extend(q.ttft for q in queued if q.ttft is not None)
        fleet = [r for r in fleet if not (r.draining and r.load() == 0)]
        rs += len(fleet) * TICK
        peak = max(peak, len(fleet))
        if static is None and k % per_policy == per_policy - 1:
            t = now + TICK
            up = [r for r in fleet if r.ready_at <= now]
            running = sum(len(r.decoding) + min(len(r.queue), 1) for r in up)
            waiting = len(pending) + sum(max(len(r.queue) - 1, 0) for r in up)
            kv = sum(len(r.decoding) for r in up) / max(len(up) * svc.max_seqs, 1)
            p95 = float(np.percentile(firsts, 95)) if firsts else None
            samples.append(Sample(t, running, waiting, kv, p95))
            firsts = []
            while samples and samples[0].ts <= t - cfg.stable_window:
                samples.popleft()
            live = [r for r in fleet if not r.draining]
            d = decide(cfg, list(samples), len(live), state, t)
            state = d.state
            for _ in range(d.desired - len(live)):
                fleet.append(Replica(t + COLD_START))
            for _ in range(len(live) - d.desired):
                # Cancel a replica still starting before draining one that serves.
                cold = [r for r in live if r.ready_at > t and not r.draining]
                victim = cold[-1] if cold else min((r for r in live if not r.draining), key=Replica.load)
                if cold:
                    fleet.remove(victim)
                victim.draining = True
    ttfts = np.array([r.ttft if r.ttft is not None else math.inf for r in reqs])
    burst = np.array([r.burst for r in reqs])
    ok = ttfts <= TTFT_TARGET
    return Run(
        name=f"static {static}" if static else "autoscaled",
        attain=float(ok.mean()),
        attain_burst=float(ok[burst].mean()),
        p95_ttft=float(np.percentile(ttfts, 95, method="higher")),
        replica_seconds=rs,
        peak_replicas=peak,
        mean_replicas=rs / (ticks * TICK),
    )


def main() -> None:
    svc = service()
    reqs = trace()
    # The static baseline: the smallest fleet that meets the target for the peak, i.e. for
    # ≥ 95% of the requests that arrive during bursts.
    statics: list[Run] = []
    for n in range(1, 33):
        statics.append(simulate(svc, reqs, static=n))
        if statics[-1].attain_burst >= GOAL_ATTAIN:
            break
    base = statics[-1]
    auto = simulate(svc, reqs, static=None)
    ratio = auto.replica_seconds / base.replica_seconds
    met = auto.attain >= GOAL_ATTAIN and ratio <= GOAL_RATIO
    print(
        f"\nbench/autoscale_sim.py  ({len(reqs)} requests over {HOURS:g} h, base {BASE_RATE} req/s, "
        f"{BURST:g}x bursts of {BURST_LEN:g} s every {BURST_EVERY:g} s, cold start {COLD_START:g} s, "
        f"TTFT target {TTFT_TARGET} s; rates from {svc.source})"
    )
    cols = ("TTFT ok", 8), ("in bursts", 10), ("p95 TTFT", 9), ("replica-s", 10), ("peak", 5), ("mean", 6)
    print(f"  {'fleet':<12} " + " ".join(f"{c:>{w}}" for c, w in cols))
    for run in [*statics[-3:], auto]:
        print(
            f"  {run.name:<12} {run.attain:8.1%} {run.attain_burst:10.1%} {run.p95_ttft:8.2f}s "
            f"{run.replica_seconds:10.0f} {run.peak_replicas:5d} {run.mean_replicas:6.2f}"
        )
    print(
        f"  autoscaled / {base.name}: {ratio:.1%} of the replica-seconds (goal ≤ {GOAL_RATIO:.0%}), "
        f"TTFT met for {auto.attain:.1%} (goal ≥ {GOAL_ATTAIN:.0%}): {'MET' if met else 'NOT MET'}"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "autoscale_sim.json").write_text(
        json.dumps(
            {
                "trace": {
                    "seed": SEED,
                    "hours": HOURS,
                    "requests": len(reqs),
                    "base_rate": BASE_RATE,
                    "burst": BURST,
                    "burst_len": BURST_LEN,
                    "burst_every": BURST_EVERY,
                    "prompt": PROMPT,
                    "output": OUTPUT,
                    "cold_start": COLD_START,
                },
                "service": asdict(svc),
                "ttft_target": TTFT_TARGET,
                "policy": asdict(POLICY),
                "static": [asdict(r) for r in statics],
                "baseline": base.name,
                "autoscaled": asdict(auto),
                "replica_seconds_ratio": ratio,
                "goals": {"attain": GOAL_ATTAIN, "ratio": GOAL_RATIO, "met": met},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
