"""The Terraform worker template and the autoscaler's KubernetesProvider build the same
worker Deployment (the manifest contract in autoscaler/kubernetes.py).

Two ways, so the agreement is checked with or without a terraform binary:

- with terraform: the module infra/terraform/modules/tokenmill/modules/worker-manifest is
  evaluated (`terraform console`; it uses no provider, so nothing is downloaded) for several
  deployments and must equal `worker_manifest(...)` exactly, spec-hash annotation included;
- always: the module's HCL is parsed with python-hcl2 and its literal parts (labels,
  selector, probes, ports, container, env names, security contexts, volumes, GPU
  scheduling, resource keys, service account, and a vLLM pod's init containers) compared
  with the Python output.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest

from autoscaler.kubernetes import gpu_count, vllm_server_flags, worker_disruption_budget, worker_manifest
from autoscaler.providers import WorkerSpec
from tests.infra.terraform_files import TERRAFORM, module_at, run, terraform_binary, terraform_env
from tokenmill.vllm_args import encode_engine_args

WORKER_MODULE = TERRAFORM / "modules" / "tokenmill" / "modules" / "worker-manifest"
NAMESPACE = "tokenmill"
IMAGE = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/tokenmill-worker:0.1.0"
SECRET = "tokenmill-worker"
VLLM_IMAGE = (
    "vllm/vllm-openai:v0.31.0@sha256:c1c9f6fd5c109ba7f0546a59f5b2f15fb87f64c77782e90a27b648b42a8e67c3"
)

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
    # vLLM beside the worker: engine arguments as flags, GPUs per replica, a sized GPU type.
    "vllm_tensor_parallel": (
        WorkerSpec(
            "dep_vllm70b",
            "Llama 3.1 70B AWQ",
            "store:models/llama-3.1-70b-instruct-awq",
            gpu_type="a10g",
            engine="vllm",
            engine_args={
                "tensor_parallel_size": 4,
                "quantization": "awq",
                "enable_prefix_caching": True,
                "enforce_eager": False,
                "max_model_len": 16384,
                "gpu_memory_utilization": 0.9,
            },
            gpus=4,
        ),
        2,
    ),
    "vllm_defaults": (
        WorkerSpec("dep_vllm_small", "Qwen2.5 7B", "bundled:smollm2", gpu_type="l4", engine="vllm"),
        0,
    ),
    "vllm_with_options": (
        WorkerSpec(
            "dep_vllm_opts",
            "Mixtral",
            "store:models/mixtral",
            gpu_type="h100",
            engine="vllm",
            engine_args={"pipeline_parallel_size": 2},
            gpus=2,
            options={"cpu": "30", "memory": "400Gi"},
        ),
        1,
    ),
}
# TOKENMILL_WORKER_RESOURCES (as modules/worker-sizing computes it) and TOKENMILL_MAX_STREAM_SECONDS.
RESOURCES = {
    "a10g": {"cpu_millis": 7500, "memory_mib": 28672, "ephemeral_gib": 80, "model_cache_gib": 60},
    "l4": {"memory_mib": 26624},  # the other keys take the defaults
}
MAX_STREAM = {"sized_four_gpus": 1800}
BLOCK_SIZE = {"vllm_tensor_parallel": 32}  # TOKENMILL_BLOCK_SIZE; default 16


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
        vllm_image=VLLM_IMAGE,
        block_size=BLOCK_SIZE.get(key, 16),
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
            f"  gpus          = {max(gpu_count(spec), 1)}",
            f"  share         = {json.dumps(RESOURCES.get(spec.gpu_type or '', {}))}",
            f"  max_stream_seconds = {MAX_STREAM.get(key, 600)}",
            f"  engine        = {_hcl_string(spec.engine)}",
            f"  engine_flags  = {json.dumps(vllm_server_flags(spec.engine_args))}",
            f"  engine_args_json = {json.dumps(encode_engine_args(spec.engine_args))}",
            f"  vllm_image    = {_hcl_string(VLLM_IMAGE)}",
            f"  block_size    = {BLOCK_SIZE.get(key, 16)}",
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
    assert {k: v for k, v in pod.items() if k not in ("containers", "initContainers")} == {
        k: v for k, v in their_pod.items() if k not in ("containers", "initContainers")
    }
    assert len(pod["containers"]) == len(their_pod["containers"]) == 1
    assert len(pod.get("initContainers", [])) == len(their_pod.get("initContainers", []))
    pairs = zip(
        pod["containers"] + pod.get("initContainers", []),
        their_pod["containers"] + their_pod.get("initContainers", []),
        strict=True,
    )
    for container, their_container in pairs:
        assert sorted(container) == sorted(their_container)
        for field in their_container:
            assert container[field] == their_container[field], (their_container["name"], field)
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


HCL = tuple[dict[str, Any], dict[str, Any]]


def _hcl_for(key: str) -> HCL:
    """The module's locals and its variables as the spec `key` sets them."""
    module = module_at("modules/tokenmill/modules/worker-manifest")
    spec, replicas = SPECS[key]
    var = {
        "deployment_id": spec.deployment_id,
        "name": spec.name,
        "model": spec.model,
        "gpu_type": spec.gpu_type,
        "replicas": replicas,
        "namespace": NAMESPACE,
        "image": IMAGE,
        "secret": SECRET,
        "cpu": spec.options.get("cpu"),
        "memory": spec.options.get("memory"),
        "engine": spec.engine,
        "engine_flags": vllm_server_flags(spec.engine_args),
        "engine_args_json": encode_engine_args(spec.engine_args),
        "vllm_image": VLLM_IMAGE,
        "block_size": BLOCK_SIZE.get(key, 16),
    }
    return module.locals, var


