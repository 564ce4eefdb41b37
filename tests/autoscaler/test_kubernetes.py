"""KubernetesProvider against a local fake of the API, through the real official client.

Each test asserts the exact calls the provider makes (method, path, body) and, for a create,
the whole manifest, written out here by hand from the manifest contract.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from kubernetes import client

from autoscaler.kubernetes import KubernetesProvider, ProviderError, worker_manifest, worker_name
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
