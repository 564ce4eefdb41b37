"""KubernetesProvider: one apps/v1 Deployment per model deployment, through the official client.

`worker_manifest` is the contract shared with infra/terraform/modules/tokenmill: a pure
function from a `WorkerSpec` to the Deployment body, plain JSON-ready dicts. The provider
only ever reads a Deployment, creates it, replaces it (its pod template changed), patches its
scale subresource, marks pods as preferred victims, deletes a pod and deletes a Deployment;
the ReplicaSet does the rest. Beside each Deployment it keeps a PodDisruptionBudget (node
drains and consolidation take one worker of a deployment at a time), and it creates the
workers' PriorityClass once. Workers outlive the provider: `close` only closes the client.

Sizes: a GPU worker asks, per GPU, the share of its GPU type in TOKENMILL_WORKER_RESOURCES
(infra/terraform computes it so that it fits the node types it offers; `gpus_per_replica`
asks several GPUs in one pod, see `gpu_count`), a CPU worker a fixed size;
`options["cpu"]`/`["memory"]` override the totals (of vLLM's container in a vLLM pod). Every
worker has a model cache volume of its own size, counted in its ephemeral-storage request with
the rest of its scratch space.

A `vllm` deployment's pod runs vLLM's own image (TOKENMILL_VLLM_IMAGE, pinned by digest) beside
the worker image, which does not bundle vLLM. In start order:

1. `fetch-model` (init container, worker image): resolves the model source into the model
   cache volume exactly as a builtin worker does (fetched from the object storage, a GGUF
   converted) and links it at MODEL_LINK: vLLM's image cannot read our storage or a path in the
   worker image, so the same emptyDir hands it the files.
2. `vllm` (a native sidecar: an init container with `restartPolicy: Always`): the OpenAI server
   on the pod's loopback only (it checks no key and meters nothing), with the pod's GPUs, the
   flags a worker gives the vLLM it starts itself (workers/vllm/server.py: our block size,
   prompt token details, llguidance) and the deployment's engine arguments, and its KV events
   on a Unix socket in a volume only these two containers mount. The worker starts once its
   startup probe has seen `/health`, and on termination it is stopped only after the worker
   has drained its streams.
3. `worker`: `tokenmill worker --engine vllm`, the same worker toward the fleet, reaching vLLM
   at TOKENMILL_VLLM_URL; it reads the adapters it fetches into the model cache, which vLLM
   sees at the same path (read-only) and loads at runtime.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from autoscaler.providers import WorkerSpec
from tokenmill import vllm_args
from tokenmill.settings import check_image_digest
from tokenmill.vllm_args import (
    ENGINE_ARGS_ENV,
    encode_engine_args,
    structured_outputs_config,
    vllm_server_flags,
)

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
ENGINES = ("builtin", "vllm")

WORKER_PORT = 8080
WORKER_HOME = "/var/lib/tokenmill"
MODEL_CACHE = f"{WORKER_HOME}/models"  # TOKENMILL_MODEL_CACHE: a volume of its own, sized
SERVICE_ACCOUNT = "tokenmill-worker"
RUN_AS = 10001
# Workers drain their in-flight streams on SIGTERM: the longest stream a gateway lets run
# (TOKENMILL_MAX_STREAM_SECONDS), plus this margin to say goodbye, before the kubelet kills.
MAX_STREAM_SECONDS = 600
DRAIN_MARGIN_SECONDS = 60
# One GPU's share of a worker pod when TOKENMILL_WORKER_RESOURCES does not name its GPU type:
# small enough for every GPU node type infra/terraform knows (g5.xlarge: 4 vCPUs, 16 GiB).
DEFAULT_GPU_SHARE = {"cpu_millis": 3000, "memory_mib": 12288, "ephemeral_gib": 50, "model_cache_gib": 40}
CPU_WORKER = {"cpu_millis": 2000, "memory_mib": 8192, "ephemeral_gib": 20, "model_cache_gib": 10}
SHARE_KEYS = frozenset(DEFAULT_GPU_SHARE)
# The workers' PriorityClass: scheduled before anything of priority 0 and evicted last under
# node pressure, but never preempting other pods (the GPU nodes' DaemonSets stay).
PRIORITY_CLASS = "tokenmill-worker"
PRIORITY_VALUE = 100_000
VICTIM_COST = "-1000"  # below the default 0: the ReplicaSet removes these pods first
REQUEST_TIMEOUT = 30.0  # seconds; a hung API server must not stall the reconciler forever

# --- vLLM pods (see the module docstring) ---
VLLM_PORT = 8000
VLLM_HEALTH = f"http://127.0.0.1:{VLLM_PORT}/health"
VLLM_HOME = "/var/lib/vllm"  # HOME of the vLLM container: torch.compile, Triton, FlashInfer caches
MODEL_LINK = f"{MODEL_CACHE}/.vllm-model"  # the resolved model directory, for vLLM's --model
KV_EVENTS_DIR = "/run/tokenmill"
# A Unix socket rather than vLLM's usual tcp://*:5557, which would publish every prompt's token
# ids to the whole cluster network; vLLM binds an ipc:// endpoint like a wildcard one.
KV_EVENTS_ENDPOINT = f"ipc://{KV_EVENTS_DIR}/kv-events"
VLLM_COMMAND = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
FETCH_MODEL_COMMAND = ["python", "-m", "workers.fetch_model"]
# What the worker beside vLLM asks (it proxies streams and maps KV events; vLLM does the work),
# taken out of the pod's share so that a vLLM pod fits the same nodes as a builtin one.
VLLM_WORKER = {"cpu_millis": 1000, "memory_mib": 2048, "ephemeral_gib": 2}
# /dev/shm for vLLM's processes (tensor-parallel NCCL, the engine's message queues): a
# container's default 64 MiB is too small. Memory-backed, so it counts in vLLM's memory.
VLLM_SHM = "2Gi"
# Big models load for many minutes (weights from the volume into the GPUs, CUDA graphs,
# torch.compile): 30 minutes before the kubelet gives up and restarts vLLM.
VLLM_STARTUP_FAILURES = 180


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


def worker_selector(spec: WorkerSpec) -> dict[str, str]:
    return {LABEL_NAME: "tokenmill-worker", LABEL_DEPLOYMENT: spec.deployment_id}


def gpu_count(spec: WorkerSpec) -> int:
    """GPUs of one worker pod, 0 on CPU: the deployment's `gpus_per_replica` (`spec.gpus`), or
    its `resources.gpus` (`options["gpus"]`, the older spelling) when that is larger, so
    neither asks less than the other; each a whole number, 1 or more."""
    if spec.gpu_type is None:
        return 0
    counts = [spec.gpus] + ([spec.options["gpus"]] if "gpus" in spec.options else [])
    for gpus in counts:
        if (
            isinstance(gpus, bool)
            or not isinstance(gpus, int | str)
            or not str(gpus).isdigit()
            or int(gpus) < 1
        ):
            raise ValueError(f"deployment {spec.deployment_id}: gpus must be a whole number of at least 1")
    return max(int(g) for g in counts)


def kv_events_config() -> str:
    """vLLM's --kv-events-config: its ZMQ publisher on the pod-local socket."""
    return vllm_args.kv_events_config(KV_EVENTS_ENDPOINT)