@pytest.fixture(scope="module")
def hcl() -> HCL:
    return _hcl_for("gpu_with_options")


@pytest.fixture(scope="module")
def vllm_hcl() -> HCL:
    return _hcl_for("vllm_tensor_parallel")


def _local(hcl: HCL, name: str) -> Any:
    local, var = hcl
    return _resolve(local[name], local, var)


def _pod(key: str) -> dict[str, Any]:
    return python_manifest(key)["spec"]["template"]["spec"]


def test_hcl_labels_and_selector(hcl: HCL) -> None:
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


def _limit_keys(expression: str) -> set[str]:
    """Keys of the object literals in a resources expression: quoted or bare."""
    return {quoted or bare for quoted, bare in re.findall(r'(?:"([\w./-]+)"|\b([a-z]+)) = ', expression)}


def test_hcl_container(hcl: HCL, vllm_hcl: HCL) -> None:
    theirs = _pod("gpu_with_options")["containers"][0]
    beside_vllm = _pod("vllm_tensor_parallel")["containers"][0]
    ours = _local(hcl, "container")
    assert set(ours) == set(theirs) == set(beside_vllm)
    for key in (
        "name",
        "image",
        "imagePullPolicy",
        "command",
        "envFrom",
        "ports",
        "startupProbe",
        "readinessProbe",
        "livenessProbe",
        "securityContext",
    ):
        assert ours[key] == theirs[key] == beside_vllm[key], key
    # args, mounts, env and resources depend on the engine: each variant is a local of its own.
    assert ours["args"] == "${local.vllm ? local.vllm_worker_args : local.builtin_worker_args}"
    assert _local(hcl, "builtin_worker_args") == theirs["args"]
    assert _local(vllm_hcl, "vllm_worker_args") == beside_vllm["args"]
    assert _local(hcl, "base_mounts") == theirs["volumeMounts"]
    assert [*_local(hcl, "base_mounts"), _local(hcl, "kv_events_mount")] == beside_vllm["volumeMounts"]
    assert "if local.vllm" in _local(hcl, "volume_mounts")
    # env is an expression (the GPU and vLLM entries are conditional): compare the names it sets.
    names = re.findall(r'name = "(\w+)"', ours["env"])
    assert names == [e["name"] for e in theirs["env"]]
    assert "local.vllm_env" in ours["env"] and "if local.vllm" in ours["env"]
    vllm_env = _local(vllm_hcl, "vllm_env")
    assert names + [e["name"] for e in vllm_env] == [e["name"] for e in beside_vllm["env"]]
    for entry in beside_vllm["env"]:
        if "valueFrom" in entry:
            assert f'fieldPath = "{entry["valueFrom"]["fieldRef"]["fieldPath"]}"' in ours["env"]
        elif entry["name"] == "TOKENMILL_MAX_STREAM_SECONDS":
            assert "value = tostring(var.max_stream_seconds)" in ours["env"]
        elif entry["name"] == "TOKENMILL_BLOCK_SIZE":
            assert "value = tostring(var.block_size)" in ours["env"]
        elif entry["name"] == "TOKENMILL_VLLM_KV_EVENTS_ENDPOINT":
            assert {"name": entry["name"], "value": entry["value"]} in vllm_env  # local.kv_events
        elif entry["name"] == "TOKENMILL_VLLM_ENGINE_ARGS":
            assert {"name": entry["name"], "value": entry["value"]} in vllm_env  # var.engine_args_json
        elif entry["name"] == "TOKENMILL_VLLM_URL":
            assert {"name": entry["name"], "value": entry["value"]} in vllm_env
        elif entry["name"] not in ("TOKENMILL_DEPLOYMENT_ID", "TOKENMILL_GPU_TYPE"):
            assert f'value = "{entry["value"]}"' in ours["env"]
    # resources: the keys; the shares the sizes come from are the Python side's own.
    from autoscaler.kubernetes import CPU_WORKER, DEFAULT_GPU_SHARE, VLLM_WORKER

    assert ours["resources"] == "${local.vllm ? local.vllm_worker_resources : local.builtin_resources}"
    builtin = _local(hcl, "builtin_resources")
    assert _limit_keys(builtin["requests"]) == set(theirs["resources"]["requests"])
    assert _limit_keys(builtin["limits"]) == set(theirs["resources"]["limits"])
    assert _local(hcl, "default_gpu_share") == DEFAULT_GPU_SHARE
    assert _local(hcl, "cpu_worker") == CPU_WORKER
    assert _local(hcl, "vllm_worker") == VLLM_WORKER
    assert _limit_keys(_local(hcl, "vllm_worker_resources")["limits"]) == set(
        beside_vllm["resources"]["limits"]
    )


