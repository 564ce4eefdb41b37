"""LocalProcessProvider: workers as `tokenmill worker` subprocesses of this server."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class LocalProcessProvider:
    """Starts and stops workers on this machine; `env` is passed to every worker."""

    env: dict[str, str]
    workers: dict[str, LocalWorker] = field(default_factory=dict)

    def start(self, deployment_id: str, model: str) -> LocalWorker:
        worker_id = f"local-{uuid.uuid4().hex[:10]}"
        cmd = [
            sys.executable, "-m", "tokenmill.cli", "worker",
            "--model", model,
            "--deployment", deployment_id,
            "--worker-id", worker_id,
            "--exit-with-parent",
        ]  # fmt: skip
        process = subprocess.Popen(cmd, env={**os.environ, **self.env}, preexec_fn=_die_with_parent)
        worker = LocalWorker(worker_id, deployment_id, process)
        self.workers[worker_id] = worker
        log.info("started worker %s (pid %d) for %s", worker_id, process.pid, deployment_id)
        return worker

    def stop(self, worker_id: str, timeout: float = 30.0) -> None:
        """SIGTERM (the worker drains its requests), then SIGKILL after `timeout`."""
        worker = self.workers.pop(worker_id, None)
        if worker is None or worker.process.poll() is not None:
            return
        worker.process.terminate()
        try:
            worker.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("worker %s did not stop in %.0fs; killing it", worker_id, timeout)
            worker.process.kill()
            worker.process.wait()

    def stop_all(self, timeout: float = 30.0) -> None:
        for worker in list(self.workers.values()):
            if worker.process.poll() is None:
                worker.process.terminate()
        for worker_id in list(self.workers):
            self.stop(worker_id, timeout)
