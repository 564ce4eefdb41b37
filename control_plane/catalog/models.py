"""Tables of the catalogue: base models, LoRA adapters, deployments, worker lifetimes. Read by
the gateway (what serves a model), the autoscaler (what to run) and billing (what to charge)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, String, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column, relationship

# Adapters and deployments belong to organisations: their table is registered with these.
import control_plane.orgs.models  # noqa: F401
from tokenmill.db import Base, Timestamped, new_id

# A deployment's statuses: `active` runs, `stopped` (by an admin) does not, and `suspended`
# is an active one of a suspended organisation, held at zero replicas until it is resumed.
ACTIVE = "active"
STOPPED = "stopped"
SUSPENDED = "suspended"

# A deployment's engines: ours (workers/engine), or vLLM for what ours cannot serve yet.
BUILTIN = "builtin"
VLLM = "vllm"


def _default_gpus(context: Any) -> int:
    # Rows written without the service (bootstrap, tests): one GPU with a GPU type, none on
    # CPU. The service sets the column from the engine's parallelism (catalog/engines.py).
    return 1 if context.get_current_parameters().get("gpu_type") else 0


class Model(Timestamped, Base):
    """A base model in the catalogue."""

    __tablename__ = "models"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("model"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(String(1000))  # path, storage URI or bundled:<name>
    format: Mapped[str] = mapped_column(String(20), default="hf")  # hf | gguf
    kind: Mapped[str] = mapped_column(String(20), default="generate")  # generate | embed
    context_length: Mapped[int] = mapped_column(default=2048)


class Adapter(Timestamped, Base):
    """A LoRA adapter, owned by one organisation, on one base model."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("org_id", "name"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("adapter"))
    org_id: Mapped[str] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"), index=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(String(1000))  # full address, e.g. s3://bucket/prefix/adapters/...
    rank: Mapped[int] = mapped_column(default=8)
    target_modules: Mapped[list[str] | None] = mapped_column(JSON)
    # Directory-like key in the storage (tokenmill.storage) holding adapter_config.json and
    # adapter_model.safetensors; a worker with the same storage settings fetches from there.
    storage_key: Mapped[str | None] = mapped_column(String(500))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)  # both files together
    sha256: Mapped[str | None] = mapped_column(String(64))  # of adapter_model.safetensors


class Deployment(Timestamped, Base):
    """What serves a model: the shared serverless deployment, or a dedicated one owned by an org."""

    __tablename__ = "deployments"
    __table_args__ = (
        # Names are unique per organisation, so no tenant learns another's from a conflict;
        # serverless ones (no org) among themselves, which a plain unique constraint would not
        # do (NULLs are distinct), hence the partial index, read alike by SQLite and PostgreSQL.
        UniqueConstraint("org_id", "name"),
        Index(
            "uq_deployments_serverless_name",
            "name",
            unique=True,
            sqlite_where=text("org_id IS NULL"),
            postgresql_where=text("org_id IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("dep"))
    name: Mapped[str] = mapped_column(String(200))
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    org_id: Mapped[str | None] = mapped_column(ForeignKey("organizations.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(20), default="generate")  # generate | embed
    type: Mapped[str] = mapped_column(String(20), default="serverless")  # serverless | dedicated
    gpu_type: Mapped[str | None] = mapped_column(String(50))
    min_replicas: Mapped[int] = mapped_column(default=1)
    max_replicas: Mapped[int] = mapped_column(default=1)
    status: Mapped[str] = mapped_column(String(20), default=ACTIVE)  # ACTIVE | STOPPED | SUSPENDED
    config: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    engine: Mapped[str] = mapped_column(String(20), default=BUILTIN)  # BUILTIN | VLLM
    # vLLM's engine arguments, validated against tokenmill/vllm_args.py's allowlist; {} for builtin.
    engine_args: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # GPUs one worker holds: what quotas count and GPU-hours are multiplied by; 0 without a
    # gpu_type (CPU workers are not billed by GPU-hour).
    gpus_per_replica: Mapped[int] = mapped_column(default=_default_gpus)

    model: Mapped[Model] = relationship(lazy="raise")


class Worker(Base):
    """One worker's lifetime: dedicated deployments are billed on these."""

    __tablename__ = "workers"
    __table_args__ = (Index("ix_workers_deployment_started", "deployment_id", "started_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    deployment_id: Mapped[str | None] = mapped_column(ForeignKey("deployments.id", ondelete="SET NULL"))
    address: Mapped[str] = mapped_column(String(300))
    model: Mapped[str] = mapped_column(String(200))
    gpu_type: Mapped[str | None] = mapped_column(String(50))
    # GPUs it held: its deployment's gpus_per_replica when it joined (0 for a deployment this
    # database does not know), so changing a deployment never re-prices hours already run.
    gpus: Mapped[int] = mapped_column(default=1)
    status: Mapped[str] = mapped_column(String(20), default="running")  # running | stopped | lost
    started_at: Mapped[datetime]
    last_seen_at: Mapped[datetime | None]
    stopped_at: Mapped[datetime | None]
