"""Engine throughput and prefix-cache TTFT against HF transformers, on this machine's CPU.

    .venv/bin/python -m bench.engine            # the full workload (several minutes)
    .venv/bin/python -m bench.engine --quick    # a small one, to check that it runs

Workload (seeded): 64 requests, prompts of 32-512 random tokens, outputs of 16-256 tokens
with EOS ignored, all arriving at t = 0. HF `generate` runs them in static batches of 8 in
workload order (left padding, greedy); the engine gets them all at once. Only each
request's own tokens count as useful output (padding and overshoot excluded). The
shared-prefix workload sends 16 requests that share a 512-token system prompt one after
another, with the prefix cache on and off, and compares mean time to first token.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.engine.omp import SPIN, user_chose

if __name__ == "__main__" and not user_chose():
    # OpenMP threads as a worker's engine process runs them: set before torch loads libgomp.
    # Not when imported (bench/served.py), whose children are servers.
    os.environ.update(SPIN)

import torch

from tokenmill.modelstore import resolve_model
from workers.engine import EngineConfig, LLMEngine, SamplingParams

RESULTS = Path(__file__).parent / "results"


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int


def workload(
    seed: int, n: int, vocab: int, prompt_range: tuple[int, int], out_range: tuple[int, int]
) -> list[Request]:
    rng = random.Random(seed)
    # Ordinary tokens only: ids below 100 hold the special tokens of most vocabularies.
    return [
        Request(
            [rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*out_range),
        )
        for _ in range(n)
    ]


def run_hf(model_dir: Path, reqs: list[Request], batch: int) -> float:
    """Useful output tokens per second of HF `generate` in static batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        width = max(len(r.prompt) for r in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group])
        new = max(r.max_tokens for r in group)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
        useful += sum(r.max_tokens for r in group)
    return useful / (time.perf_counter() - start)


@dataclass(slots=True)
class EngineRun:
    tokens_per_s: float  # useful output tokens over the wall time
    decode_tokens_per_s: float  # over the pure decode steps only
    decode_batch: float  # mean sequences per pure decode step
    ttfts: list[float]  # seconds from the start to each request's first token
    output_tokens: int
    wall: float
    cpu: float  # CPU seconds of this process (all its threads) over the run
    # Cores busy (CPU seconds per wall second) over the pure decode steps and over the rest:
    # where the second core idles, so where a gain in occupancy could come from.
    decode_cores: float
    other_cores: float


