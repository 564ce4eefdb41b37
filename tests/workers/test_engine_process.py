"""The engine in a process of its own (`EngineGenerator(process=True)`, what a served worker
runs) against the same engine on a thread: the same tokens, aborts, refusals, load figures and
prefix-cache events, and requests failing (not hanging) when the engine process dies."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.test_engine import _byte_tokenizer
from tokenmill.protocol import GenerateDelta, GenerateRequest, SamplingParams
from workers.engine import EngineConfig
from workers.generator import EngineGenerator


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("tiny-process")
    hf.save_pretrained(path)
    _byte_tokenizer(path)
    return path


def _config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), num_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def pair(tiny: Path) -> Iterator[tuple[EngineGenerator, EngineGenerator]]:
    thread, process = EngineGenerator(_config(tiny)), EngineGenerator(_config(tiny), process=True)
    yield thread, process
    thread.close()
    process.close()


def _requests(n: int, seed: int = 1) -> list[GenerateRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(12)]
    return [
        GenerateRequest(
            request_id=f"r{i}",
            prompt_token_ids=shared + [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))],
            sampling=SamplingParams(
                max_tokens=rng.randint(1, 12),
                temperature=rng.choice([0.0, 0.8]),
                seed=i,
                ignore_eos=True,
                stop=["zz"] if i % 3 == 0 else [],
            ),
        )
        for i in range(n)
    ]


async def _run(gen: EngineGenerator, req: GenerateRequest) -> list[GenerateDelta]:
    return [d async for d in gen.generate(req)]


def _summary(deltas: list[GenerateDelta]) -> tuple[list[int], str, str | None, int]:
    last = deltas[-1]
    return (
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        last.finish_reason,
        (last.completion_tokens),
    )


async def test_same_outputs_as_on_a_thread(pair: tuple[EngineGenerator, EngineGenerator]) -> None:
    thread, process = pair
    reqs = _requests(12)
    # The first request alone, then the rest together: which requests share a step (and so
    # cannot hit each other's blocks) would otherwise depend on timing, not on the engine.
    on_thread = [await _run(thread, reqs[0]), *await asyncio.gather(*(_run(thread, r) for r in reqs[1:]))]
    in_process = [await _run(process, reqs[0]), *await asyncio.gather(*(_run(process, r) for r in reqs[1:]))]
    assert [_summary(d) for d in in_process] == [_summary(d) for d in on_thread]
    assert all(_summary(d)[2] in ("length", "stop") for d in in_process)
    # Both engines computed the shared prefix once and served it from the cache after.
    assert process.prefix_cache_hits == thread.prefix_cache_hits > 0
    assert process.prefix_cache_queries == thread.prefix_cache_queries

    # The same blocks stored; in what order the concurrent eleven's blocks were stored follows
    # the order in which they reached the engine, which is timing (seen to differ once in a run).
    def stored(gen: EngineGenerator) -> list[tuple[str, ...]]:
        return sorted(tuple(op.hashes) for op in gen.drain_kv_events() if op.op == "stored")

    assert stored(process) == stored(thread) != []
    assert process.running == 0 and process.waiting == 0
    assert process.kv_usage == thread.kv_usage


async def test_abort_frees_the_engine(pair: tuple[EngineGenerator, EngineGenerator]) -> None:
    _, process = pair
    long = GenerateRequest(
        request_id="long",
        prompt_token_ids=list(range(10, 30)),
        sampling=SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
    )
    stream = process.generate(long)
    first = await anext(stream)
    assert first.token_ids
    await stream.aclose()  # the client went away
    for _ in range(200):
        if process.running == 0 and process.waiting == 0:
            break
        await asyncio.sleep(0.02)
    assert process.running == 0 and process.waiting == 0
    # And it serves the next request as usual.
    assert _summary(await _run(process, _requests(1, seed=9)[0]))[2] is not None


async def test_refused_request_raises(pair: tuple[EngineGenerator, EngineGenerator]) -> None:
    _, process = pair
    # As long as the context (256): the engine refuses it, in its process, and says why here.
    req = GenerateRequest(request_id="big", prompt_token_ids=[5] * 256, sampling=SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="context length is 256"):
        await _run(process, req)


async def test_engine_death_fails_requests(tiny: Path) -> None:
    gen = EngineGenerator(_config(tiny), process=True)
    try:
        req = GenerateRequest(
            request_id="doomed",
            prompt_token_ids=list(range(10, 20)),
            sampling=SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
        )
        stream = gen.generate(req)
        await anext(stream)
        os.kill(gen._proc._proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process exited"):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
        # And what comes after fails at once rather than waiting for an engine that is gone.
        with pytest.raises(RuntimeError, match="engine process exited"):
            async with asyncio.timeout(5):
                await _run(gen, _requests(1)[0])
    finally:
        gen.close()


async def test_engine_ignores_signals_meant_for_the_worker(tiny: Path) -> None:
    """Ctrl-C reaches the whole process group: the engine keeps serving the requests the worker
    drains, and goes when the worker closes it."""
    gen = EngineGenerator(_config(tiny), process=True)
    try:
        pid = gen._proc._proc.pid
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
        assert _summary(await _run(gen, _requests(1, seed=4)[0]))[2] is not None
        assert gen._proc._proc.is_alive()
    finally:
        gen.close()
    assert not gen._proc._proc.is_alive()


def test_engine_process_spins_openmp_briefly_unless_the_user_chose(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine process starts with OpenMP threads that spin a short while between regions,
    then sleep (libgomp's long default spin took the cores the step's own thread needed; sleeping
    at once paid a wake-up per matmul); a user's own OpenMP wait setting is kept."""
    from workers.engine.omp import spin_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    gen = EngineGenerator(_config(tiny), process=True)
    try:  # what the child's libgomp read as it started
        environ = Path(f"/proc/{gen._proc._proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        gen.close()
    assert b"GOMP_SPINCOUNT=30000" in environ and not any(v.startswith(b"OMP_WAIT_POLICY=") for v in environ)
    assert "GOMP_SPINCOUNT" not in os.environ  # the server's own environment is left as it was
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    with spin_env():
        assert os.environ["GOMP_SPINCOUNT"] == "1000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with spin_env():
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ
