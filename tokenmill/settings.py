"""One typed settings object, read from the environment.

Everything has a default for the embedded mode, so `tokenmill serve` runs with no
configuration at all; production sets DATABASE_URL, REDIS_URL and the secrets.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenmill.clients import check_trusted_proxies

BUNDLED_MODEL = "bundled:smollm2"
BUNDLED_EMBED_MODEL = "bundled:minilm"
# vLLM's CUDA image for `vllm` deployments on Kubernetes: an immutable digest, never a tag alone.
VLLM_IMAGE = (
    "vllm/vllm-openai:v0.31.0@sha256:c1c9f6fd5c109ba7f0546a59f5b2f15fb87f64c77782e90a27b648b42a8e67c3"
)
_DIGEST_PINNED = re.compile(r"^[a-z0-9][^\s@]*@sha256:[0-9a-f]{64}$")


def check_image_digest(image: str) -> str:
    """An image reference pinned by digest (`name[:tag]@sha256:<64 hex>`): a tag can be moved,
    and a pod must run the same bytes on every node and after every restart."""
    if not _DIGEST_PINNED.match(image):
        raise ValueError(f"{image!r} must be pinned by digest: name[:tag]@sha256:<64 hex digits>")
    return image


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENMILL_", extra="ignore", frozen=False)

    home: Path = Field(default=Path("~/.tokenmill"), description="State directory of the embedded mode.")
    host: str = Field(default="127.0.0.1", description="Address the server listens on.")
    port: int = Field(default=8000, description="Port the server listens on.")
    database_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DATABASE_URL", "TOKENMILL_DATABASE_URL"),
        description="SQLAlchemy URL; default is a SQLite file under TOKENMILL_HOME.",
    )
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "TOKENMILL_REDIS_URL"),
        description="Redis for the bus and rate limits; unset means in-memory (embedded mode).",
    )
    internal_token: str | None = Field(
        default=None, description="Shared secret for worker endpoints and the internal bus endpoint."
    )
    secret_key: str | None = Field(default=None, description="Key of the keyed hash of API keys.")
    bus_url: str | None = Field(
        default=None, description="Internal bus endpoint a worker publishes to when there is no Redis."
    )
    model: str = Field(default=BUNDLED_MODEL, description="Model the embedded server serves.")
    embed_model: str = Field(
        default=BUNDLED_EMBED_MODEL,
        description="Embedding model the embedded server serves with a second local worker; empty = none.",
    )
    model_cache: Path | None = Field(default=None, description="Converted model cache; default HOME/models.")
    spool_dir: Path | None = Field(
        default=None,
        description="Where usage events wait while the bus is unreachable; default HOME/spool.",
    )
    spawn_worker: bool = Field(default=True, description="Whether `serve` starts a local worker.")
    worker_host: str = Field(default="127.0.0.1", description="Address a worker listens on.")
    worker_port: int = Field(default=0, description="Port a worker listens on; 0 picks a free one.")
    worker_advertise_host: str | None = Field(
        default=None,
        description="Address a worker announces to the gateways when it listens on all interfaces "
        "(its pod IP on Kubernetes); default the listen address.",
    )
    gpu_type: str | None = Field(
        default=None,
        description="The accelerator a worker runs on, as the price book names it (GPU-hour billing).",
    )
    worker_wait_seconds: float = Field(
        default=120.0, description="How long a request waits for a worker of its deployment to appear."
    )
    heartbeat_seconds: float = Field(default=1.0, description="Worker heartbeat interval.")
    worker_timeout_seconds: float = Field(
        default=3.0, description="A worker without a heartbeat for this long is not routed to."
    )
    # Timeouts of the outbound calls: a worker or Redis that accepts a connection and never
    # answers must fail a request (or fail open) within bounded time, never hang it.
    upstream_connect_timeout_seconds: float = Field(
        default=5.0, gt=0, description="How long the gateway waits to connect to a worker."
    )
    upstream_first_byte_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How long the gateway waits for a worker's response headers (a stream starts at "
        "once; embeddings and on-demand adapter loads answer after their work); past it the request "
        "is retried on another worker.",
    )
    upstream_idle_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Longest silence the gateway allows inside a worker's response; a worker sends a "
        "keep-alive line every 2 s while a request waits or prefills, so only a hung one trips it.",
    )
    redis_timeout_seconds: float = Field(
        default=2.0,
        gt=0,
        description="How long a Redis client waits to connect and for each reply (beyond a blocking "
        "read's own wait); past it the call fails as an outage.",
    )
    routing: Literal["prefix", "round_robin", "least_loaded"] = Field(
        default="prefix",
        description="How a gateway picks a worker: `prefix` (longest cached prompt prefix, unless "
        "that worker is much busier), `round_robin` or `least_loaded`.",
    )
    torch_threads: int | None = Field(default=None, description="torch intra-op threads on a worker.")
    block_size: int = Field(default=16, description="Tokens per KV cache block (workers and the router).")
    max_num_seqs: int = Field(default=64, description="Most sequences a worker runs at once.")
    max_num_batched_tokens: int = Field(default=2048, description="Token budget of one engine step.")
    kv_cache_gib: float | None = Field(
        default=None,
        gt=0,
        description="KV cache memory of a CPU worker, in GiB; default: 40% of the host's (or the "
        "container's) memory shared among the workers on the host, at most 8 GiB each.",
    )
    kv_prefault_gib: float = Field(
        default=2.0,
        ge=0,
        description="How much of a CPU worker's KV cache a background thread maps in at start, at "
        "the lowest priority, so that requests do not pay for first touching it; 0 = none.",
    )
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto",
        description="What a worker's KV cache stores: `auto` (the model's dtype, fp32 on the CPU) "
        "or a half-precision type: `float16` holds twice the tokens in the same memory and halves "
        "the cache reads of every decode step (the CPU kernels read it), at the cost of rounding "
        "every key and value.",
    )
    prefix_caching: bool = Field(default=True, description="Whether workers reuse cached prompt prefixes.")
    scheduling: Literal["fair", "fcfs"] = Field(
        default="fair",
        description="How a worker admits waiting requests: `fair` (per-organisation service counters, "
        "so one tenant's flood cannot starve the others; priority classes first) or `fcfs`.",
    )
    num_speculative_tokens: int = Field(
        default=0,
        ge=0,
        description="Speculative decoding on workers: draft tokens (n-gram prompt lookup) verified per "
        "step for greedy requests while few sequences run; 0 = off.",
    )
    attention_backend: str | None = Field(
        default=None,
        description="`cpu` (the C kernel reading the paged cache in place), `torch` or `triton`; "
        "default: Triton on CUDA, the C kernel on the CPU (PyTorch where it cannot be built).",
    )
    default_requests_per_minute: int = Field(
        default=600, description="Requests a minute of an organisation without a plan; 0 = no limit."
    )
    default_tokens_per_minute: int = Field(
        default=1_000_000,
        description="Tokens a minute (prompt + max_tokens) of an organisation without a plan; 0 = no limit.",
    )
    default_max_concurrent: int = Field(
        default=64, description="Concurrent requests of an organisation without a plan; 0 = no limit."
    )
    default_max_dedicated_replicas: int = Field(
        default=16,
        ge=0,
        description="Quota of an organisation whose plan sets none: the sum of its dedicated "
        "deployments' max_replicas; 0 = no limit.",
    )
    default_max_gpus: int = Field(
        default=16,
        ge=0,
        description="Quota of an organisation whose plan sets none: GPUs of all its dedicated "
        "deployments at max_replicas; 0 = no limit.",
    )
    celery_broker_url: str | None = Field(
        default=None,
        description="Broker and result backend of the Celery workers and beat; default REDIS_URL.",
    )
    job_time_limit_seconds: int = Field(
        default=3600,
        gt=60,
        description="Hard time limit of one periodic billing job or export (soft limit: 60 s earlier).",
    )
    scheduler: bool = Field(
        default=True,
        description="Whether `serve` runs the periodic billing jobs in-process; turn off when Celery "
        "beat runs them against the same database.",
    )
    rollup_minute: int = Field(
        default=5, ge=0, le=59, description="Minute past each hour at which the last full hours roll up."
    )
    rollup_lookback_hours: int = Field(
        default=3,
        ge=1,
        description="Full hours each hourly rollup recomputes, so usage that reaches the ledger late "
        "(replayed from a spool) is still counted.",
    )
    invoice_hour: int = Field(
        default=0,
        ge=0,
        le=23,
        description="UTC hour at which draft invoices are refreshed daily (and the previous month is "
        "finalized on the 1st).",
    )
    invoice_minute: int = Field(
        default=30,
        ge=0,
        le=59,
        description="Minute past `invoice_hour` of the daily invoice job.",
    )
    stripe_sync_minutes: int = Field(
        default=15, ge=0, description="Interval of the Stripe sync job in minutes; 0 turns it off."
    )
    # Secrets as SecretStr: a logged or printed Settings shows '**********', never the key.
    stripe_api_key: SecretStr | None = Field(
        default=None, description="Stripe secret API key (`sk_...`); unset: nothing is sent to Stripe."
    )
    stripe_webhook_secret: SecretStr | None = Field(
        default=None,
        description="Signing secret (`whsec_...`) of the Stripe webhook endpoint `/webhooks/stripe`; "
        "unset: the endpoint answers 503.",
    )
    stripe_api_base: str | None = Field(
        default=None, description="Base URL of the Stripe API; default Stripe's own (tests use a fake)."
    )
    stripe_meter_prefix: str = Field(
        default="tokenmill_",
        description="Prefix of the Stripe meter event names in `meters` mode: `<prefix>input_tokens`, "
        "`<prefix>cached_input_tokens`, `<prefix>output_tokens`, `<prefix>gpu_seconds`, and the "
        "`<prefix>batch_input_tokens`, `<prefix>batch_cached_input_tokens`, `<prefix>batch_output_tokens` "
        "of requests run in a batch.",
    )
    storage_url: str | None = Field(
        default=None,
        description="Where weights, adapter files and the files of /v1/files are stored: `file:///path` "
        "or `s3://bucket/prefix`; default HOME/storage.",
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="Endpoint of an S3-compatible server (MinIO, Ceph...); default AWS."
    )
    s3_region: str | None = Field(default=None, description="S3 region; default boto3's configuration.")
    # --- hostile input (issue 14): who the client is, failed keys, public URL -----------------
    public_url: str | None = Field(
        default=None,
        description="The URL users reach this server at (e.g. `https://llm.example.com`); when it is "
        "https, the dashboard's cookies are `Secure` and its pages send `Strict-Transport-Security`.",
    )
    trusted_proxies: Annotated[str, AfterValidator(check_trusted_proxies)] = Field(
        default="",
        description="Reverse proxies (addresses or CIDR blocks, comma-separated) whose "
        "`X-Forwarded-For` names the client, for the per-address limits of failed API keys and "
        "dashboard sign-ins; default none: the TCP peer is the client and the header is ignored.",
    )
    key_cache_size: int = Field(
        default=10_000,
        ge=1,
        description="API key records a gateway keeps in memory (least recently used out).",
    )
    key_cache_misses: int = Field(
        default=1_000,
        ge=1,
        description="Unknown API keys a gateway remembers (2 s each, least recently used out), so a "
        "repeated bad key skips the database.",
    )
    auth_failures_per_minute: int = Field(
        default=20,
        ge=0,
        description="Failed API key authentications a client address may make in a burst, then one "
        "every 60/N s, before further attempts get 429 without a database read; 0 = no limit.",
    )
    refusals_flush_seconds: float = Field(
        default=10.0,
        gt=0,
        description="How often a gateway adds the refused requests it counted (per organisation, key, "
        "reason and minute) to the database; also on shutdown.",
    )
    key_last_used_seconds: float = Field(
        default=30.0,
        gt=0,
        description="How often a gateway writes the last use of the API keys used since (one statement "
        "for all of them; never a write per request).",
    )
    max_lora_rank: int = Field(
        default=64, ge=1, description="Largest LoRA rank an uploaded adapter may have."
    )
    max_loras: int = Field(
        default=4,
        ge=0,
        description="LoRA adapters a worker runs at once (device slots; others wait for a free one, "
        "least recently used evicted); 0 = the worker serves no adapters.",
    )
    max_cpu_loras: int | None = Field(
        default=None,
        description="LoRA adapters a worker keeps loaded in CPU memory (listed in its heartbeats); "
        "default twice `max_loras`.",
    )
    lora_backend: str | None = Field(
        default=None, description="`torch` or `triton` for LoRA; default: Triton on CUDA, PyTorch on CPU."
    )
    # --- vLLM workers (issue 17): `tokenmill worker --engine vllm` generates through vLLM's
    # OpenAI server, started as a child process or reached at a URL, and is the same worker
    # toward the fleet. ---------------------------------------------------------------------
    worker_engine: Literal["builtin", "vllm"] = Field(
        default="builtin",
        description="What a generate worker runs on: `builtin` (our engine) or `vllm` (a vLLM OpenAI "
        "server, for what outgrows ours: several GPUs per replica, other architectures, quantized "
        "weights).",
    )
    vllm_url: str | None = Field(
        default=None,
        description="A vLLM worker's vLLM server, already running (e.g. a container beside it); unset: "
        "the worker starts one as a child process (TOKENMILL_VLLM_COMMAND).",
    )
    vllm_command: str | None = Field(
        default=None,
        description="Command (shell words) that starts vLLM's OpenAI server; the worker appends the "
        "model, port, block size, KV events and engine flags. Default `<TOKENMILL_VLLM_VENV>/bin/python "
        "-m vllm.entrypoints.openai.api_server`.",
    )
    vllm_venv: Path = Field(
        default=Path(".venv-vllm"), description="Virtual environment holding vLLM (`make vllm`)."
    )
    vllm_engine_args: str | None = Field(
        default=None,
        description="A vLLM deployment's engine arguments as a JSON object (tokenmill/vllm_args.py's "
        "allowlist, e.g. tensor_parallel_size, quantization, max_model_len), rendered as vLLM flags.",
    )
    vllm_startup_timeout_seconds: float = Field(
        default=900.0,
        gt=0,
        description="How long a vLLM worker waits for its vLLM server to answer /health (a first start "
        "compiles the model for minutes).",
    )
    vllm_kv_events_endpoint: str | None = Field(
        default=None,
        description="ZMQ endpoint of the KV events of the vLLM server at TOKENMILL_VLLM_URL (started "
        'with --kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        '"tcp://*:5557"}\' and this `tcp://127.0.0.1:5557`); unset: that worker publishes no KV events. '
        "A child server's endpoint is chosen by the worker.",
    )
    autoscaler: Literal["local", "kubernetes", "none"] = Field(
        default="local",
        description="Who starts workers for the deployments: `local` (subprocesses of `serve` or "
        "`tokenmill autoscaler`), `kubernetes` (a Deployment per model deployment) or `none` "
        "(workers are started by hand).",
    )
    autoscale_interval_seconds: float = Field(
        default=2.0, gt=0, description="How often the reconciler compares desired and live workers."
    )
    kubernetes_namespace: str = Field(default="tokenmill", description="Namespace of the worker Deployments.")
    worker_image: str = Field(
        default="tokenmill-worker:0.1.0", description="Container image of GPU workers (Kubernetes)."
    )
    worker_secret: str = Field(
        default="tokenmill-worker",
        description="Kubernetes Secret whose keys become the workers' environment (internal token, "
        "Redis and storage URLs).",
    )
    # --- production on Kubernetes (issue 22): streams and shutdown, the workers' token and size,
    # the application's database role.
    max_stream_seconds: float = Field(
        default=600.0,
        gt=0,
        description="Longest a response stream may run (the gateway ends one that runs longer); a "
        "stopping server waits at least this long for the streams in flight.",
    )
    response_retention_days: float = Field(
        default=30.0,
        gt=0,
        description="How long a response of /v1/responses created with `store` is kept; past it, it "
        "is 404 and the `purge_responses` job deletes it.",
    )
    shutdown_grace_seconds: float | None = Field(
        default=None,
        description="How long a stopping server waits for requests in flight before closing them "
        "(uvicorn's graceful timeout); default, and at least, TOKENMILL_MAX_STREAM_SECONDS.",
    )
    worker_token: str | None = Field(
        default=None,
        description="Token the gateways present to workers and workers publish heartbeats and KV "
        "events with; unlike the internal token it cannot publish usage or key changes. Default "
        "TOKENMILL_INTERNAL_TOKEN.",
    )
    worker_resources: dict[str, dict[str, int]] = Field(
        default={},
        description="Per GPU type, one GPU's share of a worker pod on Kubernetes (a pod with n GPUs "
        'asks n times it), as JSON: {"a10g": {"cpu_millis": 7500, "memory_mib": 28672, '
        '"ephemeral_gib": 80, "model_cache_gib": 60}}; infra/terraform derives it from the node types.',
    )
    # --- vLLM worker pods on Kubernetes (issue 17): vLLM's own image beside the worker's.
    vllm_image: Annotated[str, AfterValidator(check_image_digest)] = Field(
        default=VLLM_IMAGE,
        description="vLLM's OpenAI server image, pinned by sha256 digest, that runs beside the worker "
        "image in the Kubernetes pods of `vllm` deployments (the worker image does not bundle vLLM).",
    )
    app_database_url: str | None = Field(
        default=None,
        description="For `migrate upgrade` run as the database owner: the services' DATABASE_URL, "
        "whose role is created (or its password set) and granted data access only, no DDL.",
    )
    # --- what one request may ask for (OpenAI's limits where it has them); each a clear 400 ---
    max_request_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="Largest request body of the OpenAI API (413 above it)."
    )
    max_messages: int = Field(default=2048, ge=1, description="Most `messages` in one chat request.")
    max_stop: int = Field(default=4, ge=0, description="Most `stop` strings in one request (OpenAI: 4).")
    max_stop_chars: int = Field(default=1000, ge=1, description="Longest `stop` string, in characters.")
    max_logit_bias: int = Field(default=300, ge=0, description="Most `logit_bias` entries (OpenAI: 300).")
    max_tools: int = Field(default=128, ge=0, description="Most `tools` in one chat request (OpenAI: 128).")
    max_guided_choices: int = Field(default=1024, ge=1, description="Most `guided_choice` entries.")
    max_schema_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Largest JSON schema (response_format, guided_json, each tool's parameters) or "
        "`guided_regex`/`guided_grammar`, in bytes of JSON.",
    )
    max_schema_depth: int = Field(default=32, ge=2, description="Deepest nesting of such a JSON schema.")
    max_n: int = Field(default=16, ge=1, description="Largest `n` (choices per prompt).")
    max_prompts: int = Field(
        default=16, ge=1, description="Most prompts in one text completion request (each its own choices)."
    )
    max_top_logprobs: int = Field(default=20, ge=0, description="Largest `top_logprobs` (OpenAI: 20).")
    max_embedding_inputs: int = Field(
        default=2048, ge=1, description="Most inputs in one embeddings request (OpenAI: 2048)."
    )
    # --- what one uploaded file (`POST /v1/files`) may hold (OpenAI's Batch API limits) ---
    max_file_bytes: int = Field(
        default=200 * 1024 * 1024,
        ge=1024,
        description="Largest file `POST /v1/files` accepts, in bytes (413 while it arrives, before it "
        "is stored); OpenAI's limit for batch input files is 200 MB.",
    )
    max_file_lines: int = Field(
        default=50_000,
        ge=1,
        description="Most lines (requests) of an uploaded batch file (400 above it); OpenAI's limit "
        "is 50,000 requests per batch.",
    )
    # --- the Batch API (`/v1/batches`, issue 19): its window, queue limit and runner ---
    batch_window_seconds: float = Field(
        default=86400.0,
        gt=0,
        description="How long a batch may run after it is created (its `24h` completion window); what "
        "has not run by then ends in the error file as `batch_expired`. Tests shorten it.",
    )
    batch_queue_tokens: int = Field(
        default=100_000_000,
        ge=0,
        description="An organisation's batch queue limit: the most tokens (estimated prompt + max output) "
        "its unfinished batches may hold; a batch that would pass it fails at validation with "
        "`token_limit_exceeded`. 0 = no limit.",
    )
    batch_concurrency: int = Field(
        default=8,
        ge=1,
        description="Lines one batch runner keeps in flight; fewer while workers report waiting requests.",
    )
    gateway_url: str | None = Field(
        default=None,
        description="Where batch runners outside `tokenmill serve` (Celery) send a batch's lines: the "
        "gateway's internal address, e.g. `http://tokenmill-gateway.tokenmill.svc`. `serve` uses its own.",
    )
    prep_threads: int = Field(
        default=max(1, (os.cpu_count() or 2) // 2),
        ge=1,
        description="Threads of a gateway that render chat templates, tokenize and compile grammars "
        "of large requests off its event loop (one at a time per organisation); default half the CPUs.",
    )
    log_level: str = Field(default="INFO", description="Python logging level.")
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="`text` (readable lines) or `json` (one JSON object per line: ts, level, logger, "
        "message, and on a request's lines its request_id, org_id, key_id, model and trace_id).",
    )

    @model_validator(mode="after")
    def _shutdown_outlasts_streams(self) -> Settings:
        if self.shutdown_grace_seconds is not None and self.shutdown_grace_seconds < self.max_stream_seconds:
            raise ValueError(
                "TOKENMILL_SHUTDOWN_GRACE_SECONDS must be at least TOKENMILL_MAX_STREAM_SECONDS "
                "(a stopping server would cut the streams in flight)"
            )
        return self

    @property
    def graceful_shutdown_seconds(self) -> float:
        """How long a stopping server waits for requests in flight (never less than a stream)."""
        grace = self.shutdown_grace_seconds
        return grace if grace is not None else self.max_stream_seconds

    @property
    def worker_credential(self) -> str | None:
        """What workers check and publish with, and what gateways present to them."""
        return self.worker_token or self.internal_token

    @cached_property
    def home_dir(self) -> Path:
        return self.home.expanduser()

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.home_dir / 'tokenmill.db'}"

    @property
    def cache_dir(self) -> Path:
        return (self.model_cache or self.home_dir / "models").expanduser()

    @property
    def spool_path(self) -> Path:
        return (self.spool_dir or self.home_dir / "spool").expanduser()

    def ensure_secrets(self) -> None:
        """Fill unset secrets from HOME/secrets.json, generating them on first start.

        Only the embedded mode relies on this; production passes them in the environment.
        """
        self.secure_home()
        path = self.home_dir / "secrets.json"
        stored: dict[str, str] = {}
        if path.exists():
            stored = json.loads(path.read_text())
        changed = False
        for name in ("internal_token", "secret_key"):
            if getattr(self, name):
                continue
            if name not in stored:
                stored[name] = secrets.token_urlsafe(32)
                changed = True
            setattr(self, name, stored[name])
        if changed:
            self.home_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(stored, f)

    def secure_home(self, *, create_db: bool = False) -> None:
        """TOKENMILL_HOME private to its owner: the directory 0700, the secrets and the embedded
        SQLite database (password hashes, cache salts) 0600. Files an older version left
        readable are tightened too, on every start; a mode someone made stricter is kept.

        With `create_db` (the commands that migrate it), the database file is created here,
        empty, before SQLite opens it: SQLite would create it with the umask's mode (0644),
        and gives its journal files the database's mode.
        """
        home = self.home_dir
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        _restrict(home, 0o700)
        private = ["secrets.json"]
        if not self.database_url:
            db = home / "tokenmill.db"
            if create_db:
                os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o600))
            private += [db.name, f"{db.name}-wal", f"{db.name}-shm", f"{db.name}-journal"]
        for name in private:
            if (home / name).exists():
                _restrict(home / name, 0o600)


def _restrict(path: Path, allowed: int) -> None:
    """Drop the permission bits of `path` outside `allowed` (not ours to change: a warning)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & ~allowed:
        try:
            path.chmod(mode & allowed)
        except PermissionError:
            logging.getLogger("tokenmill.settings").warning(
                "%s is mode %o and not ours to restrict to %o", path, mode, mode & allowed
            )


def describe() -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every setting: the README's reference."""
    rows = []
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        env = alias.choices[0] if isinstance(alias, AliasChoices) else f"TOKENMILL_{name.upper()}"
        rows.append((str(env), str(field.default), field.description or ""))
    return rows