def worker_share(spec: WorkerSpec, resources: Mapping[str, Mapping[str, int]] | None) -> dict[str, int]:
    """What one GPU of the spec's type asks (a CPU worker: its whole size)."""
    if spec.gpu_type is None:
        return dict(CPU_WORKER)
    share = {**DEFAULT_GPU_SHARE, **((resources or {}).get(spec.gpu_type) or {})}
    unknown = set(share) - SHARE_KEYS
    if unknown:
        raise ValueError(f"TOKENMILL_WORKER_RESOURCES[{spec.gpu_type}]: unknown keys {sorted(unknown)}")
    return {k: int(v) for k, v in share.items()}


def worker_manifest(
    spec: WorkerSpec,
    replicas: int,
    *,
    namespace: str,
    image: str,
    secret: str,
    resources: Mapping[str, Mapping[str, int]] | None = None,
    max_stream_seconds: int = MAX_STREAM_SECONDS,
    vllm_image: str | None = None,
    block_size: int = 16,
    prefix_caching: bool = True,
    max_lora_rank: int = 64,
) -> dict[str, Any]:
    """The Deployment that runs `replicas` workers of `spec` (the manifest contract).

    `resources` is TOKENMILL_WORKER_RESOURCES (per GPU type, one GPU's share);
    `max_stream_seconds` is TOKENMILL_MAX_STREAM_SECONDS, which the grace period outlasts;
    `vllm_image` (TOKENMILL_VLLM_IMAGE), `block_size` (TOKENMILL_BLOCK_SIZE), `prefix_caching`
    and `max_lora_rank` (TOKENMILL_PREFIX_CACHING, TOKENMILL_MAX_LORA_RANK) shape the pods of
    `vllm` deployments.
    """
    if spec.engine not in ENGINES:
        raise ValueError(f"deployment {spec.deployment_id}: unknown engine {spec.engine!r}")
    vllm = spec.engine == "vllm"
    if vllm:
        if spec.gpu_type is None:
            # vLLM's image is its CUDA build; its CPU build serves local workers only.
            raise ValueError(
                f"deployment {spec.deployment_id}: a vllm deployment on Kubernetes needs a GPU type"
            )
        if vllm_image is None:
            raise ValueError(f"deployment {spec.deployment_id}: a vllm deployment needs TOKENMILL_VLLM_IMAGE")
        check_image_digest(vllm_image)
    labels = worker_labels(spec)
    gpu = spec.gpu_type is not None
    gpus = gpu_count(spec)
    share = worker_share(spec, resources)
    units = max(gpus, 1)
    cpu = str(spec.options.get("cpu", f"{units * share['cpu_millis']}m"))
    memory = str(spec.options.get("memory", f"{units * share['memory_mib']}Mi"))
    scratch = f"{units * share['ephemeral_gib']}Gi"  # the model cache is part of it
    cache = f"{units * share['model_cache_gib']}Gi"
    requests = {"cpu": cpu, "memory": memory, "ephemeral-storage": scratch}
    limits = {"memory": memory, "ephemeral-storage": scratch}
    if gpu:
        limits = {GPU_RESOURCE: str(gpus), **limits}

    def field_ref(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    env: list[dict[str, Any]] = [
        {"name": "TOKENMILL_DEPLOYMENT_ID", "value": spec.deployment_id},
        {"name": "TOKENMILL_WORKER_ID", "valueFrom": field_ref("metadata.name")},
        {"name": "TOKENMILL_WORKER_ADVERTISE_HOST", "valueFrom": field_ref("status.podIP")},
        {"name": "TOKENMILL_WORKER_HOST", "value": "0.0.0.0"},
        {"name": "TOKENMILL_WORKER_PORT", "value": str(WORKER_PORT)},
        {"name": "TOKENMILL_HOME", "value": WORKER_HOME},
        {"name": "TOKENMILL_MODEL_CACHE", "value": MODEL_CACHE},
        {"name": "TOKENMILL_MAX_STREAM_SECONDS", "value": str(max_stream_seconds)},
        # The gateways hash prompts in blocks of this size to route by prefix; the engine's
        # (or vLLM's) blocks must be the same size for its KV events to match.
        {"name": "TOKENMILL_BLOCK_SIZE", "value": str(block_size)},
        # The root filesystem is read-only: caches that default to ~ (Triton's, torch's) too.
        {"name": "HOME", "value": WORKER_HOME},
    ]
    if gpu:
        env.append({"name": "TOKENMILL_GPU_TYPE", "value": spec.gpu_type})
    mounts = [
        {"name": "state", "mountPath": WORKER_HOME},
        {"name": "model-cache", "mountPath": MODEL_CACHE},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "state", "emptyDir": {}},
        {"name": "model-cache", "emptyDir": {"sizeLimit": cache}},
        {"name": "tmp", "emptyDir": {}},
    ]
    args = ["worker", "--model", spec.model]
    init_containers: list[dict[str, Any]] = []
    if vllm:
        assert vllm_image is not None and spec.gpu_type is not None
        # vLLM does the work with the pod's GPUs and the rest of its share; the worker beside it
        # asks a fixed small part, so the pod as a whole asks what a builtin one does.
        worker_size = _size(**VLLM_WORKER)
        requests, limits = worker_size, _limits(worker_size)
        args = ["worker", "--engine", "vllm", "--model", spec.model]
        env += [
            {"name": "TOKENMILL_VLLM_URL", "value": f"http://127.0.0.1:{VLLM_PORT}"},
            {"name": "TOKENMILL_VLLM_KV_EVENTS_ENDPOINT", "value": KV_EVENTS_ENDPOINT},
            # What the worker sizes its adapter registry and request priorities by.
            {"name": ENGINE_ARGS_ENV, "value": encode_engine_args(spec.engine_args)},
        ]
        mounts = [*mounts, {"name": "kv-events", "mountPath": KV_EVENTS_DIR}]
        volumes += [
            {"name": "vllm-home", "emptyDir": {}},
            {"name": "vllm-tmp", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": VLLM_SHM}},
            {"name": "kv-events", "emptyDir": {}},
        ]
        init_containers = _vllm_init_containers(
            spec,
            _vllm_size(spec, share, units),
            gpus=gpus,
            image=image,
            vllm_image=vllm_image,
            secret=secret,
            block_size=block_size,
            flags=vllm_server_flags(
                spec.engine_args, prefix_caching=prefix_caching, max_lora_rank=max_lora_rank
            ),
        )

    ready = {"httpGet": {"path": "/ready", "port": "http"}}  # workers.server.READY_PATH: no token
    container = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["tokenmill"],
        "args": args,
        "env": env,
        "envFrom": [{"secretRef": {"name": secret}}],
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        # The worker answers /ready only once its model is loaded, which may take many minutes
        # (weights from the object storage, Triton's first compilations): 20 minutes here.
        "startupProbe": {**ready, "periodSeconds": 10, "failureThreshold": 120},
        # Ready: the model is loaded and the server answers (a rollout waits for it).
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 3},
        # Alive: the process still accepts connections. Not /ready, so a worker that is busy
        # or draining is never killed for being slow to answer a probe.
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "resources": {"limits": limits, "requests": requests},
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    pod: dict[str, Any] = {
        "serviceAccountName": SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,
        "priorityClassName": PRIORITY_CLASS,
        "terminationGracePeriodSeconds": max_stream_seconds + DRAIN_MARGIN_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [container],
        "volumes": volumes,
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
            "selector": {"matchLabels": worker_selector(spec)},
            "template": template,
        },
    }


