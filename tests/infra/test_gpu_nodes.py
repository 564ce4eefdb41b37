"""GPU nodes and what runs on them, evaluated by terraform itself where the modules are pure
(worker-sizing, gpu-pools, rollout, monitoring use no provider: `terraform plan` runs offline):

- acceptance 2: the worker manifests the autoscaler renders for each GPU type of the example
  (one GPU, and every multi-GPU size its nodes allow) fit the node types' allocatable
  resources, computed here on their own from the instance sizes and the kubelet's rules;
- a pool whose workers would not fit fails the plan;
- Karpenter's NodePools carry the label and taint the worker pods select and tolerate, on a
  pinned AMI release;
- acceptance 3: the rollout timings (preStop >= the ALB's deregistration delay, graceful
  timeout >= TOKENMILL_MAX_STREAM_SECONDS, grace period above both) and how the tokenmill
  module wires them; workers have a disruption budget and distinct probes.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from autoscaler.kubernetes import worker_disruption_budget, worker_manifest
from autoscaler.providers import WorkerSpec
from tests.infra.terraform_files import TERRAFORM, module_at, parse, run, terraform_binary, terraform_env
from tokenmill.settings import Settings

pytestmark = pytest.mark.skipif(
    terraform_binary() is None, reason="terraform is not on the PATH (set TERRAFORM=...)"
)

MODULES = TERRAFORM / "modules"
CATALOG = json.loads((MODULES / "worker-sizing" / "instance-types.json").read_text())
PLATFORM = TERRAFORM / "examples" / "aws-private" / "platform"


def plan_outputs(tmp: Path, body: str) -> dict[str, Any]:
    """`terraform plan` of a root module made of `body` (pure modules only); its outputs."""
    (tmp / "main.tf").write_text(body)
    binary = terraform_binary()
    assert binary
    env = terraform_env(tmp)
    run([binary, "init", "-backend=false", "-input=false", "-no-color"], cwd=tmp, env=env)
    run([binary, "plan", "-input=false", "-no-color", "-out=plan"], cwd=tmp, env=env)
    shown = json.loads(run([binary, "show", "-json", "plan"], cwd=tmp, env=env))
    return {k: v["value"] for k, v in shown["planned_values"]["outputs"].items()}


def plan_error(tmp: Path, body: str) -> str:
    (tmp / "main.tf").write_text(body)
    binary = terraform_binary()
    assert binary
    env = terraform_env(tmp)
    run([binary, "init", "-backend=false", "-input=false", "-no-color"], cwd=tmp, env=env)
    done = subprocess.run(
        [binary, "plan", "-input=false", "-no-color"],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0, "the plan should have failed"
    return " ".join(done.stderr.split())


def hcl(value: Any) -> str:
    return json.dumps(value)  # JSON objects, lists, strings and numbers are HCL expressions


# --- the example's pools -----------------------------------------------------------------------


def example_pools() -> dict[str, dict[str, Any]]:
    """gpu_pools of the platform stack: terraform.tfvars.example (what the README deploys)."""
    return parse(PLATFORM / "terraform.tfvars.example")["gpu_pools"]


def example_ami() -> dict[str, str]:
    return parse(PLATFORM / "terraform.tfvars.example")["gpu_ami"]


def daemonset_requests(device_plugin: bool) -> dict[str, int]:
    """What modules/addons makes the GPU nodes' DaemonSets request (its local, read here)."""
    text = module_at("modules/addons").locals["gpu_node_daemonsets"]
    found = re.findall(r"([\w-]+) = \{cpu_millis = (\d+), memory_mib = (\d+)\}", text)
    names = {name for name, _, _ in found}
    assert {"dcgm-exporter", "fluent-bit", "node-exporter", "aws-node", "kube-proxy"} <= names, names
    chosen = [(c, m) for name, c, m in found if device_plugin or name != "nvidia-device-plugin"]
    return {"cpu_millis": sum(int(c) for c, _ in chosen), "memory_mib": sum(int(m) for _, m in chosen)}


