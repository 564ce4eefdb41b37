"""What the reconciler asks of whatever runs workers: a count of replicas per deployment.

A provider never decides how many workers a deployment needs (the policy does) nor
which workers are healthy (the heartbeats say): it makes `replicas` workers exist for a
deployment, reports how many it is keeping, and forgets deployments that are gone.
`LocalProcessProvider` (autoscaler/local.py) runs `tokenmill worker` subprocesses;
`KubernetesProvider` (autoscaler/kubernetes.py) keeps one Deployment per model deployment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """What a provider needs to run one deployment's workers."""

    deployment_id: str
    name: str  # the deployment's name (unique); Kubernetes names derive from it
    model: str  # model source a worker loads: bundled:smollm2, store:<key>, a path
    kind: str = "generate"  # generate | embed
    gpu_type: str | None = None  # None: CPU
    engine: str = "builtin"  # builtin | vllm
    # Validated vLLM engine arguments (control_plane.catalog.engines), as `--flag value` options.
    engine_args: dict[str, Any] = field(default_factory=dict)
    gpus: int = 1  # GPUs one worker holds (gpus_per_replica); unused on CPU
    # Per-deployment extras from the deployment's config (resources, node selector...).
    options: dict[str, Any] = field(default_factory=dict)


class Provider(Protocol):
    @property
    def name(self) -> str:
        """What runs the workers (local, kubernetes): the label of the provider's error metric."""
        ...

    async def scale(self, spec: WorkerSpec, replicas: int, victims: Sequence[str] = ()) -> None:
        """Make `replicas` workers of `spec` exist. When it must stop some, it stops those in
        `victims` (worker ids, most preferred first) before any others, when it can choose."""
        ...

    async def replicas(self, deployment_id: str) -> int:
        """Workers the provider keeps for the deployment (starting or running, not stopping)."""
        ...

    async def replace(self, deployment_id: str, worker_id: str) -> None:
        """A worker stopped answering (no heartbeats): stop it for good; the next `scale`
        starts its replacement."""
        ...

    async def remove(self, deployment_id: str) -> None:
        """The deployment is gone: stop all its workers and forget it."""
        ...

    async def managed(self) -> list[str]:
        """Deployment ids the provider currently runs workers for."""
        ...

    async def close(self) -> None:
        """Stop everything this provider started and owns (local processes); a provider
        whose workers outlive it (Kubernetes) only closes its client."""
        ...
