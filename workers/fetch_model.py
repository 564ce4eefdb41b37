"""`python -m workers.fetch_model SOURCE LINK`: put a model into the model cache, link it at LINK.

The first init container of a vLLM worker pod (autoscaler/kubernetes.py) runs it with the
worker image. vLLM's own image cannot read our object storage, convert a GGUF or see a path
inside the worker image, so this resolves the source exactly as a builtin worker does
(`tokenmill.modelstore.resolve_model` into TOKENMILL_MODEL_CACHE) and links the directory at
LINK, which vLLM, mounting the same volume, gets as its `--model`. A source that resolves to a
directory outside the cache (a path, or a bundled HF directory, in the worker image) is copied
into the cache first. The worker container that starts later resolves the same source from the
same cache, at the cost of one listing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from tokenmill import logs
from tokenmill.modelstore import model_name, resolve_model
from tokenmill.settings import Settings
from tokenmill.storage import open_storage

LOCAL_COPIES = "local"  # cache_dir/local/<name>: copies of directories from outside the cache


def fetch_model(source: str, link: Path, settings: Settings) -> Path:
    """The model's HF directory inside the cache; `link` points at it afterwards."""
    cache = settings.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(source, cache, storage=lambda: open_storage(settings))
    if not model_dir.resolve().is_relative_to(cache.resolve()):
        model_dir = _copy_into(model_dir, cache / LOCAL_COPIES / model_name(source))
    _link(link, model_dir)
    return model_dir


def _copy_into(source: Path, target: Path) -> Path:
    """A complete copy at `target`: built beside it and renamed, so a copy cut short is never
    taken for the model by vLLM."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, symlinks=False)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def _link(link: Path, target: Path) -> None:
    # Relative, so that it resolves wherever a container mounts the volume; replaced in one
    # rename, so a restarted init container never leaves vLLM without a model.
    link.parent.mkdir(parents=True, exist_ok=True)
    pending = link.with_name(f".{link.name}.new")
    pending.unlink(missing_ok=True)
    pending.symlink_to(os.path.relpath(target, link.parent), target_is_directory=True)
    pending.replace(link)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.fetch_model", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="model source: bundled:<name>, store:<key prefix>, a path")
    parser.add_argument("link", type=Path, help="symlink to create (in the model cache volume)")
    args = parser.parse_args(argv)
    settings = Settings()
    logs.configure(settings.log_level, settings.log_format)
    try:
        model_dir = fetch_model(args.source, args.link, settings)
    except (OSError, ValueError) as exc:
        # A missing object or a bad source: one line in the container's log, not a traceback.
        print(f"cannot fetch model {args.source}: {exc}", file=sys.stderr)
        return 1
    print(f"{args.link} -> {model_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
