"""Fair scheduling across tenants on the real engine (SmolLM2-135M, fp32, this machine's CPU).

    .venv/bin/python -m bench.fairness            # about five minutes
    .venv/bin/python -m bench.fairness --quick    # a short trace, to check that it runs

Acceptance (issue 7): tenant A sends 10x tenant B's load; B's p95 TTFT stays within 1.5x of
its value alone, and total throughput stays within 5% of FCFS.

Workload (seeded): both tenants send the same kind of request, prefill-heavy (48-64 prompt
tokens of random ids, 4-8 output tokens with EOS ignored: classification, extraction, RAG
answers). Before each engine step the number of arrivals is Poisson, A's mean 10x B's (0.15
per step), for 300 steps; then the backlog drains. A alone asks for more prefill per step
than the token budget (80) leaves after the decodes, so under A + B a queue builds up.

Three runs over the same trace: B alone, and A + B under fcfs and under fair. Method:
- Arrivals follow engine steps, not the wall clock: before its step k a run adds what the
  trace puts at k. So a run's scheduling decisions do not depend on how fast the machine is.
- The three runs advance in lockstep, one step each in turn, and each keeps its own clock:
  the sum of the durations of its own steps. Load from other processes on the shared 2-core
  machine then hits all three alike instead of whichever ran at the time.
- TTFT: a run's clock from adding a request to the end of the step that returns its first
  token (also reported in steps, which is exact). Throughput: generated tokens over the
  run's clock at the end (all served the same trace; a work-conserving policy takes as long
  as another for the same work, give or take how decodes and prefills mix in the steps).

Why these sizes: on a CPU a step's time grows with the tokens in it (compute-bound), so B's
first token, which shares its step with A's work, can come no faster than a full step takes.
A token budget near one prompt keeps a full step close to B's own prefill step, as on a GPU,
where a step's time barely changes with its size up to the budget. What is left to measure is
the scheduler: whether B's prompt gets into the next step or waits behind A's backlog.

Writes bench/results/fairness.json (fairness-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.modelstore import resolve_model
from workers.engine import EngineConfig, LLMEngine, SamplingParams

RESULTS = Path(__file__).parent / "results"


@dataclass(slots=True)
class Request:
    tenant: str
    step: int  # arrives just before this engine step
    prompt: list[int]
    max_tokens: int


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's method: fine for the small means here.
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def trace(
    seed: int,
    steps: int,
    rate_b: float,
    ratio: float,
    vocab: int,
    tenants: str,
    prompts: tuple[int, int],
    outputs: tuple[int, int],
) -> list[Request]:
    """Arrivals of tenants "a" (rate_b * ratio per step) and "b" (rate_b), in step order."""
    rng = random.Random(seed)
    reqs = []
    for step in range(steps):
        for tenant, rate in (("a", rate_b * ratio), ("b", rate_b)):
            # Drawn for both tenants always, so B's requests are the same with or without A.
            for _ in range(_poisson(rng, rate)):
                prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(*prompts))]
                req = Request(tenant, step, prompt, rng.randint(*outputs))
                if tenant in tenants:
                    reqs.append(req)
    return reqs


@dataclass(slots=True)
class Run:
    """One engine serving one trace, a step at a time, on its own clock."""

    engine: LLMEngine
    pending: list[Request]  # reversed: the next arrival last
    step: int = 0
    clock: float = 0.0  # seconds spent in this run's own steps
    generated: int = 0
    added: dict[str, tuple[str, float, int]] = field(default_factory=dict)  # id -> tenant, clock, step
    ttft: dict[str, list[float]] = field(default_factory=lambda: {"a": [], "b": []})
    ttft_steps: dict[str, list[int]] = field(default_factory=lambda: {"a": [], "b": []})

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished()

    def tick(self) -> None:
        started = time.perf_counter()
        while self.pending and self.pending[-1].step <= self.step:
            r = self.pending.pop()
            rid = f"{r.tenant}{len(self.added)}"
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
            self.engine.add_request(rid, r.prompt, params, fairness_key=r.tenant)
            self.added[rid] = (r.tenant, self.clock, self.step)
        outs = self.engine.step()
        self.clock += time.perf_counter() - started
        for out in outs:
            self.generated += len(out.token_ids)
            if out.token_ids and out.completion_tokens == len(out.token_ids):  # its first tokens
                tenant, t0, s0 = self.added[out.request_id]
                self.ttft[tenant].append(self.clock - t0)
                self.ttft_steps[tenant].append(self.step - s0 + 1)
        self.step += 1

    @property
    def throughput(self) -> float:
        return self.generated / self.clock


def lockstep(runs: list[Run]) -> None:
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                r.tick()


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    # One thread: on a shared 2-core machine two OpenMP threads stall whenever the other core
    # is busy, which turns every figure into noise.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="steps with arrivals (default 300)")
    parser.add_argument("--rate-b", type=float, default=0.15, help="B's mean arrivals per step")
    parser.add_argument("--ratio", type=float, default=10.0, help="A's rate / B's rate")
    parser.add_argument("--max-num-seqs", type=int, default=48)
    parser.add_argument("--budget", type=int, default=80, help="max_num_batched_tokens")
    parser.add_argument("--prompts", type=int, nargs=2, default=(48, 64), help="prompt tokens, min max")
    parser.add_argument("--outputs", type=int, nargs=2, default=(4, 8), help="output tokens, min max")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--cache", type=Path, default=Path("~/.tokenmill/models").expanduser())
    args = parser.parse_args()
    steps = args.steps or (60 if args.quick else 300)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = resolve_model("bundled:smollm2", args.cache)

    def engine(policy: str) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(model_dir),
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.budget,
                kv_cache_gib=0.5,
                scheduling=policy,
            )
        )

    names = ("alone", "fcfs", "fair")
    engines = {name: engine("fcfs" if name == "fcfs" else "fair") for name in names}
    vocab = engines["fair"].model_config.vocab_size
    sizes = (tuple(args.prompts), tuple(args.outputs))
    traces = {
        name: trace(
            args.seed, steps, args.rate_b, args.ratio, vocab, "b" if name == "alone" else "ab", *sizes
        )
        for name in names
    }
    # Warm up (first-call allocations) on a few requests of another seed, then start cold.
    lockstep([Run(e, trace(args.seed + 1, 4, 1.0, 1.0, vocab, "ab", *sizes)[::-1]) for e in engines.values()])
    for e in engines.values():
        e.block_manager.reset_prefix_cache()
    runs = {name: Run(engines[name], traces[name][::-1]) for name in names}
    started = time.perf_counter()
    lockstep(list(runs.values()))
    wall = time.perf_counter() - started
    for name, r in runs.items():
        print(
            f"  {name:<5}: {r.step} steps, {r.clock:6.1f} s of its own, {r.throughput:6.1f} generated tok/s"
        )

    b_alone, b_fcfs, b_fair = (p95(runs[n].ttft["b"]) for n in names)
    tput_fcfs, tput_fair = runs["fcfs"].throughput, runs["fair"].throughput
    verdict = {
        "B p95 TTFT within 1.5x of alone": b_fair <= 1.5 * b_alone,
        "throughput within 5% of fcfs": tput_fair >= 0.95 * tput_fcfs,
    }
    n_a = sum(r.tenant == "a" for r in traces["fair"])
    n_b = len(traces["alone"])
    rows = [
        ("B p95 TTFT alone (s)", b_alone),
        ("B p95 TTFT with A, fcfs (s)", b_fcfs),
        ("B p95 TTFT with A, fair (s)", b_fair),
        ("fair / alone (<= 1.5)", b_fair / b_alone),
        ("fcfs / alone", b_fcfs / b_alone),
        ("B p95 TTFT alone (steps)", p95(runs["alone"].ttft_steps["b"])),
        ("B p95 TTFT with A, fcfs (steps)", p95(runs["fcfs"].ttft_steps["b"])),
        ("B p95 TTFT with A, fair (steps)", p95(runs["fair"].ttft_steps["b"])),
        ("A p95 TTFT, fcfs (s)", p95(runs["fcfs"].ttft["a"])),
        ("A p95 TTFT, fair (s)", p95(runs["fair"].ttft["a"])),
        ("throughput fcfs (generated tok/s)", tput_fcfs),
        ("throughput fair (generated tok/s)", tput_fair),
        ("fair / fcfs (>= 0.95)", tput_fair / tput_fcfs),
        ("steps fcfs", runs["fcfs"].step),
        ("steps fair", runs["fair"].step),
    ]
    width = max(len(name) for name, _ in rows)
    print(
        f"\nbench/fairness.py  (SmolLM2-135M fp32, {args.threads} thread(s); {n_a} requests of A, {n_b} of B "
        f"over {steps} steps; budget {args.budget}, max_num_seqs {args.max_num_seqs}; {wall:.0f} s)"
    )
    for name, value in rows:
        print(f"  {name:<{width}}  {value:10.3f}")
    for name, ok in verdict.items():
        print(f"  {name:<{width}}  {'MET' if ok else 'NOT MET':>10}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("fairness-quick.json" if args.quick else "fairness.json")
    out.write_text(
        json.dumps(
            {
                "workload": {
                    "steps": steps,
                    "rate_b": args.rate_b,
                    "ratio": args.ratio,
                    "requests_a": n_a,
                    "requests_b": n_b,
                    "prompt_tokens": args.prompts,
                    "output_tokens": args.outputs,
                    "seed": args.seed,
                },
                "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.budget},
                "threads": args.threads,
                "results": dict(rows),
                "acceptance": {name: "MET" if ok else "NOT MET" for name, ok in verdict.items()},
                "ttft_b_seconds": {name: runs[name].ttft["b"] for name in names},
            },
            indent=2,
        )
    )
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
