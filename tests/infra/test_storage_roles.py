"""The storage module's IRSA roles: the gateways write only under the prefix's files/ (the
uploads of /v1/files), the workers only read, the control plane and Celery write anywhere
under the prefix (adapters, exports, batches' output files).

Two ways, as in test_manifests_agree.py:

- with terraform and the local AWS provider: `terraform test` applies the module with every
  resource overridden (nothing is created, nothing reaches AWS) and the provider itself renders
  each role's policy, whose grants must be exactly GRANTS below, and each role's trust policy;
- always: the module's HCL, parsed, says the same (where each role writes, the write actions).
"""

from __future__ import annotations

import json
import shutil
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from control_plane.files.models import file_key
from tests.infra.terraform_files import (
    TERRAFORM,
    module_at,
    plugin_mirror,
    run,
    terraform_binary,
    terraform_env,
)

STORAGE = module_at("modules/storage")

ACCOUNT = "123456789012"
REGION = "eu-west-1"
BUCKET = "tm-bucket"
PREFIX = STORAGE.variables["prefix"]["default"]
NAMESPACE = STORAGE.variables["namespace"]["default"]
ISSUER = f"oidc.eks.{REGION}.amazonaws.com/id/EXAMPLE"
BUCKET_ARN = f"arn:aws:s3:::{BUCKET}"
KEY_ARN = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/example"
OBJECTS = f"{BUCKET_ARN}/{PREFIX}/*"
FILES = f"{BUCKET_ARN}/{PREFIX}/files/*"

WRITE_ACTIONS = ("s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts")
READ = {
    ("s3:ListBucket", BUCKET_ARN),
    ("s3:GetObject", OBJECTS),
    ("kms:Decrypt", KEY_ARN),
}
# (action, resource) pairs each role's policy allows, nothing more.
GRANTS = {
    "writer": READ | {(a, OBJECTS) for a in WRITE_ACTIONS} | {("kms:GenerateDataKey", KEY_ARN)},
    "files-writer": READ | {(a, FILES) for a in WRITE_ACTIONS} | {("kms:GenerateDataKey", KEY_ARN)},
    "reader": READ,
}


def allowed(role: str, action: str, key: str) -> bool:
    """Whether the role may do `action` on the object `key` of the bucket (IAM's wildcards)."""
    arn = f"{BUCKET_ARN}/{key}"
    return any(a == action and fnmatchcase(arn, resource) for a, resource in GRANTS[role])


# --- the grants mean what the services need -------------------------------------------------


def test_the_gateway_role_writes_files_and_nothing_else() -> None:
    upload = f"{PREFIX}/{file_key('org_1', 'file-abc')}"  # where FileService puts an upload
    for action in (*WRITE_ACTIONS, "s3:GetObject"):
        assert allowed("files-writer", action, upload), action
    for elsewhere in (
        f"{PREFIX}/exports/usage.csv",
        f"{PREFIX}/models/llama/model.safetensors",
        f"{PREFIX}/adapters/a1/adapter_model.safetensors",
        f"{PREFIX}/files-elsewhere/x",
        f"{PREFIX}/files",
        "other/files/org_1/file-abc",
        "files/org_1/file-abc",
    ):
        for action in WRITE_ACTIONS:
            assert not allowed("files-writer", action, elsewhere), (action, elsewhere)
    # It still reads what it read before (tokenizers of stored models).
    assert allowed("files-writer", "s3:GetObject", f"{PREFIX}/models/llama/tokenizer.json")


def test_the_workers_role_only_reads() -> None:
    for key in (f"{PREFIX}/models/m/config.json", f"{PREFIX}/{file_key('o', 'f')}"):
        assert allowed("reader", "s3:GetObject", key)
        for action in WRITE_ACTIONS:
            assert not allowed("reader", action, key), (action, key)
    assert ("kms:GenerateDataKey", KEY_ARN) not in GRANTS["reader"]


def test_celery_s_role_writes_exports_and_batch_files() -> None:
    for key in (f"{PREFIX}/exports/usage.csv", f"{PREFIX}/{file_key('org_1', 'file-out')}"):
        for action in ("s3:GetObject", *WRITE_ACTIONS):
            assert allowed("writer", action, key), (action, key)
    assert not allowed("writer", "s3:PutObject", "elsewhere/x")


# --- the HCL says so ------------------------------------------------------------------------


def test_hcl_roles_and_where_they_write() -> None:
    assert set(STORAGE.locals["roles"]) == set(GRANTS)
    assert STORAGE.locals["objects"] == "${aws_s3_bucket.this.arn}/${var.prefix}/*"
    assert STORAGE.locals["writes"] == {
        "writer": ["${local.objects}"],
        "files-writer": ["${aws_s3_bucket.this.arn}/${var.prefix}/files/*"],
        "reader": [],
    }
    access = STORAGE.data[("aws_iam_policy_document", "access")]
    statements = {s["sid"]: s for s in access["statement"]}
    assert statements["ReadObjects"]["actions"] == ["s3:GetObject"]
    assert statements["ReadObjects"]["resources"] == ["${local.objects}"]
    (dynamic,) = access["dynamic"]
    write = dynamic["statement"]
    assert write["for_each"] == "${length(local.writes[each.key]) > 0 ? [local.writes[each.key]] : []}"
    (content,) = write["content"]
    assert content["sid"] == "WriteObjects" and content["resources"] == "${statement.value}"
    assert sorted(content["actions"]) == sorted(WRITE_ACTIONS)
    # Only a role that writes may make data keys (SSE-KMS puts); every role decrypts.
    assert statements["BucketKey"]["actions"] == (
        '${length(local.writes[each.key]) > 0 ? ["kms:Decrypt", "kms:GenerateDataKey"] : ["kms:Decrypt"]}'
    )
    for output, role in (
        ("writer_role_arn", "writer"),
        ("files_writer_role_arn", "files-writer"),
        ("reader_role_arn", "reader"),
    ):
        assert STORAGE.outputs[output]["value"] == f'${{aws_iam_role.this["{role}"].arn}}'