def run_engine(engine: LLMEngine, reqs: list[Request]) -> EngineRun:
    """Every request arriving at once; throughput, decode-only throughput and TTFTs."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, r in enumerate(reqs):
        engine.add_request(
            str(i), r.prompt, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        )
    useful = 0
    decode_tokens, decode_seconds, decode_steps, decode_cpu = 0, 0.0, 0, 0.0
    first: dict[str, float] = {}
    while engine.has_unfinished():
        running_before = engine.scheduler.num_running
        t, c = time.perf_counter(), time.process_time()
        outs = engine.step()
        now = time.perf_counter()
        useful += sum(len(o.token_ids) for o in outs)
        for o in outs:
            first.setdefault(o.request_id, now - start)
        # A pure decode step: every running sequence got one token and nobody was admitted.
        if outs and len(outs) == running_before and engine.scheduler.num_waiting == 0:
            decode_tokens += len(outs)
            decode_seconds += now - t
            decode_steps += 1
            decode_cpu += time.process_time() - c
    total = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    return EngineRun(
        tokens_per_s=useful / total,
        decode_tokens_per_s=decode_tokens / decode_seconds if decode_seconds else 0.0,
        decode_batch=decode_tokens / decode_steps if decode_steps else 0.0,
        ttfts=sorted(first.values()),
        output_tokens=useful,
        wall=total,
        cpu=cpu,
        decode_cores=decode_cpu / decode_seconds if decode_seconds else 0.0,
        other_cores=(cpu - decode_cpu) / (total - decode_seconds) if total > decode_seconds else 0.0,
    )


def decode_at_batch(engine: LLMEngine, vocab: int, batch: int, context: int, steps: int) -> float:
    """Tokens/s of pure decode steps at exactly `batch` sequences of about `context` tokens
    (what the roofline below bounds); the prefills before them are not timed."""
    rng = random.Random(5)
    for i in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(context)]
        engine.add_request(
            f"d{i}", prompt, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        )
    while engine.scheduler.num_waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode step after the prefills: warm
    tokens, start = 0, time.perf_counter()
    for _ in range(steps):
        tokens += len(engine.step())
    seconds = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return tokens / seconds


def shared_prefix_ttft(config: EngineConfig, vocab: int, n: int, prefix_len: int, caching: bool) -> float:
    """Mean time to first token over n requests sharing a prefix, sent one after another."""
    config = copy.copy(config)
    config.enable_prefix_caching = caching
    engine = LLMEngine(config)
    rng = random.Random(7)
    system = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    ttfts = []
    for i in range(n):
        prompt = system + [rng.randrange(100, vocab) for _ in range(rng.randint(8, 32))]
        start = time.perf_counter()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        first = None
        while engine.has_unfinished():
            if engine.step() and first is None:
                first = time.perf_counter() - start
        ttfts.append(first or 0.0)
    # The first request always computes the prefix; the mean is over all, as a user sees it.
    return statistics.mean(ttfts)


def ceilings(threads: int) -> tuple[float, float]:
    """(fp32 matmul FLOP/s, memory bandwidth in bytes/s) measured here."""
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    reps, start = 20, time.perf_counter()
    for _ in range(reps):
        a @ b
    flops = 2 * n**3 * reps / (time.perf_counter() - start)
    src = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, start = 5, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    bandwidth = 2 * src.numel() * 4 * reps / (time.perf_counter() - start)  # read + write
    return flops, bandwidth


def engine_config(model_dir: Path, kv_cache_gib: float | None) -> EngineConfig:
    """The engine as a worker builds it (workers/main.py), with the KV memory asked for."""
    from tokenmill.settings import Settings

    settings = Settings()
    if kv_cache_gib is not None:
        settings.kv_cache_gib = kv_cache_gib
    try:
        from workers.main import engine_config as worker_config
    except ImportError:  # a source tree from before workers.main had it (bench/served.py --tokenmill)
        return EngineConfig(model=str(model_dir), kv_cache_gib=settings.kv_cache_gib)
    return worker_config(settings, model_dir)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small workload that runs in about a minute")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path("~/.tokenmill/models").expanduser())
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV memory (default: a worker's)")
    parser.add_argument(
        "--engine-only", action="store_true", help="only the engine's own figures (no HF, no prefix cache)"
    )
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = resolve_model("bundled:smollm2", args.cache)

    n, prompts, outs = (16, (32, 128), (8, 32)) if args.quick else (64, (32, 512), (16, 256))
    config = engine_config(model_dir, args.kv_cache_gib)
    engine = LLMEngine(config)
    if engine.prefault is not None:
        # The KV pool mapped in, as a served worker has it by its first request (its start and
        # warm-ups give the thread the time): not first-touch faults in the first steps.
        engine.prefault.join()
    vocab = engine.model_config.vocab_size
    params = sum(p.numel() for p in engine.model.parameters())
    reqs = workload(1234, n, vocab, prompts, outs)

    run = run_engine(engine, reqs)
    batch = min(n, engine.config.max_num_seqs)
    decode_tps = decode_at_batch(engine, vocab, batch, 64 if args.quick else 320, 8 if args.quick else 32)
    flops, bandwidth = ceilings(args.threads)
    # Decode roofline at that batch: every step reads all weights once (bytes) and does 2 FLOPs
    # per weight per sequence; whichever takes longer bounds the step.
    step = max(2 * params * batch / flops, 4 * params / bandwidth)
    roofline = batch / step
    rows = [
        ("engine, continuous batching (tok/s)", run.tokens_per_s),
        ("TTFT p50 (s)", run.ttfts[len(run.ttfts) // 2]),
        ("TTFT p99 (s)", run.ttfts[min(len(run.ttfts) - 1, int(0.99 * len(run.ttfts)))]),
        ("output tokens", float(run.output_tokens)),
        ("CPU s per 1k output tokens", run.cpu / max(1, run.output_tokens) * 1000),
        ("wall (s)", run.wall),
        ("engine decode-only steps (tok/s)", run.decode_tokens_per_s),
        ("mean batch of those steps", run.decode_batch),
        ("cores busy in those steps", run.decode_cores),
        ("cores busy in the other steps (prefill, mixed)", run.other_cores),
        (f"engine decode at batch {batch} (tok/s)", decode_tps),
        (f"decode roofline at batch {batch} (tok/s)", roofline),
        ("decode / roofline", decode_tps / roofline),
        ("fp32 matmul (GFLOP/s)", flops / 1e9),
        ("memory bandwidth (GB/s)", bandwidth / 1e9),
    ]
    if not args.engine_only:
        del engine
        hf_tps = run_hf(model_dir, reqs, batch=8)
        prefix_n, prefix_len = (4, 256) if args.quick else (16, 512)
        ttft_on = shared_prefix_ttft(config, vocab, prefix_n, prefix_len, True)
        ttft_off = shared_prefix_ttft(config, vocab, prefix_n, prefix_len, False)
        rows[1:1] = [
            ("HF generate, static batches of 8 (tok/s)", hf_tps),
            ("engine / HF", run.tokens_per_s / hf_tps),
        ]
        rows += [
            (f"mean TTFT, {prefix_n} x {prefix_len}-token shared prefix, cache off (s)", ttft_off),
            ("mean TTFT, cache on (s)", ttft_on),
            ("TTFT off / on", ttft_off / ttft_on),
        ]
    width = max(len(r[0]) for r in rows)
    print(f"\nbench/engine.py  (SmolLM2-135M fp32, {args.threads} threads, {n} requests)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value:10.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = args.json or RESULTS / ("engine-quick.json" if args.quick else "engine.json")
    out.write_text(
        json.dumps(
            {
                "workload": {"requests": n, "prompts": prompts, "outputs": outs, "seed": 1234},
                "threads": args.threads,
                "results": {name: value for name, value in rows},
                "requests": [asdict(r) | {"prompt": len(r.prompt)} for r in reqs],
            },
            indent=2,
        )
    )
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
