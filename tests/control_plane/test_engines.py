"""Deployments on vLLM through the admin API: `engine`, validated `engine_args` (400s naming
`engine_args.<name>`), `gpus_per_replica` (its default, its lower bound, quotas counting it),
updates, listings and the audit log, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from tests.control_plane.conftest import GPU, MODEL, AdminEnv
from tests.control_plane.test_admin_api import API, error

VLLM_ARGS = {
    "quantization": "awq",
    "tensor_parallel_size": 2,
    "gpu_memory_utilization": 1,
    "enforce_eager": True,
}


async def _create(env: AdminEnv, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    r = await env.client.post(f"{API}/deployments", headers=headers, json={"model": MODEL} | body)
    assert r.status_code == 201, r.text
    return dict(r.json())


async def test_a_vllm_deployment_is_created_listed_and_read(admin_env: AdminEnv) -> None:
    a = await admin_env.org("org-a")
    c = admin_env.client
    dep = await _create(
        admin_env, a.headers, name="a-awq", gpu_type=GPU, engine="vllm", engine_args=VLLM_ARGS, max_replicas=2
    )
    # Stored in the allowlist's order, numbers for floats as floats.
    assert dep["engine"] == "vllm"
    assert list(dep["engine_args"].items()) == [
        ("tensor_parallel_size", 2),
        ("quantization", "awq"),
        ("gpu_memory_utilization", 1.0),
        ("enforce_eager", True),
    ]
    assert dep["gpus_per_replica"] == 2  # tensor_parallel_size x pipeline_parallel_size
    listed = {d["name"]: d for d in (await c.get(f"{API}/deployments", headers=a.headers)).json()}
    assert (listed["a-awq"]["engine"], listed["a-awq"]["gpus_per_replica"]) == ("vllm", 2)
    assert listed["a-awq"]["engine_args"] == dep["engine_args"]
    # The shared CPU deployment the server started with: builtin, no GPUs.
    assert (listed[MODEL]["engine"], listed[MODEL]["engine_args"], listed[MODEL]["gpus_per_replica"]) == (
        "builtin",
        {},
        0,
    )
    got = (await c.get(f"{API}/deployments/{dep['id']}", headers=a.headers)).json()
    assert got == dep
    # More GPUs than the parallelism spans is allowed (say, a node's worth); fewer is not.
    wide = await _create(
        admin_env,
        a.headers,
        name="a-wide",
        gpu_type=GPU,
        engine="vllm",
        engine_args={"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
        gpus_per_replica=8,
    )
    assert wide["gpus_per_replica"] == 8
    r = await c.post(
        f"{API}/deployments",
        headers=a.headers,
        json={
            "name": "a-narrow",
            "model": MODEL,
            "gpu_type": GPU,
            "engine": "vllm",
            "engine_args": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
            "gpus_per_replica": 3,
        },
    )
    assert "= 4" in error(r, 400, "gpus_per_replica")["message"]
    # A builtin deployment with a GPU type holds one by default.
    plain = await _create(admin_env, a.headers, name="a-plain", gpu_type=GPU)
    assert (plain["engine"], plain["engine_args"], plain["gpus_per_replica"]) == ("builtin", {}, 1)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"engine": "vllm", "engine_args": {"tensor_parallel_sise": 2}}, "engine_args.tensor_parallel_sise"),
        ({"engine": "vllm", "engine_args": {"trust_remote_code": True}}, "engine_args.trust_remote_code"),
        ({"engine": "vllm", "engine_args": {"block_size": 32}}, "engine_args.block_size"),
        (
            {"engine": "vllm", "engine_args": {"tensor_parallel_size": "2"}},
            "engine_args.tensor_parallel_size",
        ),
        ({"engine": "vllm", "engine_args": {"tensor_parallel_size": 0}}, "engine_args.tensor_parallel_size"),
        (
            {"engine": "vllm", "engine_args": {"gpu_memory_utilization": 1.5}},
            "engine_args.gpu_memory_utilization",
        ),
        (
            {"engine": "vllm", "engine_args": {"gpu_memory_utilization": 0}},
            "engine_args.gpu_memory_utilization",
        ),
        ({"engine": "vllm", "engine_args": {"quantization": "gguf4"}}, "engine_args.quantization"),
        ({"engine": "vllm", "engine_args": {"dtype": "float8"}}, "engine_args.dtype"),
        (
            {"engine": "vllm", "engine_args": {"enable_prefix_caching": "yes"}},
            "engine_args.enable_prefix_caching",
        ),
        # SmolLM2's context length is 8192 here.
        ({"engine": "vllm", "engine_args": {"max_model_len": 8193}}, "engine_args.max_model_len"),
        ({"engine": "vllm", "engine_args": ["tensor_parallel_size", 2]}, "engine_args"),
        ({"engine_args": {"tensor_parallel_size": 2}}, "engine_args"),  # builtin takes none
        ({"engine": "tgi"}, "engine"),
        ({"gpus_per_replica": -1}, "gpus_per_replica"),
        ({"gpus_per_replica": 65}, "gpus_per_replica"),
        ({"gpus_per_replica": 0}, "gpus_per_replica"),  # with a gpu_type: at least one
        (
            {"engine": "vllm", "engine_args": {"tensor_parallel_size": 4}, "gpus_per_replica": 2},
            "gpus_per_replica",
        ),
    ],
)
async def test_bad_engine_settings_are_400_naming_the_param(
    admin_env: AdminEnv, extra: dict[str, Any], param: str
) -> None:
    body = {"name": "d", "model": MODEL, "org_id": admin_env.default_org, "gpu_type": GPU} | extra
    r = await admin_env.client.post(f"{API}/deployments", headers=admin_env.root, json=body)
    error(r, 400, param)


async def test_engine_rules_without_a_gpu_and_for_embed_models(admin_env: AdminEnv) -> None:
    c, h = admin_env.client, admin_env.root
    # A serverless deployment on CPUs may run on vLLM; it holds (and is billed) no GPUs.
    cpu = await _create(
        admin_env, h, name="cpu-vllm", type="serverless", engine="vllm", engine_args={"dtype": "float32"}
    )
    assert (cpu["gpu_type"], cpu["gpus_per_replica"]) == (None, 0)
    r = await c.post(
        f"{API}/deployments",
        headers=h,
        json={"name": "cpu-2", "model": MODEL, "type": "serverless", "gpus_per_replica": 2},
    )
    assert "needs a gpu_type" in error(r, 400, "gpus_per_replica")["message"]
    r = await c.post(
        f"{API}/models", headers=h, json={"name": "minilm", "source": "bundled:minilm", "kind": "embed"}
    )
    assert r.status_code == 201, r.text
    r = await c.post(
        f"{API}/deployments",
        headers=h,
        json={"name": "embed-vllm", "model": "minilm", "type": "serverless", "engine": "vllm"},
    )
    error(r, 400, "engine")
    # Given a GPU type later, it takes what its parallelism spans.
    r = await c.patch(f"{API}/deployments/{cpu['id']}", headers=h, json={"gpu_type": GPU})
    assert r.status_code == 200 and r.json()["gpus_per_replica"] == 1, r.text


async def test_updates_move_gpus_with_the_parallelism_and_builtin_drops_the_args(
    admin_env: AdminEnv,
) -> None:
    a = await admin_env.org("org-a")
    c = admin_env.client
    dep = await _create(admin_env, a.headers, name="a-chat", gpu_type=GPU)
    url = f"{API}/deployments/{dep['id']}"

    async def patch(body: dict[str, Any]) -> dict[str, Any]:
        r = await c.patch(url, headers=a.headers, json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    # builtin takes no engine arguments
    error(
        await c.patch(url, headers=a.headers, json={"engine_args": {"dtype": "float16"}}), 400, "engine_args"
    )
    moved = await patch({"engine": "vllm", "engine_args": {"tensor_parallel_size": 4}})
    assert (moved["engine"], moved["engine_args"], moved["gpus_per_replica"]) == (
        "vllm",
        {"tensor_parallel_size": 4},
        4,
    )
    error(await c.patch(url, headers=a.headers, json={"gpus_per_replica": 2}), 400, "gpus_per_replica")
    r = await c.patch(url, headers=a.headers, json={"engine_args": {"tensor_parallel_size": 4, "seed": "x"}})
    error(r, 400, "engine_args.seed")
    # A smaller parallelism keeps the GPUs the deployment had, unless asked otherwise.
    kept = await patch({"engine_args": {"tensor_parallel_size": 2, "enable_prefix_caching": False}})
    assert (kept["engine_args"], kept["gpus_per_replica"]) == (
        {"tensor_parallel_size": 2, "enable_prefix_caching": False},
        4,
    )
    assert (await patch({"gpus_per_replica": 2}))["gpus_per_replica"] == 2
    # Other changes leave the engine alone.
    assert (await patch({"max_replicas": 2}))["engine_args"] == kept["engine_args"]
    back = await patch({"engine": "builtin"})
    assert (back["engine"], back["engine_args"], back["gpus_per_replica"]) == ("builtin", {}, 2)

    entries = await admin_env.audit(a.headers, resource_id=dep["id"], action="update")
    first = entries[-1]  # newest first
    assert (first["before"]["engine"], first["after"]["engine"]) == ("builtin", "vllm")
    assert first["after"]["engine_args"] == {"tensor_parallel_size": 4}
    assert (first["before"]["gpus_per_replica"], first["after"]["gpus_per_replica"]) == (1, 4)
    assert entries[0]["after"]["engine_args"] == {}


async def test_quotas_count_gpus_per_replica(admin_env: AdminEnv) -> None:
    c, root = admin_env.client, admin_env.root
    a = await admin_env.org("org-a")
    plan = (await c.post(f"{API}/plans", headers=root, json={"name": "eight-gpus", "max_gpus": 8})).json()
    await c.patch(f"{API}/organizations/{a.id}", headers=root, json={"plan_id": plan["id"]})
    tp4 = {"engine": "vllm", "engine_args": {"tensor_parallel_size": 4}}
    big = await _create(admin_env, a.headers, name="a-big", gpu_type=GPU, max_replicas=2, **tp4)
    assert big["gpus_per_replica"] == 4  # 2 x 4 = 8 GPUs: the whole quota
    r = await c.post(
        f"{API}/deployments", headers=a.headers, json={"name": "a-more", "model": MODEL, "gpu_type": GPU}
    )
    body = error(r, 403, "max_replicas")
    assert body["code"] == "quota_exceeded" and "max_gpus is 8" in body["message"]
    # Raising the GPUs of one replica counts as much as adding replicas.
    r = await c.patch(f"{API}/deployments/{big['id']}", headers=a.headers, json={"max_replicas": 1})
    assert r.status_code == 200, r.text
    r = await c.patch(f"{API}/deployments/{big['id']}", headers=a.headers, json={"gpus_per_replica": 9})
    assert error(r, 403)["code"] == "quota_exceeded"
    r = await c.patch(f"{API}/deployments/{big['id']}", headers=a.headers, json={"gpus_per_replica": 8})
    assert r.status_code == 200 and r.json()["gpus_per_replica"] == 8, r.text