# --- with terraform: what the AWS provider renders ------------------------------------------

# Values of the data sources the module reads from AWS (overridden: nothing is asked).
DATA_VALUES = {
    "aws_caller_identity": {"account_id": ACCOUNT},
    "aws_partition": {"partition": "aws"},
    "aws_region": {"name": REGION},
}
RESOURCE_VALUES = {
    ("aws_s3_bucket", "this"): {"arn": BUCKET_ARN, "id": BUCKET},
    ("aws_kms_key", "this"): {"arn": KEY_ARN},
}


def _hcl(value: object) -> str:
    return json.dumps(value)  # JSON strings, lists and objects of strings are HCL too


def _test_file() -> str:
    blocks = [
        'provider "aws" {',
        f"  region                      = {_hcl(REGION)}",
        '  access_key                  = "offline"',
        '  secret_key                  = "offline"',
        "  skip_credentials_validation = true",
        "  skip_requesting_account_id  = true",
        "  skip_metadata_api_check     = true",
        "  skip_region_validation      = true",
        "}",
    ]
    for dtype, dname in STORAGE.data:
        if dtype == "aws_iam_policy_document":
            continue  # rendered by the provider itself, offline: what is under test
        values = ", ".join(f"{k} = {_hcl(v)}" for k, v in DATA_VALUES[dtype].items())
        blocks += ["override_data {", f"  target = data.{dtype}.{dname}", f"  values = {{ {values} }}", "}"]
    for rtype, rname in STORAGE.resources:  # every resource: an apply creates nothing
        values = ", ".join(f"{k} = {_hcl(v)}" for k, v in RESOURCE_VALUES.get((rtype, rname), {}).items())
        blocks += ["override_resource {", f"  target = {rtype}.{rname}", f"  values = {{ {values} }}", "}"]
    blocks += [
        "variables {",
        f"  bucket_name       = {_hcl(BUCKET)}",
        f'  oidc_provider_arn = "arn:aws:iam::{ACCOUNT}:oidc-provider/{ISSUER}"',
        f"  oidc_issuer       = {_hcl(ISSUER)}",
        "}",
        'run "roles" {',
    ]
    accounts = {
        "writer": STORAGE.variables["writer_service_accounts"]["default"],
        "files-writer": STORAGE.variables["files_writer_service_accounts"]["default"],
        "reader": STORAGE.variables["reader_service_accounts"]["default"],
    }
    for role, grants in GRANTS.items():
        policy = f'data.aws_iam_policy_document.access["{role}"].json'
        # Every (effect, action, resource) the policy names, whether Action/Resource is a
        # string or a list: exactly the expected grants, all of them Allow.
        pairs = (
            f"toset(flatten([for s in jsondecode({policy}).Statement : [for a in flatten([s.Action]) : "
            f'[for r in flatten([s.Resource]) : "${{s.Effect}} ${{a}} ${{r}}"]]]))'
        )
        expected = sorted(f"Allow {a} {r}" for a, r in grants)
        subjects = sorted(f"system:serviceaccount:{NAMESPACE}:{account}" for account in accounts[role])
        trust = f'jsondecode(data.aws_iam_policy_document.assume["{role}"].json).Statement[0]'
        blocks += [
            "  assert {",
            f"    condition     = {pairs} == toset({_hcl(expected)})",
            f'    error_message = "{role}: ${{{policy}}}"',
            "  }",
            "  assert {",
            f'    condition     = toset(flatten([{trust}.Condition.StringEquals["{ISSUER}:sub"]]))'
            f" == toset({_hcl(subjects)})",
            f"    error_message = {_hcl(role + ' trusts other service accounts')}",
            "  }",
            "  assert {",
            f'    condition     = {trust}.Action == "sts:AssumeRoleWithWebIdentity"',
            f"    error_message = {_hcl(role + ' is assumed otherwise')}",
            "  }",
        ]
    blocks.append("}")
    return "\n".join(blocks) + "\n"


@pytest.mark.skipif(terraform_binary() is None, reason="terraform is not on the PATH (set TERRAFORM=...)")
def test_the_provider_renders_exactly_these_grants(tmp_path: Path) -> None:
    binary = terraform_binary()
    mirror = plugin_mirror()
    assert binary
    assert mirror is not None, (
        "terraform is here but no plugin mirror with hashicorp/aws (set TF_PLUGIN_MIRROR)"
    )
    where = tmp_path / "storage"
    shutil.copytree(TERRAFORM / "modules" / "storage", where, ignore=shutil.ignore_patterns(".terraform"))
    (where / "roles.tftest.hcl").write_text(_test_file())
    env = terraform_env(tmp_path)
    init = [binary, "init", "-backend=false", "-input=false", "-no-color", f"-plugin-dir={mirror}"]
    run(init, cwd=where, env=env)
    out = run([binary, "test", "-no-color"], cwd=where, env=env)
    assert "1 passed, 0 failed" in out, out
