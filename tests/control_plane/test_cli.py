"""`tokenmill admin` acting as the platform operator, through the same services and rules as
the admin API: suspending and resuming organisations, and creating, changing and listing
deployments, on SQLite and PostgreSQL (the commands run as the subprocesses an operator runs)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

from sqlalchemy import select

from billing.models import Price
from control_plane.audit.models import AuditEntry
from control_plane.bootstrap import bootstrap
from control_plane.catalog.models import Deployment
from tests import databases
from tests.control_plane.conftest import GPU, MODEL, SECRET_KEY
from tokenmill.db import make_engine, make_sessionmaker, utcnow
from tokenmill.settings import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[2]


def admin(env: dict[str, str], *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "admin", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done


async def test_operator_commands_suspend_resume_and_manage_deployments(db_url: str, tmp_path: Path) -> None:
    await asyncio.to_thread(databases.migrate, db_url)
    engine = make_engine(db_url)
    sm = make_sessionmaker(engine)
    await bootstrap(
        sm,
        secret_key=SECRET_KEY,
        model_name=MODEL,
        model_source=BUNDLED_MODEL,
        model_format="gguf",
        context_length=8192,
    )
    async with sm() as s, s.begin():
        s.add(Price(gpu_type=GPU, gpu_hour=Decimal("0.80"), effective_from=utcnow() - timedelta(days=1)))
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "TOKENMILL_HOME": str(tmp_path),
        "TOKENMILL_SECRET_KEY": SECRET_KEY,
        # no server to tell: the commands still commit, and say so
        "TOKENMILL_BUS_URL": "http://127.0.0.1:9/internal/bus",
        "TOKENMILL_DEFAULT_MAX_DEDICATED_REPLICAS": "4",
    }
    env.pop("REDIS_URL", None)
    try:
        admin(env, "create-org", "acme")
        out = admin(
            env, "deployments", "create", "--org", "acme", "--name", "acme-chat", "--model", MODEL,
            "--gpu-type", GPU, "--max-replicas", "2",
        ).stdout  # fmt: skip
        dep_id, name, org_id, kind, args, gpu, gpus, replicas, status = out.strip().split("\t")
        assert (name, kind, args, gpu, gpus, replicas, status) == (
            "acme-chat", "builtin", "{}", GPU, "1", "1-2", "active",
        )  # fmt: skip
        # the rules are the admin API's: a priced GPU type, the quota
        refused = admin(
            env, "deployments", "create", "--org", "acme", "--name", "x", "--model", MODEL, ok=False
        )
        assert "needs a gpu_type" in refused.stderr
        too_big = admin(
            env, "deployments", "create", "--org", "acme", "--name", "x", "--model", MODEL, "--gpu-type", GPU,
            "--max-replicas", "3", ok=False,
        )  # fmt: skip
        assert "quota max_dedicated_replicas is 4" in too_big.stderr

        suspended = admin(env, "suspend-org", "acme")
        assert suspended.stdout.strip() == "suspended acme"
        assert "no running gateway was told" in suspended.stderr
        listed = admin(env, "deployments", "list", "--org", "acme").stdout
        assert listed.strip().split("\t")[-1] == "suspended"
        assert admin(env, "resume-org", org_id).stdout.strip() == f"resumed {org_id}"
        out = admin(env, "deployments", "update", dep_id, "--max-replicas", "3").stdout
        assert out.strip().split("\t")[-2:] == ["1-3", "active"]
        # vLLM: engine arguments as name=value, GPUs per replica from the parallelism
        out = admin(
            env, "deployments", "update", dep_id, "--engine", "vllm",
            "--engine-arg", "tensor_parallel_size=2", "--engine-arg", "quantization=awq",
            "--engine-arg", "enable_prefix_caching=false",
        ).stdout  # fmt: skip
        assert out.strip().split("\t")[3:7] == [
            "vllm",
            '{"tensor_parallel_size":2,"quantization":"awq","enable_prefix_caching":false}',
            GPU,
            "2",
        ]
        bad = admin(env, "deployments", "update", dep_id, "--engine-arg", "tensor_parallel_sise=2", ok=False)
        assert "Unknown vLLM engine argument 'tensor_parallel_sise'" in bad.stderr
        low = admin(env, "deployments", "update", dep_id, "--gpus-per-replica", "1", ok=False)
        assert "gpus_per_replica (1) is below" in low.stderr
        out = admin(
            env, "deployments", "update", dep_id, "--clear-engine-args", "--gpus-per-replica", "1"
        ).stdout
        assert out.strip().split("\t")[3:7] == ["vllm", "{}", GPU, "1"]
        made = admin(
            env, "deployments", "create", "--org", "acme", "--name", "acme-big", "--model", MODEL,
            "--gpu-type", GPU, "--engine", "vllm", "--engine-arg", "pipeline_parallel_size=3",
            "--status", "stopped",
        ).stdout  # fmt: skip
        assert made.strip().split("\t")[3:] == [
            "vllm", '{"pipeline_parallel_size":3}', GPU, "3", "1-1", "stopped",
        ]  # fmt: skip
        everything = admin(env, "deployments", "list").stdout
        rows = {line.split("\t")[1]: line.split("\t") for line in everything.strip().splitlines()}
        assert set(rows) == {MODEL, "acme-chat", "acme-big"}
        assert rows[MODEL][3:7] == ["builtin", "{}", "-", "0"]
        assert rows["acme-chat"][3:7] == ["vllm", "{}", GPU, "1"]

        async with sm() as s:
            dep = await s.get(Deployment, dep_id)
            assert dep is not None and (dep.max_replicas, dep.status, dep.org_id) == (3, "active", org_id)
            assert (dep.engine, dep.engine_args, dep.gpus_per_replica) == ("vllm", {}, 1)
            entries = (await s.scalars(select(AuditEntry).where(AuditEntry.resource_id == dep_id))).all()
            # the operator is the system: entries without actor ids
            assert [e.action for e in entries] == [
                "create",
                "suspend",
                "resume",
                "update",
                "update",
                "update",
            ]
            assert all(e.actor_key_id is None and e.actor_user_id is None for e in entries)
    finally:
        await engine.dispose()
