"""The scaling policy against a simulated fleet, compared with a static fleet sized for the peak.

    .venv/bin/python -m bench.autoscale_sim

Trace (seeded): Poisson arrivals at BASE_RATE req/s for 2 h, with a 10× burst of 60 s in
every 10 minutes (starting 5 minutes in). Requests have prompts of 64-512 tokens and
outputs of 16-128 (uniform): short chat turns.

Replica model: the engine's scheduler (workers/engine/scheduler.py) step by step, with step
times from bench/engine.py's measured figures. Each step decodes one token for every running
sequence, then spends the rest of the 2048-token budget on prompt chunks, oldest first,
admitting waiting prompts while fewer than 64 sequences run; it takes (prompt tokens /
prefill rate) + (running decodes / decode rate at that batch), the decode rate being
min(batch × single-stream rate, peak decode rate). A prompt's first token comes at the end
of the step that finishes it, so TTFT = queue wait + the steps until then. On a workload
like engine.py's this model gives ~113 useful tokens/s against the 117 measured (printed).
(The previous model let prefill run first and starve decode, so an overloaded replica kept
TTFT low by piling up sequences; the engine decodes first, so overload shows in TTFT.) The
KV pool (1 GiB, ~23k tokens of SmolLM2) holds 64 sequences of this trace's mean length, so
it is not modelled. The gateway sends each request to the least-loaded ready replica; a new
replica serves after a 30 s cold start; a replica scaled down drains first. Replica-seconds
count every replica from the moment it is asked for until it is gone, over the 2 h of the
trace for every fleet (the drain tail after it serves leftovers but is not counted).

The static baseline is the smallest static fleet that meets the TTFT goal on the same trace,
found by search (the cheapest comparator there is). The policy is called every 2 s with the
fleet's samples, including the arrival rate since the previous sample, and its targets come
from the replica model rather than a guess: the highest load at which a lone replica still
meets the TTFT goal, and its mean concurrency there (with rates so slow that no load does,
it says so, and why, and exits with status 1: there is then no target to give the policy).
It uses its seasonal forecast (`forecast=True`): it learns the burst period from the arrival
rates it observes during the run (nothing about the trace is configured, and it starts with
no history) and starts replicas a cold start ahead of a recurring burst. Printed besides: a reactive-only run
(forecast off), and an oracle that knows the trace, as a bound.

Result: MET on every seed (6, 1, 2, 3: TTFT ok 95.5/95.4/95.1/95.2% at 65.7/66.6/66.3/66.0%
of static 8's replica-seconds). Reacting alone cannot work: a burst's first 30 s must be
served by the replicas already up, so a reactive fleet needs a standing fleet near the
static one. The forecast fixes every burst from the third on (100% in time once the period
is learned), but no policy can see the first two coming (a period shows once a burst has
recurred); they lose 4.5-4.9% of the trace, against the 5% the goal allows, so those two
decide it. Three things make it: a floor of 3 (N+1 over the 2 the base load needs); a
4-s panic window, so the fleet panics on the first 2-s sample of a burst instead of one
policy interval later (with 6 s, seed 2 gets 94.7%); and sizing a backlog by the replicas
that drain it within a stable window (`drain_time`) rather than by its concurrency, with a
full KV cache no longer adding a replica a call while requests already wait: the queue that
builds on the old replicas during the cold start no longer holds a fleet of 20 for minutes
after an unforeseen burst (without those two rules the same settings cost 69.9-71.2%).
Margins are thin: seed 2 meets the TTFT goal by ~15 requests; a floor of 2 misses it on
seed 2 (94.99%, at 58.9%), a floor of 4 costs 74-75%. The oracle, over the policy's floor of 3,
reaches 95.4-95.9% at ~53%.
"""

from __future__ import annotations

import heapq
import json
import math
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from autoscaler.policy import PolicyConfig, PolicyState, Sample, decide

RESULTS = Path(__file__).parent / "results"

