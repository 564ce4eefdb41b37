"""`store:` model sources and adapter files: fetched from the object storage into the model
cache, on a local directory and on S3 (moto's server), atomically and only when changed."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.control_plane.test_storage import (
    CREDENTIALS,
    REGION,
    make_bucket,
    s3_endpoint,  # noqa: F401 (a fixture: moto's S3 server)
)
from tokenmill import modelstore
from tokenmill.modelstore import FETCH_MANIFEST, MARKER, bundled_path, fetch_prefix, model_name, resolve_model
from tokenmill.storage import LocalStorage, ObjectInfo, S3Storage, Storage
from tokenmill.tokenization import Tokenizer
from workers.adapters import fetch_adapter

PREFIX = "models/m"
FILES = {"config.json": b'{"model_type": "llama"}', "weights.bin": b"w" * 5000, "sub/extra.txt": b"x"}


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"tm-{os.urandom(4).hex()}"
    make_bucket(endpoint, bucket)
    return S3Storage(bucket, "tokenmill", endpoint_url=endpoint, region_name=REGION, **CREDENTIALS)


def count_gets(storage: Storage, monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> list[str]:
    """Keys of every object read from `storage` from now on."""
    keys: list[str] = []
    original = storage.open

    def counting_open(key: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        keys.append(key)
        time.sleep(delay)
        return original(key)

    monkeypatch.setattr(storage, "open", counting_open)
    return keys


def put_all(storage: Storage, prefix: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        storage.put(f"{prefix}/{rel}", data)


def local_files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file() and p.name != FETCH_MANIFEST
    }


def test_names_of_store_sources() -> None:
    assert model_name("store:models/smollm2-135m") == "smollm2-135m"
    assert model_name("store:models/smollm2-135m/") == "smollm2-135m"
    assert model_name("store:models/tiny.Q4.gguf") == "tiny.Q4"


def test_store_source_needs_a_storage(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs an object storage"):
        resolve_model("store:models/m", tmp_path)


def test_list_objects_gives_sizes_and_changing_etags(storage: Storage) -> None:
    storage.put("a/one", b"12345")
    storage.put("a/two", b"")
    storage.put("ab/other", b"x")
    first = list(storage.list_objects("a/"))
    assert [(o.key, o.size) for o in first] == [("a/one", 5), ("a/two", 0)]
    storage.put("a/one", b"54321")
    assert next(storage.list_objects("a/one")).etag != first[0].etag


def test_fetch_once_then_only_what_changed(
    storage: Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_all(storage, PREFIX, FILES)
    storage.put("models/mm/config.json", b"not ours")  # shares the string prefix, not the directory
    gets = count_gets(storage, monkeypatch)
    cache = tmp_path / "cache"

    out = resolve_model(f"store:{PREFIX}", cache, storage=storage)
    assert out == cache / "store" / "models--m"
    assert local_files(out) == FILES and len(gets) == 3

    # Unchanged: one listing, no download (a factory is fine too).
    assert resolve_model(f"store:{PREFIX}/", cache, storage=lambda: storage) == out
    assert len(gets) == 3

    # One object replaced, one added, one deleted: only the two new ones are read.
    storage.put(f"{PREFIX}/weights.bin", b"v2")
    storage.put(f"{PREFIX}/tokenizer.json", b"{}")
    storage.delete(f"{PREFIX}/sub/extra.txt")
    config_inode = (out / "config.json").stat().st_ino
    assert fetch_prefix(storage, PREFIX, cache) == out
    assert sorted(gets[3:]) == [f"{PREFIX}/tokenizer.json", f"{PREFIX}/weights.bin"]
    assert local_files(out) == {
        "config.json": FILES["config.json"],
        "weights.bin": b"v2",
        "tokenizer.json": b"{}",
    }
    assert (out / "config.json").stat().st_ino == config_inode  # taken over, not copied
    assert sorted(p.name for p in (cache / "store").iterdir()) == [".models--m.lock", "models--m"]

    # A file damaged by hand is noticed without reading the storage's objects.
    (out / "weights.bin").write_bytes(b"")
    fetch_prefix(storage, PREFIX, cache)
    assert (out / "weights.bin").read_bytes() == b"v2" and gets[-1] == f"{PREFIX}/weights.bin"


def test_missing_prefix_names_the_key(storage: Storage, tmp_path: Path) -> None:
    storage.put("models/other/config.json", b"{}")
    with pytest.raises(FileNotFoundError, match="models/nope/"):
        resolve_model("store:models/nope", tmp_path, storage=storage)
    with pytest.raises(FileNotFoundError, match="models/nope/"):
        fetch_prefix(storage, "models/nope/", tmp_path)
    assert not (tmp_path / "store" / "models--nope").exists()


class _DiesAfter:
    """A download stream whose connection drops after the first few bytes."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.reads = 0

    def read(self, size: int = -1) -> bytes:
        self.reads += 1
        if self.reads > 1:
            raise ConnectionResetError("connection lost mid-download")
        return self.raw.read(3)