def _size(cpu_millis: int | str, memory_mib: int | str, ephemeral_gib: int) -> dict[str, str]:
    """A container's requests; an int is millicores or MiB, a string an option's quantity."""
    cpu = f"{cpu_millis}m" if isinstance(cpu_millis, int) else cpu_millis
    memory = f"{memory_mib}Mi" if isinstance(memory_mib, int) else memory_mib
    return {"cpu": cpu, "memory": memory, "ephemeral-storage": f"{ephemeral_gib}Gi"}


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _limits(requests: dict[str, str]) -> dict[str, str]:
    # No CPU limit (throttling a busy worker helps nobody); memory and disk are hard limits.
    return {k: v for k, v in requests.items() if k != "cpu"}


def _vllm_size(spec: WorkerSpec, share: Mapping[str, int], units: int) -> dict[str, str]:
    """vLLM's requests in a pod: `options["cpu"]`/`["memory"]`, else the pod's share less the
    worker's (VLLM_WORKER); its disk always so."""
    left = {key: units * share[key] - VLLM_WORKER[key] for key in VLLM_WORKER}
    if min(left.values()) <= 0:
        raise ValueError(
            f"deployment {spec.deployment_id}: the {spec.gpu_type} share leaves nothing for vLLM "
            f"beside the worker ({VLLM_WORKER})"
        )
    return _size(
        str(spec.options["cpu"]) if "cpu" in spec.options else left["cpu_millis"],
        str(spec.options["memory"]) if "memory" in spec.options else left["memory_mib"],
        left["ephemeral_gib"],
    )


