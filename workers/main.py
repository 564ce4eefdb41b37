"""The worker process: load a model, serve it, and keep the fleet informed.

`tokenmill worker` calls `run_worker`. The worker announces itself on the bus, sends a
heartbeat every `heartbeat_seconds`, drains on SIGTERM/SIGINT (no new connections,
in-flight streams finish) and says goodbye. It never talks to the database.

The model decides the kind of worker: a generative model runs on the engine (and its
prefix-cache changes go out as KV events); an embedding model (a sentence-transformers or
BERT directory, e.g. `bundled:minilm`) runs on the batched encoder and serves /embed.

With `--engine vllm` (TOKENMILL_WORKER_ENGINE) a generative model runs on a vLLM OpenAI
server instead (workers/vllm/): the worker starts it as a child process, or reaches it at
TOKENMILL_VLLM_URL, and is the same worker toward the fleet. Its child is stopped after the
worker has drained; if the child exits first, the worker leaves the fleet and exits with 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import msgspec
import uvicorn

from tokenmill import logs, tracing
from tokenmill.bus import BusConfigError, Publisher, make_publisher
from tokenmill.modelstore import model_name, resolve_model, sampling_defaults
from tokenmill.net import bind, http_address
from tokenmill.protocol import KV, WORKERS, Heartbeat, KvEvents, WorkerAnnounce, WorkerDeparture
from tokenmill.request_limits import RequestLimits
from tokenmill.settings import Settings
from tokenmill.storage import open_storage
from tokenmill.vllm_args import EngineArgError, decode_engine_args
from workers.server import Generator, Load, RecentTtft, Traffic, WorkerInfo, create_app

if TYPE_CHECKING:
    from workers.encoder import EmbedBatcher
    from workers.engine import EngineConfig
    from workers.generator import EngineGenerator
    from workers.vllm.generator import VllmGenerator

log = logging.getLogger(__name__)

# Long enough for a long CPU generation to finish; the platform (Kubernetes grace period,
# `tokenmill serve`) decides how long it really waits before killing us.
GRACEFUL_SHUTDOWN_SECONDS = 600.0
PARENT_POLL_SECONDS = 0.5


class _Stop(Exception):
    """Raised by the early signal handler to abandon model loading."""


class _Server(uvicorn.Server):
    """uvicorn without its signal handling: it re-raises the captured signal on exit,
    which would turn a clean drain into death by SIGTERM. `_serve` installs its own."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.ready.set()


@dataclass(slots=True)
class _Identity:
    worker_id: str
    deployment_id: str | None
    address: str
    model: str


def engine_config(settings: Settings, model_dir: Path) -> EngineConfig:
    """The engine a worker runs, from its settings (bench/engine.py builds the same one)."""
    import torch

    from workers.engine import EngineConfig

    kv_dtype = None if settings.kv_cache_dtype == "auto" else getattr(torch, settings.kv_cache_dtype)
    return EngineConfig(
        model=str(model_dir),
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        # Unset: the engine's default share of the host's memory (workers/engine/kv_cache.py).
        kv_cache_gib=settings.kv_cache_gib,
        kv_prefault_gib=settings.kv_prefault_gib,
        kv_cache_dtype=kv_dtype,
        enable_prefix_caching=settings.prefix_caching,
        scheduling=settings.scheduling,
        num_speculative_tokens=settings.num_speculative_tokens,
        attention_backend=settings.attention_backend,
        max_loras=settings.max_loras,
        max_lora_rank=settings.max_lora_rank,
        max_cpu_loras=settings.max_cpu_loras,
        lora_backend=settings.lora_backend,
        compile_cache=str(settings.cache_dir),  # the CPU kernel is built once, beside the models
    )


