"""Tokenizer, chat template, incremental detokenization and stop strings.

`transformers` is the reference: our renderer and encoder must agree with it exactly,
because the gateway tokenizes with ours and the model was trained on HF's output.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest

from tokenmill.modelstore import bundled_path, resolve_model
from tokenmill.tokenization import (
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    find_stop,
    partial_stop_length,
)

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse pirate."},
        {"role": "user", "content": "Hi!"},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": 'Another one, with "quotes" and\nnewlines\t{{ not a tag }}'},
    ],
    [
        {"role": "system", "content": "Réponds en français. 日本語も OK 🎉"},
        {"role": "user", "content": "  leading and trailing spaces  "},
        {"role": "assistant", "content": ""},
    ],
]

TEXTS = [
    "Hello world",
    "Café crème, naïve façade, Ångström, Straße",
    "北京欢迎你。東京タワー、서울 🎉👩‍👩‍👧🏳️‍🌈 emoji!",
    "  spaces\tand\nnewlines\n\n  ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]

# A template in the style of recent models: tools through tojson, a namespace, loop
# controls and raise_exception, all of which HF provides to templates.
TOOL_TEMPLATE = """\
{%- set ns = namespace(system=none) %}
{%- for m in messages %}
    {%- if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% endif %}
{%- endfor %}
{%- if tools %}
<tools>{{ tools | tojson }}</tools>
{%- endif %}
{%- if ns.system %}
[SYS] {{ ns.system }}
{%- endif %}
{%- for m in messages %}
    {%- if m['role'] == 'system' %}{% continue %}{% endif %}
    {%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
[{{ m['role'] | upper }}] {{ m['content'] | trim }}{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
[ASSISTANT]
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather <now> & "later"',
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def smollm_dir(model_cache: Path) -> Path:
    return resolve_model("bundled:smollm2", model_cache)


@pytest.fixture(scope="module")
def tok(smollm_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm_dir)


@pytest.fixture(scope="module")
def hf_tok(smollm_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


# --- loading ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_properties(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == [2]
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 49152
    assert tok.context_length == 8192


def test_tokenizer_does_not_import_torch(tmp_path: Path) -> None:
    # The gateway tokenizes without torch/transformers; run in a fresh interpreter to see.
    import subprocess

    code = (
        "import sys\n"
        "from tokenmill.tokenization import Tokenizer\n"
        "from tokenmill.modelstore import bundled_path\n"
        "t = Tokenizer.from_dir(bundled_path('minilm'))\n"
        "t.encode('hello')\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_minilm_matches_hf() -> None:
    from transformers import AutoTokenizer

    path = bundled_path("minilm")
    ours = Tokenizer.from_dir(path)
    hf = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    # tokenizer.json enables padding to 128; token counts must not include it.
    assert len(ours.encode("hi", add_special_tokens=True)) == 3
    assert ours.eos_token_ids == []
    assert ours.context_length == 512
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


# --- chat template and encode ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(
    tok: Tokenizer, hf_tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tok.encode(ours) == hf_tok.encode(theirs, add_special_tokens=False)


@pytest.mark.slow
def test_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_custom_template_features_match_hf(tok: Tokenizer, hf_tok: Any, tools: Any) -> None:
    custom = Tokenizer(tok.backend, chat_template=TOOL_TEMPLATE, special_tokens=tok.special_tokens)
    for messages in CONVERSATIONS:
        ours = custom.apply_chat_template(messages, tools=tools)
        theirs = hf_tok.apply_chat_template(
            messages, chat_template=TOOL_TEMPLATE, tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert ours == theirs
    if tools:
        # tojson is HF's: no HTML escaping of <, > and &.
        assert '"Weather <now> & \\"later\\""' in custom.apply_chat_template(CONVERSATIONS[0], tools=tools)


def test_template_raise_exception_and_sandbox() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    backend = Backend(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    t = Tokenizer(backend, chat_template=TOOL_TEMPLATE, special_tokens={"eos_token": "</s>"})
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])
    evil = Tokenizer(backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([])


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


# --- incremental detokenization --------------------------------------------------------------


class _CountingBackend:
    """Wraps the tokenizers backend to record how many ids each decode call sees."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.token_ids == ids


@pytest.mark.slow
def test_incremental_detokenizer_holds_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1  # one character over several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and "".join(deltas) == "🎉"
    # Generation cut inside the character: the broken bytes are dropped, not sent as U+FFFD.
    detok = IncrementalDetokenizer(tok)
    cut = tok.encode("ok 🎉")[:-1]  # "ok", " " + 2 bytes, 1 byte (the 4th is missing)
    assert [detok.add(i) for i in cut] == ["ok", "", ""]
    assert detok.flush() == " "


@pytest.mark.slow
def test_incremental_detokenizer_skips_special_tokens_and_stays_small(tok: Tokenizer) -> None:
    text = "Long text with 🎉 and 北京 repeated. " * 40
    ids = [*tok.encode(text), 2]
    detok = IncrementalDetokenizer(tok)
    counter = _CountingBackend(tok.backend)
    detok._tok = counter  # type: ignore[assignment]
    out = "".join(_stream(detok, ids))
    assert out == text  # <|im_end|> not shown
    # Each step decodes a window of a few tokens, never the whole sequence.
    assert max(counter.sizes) <= 8 < len(ids)


def test_incremental_detokenizer_metaspace() -> None:
    # SentencePiece-style tokenizers drop the leading space of a decode: the prompt
    # context and prefix diff must keep the spaces between generated words.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, héllo wörld"] * 20
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    t = Tokenizer(backend, eos_token_ids=[1])
    prompt = t.encode("the lazy")
    ids = t.encode(" quick brown fox héllo")
    detok = IncrementalDetokenizer(t, prompt)
    out = "".join(_stream(detok, ids))
    assert out == t.decode(prompt + ids)[len(t.decode(prompt)) :]
    assert out.startswith(" quick")


# --- stop strings ----------------------------------------------------------------------------


def test_find_stop() -> None:
    assert find_stop("hello world", ["world"]) == 6
    assert find_stop("hello world", ["xyz"]) == -1
    assert find_stop("a STOP b END", ["END", "STOP"]) == 2  # earliest wins, not first listed
    assert find_stop("abcabc", ["abc"], start=1) == 3
    assert find_stop("anything", [""]) == -1  # empty stop strings are ignored


def test_partial_stop_length() -> None:
    assert partial_stop_length("hello wor", ["world"]) == 3
    assert partial_stop_length("hello", ["world"]) == 0
    assert partial_stop_length("say ##", ["###", "#!"]) == 2
    assert partial_stop_length("x", ["x"]) == 0  # a whole stop is a match, not a prefix


def test_stop_matcher_across_pieces() -> None:
    m = StopStringMatcher(["World"])
    pieces = [m.feed(p) for p in ["Hel", "lo W", "orl", "d! more"]]
    assert pieces == [("Hel", False), ("lo ", False), ("", False), ("", True)]
    assert m.feed("later") == ("", True)
    assert m.flush() == ""


def test_stop_matcher_releases_false_alarm() -> None:
    m = StopStringMatcher(["</answer>"])
    emitted = [m.feed(p)[0] for p in ["a </", "ans", "wer is 42"]]
    assert emitted == ["a ", "", "</answer is 42"]  # held while it could be the stop
    assert m.flush() == ""
    m = StopStringMatcher(["</answer>"])
    assert m.feed("end </ans") == ("end ", False)
    assert m.flush() == "</ans"  # generation ended: nothing can complete the stop now


def test_stop_matcher_without_stops_passes_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


@pytest.mark.slow
def test_stop_string_split_across_tokens(tok: Tokenizer) -> None:
    text = "The answer is forty-two. END OF STORY and more"
    stop = "OF STO"
    ids = tok.encode(text)
    # The stop string really does span tokens (" OF", " ST", "ORY").
    assert all(stop not in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    matcher = StopStringMatcher([stop, "never"])
    out, stopped_at = [], None
    for n, i in enumerate(ids):
        piece, stopped = matcher.feed(detok.add(i))
        out.append(piece)
        if stopped:
            stopped_at = n
            break
    assert "".join(out) == text[: text.index(stop)]
    assert stopped_at is not None and tok.decode([ids[stopped_at]]) == "ORY"
