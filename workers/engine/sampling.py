"""Per-request sampling for one step's batch of logits.

Order of processing (vLLM's): logit_bias → repetition penalty → presence/frequency penalties →
greedy (argmax) for temperature 0, otherwise temperature → top_k → top_p → min_p → draw.

Logprobs are vLLM's default "raw logprobs": log_softmax of the model's logits before any of the
processing above, so they describe the model, not the sampling settings.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from workers.engine.structured import KINDS as GRAMMAR_KINDS
from workers.engine.structured import Grammar, allowed_tokens

# Temperatures below this are greedy (vLLM's threshold): dividing by a tinier one can overflow fp32.
SAMPLING_EPS = 1e-5
# top_p looks for its nucleus among this many most likely tokens first (widening if short).
TOP_P_CANDIDATES = 256


class InvalidParam(ValueError):
    """A sampling parameter out of range; `param` names it for the API's error."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token; 0 = only the sampled token's
    grammar: Grammar | None = None  # structured output: each sequence is masked to this grammar
    # logit_bias as (token ids, biases) tensors, built by the sampler on first use: a biased row
    # then costs the same few tensor ops each step however many tokens its bias names.
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # Written as `not (ok)` so that NaN fails every check.
        if not self.n >= 1:
            raise InvalidParam("n", f"n must be at least 1, got {self.n}")
        if not self.max_tokens >= 1:
            raise InvalidParam("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise InvalidParam("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0  # vLLM's spelling of "off"; one spelling downstream
        if not self.top_k >= 0:
            raise InvalidParam("top_k", f"top_k must be 0 or -1 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidParam(
                "presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
            )
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidParam(
                "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if not self.repetition_penalty > 0:
            raise InvalidParam(
                "repetition_penalty", f"repetition_penalty must be positive, got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidParam("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        for token, bias in self.logit_bias.items():
            if not token >= 0:
                raise InvalidParam("logit_bias", f"logit_bias token ids must be non-negative, got {token}")
            if not -100 <= bias <= 100:
                raise InvalidParam(
                    "logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {token}"
                )
        if any(not s for s in self.stop):
            raise InvalidParam("stop", "stop strings must be non-empty")
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            kinds = ", ".join(GRAMMAR_KINDS)
            raise InvalidParam("grammar", f"grammar kind must be one of {kinds}, got {self.grammar.kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Reject logit_bias ids the model does not have (the engine calls this on admission)."""
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidParam(
                "logit_bias", f"logit_bias token ids out of vocabulary (size {vocab_size}): {bad[:10]}"
            )

    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (token ids: long, biases: float32) on the CPU, made once per request."""
        if self._bias is None:
            self._bias = (
                torch.tensor(list(self.logit_bias), dtype=torch.long),
                torch.tensor(list(self.logit_bias.values()), dtype=torch.float32),
            )
        return self._bias

    @classmethod
    def from_wire(cls, p: object) -> SamplingParams:
        """Convert a `tokenmill.protocol.SamplingParams`.

        Read by attribute name, so the engine does not import the gateway↔worker protocol, and
        fields the wire type lacks (today `n`) keep their defaults.
        """
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            if not f.init or not hasattr(p, f.name):
                continue
            value = getattr(p, f.name)
            if isinstance(value, list):
                value = list(value)  # do not share the wire struct's lists
            elif f.name == "logit_bias" and value is not None:
                value = {int(t): float(b) for t, b in value.items()}  # JSON keys arrive as strings
            elif f.name == "grammar" and value is not None:
                value = Grammar.from_wire(value)
            kwargs[f.name] = value
        return cls(**kwargs)  # type: ignore[arg-type]


def make_generator(seed: int | None, index: int = 0) -> torch.Generator | None:
    """The random stream of one sequence: created once, so successive steps continue it.

    Sequence `index` of an n > 1 request uses `seed + index`, so its siblings differ.
    """
    if seed is None:
        return None
    # manual_seed takes 64-bit values; wrap so any int (negative, huge) is accepted.
    return torch.Generator().manual_seed((seed + index) & 0xFFFF_FFFF_FFFF_FFFF)


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    # Structured output: int32 bitmask of the tokens the row's grammar allows next (None = any).
    bitmask: torch.Tensor | None = None


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    # Raw logprob of each sampled token (see the module docstring); NaN where params.logprobs is None.
    logprobs: list[float]
    # Per row, the params.logprobs most likely (token, raw logprob), best first; [] when None or 0.
    top_logprobs: list[list[tuple[int, float]]]


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Add each row's logit_bias in place, with one scatter for all biased rows; unbiased rows
    cost nothing. Ids outside the vocabulary are ignored (the engine refuses them on admission:
    see check_vocab)."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return
    parts = [rows[i].params.bias_tensors() for i in biased]
    tokens = torch.cat([t for t, _ in parts])
    bias = torch.cat([b for _, b in parts])
    row_ids = torch.tensor(biased).repeat_interleave(torch.tensor([len(t) for t, _ in parts]))
    keep = tokens < logits.shape[1]
    device = logits.device
    logits.index_put_(
        (row_ids[keep].to(device), tokens[keep].to(device)),
        bias[keep].to(device=device, dtype=logits.dtype),
        accumulate=True,
    )


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Repetition (HF), then frequency and presence (OpenAI) penalties, in place (logits contiguous).

    repetition: for tokens in prompt or output, logit / r if logit > 0 else logit * r.
    frequency and presence: logit -= frequency * count_in_output + presence * (count_in_output > 0).
    Touches only the seen tokens, by flat index (row * vocab + token), never whole vocabulary rows.
    """
    pen = [i for i, row in enumerate(rows) if row.params.penalized]
    if not pen:
        return
    vocab, device = logits.shape[1], logits.device
    flat = logits.view(-1)

    def flat_ids(tokens: Callable[[SampleRow], list[int]]) -> torch.Tensor:
        parts = [torch.tensor(tokens(rows[i]), dtype=torch.long) + i * vocab for i in pen]
        return torch.cat(parts).to(device)

    def per_row(value: Callable[[SamplingParams], float], ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor([value(r.params) for r in rows], dtype=logits.dtype, device=device)[ids // vocab]

    seen = flat_ids(lambda r: r.prompt_token_ids + r.output_token_ids)
    rep, v = per_row(lambda p: p.repetition_penalty, seen), flat[seen]
    flat[seen] = torch.where(v > 0, v / rep, v * rep)  # a repeated id writes the same value each time

    out = flat_ids(lambda r: r.output_token_ids)
    flat.index_add_(0, out, -per_row(lambda p: p.frequency_penalty, out))  # once per occurrence
    distinct = out.unique()
    flat[distinct] -= per_row(lambda p: p.presence_penalty, distinct)  # once per token


def apply_grammar_masks(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Set the logits of tokens a row's grammar forbids to -inf, in place; rows without a
    bitmask are left exactly as they are. Last of the processing, so no bias or penalty can
    bring a forbidden token back."""
    idx = [i for i, row in enumerate(rows) if row.bitmask is not None]
    bitmask = torch.stack([rows[i].bitmask for i in idx]).to(logits.device)  # type: ignore[misc]
    allowed = allowed_tokens(bitmask, logits.shape[1])
    sub = torch.tensor(idx, device=logits.device)
    logits[sub] = logits[sub].masked_fill(~allowed, float("-inf"))


def top_k_top_p_cutoff(
    probs: torch.Tensor, k: torch.Tensor, p: torch.Tensor, width: int = TOP_P_CANDIDATES
) -> torch.Tensor:
    """Per row, the smallest probability that top_k and top_p keep ([N, 1]; 0 when both are off).

    probs: softmax [N, V]; k: long [N], V = off; p: float [N], 1 = off. top_p keeps the smallest
    set of most likely tokens whose mass reaches p, measured on the top-k distribution (vLLM's
    order). Tokens tied with the cutoff are kept. Only the best `width` tokens are sorted (topk):
    a full sort of the vocabulary costs more than all the rest of sampling on CPU. Rows whose
    nucleus is wider than that are redone with 16× the width.
    """
    vocab = probs.shape[1]
    limited, nucleus = k < vocab, p < 1
    width = min(vocab, max(width, int(k[limited].max()) if limited.any() else 1))
    # Descending; at full width a sort is cheaper than topk.
    best = probs.sort(dim=-1, descending=True).values if width == vocab else probs.topk(width, dim=-1).values
    best = best.masked_fill(torch.arange(width, device=probs.device) >= k.unsqueeze(1), 0.0)
    mass = best.cumsum(dim=-1)
    # With top_k, top_p is a fraction of the top-k mass (the renormalised top-k distribution).
    total = torch.where(limited, mass[:, -1], 1.0)
    # A token is needed while the mass before it is still short of p.
    keep = ((mass - best < (p * total).unsqueeze(1)) | ~nucleus.unsqueeze(1)) & (best > 0)
    cutoff = best.gather(1, keep.sum(dim=-1, keepdim=True).clamp(min=1) - 1)
    cutoff = cutoff.masked_fill(~(limited | nucleus).unsqueeze(1), 0.0)

    short = (nucleus & ~limited & (mass[:, -1] < p)).nonzero().squeeze(1)
    if width < vocab and len(short):
        cutoff[short] = top_k_top_p_cutoff(probs[short], k[short], p[short], width * 16)
    return cutoff


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What each non-greedy row draws from, unnormalised: softmax(logits / temperature) with the
    tokens removed by top_k, top_p and min_p set to 0. Filtering in probability space needs one
    softmax, which the draw needs anyway."""
    device, vocab = logits.device, logits.shape[1]
    temp = torch.tensor([p.temperature for p in params], device=device)
    probs = (logits / temp.unsqueeze(1)).softmax(dim=-1)
    if any(p.top_k or p.top_p < 1 for p in params):
        k = torch.tensor([min(p.top_k, vocab) or vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        probs.masked_fill_(probs < top_k_top_p_cutoff(probs, k, top_p), 0.0)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row by inverse CDF: one uniform number per row, a cumsum and a binary search
    (torch.multinomial draws an exponential per vocabulary entry, several times slower on CPU).
    Seeded rows take their number from their own generator, so their tokens depend only on their
    own distribution and stream, never on the rest of the batch."""
    u = torch.rand(len(generators))  # the global RNG serves unseeded rows
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g).item()
    cdf = probs.cumsum(dim=-1)  # probs need not be normalised: u scales by the total
    total = cdf[:, -1:]
    # u < 1, but u · total may round up to total; stay below it so the pick has nonzero probability.
    x = torch.minimum(u.to(probs.device).unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index of its maximum as `argmax` gives: `max` finds the same
    2-3x faster on the CPU (64 x 49152 fp32 on two threads: 0.9 against 2.3 ms)."""
    return logits.max(dim=-1).indices


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return x if len(rows) == x.shape[0] else x[rows]  # no copy when every row is wanted


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleOutput:
        raw = logits.float()
        logits = self.process(raw, rows)

        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        argmax = [i for i, row in enumerate(rows) if row.params.greedy]
        rand = [i for i, row in enumerate(rows) if not row.params.greedy]
        if argmax:
            tokens[argmax] = greedy(_take(logits, argmax))
        if rand:
            probs = filtered_probs(_take(logits, rand), [rows[i].params for i in rand])
            tokens[rand] = draw(probs, [rows[i].generator for i in rand])
        token_ids = tokens.tolist()

        # Logprobs (raw, see the module docstring) only for the rows that asked: a full-vocabulary
        # reduction per row is not free on CPU.
        logprobs = [math.nan] * len(rows)
        top: list[list[tuple[int, float]]] = [[] for _ in rows]
        asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if asked:
            lp = _take(raw, asked).log_softmax(dim=-1)
            chosen = lp.gather(1, tokens[asked].unsqueeze(1)).squeeze(1).tolist()
            for i, value in zip(asked, chosen, strict=True):
                logprobs[i] = value
            k = min(max(rows[i].params.logprobs or 0 for i in asked), lp.shape[1])
            if k:
                values, ids = lp.topk(k, dim=-1)
                values, ids = values.tolist(), ids.tolist()
                for j, i in enumerate(asked):
                    n = rows[i].params.logprobs or 0
                    top[i] = list(zip(ids[j][:n], values[j][:n], strict=True))
        return SampleOutput(token_ids, logprobs, top)

    @staticmethod
    def process(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """logit_bias, penalties and grammar masks, on a copy when there is anything to do (raw
        stays intact, so logprobs describe the model, not the grammar)."""
        masked = any(r.bitmask is not None for r in rows)
        if masked or any(r.params.logit_bias or r.params.penalized for r in rows):
            logits = logits.clone(memory_format=torch.contiguous_format)
            apply_logit_bias(logits, rows)
            apply_penalties(logits, rows)
            if masked:
                apply_grammar_masks(logits, rows)
        return logits