def run_worker(
    settings: Settings,
    *,
    model: str,
    deployment_id: str | None,
    host: str,
    port: int,
    worker_id: str | None = None,
    exit_with_parent: bool = False,
) -> int:
    """Run a worker until SIGTERM/SIGINT (or the parent's death); return the exit code."""
    logs.configure(settings.log_level, settings.log_format)
    # httpx logs every request at INFO: one line per heartbeat otherwise.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    parent_pid = os.getppid()  # before the slow load, so a parent dying meanwhile is noticed
    worker_id = worker_id or f"worker-{secrets.token_hex(4)}"
    if not settings.worker_credential:
        # Embedded mode run by hand: share the server's generated secret from HOME.
        log.warning("TOKENMILL_INTERNAL_TOKEN unset; using the one stored under %s", settings.home_dir)
        settings.ensure_secrets()
    # The worker token when there is one (it cannot publish usage), else the internal token.
    token = settings.worker_credential
    if not token:
        raise RuntimeError("no internal token")
    # Configuration errors first, in milliseconds, rather than after loading the model.
    try:
        publisher = make_publisher(settings)
    except BusConfigError as exc:
        log.error("%s", exc)
        return 2
    if settings.worker_engine == "vllm":
        try:
            decode_engine_args(settings.vllm_engine_args)
        except EngineArgError as exc:
            log.error("%s", exc)
            return 2
    try:
        sock = bind(host, port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror)
        return 1

    # Until the event loop takes over, a termination signal just abandons the load.
    def stop_loading(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    previous = {sig: signal.signal(sig, stop_loading) for sig in (signal.SIGTERM, signal.SIGINT)}
    generator: EngineGenerator | VllmGenerator | None = None
    vllm: VllmGenerator | None = None
    embedder: EmbedBatcher | None = None
    backend: EngineGenerator | VllmGenerator | EmbedBatcher
    try:
        name = model_name(model)
        try:
            model_dir = resolve_model(model, settings.cache_dir, storage=lambda: open_storage(settings))
        except (FileNotFoundError, ValueError) as exc:  # a wrong source: say so, no traceback
            log.error("cannot load model %s: %s", model, exc)
            sock.close()
            return 2
        import torch

        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        from workers.encoder import is_embedding_model

        started = time.perf_counter()
        if is_embedding_model(model_dir):
            from workers.encoder import EmbedBatcher, Encoder

            if settings.worker_engine == "vllm":
                log.info("%s is an embedding model: it runs on the built-in encoder, not vLLM", name)
            backend = embedder = EmbedBatcher(Encoder(model_dir))
        elif settings.worker_engine == "vllm":
            from workers.vllm.server import VllmStartError
            from workers.vllm.worker import vllm_generator

            try:
                backend = generator = vllm = vllm_generator(settings, model_dir, name)
            except VllmStartError as exc:
                log.error("%s", exc)
                sock.close()
                return 1
        else:
            from workers.adapters import AdapterFetcher
            from workers.generator import EngineGenerator

            backend = generator = EngineGenerator(
                engine_config(settings, model_dir),
                # Adapters come from the storage the control plane uploaded them to.
                fetch_adapter=AdapterFetcher(lambda: open_storage(settings), settings.cache_dir),
                # The engine steps in a process of its own: HTTP never holds its GIL.
                process=True,
            )
        kind = "embed" if embedder is not None else "generate"
        if settings.worker_engine == "vllm" and embedder is None:
            kind += " on vLLM"
        log.info("loaded %s (%s) from %s in %.1fs", name, kind, model_dir, time.perf_counter() - started)
    except _Stop:
        log.info("stopped while loading")
        sock.close()
        return 0
    except BaseException:
        sock.close()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    bound_port = sock.getsockname()[1]
    advertised = settings.worker_advertise_host or host
    identity = _Identity(worker_id, deployment_id, http_address(advertised, bound_port), name)
    ttft = RecentTtft()
    traffic = Traffic()
    app = create_app(
        generator,
        embedder=embedder,
        ttft=ttft,
        traffic=traffic,
        token=token,
        limits=RequestLimits.from_settings(settings),
        info=WorkerInfo(
            worker_id=worker_id,
            model=name,
            deployment_id=deployment_id,
            sampling=sampling_defaults(model, model_dir) if generator is not None else {},
        ),
    )
    # OTEL_* settings: the gateway's trace goes on through /generate (its `traceparent`).
    traced = tracing.setup("tokenmill-worker", instance=worker_id)
    config = uvicorn.Config(
        tracing.ServerSpans(app, paths=("/generate", "/embed"), remote=True) if traced else app,
        log_config=None,  # keep the process's logging setup
        access_log=False,
        # Never shorter than the longest stream (TOKENMILL_MAX_STREAM_SECONDS) a gateway lets run.
        timeout_graceful_shutdown=max(GRACEFUL_SHUTDOWN_SECONDS, settings.graceful_shutdown_seconds),
    )
    try:
        return asyncio.run(
            _serve(
                _Server(config),
                sock,
                publisher,
                settings,
                identity,
                backend,
                ttft,
                generator,
                parent_pid if exit_with_parent else None,
                background=vllm.run if vllm is not None else None,
                closing=vllm.aclose if vllm is not None else None,
                traffic=traffic,
            )
        )
    finally:
        backend.close()
        sock.close()


async def _serve(
    server: _Server,
    sock: socket.socket,
    publisher: Publisher,
    settings: Settings,
    identity: _Identity,
    load: Load,
    ttft: RecentTtft,
    generator: Generator | None,
    parent_pid: int | None,
    *,
    background: Callable[[], Awaitable[None]] | None = None,
    closing: Callable[[], Awaitable[None]] | None = None,
    traffic: Traffic | None = None,
) -> int:
    """Serve until told to stop; `generator` is None on an embed worker (no KV events).
    `background`: the backend's own work while serving (a vLLM worker's pollers and child
    watch); if it ends, the worker drains and exits with 1. `closing`: awaited at the end."""
    loop = asyncio.get_running_loop()
    draining = asyncio.Event()
    exit_code = 0

    def on_signal(signum: int) -> None:
        if draining.is_set() and signum == signal.SIGINT:
            server.force_exit = True  # second Ctrl+C: stop waiting for in-flight requests
        log.info("received %s: draining", signal.Signals(signum).name)
        draining.set()
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    serving = asyncio.create_task(server.serve(sockets=[sock]))
    ready = asyncio.create_task(server.ready.wait())
    await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED)
    if not server.ready.is_set():
        ready.cancel()
        serving.result()  # startup failed: raise its exception
        log.error("server did not start")
        return 1
    with contextlib.suppress(OSError):  # stderr's reader may be gone (see tokenmill.cli._say)
        line = f"worker {identity.worker_id} ready on {identity.address} model={identity.model}"
        print(line, file=sys.stderr, flush=True)

    tasks = [
        asyncio.create_task(
            _beat(publisher, settings, identity, load, ttft, draining, generator, traffic=traffic)
        )
    ]
    if generator is not None:
        tasks.append(asyncio.create_task(_publish_kv(publisher, settings, identity, generator)))
    if parent_pid is not None:
        tasks.append(asyncio.create_task(_watch_parent(parent_pid, server, draining)))
    if background is not None:

        def backend_ended(task: asyncio.Task[None]) -> None:
            nonlocal exit_code
            if task.cancelled():
                return
            exc = task.exception()
            log.error("the backend stopped (%s): leaving the fleet", exc or "no reason given")
            exit_code = 1
            draining.set()
            server.should_exit = True

        watch = asyncio.create_task(background())
        watch.add_done_callback(backend_ended)
        tasks.append(watch)
    try:
        await serving
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        departure = WorkerDeparture(identity.worker_id, identity.deployment_id, ts=time.time())
        for attempt in range(3):
            if await _publish(publisher, departure, settings, first_failure=attempt == 0):
                break
            await asyncio.sleep(0.5)
        await _close(publisher)
        if closing is not None:
            await closing()
    return exit_code


