"""The tokenmill module against the code it deploys: real commands, real settings, the RBAC
the Kubernetes provider needs, service accounts the storage roles trust, GPU nodes labelled
and tainted as the worker pods expect."""

from __future__ import annotations

import re
from typing import Any

import pytest

from autoscaler.kubernetes import worker_manifest
from autoscaler.providers import WorkerSpec
from tests.infra.cli_commands import resolve
from tests.infra.terraform_files import REPO, module_at
from tokenmill.settings import Settings, describe

TOKENMILL = module_at("modules/tokenmill")
CONTAINERS = {
    (rtype, name): body["spec"][0]["template"][0]["spec"][0]["container"][0]
    for (rtype, name), body in TOKENMILL.resources.items()
    if rtype in ("kubernetes_deployment_v1", "kubernetes_job_v1")
}


def _literal_args(args: list[str]) -> list[str]:
    """Container args with Terraform expressions replaced by a plausible value."""
    return ["2" if "${" in a else a for a in args]


def test_every_service_runs_a_real_tokenmill_command() -> None:
    commands = {}
    for key, container in CONTAINERS.items():
        assert "command" not in container, f"{key}: use the image's ENTRYPOINT (tokenmill)"
        args = _literal_args(container["args"])
        resolve(args)
        commands[key[1]] = args[:2] if args[0] in ("celery", "migrate") else args[:1]
    assert commands == {
        "migrate": ["migrate", "upgrade"],
        "gateway": ["gateway"],
        "control_plane": ["control-plane"],
        "celery_worker": ["celery", "worker"],
        "celery_beat": ["celery", "beat"],
        "autoscaler": ["autoscaler"],
    }


def test_the_worker_template_runs_a_real_tokenmill_command() -> None:
    manifest = worker_manifest(
        WorkerSpec("d", "n", "bundled:smollm2"), 1, namespace="t", image="i:1", secret="s"
    )
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["tokenmill"]
    resolve(container["args"])


def _keys(expression: str) -> set[str]:
    """Keys of the object literals in a merge(...) expression."""
    return set(re.findall(r"\b([A-Z][A-Z0-9_]+) = ", expression))


def test_settings_and_secrets_are_real_settings() -> None:
    known = {env for env, _, _ in describe()}
    for name in ("settings", "app_secret_data", "worker_secret_data"):
        keys = _keys(TOKENMILL.locals[name])
        assert keys, name
        assert keys <= known, f"local.{name}: not Tokenmill settings: {sorted(keys - known)}"
    required = {
        "TOKENMILL_INTERNAL_TOKEN",
        "TOKENMILL_SECRET_KEY",
        "DATABASE_URL",
        "REDIS_URL",
        "TOKENMILL_STORAGE_URL",
    }
    assert required <= _keys(TOKENMILL.locals["app_secret_data"])
    assert {"TOKENMILL_STRIPE_API_KEY", "TOKENMILL_STRIPE_WEBHOOK_SECRET"} <= _keys(
        TOKENMILL.locals["app_secret_data"]
    )
    # What the worker Secret must hold by the contract (autoscaler/kubernetes.py, envFrom).
    assert {"TOKENMILL_INTERNAL_TOKEN", "REDIS_URL", "TOKENMILL_STORAGE_URL"} <= _keys(
        TOKENMILL.locals["worker_secret_data"]
    )
    # Secrets never go into the ConfigMap.
    secrets = {
        "TOKENMILL_INTERNAL_TOKEN",
        "TOKENMILL_SECRET_KEY",
        "DATABASE_URL",
        "REDIS_URL",
        "TOKENMILL_CELERY_BROKER_URL",
        "TOKENMILL_STRIPE_API_KEY",
        "TOKENMILL_STRIPE_WEBHOOK_SECRET",
    }
    assert not secrets & _keys(TOKENMILL.locals["settings"])
    validation = TOKENMILL.variables["settings"]["validation"][0]["condition"]
    assert all(f'"{name}"' in validation for name in secrets if name.startswith("TOKENMILL_"))


def test_defaults_match_the_autoscaler_s_settings() -> None:
    defaults = Settings.model_fields
    assert TOKENMILL.variables["namespace"]["default"] == defaults["kubernetes_namespace"].default
    assert TOKENMILL.locals["worker_secret"] == defaults["worker_secret"].default
    assert TOKENMILL.locals["service_accounts"]["worker"] == "tokenmill-worker"


def _rules() -> dict[tuple[str, str], set[str]]:
    rules: dict[tuple[str, str], set[str]] = {}
    for rule in TOKENMILL.resources[("kubernetes_role_v1", "autoscaler")]["rule"]:
        for group in rule["api_groups"]:
            for resource in rule["resources"]:
                rules.setdefault((group, resource), set()).update(rule["verbs"])
    return rules


