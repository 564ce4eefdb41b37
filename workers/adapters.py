"""LoRA adapter files on the worker's disk: fetched from the object storage where the
control plane put them (`adapters/<org>/<adapter id>/`), reused while they are unchanged.

Applying an adapter is the engine's business; this module only gets the files here. A worker
finds an adapter's files from its storage key when the caller gives one (the gateway sends the
key it read from the catalogue with every request naming an adapter), or else by looking for
`adapters/*/<adapter id>/` in the storage (one listing of every stored adapter: the admin
API's `POST /adapters` with only an id). Adapter ids are unique and their files never change
(a new upload is a new id), so the id alone names the weights, which is what the prefix
cache's keys rely on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from tokenmill.modelstore import fetch_prefix
from tokenmill.storage import Storage

log = logging.getLogger(__name__)

# Adapter id (and its storage key, if known) -> local directory with its files; blocking.
FetchAdapter = Callable[[str, str | None], Path]

# PEFT's file names, as the control plane stores them (control_plane.catalog.lora; workers do not
# import the control plane).
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def fetch_adapter(storage: Storage, key_prefix: str, cache_dir: Path) -> Path:
    """Local directory holding the adapter's `adapter_config.json` and
    `adapter_model.safetensors`, fetched from `key_prefix` (the adapter's storage key) into
    `cache_dir`. FileNotFoundError, naming the key, if either file is not stored."""
    directory = fetch_prefix(storage, key_prefix, cache_dir)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            key = f"{key_prefix.strip('/')}/{name}"
            raise FileNotFoundError(f"adapter file {key!r} is missing from {storage.url}")
    return directory


ADAPTERS = "adapters"  # the storage folder the control plane puts adapters under


class AdapterProblem(Exception):
    """Why a worker cannot load, use or unload an adapter, with the HTTP status saying so."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def check_adapter_key(adapter_id: str, key: str) -> str:
    """`key` if it is the storage folder of this adapter (`adapters/<org>/<adapter id>/`):
    a request must not load other files under an adapter's name."""
    parts = key.strip("/").split("/")
    if len(parts) != 3 or parts[0] != ADAPTERS or parts[2] != adapter_id or not parts[1]:
        raise AdapterProblem(
            400, f"adapter key {key!r} is not adapters/<org>/{adapter_id}/", "invalid_adapter_key"
        )
    return "/".join(parts) + "/"


async def fetch_files(fetch: FetchAdapter | None, adapter_id: str, key: str | None) -> Path:
    """The adapter's files on this worker's disk, fetched off the event loop; AdapterProblem
    says why not (404 when storage does not have it, 503 when storage could not be read: another
    worker, or a retry, may do). One rule for both engines' workers."""
    if fetch is None:
        raise AdapterProblem(
            404,
            f"adapter {adapter_id!r} is not loaded and this worker has no adapter storage",
            "adapter_not_found",
        )
    try:
        return await asyncio.to_thread(fetch, adapter_id, key)
    except AdapterProblem:
        raise
    except FileNotFoundError as exc:
        raise AdapterProblem(
            404, f"adapter {adapter_id!r} is not in storage: {exc}", "adapter_not_found"
        ) from exc
    except Exception as exc:  # storage down, network
        log.exception("fetching adapter %s failed", adapter_id)
        raise AdapterProblem(
            503, f"adapter {adapter_id!r} could not be fetched: {exc}", "adapter_unavailable"
        ) from exc


def find_adapter_key(storage: Storage, adapter_id: str) -> str:
    """The storage folder of an adapter known only by its id; FileNotFoundError if none."""
    for key in storage.list(f"{ADAPTERS}/"):
        parts = key.split("/")
        if len(parts) == 4 and parts[2] == adapter_id and parts[3] == CONFIG_FILE:
            return "/".join(parts[:3]) + "/"
    raise FileNotFoundError(f"no adapter {adapter_id!r} under {ADAPTERS}/ in {storage.url}")


class AdapterFetcher:
    """Adapter id (and storage key, if known) -> local directory with its two files. The
    storage is opened on first use, so a worker that never sees an adapter never opens it."""

    def __init__(self, storage: Callable[[], Storage], cache_dir: Path) -> None:
        self._open = storage
        self._storage: Storage | None = None
        self._lock = threading.Lock()  # fetches run in worker threads
        self.cache_dir = cache_dir

    def storage(self) -> Storage:
        with self._lock:
            if self._storage is None:
                self._storage = self._open()
            return self._storage

    def __call__(self, adapter_id: str, key: str | None = None) -> Path:
        storage = self.storage()
        key = check_adapter_key(adapter_id, key) if key else find_adapter_key(storage, adapter_id)
        return fetch_adapter(storage, key, self.cache_dir)
