"""`python -m workers.fetch_model`: what the first init container of a vLLM pod runs, so that
vLLM's image finds the model in the volume it shares with the worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.settings import Settings
from tokenmill.storage import LocalStorage
from workers.fetch_model import fetch_model

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def stored_model(root: Path) -> LocalStorage:
    storage = LocalStorage(root / "storage")
    storage.put("models/tiny-llama/config.json", json.dumps(CONFIG).encode())
    storage.put("models/tiny-llama/model.safetensors", b"\x00" * 64)
    return storage


def test_a_stored_model_is_fetched_into_the_cache_and_linked(tmp_path: Path) -> None:
    storage = stored_model(tmp_path)
    cache = tmp_path / "cache"
    settings = Settings(home=tmp_path / "home", model_cache=cache, storage_url=storage.url)
    link = cache / ".vllm-model"

    model_dir = fetch_model("store:models/tiny-llama", link, settings)

    assert model_dir.parent == cache / "store"
    assert link.is_symlink() and not os.readlink(link).startswith("/")  # relative: any mount path
    assert json.loads((link / "config.json").read_text()) == CONFIG
    assert (link / "model.safetensors").read_bytes() == b"\x00" * 64

    # A restarted init container: the same directory, the link replaced in place.
    assert fetch_model("store:models/tiny-llama", link, settings) == model_dir
    assert link.resolve() == model_dir.resolve()


def test_a_directory_outside_the_cache_is_copied_into_it(tmp_path: Path) -> None:
    # A path in the worker image: vLLM's container sees only the shared volume.
    outside = tmp_path / "image" / "my-model"
    outside.mkdir(parents=True)
    (outside / "config.json").write_text(json.dumps(CONFIG))
    (outside / "tokenizer.json").write_text("{}")
    cache = tmp_path / "cache"
    settings = Settings(home=tmp_path / "home", model_cache=cache)
    link = cache / ".vllm-model"

    model_dir = fetch_model(str(outside), link, settings)

    assert model_dir == cache / "local" / "my-model"
    assert link.resolve() == model_dir.resolve()
    assert sorted(p.name for p in link.iterdir()) == ["config.json", "tokenizer.json"]
    assert not any(p.name.startswith(".") for p in (cache / "local").iterdir())  # no partial copy left


def test_the_module_runs_as_the_init_container_does(tmp_path: Path) -> None:
    storage = stored_model(tmp_path)
    cache = tmp_path / "cache"
    env = {
        **os.environ,
        "TOKENMILL_HOME": str(tmp_path / "home"),
        "TOKENMILL_MODEL_CACHE": str(cache),
        "TOKENMILL_STORAGE_URL": storage.url,
    }
    command = [sys.executable, "-m", "workers.fetch_model"]

    done = subprocess.run(
        [*command, "store:models/tiny-llama", str(cache / ".vllm-model")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((cache / ".vllm-model" / "config.json").read_text()) == CONFIG

    # Nothing stored under the prefix: one line naming it, exit status 1, no link.
    missing = subprocess.run(
        [*command, "store:models/absent", str(cache / ".other")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1
    assert missing.stderr.startswith("cannot fetch model store:models/absent: ")
    assert "models/absent/" in missing.stderr and "Traceback" not in missing.stderr
    assert not (cache / ".other").exists()


@pytest.mark.parametrize("source", ["bundled:nope", "/no/such/model"])
def test_a_bad_source_is_refused(tmp_path: Path, source: str) -> None:
    settings = Settings(home=tmp_path / "home", model_cache=tmp_path / "cache")
    with pytest.raises((ValueError, FileNotFoundError)):
        fetch_model(source, tmp_path / "cache" / ".vllm-model", settings)
    assert not (tmp_path / "cache" / ".vllm-model").exists()
