"""LocalProcessProvider: workers as `tokenmill worker` subprocesses of this server.

A vllm deployment's worker runs `tokenmill worker ... --engine vllm` with the deployment's
engine arguments as JSON in `TOKENMILL_VLLM_ENGINE_ARGS` (tokenmill/vllm_args.py), from which
it starts its vLLM server."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from autoscaler.providers import WorkerSpec
from tokenmill.vllm_args import ENGINE_ARGS_ENV, encode_engine_args

log = logging.getLogger("tokenmill.autoscaler.local")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGTERM to the worker if this server dies, even by SIGKILL,
    # so no worker outlives the server that started it.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass(slots=True)
class LocalWorker:
    worker_id: str
    deployment_id: str
    process: subprocess.Popen[bytes]
    stopping: bool = False


@dataclass(slots=True)
class LocalProcessProvider:
    """Starts and stops workers on this machine; `env` is passed to every worker.

    A worker process that exits by itself (crashed, killed) stops counting at once, so the
    reconciler's next `scale` starts its replacement. Stopping is SIGTERM (the worker
    drains its in-flight requests) and SIGKILL after `drain_timeout`, in the background.
    """

    name: ClassVar[str] = "local"
    env: dict[str, str]
    drain_timeout: float = 600.0
    workers: dict[str, LocalWorker] = field(default_factory=dict)
    # How `tokenmill` is run: this interpreter's, so workers run the server's code.
    program: tuple[str, ...] = (sys.executable, "-m", "tokenmill.cli")

    def command(
        self,
        deployment_id: str,
        model: str,
        worker_id: str,
        gpu_type: str | None = None,
        *,
        engine: str = "builtin",
        engine_args: Mapping[str, Any] | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        """The command line and environment of one worker."""
        cmd = [
            *self.program, "worker",
            "--model", model,
            "--deployment", deployment_id,
            "--worker-id", worker_id,
            "--exit-with-parent",
        ]  # fmt: skip
        env = {**os.environ, **self.env}
        env.pop(ENGINE_ARGS_ENV, None)  # never this server's own, if it has one
        if gpu_type:
            env["TOKENMILL_GPU_TYPE"] = gpu_type  # its lifetime is billed at this GPU's price
        if engine != "builtin":
            # The worker starts vLLM with these (validated again there, then as flags).
            cmd += ["--engine", engine]
            env[ENGINE_ARGS_ENV] = encode_engine_args(engine_args or {})
        return cmd, env

    def start(
        self,
        deployment_id: str,
        model: str,
        gpu_type: str | None = None,
        *,
        engine: str = "builtin",
        engine_args: Mapping[str, Any] | None = None,
    ) -> LocalWorker:
        worker_id = f"local-{uuid.uuid4().hex[:10]}"
        cmd, env = self.command(
            deployment_id, model, worker_id, gpu_type, engine=engine, engine_args=engine_args
        )
        process = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
        worker = LocalWorker(worker_id, deployment_id, process)
        self.workers[worker_id] = worker
        log.info("started worker %s (pid %d) for %s", worker_id, process.pid, deployment_id)
        return worker

    def _kept(self, deployment_id: str) -> list[LocalWorker]:
        """The deployment's workers that run or start and are not being stopped; reaps
        the ones that exited by themselves."""
        kept = []
        for worker in list(self.workers.values()):
            if worker.process.poll() is not None:
                if not worker.stopping:
                    log.warning("worker %s exited with %s", worker.worker_id, worker.process.returncode)
                del self.workers[worker.worker_id]
            elif worker.deployment_id == deployment_id and not worker.stopping:
                kept.append(worker)
        return kept

    async def scale(self, spec: WorkerSpec, replicas: int, victims: Sequence[str] = ()) -> None:
        kept = self._kept(spec.deployment_id)
        for _ in range(replicas - len(kept)):
            self.start(
                spec.deployment_id,
                spec.model,
                spec.gpu_type,
                engine=spec.engine,
                engine_args=spec.engine_args,
            )
        if len(kept) > replicas:
            rank = {worker_id: i for i, worker_id in enumerate(victims)}
            # Named victims first, in order; then the newest (most likely still loading).
            kept.sort(key=lambda w: (rank.get(w.worker_id, len(rank)), -w.process.pid))
            for worker in kept[: len(kept) - replicas]:
                self._terminate(worker)

    async def replicas(self, deployment_id: str) -> int:
        return len(self._kept(deployment_id))

    async def replace(self, deployment_id: str, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None and worker.process.poll() is None:
            # Silent but alive (hung): it cannot drain what it does not serve.
            log.warning("killing unresponsive worker %s", worker_id)
            worker.stopping = True
            worker.process.kill()

    async def remove(self, deployment_id: str) -> None:
        for worker in self._kept(deployment_id):
            self._terminate(worker)

    async def managed(self) -> list[str]:
        return sorted({w.deployment_id for w in self.workers.values() if not w.stopping})

    async def close(self) -> None:
        await asyncio.to_thread(self.stop_all)

    def _terminate(self, worker: LocalWorker) -> None:
        log.info("stopping worker %s (draining)", worker.worker_id)
        worker.stopping = True
        worker.process.terminate()
        threading.Thread(target=self._reap, args=(worker,), daemon=True).start()

    def _reap(self, worker: LocalWorker) -> None:
        try:
            worker.process.wait(self.drain_timeout)
        except subprocess.TimeoutExpired:
            log.warning("worker %s did not drain in %.0fs; killing it", worker.worker_id, self.drain_timeout)
            worker.process.kill()
            worker.process.wait()

    def stop_all(self, timeout: float = 30.0) -> None:
        """SIGTERM to every worker, then wait for all of them (SIGKILL after `timeout`)."""
        for worker in self.workers.values():
            if worker.process.poll() is None:
                worker.process.terminate()
        deadline = time.monotonic() + timeout
        for worker in list(self.workers.values()):
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %s did not stop in %.0fs; killing it", worker.worker_id, timeout)
                worker.process.kill()
                worker.process.wait()
        self.workers.clear()
