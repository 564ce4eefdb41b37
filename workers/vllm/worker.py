"""A vLLM worker's parts, assembled from the settings (`workers.main.run_worker` calls this)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import IO

from tokenmill.settings import Settings
from tokenmill.storage import open_storage
from tokenmill.tokenization import Tokenizer
from workers.adapters import AdapterFetcher
from workers.vllm.generator import VllmGenerator
from workers.vllm.server import VllmServer, attach_server, start_server

log = logging.getLogger(__name__)


def vocab_size(model_dir: Path, tokenizer: Tokenizer) -> int:
    """The model's vocabulary (config.json's, which may exceed the tokenizer's: padded rows)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    for section in (config, config.get("text_config") or {}):
        if isinstance(section.get("vocab_size"), int):
            return int(section["vocab_size"])
    return tokenizer.vocab_size


def adapter_capacity(settings: Settings, server: VllmServer) -> int:
    """Adapters registered with vLLM at once: what it keeps in CPU memory (`max_cpu_loras`,
    vLLM's default: `max_loras`), else the worker's own setting."""
    args = server.engine_args
    if "max_cpu_loras" in args:
        return int(args["max_cpu_loras"])
    if settings.max_cpu_loras is not None:
        return settings.max_cpu_loras
    return 2 * max(1, int(args.get("max_loras", settings.max_loras)))


def open_server(
    settings: Settings, model_dir: Path, name: str, log_file: IO[bytes] | None = None
) -> VllmServer:
    """The vLLM server at TOKENMILL_VLLM_URL, or a child started on `model_dir` as `name`."""
    if settings.vllm_url:
        return attach_server(settings)
    return start_server(settings, model_dir, name, log_file=log_file)


def vllm_generator(
    settings: Settings, model_dir: Path, name: str, *, log_file: IO[bytes] | None = None
) -> VllmGenerator:
    """A generator on a vLLM server that answers (blocks until then; stops the child on failure)."""
    server = open_server(settings, model_dir, name, log_file)
    try:
        tokenizer = Tokenizer.from_dir(model_dir)  # for the worker's own OpenAI endpoints
        kv_events = None
        if server.kv_events_endpoint is not None:
            from workers.vllm.kv_events import KvEventMapper

            kv_events = KvEventMapper(server.kv_events_endpoint, settings.block_size)
        return VllmGenerator(
            server,
            tokenizer,
            vocab_size=vocab_size(model_dir, tokenizer),
            # Adapters come from the storage the control plane uploaded them to.
            fetch_adapter=AdapterFetcher(lambda: open_storage(settings), settings.cache_dir),
            kv_events=kv_events,
            poll_seconds=settings.heartbeat_seconds,
            max_adapters=adapter_capacity(settings, server),
            stream_timeout=settings.max_stream_seconds,
        )
    except BaseException:
        server.stop()
        raise
