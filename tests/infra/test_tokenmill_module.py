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


def test_a_vllm_pod_runs_real_commands_of_the_worker_image() -> None:
    """`tokenmill worker --engine vllm`, and the init container's module, are in the worker
    image's package; vLLM's own image runs vLLM's server module."""
    spec = WorkerSpec("d", "n", "store:m", gpu_type="l4", engine="vllm")
    pod = worker_manifest(spec, 1, namespace="t", image="i:1", secret="s", vllm_image=Settings().vllm_image)[
        "spec"
    ]["template"]["spec"]
    (worker,) = pod["containers"]
    fetch, vllm = pod["initContainers"]
    assert worker["command"] == ["tokenmill"]
    assert resolve(worker["args"]).name == "worker"
    command = fetch["command"]
    assert command[:2] == ["python", "-m"] and fetch["image"] == worker["image"]
    module = command[2]
    assert (REPO / (module.replace(".", "/") + ".py")).read_text().rstrip().endswith("sys.exit(main())")
    packages = re.search(r"include = \[([^\]]*)\]", (REPO / "pyproject.toml").read_text())
    assert packages and f'"{module.split(".")[0]}*"' in packages[1]  # installed into the image
    from workers.fetch_model import main

    with pytest.raises(SystemExit) as parsed:
        main([*fetch["args"], "--help"])  # its arguments parse
    assert parsed.value.code == 0
    assert vllm["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def _keys(expression: str) -> set[str]:
    """Keys of the object literals in a merge(...) expression."""
    return set(re.findall(r"\b([A-Z][A-Z0-9_]+) = ", expression))


SECRET_SETTINGS = {
    "TOKENMILL_INTERNAL_TOKEN",
    "TOKENMILL_WORKER_TOKEN",
    "TOKENMILL_SECRET_KEY",
    "DATABASE_URL",
    "REDIS_URL",
    "TOKENMILL_CELERY_BROKER_URL",
    "TOKENMILL_STRIPE_API_KEY",
    "TOKENMILL_STRIPE_WEBHOOK_SECRET",
    "TOKENMILL_APP_DATABASE_URL",
}


def _component_secrets() -> dict[str, set[str]]:
    """Secret name -> the environment variables External Secrets renders into it."""
    found = {}
    for name, secret in TOKENMILL.locals["component_secrets"].items():
        data = secret["data"]
        keys = set(data) if isinstance(data, dict) else _keys(data)
        found[TOKENMILL.locals["worker_secret"] if name == "${(local.worker_secret)}" else name] = keys
    return found


def _remote_keys(secret: dict[str, Any]) -> set[str]:
    """The template variables a Secret fetches from Secrets Manager (local.remote's entries)."""
    remote = TOKENMILL.locals["remote"]
    names: set[str] = set()
    for group, user in re.findall(r'local\.remote\.(\w+)(?:\["([\w-]+)"\])?', str(secret["remote"])):
        entry = remote[group]
        if user:
            entry = re.findall(r"(\w+) = \[", entry)  # a for-expression: its keys
            names |= set(entry)
        else:
            names |= set(entry)
    return names


def test_settings_and_secrets_are_real_settings() -> None:
    known = {env for env, _, _ in describe()}
    settings = _keys(TOKENMILL.locals["settings"])
    assert settings and settings <= known, f"not Tokenmill settings: {sorted(settings - known)}"
    assert not settings & SECRET_SETTINGS, "a secret in the ConfigMap"
    assert {
        "TOKENMILL_MAX_STREAM_SECONDS",
        "TOKENMILL_SHUTDOWN_GRACE_SECONDS",
        "TOKENMILL_WORKER_RESOURCES",
    } <= settings
    secrets = _component_secrets()
    for name, keys in secrets.items():
        if name != "tokenmill-metrics":
            assert keys <= known, f"{name}: not Tokenmill settings: {sorted(keys - known)}"
    # Each service has what `_require_production` asks for, with its own Redis user.
    for name in ("tokenmill-gateway", "tokenmill-control-plane", "tokenmill-billing", "tokenmill-autoscaler"):
        assert {"DATABASE_URL", "REDIS_URL", "TOKENMILL_INTERNAL_TOKEN", "TOKENMILL_SECRET_KEY"} <= secrets[
            name
        ]
    # Gateways (and the control plane) talk to workers with the workers' token; it is also what
    # Prometheus reads every scraped service's /metrics with (tokenmill.ops.check_scraper).
    for name in ("tokenmill-gateway", "tokenmill-control-plane", "tokenmill-autoscaler"):
        assert "TOKENMILL_WORKER_TOKEN" in secrets[name], name
    # Workers: their token, their Redis user, the bucket; never the internal token or the database.
    worker = secrets[TOKENMILL.locals["worker_secret"]]
    assert {"TOKENMILL_WORKER_TOKEN", "REDIS_URL", "TOKENMILL_STORAGE_URL"} <= worker
    assert not worker & {"TOKENMILL_INTERNAL_TOKEN", "DATABASE_URL", "TOKENMILL_SECRET_KEY"}
    # Only the migration Job gets the owner's credentials, and it creates the services' role.
    assert secrets["tokenmill-migrate"] == {"DATABASE_URL", "TOKENMILL_APP_DATABASE_URL"}
    owner = [
        n for n, c in TOKENMILL.locals["component_secrets"].items() if "local.owner_url" in str(c["data"])
    ]
    assert owner == ["tokenmill-migrate"]
    validation = TOKENMILL.variables["settings"]["validation"][0]["condition"]
    assert all(f'"{name}"' in validation for name in SECRET_SETTINGS if name.startswith("TOKENMILL_"))


def test_every_secret_template_fetches_what_it_uses() -> None:
    for name, secret in TOKENMILL.locals["component_secrets"].items():
        used = set(re.findall(r"\{\{ \.(\w+)", str(secret["data"])))
        for url in ("database_url", "owner_url", "redis_url"):
            if f"local.{url}" in str(secret["data"]):
                used |= set(re.findall(r"\{\{ \.(\w+)", TOKENMILL.locals[url]))
        assert used and used <= _remote_keys(secret), (
            f"{name}: {sorted(used - _remote_keys(secret))} not fetched"
        )
    # TLS with verification to PostgreSQL (the RDS CA bundle in the images) and to Redis.
    assert TOKENMILL.locals["database_url"].endswith("?ssl=verify-full")
    assert TOKENMILL.locals["owner_url"].endswith("?ssl=verify-full")
    assert (
        TOKENMILL.locals["redis_url"].startswith("rediss://")
        and "ssl_cert_reqs=required" in TOKENMILL.locals["redis_url"]
    )


def test_each_workload_reads_its_own_secret() -> None:
    expected = {
        "migrate": "tokenmill-migrate",
        "gateway": "tokenmill-gateway",
        "control_plane": "tokenmill-control-plane",
        "celery_worker": "tokenmill-billing",
        "celery_beat": "tokenmill-billing",
        "autoscaler": "tokenmill-autoscaler",
    }
    for (_, name), container in CONTAINERS.items():
        refs = [e["secret_ref"][0]["name"] for e in container["env_from"] if "secret_ref" in e]
        assert refs[0] == expected[name], name
        assert set(refs[1:]) <= {"${local.stripe_secret}"}, name  # optional Stripe keys


def test_defaults_match_the_autoscaler_s_settings() -> None:
    defaults = Settings.model_fields
    assert TOKENMILL.variables["namespace"]["default"] == defaults["kubernetes_namespace"].default
    assert TOKENMILL.locals["worker_secret"] == defaults["worker_secret"].default
    assert TOKENMILL.locals["service_accounts"]["worker"] == "tokenmill-worker"
    # The autoscaler and the templates run the same vLLM image, pinned by digest on both sides.
    assert TOKENMILL.variables["vllm_image"]["default"] == defaults["vllm_image"].default
    assert "TOKENMILL_VLLM_IMAGE = var.vllm_image" in TOKENMILL.locals["settings"]
    assert '"TOKENMILL_VLLM_IMAGE"' in TOKENMILL.variables["settings"]["validation"][0]["condition"]


def test_the_admission_policy_admits_vllm_beside_the_worker_and_nothing_else() -> None:
    """A vllm deployment's pod: the worker image as its container and first init container,
    vLLM's pinned image as its sidecar; no other image, and no init container reads another
    Secret."""
    validations = {
        v["message"]: v["expression"] for v in TOKENMILL.locals["autoscaler_policy"]["spec"]["validations"]
    }
    images = next(e for m, e in validations.items() if m.startswith("worker pods run the worker image"))
    assert "object.spec.template.spec.containers.all(c, c.image == '${var.worker_image}')" in images
    assert (
        "object.spec.template.spec.initContainers.all(c, c.image == '${var.worker_image}' || "
        "c.image == '${var.vllm_image}')"
    ) in images
    assert "!has(object.spec.template.spec.ephemeralContainers)" in images
    secrets = validations["worker pods read the worker Secret and no other"]
    assert "object.spec.template.spec.initContainers) + object.spec.template.spec.containers).all(" in secrets
    # What the provider makes passes those rules.
    spec = WorkerSpec("d", "n", "store:m", gpu_type="l4", engine="vllm")
    image, vllm_image = "w:1", Settings().vllm_image
    pod = worker_manifest(
        spec, 1, namespace="t", image=image, secret="tokenmill-worker", vllm_image=vllm_image
    )["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["containers"]] == [image]
    assert [c["image"] for c in pod["initContainers"]] == [image, vllm_image]
    for container in pod["initContainers"] + pod["containers"]:
        assert all(e["secretRef"]["name"] == "tokenmill-worker" for e in container.get("envFrom", []))
        assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in container["env"])
    assert all("emptyDir" in v for v in pod["volumes"])


def _rules() -> dict[tuple[str, str], set[str]]:
    rules: dict[tuple[str, str], set[str]] = {}
    for rule in TOKENMILL.resources[("kubernetes_role_v1", "autoscaler")]["rule"]:
        for group in rule["api_groups"]:
            for resource in rule["resources"]:
                rules.setdefault((group, resource), set()).update(rule["verbs"])
    return rules


def _cluster_rules() -> dict[tuple[str, str], set[str]]:
    rules: dict[tuple[str, str], set[str]] = {}
    for rule in TOKENMILL.resources[("kubernetes_cluster_role_v1", "autoscaler")]["rule"]:
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
        "pod_disruption_budget": ("policy", "poddisruptionbudgets"),
    }
    calls = set(
        re.findall(
            r"\b(create|replace|patch|delete|read|list|watch)_namespaced_"
            r"(deployment_scale|deployment|pod_disruption_budget|pod)\b",
            source,
        )
    )
    assert {("create", "pod_disruption_budget"), ("delete", "pod_disruption_budget")} <= calls
    rules = _rules()
    for verb, kind in calls:
        assert verbs[verb] in rules.get(kinds[kind], set()), (
            f"the autoscaler Role lacks {verbs[verb]} on {kinds[kind]}"
        )
    cluster_calls = set(re.findall(r"\b(create|read|replace|patch|delete|list)_priority_class\b", source))
    assert cluster_calls == {"create", "read"}
    cluster = _cluster_rules()
    for verb in cluster_calls:
        assert verbs[verb] in cluster[("scheduling.k8s.io", "priorityclasses")], verb
    # And no more: no secrets, no escalation; the only cluster-scoped grant is the PriorityClass,
    # reads of it limited to its name (create cannot be: the admission policy limits it).
    assert set(rules) <= {
        ("apps", "deployments"),
        ("apps", "deployments/scale"),
        ("", "pods"),
        ("policy", "poddisruptionbudgets"),
    }
    assert rules[("", "pods")] <= {"get", "list", "watch", "patch", "delete"}
    assert set(cluster) == {("scheduling.k8s.io", "priorityclasses")}
    for rule in TOKENMILL.resources[("kubernetes_cluster_role_v1", "autoscaler")]["rule"]:
        assert set(rule["verbs"]) <= {"get", "create"}
        if "get" in rule["verbs"]:
            assert rule["resource_names"] == ["tokenmill-worker"]
    binding = TOKENMILL.resources[("kubernetes_role_binding_v1", "autoscaler")]
    assert (
        binding["subject"][0]["name"]
        == '${kubernetes_service_account_v1.this["autoscaler"].metadata[0].name}'
    )
    cluster_binding = TOKENMILL.resources[("kubernetes_cluster_role_binding_v1", "autoscaler")]
    assert cluster_binding["subject"] == binding["subject"]