async def _publish(
    publisher: Publisher,
    event: msgspec.Struct,
    settings: Settings,
    *,
    first_failure: bool,
    stream: str = WORKERS,
) -> bool:
    """Publish on the bus; failures (bus not up yet, network) are logged, never raised."""
    try:
        async with asyncio.timeout(max(settings.heartbeat_seconds, 2.0)):
            await publisher.publish(stream, event)
        return True
    except Exception as exc:
        # Warn once per outage; the next beat retries anyway.
        log.log(
            logging.WARNING if first_failure else logging.DEBUG,
            "publishing %s failed: %s",
            type(event).__name__,
            exc or type(exc).__name__,
        )
        return False


async def _beat(
    publisher: Publisher,
    settings: Settings,
    identity: _Identity,
    load: Load,
    ttft: RecentTtft,
    draining: asyncio.Event,
    generator: Generator | None = None,
    *,
    traffic: Traffic | None = None,
) -> None:
    traffic = traffic or Traffic()
    announced = False
    healthy = True
    while True:
        was_draining = draining.is_set()
        event: msgspec.Struct
        if not announced:
            event = WorkerAnnounce(
                worker_id=identity.worker_id,
                deployment_id=identity.deployment_id,
                address=identity.address,
                model=identity.model,
                capacity=1,
                gpu_type=settings.gpu_type,
                ts=time.time(),
            )
        else:
            event = Heartbeat(
                worker_id=identity.worker_id,
                deployment_id=identity.deployment_id,
                address=identity.address,
                model=identity.model,
                running=load.running,
                waiting=load.waiting,
                kv_usage=load.kv_usage,
                adapters=generator.adapters if generator is not None else [],
                draining=was_draining,
                ts=time.time(),
                ttft_p95=ttft.p95(),
                arrived=traffic.arrived,
                finished=traffic.finished,
            )
        ok = await _publish(publisher, event, settings, first_failure=healthy)
        if ok and not healthy:
            log.info("bus reachable again")
        healthy = ok
        announced = announced or ok
        if announced and not was_draining:
            # Beat early when draining starts, so that gateways stop routing here at once.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(settings.heartbeat_seconds):
                    await draining.wait()
        else:
            await asyncio.sleep(settings.heartbeat_seconds)


KV_INTERVAL = 0.1  # seconds: the router's view of our cache lags by about this much


async def _publish_kv(
    publisher: Publisher, settings: Settings, identity: _Identity, generator: Generator
) -> None:
    """Publish prefix-cache changes in small batches, so gateways route to where a prompt's
    prefix already is. A batch that cannot be published is dropped: the router treats its
    view as a hint, and the next heartbeat-era batches keep it roughly right."""
    healthy = True
    while True:
        await asyncio.sleep(KV_INTERVAL)
        ops = generator.drain_kv_events()
        if not ops:
            continue
        event = KvEvents(identity.worker_id, identity.deployment_id, ops, ts=time.time())
        healthy = await _publish(publisher, event, settings, first_failure=healthy, stream=KV)


async def _watch_parent(parent_pid: int, server: _Server, draining: asyncio.Event) -> None:
    # Polling: there is no portable event for "my parent died" (PR_SET_PDEATHSIG is
    # Linux-only and fires on the parent *thread*'s exit).
    while os.getppid() == parent_pid:  # noqa: ASYNC110
        await asyncio.sleep(PARENT_POLL_SECONDS)
    log.warning("parent process %d is gone: shutting down", parent_pid)
    draining.set()
    server.should_exit = True


async def _close(publisher: Publisher) -> None:
    try:
        await publisher.close()
    except Exception:
        log.debug("closing the publisher failed", exc_info=True)
