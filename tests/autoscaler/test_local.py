"""LocalProcessProvider starts a vllm deployment's workers as `tokenmill worker ... --engine vllm`
with the engine arguments as JSON in TOKENMILL_VLLM_ENGINE_ARGS, and builtin ones as before:
from a deployment in a real database, through the reconciler, to real processes (a stand-in
for `tokenmill` that writes down how it was started, then waits to be stopped)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from autoscaler.leader import SoleLease
from autoscaler.local import LocalProcessProvider
from autoscaler.reconciler import Reconciler
from control_plane.catalog.models import Deployment, Model
from tokenmill.bus import MemoryBus
from tokenmill.db import Base, make_engine, make_sessionmaker
from tokenmill.vllm_args import ENGINE_ARGS_ENV, decode_engine_args

# Records argv and the engine arguments' variable in $OUT/<worker id>.json, then sleeps until
# SIGTERM (the provider's stop) ends it.
STAND_IN = """
import json, os, sys, time
argv = sys.argv[1:]
worker_id = argv[argv.index("--worker-id") + 1]
record = {"argv": argv, "engine_args": os.environ.get("TOKENMILL_VLLM_ENGINE_ARGS"),
          "gpu_type": os.environ.get("TOKENMILL_GPU_TYPE")}
path = os.path.join(os.environ["OUT"], worker_id + ".json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
time.sleep(120)
"""

ARGS = {"tensor_parallel_size": 2, "quantization": "awq", "enable_prefix_caching": False}


@pytest.fixture
async def db(sqlite_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = make_engine(sqlite_url)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    yield make_sessionmaker(engine)
    await engine.dispose()


def _provider(tmp_path: Path, **env: str) -> LocalProcessProvider:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return LocalProcessProvider(
        env={"OUT": str(out), **env}, drain_timeout=10, program=(sys.executable, str(script))
    )


async def _records(tmp_path: Path, n: int) -> list[dict[str, object]]:
    for _ in range(500):
        found = sorted((tmp_path / "out").glob("*.json"))
        if len(found) >= n:
            return [json.loads(p.read_text()) for p in found]
        await asyncio.sleep(0.02)
    raise AssertionError(f"fewer than {n} workers started")


def test_the_command_line_of_each_engine(tmp_path: Path) -> None:
    # An engine-arguments variable in the server's own environment never reaches a worker.
    provider = _provider(tmp_path, **{ENGINE_ARGS_ENV: '{"seed": 1}'})
    cmd, env = provider.command("dep_v", "store:models/big", "w-1", "a100", engine="vllm", engine_args=ARGS)
    assert cmd[2:] == [
        "worker", "--model", "store:models/big", "--deployment", "dep_v", "--worker-id", "w-1",
        "--exit-with-parent", "--engine", "vllm",
    ]  # fmt: skip
    assert decode_engine_args(env[ENGINE_ARGS_ENV]) == ARGS
    assert env["TOKENMILL_GPU_TYPE"] == "a100"
    cmd, env = provider.command("dep_b", "bundled:smollm2", "w-2")
    assert "--engine" not in cmd and ENGINE_ARGS_ENV not in env and "TOKENMILL_GPU_TYPE" not in env


async def test_the_reconciler_starts_vllm_workers_with_their_engine_arguments(
    db: async_sessionmaker[AsyncSession], tmp_path: Path
) -> None:
    async with db() as session, session.begin():
        model = Model(name="m", source="bundled:smollm2", format="gguf")
        session.add(model)
        await session.flush()
        vllm = Deployment(
            name="on-vllm", model_id=model.id, engine="vllm", engine_args=ARGS, min_replicas=2, max_replicas=2
        )
        plain = Deployment(name="on-ours", model_id=model.id, min_replicas=1, max_replicas=1)
        session.add_all([vllm, plain])
        await session.flush()
    provider = _provider(tmp_path)
    reconciler = Reconciler(MemoryBus(), db, provider, SoleLease(), interval=0.1, worker_timeout=3.0)
    try:
        await reconciler.tick()
        records = await _records(tmp_path, 3)
        assert await provider.replicas(vllm.id) == 2 and await provider.replicas(plain.id) == 1
    finally:
        await provider.close()
    by_dep: dict[str, list[dict[str, object]]] = {}
    for record in records:
        argv = record["argv"]
        assert isinstance(argv, list)
        by_dep.setdefault(argv[argv.index("--deployment") + 1], []).append(record)
    assert len(by_dep[vllm.id]) == 2
    for record in by_dep[vllm.id]:
        assert record["argv"][-2:] == ["--engine", "vllm"]  # type: ignore[index]
        assert json.loads(str(record["engine_args"])) == ARGS
    (ours,) = by_dep[plain.id]
    assert "--engine" not in ours["argv"] and ours["engine_args"] is None  # type: ignore[operator]
