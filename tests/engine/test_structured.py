"""Structured outputs in the engine (issue 7): per-sequence grammar masks through llguidance.

The fast tests check the masking arithmetic on made-up logits. The slow ones run the bundled
SmolLM2: a mixed batch (a constrained row does not change its unconstrained neighbour's
greedy tokens), and acceptance 2's 100 extractions over five JSON schemas, every one of
which must validate, most carrying the values of their prompt, while the same prompts
without the grammar fail validation at least sometimes (the mask does the work).
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tokenmill.modelstore import resolve_model
from workers.engine import LLM, SamplingParams
from workers.engine.sampling import InvalidParam, Sampler, SampleRow, apply_grammar_masks
from workers.engine.structured import Grammar, GrammarError, allowed_tokens

# --- masks on made-up logits ------------------------------------------------------------------


def _bitmask(allowed: list[int], vocab: int) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    # int32 with the sign bit where token 31 of a word is allowed, as llguidance writes them.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_bitmask_unpacks_to_the_allowed_tokens() -> None:
    vocab = 70  # not a multiple of 32: the last word is partly past the vocabulary
    allowed = [0, 5, 31, 32, 63, 69]
    got = allowed_tokens(_bitmask(allowed, vocab).unsqueeze(0), vocab)
    assert got.shape == (1, vocab)
    assert got[0].nonzero().squeeze(1).tolist() == allowed
    # Logits wider than the mask (a model vocabulary padded past the tokenizer's): banned.
    wider = allowed_tokens(_bitmask(allowed, vocab).unsqueeze(0), 100)
    assert wider.shape == (1, 100) and not wider[0, 70:].any()


def _row(temperature: float = 0.0, bitmask: torch.Tensor | None = None) -> SampleRow:
    return SampleRow(SamplingParams(temperature=temperature), [], [], None, bitmask)


def test_masks_touch_only_constrained_rows() -> None:
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(3, vocab)
    rows = [_row(), _row(bitmask=_bitmask([7, 9], vocab)), _row()]
    out = logits.clone()
    apply_grammar_masks(out, rows)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isinf(out[1]).sum() == vocab - 2
    assert torch.equal(out[1, [7, 9]], logits[1, [7, 9]])

    # Through the sampler: the constrained rows pick only allowed tokens, greedy or sampled;
    # the free ones pick what they would alone.
    rows = [
        _row(),
        _row(bitmask=_bitmask([7, 9], vocab)),
        _row(temperature=1.0, bitmask=_bitmask([3], vocab)),
    ]
    tokens = Sampler()(logits, rows).token_ids
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == max((7, 9), key=lambda t: float(logits[1, t]))
    assert tokens[2] == 3


def test_logprobs_stay_the_models() -> None:
    logits = torch.randn(1, 40)
    row = SampleRow(SamplingParams(temperature=0, logprobs=1), [], [], None, _bitmask([4], 40))
    out = Sampler()(logits, [row])
    assert out.token_ids == [4]
    assert out.logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[4]), abs=1e-5)


def test_bad_grammars_are_refused_with_a_param() -> None:
    with pytest.raises(GrammarError, match="invalid json_schema"):
        Grammar("json_schema", '{"type": "nonsense"}').check()
    with pytest.raises(GrammarError):
        Grammar("regex", "[a-").check()
    with pytest.raises(GrammarError):
        Grammar("lark", "start: missing_rule").check()
    with pytest.raises(InvalidParam) as err:
        SamplingParams(grammar=Grammar("yaml", "x"))
    assert err.value.param == "grammar"


def test_grammar_arrives_from_the_wire() -> None:
    from tokenmill import protocol

    wire = protocol.SamplingParams(grammar=protocol.Grammar("regex", "[0-9]+"))
    assert SamplingParams.from_wire(wire).grammar == Grammar("regex", "[0-9]+")
    assert SamplingParams.from_wire(protocol.SamplingParams()).grammar is None


# --- the bundled model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(model_cache: Path) -> LLM:
    return LLM(str(resolve_model("bundled:smollm2", model_cache)), kv_cache_gib=1.0, max_num_seqs=128)


def _chat(llm: LLM, user: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": user}]))


# Strings are bounded (maxLength): inside an unbounded string a 135M model may repeat itself
# until max_tokens, which no grammar can prevent.
STR = {"type": "string", "maxLength": 40}
PERSON = {
    "type": "object",
    "properties": {"name": STR, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_mixed_batch_masks_only_the_constrained_rows(smol: LLM) -> None:
    free_prompt = _chat(smol, "Write one sentence about the sea.")
    person = _chat(smol, "Describe John Smith, who is 42 years old, as JSON.")
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = smol.generate([free_prompt], greedy)[0].outputs[0]

    constrained = [
        SamplingParams(temperature=0, max_tokens=40, grammar=Grammar.json_schema(PERSON)),
        SamplingParams(
            temperature=0.8, seed=1, max_tokens=20, grammar=Grammar("regex", r"[0-9]{3}-[0-9]{4}")
        ),
        SamplingParams(temperature=0, max_tokens=10, grammar=Grammar("lark", 'start: "yes" | "no"')),
    ]
    results = smol.generate([free_prompt, person, person, person], [greedy, *constrained])
    free, as_json, phone, yes_no = (r.outputs[0] for r in results)

    # The unconstrained row's greedy tokens are exactly those it makes alone.
    assert free.token_ids == alone.token_ids
    # Each constrained row matches its own grammar and ends as soon as it is complete.
    jsonschema.validate(json.loads(as_json.text), PERSON)
    assert as_json.finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.text) and phone.finish_reason == "stop"
    assert len(phone.token_ids) <= 8
    assert yes_no.text in ("yes", "no") and yes_no.finish_reason == "stop"


@pytest.mark.slow
def test_n_samples_each_walk_their_own_grammar(smol: LLM) -> None:
    params = SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=12, grammar=Grammar("regex", "[a-z]{2,6}")
    )
    (result,) = smol.generate([_chat(smol, "Say a short word.")], params)
    for out in result.outputs:
        assert re.fullmatch("[a-z]{2,6}", out.text), out.text


# --- acceptance 2: 100 extractions over five schemas --------------------------------------------

FIRST = ["John", "Maria", "Ahmed", "Li", "Olga", "Pedro", "Aisha", "Tom", "Yuki", "Sven", "Fatima", "Carlos"]
LAST = ["Smith", "Garcia", "Khan", "Wei", "Petrova", "Silva", "Bello", "Brown", "Tanaka", "Larsen", "Novak"]
CITIES = ["Paris", "Berlin", "Madrid", "Lisbon", "Vienna", "Oslo", "Dublin", "Prague", "Warsaw", "Athens"]
STREETS = ["Oak Street", "Mill Road", "Station Avenue", "High Street", "Church Lane", "Park Road"]
FRUITS = ["apples", "pears", "oranges", "lemons", "peaches", "plums", "bananas"]
KINDS = ["meeting", "party", "conference"]
TOPICS = ["budget", "launch", "hiring", "summer", "design", "safety"]
COLORS = ["red", "blue", "green", "black", "white", "yellow"]
GADGETS = ["Widget", "Gizmo", "Lamp", "Kettle", "Speaker", "Backpack"]


@dataclass(slots=True)
class Case:
    schema_name: str
    prompt: str
    expected: dict[str, Any]  # values from the prompt the answer must carry
    carries: Callable[[Any], bool]


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": PERSON,
    "address": {
        "type": "object",
        "properties": {
            "street": STR,
            "city": STR,
            "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["street", "city", "postal_code"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "product": STR,
                        "quantity": {"type": "integer", "minimum": 1},
                    },
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["order_id", "items"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": STR,
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "kind": {"enum": KINDS},
        },
        "required": ["title", "date", "kind"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "name": STR,
            "price": {"type": "number"},
            "details": {
                "type": "object",
                "properties": {"color": STR, "in_stock": {"type": "boolean"}},
                "required": ["color", "in_stock"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "price", "details"],
        "additionalProperties": False,
    },
}


def _keys(name: str) -> str:
    return ", ".join(f'"{k}"' for k in SCHEMAS[name]["properties"])


def make_cases(seed: int = 7, per_schema: int = 20) -> list[Case]:
    """Prompts whose content decides the answer: random values, drawn from a fixed seed."""
    rng = random.Random(seed)
    cases = []
    for _ in range(per_schema):
        name, age = f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.randint(18, 90)
        cases.append(
            Case(
                "person",
                f"Extract the person's name and age as JSON with keys {_keys('person')}.\n"
                f"Text: {name} is {age} years old and works at a bakery.",
                {"name": name, "age": age},
                lambda d, name=name, age=age: d["name"] == name and d["age"] == age,
            )
        )
        street, city, code = (
            f"{rng.randint(1, 99)} {rng.choice(STREETS)}",
            rng.choice(CITIES),
            f"{rng.randint(10000, 99999)}",
        )
        cases.append(
            Case(
                "address",
                f"Extract the address as JSON with keys {_keys('address')}.\n"
                f"Text: Please send the parcel to {street}, {city} {code}.",
                {"city": city, "postal_code": code},
                lambda d, city=city, code=code: (
                    d["city"].lower() == city.lower() and d["postal_code"] == code
                ),
            )
        )
        order_id, qty, fruit = f"ORD-{rng.randint(1000, 9999)}", rng.randint(2, 9), rng.choice(FRUITS)
        cases.append(
            Case(
                "order",
                f"Extract the order as JSON with keys {_keys('order')}; each item has "
                f'"product" and "quantity".\nText: Order {order_id}: {qty} {fruit}.',
                {"order_id": order_id, "quantity": qty},
                lambda d, order_id=order_id, qty=qty: (
                    d["order_id"] == order_id and d["items"][0]["quantity"] == qty
                ),
            )
        )
        date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        kind, topic = rng.choice(KINDS), rng.choice(TOPICS)
        cases.append(
            Case(
                "event",
                f"Extract the event as JSON with keys {_keys('event')}.\n"
                f"Text: We are planning a {kind} about {topic} on {date}.",
                {"date": date, "kind": kind},
                lambda d, date=date, kind=kind: d["date"] == date and d["kind"] == kind,
            )
        )
        gadget, color = rng.choice(GADGETS), rng.choice(COLORS)
        price = rng.randint(5, 200) + rng.choice([0.0, 0.5, 0.99])
        cases.append(
            Case(
                "product",
                f"Extract the product as JSON with keys {_keys('product')}; details has "
                f'"color" and "in_stock".\nText: The {color} {gadget} costs {price} dollars and is in stock.',
                {"price": price, "color": color},
                lambda d, price=price, color=color: (
                    d["price"] == price and d["details"]["color"].lower() == color
                ),
            )
        )
    return cases


def _valid(text: str, schema: dict[str, Any], lenient: bool = False) -> Any:
    """The parsed answer if it validates, else None. `lenient` (for free text) takes the
    first JSON value in the text, so prose or a code fence around it is not held against it."""
    try:
        if lenient:
            value, _ = json.JSONDecoder().raw_decode(text[text.index("{") :])
        else:
            value = json.loads(text)
        jsonschema.validate(value, schema)
    except (ValueError, jsonschema.ValidationError):
        return None
    return value


@pytest.mark.slow
def test_acceptance_100_extractions_validate_and_carry_the_prompts_values(smol: LLM) -> None:
    cases = make_cases()
    assert len(cases) == 100 and {c.schema_name for c in cases} == set(SCHEMAS)
    prompts = [_chat(smol, c.prompt) for c in cases]
    constrained = [
        SamplingParams(temperature=0, max_tokens=120, grammar=Grammar.json_schema(SCHEMAS[c.schema_name]))
        for c in cases
    ]
    # The same prompts, greedy, without the grammar: the model on its own. "\n\n" ends it
    # after its JSON rather than after the prose it likes to add.
    free = SamplingParams(temperature=0, max_tokens=80, stop=["\n\n"])

    # All 200 in one continuously batched run: constrained and free rows share every step.
    started = time.monotonic()
    results = smol.generate(prompts + prompts, constrained + [free] * len(cases))
    took = time.monotonic() - started
    outs = [r.outputs[0] for r in results]

    invalid, wrong = [], []
    for case, out in zip(cases, outs[: len(cases)], strict=True):
        value = _valid(out.text, SCHEMAS[case.schema_name])
        if value is None:
            invalid.append((case.schema_name, out.text, out.finish_reason))
        elif not case.carries(value):
            wrong.append((case.schema_name, case.expected, out.text))
    free_valid = sum(
        _valid(out.text, SCHEMAS[case.schema_name], lenient=True) is not None
        for case, out in zip(cases, outs[len(cases) :], strict=True)
    )
    carried = len(cases) - len(wrong)
    print(f"\nconstrained: 100 generations, {100 - len(invalid)} valid, {carried} carry the prompt's values")
    print(f"unconstrained: {free_valid} of 100 valid; both runs in one batch, {took:.1f} s")
    assert not invalid, invalid  # every one parses and validates
    assert carried >= 80, wrong  # a 135M model: a clear majority, not all
    assert free_valid < 100  # without the mask, the model alone fails