def _vllm_init_containers(
    spec: WorkerSpec,
    size: dict[str, str],
    *,
    gpus: int,
    image: str,
    vllm_image: str,
    secret: str,
    block_size: int,
    flags: list[str],
) -> list[dict[str, Any]]:
    """`fetch-model`, then vLLM as a native sidecar (see the module docstring)."""
    health = {
        "exec": {
            # vLLM listens on the loopback only, where the kubelet's httpGet cannot reach.
            "command": ["python3", "-c", f"import urllib.request as r; r.urlopen('{VLLM_HEALTH}', timeout=4)"]
        },
        "periodSeconds": 10,
        "timeoutSeconds": 5,
    }
    fetch_model = {
        "name": "fetch-model",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": FETCH_MODEL_COMMAND,
        "args": [spec.model, MODEL_LINK],
        "env": [
            {"name": "TOKENMILL_HOME", "value": WORKER_HOME},
            {"name": "TOKENMILL_MODEL_CACHE", "value": MODEL_CACHE},
            {"name": "HOME", "value": WORKER_HOME},
        ],
        "envFrom": [{"secretRef": {"name": secret}}],  # the storage's URL and credentials
        # Converting a GGUF takes memory: vLLM's size, which the pod holds anyway (an init
        # container's request is not added to the others').
        "resources": {"limits": _limits(size), "requests": size},
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "state", "mountPath": WORKER_HOME},
            {"name": "model-cache", "mountPath": MODEL_CACHE},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    server = {
        "name": "vllm",
        "image": vllm_image,
        "imagePullPolicy": "IfNotPresent",
        # A native sidecar: started before the worker, stopped only after it has drained.
        "restartPolicy": "Always",
        "command": VLLM_COMMAND,
        "args": [
            "--model",
            MODEL_LINK,
            # It checks no key and meters nothing: only the worker beside it may reach it.
            "--host",
            "127.0.0.1",
            "--port",
            str(VLLM_PORT),
            "--block-size",
            str(block_size),
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            kv_events_config(),
            "--structured-outputs-config",
            structured_outputs_config(),
            "--disable-uvicorn-access-log",  # the probes' /health every 10 s
            *flags,
        ],
        "env": [
            {"name": "HOME", "value": VLLM_HOME},
            # torch asks getpass for a user name, and uid 10001 has none in vLLM's image.
            {"name": "USER", "value": "tokenmill"},
            {"name": "HF_HUB_OFFLINE", "value": "1"},  # the weights are on the volume
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            # The worker loads and unloads LoRA adapters through vLLM's runtime endpoints.
            {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"},
        ],
        "startupProbe": {**health, "failureThreshold": VLLM_STARTUP_FAILURES},
        "livenessProbe": {**health, "failureThreshold": 6},
        "resources": {"limits": {GPU_RESOURCE: str(gpus), **_limits(size)}, "requests": size},
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "vllm-home", "mountPath": VLLM_HOME},
            # Read-only: the model and the adapters the worker fetched, at the worker's paths.
            {"name": "model-cache", "mountPath": MODEL_CACHE, "readOnly": True},
            {"name": "vllm-tmp", "mountPath": "/tmp"},
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "kv-events", "mountPath": KV_EVENTS_DIR},
        ],
    }
    return [fetch_model, server]


