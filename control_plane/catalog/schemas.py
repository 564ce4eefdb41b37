"""Wire types of the catalogue: models, deployments, adapters."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from control_plane.wire import Body, ModelName

# --- models ----------------------------------------------------------------------------

ContextLength = Annotated[int, Meta(ge=1, le=16_777_216)]


class ModelCreate(Body):
    name: ModelName
    source: Annotated[str, Meta(min_length=1, max_length=1000)]
    format: Literal["hf", "gguf"] = "hf"
    kind: Literal["generate", "embed"] = "generate"
    context_length: ContextLength = 2048


class ModelUpdate(Body):
    source: Annotated[str, Meta(min_length=1, max_length=1000)] | UnsetType = UNSET
    format: Literal["hf", "gguf"] | UnsetType = UNSET
    context_length: ContextLength | UnsetType = UNSET


class ModelOut(msgspec.Struct):
    id: str
    name: str
    source: str
    format: str
    kind: str
    context_length: int
    created_at: datetime


# --- deployments -----------------------------------------------------------------------

GpuType = Annotated[str, Meta(min_length=1, max_length=50, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Replicas = Annotated[int, Meta(ge=0, le=1000)]
AdapterIds = Annotated[list[Annotated[str, Meta(min_length=1, max_length=40)]], Meta(max_length=100)]


Seconds = Annotated[float, Meta(gt=0, le=86_400)]
Engine = Literal["builtin", "vllm"]
# vLLM's engine arguments by name; the allowlist, types and ranges are checked by the service
# (control_plane/catalog/engines.py), so a 400 names the argument: `engine_args.<name>`.
EngineArgs = Annotated[dict[str, Any], Meta(max_length=64)]
Gpus = Annotated[int, Meta(ge=0, le=64)]


class Autoscaling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """How the autoscaler sizes a deployment between its min and max replicas; unset fields
    take the autoscaler's defaults (autoscaler/policy.py)."""

    target_concurrency: Annotated[float, Meta(gt=0, le=10_000)] | None = None  # requests per replica
    # Requests/s one replica should take: the fleet also follows the arrival rate its workers
    # report, ahead of the queue that concurrency waits for. Unset: concurrency alone.
    target_rate: Annotated[float, Meta(gt=0, le=100_000)] | None = None
    target_ttft_seconds: Seconds | None = None  # p95; above it the fleet grows
    stable_window_seconds: Seconds | None = None
    panic_window_seconds: Seconds | None = None
    scale_down_cooldown_seconds: Seconds | None = None
    scale_to_zero_grace_seconds: Seconds | None = None  # idle time before a min-0 deployment stops
    # With target_rate: a backlog asks for the replicas that clear it in this time, not one per
    # target_concurrency of it.
    drain_time_seconds: Seconds | None = None
    # With target_rate: start replicas ahead of a burst that recurs (its period is learned).
    forecast: bool | None = None
    forecast_lead_seconds: Seconds | None = None  # how far ahead: longer than a cold start


class DeploymentCreate(Body):
    name: ModelName
    model: Annotated[str, Meta(min_length=1, max_length=200)]  # id or name of a base model
    type: Literal["serverless", "dedicated"] = "dedicated"
    org_id: str | None = None  # owner of a dedicated deployment (org admins: their own)
    adapters: AdapterIds = []
    gpu_type: GpuType | None = None  # a dedicated deployment's must be in the price book
    min_replicas: Replicas = 1
    max_replicas: Replicas = 1
    status: Literal["active", "stopped"] = "active"
    autoscaling: Autoscaling | None = None
    engine: Engine = "builtin"
    engine_args: EngineArgs = {}
    # Default: tensor_parallel_size x pipeline_parallel_size with a gpu_type, 0 without.
    gpus_per_replica: Gpus | None = None


class DeploymentUpdate(Body):
    adapters: AdapterIds | UnsetType = UNSET
    gpu_type: GpuType | UnsetType | None = UNSET
    min_replicas: Replicas | UnsetType = UNSET
    max_replicas: Replicas | UnsetType = UNSET
    status: Literal["active", "stopped"] | UnsetType = UNSET
    autoscaling: Autoscaling | UnsetType = UNSET  # replaces the whole setting
    engine: Engine | UnsetType = UNSET  # back to builtin drops the engine_args
    engine_args: EngineArgs | UnsetType = UNSET  # replaces the whole setting
    # Unset: kept, raised to what the engine's parallelism needs (0 without a gpu_type).
    gpus_per_replica: Gpus | UnsetType = UNSET


class DeploymentOut(msgspec.Struct):
    id: str
    name: str
    model_id: str
    org_id: str | None
    type: str
    kind: str
    gpu_type: str | None
    min_replicas: int
    max_replicas: int
    status: str  # active | stopped | suspended (its organisation is)
    adapters: list[str]
    created_at: datetime
    autoscaling: Autoscaling = Autoscaling()
    engine: str = "builtin"
    engine_args: dict[str, Any] = {}
    gpus_per_replica: int = 0  # GPUs one worker holds (0: a CPU deployment)


# --- adapters --------------------------------------------------------------------------


class AdapterOut(msgspec.Struct):
    id: str
    org_id: str
    model_id: str
    name: str
    rank: int
    target_modules: list[str] | None
    size_bytes: int | None
    sha256: str | None
    created_at: datetime
