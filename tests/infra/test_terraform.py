"""infra/terraform: formatted, valid, and consistent.

Every module that needs no provider but AWS's (or none) is checked by `terraform validate`
itself, initialised from the machine's local plugin mirror (DESIGN.md: nothing is downloaded);
the ones that need kubernetes or helm, which no mirror holds, are checked here with
python-hcl2 (and by checkov, tests/infra/test_checkov.py): variables and outputs documented,
variables used, every var./local./module./data./resource reference defined, every module
call passing exactly the variables its module declares, provider versions pinned.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.infra.terraform_files import (
    META_ARGUMENTS,
    TERRAFORM,
    Module,
    local_source,
    module_at,
    modules,
    plugin_mirror,
    run,
    terraform_binary,
    terraform_env,
)

MODULES = [
    "network",
    "cluster",
    "database",
    "cache",
    "storage",
    "secrets",
    "addons-aws",
    "addons",
    "gpu-pools",
    "worker-sizing",
    "tokenmill",
]
STACKS = ["examples/aws-private/infra", "examples/aws-private/platform"]
ALL = sorted(modules(), key=str)
IDS = [str(p.relative_to(TERRAFORM)) for p in ALL]


def _required_providers(module: Module) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    for block in module.terraform:
        for providers in block.get("required_providers", []):
            found.update(providers)
    return found


def _providers_of(module: Module) -> set[str]:
    return set(_required_providers(module))


# Modules `terraform validate` can check here: AWS's provider (from the mirror) or none.
AWS_ONLY = [m for m in ALL if _providers_of(modules()[m]) <= {"aws"}]
AWS_ONLY_IDS = [str(p.relative_to(TERRAFORM)) for p in AWS_ONLY]


def test_the_issue_s_modules_and_stacks_exist() -> None:
    names = {m.name for m in modules().values()}
    for name in MODULES:
        assert f"modules/{name}" in names
    for stack in STACKS:
        assert stack in names
    # The infra stack is AWS only (it applies without reaching the cluster); the platform stack
    # reads it by remote state and is the only one talking to Kubernetes.
    assert _providers_of(module_at("examples/aws-private/infra")) == {"aws"}
    assert _providers_of(module_at("examples/aws-private/platform")) == {"kubernetes", "helm"}
    platform = module_at("examples/aws-private/platform")
    state = platform.data[("terraform_remote_state", "infra")]
    assert state["backend"] == "s3"
    assert set(state["config"]) == {"bucket", "key", "region"}
    for stack in STACKS:
        backends = [b for block in module_at(stack).terraform for b in block.get("backend", [])]
        assert backends and "s3" in backends[0], stack
    # No provider that the mirror lacks where AWS has a native resource (random, tls).
    for module in modules().values():
        assert not _providers_of(module) & {"random", "tls"}, module.name
    for module in modules().values():
        files = {p.name for p in module.files}
        assert {"main.tf", "variables.tf" if module.variables else "main.tf"} <= files, module.name


@pytest.mark.skipif(terraform_binary() is None, reason="terraform is not on the PATH (set TERRAFORM=...)")
@pytest.mark.parametrize("path", AWS_ONLY, ids=AWS_ONLY_IDS)
def test_terraform_validate_with_the_local_aws_provider(path: Path, tmp_path: Path) -> None:
    """`terraform init -plugin-dir=<mirror>` then `terraform validate`, on a copy (init writes a
    lock file), with no network: what the AWS provider itself says about every resource."""
    binary = terraform_binary()
    mirror = plugin_mirror()
    assert binary
    assert mirror is not None, (
        "terraform is here but no plugin mirror with hashicorp/aws (set TF_PLUGIN_MIRROR)"
    )
    # All of infra/: the monitoring module reads the alert rules of infra/prometheus.
    copy = tmp_path / "infra"
    shutil.copytree(TERRAFORM.parent, copy, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*"))
    where = copy / TERRAFORM.name / path.relative_to(TERRAFORM)
    env = terraform_env(tmp_path)
    init = [binary, "init", "-backend=false", "-input=false", "-no-color", f"-plugin-dir={mirror}"]
    run(init, cwd=where, env=env)
    out = run([binary, "validate", "-no-color", "-json"], cwd=where, env=env)
    import json

    report = json.loads(out)
    assert report["valid"] is True, report["diagnostics"]
    assert report["error_count"] == 0 and report["warning_count"] == 0, report["diagnostics"]


def test_the_aws_only_modules_include_the_stack_and_every_aws_module() -> None:
    names = set(AWS_ONLY_IDS)
    expected = {f"modules/{m}" for m in MODULES if m not in ("addons", "tokenmill")}
    assert expected | {"examples/aws-private/infra"} <= names
    assert "modules/tokenmill/modules/worker-manifest" in names
    assert "modules/tokenmill/modules/rollout" in names
    assert not names & {"modules/addons", "modules/tokenmill", "examples/aws-private/platform"}


@pytest.mark.skipif(terraform_binary() is None, reason="terraform is not on the PATH (set TERRAFORM=...)")
def test_terraform_fmt_is_clean(tmp_path: Path) -> None:
    binary = terraform_binary()
    assert binary
    out = run(
        [binary, "fmt", "-check", "-recursive", "-diff", str(TERRAFORM)],
        cwd=tmp_path,
        env=terraform_env(tmp_path),
    )
    assert out == ""


def test_every_tf_file_parses() -> None:
    files = [f for m in modules().values() for f in m.files]
    assert len(files) == len([f for f in TERRAFORM.rglob("*.tf") if ".terraform" not in f.parts])
    assert len(files) >= 6 * 3 + 4


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_variables_are_documented_typed_and_used(path: Path) -> None:
    module = modules()[path]
    used = {name for kind, name, _ in module.references() if kind == "var"}
    for name, body in module.variables.items():
        assert str(body.get("description", "")).strip(), f"{module.name}: variable {name} has no description"
        assert "type" in body, f"{module.name}: variable {name} has no type"
        assert name in used, f"{module.name}: variable {name} is never used"


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_outputs_are_documented(path: Path) -> None:
    module = modules()[path]
    for name, body in module.outputs.items():
        assert str(body.get("description", "")).strip(), f"{module.name}: output {name} has no description"


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_every_reference_resolves(path: Path) -> None:
    module = modules()[path]
    problems = []
    for ref in sorted(module.references()):
        kind = ref[0]
        if kind == "var" and ref[1] not in module.variables:
            problems.append(f"var.{ref[1]} is not declared")
        elif kind == "local" and ref[1] not in module.locals:
            problems.append(f"local.{ref[1]} is not defined")
        elif kind == "module":
            if ref[1] not in module.modules:
                problems.append(f"module.{ref[1]} is not called")
                continue
            source = local_source(module, module.modules[ref[1]])
            if source is not None and ref[2] and ref[2] not in modules()[source].outputs:
                problems.append(f"module.{ref[1]}.{ref[2]}: the module has no such output")
        elif kind == "data" and (ref[1], ref[2]) not in module.data:
            problems.append(f"data.{ref[1]}.{ref[2]} is not declared")
        elif kind == "resource" and (ref[1], ref[2]) not in module.resources:
            problems.append(f"{ref[1]}.{ref[2]} is not declared")
    assert not problems, f"{module.name}: " + "; ".join(problems)


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_locals_data_and_resources_are_used(path: Path) -> None:
    module = modules()[path]
    refs = module.references()
    used_locals = {name for kind, name, _ in refs if kind == "local"}
    for name in module.locals:
        assert name in used_locals, f"{module.name}: local.{name} unused"
    for dtype, dname in module.data:
        assert ("data", dtype, dname) in refs, f"{module.name}: data.{dtype}.{dname} unused"


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_module_calls_match_the_modules_variables(path: Path) -> None:
    caller = modules()[path]
    for name, call in caller.modules.items():
        source = local_source(caller, call)
        assert source is not None and source in modules(), f"{caller.name}: module {name} has no local source"
        callee = modules()[source]
        given = set(call) - META_ARGUMENTS
        unknown = given - set(callee.variables)
        assert not unknown, f"{caller.name}: module {name} passes undeclared {sorted(unknown)}"
        required = {v for v, body in callee.variables.items() if "default" not in body}
        missing = required - given
        assert not missing, f"{caller.name}: module {name} misses required {sorted(missing)}"


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_versions_are_pinned_and_providers_declared(path: Path) -> None:
    module = modules()[path]
    assert any("required_version" in b for b in module.terraform), f"{module.name}: no required_version"
    declared = _required_providers(module)
    used = {rtype.split("_")[0] for rtype, _ in module.resources} | {d.split("_")[0] for d, _ in module.data}
    used.discard("terraform")  # built in (terraform_remote_state): nothing to install
    assert used <= set(declared), f"{module.name}: providers {sorted(used - set(declared))} not required"
    expected = {"aws": "~> 5.", "kubernetes": "~> 2.", "helm": "~> 2."}
    for name, spec in declared.items():
        assert spec["version"].startswith(expected[name]), f"{module.name}: {name} {spec['version']}"
        assert spec["source"] == f"hashicorp/{name}"


def test_variables_have_validation_where_inputs_are_free_form() -> None:
    """The example's inputs and the modules' names, images, secrets and sizes are validated."""
    infra = modules()[TERRAFORM / "examples/aws-private/infra"]
    validated = [n for n, body in infra.variables.items() if body.get("validation")]
    assert {"region", "name", "azs", "cluster_public_access_cidrs"} <= set(validated)
    platform = modules()[TERRAFORM / "examples/aws-private/platform"]
    validated = [n for n, body in platform.variables.items() if body.get("validation")]
    assert {"image", "worker_image", "certificate_arn"} <= set(validated)
    for module_name, names in {
        "modules/tokenmill": [
            "namespace",
            "image",
            "worker_image",
            "secret_store",
            "redis",
            "storage_url",
            "settings",
        ],
        "modules/database": ["backup_retention_days", "engine_version", "username"],
        "modules/cache": ["users", "num_cache_clusters"],
        "modules/cluster": [
            "kubernetes_version",
            "system_node_group",
            "public_access_cidrs",
            "api_access_cidrs",
        ],
        "modules/secrets": ["name", "app_database_username", "versions"],
        "modules/gpu-pools": ["pools", "ami_family", "ami_version"],
        "modules/worker-sizing": ["pools", "model_cache_percent"],
        "modules/tokenmill/modules/rollout": ["max_stream_seconds"],
        "modules/storage": ["bucket_name", "prefix"],
        "modules/network": ["cidr", "azs"],
    }.items():
        module = modules()[TERRAFORM / module_name]
        for name in names:
            assert module.variables[name].get("validation"), f"{module_name}: {name} is not validated"


def test_no_secret_passes_through_terraform() -> None:
    """Secrets live in Secrets Manager: RDS manages its master password, Tokenmill's tokens are
    generated by an ephemeral resource and written write-only; no module takes a secret as an
    input, and no Kubernetes Secret is written by Terraform (External Secrets renders them)."""
    db = module_at("modules/database").resources[("aws_db_instance", "this")]
    assert db["manage_master_user_password"] is True and "password" not in db and "password_wo" not in db
    secrets = module_at("modules/secrets")
    ephemeral = [block for parsed in secrets.files.values() for block in parsed.get("ephemeral", [])]
    assert ephemeral and all("aws_secretsmanager_random_password" in block for block in ephemeral)
    for (rtype, name), body in secrets.resources.items():
        if rtype == "aws_secretsmanager_secret_version":
            assert "secret_string" not in body and "secret_string_wo" in body, name
            assert "secret_string_wo_version" in body, name
    for module in modules().values():
        for name, body in module.variables.items():
            assert not body.get("sensitive"), f"{module.name}: {name} is a secret input"
        assert not [r for r in module.resources if r[0] == "kubernetes_secret_v1"], module.name
        assert not [r for r in module.resources if r[0].startswith("random_")], module.name
    required = module_at("modules/secrets").terraform[0]["required_version"]
    assert required.startswith(">= 1.11"), required  # write-only arguments


def test_suppressions_sit_next_to_their_resource_with_a_reason() -> None:
    """Every `#checkov:skip=` is inside a resource block, names a check and gives a reason."""
    skip = re.compile(r"#\s*checkov:skip=(?P<id>[A-Z0-9_]+)(?::(?P<reason>.*))?$")
    for tf in TERRAFORM.rglob("*.tf"):
        lines = tf.read_text().splitlines()
        for number, line in enumerate(lines):
            m = skip.search(line.strip())
            if not m:
                continue
            where = f"{tf.relative_to(TERRAFORM)}:{number + 1}"
            assert re.fullmatch(r"CKV2?_[A-Z0-9]+_\d+", m["id"]), f"{where}: {m['id']}"
            assert m["reason"] and len(m["reason"].strip()) >= 30, f"{where}: {m['id']} without a real reason"
            # Inside the block: the nearest unindented line above opens a resource.
            opener = next(lines[i] for i in range(number, -1, -1) if lines[i] and not lines[i][0].isspace())
            assert opener.startswith(("resource ", "data ")), f"{where}: suppression outside a resource"


def test_security_defaults() -> None:
    """What checkov checks too, checked here as well so the suite says it without checkov."""
    db = modules()[TERRAFORM / "modules/database"].resources[("aws_db_instance", "this")]
    assert db["storage_encrypted"] is True and db["publicly_accessible"] is False
    assert db["multi_az"] == "${var.multi_az}"
    assert modules()[TERRAFORM / "modules/database"].variables["multi_az"]["default"] is True
    cache = modules()[TERRAFORM / "modules/cache"].resources[("aws_elasticache_replication_group", "this")]
    assert cache["transit_encryption_enabled"] is True and cache["at_rest_encryption_enabled"] is True
    # A Redis user per component; the default user is off.
    assert cache["user_group_ids"] == ["${aws_elasticache_user_group.this.user_group_id}"]
    assert "auth_token" not in cache
    default_user = modules()[TERRAFORM / "modules/cache"].resources[("aws_elasticache_user", "default")]
    assert default_user["user_name"] == "default" and default_user["access_string"].startswith("off")
    cluster = modules()[TERRAFORM / "modules/cluster"]
    template = cluster.resources[("aws_launch_template", "node")]
    metadata = template["metadata_options"][0]
    assert metadata["http_tokens"] == "required" and metadata["http_put_response_hop_limit"] == 1
    eks = cluster.resources[("aws_eks_cluster", "this")]
    assert eks["encryption_config"][0]["resources"] == ["secrets"]
    assert cluster.variables["endpoint_public_access"]["default"] is False
    storage = modules()[TERRAFORM / "modules/storage"]
    block = storage.resources[("aws_s3_bucket_public_access_block", "this")]
    assert all(
        block[k] is True for k in ("block_public_acls", "block_public_policy", "restrict_public_buckets")
    )
    sse = storage.resources[("aws_s3_bucket_server_side_encryption_configuration", "this")]
    assert sse["rule"][0]["apply_server_side_encryption_by_default"][0]["sse_algorithm"] == "aws:kms"
    for module in modules().values():
        for (rtype, name), body in module.resources.items():
            if rtype == "aws_kms_key":
                assert body["enable_key_rotation"] is True and "policy" in body, f"{module.name}: {name}"