def test_hcl_pod(hcl: HCL) -> None:
    theirs = _pod("gpu_with_options")
    with_vllm = _pod("vllm_tensor_parallel")
    assert _local(hcl, "pod_security_context") == theirs["securityContext"]
    volumes = _local(hcl, "base_volumes")
    assert [v["name"] for v in volumes] == [v["name"] for v in theirs["volumes"]]
    assert [v for v in volumes if v["name"] != "model-cache"] == [
        v for v in theirs["volumes"] if v["name"] != "model-cache"
    ]
    cache = next(v for v in volumes if v["name"] == "model-cache")
    assert cache["emptyDir"]["sizeLimit"] == "${local.units * local.share.model_cache_gib}Gi"
    assert volumes[:1] + volumes[2:] + _local(hcl, "vllm_volumes") == [
        v for v in with_vllm["volumes"] if v["name"] != "model-cache"
    ]
    assert "if local.vllm" in _local(hcl, "volumes")
    scheduling = _local(hcl, "gpu_scheduling")
    assert scheduling == {"nodeSelector": theirs["nodeSelector"], "tolerations": theirs["tolerations"]}
    pod_spec = _local(hcl, "pod_spec")  # merge(...) of the literal part, the GPU and vLLM parts
    assert isinstance(pod_spec, Unresolved)
    for key in ("serviceAccountName", "automountServiceAccountToken", "priorityClassName"):
        literal = json.dumps(theirs[key]).lower()
        assert re.search(rf"\b{key} = {re.escape(literal)}", pod_spec), key
    assert re.search(r"\bterminationGracePeriodSeconds = var.max_stream_seconds \+ 60\b", pod_spec)
    cpu_pod = _pod("cpu_defaults")
    assert "nodeSelector" not in cpu_pod and "tolerations" not in cpu_pod
    assert "initContainers" not in theirs and "initContainers" not in cpu_pod
    assert "if local.gpu" in pod_spec  # the GPU part is added for GPU deployments only
    assert "initContainers = local.init_containers" in pod_spec and "if local.vllm" in pod_spec