def worker_disruption_budget(spec: WorkerSpec, *, namespace: str) -> dict[str, Any]:
    """The PodDisruptionBudget beside a deployment's Deployment (same name): voluntary
    disruptions (node drains, consolidation, upgrades) take one of its workers at a time; a
    worker that is not ready (still loading, or stuck) may always be evicted."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": worker_name(spec), "namespace": namespace, "labels": worker_labels(spec)},
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": worker_selector(spec)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def worker_priority_class() -> dict[str, Any]:
    """The workers' PriorityClass (cluster-scoped; the admission policy in infra/terraform
    lets the autoscaler create this one and no other)."""
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {
            "name": PRIORITY_CLASS,
            "labels": {LABEL_PART_OF: "tokenmill", LABEL_MANAGED_BY: MANAGED_BY},
        },
        "value": PRIORITY_VALUE,
        "globalDefault": False,
        "preemptionPolicy": "Never",
        "description": "Tokenmill workers: scheduled first and evicted last, never preempting.",
    }


@dataclass(slots=True)
class KubernetesProvider:
    """Keeps one Deployment per model deployment in `namespace`; see the module docstring."""

    name: ClassVar[str] = "kubernetes"
    api: client.ApiClient
    namespace: str
    image: str
    secret: str
    # TOKENMILL_WORKER_RESOURCES and TOKENMILL_MAX_STREAM_SECONDS (see worker_manifest).
    resources: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    max_stream_seconds: int = MAX_STREAM_SECONDS
    # TOKENMILL_VLLM_IMAGE, TOKENMILL_BLOCK_SIZE, TOKENMILL_PREFIX_CACHING and
    # TOKENMILL_MAX_LORA_RANK, for the pods of vllm deployments.
    vllm_image: str | None = None
    block_size: int = 16
    prefix_caching: bool = True
    max_lora_rank: int = 64
    apps: client.AppsV1Api = field(init=False)
    core: client.CoreV1Api = field(init=False)
    policy: client.PolicyV1Api = field(init=False)
    scheduling: client.SchedulingV1Api = field(init=False)
    # deployment id -> Deployment name, so reads after a scale need no list call.
    names: dict[str, str] = field(default_factory=dict, init=False)
    # Deployments whose PodDisruptionBudget is known to exist; the PriorityClass, once made.
    budgets: set[str] = field(default_factory=set, init=False)
    priority_class_ready: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.apps = client.AppsV1Api(self.api)
        self.core = client.CoreV1Api(self.api)
        self.policy = client.PolicyV1Api(self.api)
        self.scheduling = client.SchedulingV1Api(self.api)

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
            resources=settings.worker_resources,
            max_stream_seconds=math.ceil(settings.max_stream_seconds),
            vllm_image=settings.vllm_image,
            block_size=settings.block_size,
            prefix_caching=settings.prefix_caching,
            max_lora_rank=settings.max_lora_rank,
        )

    async def scale(self, spec: WorkerSpec, replicas: int, victims: Sequence[str] = ()) -> None:
        body = worker_manifest(
            spec,
            replicas,
            namespace=self.namespace,
            image=self.image,
            secret=self.secret,
            resources=self.resources,
            max_stream_seconds=self.max_stream_seconds,
            vllm_image=self.vllm_image,
            block_size=self.block_size,
            prefix_caching=self.prefix_caching,
            max_lora_rank=self.max_lora_rank,
        )
        name = body["metadata"]["name"]
        # Before any worker pod: the API server refuses pods naming a missing PriorityClass.
        await self._ensure_priority_class()
        current = await self._read(name)
        if current is None:
            create = self.apps.create_namespaced_deployment
            if await self._call("create deployment", name, create, self.namespace, body, allow=(409,)):
                self.names[spec.deployment_id] = name
                log.info("created deployment %s with %d replicas", name, replicas)
                await self._ensure_budget(spec, name, new=True)
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
        await self._ensure_budget(spec, name)
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
        delete_budget = self.policy.delete_namespaced_pod_disruption_budget
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
            await self._call(
                "delete disruption budget", name, delete_budget, name, self.namespace, allow=(404,)
            )
            self.budgets.discard(name)
            log.info("deleted deployment %s", name)

    async def managed(self) -> list[str]:
        found = await self._list(f"{LABEL_MANAGED_BY}={MANAGED_BY}")
        ids = {(d.metadata.labels or {}).get(LABEL_DEPLOYMENT) for d in found}
        return sorted(i for i in ids if i)

    async def close(self) -> None:
        await asyncio.to_thread(self.api.close)

    async def _ensure_priority_class(self) -> None:
        if self.priority_class_ready:
            return
        read = self.scheduling.read_priority_class
        if (
            await self._call("read priority class", PRIORITY_CLASS, read, PRIORITY_CLASS, allow=(404,))
            is None
        ):
            create = self.scheduling.create_priority_class
            # 409: another autoscaler replica made it first.
            await self._call(
                "create priority class", PRIORITY_CLASS, create, worker_priority_class(), allow=(409,)
            )
            log.info("created priority class %s", PRIORITY_CLASS)
        self.priority_class_ready = True

    async def _ensure_budget(self, spec: WorkerSpec, name: str, *, new: bool = False) -> None:
        """The Deployment's PodDisruptionBudget exists (read once per provider, or created at
        once beside a Deployment just created)."""
        if name in self.budgets:
            return
        if (
            new
            or await self._call(
                "read disruption budget",
                name,
                self.policy.read_namespaced_pod_disruption_budget,
                name,
                self.namespace,
                allow=(404,),
            )
            is None
        ):
            body = worker_disruption_budget(spec, namespace=self.namespace)
            create = self.policy.create_namespaced_pod_disruption_budget
            await self._call("create disruption budget", name, create, self.namespace, body, allow=(409,))
        self.budgets.add(name)

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
