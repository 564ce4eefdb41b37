"""One real vLLM server for the whole test run: the CPU build that `make vllm` installs in
.venv-vllm, serving the converted SmolLM2 the way a vLLM worker starts it
(`workers.vllm.server.start_server`: block size, prompt token details, KV events), in fp32
with 1 GiB of KV cache and LoRA adapters enabled.

conftest.py's session fixture `vllm_server` starts it on first use. Starting is the slow part
(model load, and on CPU a torch.compile unless eager): `enforce_eager` skips the compile (LoRA
turns it off on CPU anyway), and vLLM's cache lives in the test model cache, so later runs
reuse whatever it keeps there. A missing .venv-vllm fails the tests that need it, loudly:
`make test` installs it.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from tokenmill.modelstore import model_name, resolve_model
from tokenmill.settings import BUNDLED_MODEL, Settings
from workers.vllm.server import VllmServer, start_server

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".venv-vllm"
MODEL = BUNDLED_MODEL
KV_CACHE_GIB = 1
# vLLM's CPU attention takes blocks of a multiple of 32 tokens only (the default, 16, fails its
# start), so the fleet that runs this server (worker, router, tests' hashes) uses 32.
BLOCK_SIZE = 32
MAX_LORA_RANK = 8
ENGINE_ARGS = {
    "dtype": "float32",  # as our engine runs it, so greedy outputs compare
    "enforce_eager": True,  # no torch.compile: minutes less to start, on a model this small
    "enable_lora": True,
    "max_loras": 1,
    "max_lora_rank": MAX_LORA_RANK,
    "seed": 0,
}


@dataclass(slots=True)
class RunningVllm:
    server: VllmServer
    settings: Settings  # what it was started with (block size, model cache, engine args)
    model_dir: Path
    name: str  # the served model name
    log_path: Path
    start_seconds: float  # from the command to /health answering

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()

    def report(self, lines: int = 60) -> str:
        """What a failed test attaches: the state of vLLM's processes (its session: the API
        server, the engine core, the worker) and the end of its log."""
        process = self.server.process
        states = ""
        if process is not None:
            ps = subprocess.run(
                ["ps", "-s", str(process.pid), "-o", "pid,stat,pcpu,rss,etime,time,comm"],
                capture_output=True,
                text=True,
            )
            states = ps.stdout or ps.stderr
        exited = self.server.exited()
        head = "running" if exited is None else f"exited with {exited}"
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        tail = log.splitlines()[-lines:]
        return f"vLLM {head}\n{states}\n--- {self.log_path} (last {lines} lines)\n" + "\n".join(tail)


def worker_settings(model_cache: Path) -> Settings:
    """A vLLM worker's settings for the test server (nothing from the environment that matters)."""
    return Settings(
        model_cache=model_cache,
        vllm_venv=VLLM_VENV,
        vllm_url=None,
        vllm_command=None,
        vllm_engine_args=json.dumps(ENGINE_ARGS),
        kv_cache_gib=KV_CACHE_GIB,
        block_size=BLOCK_SIZE,
        prefix_caching=True,
        # One core: on a 2-core machine shared with the test process itself, two OpenMP threads
        # spinning at their barriers run vLLM at half the speed of one.
        torch_threads=1,
        max_lora_rank=64,
        heartbeat_seconds=0.2,
    )


def start_test_vllm(model_cache: Path, log_dir: Path) -> RunningVllm:
    if not (VLLM_VENV / ".installed").exists() or not (VLLM_VENV / "bin" / "python").exists():
        pytest.fail(
            f"vLLM's CPU build is not installed in {VLLM_VENV}: run `make vllm` (`make test` does)",
            pytrace=False,
        )
    settings = worker_settings(model_cache)
    model_dir = resolve_model(MODEL, model_cache)
    name = model_name(MODEL)
    log_path = log_dir / "vllm.log"
    log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 (the child writes it until it stops)
    started = time.perf_counter()
    try:
        server = start_server(settings, model_dir, name, log_file=log)
    except Exception as exc:
        pytest.fail(f"the test vLLM server did not start: {exc}", pytrace=False)
    finally:
        log.close()  # the child holds its own descriptor
    return RunningVllm(server, settings, model_dir, name, log_path, time.perf_counter() - started)
