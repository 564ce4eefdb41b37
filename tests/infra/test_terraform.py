"""infra/terraform: formatted, and as consistent as `terraform validate` would demand.

Providers cannot be downloaded here, so `terraform validate` cannot run. Instead every .tf
file is parsed with python-hcl2 and checked: variables and outputs documented, variables
used, every var./local./module./data./resource reference defined, every module call
passing exactly the variables its module declares, provider versions pinned.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.infra.terraform_files import (
    META_ARGUMENTS,
    TERRAFORM,
    Module,
    local_source,
    modules,
    run,
    terraform_binary,
    terraform_env,
)

MODULES = ["network", "cluster", "database", "cache", "storage", "tokenmill"]
ALL = sorted(modules(), key=str)
IDS = [str(p.relative_to(TERRAFORM)) for p in ALL]


def test_the_issue_s_modules_and_example_exist() -> None:
    names = {m.name for m in modules().values()}
    for name in MODULES:
        assert f"modules/{name}" in names
    assert "examples/aws-private" in names
    for module in modules().values():
        files = {p.name for p in module.files}
        assert {"main.tf", "variables.tf" if module.variables else "main.tf"} <= files, module.name


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


def _required_providers(module: Module) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    for block in module.terraform:
        for providers in block.get("required_providers", []):
            found.update(providers)
    return found


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_versions_are_pinned_and_providers_declared(path: Path) -> None:
    module = modules()[path]
    assert any("required_version" in b for b in module.terraform), f"{module.name}: no required_version"
    declared = _required_providers(module)
    used = {rtype.split("_")[0] for rtype, _ in module.resources} | {d.split("_")[0] for d, _ in module.data}
    assert used <= set(declared), f"{module.name}: providers {sorted(used - set(declared))} not required"
    expected = {"aws": "~> 5.", "kubernetes": "~> 2.", "random": "~> 3.", "tls": "~> 4."}
    for name, spec in declared.items():
        assert spec["version"].startswith(expected[name]), f"{module.name}: {name} {spec['version']}"
        assert spec["source"] == f"hashicorp/{name}"


def test_variables_have_validation_where_inputs_are_free_form() -> None:
    """The example's inputs and the modules' names, images, secrets and sizes are validated."""
    example = modules()[TERRAFORM / "examples/aws-private"]
    validated = [n for n, body in example.variables.items() if body.get("validation")]
    assert {"region", "name", "azs", "image", "worker_image", "certificate_arn"} <= set(validated)
    for module_name, names in {
        "modules/tokenmill": [
            "namespace",
            "image",
            "worker_image",
            "database_url",
            "redis_url",
            "storage_url",
        ],
        "modules/database": ["password", "backup_retention_days", "engine_version"],
        "modules/cache": ["auth_token", "num_cache_clusters"],
        "modules/cluster": ["kubernetes_version", "gpu_node_groups", "public_access_cidrs"],
        "modules/storage": ["bucket_name", "prefix"],
        "modules/network": ["cidr", "azs"],
    }.items():
        module = modules()[TERRAFORM / module_name]
        for name in names:
            assert module.variables[name].get("validation"), f"{module_name}: {name} is not validated"


def test_secrets_are_sensitive_inputs() -> None:
    for module_name, names in {
        "modules/tokenmill": ["internal_token", "secret_key", "database_url", "redis_url", "stripe_api_key"],
        "modules/database": ["password"],
        "modules/cache": ["auth_token"],
        "examples/aws-private": ["stripe_api_key", "stripe_webhook_secret"],
    }.items():
        module = modules()[TERRAFORM / module_name]
        for name in names:
            assert module.variables[name].get("sensitive") is True, f"{module_name}: {name} is not sensitive"


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
    assert cache["auth_token"] == "${var.auth_token}"
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
