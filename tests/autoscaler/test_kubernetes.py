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
        "terminationGracePeriodSeconds": 600,
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
                    {"name": "HOME", "value": "/var/lib/tokenmill"},
                    {"name": "TOKENMILL_GPU_TYPE", "value": "a100-80gb"},
                ],
                "envFrom": [{"secretRef": {"name": "tokenmill-worker"}}],
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                "startupProbe": {**PROBE, "periodSeconds": 10, "failureThreshold": 60},
                "readinessProbe": {**PROBE, "periodSeconds": 5, "failureThreshold": 3},
                "livenessProbe": {**PROBE, "periodSeconds": 10, "failureThreshold": 6},
                "resources": {
                    "limits": {"nvidia.com/gpu": "1", "memory": "32Gi"},
                    "requests": {"cpu": "4", "memory": "32Gi"},
                },
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [
                    {"name": "state", "mountPath": "/var/lib/tokenmill"},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ],
        "volumes": [{"name": "state", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
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

    assert calls(fake) == [("GET", DEPLOYMENT, None), ("POST", DEPLOYMENTS, gpu_manifest(2))]
    assert all(c.authorization == f"Bearer {TOKEN}" for c in fake.calls)
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

    assert calls(fake) == [("DELETE", DEPLOYMENT, None)]
    assert fake.calls[0].query == {"propagationPolicy": "Background"}
    assert (NS, NAME) not in fake.deployments

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
        ("GET", DEPLOYMENT, None),
        ("POST", DEPLOYMENTS, gpu_manifest(2)),
        ("GET", DEPLOYMENT, None),
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
    assert container["resources"] == {"limits": {"memory": "8Gi"}, "requests": {"cpu": "2", "memory": "8Gi"}}
    assert [e["name"] for e in container["env"]] == [
        "TOKENMILL_DEPLOYMENT_ID",
        "TOKENMILL_WORKER_ID",
        "TOKENMILL_WORKER_ADVERTISE_HOST",
        "TOKENMILL_WORKER_HOST",
        "TOKENMILL_WORKER_PORT",
        "TOKENMILL_HOME",
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

    assert resources(cpu) == {"limits": {"memory": "2Gi"}, "requests": {"cpu": "1", "memory": "2Gi"}}
    assert resources(gpu) == {
        "limits": {"nvidia.com/gpu": "1", "memory": "120Gi"},
        "requests": {"cpu": "16", "memory": "120Gi"},
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
