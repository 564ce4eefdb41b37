"""KubernetesProvider against a local fake of the API, through the real official client.

Each test asserts the exact calls the provider makes (method, path, body) and, for a create,
the whole manifest, written out here by hand from the manifest contract.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from autoscaler.kubernetes import (
    KubernetesProvider,
    ProviderError,
    vllm_server_flags,
    worker_manifest,
    worker_name,
)
from autoscaler.providers import WorkerSpec
from tests.autoscaler.fake_kubernetes import PATCH_TYPES, FakeKubernetes

TOKEN = "k8s-bearer-7c1d9e3f5a"
NS = "tokenmill"
IMAGE = "registry.example.com/tokenmill-worker:1.4.2"
SECRET = "tokenmill-worker"

GPU = WorkerSpec(
    deployment_id="dep_01hzx3k9",
    name="Llama 3.1 8B Instruct (prod)",
    model="store:models/llama-3.1-8b-instruct",
    gpu_type="a100-80gb",
)
NAME = "tm-worker-llama-3-1-8b-instruct-prod"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
DEPLOYMENT = f"{DEPLOYMENTS}/{NAME}"
SCALE = f"{DEPLOYMENT}/scale"
BUDGETS = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets"
BUDGET = f"{BUDGETS}/{NAME}"
PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"
PRIORITY_CLASS = f"{PRIORITY_CLASSES}/tokenmill-worker"


def pod_path(name: str) -> str:
    return f"/api/v1/namespaces/{NS}/pods/{name}"


LABELS = {
    "app.kubernetes.io/name": "tokenmill-worker",
    "app.kubernetes.io/part-of": "tokenmill",
    "app.kubernetes.io/component": "worker",
    "app.kubernetes.io/managed-by": "tokenmill-autoscaler",
    "tokenmill.dev/deployment": "dep_01hzx3k9",
}
PROBE = {"httpGet": {"path": "/ready", "port": "http"}}
GPU_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": LABELS},
    "spec": {
        "serviceAccountName": "tokenmill-worker",
        "automountServiceAccountToken": False,
        "priorityClassName": "tokenmill-worker",
        # TOKENMILL_MAX_STREAM_SECONDS (600 by default) and a minute to say goodbye.
        "terminationGracePeriodSeconds": 660,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "worker",
                "image": IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "command": ["tokenmill"],
                "args": ["worker", "--model", "store:models/llama-3.1-8b-instruct"],
                "env": [
                    {"name": "TOKENMILL_DEPLOYMENT_ID", "value": "dep_01hzx3k9"},
                    {
                        "name": "TOKENMILL_WORKER_ID",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                    },
                    {
                        "name": "TOKENMILL_WORKER_ADVERTISE_HOST",
                        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                    },
                    {"name": "TOKENMILL_WORKER_HOST", "value": "0.0.0.0"},
                    {"name": "TOKENMILL_WORKER_PORT", "value": "8080"},
                    {"name": "TOKENMILL_HOME", "value": "/var/lib/tokenmill"},
                    {"name": "TOKENMILL_MODEL_CACHE", "value": "/var/lib/tokenmill/models"},
                    {"name": "TOKENMILL_MAX_STREAM_SECONDS", "value": "600"},
                    {"name": "TOKENMILL_BLOCK_SIZE", "value": "16"},
                    {"name": "HOME", "value": "/var/lib/tokenmill"},
                    {"name": "TOKENMILL_GPU_TYPE", "value": "a100-80gb"},
                ],
                "envFrom": [{"secretRef": {"name": "tokenmill-worker"}}],
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                "startupProbe": {**PROBE, "periodSeconds": 10, "failureThreshold": 120},
                "readinessProbe": {**PROBE, "periodSeconds": 5, "failureThreshold": 3},
                # Not /ready: a busy or draining worker is not killed for a slow answer.
                "livenessProbe": {
                    "tcpSocket": {"port": "http"},
                    "periodSeconds": 10,
                    "timeoutSeconds": 5,
                    "failureThreshold": 6,
                },
                # a100-80gb is not in TOKENMILL_WORKER_RESOURCES here: the default share of one GPU.
                "resources": {
                    "limits": {"nvidia.com/gpu": "1", "memory": "12288Mi", "ephemeral-storage": "50Gi"},
                    "requests": {"cpu": "3000m", "memory": "12288Mi", "ephemeral-storage": "50Gi"},
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [
                    {"name": "state", "mountPath": "/var/lib/tokenmill"},
                    {"name": "model-cache", "mountPath": "/var/lib/tokenmill/models"},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ],
        "volumes": [
            {"name": "state", "emptyDir": {}},
            {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}},
            {"name": "tmp", "emptyDir": {}},
        ],
        "nodeSelector": {"tokenmill.dev/gpu-type": "a100-80gb"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}


def contract_hash(template: dict[str, Any]) -> str:
    """The contract's spec hash, restated: sha256 of the template's compact, key-sorted JSON."""
    return hashlib.sha256(json.dumps(template, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[
        :16
    ]


def gpu_manifest(replicas: int) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": NAME,
                "namespace": NS,
                "labels": LABELS,
                "annotations": {"tokenmill.dev/spec-hash": contract_hash(GPU_TEMPLATE)},
            },
            "spec": {
                "replicas": replicas,
                "selector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": "tokenmill-worker",
                        "tokenmill.dev/deployment": "dep_01hzx3k9",
                    }
                },
                "template": GPU_TEMPLATE,
            },
        }
    )


SELECTOR = {"app.kubernetes.io/name": "tokenmill-worker", "tokenmill.dev/deployment": "dep_01hzx3k9"}
GPU_BUDGET = {
    "apiVersion": "policy/v1",
    "kind": "PodDisruptionBudget",
    "metadata": {"name": NAME, "namespace": NS, "labels": LABELS},
    "spec": {
        "maxUnavailable": 1,
        "selector": {"matchLabels": SELECTOR},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    },
}
WORKER_PRIORITY_CLASS = {
    "apiVersion": "scheduling.k8s.io/v1",
    "kind": "PriorityClass",
    "metadata": {
        "name": "tokenmill-worker",
        "labels": {
            "app.kubernetes.io/part-of": "tokenmill",
            "app.kubernetes.io/managed-by": "tokenmill-autoscaler",
        },
    },
    "value": 100000,
    "globalDefault": False,
    "preemptionPolicy": "Never",
    "description": "Tokenmill workers: scheduled first and evicted last, never preempting.",
}


def victim_patch() -> dict[str, Any]:
    return {"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "-1000"}}}


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    server = FakeKubernetes(token=TOKEN).start()
    yield server
    server.stop()


def make_provider(fake: FakeKubernetes) -> KubernetesProvider:
    configuration = client.Configuration(
        host=fake.url, api_key={"authorization": TOKEN}, api_key_prefix={"authorization": "Bearer"}
    )
    return KubernetesProvider(client.ApiClient(configuration), namespace=NS, image=IMAGE, secret=SECRET)


@pytest.fixture
async def provider(fake: FakeKubernetes) -> AsyncIterator[KubernetesProvider]:
    provider = make_provider(fake)
    yield provider
    await provider.close()


def calls(fake: FakeKubernetes) -> list[tuple[str, str, Any]]:
    return [(c.method, c.path, c.body) for c in fake.calls]


async def created(fake: FakeKubernetes, provider: KubernetesProvider, replicas: int) -> None:
    """The GPU deployment exists with `replicas`; the calls so far are forgotten."""
    await provider.scale(GPU, replicas)
    fake.calls.clear()


async def test_first_scale_creates_the_deployment(fake: FakeKubernetes, provider: KubernetesProvider) -> None:
    await provider.scale(GPU, 2)

    # The PriorityClass first (pods naming a missing one are refused), the budget beside.
    assert calls(fake) == [
        ("GET", PRIORITY_CLASS, None),
        ("POST", PRIORITY_CLASSES, WORKER_PRIORITY_CLASS),
        ("GET", DEPLOYMENT, None),
        ("POST", DEPLOYMENTS, gpu_manifest(2)),
        ("POST", BUDGETS, GPU_BUDGET),
    ]
    assert all(c.authorization == f"Bearer {TOKEN}" for c in fake.calls)
    assert (
        fake.budgets[NS, NAME]["spec"]["selector"]["matchLabels"]
        == gpu_manifest(2)["spec"]["selector"]["matchLabels"]
    )
    assert fake.priority_classes["tokenmill-worker"]["preemptionPolicy"] == "Never"
    stored = fake.deployments[NS, NAME]
    assert stored["spec"]["replicas"] == 2
    assert stored["metadata"]["uid"] and stored["metadata"]["resourceVersion"]
    assert await provider.replicas(GPU.deployment_id) == 2


async def test_scale_up_and_down_patch_the_scale_only(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    await created(fake, provider, 1)

    await provider.scale(GPU, 3)
    await provider.scale(GPU, 2)

    assert calls(fake) == [
        ("GET", DEPLOYMENT, None),
        ("PATCH", SCALE, {"spec": {"replicas": 3}}),
        ("GET", DEPLOYMENT, None),
        ("PATCH", SCALE, {"spec": {"replicas": 2}}),
    ]
    assert all(c.content_type in PATCH_TYPES for c in fake.calls if c.method == "PATCH")
    assert fake.deployments[NS, NAME]["spec"]["replicas"] == 2


async def test_scale_down_marks_victims_first(fake: FakeKubernetes, provider: KubernetesProvider) -> None:
    await created(fake, provider, 4)
    pods = [f"{NAME}-7d9f8c6b5-{suffix}" for suffix in ("aaaaa", "bbbbb", "ccccc", "ddddd")]
    for pod in pods:
        fake.add_pod(NS, pod, LABELS)
    gone = f"{NAME}-7d9f8c6b5-zzzzz"

    # Two pods go: the first two victims are marked (one already gone), the third is not.
    await provider.scale(GPU, 2, victims=[gone, pods[2], pods[0]])

    assert calls(fake) == [
        ("GET", DEPLOYMENT, None),
        ("PATCH", pod_path(gone), victim_patch()),
        ("PATCH", pod_path(pods[2]), victim_patch()),
        ("PATCH", SCALE, {"spec": {"replicas": 2}}),
    ]
    costs = {
        pod: fake.pods[NS, pod]["metadata"]
        .get("annotations", {})
        .get("controller.kubernetes.io/pod-deletion-cost")
        for pod in pods
    }
    assert costs == {pods[0]: None, pods[1]: None, pods[2]: "-1000", pods[3]: None}


async def test_victims_are_ignored_when_scaling_up(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    await created(fake, provider, 1)
    await provider.scale(GPU, 2, victims=[f"{NAME}-7d9f8c6b5-aaaaa"])
    assert calls(fake) == [("GET", DEPLOYMENT, None), ("PATCH", SCALE, {"spec": {"replicas": 2}})]


async def test_unchanged_scale_writes_nothing(fake: FakeKubernetes, provider: KubernetesProvider) -> None:
    await created(fake, provider, 2)
    await provider.scale(GPU, 2, victims=[f"{NAME}-7d9f8c6b5-aaaaa"])
    assert calls(fake) == [("GET", DEPLOYMENT, None)]


async def test_changed_model_replaces_the_deployment(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    await created(fake, provider, 2)
    before = fake.deployments[NS, NAME]["metadata"]
    changed = WorkerSpec(
        GPU.deployment_id, GPU.name, "store:models/llama-3.1-8b-instruct-v2", gpu_type="a100-80gb"
    )

    await provider.scale(changed, 3)

    expected = gpu_manifest(3)
    container = expected["spec"]["template"]["spec"]["containers"][0]
    container["args"] = ["worker", "--model", "store:models/llama-3.1-8b-instruct-v2"]
    expected["metadata"]["annotations"]["tokenmill.dev/spec-hash"] = contract_hash(
        expected["spec"]["template"]
    )
    assert expected["metadata"]["annotations"] != gpu_manifest(3)["metadata"]["annotations"]
    assert calls(fake) == [("GET", DEPLOYMENT, None), ("PUT", DEPLOYMENT, expected)]
    after = fake.deployments[NS, NAME]["metadata"]
    assert after["uid"] == before["uid"] and after["generation"] == before["generation"] + 1


async def test_replace_deletes_the_workers_pod(fake: FakeKubernetes, provider: KubernetesProvider) -> None:
    await created(fake, provider, 2)
    pod = f"{NAME}-7d9f8c6b5-aaaaa"
    fake.add_pod(NS, pod, LABELS)

    await provider.replace(GPU.deployment_id, pod)
    await provider.replace(GPU.deployment_id, pod)  # already gone: not an error

    assert calls(fake) == [("DELETE", pod_path(pod), None), ("DELETE", pod_path(pod), None)]
    assert (NS, pod) not in fake.pods


async def test_remove_deletes_the_deployment(fake: FakeKubernetes, provider: KubernetesProvider) -> None:
    await created(fake, provider, 2)

    await provider.remove(GPU.deployment_id)

    assert calls(fake) == [("DELETE", DEPLOYMENT, None), ("DELETE", BUDGET, None)]
    assert fake.calls[0].query == {"propagationPolicy": "Background"}
    assert (NS, NAME) not in fake.deployments and (NS, NAME) not in fake.budgets

    # Forgotten now: found by its label, and there is nothing left to delete.
    fake.calls.clear()
    await provider.remove(GPU.deployment_id)
    assert calls(fake) == [("GET", DEPLOYMENTS, None)]
    assert fake.calls[0].query == {"labelSelector": "tokenmill.dev/deployment=dep_01hzx3k9"}


async def test_a_new_provider_finds_deployments_by_label(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    await created(fake, provider, 3)
    fresh = make_provider(fake)
    try:
        assert await fresh.replicas(GPU.deployment_id) == 3
        assert await fresh.replicas("dep_unknown") == 0
        await fresh.remove(GPU.deployment_id)
    finally:
        await fresh.close()

    by_label = {"labelSelector": "tokenmill.dev/deployment=dep_01hzx3k9"}
    assert [(c.method, c.path, c.query) for c in fake.calls] == [
        ("GET", DEPLOYMENTS, by_label),
        ("GET", DEPLOYMENTS, {"labelSelector": "tokenmill.dev/deployment=dep_unknown"}),
        ("GET", DEPLOYMENTS, by_label),
        ("DELETE", DEPLOYMENT, {"propagationPolicy": "Background"}),
        ("DELETE", BUDGET, {}),
    ]


async def test_managed_lists_the_autoscalers_deployments(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    await provider.scale(GPU, 1)
    await provider.scale(WorkerSpec("dep_02embed", "MiniLM embeddings", "bundled:minilm", kind="embed"), 1)
    # The gateway's own Deployment lives in the same namespace: not ours.
    gateway = gpu_manifest(2)
    gateway["metadata"] = {"name": "tokenmill-gateway", "namespace": NS, "labels": {"app": "gateway"}}
    gateway["spec"]["selector"] = {"matchLabels": {"app": "gateway"}}
    gateway["spec"]["template"] = {**GPU_TEMPLATE, "metadata": {"labels": {"app": "gateway"}}}
    fake.add_deployment(gateway)
    fake.calls.clear()

    assert await provider.managed() == ["dep_01hzx3k9", "dep_02embed"]
    assert [(c.method, c.path, c.query) for c in fake.calls] == [
        ("GET", DEPLOYMENTS, {"labelSelector": "app.kubernetes.io/managed-by=tokenmill-autoscaler"})
    ]


async def test_conflict_on_create_carries_on_with_the_existing_one(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    # Someone else (another autoscaler replica) created it between our read and our create.
    fake.add_deployment(gpu_manifest(1))
    fake.fail_next("GET", DEPLOYMENT, 404, f'deployments.apps "{NAME}" not found')

    await provider.scale(GPU, 2)

    assert calls(fake) == [
        ("GET", PRIORITY_CLASS, None),
        ("POST", PRIORITY_CLASSES, WORKER_PRIORITY_CLASS),
        ("GET", DEPLOYMENT, None),
        ("POST", DEPLOYMENTS, gpu_manifest(2)),
        ("GET", DEPLOYMENT, None),
        # Theirs had no budget yet: ours is added.
        ("GET", BUDGET, None),
        ("POST", BUDGETS, GPU_BUDGET),
        ("PATCH", SCALE, {"spec": {"replicas": 2}}),
    ]
    assert fake.deployments[NS, NAME]["spec"]["replicas"] == 2


async def test_server_error_is_a_provider_error_without_the_token(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    await created(fake, provider, 1)
    fake.fail_next("PATCH", SCALE, 500, "etcdserver: request timed out")

    with pytest.raises(ProviderError) as caught:
        await provider.scale(GPU, 2)

    message = str(caught.value)
    expected = "HTTP 500 Internal Server Error: etcdserver: request timed out"
    assert message == f"kubernetes scale deployment {NAME}: {expected}"
    assert TOKEN not in message and TOKEN not in repr(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


async def test_a_deployment_of_another_id_is_never_taken_over(
    fake: FakeKubernetes, provider: KubernetesProvider
) -> None:
    await created(fake, provider, 1)
    # Another deployment whose name slugs the same.
    twin = WorkerSpec("dep_twin", "llama-3.1-8b-instruct-PROD", "store:other", gpu_type="a100-80gb")
    assert worker_name(twin) == NAME

    with pytest.raises(ProviderError, match="belongs to deployment 'dep_01hzx3k9'"):
        await provider.scale(twin, 3)

    assert calls(fake) == [("GET", DEPLOYMENT, None)]
    assert await provider.replicas("dep_twin") == 0  # its name was not remembered either


def test_cpu_manifest_has_no_gpu_keys() -> None:
    spec = WorkerSpec("dep_cpu1", "SmolLM2 (CPU)", "bundled:smollm2")
    manifest = worker_manifest(spec, 1, namespace=NS, image=IMAGE, secret=SECRET)

    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert manifest["metadata"]["name"] == "tm-worker-smollm2-cpu"
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert container["resources"] == {
        "limits": {"memory": "8192Mi", "ephemeral-storage": "20Gi"},
        "requests": {"cpu": "2000m", "memory": "8192Mi", "ephemeral-storage": "20Gi"},
    }
    assert [e["name"] for e in container["env"]] == [
        "TOKENMILL_DEPLOYMENT_ID",
        "TOKENMILL_WORKER_ID",
        "TOKENMILL_WORKER_ADVERTISE_HOST",
        "TOKENMILL_WORKER_HOST",
        "TOKENMILL_WORKER_PORT",
        "TOKENMILL_HOME",
        "TOKENMILL_MODEL_CACHE",
        "TOKENMILL_MAX_STREAM_SECONDS",
        "TOKENMILL_BLOCK_SIZE",
        "HOME",
    ]
    assert "nvidia.com/gpu" not in json.dumps(manifest)
    assert manifest["metadata"]["annotations"]["tokenmill.dev/spec-hash"] == contract_hash(
        manifest["spec"]["template"]
    )


def test_options_override_cpu_and_memory() -> None:
    cpu = WorkerSpec("dep_cpu1", "small", "bundled:smollm2", options={"cpu": 1, "memory": "2Gi"})
    gpu = WorkerSpec(
        "dep_gpu1", "big", "store:big", gpu_type="h100", options={"cpu": "16", "memory": "120Gi"}
    )

    def resources(spec: WorkerSpec) -> dict[str, Any]:
        manifest = worker_manifest(spec, 1, namespace=NS, image=IMAGE, secret=SECRET)
        return manifest["spec"]["template"]["spec"]["containers"][0]["resources"]

    assert resources(cpu) == {
        "limits": {"memory": "2Gi", "ephemeral-storage": "20Gi"},
        "requests": {"cpu": "1", "memory": "2Gi", "ephemeral-storage": "20Gi"},
    }
    assert resources(gpu) == {
        "limits": {"nvidia.com/gpu": "1", "memory": "120Gi", "ephemeral-storage": "50Gi"},
        "requests": {"cpu": "16", "memory": "120Gi", "ephemeral-storage": "50Gi"},
    }


def test_names_are_slugged_and_at_most_63_characters() -> None:
    def name(deployment_name: str, deployment_id: str = "dep_1") -> str:
        return worker_name(WorkerSpec(deployment_id, deployment_name, "bundled:smollm2"))

    assert name("Llama 3.1 8B Instruct (prod)") == NAME
    assert name("--Qwen2.5__Coder//32B--") == "tm-worker-qwen2-5-coder-32b"

    fits = "a" * 53  # tm-worker- (10) + 53 = 63: kept whole
    assert name(fits) == f"tm-worker-{fits}"

    long = "Mixtral 8x22B Instruct v0.1 for the European customers, dedicated"
    digest = hashlib.sha256(b"dep_1").hexdigest()[:8]
    assert name(long) == f"tm-worker-mixtral-8x22b-instruct-v0-1-for-the-european-{digest}"
    assert len(name(long)) == 63
    assert name("a" * 54) == f"tm-worker-{'a' * 44}-{digest}"
    # Same long prefix, another deployment: another name.
    assert name(long, "dep_2") != name(long)

    # No letter or digit at all: the hash alone keeps the name valid.
    assert name("!!!") == f"tm-worker-{digest}"


# --- sizes per GPU type, disruption budgets, probes and the grace period ---------------------

A10G_SHARE = {"cpu_millis": 7500, "memory_mib": 28672, "ephemeral_gib": 80, "model_cache_gib": 60}


def test_gpu_workers_ask_their_gpu_types_share_times_their_gpus() -> None:
    resources = {"a10g": A10G_SHARE}
    one = WorkerSpec("dep_a", "one", "store:m", gpu_type="a10g")
    four = WorkerSpec("dep_b", "four", "store:m", gpu_type="a10g", options={"gpus": 4})

    def pod(spec: WorkerSpec) -> dict[str, Any]:
        manifest = worker_manifest(spec, 1, namespace=NS, image=IMAGE, secret=SECRET, resources=resources)
        return manifest["spec"]["template"]["spec"]

    assert pod(one)["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": "1", "memory": "28672Mi", "ephemeral-storage": "80Gi"},
        "requests": {"cpu": "7500m", "memory": "28672Mi", "ephemeral-storage": "80Gi"},
    }
    big = pod(four)
    assert big["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": "4", "memory": "114688Mi", "ephemeral-storage": "320Gi"},
        "requests": {"cpu": "30000m", "memory": "114688Mi", "ephemeral-storage": "320Gi"},
    }
    cache = next(v for v in big["volumes"] if v["name"] == "model-cache")
    # The model cache (60 GiB a GPU) lives inside the pod's ephemeral-storage request (80 a GPU).
    assert cache == {"name": "model-cache", "emptyDir": {"sizeLimit": "240Gi"}}


@pytest.mark.parametrize("gpus", [0, -1, "two", 1.5, True])
def test_a_bad_gpu_count_is_refused(gpus: object) -> None:
    spec = WorkerSpec("dep_a", "bad", "store:m", gpu_type="a10g", options={"gpus": gpus})
    with pytest.raises(ValueError, match="gpus"):
        worker_manifest(spec, 1, namespace=NS, image=IMAGE, secret=SECRET)


def test_unknown_share_keys_are_refused() -> None:
    spec = WorkerSpec("dep_a", "x", "store:m", gpu_type="a10g")
    with pytest.raises(ValueError, match="unknown keys"):
        worker_manifest(spec, 1, namespace=NS, image=IMAGE, secret=SECRET, resources={"a10g": {"gpu_mib": 1}})


def test_liveness_and_readiness_are_distinct_probes() -> None:
    container = gpu_manifest(1)["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "httpGet" not in container["livenessProbe"] and container["livenessProbe"]["tcpSocket"]
    assert container["livenessProbe"] != container["readinessProbe"]
    # A slow model load is the startup probe's business, not the liveness probe's.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200


def test_a_builtin_pod_hashes_in_the_gateways_block_size() -> None:
    """The gateways route by block hashes of TOKENMILL_BLOCK_SIZE tokens: a builtin worker left
    at its default 16 beside gateways set to 32 would publish hashes no router ever finds."""
    manifest = worker_manifest(GPU, 1, namespace=NS, image=IMAGE, secret=SECRET, block_size=32)
    env = {e["name"]: e.get("value") for e in manifest["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TOKENMILL_BLOCK_SIZE"] == "32"


@pytest.mark.parametrize("max_stream", [300, 600, 1800])
def test_the_grace_period_outlasts_the_longest_stream(max_stream: int) -> None:
    manifest = worker_manifest(
        GPU, 1, namespace=NS, image=IMAGE, secret=SECRET, max_stream_seconds=max_stream
    )
    pod = manifest["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == max_stream + 60
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    # The worker's own graceful timeout follows TOKENMILL_MAX_STREAM_SECONDS.
    assert env["TOKENMILL_MAX_STREAM_SECONDS"] == str(max_stream)
    from tokenmill.settings import Settings

    assert (
        Settings(max_stream_seconds=max_stream).graceful_shutdown_seconds
        < pod["terminationGracePeriodSeconds"]
    )


async def test_a_new_provider_adds_the_missing_budget_of_an_existing_deployment(fake: FakeKubernetes) -> None:
    fake.add_deployment(gpu_manifest(2))  # made by an autoscaler that made no budgets
    fake.priority_classes["tokenmill-worker"] = copy.deepcopy(WORKER_PRIORITY_CLASS)
    provider = make_provider(fake)
    try:
        await provider.scale(GPU, 2)
        await provider.scale(GPU, 3)
    finally:
        await provider.close()

    assert calls(fake) == [
        ("GET", PRIORITY_CLASS, None),  # there already: not created again
        ("GET", DEPLOYMENT, None),
        ("GET", BUDGET, None),
        ("POST", BUDGETS, GPU_BUDGET),
        ("GET", DEPLOYMENT, None),  # the budget is known now: read once per provider
        ("PATCH", SCALE, {"spec": {"replicas": 3}}),
    ]


async def test_another_replica_creating_the_budget_first_is_fine(fake: FakeKubernetes) -> None:
    provider = make_provider(fake)
    fake.fail_next("POST", BUDGETS, 409, f'poddisruptionbudgets.policy "{NAME}" already exists')
    try:
        await provider.scale(GPU, 1)
    finally:
        await provider.close()
    assert ("POST", BUDGETS, GPU_BUDGET) in calls(fake)
    assert fake.deployments[NS, NAME]["spec"]["replicas"] == 1


async def test_provider_passes_its_sizes_and_stream_limit_to_the_manifest(fake: FakeKubernetes) -> None:
    configuration = client.Configuration(
        host=fake.url, api_key={"authorization": TOKEN}, api_key_prefix={"authorization": "Bearer"}
    )
    provider = KubernetesProvider(
        client.ApiClient(configuration),
        namespace=NS,
        image=IMAGE,
        secret=SECRET,
        resources={"a100-80gb": A10G_SHARE},
        max_stream_seconds=900,
    )
    try:
        await provider.scale(GPU, 1)
    finally:
        await provider.close()
    pod = fake.deployments[NS, NAME]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 960
    assert pod["containers"][0]["resources"]["requests"]["cpu"] == "7500m"


# --- vLLM deployments: vLLM's image beside the worker's ----------------------------------------

VLLM_IMAGE = "registry.example.com/vllm/vllm-openai:v0.31.0@sha256:" + "3f9c" * 16
VLLM = WorkerSpec(
    deployment_id="dep_01j0vllm70b",
    name="Llama 3.1 70B AWQ",
    model="store:models/llama-3.1-70b-instruct-awq",
    gpu_type="a100-80gb",
    engine="vllm",
    # In no particular order (a JSON column's): the flags come out sorted.
    engine_args={
        "tensor_parallel_size": 2,
        "quantization": "awq",
        "enable_prefix_caching": True,
        "max_model_len": 32768,
        "gpu_memory_utilization": 0.92,
    },
    gpus=2,
)
VLLM_NAME = "tm-worker-llama-3-1-70b-awq"
VLLM_LABELS = {**LABELS, "tokenmill.dev/deployment": "dep_01j0vllm70b"}
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
VLLM_HEALTH = {
    "exec": {
        "command": [
            "python3",
            "-c",
            "import urllib.request as r; r.urlopen('http://127.0.0.1:8000/health', timeout=4)",
        ]
    },
    "periodSeconds": 10,
    "timeoutSeconds": 5,
}
# The default share of an a100-80gb GPU, twice: 6000m, 24576Mi and 100Gi for the pod, of which
# the worker beside vLLM asks 1000m, 2048Mi and 2Gi.
VLLM_SIZE = {"cpu": "5000m", "memory": "22528Mi", "ephemeral-storage": "98Gi"}
WORKER_SIZE = {"cpu": "1000m", "memory": "2048Mi", "ephemeral-storage": "2Gi"}
VLLM_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": VLLM_LABELS},
    "spec": {
        "serviceAccountName": "tokenmill-worker",
        "automountServiceAccountToken": False,
        "priorityClassName": "tokenmill-worker",
        "terminationGracePeriodSeconds": 660,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [
            {
                "name": "fetch-model",
                "image": IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "command": ["python", "-m", "workers.fetch_model"],
                "args": ["store:models/llama-3.1-70b-instruct-awq", "/var/lib/tokenmill/models/.vllm-model"],
                "env": [
                    {"name": "TOKENMILL_HOME", "value": "/var/lib/tokenmill"},
                    {"name": "TOKENMILL_MODEL_CACHE", "value": "/var/lib/tokenmill/models"},
                    {"name": "HOME", "value": "/var/lib/tokenmill"},
                ],
                "envFrom": [{"secretRef": {"name": "tokenmill-worker"}}],
                "resources": {
                    "limits": {"memory": "22528Mi", "ephemeral-storage": "98Gi"},
                    "requests": VLLM_SIZE,
                },
                "securityContext": RESTRICTED,
                "volumeMounts": [
                    {"name": "state", "mountPath": "/var/lib/tokenmill"},
                    {"name": "model-cache", "mountPath": "/var/lib/tokenmill/models"},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            },
            {
                "name": "vllm",
                "image": VLLM_IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "restartPolicy": "Always",
                "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
                "args": [
                    "--model",
                    "/var/lib/tokenmill/models/.vllm-model",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "8000",
                    "--block-size",
                    "32",
                    "--enable-prompt-tokens-details",
                    "--kv-events-config",
                    '{"enable_kv_cache_events":true,"endpoint":"ipc:///run/tokenmill/kv-events","publisher":"zmq"}',
                    "--structured-outputs-config",
                    '{"backend":"guidance","disable_any_whitespace":true}',
                    "--disable-uvicorn-access-log",
                    # The engine arguments in tokenmill.vllm_args' order, whatever the column's.
                    "--tensor-parallel-size",
                    "2",
                    "--quantization",
                    "awq",
                    "--max-model-len",
                    "32768",
                    "--gpu-memory-utilization",
                    "0.92",
                    "--enable-prefix-caching",
                    # The worker's default: flex requests behind default ones.
                    "--scheduling-policy",
                    "priority",
                ],
                "env": [
                    {"name": "HOME", "value": "/var/lib/vllm"},
                    {"name": "USER", "value": "tokenmill"},
                    {"name": "HF_HUB_OFFLINE", "value": "1"},
                    {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
                    {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"},
                ],
                "startupProbe": {**VLLM_HEALTH, "failureThreshold": 180},
                "livenessProbe": {**VLLM_HEALTH, "failureThreshold": 6},
                "resources": {
                    "limits": {"nvidia.com/gpu": "2", "memory": "22528Mi", "ephemeral-storage": "98Gi"},
                    "requests": VLLM_SIZE,
                },
                "securityContext": RESTRICTED,
                "volumeMounts": [
                    {"name": "vllm-home", "mountPath": "/var/lib/vllm"},
                    {"name": "model-cache", "mountPath": "/var/lib/tokenmill/models", "readOnly": True},
                    {"name": "vllm-tmp", "mountPath": "/tmp"},
                    {"name": "shm", "mountPath": "/dev/shm"},
                    {"name": "kv-events", "mountPath": "/run/tokenmill"},
                ],
            },
        ],
        "containers": [
            {
                "name": "worker",
                "image": IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "command": ["tokenmill"],
                "args": ["worker", "--engine", "vllm", "--model", "store:models/llama-3.1-70b-instruct-awq"],
                "env": [
                    {"name": "TOKENMILL_DEPLOYMENT_ID", "value": "dep_01j0vllm70b"},
                    {
                        "name": "TOKENMILL_WORKER_ID",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                    },
                    {
                        "name": "TOKENMILL_WORKER_ADVERTISE_HOST",
                        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                    },
                    {"name": "TOKENMILL_WORKER_HOST", "value": "0.0.0.0"},
                    {"name": "TOKENMILL_WORKER_PORT", "value": "8080"},
                    {"name": "TOKENMILL_HOME", "value": "/var/lib/tokenmill"},
                    {"name": "TOKENMILL_MODEL_CACHE", "value": "/var/lib/tokenmill/models"},
                    {"name": "TOKENMILL_MAX_STREAM_SECONDS", "value": "600"},
                    {"name": "TOKENMILL_BLOCK_SIZE", "value": "32"},
                    {"name": "HOME", "value": "/var/lib/tokenmill"},
                    {"name": "TOKENMILL_GPU_TYPE", "value": "a100-80gb"},
                    {"name": "TOKENMILL_VLLM_URL", "value": "http://127.0.0.1:8000"},
                    {"name": "TOKENMILL_VLLM_KV_EVENTS_ENDPOINT", "value": "ipc:///run/tokenmill/kv-events"},
                    {
                        "name": "TOKENMILL_VLLM_ENGINE_ARGS",
                        "value": '{"tensor_parallel_size":2,"quantization":"awq","max_model_len":32768,'
                        '"gpu_memory_utilization":0.92,"enable_prefix_caching":true}',
                    },
                ],
                "envFrom": [{"secretRef": {"name": "tokenmill-worker"}}],
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                "startupProbe": {**PROBE, "periodSeconds": 10, "failureThreshold": 120},
                "readinessProbe": {**PROBE, "periodSeconds": 5, "failureThreshold": 3},
                "livenessProbe": {
                    "tcpSocket": {"port": "http"},
                    "periodSeconds": 10,
                    "timeoutSeconds": 5,
                    "failureThreshold": 6,
                },
                "resources": {
                    "limits": {"memory": "2048Mi", "ephemeral-storage": "2Gi"},
                    "requests": WORKER_SIZE,
                },
                "securityContext": RESTRICTED,
                "volumeMounts": [
                    {"name": "state", "mountPath": "/var/lib/tokenmill"},
                    {"name": "model-cache", "mountPath": "/var/lib/tokenmill/models"},
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "kv-events", "mountPath": "/run/tokenmill"},
                ],
            }
        ],
        "volumes": [
            {"name": "state", "emptyDir": {}},
            {"name": "model-cache", "emptyDir": {"sizeLimit": "80Gi"}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "vllm-home", "emptyDir": {}},
            {"name": "vllm-tmp", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
            {"name": "kv-events", "emptyDir": {}},
        ],
        "nodeSelector": {"tokenmill.dev/gpu-type": "a100-80gb"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}


def vllm_manifest(replicas: int) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": VLLM_NAME,
                "namespace": NS,
                "labels": VLLM_LABELS,
                "annotations": {"tokenmill.dev/spec-hash": contract_hash(VLLM_TEMPLATE)},
            },
            "spec": {
                "replicas": replicas,
                "selector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": "tokenmill-worker",
                        "tokenmill.dev/deployment": "dep_01j0vllm70b",
                    }
                },
                "template": VLLM_TEMPLATE,
            },
        }
    )


def vllm_provider(fake: FakeKubernetes) -> KubernetesProvider:
    configuration = client.Configuration(
        host=fake.url, api_key={"authorization": TOKEN}, api_key_prefix={"authorization": "Bearer"}
    )
    return KubernetesProvider(
        client.ApiClient(configuration),
        namespace=NS,
        image=IMAGE,
        secret=SECRET,
        vllm_image=VLLM_IMAGE,
        block_size=32,
    )


async def test_a_vllm_deployment_gets_vllm_beside_the_worker(fake: FakeKubernetes) -> None:
    provider = vllm_provider(fake)
    try:
        await provider.scale(VLLM, 2)
    finally:
        await provider.close()

    deployments = f"/apis/apps/v1/namespaces/{NS}/deployments"
    assert calls(fake)[2:4] == [
        ("GET", f"{deployments}/{VLLM_NAME}", None),
        ("POST", deployments, vllm_manifest(2)),
    ]
    pod = fake.deployments[NS, VLLM_NAME]["spec"]["template"]["spec"]
    fetch, server = pod["initContainers"]
    (worker,) = pod["containers"]
    # The GPUs are vLLM's, all of them; the worker (which does not bundle vLLM) has none.
    assert server["image"] == VLLM_IMAGE and "@sha256:" in server["image"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "nvidia.com/gpu" not in json.dumps([fetch, worker])
    assert fetch["image"] == worker["image"] == IMAGE
    # vLLM starts before the worker and stops after it (a native sidecar), on the model the
    # init container put in the volume they share.
    assert server["restartPolicy"] == "Always" and "restartPolicy" not in fetch
    link = fetch["args"][1]
    assert server["args"][:2] == ["--model", link]
    assert link.startswith(next(m["mountPath"] for m in server["volumeMounts"] if m["name"] == "model-cache"))
    # Our block size, prompt token details for cached_tokens, KV events on the pod-local socket
    # the worker subscribes to, and the engine arguments as flags.
    args = server["args"]
    assert args[args.index("--block-size") + 1] == "32"
    assert "--enable-prompt-tokens-details" in args
    events = json.loads(args[args.index("--kv-events-config") + 1])
    worker_env = {e["name"]: e.get("value") for e in worker["env"]}
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": worker_env["TOKENMILL_VLLM_KV_EVENTS_ENDPOINT"],
    }
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--quantization") + 1] == "awq"
    assert worker_env["TOKENMILL_BLOCK_SIZE"] == "32"
    # The worker reaches vLLM on the loopback, where vLLM alone listens.
    assert (
        worker_env["TOKENMILL_VLLM_URL"]
        == f"http://{args[args.index('--host') + 1]}:{args[args.index('--port') + 1]}"
    )
    assert worker["args"] == ["worker", "--engine", "vllm", "--model", VLLM.model]
    assert json.loads(worker_env["TOKENMILL_VLLM_ENGINE_ARGS"]) == VLLM.engine_args
    assert {e["name"]: e["value"] for e in server["env"]}["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # Probes: vLLM's /health (a long startup budget), the worker's /ready as for builtin workers.
    startup = server["startupProbe"]
    assert "/health" in startup["exec"]["command"][-1]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    assert server["livenessProbe"]["exec"] == startup["exec"] and "readinessProbe" not in server
    assert worker["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_a_vllm_pod_asks_what_a_builtin_pod_of_its_size_asks() -> None:
    builtin = WorkerSpec("dep_b", "b", "store:m", gpu_type="a10g", gpus=4)
    vllm = WorkerSpec("dep_v", "v", "store:m", gpu_type="a10g", gpus=4, engine="vllm")
    resources = {"a10g": A10G_SHARE}

    def containers(spec: WorkerSpec) -> list[dict[str, Any]]:
        manifest = worker_manifest(
            spec, 1, namespace=NS, image=IMAGE, secret=SECRET, resources=resources, vllm_image=VLLM_IMAGE
        )
        pod = manifest["spec"]["template"]["spec"]
        # Running side by side: the sidecar and the worker (the fetch-model init container ends first).
        return [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"] + pod[
            "containers"
        ]

    def total(spec: WorkerSpec, key: str) -> int:
        unit = {"cpu": "m", "memory": "Mi", "ephemeral-storage": "Gi"}[key]
        return sum(int(c["resources"]["requests"][key].removesuffix(unit)) for c in containers(spec))

    for key in ("cpu", "memory", "ephemeral-storage"):
        assert total(vllm, key) == total(builtin, key), key
    assert [c["resources"]["limits"].get("nvidia.com/gpu") for c in containers(vllm)] == ["4", None]
    assert containers(builtin)[0]["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_options_size_the_vllm_container() -> None:
    spec = WorkerSpec(
        "dep_v", "v", "store:m", gpu_type="h100", engine="vllm", options={"cpu": "24", "memory": "200Gi"}
    )
    pod = worker_manifest(spec, 1, namespace=NS, image=IMAGE, secret=SECRET, vllm_image=VLLM_IMAGE)
    server = pod["spec"]["template"]["spec"]["initContainers"][1]
    assert server["resources"]["requests"] == {"cpu": "24", "memory": "200Gi", "ephemeral-storage": "48Gi"}
    assert pod["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] == WORKER_SIZE


def test_vllm_gets_the_flags_a_worker_gives_the_vllm_it_starts() -> None:
    """The same flags as workers/vllm/server.py gives a child vLLM, from the same settings."""
    from tokenmill.settings import Settings
    from workers.vllm.server import server_args

    for args, prefix_caching in [
        ({}, True),
        ({}, False),  # TOKENMILL_PREFIX_CACHING off: off in vLLM too, unless the deployment says
        ({"enable_prefix_caching": True}, False),
        ({"max_loras": 2}, True),  # adapters: LoRA on, at the rank the control plane accepts
        ({"enable_lora": True, "max_lora_rank": 16, "scheduling_policy": "priority"}, True),
        ({"enable_lora": False, "max_loras": 2}, True),
    ]:
        settings = Settings(block_size=32, prefix_caching=prefix_caching, max_lora_rank=128)
        spec = dataclasses.replace(VLLM, engine_args=args)
        manifest = worker_manifest(
            spec,
            1,
            namespace=NS,
            image=IMAGE,
            secret=SECRET,
            vllm_image=VLLM_IMAGE,
            block_size=settings.block_size,
            prefix_caching=settings.prefix_caching,
            max_lora_rank=settings.max_lora_rank,
        )
        ours = manifest["spec"]["template"]["spec"]["initContainers"][1]["args"]
        child = server_args(settings, Path("/m"), "m", 8000, KV_ENDPOINT, args)
        # The same flags, values and order, apart from what differs by design: the model's
        # path and served name (the worker reads it from /v1/models), the port's owner.
        assert _flags(ours, drop={"--model"}) == _flags(child, drop={"--model", "--served-model-name"}), args
    assert "--no-enable-prefix-caching" in vllm_server_flags({}, prefix_caching=False)
    assert vllm_server_flags({"max_loras": 2}, max_lora_rank=64) == [
        "--max-loras",
        "2",
        "--scheduling-policy",
        "priority",
        "--enable-lora",
        "--max-lora-rank",
        "64",
    ]
    assert vllm_server_flags({"scheduling_policy": "fcfs"}) == ["--scheduling-policy", "fcfs"]


KV_ENDPOINT = "ipc:///run/tokenmill/kv-events"


def _flags(args: list[str], drop: set[str]) -> list[str]:
    """Flags with their values, JSON values parsed (key order and spaces aside), some dropped."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in drop:
            skip = True
            continue
        out.append(json.dumps(json.loads(arg), sort_keys=True) if arg.startswith("{") else arg)
    return out


