"""Structured outputs: a grammar per sequence, a token mask per step, through llguidance.

A request may carry a `Grammar` (JSON schema, any JSON object, regex, or a Lark grammar in
llguidance's dialect). Each of its sequences gets its own matcher: before sampling, the
matcher writes a bitmask of the tokens that keep the output inside the grammar; after
sampling it consumes the token. A matcher that has nothing left to match (a closed JSON
object, say) ends its sequence at once, as if it had sampled EOS, saving a step.

Masks are computed on the CPU (llguidance's Rust core, in parallel over the batch); only
constrained rows pay for them, and unconstrained rows in the same batch are never touched.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import llguidance
import torch

if TYPE_CHECKING:
    from tokenmill.tokenization import Tokenizer

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "lark")

# How generated JSON is laid out: one space after ':' and ',' and no other whitespace. Small
# models given free whitespace tend to pad with newlines until max_tokens; this is also how
# they mostly write JSON when unconstrained. Defaults only: a schema's own "x-guidance" wins.
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that does not compile; `param` names the sampling field for the API's error."""

    param = "grammar"


@dataclass(slots=True, frozen=True)
class Grammar:
    """What to constrain a sequence to. `spec`: the schema (JSON text), regex or grammar;
    unused for json_object."""

    kind: str
    spec: str = ""

    def source(self) -> str:
        """llguidance's grammar text. Raises GrammarError for an unknown kind or bad JSON."""
        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_LAYOUT)
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults=JSON_LAYOUT
                )
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(self.spec)
        except ValueError as exc:  # the schema is not JSON
            raise GrammarError(f"invalid {self.kind}: {exc}") from exc
        raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")

    def check(self) -> None:
        """Raise GrammarError unless the grammar compiles (needs no tokenizer: cheap)."""
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.source())
        if failed:  # warnings (an unsupported string "format", say) do not stop generation
            raise GrammarError(f"invalid {self.kind}: {' '.join(messages)}")

    @classmethod
    def from_wire(cls, g: object) -> Grammar:
        """From `tokenmill.protocol.Grammar` (read by attribute, as SamplingParams.from_wire)."""
        return cls(str(getattr(g, "kind", "")), str(getattr(g, "spec", "") or ""))

    @classmethod
    def json_schema(cls, schema: dict[str, object]) -> Grammar:
        return cls("json_schema", json.dumps(schema))


class Matcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self._m = m

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar refuses it (the matcher is then broken)."""
        return self._m.consume_token(token)

    @property
    def done(self) -> bool:
        """Nothing but EOS can follow: the output is complete."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def copy(self) -> Matcher:
        return Matcher(self._m.deep_copy())


class StructuredOutputs:
    """The engine's side of llguidance: one tokenizer and thread pool, matchers and masks.

    The llguidance tokenizer (built from tokenizer.json, ~1 s for a 50k vocabulary) is made on
    the first constrained request, so engines that never see one do not pay for it.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        # The mask covers the model's logits; a tokenizer with fewer ids leaves the rest banned.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._eos = list(eos_token_ids)
        self.words = (self.vocab_size + 31) // 32  # int32 words per mask row

    @cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(
            self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos
        )

    @cached_property
    def _executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor()

    def matcher(self, grammar: Grammar) -> Matcher:
        """A fresh matcher at the start of `grammar`; GrammarError if it does not compile."""
        # log_level 0: a refused token is reported through `error`, not printed on stderr.
        m = llguidance.LLMatcher(self._ll_tokenizer, grammar.source(), log_level=0)
        if m.is_error():
            raise GrammarError(f"invalid {grammar.kind}: {m.get_error()}")
        return Matcher(m)

    def masks(self, matchers: list[Matcher]) -> torch.Tensor:
        """Bitmasks of allowed next tokens, int32 [len(matchers), words] (bit t of row r set =
        token t allowed), computed in parallel on llguidance's threads."""
        out = torch.empty((len(matchers), self.words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m._m, i) for i, m in enumerate(matchers)], out.data_ptr(), self.words * 4, len(matchers)
        )
        return out


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] from int32 bitmasks [rows, words]; ids past the mask are not allowed."""
    bits = ((bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros((bits.shape[0], vocab - bits.shape[1]), dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)
