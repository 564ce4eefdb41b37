"""Object storage for weights and adapter files: a local directory or an S3 bucket.

One small, synchronous interface (boto3 is synchronous; async callers use
`asyncio.to_thread`). Keys are relative POSIX paths such as
`adapters/org_x/adapter_y/adapter_model.safetensors`; the same key means the same object
on every backend, so a worker given the storage URL finds what the control plane stored.

`open_storage(settings)` picks the backend from `TOKENMILL_STORAGE_URL`:
`file:///path` (or unset: `TOKENMILL_HOME/storage`) or `s3://bucket/prefix`, with
`TOKENMILL_S3_ENDPOINT_URL` for S3-compatible servers (MinIO, Ceph, moto). S3 credentials
come from boto3's usual chain (environment, shared config, instance role), never from
our settings.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    from tokenmill.settings import Settings

CHUNK = 1 << 20  # bytes per read when streaming
# Temporary files of unfinished local writes start with this; listings skip them.
_PARTIAL = ".tm-partial-"


class ObjectNotFound(FileNotFoundError):
    """No object under this key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no object {key!r} in storage")
        self.key = key


@dataclass(frozen=True)
class ObjectInfo:
    """One object as a listing sees it. `etag` changes whenever the object is replaced
    (S3's ETag; for local files, inode, size and mtime), so a copy can be checked for
    freshness without reading the object."""

    key: str
    size: int
    etag: str


def check_key(key: str) -> str:
    """`key` if it is a clean relative path, else ValueError. Keeps local keys inside the
    root ("..", absolute paths) and S3 keys unambiguous (empty segments, backslashes)."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid storage key {key!r}")
    parts = key.split("/")
    if any(p in ("", ".", "..") or p.startswith(_PARTIAL) for p in parts):
        raise ValueError(f"invalid storage key {key!r}")
    return key


class Storage(ABC):
    """Blobs by key. `put` streams from a file object; `open` streams back out."""

    @property
    @abstractmethod
    def url(self) -> str:
        """Where this storage lives (`file:///...` or `s3://bucket/prefix`)."""

    def uri(self, key: str) -> str:
        """A full address of one object, for people and logs."""
        return f"{self.url.rstrip('/')}/{check_key(key)}"

    @abstractmethod
    def put(self, key: str, data: bytes | IO[bytes]) -> int:
        """Store `data` (bytes, or a binary file object read from its current position to
        the end) under `key`, replacing any object there; returns the size in bytes.
        Readers never see a half-written object."""

    @abstractmethod
    def open(self, key: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A context manager giving a binary stream of the object (ObjectNotFound if none)."""

    def get(self, key: str) -> bytes:
        """The whole object (for small objects; stream large ones with `open`)."""
        with self.open(key) as f:
            return f.read()

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        with self.open(key) as f:
            while chunk := f.read(chunk_size):
                yield chunk

    @abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes (ObjectNotFound if none)."""

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; removing a missing object is not an error."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with `prefix` (a plain string prefix, as in S3), in sorted order."""

    @abstractmethod
    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Like `list`, with each object's size and etag."""

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under `prefix`; returns how many. The prefix must be a
        non-empty directory-like key ending in '/', so a slip cannot empty the store."""
        if not prefix.endswith("/"):
            raise ValueError(f"delete_prefix wants a 'directory/' prefix, got {prefix!r}")
        check_key(prefix.rstrip("/"))
        keys = list(self.list(prefix))
        for key in keys:
            self.delete(key)
        return len(keys)


class LocalStorage(Storage):
    """Objects as files under `root` (created on first write)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*PurePosixPath(check_key(key)).parts)

    def put(self, key: str, data: bytes | IO[bytes]) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_PARTIAL, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                if isinstance(data, bytes | bytearray | memoryview):
                    out.write(data)
                else:
                    shutil.copyfileobj(data, out, CHUNK)
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; workers may run as another user
            # Atomic on POSIX: a reader sees the old object or the new one, never a mix.
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return size

    @contextlib.contextmanager
    def open(self, key: str) -> Iterator[IO[bytes]]:
        try:
            f = self._path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key) from None
        with f:
            yield f

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        return path.stat().st_size

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        # Drop directories the object leaves empty, up to the root.
        parent = path.parent
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def list(self, prefix: str = "") -> Iterator[str]:
        if not self.root.is_dir():
            return
        # Walk only the deepest directory the prefix names, not the whole store.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*PurePosixPath(check_key(head)).parts) if head else self.root
        if not start.is_dir():
            return
        found = []
        for dirpath, _dirs, files in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(_PARTIAL):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    found.append(key)
        yield from sorted(found)

    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for key in self.list(prefix):
            try:
                st = self._path(key).stat()
            except FileNotFoundError:  # deleted since the listing
                continue
            # `put` always writes a new file and renames it into place, so a replaced object
            # gets a new inode and mtime; hashing instead would read every weight file.
            yield ObjectInfo(key, st.st_size, f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}")