async def test_changed_engine_args_replace_the_deployment_and_their_order_does_not(
    fake: FakeKubernetes,
) -> None:
    provider = vllm_provider(fake)
    try:
        await provider.scale(VLLM, 1)
        reordered = dataclasses.replace(VLLM, engine_args=dict(reversed(list(VLLM.engine_args.items()))))
        fake.calls.clear()
        await provider.scale(reordered, 1)
        assert calls(fake) == [("GET", f"{DEPLOYMENTS}/{VLLM_NAME}", None)]  # same hash: nothing to do

        bigger = dataclasses.replace(VLLM, engine_args={**VLLM.engine_args, "max_model_len": 65536})
        fake.calls.clear()
        await provider.scale(bigger, 1)
    finally:
        await provider.close()
    get, put = calls(fake)
    assert get == ("GET", f"{DEPLOYMENTS}/{VLLM_NAME}", None)
    assert put[0] == "PUT" and put[1] == f"{DEPLOYMENTS}/{VLLM_NAME}"
    args = put[2]["spec"]["template"]["spec"]["initContainers"][1]["args"]
    assert args[args.index("--max-model-len") + 1] == "65536"
    old_hash = vllm_manifest(1)["metadata"]["annotations"]["tokenmill.dev/spec-hash"]
    assert put[2]["metadata"]["annotations"]["tokenmill.dev/spec-hash"] != old_hash


