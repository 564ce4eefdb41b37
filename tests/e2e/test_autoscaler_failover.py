"""Two `tokenmill autoscaler` processes (production mode: PostgreSQL, Redis) against a fake
Kubernetes API reached through a kubeconfig, as in a cluster: only the lease holder acts,
and when it is killed the other takes over and carries on reconciling."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import update

import migrations
from control_plane.catalog.models import Deployment, Model
from tests.autoscaler.fake_kubernetes import FakeKubernetes
from tokenmill.db import make_engine, make_sessionmaker

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "fake-cluster-token"
LEASE = "tm:autoscaler:leader"


def _kubeconfig(path: Path, url: str) -> Path:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: {url}
users:
- name: autoscaler
  user:
    token: {TOKEN}
contexts:
- name: fake
  context:
    cluster: fake
    user: autoscaler
    namespace: tokenmill
current-context: fake
"""
    )
    return path


def _wait(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def _seed(url: str) -> str:
    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            model = Model(name="llama-8b", source="store:models/llama-8b", format="hf")
            session.add(model)
            await session.flush()
            dep = Deployment(
                name="Llama 8B", model_id=model.id, min_replicas=2, max_replicas=4, gpu_type="L4"
            )
            session.add(dep)
            await session.flush()
            return dep.id
    finally:
        await engine.dispose()


async def _set(url: str, dep_id: str, **values: object) -> None:
    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            await session.execute(update(Deployment).where(Deployment.id == dep_id).values(**values))
    finally:
        await engine.dispose()


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    server = FakeKubernetes(token=TOKEN).start()
    yield server
    server.stop()


def test_one_leader_acts_and_a_standby_takes_over(
    tmp_path: Path, pg_url: str, redis_url: str, fake: FakeKubernetes
) -> None:
    migrations.upgrade(pg_url)
    dep_id = asyncio.run(_seed(pg_url))
    r = redis.Redis.from_url(redis_url)
    r.delete(LEASE)
    env = {
        **os.environ,
        "DATABASE_URL": pg_url,
        "REDIS_URL": redis_url,
        "TOKENMILL_INTERNAL_TOKEN": "internal-token-for-the-test",
        "TOKENMILL_SECRET_KEY": "secret-key-for-the-test",
        "TOKENMILL_AUTOSCALER": "kubernetes",
        "TOKENMILL_AUTOSCALE_INTERVAL_SECONDS": "0.5",
        "TOKENMILL_KUBERNETES_NAMESPACE": "tokenmill",
        "TOKENMILL_WORKER_IMAGE": "registry.example/tokenmill-worker:1.2.3",
        "TOKENMILL_HOME": str(tmp_path / "home"),
        "KUBECONFIG": str(_kubeconfig(tmp_path / "kubeconfig", fake.url)),
    }
    logs: dict[int, list[str]] = {}
    procs = []
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "autoscaler", "--port", "0"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = logs[proc.pid] = []
        threading.Thread(target=lambda p=proc, out=lines: out.extend(p.stdout), daemon=True).start()
        procs.append(proc)
    try:
        path = "/apis/apps/v1/namespaces/tokenmill/deployments"
        _wait("the worker Deployment", lambda: ("tokenmill", "tm-worker-llama-8b") in fake.deployments)
        time.sleep(2)  # both reconcilers have ticked several times meanwhile
        creates = [c for c in fake.calls if c.method == "POST" and c.path == path]
        assert len(creates) == 1, "only the leader acts"
        body = creates[0].body
        assert body["spec"]["replicas"] == 2
        container = body["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "registry.example/tokenmill-worker:1.2.3"
        assert container["args"] == ["worker", "--model", "store:models/llama-8b"]
        assert all(c.authorization == f"Bearer {TOKEN}" for c in fake.calls)

        holder = r.get(LEASE)
        assert holder is not None
        leader = next(p for p in procs if holder.decode().endswith(f"-{p.pid}"))
        standby = next(p for p in procs if p is not leader)
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        killed = len(fake.calls)
        asyncio.run(_set(pg_url, dep_id, min_replicas=3))

        scale = f"{path}/tm-worker-llama-8b/scale"
        _wait(
            "the standby to scale to 3",
            lambda: any(c.method == "PATCH" and c.path == scale for c in fake.calls[killed:]),
            timeout=30,
        )
        patch = next(c for c in fake.calls[killed:] if c.method == "PATCH" and c.path == scale)
        assert patch.body == {"spec": {"replicas": 3}}
        assert (r.get(LEASE) or b"").decode().endswith(f"-{standby.pid}")

        # A stopped deployment loses its workers.
        asyncio.run(_set(pg_url, dep_id, status="stopped"))
        _wait(
            "the Deployment's deletion", lambda: ("tokenmill", "tm-worker-llama-8b") not in fake.deployments
        )
        assert standby.poll() is None, "".join(logs[standby.pid])
        # A leader that stops gives the lease up rather than leaving it to expire.
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(30) == 0, "".join(logs[standby.pid])
        assert r.get(LEASE) is None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        r.delete(LEASE)
        r.close()