def sizing(tmp: Path, pools: dict[str, Any], overhead: dict[str, int]) -> dict[str, Any]:
    pools_hcl = {
        t: {k: v for k, v in p.items() if k in ("instance_types", "disk_gib", "share")}
        for t, p in pools.items()
    }
    body = f"""
module "sizing" {{
  source             = {hcl(str(MODULES / "worker-sizing"))}
  pools              = {hcl(pools_hcl)}
  daemonset_requests = {hcl(overhead)}
}}
output "resources" {{ value = module.sizing.worker_resources }}
output "max_gpus" {{ value = module.sizing.max_gpus_per_pod }}
"""
    return plan_outputs(tmp, body)


# --- allocatable, computed here on its own ------------------------------------------------------


def kube_reserved_cpu_millis(vcpu: int) -> int:
    """EKS AMIs' and Karpenter's formula: 6% of the first core, 1% of the second, 0.5% of the
    next two, 0.25% of every core above four."""
    millis = 0.0
    for core in range(1, vcpu + 1):
        millis += 60 if core == 1 else 10 if core == 2 else 5 if core <= 4 else 2.5
    return math.ceil(millis)


def allocatable(instance: str, *, disk_gib: int, max_pods: int = 32) -> dict[str, float]:
    facts = CATALOG[instance]
    memory = facts["memory_mib"] * 0.925 - (255 + 11 * max_pods) - 100  # VM overhead, kube-reserved, eviction
    return {
        "cpu_millis": facts["vcpu"] * 1000 - kube_reserved_cpu_millis(facts["vcpu"]),
        "memory_mib": memory,
        "ephemeral_gib": disk_gib * 0.9 - 1,  # nodefs eviction at 10%, 1 GiB kube-reserved
        "gpus": facts["gpus"],
    }


def quantity(value: str) -> float:
    """A Kubernetes quantity in base units (cores, bytes)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti)?", value)
    assert m, value
    factor = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m[2]]
    return float(m[1]) * factor


def fits(
    pod: dict[str, Any], node: dict[str, float], overhead: dict[str, int], image_gib: int = 40
) -> list[str]:
    """What of the pod's requests (with the node's DaemonSets) exceeds the node; [] if it fits."""
    requests, gpus = pod_requests(pod)
    problems = []
    cpu = requests["cpu"] * 1000 + overhead["cpu_millis"]
    if cpu > node["cpu_millis"]:
        problems.append(f"cpu {cpu:.0f}m > {node['cpu_millis']:.0f}m")
    memory = requests["memory"] / 2**20 + overhead["memory_mib"]
    if memory > node["memory_mib"]:
        problems.append(f"memory {memory:.0f}Mi > {node['memory_mib']:.0f}Mi")
    disk = requests["ephemeral-storage"] / 2**30 + image_gib
    if disk > node["ephemeral_gib"]:
        problems.append(f"ephemeral-storage {disk:.0f}Gi > {node['ephemeral_gib']:.0f}Gi")
    if gpus > node["gpus"]:
        problems.append(f"gpus {gpus} > {node['gpus']}")
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")["emptyDir"]["sizeLimit"]
    if quantity(cache) > requests["ephemeral-storage"]:
        problems.append("the model cache is larger than the pod's ephemeral storage")
    return problems


def pod_requests(pod: dict[str, Any]) -> tuple[dict[str, float], int]:
    """What the scheduler reserves for a pod, and its GPUs: the sum over the containers and the
    native sidecars (init containers with restartPolicy Always) that run beside them, or a plain
    init container's own requests when larger (it runs alone, before them)."""
    keys = ("cpu", "memory", "ephemeral-storage")
    init = pod.get("initContainers", [])
    running = [c for c in init if c.get("restartPolicy") == "Always"] + pod["containers"]
    total = {k: sum(quantity(c["resources"]["requests"].get(k, "0")) for c in running) for k in keys}
    for container in init:
        if container.get("restartPolicy") != "Always":
            for k in keys:
                total[k] = max(total[k], quantity(container["resources"]["requests"].get(k, "0")))
    gpus = sum(int(c["resources"].get("limits", {}).get("nvidia.com/gpu", "0")) for c in running)
    return total, gpus


def test_the_fit_check_itself_catches_the_old_default() -> None:
    """The issue's case: 32Gi on a 32 GiB g5.2xlarge does not fit (so `fits` can fail)."""
    spec = WorkerSpec("d", "n", "m", gpu_type="a10g", options={"cpu": "4", "memory": "32Gi"})
    pod = worker_manifest(spec, 1, namespace="t", image="i:1", secret="s")["spec"]["template"]["spec"]
    problems = fits(pod, allocatable("g5.2xlarge", disk_gib=200), daemonset_requests(False))
    assert any(p.startswith("memory") for p in problems), problems


