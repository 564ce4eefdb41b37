"""The storage interface on both backends: a local directory, and S3 over the real wire
protocol against moto's server (a local S3 on a free port, not a mock of boto3)."""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tokenmill.settings import Settings
from tokenmill.storage import LocalStorage, ObjectNotFound, S3Storage, Storage, open_storage, storage_from_url

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server for this module."""
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def make_bucket(endpoint: str, name: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, **CREDENTIALS)
    client.create_bucket(Bucket=name)


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"tm-{os.urandom(4).hex()}"
    make_bucket(endpoint, bucket)
    return S3Storage(bucket, "some/prefix", endpoint_url=endpoint, region_name=REGION, **CREDENTIALS)


def test_put_get_size_exists_delete(storage: Storage) -> None:
    assert not storage.exists("a/b.txt")
    assert storage.put("a/b.txt", b"hello") == 5
    assert storage.exists("a/b.txt")
    assert storage.get("a/b.txt") == b"hello"
    assert storage.size("a/b.txt") == 5
    assert storage.put("a/b.txt", b"replaced!") == 9  # a put replaces
    assert storage.get("a/b.txt") == b"replaced!"
    storage.delete("a/b.txt")
    assert not storage.exists("a/b.txt")
    storage.delete("a/b.txt")  # deleting what is gone is fine


def test_missing_objects_raise_object_not_found(storage: Storage) -> None:
    with pytest.raises(ObjectNotFound):
        storage.get("nope")
    with pytest.raises(ObjectNotFound):
        storage.size("no/such/key")
    with pytest.raises(ObjectNotFound), storage.open("nope"):
        pass


def test_streams_large_objects_in_and_out(storage: Storage) -> None:
    # Larger than boto3's multipart threshold (8 MiB), so S3 goes through a multipart upload.
    blob = os.urandom(9 << 20)
    src = io.BytesIO(b"skip" + blob)
    src.seek(4)  # a put reads from the current position
    assert storage.put("big/weights.bin", src) == len(blob)
    assert storage.size("big/weights.bin") == len(blob)
    chunks = list(storage.iter_chunks("big/weights.bin", chunk_size=1 << 20))
    assert len(chunks) >= 9 and b"".join(chunks) == blob
    with storage.open("big/weights.bin") as f:
        assert f.read(10) == blob[:10]


def test_list_by_prefix_and_delete_prefix(storage: Storage) -> None:
    for key in ("x/1/a", "x/1/b", "x/10/c", "x/2/d", "y/e"):
        storage.put(key, key.encode())
    assert list(storage.list("x/1/")) == ["x/1/a", "x/1/b"]
    assert list(storage.list("x/1")) == ["x/1/a", "x/1/b", "x/10/c"]  # a plain string prefix, as S3
    assert list(storage.list()) == ["x/1/a", "x/1/b", "x/10/c", "x/2/d", "y/e"]
    assert storage.delete_prefix("x/1/") == 2
    assert list(storage.list()) == ["x/10/c", "x/2/d", "y/e"]
    with pytest.raises(ValueError):
        storage.delete_prefix("x")  # not a directory-like prefix: refused, not a wildcard


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "../up", "a//b", "a/./b", "a\\b"])
def test_bad_keys_are_refused(storage: Storage, key: str) -> None:
    with pytest.raises(ValueError):
        storage.put(key, b"x")


def test_local_writes_are_atomic_and_stay_inside_the_root(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    store.put("d/obj", b"one")

    class Failing(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, b: memoryview) -> int:  # type: ignore[override]
            raise OSError("disk on fire")

    with pytest.raises(OSError):
        store.put("d/obj", Failing())
    assert store.get("d/obj") == b"one"  # the failed write left the old object whole
    assert sorted(p.name for p in (tmp_path / "store" / "d").iterdir()) == ["obj"]  # no partial file
    store.delete("d/obj")
    assert not (tmp_path / "store" / "d").exists()  # empty directories go with their last object
    assert (tmp_path / "store").exists()


def test_s3_objects_live_under_the_prefix(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Credentials come from boto3's usual chain (here the environment), never from our settings.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDENTIALS["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIALS["aws_secret_access_key"])
    make_bucket(s3_endpoint, "tm-prefix")
    store = storage_from_url("s3://tm-prefix/base/dir", s3_endpoint_url=s3_endpoint, s3_region=REGION)
    assert isinstance(store, S3Storage) and store.url == "s3://tm-prefix/base/dir"
    store.put("k/v", b"1")
    raw = boto3.client("s3", endpoint_url=s3_endpoint, region_name=REGION, **CREDENTIALS)
    assert [o["Key"] for o in raw.list_objects_v2(Bucket="tm-prefix")["Contents"]] == ["base/dir/k/v"]
    assert store.uri("k/v") == "s3://tm-prefix/base/dir/k/v"


def test_open_storage_follows_the_settings(tmp_path: Path) -> None:
    default = open_storage(Settings(home=tmp_path))
    assert isinstance(default, LocalStorage) and default.root == (tmp_path / "storage").resolve()
    local = open_storage(Settings(home=tmp_path, storage_url=f"file://{tmp_path}/elsewhere"))
    assert isinstance(local, LocalStorage) and local.root == (tmp_path / "elsewhere").resolve()
    s3 = open_storage(
        Settings(
            home=tmp_path, storage_url="s3://bucket/p", s3_endpoint_url="http://127.0.0.1:1", s3_region=REGION
        )
    )
    assert isinstance(s3, S3Storage) and (s3.bucket, s3.prefix) == ("bucket", "p")
    assert s3.client.meta.endpoint_url == "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="expected file"):
        storage_from_url("ftp://host/x")