def test_storage_roles_trust_the_module_s_service_accounts() -> None:
    """Celery and the control plane write the bucket, the gateways only under files/ (the
    uploads of /v1/files: tests/infra/test_storage_roles.py), the workers only read it."""
    storage = module_at("modules/storage")
    accounts = TOKENMILL.locals["service_accounts"]
    writers, files_writers, readers = (
        storage.variables["writer_service_accounts"]["default"],
        storage.variables["files_writer_service_accounts"]["default"],
        storage.variables["reader_service_accounts"]["default"],
    )
    assert set(writers) == {accounts["control_plane"], accounts["billing"]}
    assert files_writers == [accounts["gateway"]]
    assert readers == [accounts["worker"]]
    roles = TOKENMILL.locals["role_arns"]
    assert roles["control_plane"] == roles["billing"] == "${var.writer_role_arn}"
    assert roles["gateway"] == "${var.files_writer_role_arn}"
    assert roles["worker"] == "${var.reader_role_arn}"
    assert roles["autoscaler"] is None and roles["migrate"] is None
    # The example hands each role of the infra stack's bucket to the module's variable of that name.
    outputs = module_at("examples/aws-private/infra").outputs["storage"]["value"]
    call = module_at("examples/aws-private/platform").modules["tokenmill"]
    for name in ("writer_role_arn", "files_writer_role_arn", "reader_role_arn"):
        assert outputs[name] == f"${{module.storage.{name}}}"
        assert call[name] == f"${{local.infra.storage.{name}}}"


