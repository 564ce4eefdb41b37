"""Tokenizer, chat template, streaming detokenization and stop strings.

Shared by the gateway (render the chat template, count and hash prompt tokens) and the
workers (detokenize the stream, cut at stop strings). Built on `tokenizers` and `jinja2`
only: the gateway must tokenize without importing torch or transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# Special-token names the HF tokenizer exposes to chat templates as variables.
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


# --- chat template -------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF overrides jinja's tojson, which HTML-escapes; templates rely on the plain form.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trim/lstrip blocks)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _load_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    # transformers >= 4.43 writes chat_template.jinja; older checkpoints keep it in
    # tokenizer_config.json, either as a string or as a list of named templates.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


# --- tokenizer -----------------------------------------------------------------------------

# Texts longer than this are tokenized through the GIL-releasing batch call (a few µs more).
_GIL_FREE_CHARS = 4096

# Normalizers that never make a text shorter, so `len(text) / max_token_chars` stays a lower
# bound on its tokens: `Replace` only as SentencePiece uses it (one character for another).
_SAFE_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "NFKD"}


def _never_shrinks(config: Any) -> bool:
    if config is None:
        return True
    kind = config.get("type") if isinstance(config, dict) else None
    if kind == "Sequence":
        return all(_never_shrinks(c) for c in config.get("normalizers") or [])
    if kind == "Replace":
        pattern = (config.get("pattern") or {}).get("String")
        content = config.get("content")
        return isinstance(pattern, str) and isinstance(content, str) and len(content) >= len(pattern)
    return kind in _SAFE_NORMALIZERS


class Tokenizer:
    """A model's tokenizer (tokenizer.json) plus its chat template and special ids."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        context_length: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._eos_token_ids = list(eos_token_ids)
        self._bos_token_id = bos_token_id
        self._context_length = context_length

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"{tokenizer_file} not found (only fast tokenizers are supported)")
        tok = _HFTokenizer.from_file(str(tokenizer_file))
        # Some tokenizer.json files (MiniLM's) enable padding and truncation; either would
        # silently change token counts, so callers pad or truncate explicitly instead.
        tok.no_padding()
        tok.no_truncation()
        tok_cfg = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        config = _read_json(path / "config.json")
        gen_cfg = _read_json(path / "generation_config.json")

        special: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(tok_cfg.get(key)) or _token_content(special_map.get(key))
            if content is not None:
                special[key] = content

        # EOS: generation_config is what HF generate stops on; config.json and the
        # tokenizer's eos_token are fallbacks. The union is kept because chat models often
        # list several (end of turn and end of text).
        eos: list[int] = []
        for candidate in (
            _as_id_list(gen_cfg.get("eos_token_id")),
            _as_id_list(config.get("eos_token_id")),
            [i]
            if "eos_token" in special and (i := tok.token_to_id(special["eos_token"])) is not None
            else [],
        ):
            eos.extend(i for i in candidate if i not in eos)

        bos = next(
            iter(_as_id_list(config.get("bos_token_id")) or _as_id_list(gen_cfg.get("bos_token_id"))), None
        )
        if bos is None and "bos_token" in special:
            bos = tok.token_to_id(special["bos_token"])

        ctx = config.get("max_position_embeddings")
        return cls(
            tok,
            chat_template=_load_chat_template(path, tok_cfg),
            special_tokens=special,
            eos_token_ids=eos,
            bos_token_id=bos,
            context_length=ctx if isinstance(ctx, int) else None,
        )

    # --- properties ---

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def context_length(self) -> int | None:
        return self._context_length

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        return compile_chat_template(self.chat_template)

    # --- encode / decode ---

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Special tokens written in the text (e.g. <|im_start|> from the chat template) are
        # matched either way; add_special_tokens only controls the post-processor (BOS/CLS...).
        if len(text) > _GIL_FREE_CHARS:
            # `tokenizers` holds the GIL through `encode` but releases it in `encode_batch`:
            # a long text tokenized in a thread must not stop the event loop meanwhile.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    @cached_property
    def max_token_chars(self) -> int | None:
        """Most characters of input text one token can stand for, or None when that bounds
        nothing: a normalizer that may shrink the text (lowercasing is fine, stripping accents
        or whitespace is not) lets any length of input become few tokens."""
        config = json.loads(self._tok.to_str()).get("normalizer")
        if not _never_shrinks(config):
            return None
        # A vocabulary entry spells what its token covers: one character per byte for
        # byte-level BPE (which covers at most as many characters), the normalized text for
        # SentencePiece (`▁` for a space). Byte-fallback entries (`<0x41>`) only overstate.
        return max(len(piece) for piece in self._tok.get_vocab(with_added_tokens=True)) or None

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))`, known without tokenizing: a text that cannot
        fit a context is refused without spending a second on it."""
        per_token = self.max_token_chars
        return -(-len(text) // per_token) if per_token else 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render the conversation to the prompt string (not tokenized), as HF does."""
        variables: dict[str, Any] = {**self.special_tokens, **extra}
        return self._template.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


# --- streaming detokenization --------------------------------------------------------------

# Prompt tokens kept as left context so the first generated tokens decode as they would in
# the middle of a sequence (leading-space handling of SentencePiece-style decoders).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas.

    Same scheme as vLLM: decode only the window `ids[prefix:]` and the already emitted part
    `ids[prefix:read]`; the difference is the new text. Output is held back while it ends in
    U+FFFD (a UTF-8 character split over tokens) and emitted once the character completes.
    The window restarts wherever text was emitted, so each step costs a few tokens.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer.backend
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._context = len(context)

    @property
    def token_ids(self) -> list[int]:
        """Generated ids fed so far (without the prompt context)."""
        return self._ids[self._context :]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feed one token id; return the text that became final (possibly "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix = self._read
            self._read = len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Emit what is held back at the end of generation.

        A character left incomplete (generation stopped inside its bytes) is dropped, as
        vLLM does, rather than sent as U+FFFD.
        """
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :].rstrip("\ufffd")


# --- stop strings --------------------------------------------------------------------------


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest occurrence of any stop string in `text[start:]`, or -1."""
    best = -1
    for stop in stops:
        if not stop:
            continue
        i = text.find(stop, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string.

    That suffix may become a stop string with the next tokens, so it must not be emitted yet.
    """
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopStringMatcher:
    """Cut a text stream at the first stop string, holding back possible stop prefixes.

    Stop strings may span token boundaries. Only the held-back tail needs searching: any
    occurrence starting in already emitted text would have been held back.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit, whether a stop string was found)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        pending = self._pending + delta
        i = find_stop(pending, self.stops)
        if i != -1:
            self._pending = ""
            self.stopped = True
            return pending[:i], True
        keep = partial_stop_length(pending, self.stops)
        cut = len(pending) - keep
        self._pending = pending[cut:]
        return pending[:cut], False

    def flush(self) -> str:
        """At the end of generation nothing more can complete a stop: release the tail."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
