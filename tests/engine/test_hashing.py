"""The one block hash shared by the engine's prefix cache and the gateway's router."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from tokenmill.hashing import HASH_SIZE, block_hash, extra_keys, hash_blocks

BS = 16


def _chain(tokens: list[int], bs: int, extra: tuple[str | None, ...] = ()) -> list[bytes]:
    out: list[bytes] = []
    parent = None
    for i in range(len(tokens) // bs):
        parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], extra)
        out.append(parent)
    return out


def test_hash_blocks_equals_block_by_block_chain() -> None:
    tokens = list(range(1000, 1000 + 5 * BS + 3))
    for extra in [(), ("salt", None), (None, "adapter"), ("salt", "adapter")]:
        hashes = hash_blocks(tokens, BS, extra)
        assert hashes == _chain(tokens, BS, extra)
        assert len(hashes) == 5
        assert all(isinstance(h, bytes) and len(h) == HASH_SIZE for h in hashes)


def test_continuation_with_parent() -> None:
    tokens = list(range(7 * BS))
    full = hash_blocks(tokens, BS, ("s", None))
    tail = hash_blocks(tokens[3 * BS :], BS, ("s", None), parent=full[2])
    assert tail == full[3:]


def test_chaining_same_block_after_different_prefixes() -> None:
    block = list(range(BS))
    a = hash_blocks([1] * BS + block, BS)
    b = hash_blocks([2] * BS + block, BS)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens, different prefix
    # ...and the same prefix gives the same hashes.
    assert hash_blocks([1] * BS + block, BS) == a


def test_salt_and_adapter_change_every_hash() -> None:
    tokens = list(range(4 * BS))
    base = hash_blocks(tokens, BS, (None, None))
    variants = [("tenant-a", None), ("tenant-b", None), (None, "lora-1"), ("tenant-a", "lora-1"), ()]
    seen = {tuple(base)}
    for extra in variants:
        hashes = hash_blocks(tokens, BS, extra)
        assert all(h != b for h, b in zip(hashes, base, strict=True)), extra
        seen.add(tuple(hashes))
    assert len(seen) == len(variants) + 1


def test_extra_encoding_is_unambiguous() -> None:
    tokens = list(range(BS))
    extras = [
        (),
        (None,),
        ("",),
        ("a",),
        ("a", None),
        (None, "a"),
        ("a", ""),
        ("ab",),
        ("a", "b"),
        ("a\x00",),
    ]
    hashes = {block_hash(None, tokens, e) for e in extras}
    assert len(hashes) == len(extras)


def test_extra_keys_is_what_engine_and_router_share() -> None:
    assert extra_keys("salt", "lora") == ("salt", "lora")
    # The pitfall extra_keys exists for: an empty tuple is not the same key as (None, None).
    tokens = list(range(BS))
    assert block_hash(None, tokens, extra_keys(None, None)) != block_hash(None, tokens, ())


def test_token_encoding_is_unambiguous() -> None:
    # Different splits and lengths never collide (length-prefixed, fixed-width tokens).
    assert block_hash(None, [1, 2, 3]) != block_hash(None, [1, 2])
    assert block_hash(None, [0]) != block_hash(None, [])
    assert block_hash(None, [256]) != block_hash(None, [1, 0])
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [1]), [2])
    assert block_hash(None, [5]) != block_hash(b"", [5])


def test_partial_trailing_block_ignored() -> None:
    tokens = list(range(3 * BS))
    assert hash_blocks([*tokens, 7, 8, 9], BS) == hash_blocks(tokens, BS)
    assert hash_blocks(list(range(BS - 1)), BS) == []
    assert hash_blocks([], BS) == []
    with pytest.raises(ValueError):
        hash_blocks(tokens, 0)


def test_deterministic_across_processes() -> None:
    # No Python hash(): a fresh interpreter with another hash seed gives the same bytes.
    code = (
        "from tokenmill.hashing import hash_blocks;"
        "print(b''.join(hash_blocks(list(range(100)), 16, ('salt', 'adapter'))).hex())"
    )
    local = b"".join(hash_blocks(list(range(100)), 16, ("salt", "adapter"))).hex()
    for seed in ("1", "2"):
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        assert res.stdout.strip() == local


def test_pinned_value() -> None:
    # Gateways and workers of different releases must agree: changing the encoding must be a
    # deliberate act (bump the personalisation string and this value together).
    assert block_hash(None, [1, 2, 3, 4], ("salt", None)).hex() == "39b0aff1a7242926de375d6da0395e6e"


def test_speed_gateway_hot_path() -> None:
    tokens = [random.Random(0).randrange(49152) for _ in range(2000)]
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        hash_blocks(tokens, BS, ("tenant-salt", "adapter"))
        best = min(best, time.perf_counter() - start)
    assert best < 0.002, f"hashing a 2,000-token prompt took {best * 1e3:.2f} ms"