def _env(name: str) -> dict[str, str]:
    container = CONTAINERS[("kubernetes_deployment_v1", name)]
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_celery_sends_batch_lines_to_the_gateway_service() -> None:
    """Beat schedules `billing.run_batches` only when TOKENMILL_GATEWAY_URL is set, and the
    Celery worker sends each line there: the gateways' in-cluster Service address."""
    from billing.schedule import jobs

    for name in ("celery_worker", "celery_beat"):
        assert _env(name) == {"TOKENMILL_GATEWAY_URL": "${local.gateway_url}"}, name
    assert "TOKENMILL_GATEWAY_URL" in {env for env, _, _ in describe()}
    service = "kubernetes_service_v1.gateway"
    assert TOKENMILL.locals["gateway_url"] == (
        f"http://${{{service}.metadata[0].name}}.${{kubernetes_namespace_v1.this.metadata[0].name}}"
        f".svc:${{{service}.spec[0].port[0].port}}"
    )
    gateway = TOKENMILL.resources[("kubernetes_service_v1", "gateway")]
    spec = gateway["spec"][0]
    assert spec["selector"] == {"app.kubernetes.io/name": '${local.labels.gateway["app.kubernetes.io/name"]}'}
    (port,) = spec["port"]
    container = CONTAINERS[("kubernetes_deployment_v1", "gateway")]
    assert port["target_port"] == container["port"][0]["name"] == "http"
    # With the Service's name and port and the default namespace, beat schedules the runner.
    url = f"http://{gateway['metadata'][0]['name']}.{TOKENMILL.variables['namespace']['default']}.svc:{port['port']}"
    assert url == "http://tokenmill-gateway.tokenmill.svc:80"
    assert "run_batches" in {job.name for job in jobs(Settings(gateway_url=url))}
    assert "run_batches" not in {job.name for job in jobs(Settings(gateway_url=None))}