SEED = 6
CHECK_SEEDS = (1, 2, 3)  # the policy was tuned on SEED only; these check it was not tuned to it
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
DRAIN = 600.0  # simulated after the trace, so queued requests get their TTFT
TTFT_TARGET = 2.0  # s; the longest prompt alone prefills in ~0.8 s on this replica
GOAL_ATTAIN = 0.95
GOAL_RATIO = 0.70

# The policy's own settings: KPA's windows, targets filled in by calibrate(). The forecast
# provisions a cold start ahead, plus 10 s for its 10-s rate buckets and a policy interval.
# A floor of 3: the 2 replicas the base load needs plus one spare (N+1). A panic window of
# two policy intervals (KPA's default is 10% of the stable window, 6 s): a burst of arrivals
# is plain in one 2-s rate sample, and a 6-s mean dilutes it with the two before, so a fleet
# of 3 would panic a policy interval later. A backlog is drained over one stable window.
POLICY = PolicyConfig(
    stable_window=60.0,
    panic_window=4.0,
    panic_threshold=2.0,
    min_replicas=3,
    max_replicas=20,
    scale_down_cooldown=60.0,
    drain_time=60.0,
    forecast=True,
    forecast_lead=COLD_START + 15.0,
)


@dataclass(slots=True, frozen=True)
class Service:
    prefill: float  # tokens/s
    decode_one: float  # tokens/s of one sequence alone (weight-read bound)
    decode_peak: float  # aggregate tokens/s at a full batch
    max_seqs: int  # EngineConfig.max_num_seqs
    step_tokens: int  # EngineConfig.max_num_batched_tokens
    measured_tps: float  # bench/engine.py: useful tokens/s with continuous batching
    source: str

    def decode_time(self, batch: int) -> float:
        return max(1 / self.decode_one, batch / self.decode_peak) if batch else 0.0


def service() -> Service:
    """Per-replica rates from bench/results/engine.json, else README's measured figures (also
    when that file lacks a row the rates need: `bench.engine --engine-only` writes no cold
    TTFT, and a run of an older bench may lack others)."""
    path = RESULTS / "engine.json"
    if path.exists():
        res = json.loads(path.read_text())["results"]
        get = {k.split(" (")[0]: v for k, v in res.items()}
        ttft_off = [v for k, v in res.items() if k.startswith("mean TTFT") and "cache off" in k]
        rows = ("memory bandwidth", "engine decode-only steps", "engine, continuous batching")
        missing = [row for row in rows if row not in get] + ([] if ttft_off else ["mean TTFT (cache off)"])
        if not missing:
            return Service(
                prefill=532 / ttft_off[0],  # 512-token prefix + ~20 own tokens, prefilled cold
                decode_one=get["memory bandwidth"] * 1e9 / (4 * 134.5e6),
                decode_peak=get["engine decode-only steps"],
                max_seqs=64,
                step_tokens=2048,
                measured_tps=get["engine, continuous batching"],
                source=str(path),
            )
        print(f"{path} lacks {', '.join(missing)}: using the README's figures", file=sys.stderr)
    # README "Engine performance" (2-core CPU, SmolLM2-135M fp32): cold TTFT 0.84 s for a
    # ~532-token prompt; decode-only steps 169 tok/s at batch up to 64; 24 GB/s memory
    # bandwidth, so one stream reads 4 × 134.5M bytes of weights per token: ~45 tok/s;
    # continuous batching 117 useful tok/s. EngineConfig: 64 sequences, 2048 tokens a step.
    return Service(532 / 0.84, 24e9 / (4 * 134.5e6), 169.0, 64, 2048, 117.0, "README")


@dataclass(slots=True)
class Req:
    arrival: float
    prompt: int
    output: int
    left: int = 0  # prompt tokens still to prefill
    ttft: float | None = None
    burst: bool = False