def test_example_workers_fit_every_node_type_of_their_pool(tmp_path: Path) -> None:
    pools = example_pools()
    assert len(pools) >= 2 and any(
        CATALOG[i]["gpus"] > 1 for p in pools.values() for i in p["instance_types"]
    )
    plugin = example_ami().get("family", "bottlerocket") != "bottlerocket"
    overhead = daemonset_requests(plugin)
    out = sizing(tmp_path, pools, overhead)
    resources = out["resources"]
    assert set(resources) == set(pools)
    checked = 0
    for gpu_type, pool in pools.items():
        assert out["max_gpus"][gpu_type] == max(CATALOG[i]["gpus"] for i in pool["instance_types"])
        for instance in pool["instance_types"]:
            node = allocatable(instance, disk_gib=pool.get("disk_gib", 200))
            # One GPU, and every multi-GPU pod this node can hold (#13's several GPUs a replica).
            for gpus in sorted({1, node["gpus"]} | set(range(2, node["gpus"] + 1, 2))):
                # On our engine, and vLLM beside the worker (#17): the same pod size.
                for engine in ("builtin", "vllm"):
                    spec = WorkerSpec(
                        "dep", f"{gpu_type}-{gpus}", "store:m", gpu_type=gpu_type, engine=engine, gpus=gpus
                    )
                    manifest = worker_manifest(
                        spec,
                        1,
                        namespace="t",
                        image="i:1",
                        secret="s",
                        resources=resources,
                        vllm_image=Settings().vllm_image,
                    )
                    pod = manifest["spec"]["template"]["spec"]
                    assert pod["nodeSelector"] == {"tokenmill.dev/gpu-type": gpu_type}
                    assert fits(pod, node, overhead) == [], (gpu_type, instance, gpus, engine)
                    assert pod_requests(pod)[1] == gpus
                    checked += 1
    assert checked >= 5


def sizing_body(pools: dict[str, Any]) -> str:
    source = hcl(str(MODULES / "worker-sizing"))
    output = 'output "r" { value = module.s.worker_resources }\n'
    return f'module "s" {{\n  source = {source}\n  pools = {hcl(pools)}\n}}\n{output}'


def test_a_pool_whose_workers_do_not_fit_fails_the_plan(tmp_path: Path) -> None:
    too_big = {"a10g": {"instance_types": ["g5.2xlarge"], "share": {"memory_mib": 32768}}}
    error = plan_error(
        tmp_path,
        sizing_body(too_big),
    )
    assert "would not fit these node types" in error and "a10g/g5.2xlarge" in error
    (tmp_path / "b").mkdir()
    unknown = {"h100": {"instance_types": ["p9.huge"]}}
    error = plan_error(
        tmp_path / "b",
        sizing_body(unknown),
    )
    assert "missing from modules/worker-sizing/instance-types.json" in error and "p9.huge" in error
    (tmp_path / "c").mkdir()
    mixed = {"mixed": {"instance_types": ["g5.2xlarge", "g6.2xlarge"]}}
    error = plan_error(
        tmp_path / "c",
        sizing_body(mixed),
    )
    assert "mixes GPU models" in error


def test_the_sizing_keeps_room_for_the_daemonsets_the_addons_run(tmp_path: Path) -> None:
    """The platform passes modules/addons' own sum to modules/worker-sizing (so a new DaemonSet
    shrinks the workers instead of leaving them Pending), and the sum is what the Helm values set."""
    platform = module_at("examples/aws-private/platform")
    assert (
        platform.modules["worker_sizing"]["daemonset_requests"]
        == "${module.addons.gpu_node_daemonset_requests}"
    )
    addons = (MODULES / "addons" / "main.tf").read_text()
    for name in ("node-exporter", "dcgm-exporter", "fluent-bit", "nvidia-device-plugin"):
        assert f'local.gpu_node_daemonsets["{name}"].cpu_millis' in addons, name
        assert f'local.gpu_node_daemonsets["{name}"].memory_mib' in addons, name
    assert daemonset_requests(True)["cpu_millis"] > daemonset_requests(False)["cpu_millis"]