def test_hcl_vllm_init_containers(vllm_hcl: HCL) -> None:
    theirs = _pod("vllm_tensor_parallel")["initContainers"]
    ours = _local(vllm_hcl, "init_containers")
    assert [c["name"] for c in ours] == [c["name"] for c in theirs] == ["fetch-model", "vllm"]
    for mine, their in zip(ours, theirs, strict=True):
        assert set(mine) == set(their), their["name"]
        for key in ("image", "imagePullPolicy", "command", "env", "securityContext", "volumeMounts"):
            assert mine[key] == their[key], (their["name"], key)
        assert set(mine["resources"]["requests"]) == set(their["resources"]["requests"])
        assert set(mine["resources"]["limits"]) == set(their["resources"]["limits"])
    fetch, vllm = ours
    assert fetch["args"] == theirs[0]["args"] and fetch["envFrom"] == theirs[0]["envFrom"]
    assert vllm["restartPolicy"] == theirs[1]["restartPolicy"] == "Always"
    # vLLM's own flags are a local (the JSON of the KV events config is jsonencode's), the
    # deployment's engine arguments come after them.
    assert vllm["args"] == "${concat(local.vllm_args, var.engine_flags)}"
    args = _local(vllm_hcl, "vllm_args")
    their_args = theirs[1]["args"]
    assert len(args) == len(their_args) - len(vllm_server_flags(SPECS["vllm_tensor_parallel"][0].engine_args))
    for mine, their in zip(args, their_args, strict=False):
        if mine.startswith("${jsonencode({enable_kv_cache_events"):  # local.kv_events_config
            for attribute in (
                "enable_kv_cache_events = true",
                'publisher = "zmq"',
                "endpoint = local.kv_events",
            ):
                assert attribute in mine
            assert json.loads(their) == {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": _local(vllm_hcl, "kv_events"),
            }
        elif mine.startswith("${jsonencode({backend"):  # local.structured_outputs_config
            assert 'backend = "guidance"' in mine and "disable_any_whitespace = true" in mine
            assert json.loads(their) == {"backend": "guidance", "disable_any_whitespace": True}
        elif mine == "${tostring(var.block_size)}":
            assert their == "32"
        else:
            assert mine == their
    health = _local(vllm_hcl, "vllm_health")
    for probe, threshold in (("startupProbe", 180), ("livenessProbe", 6)):
        assert theirs[1][probe] == {**health, "failureThreshold": threshold}
        assert re.fullmatch(
            rf"\$\{{merge\(local\.vllm_health, \{{ ?failureThreshold = {threshold} ?\}}\)\}}", vllm[probe]
        )


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
    # Per GPU type a builtin and a vLLM template, with TOKENMILL_VLLM_IMAGE and the block size
    # and prefix caching of the settings the autoscaler reads (a ConfigMap of local.settings).
    assert call["for_each"] == "${local.worker_templates}"
    templates = module.locals["worker_templates"]
    assert '"vllm-${t}" => {gpu_type = t, engine = "vllm"}' in templates.replace("{ ", "{").replace(" }", "}")
    assert call["engine"] == "${each.value.engine}" and call["gpu_type"] == "${each.value.gpu_type}"
    assert call["vllm_image"] == "${var.vllm_image}"
    assert "TOKENMILL_VLLM_IMAGE = var.vllm_image" in settings
    assert call["block_size"] == '${tonumber(lookup(local.settings, "TOKENMILL_BLOCK_SIZE", "16"))}'
    assert 'lookup(local.settings, "TOKENMILL_PREFIX_CACHING", "true")' in call["engine_flags"]
    assert vllm_server_flags({}, prefix_caching=False) == [
        "--scheduling-policy",
        "priority",
        "--no-enable-prefix-caching",
    ]
    assert '["--scheduling-policy", "priority"]' in call["engine_flags"]
    assert '["--no-enable-prefix-caching"] : []' in call["engine_flags"]