def test_autoscaler_rbac_covers_every_call_of_the_kubernetes_provider() -> None:
    source = (REPO / "autoscaler" / "kubernetes.py").read_text()
    verbs = {
        "create": "create",
        "replace": "update",
        "patch": "patch",
        "delete": "delete",
        "read": "get",
        "list": "list",
        "watch": "watch",
    }
    kinds = {
        "deployment": ("apps", "deployments"),
        "deployment_scale": ("apps", "deployments/scale"),
        "pod": ("", "pods"),
    }
    calls = set(
        re.findall(
            r"\b(create|replace|patch|delete|read|list|watch)_namespaced_(deployment_scale|deployment|pod)\b",
            source,
        )
    )
    assert calls, "autoscaler/kubernetes.py makes no namespaced API call?"
    rules = _rules()
    for verb, kind in calls:
        assert verbs[verb] in rules.get(kinds[kind], set()), (
            f"the autoscaler Role lacks {verbs[verb]} on {kinds[kind]}"
        )
    # And no more than the issue grants: no cluster scope, no secrets, no escalation.
    assert set(rules) <= {("apps", "deployments"), ("apps", "deployments/scale"), ("", "pods")}
    assert rules[("", "pods")] <= {"get", "list", "watch", "patch", "delete"}
    assert ("kubernetes_cluster_role_v1", "autoscaler") not in TOKENMILL.resources
    binding = TOKENMILL.resources[("kubernetes_role_binding_v1", "autoscaler")]
    assert (
        binding["subject"][0]["name"]
        == '${kubernetes_service_account_v1.this["autoscaler"].metadata[0].name}'
    )


def test_storage_roles_trust_the_module_s_service_accounts() -> None:
    storage = module_at("modules/storage")
    accounts = TOKENMILL.locals["service_accounts"]
    writers, readers = (
        storage.variables["writer_service_accounts"]["default"],
        storage.variables["reader_service_accounts"]["default"],
    )
    assert set(writers) == {accounts["control_plane"], accounts["billing"]}
    assert set(readers) == {accounts["worker"], accounts["gateway"]}
    roles = TOKENMILL.locals["role_arns"]
    assert roles["control_plane"] == roles["billing"] == "${var.writer_role_arn}"
    assert roles["worker"] == roles["gateway"] == "${var.reader_role_arn}"
    assert roles["autoscaler"] is None and roles["migrate"] is None


def test_gpu_nodes_carry_the_label_and_taint_worker_pods_use() -> None:
    pod = worker_manifest(
        WorkerSpec("d", "n", "m", gpu_type="a10g"), 1, namespace="t", image="i:1", secret="s"
    )
    spec = pod["spec"]["template"]["spec"]
    (label,) = spec["nodeSelector"]
    (toleration,) = spec["tolerations"]
    cluster = module_at("modules/cluster")
    assert f'"{label}" = group.gpu_type' in cluster.locals["node_groups"]
    (taint,) = cluster.resources[("aws_eks_node_group", "this")]["dynamic"]
    assert taint["taint"]["for_each"] == f'${{each.value.gpu_type == null ? [] : ["{toleration["key"]}"]}}'
    assert toleration["operator"] == "Exists"  # any value of the taint
    assert taint["taint"]["content"][0]["effect"] == "NO_SCHEDULE" and toleration["effect"] == "NoSchedule"


def _probe_paths(container: dict[str, Any]) -> set[str]:
    return {
        probe[0]["http_get"][0]["path"]
        for key in ("readiness_probe", "liveness_probe", "startup_probe")
        for probe in [container.get(key)]
        if probe and "http_get" in probe[0]
    }


@pytest.mark.parametrize("name", ["gateway", "control_plane", "autoscaler"])
def test_http_services_are_probed_on_health(name: str) -> None:
    container = CONTAINERS[("kubernetes_deployment_v1", name)]
    assert _probe_paths(container) == {"/health"}
    assert container["port"][0]["container_port"] == 8000
    assert '@get("/health"' in (REPO / "tokenmill" / "ops.py").read_text()


def test_worker_probes_use_the_worker_s_tokenless_path() -> None:
    server = (REPO / "workers" / "server.py").read_text()
    (ready,) = re.findall(r'^READY_PATH = "([^"]+)"', server, re.M)
    pod = worker_manifest(WorkerSpec("d", "n", "m"), 1, namespace="t", image="i:1", secret="s")
    container = pod["spec"]["template"]["spec"]["containers"][0]
    for key in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[key]["httpGet"]["path"] == ready
    assert f"/{ready.strip('/')}'" in (REPO / "Dockerfile.worker").read_text()  # its HEALTHCHECK


def test_every_pod_runs_restricted() -> None:
    for key, body in TOKENMILL.resources.items():
        if key[0] not in ("kubernetes_deployment_v1", "kubernetes_job_v1"):
            continue
        pod = body["spec"][0]["template"][0]["spec"][0]
        context = pod["security_context"][0]
        assert context["run_as_non_root"] is True and context["run_as_user"] == 10001, key
        assert context["seccomp_profile"][0]["type"] == "RuntimeDefault", key
        container = pod["container"][0]["security_context"][0]
        assert container["allow_privilege_escalation"] is False, key
        assert container["read_only_root_filesystem"] is True, key
        assert container["capabilities"][0]["drop"] == ["ALL"], key
        expected_token = key[1] == "autoscaler"
        assert pod["automount_service_account_token"] is expected_token, key


def test_migrations_run_before_the_rollout() -> None:
    job = TOKENMILL.resources[("kubernetes_job_v1", "migrate")]
    assert job["wait_for_completion"] is True
    assert "sha256(var.image)" in TOKENMILL.locals["migrate_job"]  # a new image, a new Job
    for name in ("gateway", "control_plane", "celery_worker", "celery_beat", "autoscaler"):
        depends = TOKENMILL.resources[("kubernetes_deployment_v1", name)]["depends_on"]
        assert "kubernetes_job_v1.migrate" in str(depends), name