class S3Storage(Storage):
    """Objects in an S3 bucket (or any S3-compatible server via `endpoint_url`), under
    `prefix`. Extra keyword arguments go to `boto3.client("s3", ...)` (credentials,
    region, config)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        client: Any = None,
        **client_kwargs: Any,
    ) -> None:
        if not bucket:
            raise ValueError("S3 storage needs a bucket name")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        if client is None:
            import boto3  # only S3 deployments pay for importing boto3

            client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region_name, **client_kwargs)
        self.client = client

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _is_missing(self, exc: Exception) -> bool:
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def put(self, key: str, data: bytes | IO[bytes]) -> int:
        import io

        stream: IO[bytes] = io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
        reader = _CountingReader(stream)
        # upload_fileobj switches to a multipart upload for large objects (each part buffered,
        # so memory stays bounded); S3 shows the object only once the upload completes.
        self.client.upload_fileobj(reader, self.bucket, self._key(key))
        return reader.count

    @contextlib.contextmanager
    def open(self, key: str) -> Iterator[IO[bytes]]:
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if self._is_missing(exc):
                raise ObjectNotFound(key) from None
            raise
        body = response["Body"]  # botocore StreamingBody: read(n) streams from the socket
        try:
            yield body
        finally:
            body.close()

    def size(self, key: str) -> int:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if self._is_missing(exc):
                raise ObjectNotFound(key) from None
            raise
        return int(head["ContentLength"])

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
        for page in pages:  # S3 lists in UTF-8 binary order, i.e. sorted
            for obj in page.get("Contents", []):
                yield obj["Key"][strip:]

    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
        for page in pages:
            for obj in page.get("Contents", []):
                yield ObjectInfo(obj["Key"][strip:], int(obj["Size"]), str(obj.get("ETag", "")))


class _CountingReader:
    """The caller's stream as boto3 sees it: read-only, counted, and not closable (boto3
    closes what it uploaded, but the stream belongs to the caller). Without `seek`, boto3
    reads it front to back in parts instead of seeking around in it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.count += len(data)
        return data

    def close(self) -> None:
        pass


def storage_from_url(
    url: str, *, s3_endpoint_url: str | None = None, s3_region: str | None = None
) -> Storage:
    """`file:///path` or a plain path -> LocalStorage; `s3://bucket/prefix` -> S3Storage."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        return S3Storage(
            parsed.netloc, unquote(parsed.path), endpoint_url=s3_endpoint_url, region_name=s3_region
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"storage URL {url!r}: file URLs name a local path (file:///path)")
        return LocalStorage(unquote(parsed.path))
    if parsed.scheme == "":
        return LocalStorage(url)
    raise ValueError(f"storage URL {url!r}: expected file:///path or s3://bucket/prefix")


def open_storage(settings: Settings) -> Storage:
    """The storage the settings name; default a directory under TOKENMILL_HOME."""
    if not settings.storage_url:
        return LocalStorage(settings.home_dir / "storage")
    return storage_from_url(
        settings.storage_url, s3_endpoint_url=settings.s3_endpoint_url, s3_region=settings.s3_region
    )