# --- Karpenter's pools ---------------------------------------------------------------------------


def test_gpu_nodes_carry_the_label_and_taint_worker_pods_use(tmp_path: Path) -> None:
    pools = {t: {k: v for k, v in p.items() if k != "share"} for t, p in example_pools().items()}
    ami = example_ami()
    body = f"""
module "pools" {{
  source         = {hcl(str(MODULES / "gpu-pools"))}
  cluster_name   = "tokenmill"
  node_role_name = "tokenmill-gpu-node"
  pools          = {hcl(pools)}
  ami_family     = {hcl(ami.get("family", "bottlerocket"))}
  ami_version    = {hcl(ami["version"])}
}}
output "manifests" {{ value = module.pools.manifests }}
output "plugin" {{ value = module.pools.needs_device_plugin }}
"""
    out = plan_outputs(tmp_path, body)
    node_pools = {m["metadata"]["name"]: m for m in out["manifests"] if m["kind"] == "NodePool"}
    classes = {m["metadata"]["name"]: m for m in out["manifests"] if m["kind"] == "EC2NodeClass"}
    assert out["plugin"] is False  # Bottlerocket's NVIDIA variant has the device plugin
    for gpu_type, pool in pools.items():
        template = node_pools[f"gpu-{gpu_type}"]["spec"]["template"]
        pod = worker_manifest(
            WorkerSpec("d", "n", "m", gpu_type=gpu_type), 1, namespace="t", image="i:1", secret="s"
        )["spec"]["template"]["spec"]
        for key, value in pod["nodeSelector"].items():
            assert template["metadata"]["labels"][key] == value
        (taint,) = template["spec"]["taints"]
        (toleration,) = pod["tolerations"]
        assert taint["key"] == toleration["key"] and taint["effect"] == toleration["effect"]
        assert toleration["operator"] == "Exists"
        requirements = {r["key"]: r["values"] for r in template["spec"]["requirements"]}
        assert requirements["node.kubernetes.io/instance-type"] == pool["instance_types"]
        node_class = classes[template["spec"]["nodeClassRef"]["name"]]["spec"]
        # The AMI release is pinned (no "latest"), IMDSv2 with one hop, encrypted volumes.
        (alias,) = node_class["amiSelectorTerms"]
        assert re.fullmatch(r"bottlerocket@v\d+\.\d+\.\d+", alias["alias"]), alias
        assert node_class["metadataOptions"]["httpTokens"] == "required"
        assert node_class["metadataOptions"]["httpPutResponseHopLimit"] == 1
        assert all(b["ebs"]["encrypted"] for b in node_class["blockDeviceMappings"])
        data_volume = node_class["blockDeviceMappings"][-1]["ebs"]["volumeSize"]
        assert data_volume == f"{pool.get('disk_gib', 200)}Gi"  # what worker-sizing counted
        # The kubelet's maxPods that worker-sizing reserves memory for.
        sizing_default = module_at("modules/worker-sizing").variables["max_pods"]["default"]
        assert node_class["kubelet"]["maxPods"] == sizing_default
        # Never moved to save money while running (only empty nodes are consolidated).
        assert node_pools[f"gpu-{gpu_type}"]["spec"]["disruption"]["consolidationPolicy"] == "WhenEmpty"


def test_an_unpinned_ami_is_refused(tmp_path: Path) -> None:
    body = f"""
module "pools" {{
  source         = {hcl(str(MODULES / "gpu-pools"))}
  cluster_name   = "tokenmill"
  node_role_name = "r"
  pools          = {{ a10g = {{ instance_types = ["g5.2xlarge"] }} }}
  ami_version    = "latest"
}}
output "m" {{ value = module.pools.manifests }}
"""
    assert "pinned release" in plan_error(tmp_path, body)