def die_on_nth_get(storage: Storage, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    original = storage.open
    calls: list[str] = []

    @contextlib.contextmanager
    def dying_open(key: str) -> Iterator[IO[bytes]]:
        calls.append(key)
        with original(key) as f:
            yield _DiesAfter(f) if len(calls) == n else f  # type: ignore[misc]

    monkeypatch.setattr(storage, "open", dying_open)


def test_killed_download_leaves_nothing_that_looks_complete(
    storage: Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_all(storage, PREFIX, FILES)
    cache = tmp_path / "cache"
    target = cache / "store" / "models--m"
    with monkeypatch.context() as m:
        die_on_nth_get(storage, m, 2)
        with pytest.raises(ConnectionResetError):
            resolve_model(f"store:{PREFIX}", cache, storage=storage)
    assert sorted(p.name for p in (cache / "store").iterdir()) == [".models--m.lock"]

    # What a hard kill leaves: a partial directory, and a manifest-less directory in place.
    (cache / "store" / ".models--m.partial").mkdir()
    (cache / "store" / ".models--m.partial" / "config.json").write_text("half")
    target.mkdir()
    (target / "config.json").write_text("half")
    assert local_files(fetch_prefix(storage, PREFIX, cache)) == FILES
    assert sorted(p.name for p in (cache / "store").iterdir()) == [".models--m.lock", "models--m"]

    # A failed update keeps the previous complete copy, still trusted as it was.
    old_manifest = (target / FETCH_MANIFEST).read_bytes()
    put_all(storage, PREFIX, {"config.json": b"{}", "weights.bin": b"new weights"})
    with monkeypatch.context() as m:
        die_on_nth_get(storage, m, 2)
        with pytest.raises(ConnectionResetError):
            fetch_prefix(storage, PREFIX, cache)
    assert local_files(target) == FILES and (target / FETCH_MANIFEST).read_bytes() == old_manifest
    assert sorted(p.name for p in (cache / "store").iterdir()) == [".models--m.lock", "models--m"]
    assert local_files(fetch_prefix(storage, PREFIX, cache))["weights.bin"] == b"new weights"


def test_concurrent_fetches_download_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStorage(tmp_path / "store")
    put_all(store, PREFIX, FILES)
    gets = count_gets(store, monkeypatch, delay=0.05)  # slow enough for the others to pile up
    results: list[Path] = []
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            results.append(fetch_prefix(store, PREFIX, tmp_path / "cache"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(results) == 4
    assert sorted(gets) == sorted(f"{PREFIX}/{rel}" for rel in FILES)
    assert local_files(results[0]) == FILES


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the (slow, transformers-based) conversion; records each call's gguf."""
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        (out / "config.json").write_text(json.dumps({"source": gguf.read_text()}))

    monkeypatch.setattr(modelstore, "_convert_gguf", convert)
    return calls


def test_a_stored_gguf_is_converted_once_and_again_when_it_changes(
    storage: Storage, tmp_path: Path, fake_convert: list[Path]
) -> None:
    storage.put("models/tiny/tiny.gguf", b"v1")
    cache = tmp_path / "cache"
    out = resolve_model("store:models/tiny", cache, storage=storage)
    assert out == cache / "tiny" and json.loads((out / "config.json").read_text()) == {"source": "v1"}
    assert fake_convert == [cache / "store" / "models--tiny" / "tiny.gguf"]
    assert resolve_model("store:models/tiny", cache, storage=storage) == out and len(fake_convert) == 1
    storage.put("models/tiny/tiny.gguf", b"v2")
    assert json.loads(
        (resolve_model("store:models/tiny", cache, storage=storage) / "config.json").read_text()
    ) == {"source": "v2"}


def test_fetch_adapter_returns_the_two_files(
    storage: Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = "adapters/org_x/adapter_y/"  # an adapter's storage_key, as the control plane writes it
    config = json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}).encode()
    weights = bytes(range(256)) * 40
    storage.put(prefix + "adapter_config.json", config)
    storage.put(prefix + "adapter_model.safetensors", weights)
    gets = count_gets(storage, monkeypatch)
    out = fetch_adapter(storage, prefix, tmp_path)
    assert (out / "adapter_config.json").read_bytes() == config
    assert (out / "adapter_model.safetensors").read_bytes() == weights
    assert fetch_adapter(storage, prefix, tmp_path) == out and len(gets) == 2

    storage.put("adapters/org_x/adapter_z/adapter_config.json", config)
    with pytest.raises(FileNotFoundError, match=r"adapters/org_x/adapter_z/adapter_model\.safetensors"):
        fetch_adapter(storage, "adapters/org_x/adapter_z", tmp_path)
    with pytest.raises(FileNotFoundError, match="adapters/org_x/gone/"):
        fetch_adapter(storage, "adapters/org_x/gone/", tmp_path)


@pytest.fixture(scope="module")
def bundled_config(model_cache: Path) -> dict[str, object]:
    return json.loads((resolve_model("bundled:smollm2", model_cache) / "config.json").read_text())


@pytest.mark.slow
def test_the_bundled_gguf_served_from_storage(
    storage: Storage,
    tmp_path: Path,
    bundled_config: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gguf = bundled_path("smollm2")
    with gguf.open("rb") as f:
        storage.put(f"models/smollm2-135m/{gguf.name}", f)
    opened: list[Storage] = []

    def factory() -> Storage:
        opened.append(storage)
        return storage

    out = resolve_model("store:models/smollm2-135m", tmp_path / "cache", storage=factory)
    assert opened == [storage]
    assert filecmp.cmp(tmp_path / "cache" / "store" / "models--smollm2-135m" / gguf.name, gguf, shallow=False)
    assert (out / MARKER).exists()
    assert json.loads((out / "config.json").read_text()) == bundled_config
    tok = Tokenizer.from_dir(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode(prompt), skip_special_tokens=False) == prompt

    gets = count_gets(storage, monkeypatch)
    assert resolve_model("store:models/smollm2-135m", tmp_path / "cache", storage=storage) == out
    assert gets == []


def test_fetch_checks_keys_from_the_listing(tmp_path: Path) -> None:
    """A key S3 would accept but that would escape the directory is refused."""

    class Listing(LocalStorage):
        def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
            yield from super().list_objects(prefix)
            yield ObjectInfo(f"{prefix}../escape", 1, "e")

    store = Listing(tmp_path / "store")
    store.put(f"{PREFIX}/config.json", b"{}")
    with pytest.raises(ValueError, match="invalid storage key"):
        fetch_prefix(store, PREFIX, tmp_path / "cache")
