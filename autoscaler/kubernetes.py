"""KubernetesProvider: one apps/v1 Deployment per model deployment, through the official client.

`worker_manifest` is the contract shared with infra/terraform/modules/tokenmill: a pure
function from a `WorkerSpec` to the Deployment body, plain JSON-ready dicts. The provider
only ever reads a Deployment, creates it, replaces it (its pod template changed), patches its
scale subresource, marks pods as preferred victims, deletes a pod and deletes a Deployment;
the ReplicaSet does the rest. Workers outlive the provider: `close` only closes the client.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from autoscaler.providers import WorkerSpec

if TYPE_CHECKING:
    from tokenmill.settings import Settings

log = logging.getLogger("tokenmill.autoscaler.kubernetes")

T = TypeVar("T")

NAME_PREFIX = "tm-worker-"
MAX_NAME = 63  # a DNS-1123 label: the name also becomes a label value and pod name prefix
LABEL_NAME = "app.kubernetes.io/name"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT = "tokenmill.dev/deployment"
LABEL_GPU_TYPE = "tokenmill.dev/gpu-type"  # on GPU nodes, set by the Terraform cluster module
ANNOTATION_SPEC_HASH = "tokenmill.dev/spec-hash"
ANNOTATION_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MANAGED_BY = "tokenmill-autoscaler"
GPU_RESOURCE = "nvidia.com/gpu"

WORKER_PORT = 8080
WORKER_HOME = "/var/lib/tokenmill"
SERVICE_ACCOUNT = "tokenmill-worker"
RUN_AS = 10001
# Workers drain their in-flight streams on SIGTERM; a long generation may take minutes.
GRACE_SECONDS = 600
DEFAULT_RESOURCES = {"gpu": {"cpu": "4", "memory": "32Gi"}, "cpu": {"cpu": "2", "memory": "8Gi"}}
VICTIM_COST = "-1000"  # below the default 0: the ReplicaSet removes these pods first
REQUEST_TIMEOUT = 30.0  # seconds; a hung API server must not stall the reconciler forever


class ProviderError(Exception):
    """A Kubernetes API call failed; the message names the operation and the status only."""


def worker_name(spec: WorkerSpec) -> str:
    """`tm-worker-<slug>`, at most 63 characters; a long or empty slug gets a hash suffix."""
    slug = re.sub(r"[^a-z0-9]+", "-", spec.name.lower()).strip("-")
    if slug and len(NAME_PREFIX) + len(slug) <= MAX_NAME:
        return NAME_PREFIX + slug
    # The suffix keeps two long names that share a prefix apart; an empty slug (a name without
    # any ASCII letter or digit) would end the name with "-", which is invalid.
    digest = hashlib.sha256(spec.deployment_id.encode()).hexdigest()[:8]
    keep = MAX_NAME - len(NAME_PREFIX) - len(digest) - 1
    return f"{NAME_PREFIX}{slug[:keep]}-{digest}" if slug else f"{NAME_PREFIX}{digest}"


def spec_hash(template: dict[str, Any]) -> str:
    # Compact JSON with sorted keys is what Terraform's jsonencode produces, so both sides
    # hash the same bytes (for ASCII values without <, > or &, which jsonencode escapes).
    text = json.dumps(template, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def worker_labels(spec: WorkerSpec) -> dict[str, str]:
    return {
        LABEL_NAME: "tokenmill-worker",
        LABEL_PART_OF: "tokenmill",
        LABEL_COMPONENT: "worker",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_DEPLOYMENT: spec.deployment_id,
    }


def worker_manifest(
    spec: WorkerSpec, replicas: int, *, namespace: str, image: str, secret: str
) -> dict[str, Any]:
    """The Deployment that runs `replicas` workers of `spec` (the manifest contract)."""
    labels = worker_labels(spec)
    gpu = spec.gpu_type is not None
    defaults = DEFAULT_RESOURCES["gpu" if gpu else "cpu"]
    cpu = str(spec.options.get("cpu", defaults["cpu"]))
    memory = str(spec.options.get("memory", defaults["memory"]))
    limits = {GPU_RESOURCE: "1", "memory": memory} if gpu else {"memory": memory}

    def field_ref(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    env: list[dict[str, Any]] = [
        {"name": "TOKENMILL_DEPLOYMENT_ID", "value": spec.deployment_id},
        {"name": "TOKENMILL_WORKER_ID", "valueFrom": field_ref("metadata.name")},
        {"name": "TOKENMILL_WORKER_ADVERTISE_HOST", "valueFrom": field_ref("status.podIP")},
        {"name": "TOKENMILL_WORKER_HOST", "value": "0.0.0.0"},
        {"name": "TOKENMILL_WORKER_PORT", "value": str(WORKER_PORT)},
        {"name": "TOKENMILL_HOME", "value": WORKER_HOME},
        # The root filesystem is read-only: caches that default to ~ (Triton's, torch's) too.
        {"name": "HOME", "value": WORKER_HOME},
    ]
    if gpu:
        env.append({"name": "TOKENMILL_GPU_TYPE", "value": spec.gpu_type})

    def probe(period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": "/ready", "port": "http"},  # workers.server.READY_PATH: no token
            "periodSeconds": period,
            "failureThreshold": failures,
        }

    container = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["tokenmill"],
        "args": ["worker", "--model", spec.model],
        "env": env,
        "envFrom": [{"secretRef": {"name": secret}}],
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        # The worker answers /ready only once its model is loaded, which may take minutes.
        "startupProbe": probe(10, 60),
        "readinessProbe": probe(5, 3),
        "livenessProbe": probe(10, 6),
        "resources": {"limits": limits, "requests": {"cpu": cpu, "memory": memory}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "state", "mountPath": WORKER_HOME}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    pod: dict[str, Any] = {
        "serviceAccountName": SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [{"name": "state", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
    }
    if gpu:
        pod["nodeSelector"] = {LABEL_GPU_TYPE: spec.gpu_type}
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    template = {"metadata": {"labels": labels}, "spec": pod}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": worker_name(spec),
            "namespace": namespace,
            "labels": dict(labels),
            "annotations": {ANNOTATION_SPEC_HASH: spec_hash(template)},
        },
        "spec": {
            "replicas": replicas,
            "selector": {
                "matchLabels": {LABEL_NAME: labels[LABEL_NAME], LABEL_DEPLOYMENT: spec.deployment_id}
            },
            "template": template,
        },
    }


@dataclass(slots=True)
class KubernetesProvider:
    """Keeps one Deployment per model deployment in `namespace`; see the module docstring."""

    api: client.ApiClient
    namespace: str
    image: str
    secret: str
    apps: client.AppsV1Api = field(init=False)
    core: client.CoreV1Api = field(init=False)
    # deployment id -> Deployment name, so reads after a scale need no list call.
    names: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.apps = client.AppsV1Api(self.api)
        self.core = client.CoreV1Api(self.api)

    @classmethod
    def from_settings(cls, settings: Settings) -> KubernetesProvider:
        """In a pod: its service account; elsewhere: the current kubeconfig context."""
        from kubernetes import config

        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
        return cls(
            client.ApiClient(configuration),
            namespace=settings.kubernetes_namespace,
            image=settings.worker_image,
            secret=settings.worker_secret,
        )

    async def scale(self, spec: WorkerSpec, replicas: int, victims: Sequence[str] = ()) -> None:
        body = worker_manifest(spec, replicas, namespace=self.namespace, image=self.image, secret=self.secret)
        name = body["metadata"]["name"]
        current = await self._read(name)
        if current is None:
            create = self.apps.create_namespaced_deployment
            if await self._call("create deployment", name, create, self.namespace, body, allow=(409,)):
                self.names[spec.deployment_id] = name
                log.info("created deployment %s with %d replicas", name, replicas)
                return
            # Created by someone else between our read and our create: carry on from theirs.
            current = await self._read(name)
            if current is None:
                raise ProviderError(f"kubernetes create deployment {name}: conflict, then not found")
        owner = (current.metadata.labels or {}).get(LABEL_DEPLOYMENT)
        if owner != spec.deployment_id:
            # Two deployment names can slug alike ("Foo Bar", "foo-bar"): never take over the other.
            raise ProviderError(
                f"kubernetes deployment {name} belongs to deployment {owner!r}, not {spec.deployment_id!r}"
            )
        self.names[spec.deployment_id] = name
        annotations = current.metadata.annotations or {}
        if annotations.get(ANNOTATION_SPEC_HASH) != body["metadata"]["annotations"][ANNOTATION_SPEC_HASH]:
            replace = self.apps.replace_namespaced_deployment
            await self._call("replace deployment", name, replace, name, self.namespace, body)
            log.info("replaced deployment %s (pod template changed), %d replicas", name, replicas)
            return
        have = current.spec.replicas or 0
        if have == replicas:
            return
        # Only as many victims as pods go: a marked pod that stays would be picked first later.
        for pod in victims[: max(have - replicas, 0)]:
            patch = {"metadata": {"annotations": {ANNOTATION_DELETION_COST: VICTIM_COST}}}
            patch_pod = self.core.patch_namespaced_pod
            await self._call("mark pod", pod, patch_pod, pod, self.namespace, patch, allow=(404,))
        patch_scale = self.apps.patch_namespaced_deployment_scale
        await self._call(
            "scale deployment", name, patch_scale, name, self.namespace, {"spec": {"replicas": replicas}}
        )
        log.info("scaled deployment %s from %d to %d replicas", name, have, replicas)

    async def replicas(self, deployment_id: str) -> int:
        return sum(d.spec.replicas or 0 for d in await self._find(deployment_id))

    async def replace(self, deployment_id: str, worker_id: str) -> None:
        # The worker id is its pod's name (TOKENMILL_WORKER_ID from metadata.name); the
        # ReplicaSet starts a new pod as soon as this one is gone.
        delete = self.core.delete_namespaced_pod
        await self._call("delete pod", worker_id, delete, worker_id, self.namespace, allow=(404,))

    async def remove(self, deployment_id: str) -> None:
        name = self.names.pop(deployment_id, None)
        if name is None:
            names = [d.metadata.name for d in await self._list(f"{LABEL_DEPLOYMENT}={deployment_id}")]
        else:
            names = [name]
        delete = self.apps.delete_namespaced_deployment
        for name in names:
            # Background: the call returns at once; the garbage collector stops the pods, which
            # drain within their grace period.
            await self._call(
                "delete deployment",
                name,
                delete,
                name,
                self.namespace,
                propagation_policy="Background",
                allow=(404,),
            )
            log.info("deleted deployment %s", name)

    async def managed(self) -> list[str]:
        found = await self._list(f"{LABEL_MANAGED_BY}={MANAGED_BY}")
        ids = {(d.metadata.labels or {}).get(LABEL_DEPLOYMENT) for d in found}
        return sorted(i for i in ids if i)

    async def close(self) -> None:
        await asyncio.to_thread(self.api.close)

    async def _find(self, deployment_id: str) -> list[Any]:
        """The deployment's Deployment: by its remembered name, else by its label."""
        name = self.names.get(deployment_id)
        if name is not None:
            current = await self._read(name)
            return [current] if current is not None else []
        return await self._list(f"{LABEL_DEPLOYMENT}={deployment_id}")

    async def _read(self, name: str) -> Any | None:
        read = self.apps.read_namespaced_deployment
        return await self._call("read deployment", name, read, name, self.namespace, allow=(404,))

    async def _list(self, selector: str) -> list[Any]:
        listing = self.apps.list_namespaced_deployment
        found = await self._call(
            "list deployments", selector, listing, self.namespace, label_selector=selector
        )
        return list(found.items or [])

    async def _call(
        self,
        operation: str,
        target: str,
        fn: Callable[..., T],
        *args: Any,
        allow: tuple[int, ...] = (),
        **kwargs: Any,
    ) -> T | None:
        """`fn` off the event loop (the client blocks); None for a status in `allow`."""
        try:
            return await asyncio.to_thread(fn, *args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        except ApiException as exc:
            if exc.status in allow:
                return None
            # Only the status and the server's message: the exception's headers and request
            # details are not for logs.
            status = f"HTTP {exc.status} {exc.reason or ''}".rstrip()
            raise ProviderError(f"kubernetes {operation} {target}: {status}{_message(exc.body)}") from None
        except HTTPError as exc:  # unreachable, timed out: urllib3 names the host, never the token
            raise ProviderError(f"kubernetes {operation} {target}: {exc}") from None


def _message(body: str | bytes | None) -> str:
    """The `message` of a Status body, if the server sent one."""
    try:
        message = json.loads(body or "").get("message")
    except (ValueError, AttributeError):
        return ""
    return f": {message[:300]}" if isinstance(message, str) and message else ""
