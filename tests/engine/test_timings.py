"""What the engine records of each sequence's life (arrived, first scheduled, first token,
finished), on its last output only: the worker's queue, prefill and decode spans (issue 20)
are built from these, so the step loop never calls into tracing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.engine.conftest import TinyModel
from tests.engine.test_engine import _byte_tokenizer
from workers.engine import LLM, SamplingParams
from workers.engine.engine import Output


@pytest.fixture(scope="module")
def tiny(tiny_model: TinyModel) -> Path:
    _byte_tokenizer(tiny_model.path)
    return tiny_model.path


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
def test_the_last_output_of_a_sequence_carries_its_timings(tiny: Path) -> None:
    # 8 blocks of 16 tokens for six prompts of 50 tokens growing by 24: some are preempted.
    engine = LLM(str(tiny), num_blocks=8).engine
    rng = random.Random(5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", [rng.randrange(3, 200) for _ in range(50)], params)
    outputs: dict[str, list[Output]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert len(outputs) == 6 and engine.scheduler.preemptions > 0
    preempted = 0
    for outs in outputs.values():
        *before, last = outs
        assert last.finish_reason == "length" and all(o.timings is None for o in before)
        t = last.timings
        assert t is not None
        # Queued until first scheduled (a recompute after preemption keeps that time), prefill
        # until the first token, decode until the end.
        assert 0 < t.arrived <= t.scheduled <= t.first_token <= t.finished
        preempted += t.preemptions
    assert preempted == engine.scheduler.preemptions


@pytest.mark.parametrize("tiny_model", ["llama-gqa"], indirect=True)
def test_merged_outputs_keep_the_timings_of_the_later(tiny: Path) -> None:
    from workers.engine.engine import merge_outputs

    engine = LLM(str(tiny)).engine
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs: list[Output] = []
    while engine.has_unfinished():
        outs += engine.step()
    merged = outs[0]
    for out in outs[1:]:
        merged = merge_outputs(merged, out)
    assert merged.finish_reason == "length" and merged.timings is outs[-1].timings is not None