def trace(seed: int) -> list[Req]:
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
    clock: float = 0.0  # when its next step may start
    waiting: deque[Req] = field(default_factory=deque)
    prefilling: list[Req] = field(default_factory=list)  # admitted, prompt not finished
    decoding: list[int] = field(default_factory=list)  # heap: the step count each one ends at
    steps: int = 0  # decode steps so far (every running sequence decodes once a step)
    draining: bool = False

    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def run(self, svc: Service, until: float, firsts: list[float]) -> None:
        """Run steps until `until`; the TTFT of every prompt finished goes to `firsts`. A
        step may end after `until`: its effects count now, its time is the replica's."""
        self.clock = max(self.clock, self.ready_at)
        while self.clock < until:
            room = self.running() < svc.max_seqs
            # Requests are routed a tick at a time; a step only admits those already there.
            nxt = self.waiting[0].arrival if self.waiting and room else math.inf
            if not self.prefilling and nxt > self.clock:
                if not self.decoding:  # idle until the next arrival
                    self.clock = min(max(self.clock, nxt), until)
                    continue
                # Decode-only steps cost the same while the batch holds: take them in one go,
                # up to the first sequence to finish, the next arrival or the end of the tick.
                dt = svc.decode_time(len(self.decoding))
                k = min(self.decoding[0] - self.steps, max(1, math.ceil((min(nxt, until) - self.clock) / dt)))
                self.steps += k
                self.clock += k * dt
                while self.decoding and self.decoding[0] <= self.steps:
                    heapq.heappop(self.decoding)
                continue
            self._mixed_step(svc, firsts)

    def _mixed_step(self, svc: Service, firsts: list[float]) -> None:
        batch = len(self.decoding)
        budget = svc.step_tokens - batch
        tokens = 0
        for r in self.prefilling:
            n = min(r.left, budget)
            r.left, budget, tokens = r.left - n, budget - n, tokens + n
        while budget > 0 and self.waiting and self.waiting[0].arrival <= self.clock:
            if self.running() >= svc.max_seqs:
                break
            r = self.waiting.popleft()
            n = min(r.left, budget)
            r.left, budget, tokens = r.left - n, budget - n, tokens + n
            self.prefilling.append(r)
        self.clock += svc.decode_time(batch) + tokens / svc.prefill
        if batch:
            self.steps += 1
            while self.decoding and self.decoding[0] <= self.steps:
                heapq.heappop(self.decoding)
        for r in self.prefilling:
            if not r.left:
                r.ttft = self.clock - r.arrival
                firsts.append(r.ttft)
                if r.output > 1:  # the prompt's step sampled the first token
                    heapq.heappush(self.decoding, self.steps + r.output - 1)
        self.prefilling = [r for r in self.prefilling if r.left]


def engine_workload_tps(svc: Service) -> float:
    """Useful tokens/s of the model on bench/engine.py's workload (64 requests at t = 0,
    prompts 32-512, outputs 16-256), to compare with the engine's measured figure."""
    rng = np.random.default_rng(1234)
    reqs = [Req(0.0, p, int(rng.integers(16, 257)), p) for p in rng.integers(32, 513, 64).tolist()]
    rep = Replica(0.0)
    rep.waiting.extend(reqs)
    while rep.load():
        rep.run(svc, rep.clock + 1.0, [])
    return sum(r.output for r in reqs) / rep.clock


@dataclass(slots=True, frozen=True)
class Calibration:
    rate: float  # req/s
    concurrency: float  # mean running + waiting at that rate
    attain: float


