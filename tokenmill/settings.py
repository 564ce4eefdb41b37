"""One typed settings object, read from the environment.

Everything has a default for the embedded mode, so `tokenmill serve` runs with no
configuration at all; production sets DATABASE_URL, REDIS_URL and the secrets.
"""

from __future__ import annotations

import json
import os
import secrets
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

BUNDLED_MODEL = "bundled:smollm2"
BUNDLED_EMBED_MODEL = "bundled:minilm"


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
    routing: Literal["prefix", "round_robin", "least_loaded"] = Field(
        default="prefix",
        description="How a gateway picks a worker: `prefix` (longest cached prompt prefix, unless "
        "that worker is much busier), `round_robin` or `least_loaded`.",
    )
    torch_threads: int | None = Field(default=None, description="torch intra-op threads on a worker.")
    block_size: int = Field(default=16, description="Tokens per KV cache block (workers and the router).")
    max_num_seqs: int = Field(default=64, description="Most sequences a worker runs at once.")
    max_num_batched_tokens: int = Field(default=2048, description="Token budget of one engine step.")
    kv_cache_gib: float = Field(default=1.0, description="KV cache memory of a CPU worker, in GiB.")
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
        default=None, description="`torch` or `triton`; default: Triton on CUDA, PyTorch on CPU."
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
        "`<prefix>cached_input_tokens`, `<prefix>output_tokens`, `<prefix>gpu_seconds`.",
    )
    storage_url: str | None = Field(
        default=None,
        description="Where weights and adapter files are stored: `file:///path` or `s3://bucket/prefix`; "
        "default HOME/storage.",
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="Endpoint of an S3-compatible server (MinIO, Ceph...); default AWS."
    )
    s3_region: str | None = Field(default=None, description="S3 region; default boto3's configuration.")
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
    log_level: str = Field(default="INFO", description="Python logging level.")

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


def describe() -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every setting: the README's reference."""
    rows = []
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        env = alias.choices[0] if isinstance(alias, AliasChoices) else f"TOKENMILL_{name.upper()}"
        rows.append((str(env), str(field.default), field.description or ""))
    return rows