def test_celery_has_the_gateway_s_internal_token() -> None:
    """The runner's lines carry TOKENMILL_INTERNAL_TOKEN: the Celery pods' Secret renders it
    from the same Secrets Manager entry as the gateways' Secret."""
    secrets = TOKENMILL.locals["component_secrets"]
    for name in ("tokenmill-gateway", "tokenmill-billing"):
        assert secrets[name]["data"]["TOKENMILL_INTERNAL_TOKEN"] == "{{ .internal_token }}", name
        assert "local.remote.internal" in secrets[name]["remote"], name
    assert TOKENMILL.locals["remote"]["internal"] == {
        "internal_token": ["${var.secrets.internal_token}", None]
    }


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
    # Readiness asks /health; liveness only that the port accepts connections: distinct.
    assert container["readiness_probe"][0]["http_get"][0]["path"] == "/health"
    assert container["liveness_probe"][0]["tcp_socket"][0]["port"] == "http"
    assert "http_get" not in container["liveness_probe"][0]
    assert '@get("/health"' in (REPO / "tokenmill" / "ops.py").read_text()


def test_worker_probes_use_the_worker_s_tokenless_path() -> None:
    server = (REPO / "workers" / "server.py").read_text()
    (ready,) = re.findall(r'^READY_PATH = "([^"]+)"', server, re.M)
    pod = worker_manifest(WorkerSpec("d", "n", "m"), 1, namespace="t", image="i:1", secret="s")
    container = pod["spec"]["template"]["spec"]["containers"][0]
    for key in ("startupProbe", "readinessProbe"):
        assert container[key]["httpGet"]["path"] == ready
    # Liveness is distinct: the port only (no token needed, and a busy worker is not killed).
    assert container["livenessProbe"]["tcpSocket"]["port"] == "http"
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