def one_replica(svc: Service, rate: float, seconds: float = 3600.0) -> Calibration:
    """One replica alone under Poisson arrivals at `rate` req/s: the share of requests that
    meet the TTFT target, and the mean concurrency."""
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.2)))
    arrivals = arrivals[arrivals < seconds]
    prompts = rng.integers(PROMPT[0], PROMPT[1] + 1, len(arrivals))
    outputs = rng.integers(OUTPUT[0], OUTPUT[1] + 1, len(arrivals))
    reqs = [Req(float(a), int(p), int(o), int(p)) for a, p, o in zip(arrivals, prompts, outputs, strict=True)]
    rep, i, conc = Replica(0.0), 0, 0
    ticks = int((seconds + DRAIN) / TICK)
    for k in range(ticks):
        while i < len(reqs) and reqs[i].arrival < (k + 1) * TICK:
            rep.waiting.append(reqs[i])
            i += 1
        rep.run(svc, (k + 1) * TICK, [])
        conc += rep.load()
    attain = float(np.mean([r.ttft is not None and r.ttft <= TTFT_TARGET for r in reqs])) if reqs else 1.0
    return Calibration(round(rate, 2), conc / ticks, attain)


def alone_attain(svc: Service) -> float:
    """The share of the trace's requests whose first token comes in time on a replica with
    nothing else to do (the prompt's prefill alone): the most one replica reaches at any rate,
    however low."""
    longest = math.floor(TTFT_TARGET * svc.prefill)  # prompt tokens prefilled within the target
    lo, hi = PROMPT
    return min(max(longest - lo + 1, 0), hi - lo + 1) / (hi - lo + 1)


def calibrate(svc: Service, seconds: float = 3600.0) -> Calibration | None:
    """The highest Poisson load (in steps of 0.05 req/s, from 0.5 up, or down when 0.5 is
    already too much) at which one replica alone meets the TTFT target for GOAL_ATTAIN of
    requests, and its mean concurrency there; None when no load of 0.05 req/s or more does."""
    best = None
    for rate in np.arange(0.5, 2.0, 0.05):
        cal = one_replica(svc, float(rate), seconds)
        if cal.attain < GOAL_ATTAIN:
            break
        best = cal
    if best is None and alone_attain(svc) >= GOAL_ATTAIN:
        for rate in np.arange(0.45, 0.04, -0.05):
            cal = one_replica(svc, float(rate), seconds)
            if cal.attain >= GOAL_ATTAIN:
                return cal
    return best


def unmeetable(svc: Service) -> str:
    """Why calibration found no load one replica serves within the goal."""
    goal = f"the TTFT goal ({TTFT_TARGET} s for >= {GOAL_ATTAIN:.0%} of requests)"
    alone = alone_attain(svc)
    if alone < GOAL_ATTAIN:
        return (
            f"one replica cannot meet {goal} at any rate: with rates from {svc.source} it prefills "
            f"{svc.prefill:.0f} prompt tokens/s, so even with nothing else to do only {alone:.1%} of "
            f"this trace's prompts ({PROMPT[0]}-{PROMPT[1]} tokens) get their first token in time, and "
            "more replicas do not make one prompt faster. No policy target exists; no fleet meets the goal."
        )
    return (
        f"one replica meets {goal} only below 0.05 req/s (rates from {svc.source}): no policy target "
        "in the range this simulation searches."
    )


@dataclass(slots=True)
class Run:
    name: str
    attain: float
    attain_burst: float
    p50_ttft: float
    p95_ttft: float
    replica_seconds: float
    peak_replicas: int
    mean_replicas: float
    misses_per_burst: list[int]
    season_learned_at: float | None = None  # when the forecast first trusted a period
    season_period: float | None = None
    attain_learned: float | None = None  # over the requests that arrived after that
    replica_seconds_learned: float | None = None  # and the replica-seconds after it


def base_floor(cfg: PolicyConfig) -> int:
    """Replicas the policy's target rate asks for at the base rate."""
    return math.ceil(BASE_RATE / (cfg.target_rate or 1.0))


