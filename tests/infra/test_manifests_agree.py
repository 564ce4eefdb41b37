"""The Terraform worker template and the autoscaler's KubernetesProvider build the same
worker Deployment (the manifest contract in autoscaler/kubernetes.py).

Two ways, so the agreement is checked with or without a terraform binary:

- with terraform: the module infra/terraform/modules/tokenmill/modules/worker-manifest is
  evaluated (`terraform console`; it uses no provider, so nothing is downloaded) for several
  deployments and must equal `worker_manifest(...)` exactly, spec-hash annotation included;
- always: the module's HCL is parsed with python-hcl2 and its literal parts (labels,
  selector, probes, ports, container, env names, security contexts, volumes, GPU
  scheduling, resource keys, service account) compared with the Python output.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest

from autoscaler.kubernetes import worker_disruption_budget, worker_manifest
from autoscaler.providers import WorkerSpec
from tests.infra.terraform_files import TERRAFORM, module_at, run, terraform_binary, terraform_env

WORKER_MODULE = TERRAFORM / "modules" / "tokenmill" / "modules" / "worker-manifest"
NAMESPACE = "tokenmill"
IMAGE = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/tokenmill-worker:0.1.0"
SECRET = "tokenmill-worker"

SPECS = {
    "gpu_with_options": (
        WorkerSpec(
            deployment_id="dep_01hzx3k9",
            name="Llama 3.1 8B Instruct (prod)",
            model="store:models/llama-3.1-8b-instruct",
            gpu_type="a10g",
            options={"cpu": "8", "memory": "48Gi"},
        ),
        3,
    ),
    "gpu_defaults": (
        WorkerSpec("7c1d9e3f-5a2b-4c8d-9e0f-1a2b3c4d5e6f", "mistral-7b", "store:m/7b", gpu_type="l4"),
        1,
    ),
    "cpu_defaults": (WorkerSpec("dep_cpu", "SmolLM2 on CPU", "bundled:smollm2"), 2),
    "embed_on_cpu": (WorkerSpec("dep_embed", "MiniLM", "bundled:minilm", kind="embed"), 0),
    "long_name": (
        WorkerSpec("dep_long", "A very long deployment name for a model " * 3, "store:x", gpu_type="h100"),
        1,
    ),
    "empty_slug": (WorkerSpec("dep_sym", "%%% ***", "bundled:smollm2"), 1),
    "slug_edges": (WorkerSpec("dep_edges", "--Qwen2.5__7B--", "store:q", gpu_type="l40s"), 1),
    # A GPU type with its share in TOKENMILL_WORKER_RESOURCES, one GPU and four in one pod.
    "sized_one_gpu": (WorkerSpec("dep_sized1", "Llama 8B", "store:l8", gpu_type="a10g"), 2),
    "sized_four_gpus": (
        WorkerSpec("dep_sized4", "Llama 70B", "store:l70", gpu_type="a10g", options={"gpus": 4}),
        1,
    ),
    "partial_share": (WorkerSpec("dep_partial", "L4 model", "store:l4", gpu_type="l4"), 1),
}
# TOKENMILL_WORKER_RESOURCES (as modules/worker-sizing computes it) and TOKENMILL_MAX_STREAM_SECONDS.
RESOURCES = {
    "a10g": {"cpu_millis": 7500, "memory_mib": 28672, "ephemeral_gib": 80, "model_cache_gib": 60},
    "l4": {"memory_mib": 26624},  # the other keys take the defaults
}
MAX_STREAM = {"sized_four_gpus": 1800}


def python_manifest(key: str) -> dict[str, Any]:
    spec, replicas = SPECS[key]
    return worker_manifest(
        spec,
        replicas,
        namespace=NAMESPACE,
        image=IMAGE,
        secret=SECRET,
        resources=RESOURCES,
        max_stream_seconds=MAX_STREAM.get(key, 600),
    )


def _hcl_string(value: str | None) -> str:
    return "null" if value is None else json.dumps(value)  # JSON strings are HCL strings here


def _module_block(key: str) -> str:
    spec, replicas = SPECS[key]
    return "\n".join(
        [
            f'module "{key}" {{',
            f"  source        = {json.dumps(str(WORKER_MODULE))}",
            f"  deployment_id = {_hcl_string(spec.deployment_id)}",
            f"  name          = {_hcl_string(spec.name)}",
            f"  model         = {_hcl_string(spec.model)}",
            f"  gpu_type      = {_hcl_string(spec.gpu_type)}",
            f"  replicas      = {replicas}",
            f"  namespace     = {_hcl_string(NAMESPACE)}",
            f"  image         = {_hcl_string(IMAGE)}",
            f"  secret        = {_hcl_string(SECRET)}",
            f"  cpu           = {_hcl_string(spec.options.get('cpu'))}",
            f"  memory        = {_hcl_string(spec.options.get('memory'))}",
            f"  gpus          = {spec.options.get('gpus', 1)}",
            f"  share         = {json.dumps(RESOURCES.get(spec.gpu_type or '', {}))}",
            f"  max_stream_seconds = {MAX_STREAM.get(key, 600)}",
            "}",
        ]
    )


@pytest.fixture(scope="module")
def terraform_manifests(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    binary = terraform_binary()
    if binary is None:
        pytest.skip("terraform is not on the PATH (set TERRAFORM=...); the HCL comparison below still runs")
    root = tmp_path_factory.mktemp("worker-manifest")
    (root / "main.tf").write_text("\n\n".join(_module_block(key) for key in SPECS) + "\n")
    env = terraform_env(root)
    run([binary, "init", "-backend=false", "-input=false", "-no-color"], cwd=root, env=env)
    expression = (
        "jsonencode({"
        + ", ".join(f"{k} = module.{k}.manifest, {k}_budget = module.{k}.disruption_budget" for k in SPECS)
        + "})"
    )
    done = subprocess.run(
        [binary, "console", "-no-color"],
        cwd=root,
        env=env,
        input=expression + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(json.loads(done.stdout.strip()))  # console prints the JSON as an HCL string


@pytest.mark.parametrize("key", list(SPECS))
def test_terraform_template_equals_worker_manifest(terraform_manifests: dict[str, Any], key: str) -> None:
    ours = terraform_manifests[key]
    theirs = python_manifest(key)
    # Field by field first, for a readable failure; then the whole, spec-hash included.
    assert ours["metadata"]["name"] == theirs["metadata"]["name"]
    assert ours["metadata"]["labels"] == theirs["metadata"]["labels"]
    assert ours["spec"]["selector"] == theirs["spec"]["selector"]
    assert ours["spec"]["template"]["metadata"] == theirs["spec"]["template"]["metadata"]
    pod, their_pod = ours["spec"]["template"]["spec"], theirs["spec"]["template"]["spec"]
    assert {k: v for k, v in pod.items() if k != "containers"} == {
        k: v for k, v in their_pod.items() if k != "containers"
    }
    assert len(pod["containers"]) == len(their_pod["containers"]) == 1
    container, their_container = pod["containers"][0], their_pod["containers"][0]
    assert sorted(container) == sorted(their_container)
    for field in their_container:
        assert container[field] == their_container[field], field
    assert ours == theirs


@pytest.mark.parametrize("key", list(SPECS))
def test_terraform_budget_equals_worker_disruption_budget(
    terraform_manifests: dict[str, Any], key: str
) -> None:
    spec, _ = SPECS[key]
    assert terraform_manifests[f"{key}_budget"] == worker_disruption_budget(spec, namespace=NAMESPACE)


def test_names_stay_dns_labels(terraform_manifests: dict[str, Any]) -> None:
    for key, manifest in terraform_manifests.items():
        if key.endswith("_budget"):
            continue
        name = manifest["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, (key, name)


# --- without terraform: the HCL itself ------------------------------------------------------


class Unresolved(str):
    """An expression the static reader does not evaluate."""


def _resolve(value: Any, local: dict[str, Any], var: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        return {k: _resolve(v, local, var) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, local, var) for v in value]
    if isinstance(value, str):
        m = re.fullmatch(r"\$\{(var|local)\.(\w+)\}", value)
        if m:
            if m[1] == "var":
                return var[m[2]]
            return _resolve(local[m[2]], local, var)
        if "${" in value:
            return Unresolved(value)
    return value


@pytest.fixture(scope="module")
def hcl() -> tuple[dict[str, Any], dict[str, Any]]:
    module = module_at("modules/tokenmill/modules/worker-manifest")
    spec, replicas = SPECS["gpu_with_options"]
    var = {
        "deployment_id": spec.deployment_id,
        "name": spec.name,
        "model": spec.model,
        "gpu_type": spec.gpu_type,
        "replicas": replicas,
        "namespace": NAMESPACE,
        "image": IMAGE,
        "secret": SECRET,
        "cpu": spec.options["cpu"],
        "memory": spec.options["memory"],
    }
    return module.locals, var


def _local(hcl: tuple[dict[str, Any], dict[str, Any]], name: str) -> Any:
    local, var = hcl
    return _resolve(local[name], local, var)


def test_hcl_labels_and_selector(hcl: tuple[dict[str, Any], dict[str, Any]]) -> None:
    theirs = python_manifest("gpu_with_options")
    assert (
        _local(hcl, "labels")
        == theirs["metadata"]["labels"]
        == theirs["spec"]["template"]["metadata"]["labels"]
    )
    assert _local(hcl, "selector") == theirs["spec"]["selector"]["matchLabels"]
    manifest = _local(hcl, "manifest")
    assert manifest["apiVersion"] == theirs["apiVersion"] and manifest["kind"] == theirs["kind"]
    assert manifest["metadata"]["namespace"] == NAMESPACE
    assert set(manifest["metadata"]["annotations"]) == set(theirs["metadata"]["annotations"])
    assert manifest["spec"]["replicas"] == theirs["spec"]["replicas"]


def test_hcl_container(hcl: tuple[dict[str, Any], dict[str, Any]]) -> None:
    theirs = python_manifest("gpu_with_options")["spec"]["template"]["spec"]["containers"][0]
    ours = _local(hcl, "container")
    assert set(ours) == set(theirs)
    for key in (
        "name",
        "image",
        "imagePullPolicy",
        "command",
        "args",
        "envFrom",
        "ports",
        "startupProbe",
        "readinessProbe",
        "livenessProbe",
        "securityContext",
        "volumeMounts",
    ):
        assert ours[key] == theirs[key], key
    # env is an expression (the GPU entry is conditional): compare the names it sets.
    names = re.findall(r'name = "(\w+)"', ours["env"])
    assert names == [e["name"] for e in theirs["env"]]
    for entry in theirs["env"]:
        if "valueFrom" in entry:
            assert f'fieldPath = "{entry["valueFrom"]["fieldRef"]["fieldPath"]}"' in ours["env"]
        elif entry["name"] == "TOKENMILL_MAX_STREAM_SECONDS":
            assert "value = tostring(var.max_stream_seconds)" in ours["env"]
        elif entry["name"] not in ("TOKENMILL_DEPLOYMENT_ID", "TOKENMILL_GPU_TYPE"):
            assert f'value = "{entry["value"]}"' in ours["env"]
    # resources: the keys; the shares the sizes come from are the Python side's own.
    assert set(ours["resources"]["requests"]) == set(theirs["resources"]["requests"])
    from autoscaler.kubernetes import CPU_WORKER, DEFAULT_GPU_SHARE

    assert _local(hcl, "default_gpu_share") == DEFAULT_GPU_SHARE
    assert _local(hcl, "cpu_worker") == CPU_WORKER
    limits = ours["resources"]["limits"]
    limit_keys = set(re.findall(r'"([\w./-]+)" = ', limits)) | (
        {"memory"} if "memory = local.memory" in limits else set()
    )
    assert limit_keys == set(theirs["resources"]["limits"])


def test_hcl_pod(hcl: tuple[dict[str, Any], dict[str, Any]]) -> None:
    theirs = python_manifest("gpu_with_options")["spec"]["template"]["spec"]
    assert _local(hcl, "pod_security_context") == theirs["securityContext"]
    volumes = _local(hcl, "volumes")
    assert [v["name"] for v in volumes] == [v["name"] for v in theirs["volumes"]]
    assert [v for v in volumes if v["name"] != "model-cache"] == [
        v for v in theirs["volumes"] if v["name"] != "model-cache"
    ]
    cache = next(v for v in volumes if v["name"] == "model-cache")
    assert cache["emptyDir"]["sizeLimit"] == "${local.units * local.share.model_cache_gib}Gi"
    scheduling = _local(hcl, "gpu_scheduling")
    assert scheduling == {"nodeSelector": theirs["nodeSelector"], "tolerations": theirs["tolerations"]}
    pod_spec = _local(hcl, "pod_spec")  # merge(...) of the literal part and the GPU part
    assert isinstance(pod_spec, Unresolved)
    for key in ("serviceAccountName", "automountServiceAccountToken", "priorityClassName"):
        literal = json.dumps(theirs[key]).lower()
        assert re.search(rf"\b{key} = {re.escape(literal)}", pod_spec), key
    assert re.search(r"\bterminationGracePeriodSeconds = var.max_stream_seconds \+ 60\b", pod_spec)
    cpu_pod = python_manifest("cpu_defaults")["spec"]["template"]["spec"]
    assert "nodeSelector" not in cpu_pod and "tolerations" not in cpu_pod
    assert "if local.gpu" in pod_spec  # the GPU part is added for GPU deployments only


def test_tokenmill_module_renders_templates_with_the_autoscaler_s_settings() -> None:
    """The tokenmill module calls worker-manifest with what the autoscaler itself uses:
    TOKENMILL_WORKER_IMAGE, TOKENMILL_WORKER_SECRET, TOKENMILL_KUBERNETES_NAMESPACE."""
    module = module_at("modules/tokenmill")
    call = module.modules["worker_template"]
    assert call["source"] == "./modules/worker-manifest"
    assert call["namespace"] == "${var.namespace}"
    assert call["image"] == "${var.worker_image}"
    assert call["secret"] == "${local.worker_secret}"
    settings = module.locals["settings"]
    assert "TOKENMILL_WORKER_IMAGE = var.worker_image" in settings
    assert "TOKENMILL_WORKER_SECRET = local.worker_secret" in settings
    assert "TOKENMILL_KUBERNETES_NAMESPACE = var.namespace" in settings
    assert module.locals["worker_secret"] == SECRET
    assert module.locals["service_accounts"]["worker"] == "tokenmill-worker"
