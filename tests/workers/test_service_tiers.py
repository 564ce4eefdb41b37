"""Service tiers on a busy worker: a `flex` request (`GenerateRequest.priority = 1`, what the
gateway sends for `service_tier: flex`) waits behind default ones submitted with it, on the
real SmolLM2 engine. The same scenario without priorities runs first-come first-served,
which shows the scenario itself tells the two orders apart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.modelstore import resolve_model
from tokenmill.protocol import GenerateRequest, SamplingParams
from workers.engine import EngineConfig
from workers.generator import EngineGenerator

pytestmark = pytest.mark.slow

# Sequences the engine runs at once: one, so the queued requests run strictly one after
# another and no two get their first token in the same step (a tie would make the order moot).
SLOTS = 1


@pytest.fixture(scope="module")
def generator(model_cache: Path) -> Iterator[EngineGenerator]:
    model = resolve_model("bundled:smollm2", model_cache)
    gen = EngineGenerator(EngineConfig(model=str(model), kv_cache_gib=0.25, max_num_seqs=SLOTS))
    yield gen
    gen.close()


def _request(gen: EngineGenerator, name: str, priority: int, max_tokens: int) -> GenerateRequest:
    prompt = gen.tokenizer.encode(f"Tell me a story about {name}.")
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return GenerateRequest(request_id=name, prompt_token_ids=prompt, sampling=sampling, priority=priority)


async def _ttft(gen: EngineGenerator, req: GenerateRequest, first: asyncio.Event | None = None) -> float:
    """Seconds from submission to the first generated token; runs the request to its end."""
    started, ttft = time.monotonic(), None
    async for delta in gen.generate(req):
        if ttft is None and delta.token_ids:
            ttft = time.monotonic() - started
            if first is not None:
                first.set()
    assert ttft is not None
    return ttft


async def _race(gen: EngineGenerator, late_priority: int) -> tuple[list[float], list[float]]:
    """Fill every slot with long requests; once they run, submit three requests at
    `late_priority`, then at once three default ones. TTFTs of (the first three, the others)."""
    running = [asyncio.Event() for _ in range(SLOTS)]
    blockers = [
        asyncio.create_task(_ttft(gen, _request(gen, f"busy {i}", 0, 48), running[i])) for i in range(SLOTS)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running)), 120)
    # Submitted first, so first-come first-served would serve them first.
    flex = [asyncio.create_task(_ttft(gen, _request(gen, f"flex {i}", late_priority, 4))) for i in range(3)]
    default = [asyncio.create_task(_ttft(gen, _request(gen, f"default {i}", 0, 4))) for i in range(3)]
    await asyncio.gather(*blockers)
    return list(await asyncio.gather(*flex)), list(await asyncio.gather(*default))


async def test_default_tier_gets_its_first_token_before_flex_submitted_with_it(
    generator: EngineGenerator,
) -> None:
    # Control: all at one priority, the earlier requests get their first tokens first.
    earlier, later = await _race(generator, late_priority=0)
    assert max(earlier) < min(later), (earlier, later)
    # Flex (batch priority) submitted first still goes behind every default request.
    flex, default = await _race(generator, late_priority=1)
    assert max(default) < min(flex), (default, flex)
    assert sum(default) / 3 < sum(flex) / 3
