"""Wire types between gateway and workers, and the events on the bus.

`/generate` takes a `GenerateRequest` as JSON and answers with newline-delimited JSON,
one `GenerateDelta` per line, the last one carrying `finish_reason`.
"""

from __future__ import annotations

import msgspec

# Bus streams. Every gateway replica tails WORKERS and KV; billing consumes USAGE.
WORKERS = "tm:workers"
KV = "tm:kv"
USAGE = "tm:usage"
KEYS = "tm:keys"
DEMAND = "tm:demand"


class Grammar(msgspec.Struct):
    """What a structured output must match (the engine masks every token to it).

    kind: json_schema (spec: the schema as JSON text) | json_object (any JSON object; spec
    unused) | regex (spec: the pattern, matched as a whole) | lark (spec: a grammar in
    llguidance's Lark dialect, which may embed JSON schemas with `%json {...}`).
    """

    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; None = off
    grammar: Grammar | None = None  # structured output / tool calls; None = free text
    # Added to the logits of these token ids before sampling (OpenAI's -100..100): -100 all
    # but bans a token, 100 all but forces it. Logprobs still describe the model's own logits.
    logit_bias: dict[int, float] = {}


class GenerateRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    adapter: str | None = None
    cache_salt: str | None = None
    priority: int = 0  # lower runs first: 0 interactive, 1 batch
    fairness_key: str | None = None
    # Storage folder of `adapter` (adapters/<org>/<adapter id>/), so a worker that has not
    # loaded it fetches it without searching the storage.
    adapter_key: str | None = None


class LoadAdapter(msgspec.Struct, omit_defaults=True):
    """Body of a worker's `POST /adapters`: load a LoRA adapter now. Without `key` the worker
    finds `adapters/<org>/<id>/` in its storage by the id."""

    id: str
    key: str | None = None


class GenerateDelta(msgspec.Struct, omit_defaults=True):
    """Text and token ids produced since the previous delta; counts are running totals."""

    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None  # stop | length | abort | error
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    # When the request asked for logprobs, one entry per id of `token_ids`: the sampled
    # token's raw logprob, and the `sampling.logprobs` likeliest (token id, logprob), best first.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class EmbedRequest(msgspec.Struct):
    """Body of a worker's `/embed` (an embed deployment's worker; JSON in, `EmbedResponse` out).

    Each input is the complete token sequence the model reads, special tokens included:
    for BERT-style models `Tokenizer.encode(text, add_special_tokens=True)`, i.e. [CLS] … [SEP].
    Inputs longer than the model's context length are refused (400), never truncated.
    """

    request_id: str
    inputs: list[list[int]]


class EmbedResponse(msgspec.Struct):
    embeddings: list[list[float]]  # one per input, in input order
    prompt_tokens: int  # tokens of all inputs, special tokens included


# --- bus events -------------------------------------------------------------------------


class WorkerAnnounce(msgspec.Struct, tag="announce", tag_field="type"):
    worker_id: str
    deployment_id: str | None
    address: str
    model: str
    capacity: int = 1
    gpu_type: str | None = None
    ts: float = 0.0


class Heartbeat(msgspec.Struct, tag="heartbeat", tag_field="type"):
    worker_id: str
    deployment_id: str | None
    address: str
    model: str
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    adapters: list[str] = []
    draining: bool = False
    ts: float = 0.0
    ttft_p95: float | None = None  # seconds, over requests that got their first token lately
    # Requests that reached the worker and that ended (however), since it started: cumulative,
    # so a lost heartbeat loses nothing; the autoscaler takes arrival rates from their change.
    arrived: int = 0
    finished: int = 0


class WorkerDeparture(msgspec.Struct, tag="departure", tag_field="type"):
    """A worker left: said by itself on shutdown, or by the reconciler for a worker that went
    silent (`lost`, with `ts` its last heartbeat's: when it was last known to run)."""

    worker_id: str
    deployment_id: str | None
    ts: float = 0.0
    lost: bool = False


WorkerEvent = WorkerAnnounce | Heartbeat | WorkerDeparture


class Demand(msgspec.Struct):
    """A gateway holds a request for a deployment that has no live worker (scaled to zero,
    or all its workers gone): the autoscaler wakes it. Sent about once a second per waiting
    request, so the count of distinct request ids over the last seconds is the queue."""

    deployment_id: str
    request_id: str
    ts: float = 0.0


class KvOp(msgspec.Struct, array_like=True):
    """Blocks a worker stored in ("stored") or evicted from ("removed") its prefix cache,
    as hex block hashes (tokenmill.hashing)."""

    op: str
    hashes: list[str]


class KvEvents(msgspec.Struct):
    """A batch of prefix-cache changes of one worker, in the order they happened."""

    worker_id: str
    deployment_id: str | None
    ops: list[KvOp]
    ts: float = 0.0


class UsageRecord(msgspec.Struct, omit_defaults=True):
    request_id: str
    org_id: str
    model: str
    api_key_id: str | None = None
    adapter: str | None = None
    deployment_id: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    duration_ms: float | None = None
    status: str = "ok"
    ts: float = 0.0
    # The request's context, stored for the caller's reconciliation: OpenAI's `user` field,
    # their X-Client-Request-Id header, and the tier it ran at (default | flex). Events from
    # gateways older than these fields decode with the defaults.
    user: str | None = None
    client_request_id: str | None = None
    service_tier: str = "default"
    # The batch (/v1/batches) this request was a line of, priced at the batch discount.
    batch_id: str | None = None


class KeysChanged(msgspec.Struct, omit_defaults=True):
    """Drop cached key records: one key (revoked, changed) or all of an organisation's
    (suspended, plan changed). Gateways tail KEYS and evict at once."""

    prefix: str | None = None
    org_id: str | None = None
