"""LoRA adapter files on the worker's disk: fetched from the object storage where the
control plane put them (`adapters/<org>/<adapter id>/`), reused while they are unchanged.

Applying an adapter is the engine's business; this module only gets the files here.
"""

from __future__ import annotations

from pathlib import Path

from tokenmill.modelstore import fetch_prefix
from tokenmill.storage import Storage

# PEFT's file names, as the control plane stores them (control_plane.lora; workers do not
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
