"""Chained KV block hashes: the one function shared by the engine's prefix cache and the router.

    h_i = H(h_{i-1}, tokens of block i, extra)

`extra` carries the tenant's cache salt and the adapter id, so two tenants (or two adapters)
never map the same tokens to the same hash: they cannot share, or probe, each other's cache.
Chaining makes a block's hash name its whole prefix, so one dict lookup per block finds the
longest cached prefix.

The encoding is unambiguous (every field self-delimiting) and independent of the process and
the machine (fixed little-endian integers, no Python `hash()`), so a gateway replica and a
worker on another host compute the same bytes. Change the encoding only together with
`_PERSON`, so that old and new hashes can never be confused.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

HASH_SIZE = 16  # bytes; 128-bit BLAKE2b: collisions need ~2^64 blocks, and it keeps KV events small
_PERSON = b"tokenmill-kv-v1"  # BLAKE2b personalisation: domain separation from every other use

_ITEM = "i"  # 4-byte signed int; token ids are well below 2^31
assert array(_ITEM).itemsize == 4
_BIG_ENDIAN = sys.byteorder == "big"


def _hasher() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=HASH_SIZE, person=_PERSON)


def _encode_extra(extra: tuple[str | None, ...]) -> bytes:
    # Count, then per item a tag (None vs str) and a length, so ("a", None) != (None, "a") != ("a",).
    parts = [struct.pack("<I", len(extra))]
    for item in extra:
        if item is None:
            parts.append(b"\x00")
        else:
            raw = item.encode()
            parts.append(b"\x01" + struct.pack("<I", len(raw)) + raw)
    return b"".join(parts)


def _encode_parent(parent: bytes | None) -> bytes:
    if parent is None:
        return b"\x00"
    return b"\x01" + struct.pack("<B", len(parent)) + parent


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array(_ITEM, tokens)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def extra_keys(cache_salt: str | None, adapter_id: str | None) -> tuple[str | None, ...]:
    """The `extra` of a request's blocks. Engine and router must both build it here: `()` and
    `(None, None)` hash differently."""
    return (cache_salt, adapter_id)


def block_hash(parent: bytes | None, tokens: Sequence[int], extra: tuple[str | None, ...] = ()) -> bytes:
    """The hash of one block of `tokens` that follows the block hashed `parent` (None: the first)."""
    h = _hasher()
    h.update(_encode_extra(extra))
    h.update(_encode_parent(parent))
    h.update(struct.pack("<I", len(tokens)))
    h.update(_token_bytes(tokens))
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra: tuple[str | None, ...] = (),
    *,
    parent: bytes | None = None,
) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids` (a trailing partial block is ignored).

    `parent` continues a chain: `hash_blocks(ids[k*bs:], bs, extra, parent=hashes[k-1])` equals
    `hash_blocks(ids, bs, extra)[k:]`. Same result as calling `block_hash` block by block, but the
    tokens are packed once and the `extra` prefix is hashed once (hasher copies are cheap).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    base = _hasher()
    base.update(_encode_extra(extra))
    count = struct.pack("<I", block_size)
    data = memoryview(_token_bytes(token_ids[: num_blocks * block_size]))
    step = block_size * 4
    hashes = []
    for start in range(0, num_blocks * step, step):
        h = base.copy()
        h.update(_encode_parent(parent))
        h.update(count)
        h.update(data[start : start + step])
        parent = h.digest()
        hashes.append(parent)
    return hashes