def oracle(cfg: PolicyConfig, floor: int | None = None) -> Callable[[float], int]:
    """A bound, not a policy: replicas by a schedule that knows the trace. Between bursts
    `floor` (default: what the policy's target rate asks for at the base rate, or the policy's
    min_replicas if higher: the policy's own floor); the first two
    bursts (which no policy can see coming) get the burst's fleet at their very first
    instant, the later ones a cold start before they begin."""
    floor = max(base_floor(cfg), cfg.min_replicas) if floor is None else floor
    peak = math.ceil(BASE_RATE * BURST / (cfg.target_rate or 1.0))

    def desired(t: float) -> int:
        k, phase = divmod(t, BURST_EVERY)
        lead, tail = (0.0, COLD_START) if k < 2 else (COLD_START, 0.0)
        return peak if BURST_AT - lead <= phase < BURST_AT + BURST_LEN + tail else floor

    return desired


def simulate(
    svc: Service,
    reqs: list[Req],
    static: int | None,
    cfg: PolicyConfig,
    schedule: Callable[[float], int] | None = None,
) -> Run:
    """`static` replicas all along, or (None) the policy's fleet starting at its minimum, or
    the fleet a `schedule` of desired replicas asks for."""
    for r in reqs:
        r.left, r.ttft = r.prompt, None
    fleet = [Replica(0.0) for _ in range(static or max(cfg.min_replicas, 1))]
    pending: deque[Req] = deque()  # arrived while no replica was ready
    samples: deque[Sample] = deque()
    state = PolicyState()
    firsts: list[float] = []  # TTFTs since the last sample
    learned: tuple[float, float] | None = None
    rs_learned = 0.0
    i, arrived, rs, peak, end = 0, 0, 0.0, len(fleet), HOURS * 3600
    per_policy = round(POLICY_EVERY / TICK)
    for k in range(int((end + DRAIN) / TICK)):
        now = k * TICK
        if now >= end and i == len(reqs) and not pending and not any(r.load() for r in fleet):
            break
        ready = [r for r in fleet if r.ready_at <= now and not r.draining]
        while i < len(reqs) and reqs[i].arrival < now + TICK:
            pending.append(reqs[i])
            i, arrived = i + 1, arrived + 1
        while pending and ready:
            min(ready, key=Replica.load).waiting.append(pending.popleft())
        for r in fleet:
            if r.ready_at < now + TICK:
                r.run(svc, now + TICK, firsts)
        fleet = [r for r in fleet if not (r.draining and r.load() == 0)]
        if now < end:
            rs += len(fleet) * TICK
            rs_learned += len(fleet) * TICK if learned else 0.0
            peak = max(peak, len(fleet))
        if static is None and k % per_policy == per_policy - 1:
            t = now + TICK
            up = [r for r in fleet if r.ready_at <= now]
            running = sum(r.running() for r in up)
            waiting = len(pending) + sum(len(r.waiting) for r in up)
            kv = running / max(len(up) * svc.max_seqs, 1)
            p95 = float(np.percentile(firsts, 95)) if firsts else None
            samples.append(Sample(t, running, waiting, kv, p95, arrived / POLICY_EVERY))
            firsts, arrived = [], 0
            # The forecast learns from all the history it is given; the windows need only theirs.
            while not cfg.forecast and samples and samples[0].ts <= t - cfg.stable_window:
                samples.popleft()
            live = [r for r in fleet if not r.draining]
            if schedule is not None:
                desired = schedule(t)
            else:
                d = decide(cfg, samples, len(live), state, t)
                state, desired = d.state, d.desired
                if d.season is not None and learned is None:
                    learned = (t, d.season.period)
            for _ in range(desired - len(live)):
                fleet.append(Replica(t + COLD_START))
            for _ in range(len(live) - desired):
                # Cancel a replica still starting before draining one that serves.
                cold = [r for r in live if r.ready_at > t and not r.draining]
                victim = cold[-1] if cold else min((r for r in live if not r.draining), key=Replica.load)
                if cold:
                    fleet.remove(victim)
                victim.draining = True
    ttfts = np.array([r.ttft if r.ttft is not None else math.inf for r in reqs])
    burst = np.array([r.burst for r in reqs])
    period = np.array([int(r.arrival // BURST_EVERY) for r in reqs])
    ok = ttfts <= TTFT_TARGET
    after = np.array([learned is not None and r.arrival >= learned[0] for r in reqs])
    name = "autoscaled" if cfg.forecast else "reactive only"
    name = f"static {static}" if static else "oracle (bound)" if schedule else name
    return Run(
        name=name,
        attain=float(ok.mean()),
        attain_burst=float(ok[burst].mean()),
        p50_ttft=float(np.percentile(ttfts, 50)),
        p95_ttft=float(np.percentile(ttfts, 95, method="higher")),
        replica_seconds=rs,
        peak_replicas=peak,
        mean_replicas=rs / end,
        misses_per_burst=[int((~ok[burst & (period == p)]).sum()) for p in range(int(end // BURST_EVERY))],
        season_learned_at=learned[0] if learned else None,
        season_period=learned[1] if learned else None,
        attain_learned=float(ok[after].mean()) if after.any() else None,
        replica_seconds_learned=rs_learned if learned else None,
    )


@dataclass(slots=True)
class SeedResult:
    seed: int
    reqs: list[Req]
    statics: list[Run]  # the largest fleet that misses the goal and the smallest that meets it
    auto: Run
    bound: Run  # oracle(): what knowing the trace would reach over the same floor
    ratio: float
    met: bool
    floors: dict[int, tuple[Run, Run]] = field(default_factory=dict)  # (oracle, policy) over a floor

    @property
    def static(self) -> Run:
        return self.statics[-1]

    def share(self, run: Run) -> float:
        return run.replica_seconds / self.static.replica_seconds


def smallest_static(svc: Service, reqs: list[Req], cfg: PolicyConfig) -> list[Run]:
    """Static fleets from 1 up, to the smallest that meets the TTFT goal on this trace: the
    cheapest static fleet that does what the policy must do (sized for the peak)."""
    runs: list[Run] = []
    for n in range(1, 65):
        runs.append(simulate(svc, reqs, static=n, cfg=cfg))
        if runs[-1].attain >= GOAL_ATTAIN:
            return runs[-2:]
    raise RuntimeError("no static fleet of up to 64 replicas meets the TTFT goal")


def run_seed(svc: Service, seed: int, cfg: PolicyConfig) -> SeedResult:
    reqs = trace(seed)
    statics = smallest_static(svc, reqs, cfg)
    auto = simulate(svc, reqs, static=None, cfg=cfg)
    bound = simulate(svc, reqs, static=None, cfg=cfg, schedule=oracle(cfg))
    ratio = auto.replica_seconds / statics[-1].replica_seconds
    met = auto.attain >= GOAL_ATTAIN and ratio <= GOAL_RATIO
    return SeedResult(seed, reqs, statics, auto, bound, ratio, met)


def higher_floors(svc: Service, cfg: PolicyConfig, results: list[SeedResult]) -> dict[str, tuple[int, float]]:
    """Raise the floor (the oracle's, and the policy's min_replicas) a replica at a time until
    the policy meets the TTFT goal on every seed; per run, the first floor at which each
    does, with its worst replica-seconds ratio."""
    first: dict[str, tuple[int, float]] = {}
    print("\n  over a higher floor (worst seed)   oracle: TTFT ok  ratio    policy: TTFT ok  ratio")
    for f in range(base_floor(cfg) + 1, min(r.static.peak_replicas for r in results)):
        cells = []
        for res in results:
            res.floors[f] = (
                simulate(svc, res.reqs, static=None, cfg=cfg, schedule=oracle(cfg, f)),
                simulate(svc, res.reqs, static=None, cfg=replace(cfg, min_replicas=f)),
            )
        for i, who in enumerate(("oracle", "policy")):
            worst = min(r.floors[f][i].attain for r in results)
            cost = max(r.share(r.floors[f][i]) for r in results)
            cells.append(f"{worst:15.1%}  {cost:5.1%}")
            if who not in first and worst >= GOAL_ATTAIN:
                first[who] = (f, cost)
        print(f"    floor {f} replicas {'':14} {cells[0]}    {cells[1]}")
        if "policy" in first:
            break
    return first


def row(run: Run, base: Run) -> str:
    return (
        f"  {run.name:<14} {run.attain:8.1%} {run.attain_burst:10.1%} {run.p50_ttft:8.2f}s "
        f"{run.p95_ttft:8.2f}s {run.replica_seconds:10.0f} {run.replica_seconds / base.replica_seconds:7.1%} "
        f"{run.peak_replicas:5d} {run.mean_replicas:6.2f}"
    )


def main() -> None:
    svc = service()
    tps = engine_workload_tps(svc)
    cal = calibrate(svc)
    if cal is None:
        # Nothing to compare: the policy has no target, and the static fleets would be searched
        # in vain. A stale result must not stand for this run either.
        why = unmeetable(svc)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "autoscale_sim.json").write_text(
            json.dumps({"service": asdict(svc), "calibration": None, "error": why}, indent=2)
        )
        raise SystemExit(f"bench/autoscale_sim.py: calibration failed: {why}")
    # A slow replica's concurrency can round to 0 at one decimal, a target the policy refuses.
    target = round(cal.concurrency, 1) or float(f"{cal.concurrency:.2g}")
    cfg = replace(POLICY, target_rate=cal.rate, target_concurrency=target)
    print(
        f"\nbench/autoscale_sim.py  (base {BASE_RATE} req/s for {HOURS:g} h, {BURST:g}x bursts of "
        f"{BURST_LEN:g} s every {BURST_EVERY:g} s, cold start {COLD_START:g} s, TTFT target "
        f"{TTFT_TARGET} s for >= {GOAL_ATTAIN:.0%}, replica-seconds <= {GOAL_RATIO:.0%} of static)"
    )
    print(
        f"  replica model: rates from {svc.source}; on engine.py's workload {tps:.0f} useful tok/s "
        f"(measured {svc.measured_tps:.0f})"
    )
    print(
        f"  calibration: one replica meets the TTFT goal up to {cal.rate:.2f} req/s ({cal.attain:.1%} "
        f"in time), mean concurrency {cal.concurrency:.1f} -> policy target_rate {cfg.target_rate}, "
        f"target_concurrency {cfg.target_concurrency}"
    )
    print(
        "  policy: KPA windows + arrival rate + seasonal forecast (on: the period is learned online "
        f"from the arrival rates observed, nothing about the trace is configured; lead "
        f"{cfg.forecast_lead:g} s)"
    )

    main_run = run_seed(svc, SEED, cfg)
    reactive = simulate(svc, main_run.reqs, static=None, cfg=replace(cfg, forecast=False))
    head = ("TTFT ok", 8), ("in bursts", 10), ("p50 TTFT", 9), ("p95 TTFT", 9), ("replica-s", 10)
    head += ("ratio", 7), ("peak", 5), ("mean", 6)
    print(f"\n  seed {SEED}, {len(main_run.reqs)} requests")
    print(f"  {'fleet':<14} " + " ".join(f"{c:>{w}}" for c, w in head))
    for run in [*main_run.statics, reactive, main_run.bound, main_run.auto]:
        print(row(run, main_run.static))
    auto = main_run.auto
    print(f"  TTFT misses per burst (autoscaled): {auto.misses_per_burst}")

    results = [main_run, *(run_seed(svc, s, cfg) for s in CHECK_SEEDS)]
    print(
        "\n  seed  static  TTFT ok: static  auto  oracle   ratio  goal     first 2 bursts  "
        "period learned    after it: TTFT ok  ratio"
    )
    for res in results:
        a = res.auto
        early = sum(a.misses_per_burst[:2]) / len(res.reqs)
        learned, after = "never", ""
        if a.season_learned_at is not None and a.replica_seconds_learned is not None:
            learned = f"{a.season_period:g} s at {a.season_learned_at:.0f} s"
            span = res.static.peak_replicas * (HOURS * 3600 - a.season_learned_at)
            after = f"{a.attain_learned:17.1%}  {a.replica_seconds_learned / span:5.1%}"
        print(
            f"  {res.seed:4d}  {res.static.peak_replicas:6d}  {res.static.attain:14.1%}  {a.attain:5.1%}  "
            f"{res.bound.attain:6.1%}  {res.ratio:5.1%}  {'met' if res.met else 'NOT met':<7}  "
            f"{early:8.1%} missed  {learned:<17} {after}"
        )
    met = all(r.met for r in results)
    first = {} if met else higher_floors(svc, cfg, results)

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "autoscale_sim.json").write_text(
        json.dumps(
            {
                "trace": {
                    "seed": SEED,
                    "check_seeds": CHECK_SEEDS,
                    "hours": HOURS,
                    "base_rate": BASE_RATE,
                    "burst": BURST,
                    "burst_len": BURST_LEN,
                    "burst_every": BURST_EVERY,
                    "burst_at": BURST_AT,
                    "prompt": PROMPT,
                    "output": OUTPUT,
                    "cold_start": COLD_START,
                },
                "service": asdict(svc),
                "engine_workload_tps": tps,
                "calibration": asdict(cal),
                "ttft_target": TTFT_TARGET,
                "policy": asdict(cfg),
                "reactive_only": asdict(reactive),
                "seeds": [
                    {
                        "seed": r.seed,
                        "requests": len(r.reqs),
                        "static": [asdict(s) for s in r.statics],
                        "autoscaled": asdict(r.auto),
                        "oracle": asdict(r.bound),
                        "replica_seconds_ratio": r.ratio,
                        "met": r.met,
                        "higher_floors": {
                            f: {"oracle": asdict(o), "policy": asdict(p)} for f, (o, p) in r.floors.items()
                        },
                    }
                    for r in results
                ],
                "goals": {
                    "attain": GOAL_ATTAIN,
                    "ratio": GOAL_RATIO,
                    "met": met,
                    "met_on_seed": main_run.met,
                },
            },
            indent=2,
        )
    )
    print(
        f"\n  seed {SEED}: TTFT met for {auto.attain:.1%} (goal >= {GOAL_ATTAIN:.0%}) with "
        f"{main_run.ratio:.1%} of {main_run.static.name}'s replica-seconds (goal <= {GOAL_RATIO:.0%}): "
        f"{'met' if main_run.met else 'not met'}; seeds met: {sum(r.met for r in results)} of {len(results)}"
    )
    if met:
        print("  MET on every seed")
        return
    early = [sum(r.auto.misses_per_burst[:2]) / len(r.reqs) for r in results]
    bounds = [r.bound.attain for r in results]
    notes = [
        f"the {who} first meets the TTFT goal on every seed over {first[who][0]} replicas, at up to "
        f"{first[who][1]:.0%} of the static replica-seconds"
        if who in first
        else f"the {who} does not meet it on every seed over any floor below the static fleet"
        for who in ("oracle", "policy")
    ]
    print(
        f"  NOT MET on every seed. The first two bursts come before a period can be learned (it "
        f"shows once a burst has recurred), and until the replicas they call for are up, a cold "
        f"start later, the {base_floor(cfg)} replicas the base load needs cannot keep up: they lose "
        f"{min(early):.1%}-{max(early):.1%} of all requests, against the {1 - GOAL_ATTAIN:.0%} the "
        f"goal allows. An oracle that reacts to them at their first instant and foresees the rest, "
        f"over the same floor, reaches {min(bounds):.1%}-{max(bounds):.1%}; {notes[0]}; {notes[1]}."
    )


if __name__ == "__main__":
    main()