@pytest.mark.parametrize(
    "image",
    [
        "vllm/vllm-openai:v0.31.0",  # a tag can move
        "vllm/vllm-openai:latest",
        "vllm/vllm-openai@sha256:abc",  # not a whole digest
        "vllm/vllm-openai@sha256:" + "A" * 64,
        "",
    ],
)
def test_vllm_s_image_must_be_pinned_by_digest(image: str) -> None:
    with pytest.raises(ValueError, match="pinned by digest"):
        worker_manifest(VLLM, 1, namespace=NS, image=IMAGE, secret=SECRET, vllm_image=image)
    from pydantic import ValidationError

    from tokenmill.settings import Settings

    with pytest.raises(ValidationError, match="pinned by digest"):
        Settings(vllm_image=image)


def test_the_default_vllm_image_is_pinned_and_reaches_the_provider() -> None:
    from tokenmill.settings import Settings

    settings = Settings(block_size=32)
    assert re.fullmatch(r"vllm/vllm-openai:v[\d.]+@sha256:[0-9a-f]{64}", settings.vllm_image)
    pod = worker_manifest(
        VLLM,
        1,
        namespace=NS,
        image=IMAGE,
        secret=SECRET,
        vllm_image=settings.vllm_image,
        block_size=settings.block_size,
    )["spec"]["template"]["spec"]
    assert pod["initContainers"][1]["image"] == settings.vllm_image


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dataclasses.replace(VLLM, gpu_type=None), "needs a GPU type"),
        (dataclasses.replace(VLLM, engine="sglang"), "unknown engine 'sglang'"),
        (dataclasses.replace(VLLM, gpus=0), "gpus must be a whole number"),
        (dataclasses.replace(VLLM, engine_args={"trust_remote_code": True}), "Unknown vLLM engine argument"),
        (dataclasses.replace(VLLM, engine_args={"block_size": 8}), "set by the worker"),
    ],
)
def test_a_vllm_spec_that_cannot_run_is_refused(spec: WorkerSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker_manifest(spec, 1, namespace=NS, image=IMAGE, secret=SECRET, vllm_image=VLLM_IMAGE)


def test_a_vllm_deployment_without_a_vllm_image_is_refused() -> None:
    with pytest.raises(ValueError, match="TOKENMILL_VLLM_IMAGE"):
        worker_manifest(VLLM, 1, namespace=NS, image=IMAGE, secret=SECRET)


def test_a_share_too_small_for_vllm_beside_the_worker_is_refused() -> None:
    tiny = {"a100-80gb": {"cpu_millis": 1000}}
    with pytest.raises(ValueError, match="leaves nothing for vLLM"):
        worker_manifest(
            dataclasses.replace(VLLM, gpus=1),
            1,
            namespace=NS,
            image=IMAGE,
            secret=SECRET,
            resources=tiny,
            vllm_image=VLLM_IMAGE,
        )


def test_gpus_per_replica_and_the_older_resources_gpus() -> None:
    def gpus(spec: WorkerSpec) -> str:
        manifest = worker_manifest(spec, 1, namespace=NS, image=IMAGE, secret=SECRET)
        return manifest["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]

    assert gpus(WorkerSpec("d", "n", "m", gpu_type="l4", gpus=2)) == "2"
    assert gpus(WorkerSpec("d", "n", "m", gpu_type="l4", options={"gpus": 4})) == "4"
    # Both said: the larger, so that neither asks less than the other.
    assert gpus(WorkerSpec("d", "n", "m", gpu_type="l4", gpus=8, options={"gpus": 2})) == "8"


@pytest.mark.parametrize("spec", [GPU, VLLM, WorkerSpec("dep_cpu", "cpu", "bundled:smollm2")])
def test_manifests_are_valid_objects_of_the_kubernetes_api(spec: WorkerSpec) -> None:
    """A round trip through the official client's models keeps every field: none is misspelt,
    misplaced or of the wrong type (the client drops what its V1Deployment does not know)."""
    manifest = worker_manifest(spec, 1, namespace=NS, image=IMAGE, secret=SECRET, vllm_image=VLLM_IMAGE)
    api = client.ApiClient()
    deployment = api.deserialize(json.dumps(manifest), "V1Deployment", "application/json")
    assert isinstance(deployment, client.V1Deployment)
    assert api.sanitize_for_serialization(deployment) == manifest