# --- rollouts (acceptance 3) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, int]]:
    values = [60, 300, 600, 1800]
    body = "\n".join(
        f'module "r{v}" {{\n  source = {hcl(str(MODULES / "tokenmill" / "modules" / "rollout"))}\n'
        f"  max_stream_seconds = {v}\n}}\n"
        f'output "r{v}" {{ value = {{ '
        f"max_stream = module.r{v}.max_stream_seconds, "
        f"deregistration = module.r{v}.deregistration_delay_seconds, "
        f"prestop = module.r{v}.prestop_seconds, graceful = module.r{v}.graceful_shutdown_seconds, "
        f"grace = module.r{v}.termination_grace_period_seconds, "
        f"worker_grace = module.r{v}.worker_termination_grace_period_seconds }} }}"
        for v in values
    )
    out = plan_outputs(tmp_path_factory.mktemp("rollout"), body)
    return {v: out[f"r{v}"] for v in values}


def test_rollout_timings_hold_for_every_stream_limit(rollouts: dict[int, dict[str, int]]) -> None:
    for max_stream, t in rollouts.items():
        assert t["deregistration"] >= max_stream, t  # the ALB never cuts a stream in flight
        assert t["prestop"] >= t["deregistration"], t
        assert t["graceful"] >= max_stream, t
        assert t["grace"] > t["prestop"] + t["graceful"], t
        # The Python side agrees: the server's own graceful timeout, the workers' grace period.
        assert Settings(max_stream_seconds=max_stream).graceful_shutdown_seconds <= t["graceful"]
        pod = worker_manifest(
            WorkerSpec("d", "n", "m", gpu_type="a10g"),
            1,
            namespace="t",
            image="i:1",
            secret="s",
            max_stream_seconds=max_stream,
        )["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == t["worker_grace"] > max_stream


def test_the_tokenmill_module_wires_the_rollout_timings() -> None:
    tokenmill = module_at("modules/tokenmill")
    assert tokenmill.modules["rollout"]["max_stream_seconds"] == "${var.max_stream_seconds}"
    settings = tokenmill.locals["settings"]
    assert "TOKENMILL_MAX_STREAM_SECONDS = tostring(module.rollout.max_stream_seconds)" in settings
    assert "TOKENMILL_SHUTDOWN_GRACE_SECONDS = tostring(module.rollout.graceful_shutdown_seconds)" in settings
    annotations = tokenmill.locals["target_group_attributes"]
    assert annotations["alb.ingress.kubernetes.io/target-group-attributes"] == (
        "deregistration_delay.timeout_seconds=${module.rollout.deregistration_delay_seconds}"
    )
    for ingress in ("api", "admin"):
        body = tokenmill.resources[("kubernetes_ingress_v1", ingress)]
        assert "local.target_group_attributes" in body["metadata"][0]["annotations"]
    for name in ("gateway", "control_plane"):  # the pods behind the ALB
        pod = tokenmill.resources[("kubernetes_deployment_v1", name)]["spec"][0]["template"][0]["spec"][0]
        assert pod["termination_grace_period_seconds"] == "${module.rollout.termination_grace_period_seconds}"
        container = pod["container"][0]
        command = container["lifecycle"][0]["pre_stop"][0]["exec"][0]["command"]
        assert command == ["sleep", "${tostring(module.rollout.prestop_seconds)}"]
    # The ALB's readiness gate: pods count as ready once the ALB has them healthy.
    namespace = tokenmill.resources[("kubernetes_namespace_v1", "this")]["metadata"][0]
    assert "elbv2.k8s.aws/pod-readiness-gate-inject" in str(namespace["labels"])
    # The platform stack feeds one number to all of it, and keeps the ALB's idle timeout above it.
    platform = module_at("examples/aws-private/platform")
    assert platform.modules["tokenmill"]["max_stream_seconds"] == "${var.max_stream_seconds}"
    assert "idle_timeout.timeout_seconds=${max(var.max_stream_seconds, 60)}" in platform.locals["alb_common"]


def test_workers_have_a_disruption_budget_and_distinct_probes() -> None:
    spec = WorkerSpec("dep_x", "model x", "store:x", gpu_type="a10g")
    manifest = worker_manifest(spec, 2, namespace="t", image="i:1", secret="s")
    budget = worker_disruption_budget(spec, namespace="t")
    assert budget["spec"]["selector"]["matchLabels"] == manifest["spec"]["selector"]["matchLabels"]
    assert budget["spec"]["maxUnavailable"] == 1
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"] != container["readinessProbe"]
    assert "tcpSocket" in container["livenessProbe"] and "httpGet" in container["readinessProbe"]
    assert manifest["spec"]["template"]["spec"]["priorityClassName"] == "tokenmill-worker"
