"""vLLM's KV events mapped to our salted block hashes (issue 17, acceptance 1's hash test).

The unit tests feed the subscriber bytes from vLLM's own `ZmqEventPublisher`, run in a
subprocess of .venv-vllm's Python with `KVEventBatch`es built there from vLLM's own event
classes, so the wire format (framing, msgpack, tags) is vLLM's, not our reading of it. The
integration test subscribes to a real vLLM server (the CPU build serving SmolLM2) while it
serves one prompt for two organisations.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.vllm_server import VLLM_VENV, RunningVllm
from tokenmill.hashing import block_hash, extra_keys, hash_blocks
from tokenmill.protocol import GenerateRequest, KvOp
from workers.vllm.kv_events import KvEventMapper, socket_plan

BS = 16
VLLM_PYTHON = VLLM_VENV / "bin" / "python"

# Publishes what the test asks, one JSON command a line; answers "@@ok" (vLLM logs to stdout too).
PUBLISHER = r"""
import json, sys, time
import msgspec
from vllm.distributed.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher,
)

class BlockTouched(msgspec.Struct, tag=True):  # an event type this subscriber does not know
    block_hashes: list[bytes]

def h(x):
    return bytes.fromhex(x) if isinstance(x, str) else x

def event(e):
    kind = e.pop("type")
    if kind == "stored":
        return BlockStored(
            block_hashes=[h(x) for x in e["hashes"]],
            parent_block_hash=None if e["parent"] is None else h(e["parent"]),
            token_ids=e["tokens"], block_size=e["block_size"], lora_id=e["lora_id"],
            medium=e["medium"], lora_name=e["lora_name"],
            extra_keys=None if e["extra_keys"] is None else [
                None if k is None else tuple(k) for k in e["extra_keys"]
            ],
            group_idx=e["group_idx"], kv_cache_spec_kind=e["kind"],
        )
    if kind == "removed":
        return BlockRemoved(block_hashes=[h(x) for x in e["hashes"]], medium="GPU", group_idx=0)
    if kind == "cleared":
        return AllBlocksCleared()
    return BlockTouched(block_hashes=[h(x) for x in e["hashes"]])

pub = None
for line in sys.stdin:
    cmd = json.loads(line)
    if "open" in cmd:
        if pub is not None:
            pub.shutdown()
        pub = ZmqEventPublisher(0, endpoint=cmd["open"], topic="kv")
    elif "events" in cmd:
        pub.publish(KVEventBatch(ts=time.time(), events=[event(e) for e in cmd["events"]]))
    print("@@ok", flush=True)
if pub is not None:
    pub.shutdown()
"""


class Publisher:
    """vLLM's ZMQ publisher in a .venv-vllm subprocess."""

    def __init__(self) -> None:
        if not VLLM_PYTHON.exists():
            pytest.fail(f"vLLM is not installed in {VLLM_VENV}: run `make vllm`", pytrace=False)
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0"}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-c", PUBLISHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.sent = 0  # batches published since the last open: the next one's sequence number

    def _call(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            assert line, f"the publisher exited ({self.proc.poll()})"
            if line.startswith("@@ok"):
                return

    def open(self, endpoint: str) -> None:
        self._call({"open": endpoint})
        self.sent = 0

    def publish(self, *events: dict[str, Any]) -> int:
        self._call({"events": list(events)})
        self.sent += 1
        return self.sent - 1

    async def connect(self, mapper: KvEventMapper, endpoint: str) -> None:
        """Open a publisher on `endpoint` and publish empty batches until the new `mapper` hears
        one (a SUB socket misses what is published before its subscription arrives)."""
        assert mapper.last_seq is None
        self.open(endpoint)
        deadline = time.monotonic() + 30
        while mapper.last_seq is None:
            assert time.monotonic() < deadline, "the subscriber never heard the publisher"
            self.publish()
            await asyncio.sleep(0.05)
        await self.delivered(mapper, self.sent - 1)

    async def delivered(self, mapper: KvEventMapper, seq: int) -> None:
        deadline = time.monotonic() + 10
        while mapper.last_seq is None or mapper.last_seq < seq:
            assert time.monotonic() < deadline, f"batch {seq} never arrived (last {mapper.last_seq})"
            await asyncio.sleep(0.01)

    async def send(self, mapper: KvEventMapper, *events: dict[str, Any]) -> list[KvOp]:
        """Publish one batch, wait until the mapper read it, and return what it drained."""
        await self.delivered(mapper, self.publish(*events))
        return mapper.drain()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stored(
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    *,
    lora_name: str | None = None,
    lora_id: int | None = None,
    extra: list[list[Any] | None] | None = None,
    block_size: int = BS,
    medium: str = "GPU",
    group_idx: int = 0,
    kind: str = "full_attention",
) -> dict[str, Any]:
    return {
        "type": "stored",
        "hashes": hashes,
        "parent": parent,
        "tokens": tokens,
        "lora_name": lora_name,
        "lora_id": lora_id,
        "extra_keys": extra,
        "block_size": block_size,
        "medium": medium,
        "group_idx": group_idx,
        "kind": kind,
    }


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "removed", "hashes": hashes}


def vh(name: str) -> str:
    """A vLLM block hash (opaque to the mapper): 32 bytes, as vLLM's sha256, in hex for JSON."""
    return hashlib.sha256(name.encode()).hexdigest()


def ours(tokens: list[int], salt: str | None, adapter: str | None = None) -> list[str]:
    return [h.hex() for h in hash_blocks(tokens, BS, extra_keys(salt, adapter))]


PROMPT = list(range(100, 100 + 2 * BS + 3))  # two full blocks and a partial one


@pytest.fixture(scope="module")
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


@pytest.fixture
async def mapper(publisher: Publisher, tmp_path: Path) -> AsyncIterator[KvEventMapper]:
    # As workers.vllm.server starts vLLM: an ipc endpoint, which vLLM binds and we connect to.
    endpoint = f"ipc://{tmp_path / 'kv'}"
    m = KvEventMapper(endpoint, BS)
    task = asyncio.create_task(m.run())
    await publisher.connect(m, endpoint)
    assert m.drain() == []  # empty batches say nothing
    yield m
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def note(m: KvEventMapper, rid: str, prompt: list[int], salt: str | None, adapter: str | None = None) -> None:
    m.note(GenerateRequest(request_id=rid, prompt_token_ids=prompt, cache_salt=salt, adapter=adapter))


async def test_two_orgs_same_prompt_map_to_their_salted_hashes(
    publisher: Publisher, mapper: KvEventMapper
) -> None:
    note(mapper, "r-a", PROMPT, "salt_a")
    note(mapper, "r-b", PROMPT, "salt_b")
    tokens = PROMPT[: 2 * BS]
    # vLLM 0.32 publishes each first block's salt: B's chain comes first and still maps to B.
    ops = await publisher.send(
        mapper,
        stored([vh("b1"), vh("b2")], None, tokens, extra=[["salt_b"], None]),
        stored([vh("a1"), vh("a2")], None, tokens, extra=[["salt_a"], None]),
    )
    assert ops == [KvOp("stored", ours(PROMPT, "salt_b")), KvOp("stored", ours(PROMPT, "salt_a"))]
    assert set(ours(PROMPT, "salt_a")).isdisjoint(ours(PROMPT, "salt_b"))


async def test_without_published_salt_first_come_first_served(
    publisher: Publisher, mapper: KvEventMapper
) -> None:
    tokens = PROMPT[: 2 * BS]
    note(mapper, "r1", PROMPT, "salt_a")
    note(mapper, "r2", PROMPT, "salt_a")  # same org again: a cache hit in vLLM, no new root
    note(mapper, "r3", PROMPT, "salt_b")
    ops = await publisher.send(mapper, stored([vh("a1"), vh("a2")], None, tokens))
    assert ops == [KvOp("stored", ours(PROMPT, "salt_a"))]
    # The next new root is not r2's (its first block is cached already) but r3's.
    ops = await publisher.send(mapper, stored([vh("b1"), vh("b2")], None, tokens))
    assert ops == [KvOp("stored", ours(PROMPT, "salt_b"))]


async def test_chains_extend_and_unknown_blocks_are_skipped(
    publisher: Publisher, mapper: KvEventMapper
) -> None:
    note(mapper, "r1", PROMPT, "salt_a")
    first = ours(PROMPT, "salt_a")
    # The first block alone, then the second (its parent known), then a block of generated tokens.
    ops = await publisher.send(mapper, stored([vh("a1")], None, PROMPT[:BS], extra=[["salt_a"]]))
    assert ops == [KvOp("stored", first[:1])]
    ops = await publisher.send(mapper, stored([vh("a2")], vh("a1"), PROMPT[BS : 2 * BS], extra=[None]))
    assert ops == [KvOp("stored", first[1:2])]
    generated = PROMPT[2 * BS :] + [7] * (BS - 3)
    ops = await publisher.send(mapper, stored([vh("a3")], vh("a2"), generated, extra=[None]))
    extra = extra_keys("salt_a", None)
    assert ops == [KvOp("stored", [block_hash(bytes.fromhex(first[1]), generated, extra).hex()])]
    # Skipped: a parent never mapped, a first block no noted request has, a salt no noted request
    # has, another block size, an offloading tier, a sliding-window group, a re-report.
    ops = await publisher.send(
        mapper,
        stored([vh("x2")], vh("x1"), PROMPT[BS : 2 * BS]),
        stored([vh("y1")], None, list(range(5000, 5000 + BS))),
        stored([vh("z1")], None, PROMPT[:BS], extra=[["salt_z"]]),
        stored([vh("w1")], None, PROMPT[:8], block_size=8, extra=[["salt_a"]]),
        stored([vh("c1")], None, PROMPT[:BS], medium="CPU", extra=[["salt_a"]]),
        stored([vh("s1")], None, PROMPT[:BS], group_idx=1, kind="sliding_window", extra=[["salt_a"]]),
        stored([vh("a1")], None, PROMPT[:BS], extra=[["salt_a"]]),
    )
    assert ops == []
    # A child of a skipped block is skipped too.
    assert await publisher.send(mapper, stored([vh("y2")], vh("y1"), PROMPT[BS : 2 * BS])) == []


async def test_removal_and_clear(publisher: Publisher, mapper: KvEventMapper) -> None:
    note(mapper, "r-a", PROMPT, "salt_a")
    note(mapper, "r-b", PROMPT, "salt_b")
    a, b = ours(PROMPT, "salt_a"), ours(PROMPT, "salt_b")
    tokens = PROMPT[: 2 * BS]
    await publisher.send(
        mapper,
        stored([vh("a1"), vh("a2")], None, tokens, extra=[["salt_a"], None]),
        stored([vh("b1"), vh("b2")], None, tokens, extra=[["salt_b"], None]),
    )
    ops = await publisher.send(mapper, removed([vh("a2"), vh("never-stored")]))
    assert ops == [KvOp("removed", [a[1]])]
    assert await publisher.send(mapper, removed([vh("a2")])) == []  # forgotten: no second removal
    ops = await publisher.send(mapper, {"type": "cleared"})
    assert ops == [KvOp("removed", [a[0], b[0], b[1]])]
    assert await publisher.send(mapper, removed([vh("b1")])) == []
    # After a clear vLLM stores anew, under the same hashes: mapped again.
    ops = await publisher.send(mapper, stored([vh("a1"), vh("a2")], None, tokens, extra=[["salt_a"], None]))
    assert ops == [KvOp("stored", a)]


async def test_adapters_and_short_prompts(publisher: Publisher, mapper: KvEventMapper) -> None:
    note(mapper, "base", PROMPT, "salt_a")
    note(mapper, "lora", PROMPT, "salt_a", adapter="ad-1")
    tokens = PROMPT[: 2 * BS]
    # vLLM registers our adapter id as its LoRA name; the name leads the first block's extra keys.
    ops = await publisher.send(
        mapper,
        stored(
            [vh("l1"), vh("l2")],
            None,
            tokens,
            lora_name="ad-1",
            lora_id=1,
            extra=[["ad-1", "salt_a"], ["ad-1"]],
        ),
        stored([vh("a1"), vh("a2")], None, tokens, extra=[["salt_a"], None]),
    )
    assert ops == [KvOp("stored", ours(PROMPT, "salt_a", "ad-1")), KvOp("stored", ours(PROMPT, "salt_a"))]
    # A prompt shorter than a block: its first block fills up with generated tokens.
    short = [9, 8, 7, 6, 5]
    note(mapper, "short", short, "salt_b")
    block = short + [42] * (BS - len(short))
    ops = await publisher.send(mapper, stored([vh("s1")], None, block, extra=[["salt_b"]]))
    assert ops == [KvOp("stored", ours(block, "salt_b"))]


async def test_finished_requests_are_forgotten_after_a_grace(
    publisher: Publisher, mapper: KvEventMapper
) -> None:
    mapper.GRACE = 2.0
    note(mapper, "late", PROMPT, "salt_a")
    mapper.done("late")  # vLLM may publish its blocks after it answered
    ops = await publisher.send(mapper, stored([vh("a1")], None, PROMPT[:BS], extra=[["salt_a"]]))
    assert ops == [KvOp("stored", ours(PROMPT, "salt_a")[:1])]
    note(mapper, "gone", PROMPT, "salt_b")
    mapper.done("gone")
    await asyncio.sleep(2.1)
    assert mapper.drain() == []  # prunes
    assert await publisher.send(mapper, stored([vh("b1")], None, PROMPT[:BS], extra=[["salt_b"]])) == []


async def test_int_hashes_and_unknown_event_types(publisher: Publisher, mapper: KvEventMapper) -> None:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: 64-bit ints instead of bytes.
    note(mapper, "r", PROMPT, "salt_a")
    ops = await publisher.send(
        mapper,
        {"type": "touched", "hashes": [vh("t")]},  # a later vLLM's event type: skipped alone
        stored([2**63 + 5, 17], None, PROMPT[: 2 * BS], extra=[["salt_a"], None]),
    )
    assert ops == [KvOp("stored", ours(PROMPT, "salt_a"))]
    assert await publisher.send(mapper, removed([17])) == [KvOp("removed", ours(PROMPT, "salt_a")[1:])]


async def test_restarted_publisher_clears(
    publisher: Publisher, mapper: KvEventMapper, tmp_path: Path
) -> None:
    note(mapper, "r", PROMPT, "salt_a")
    await publisher.send(
        mapper, stored([vh("a1"), vh("a2")], None, PROMPT[: 2 * BS], extra=[["salt_a"], None])
    )
    # A new publisher (vLLM restarted) numbers from 0 again and holds nothing: all removed.
    publisher.open(f"ipc://{tmp_path / 'kv'}")
    deadline = time.monotonic() + 30
    ops: list[KvOp] = []
    while not ops:
        assert time.monotonic() < deadline, "the subscriber never heard the new publisher"
        publisher.publish()
        await asyncio.sleep(0.05)
        ops = mapper.drain()
    assert ops == [KvOp("removed", ours(PROMPT, "salt_a"))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_tcp_endpoint_binds_and_cancels_cleanly(publisher: Publisher) -> None:
    # vLLM connects to a tcp endpoint with a host: we bind it (and release it on cancel).
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    assert socket_plan(endpoint) == ("bind", endpoint)
    assert socket_plan("tcp://*:5557") == ("connect", "tcp://127.0.0.1:5557")
    for round_ in range(2):
        m = KvEventMapper(endpoint, BS)
        task = asyncio.create_task(m.run())
        await asyncio.wait_for(m.ready.wait(), 5)
        await publisher.connect(m, endpoint)
        note(m, "r", PROMPT, "salt_a")
        ops = await publisher.send(m, stored([vh(f"a{round_}")], None, PROMPT[:BS], extra=[["salt_a"]]))
        assert ops == [KvOp("stored", ours(PROMPT, "salt_a")[:1])]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not m.ready.is_set()


# --- against a real vLLM ------------------------------------------------------------------------


async def _complete(
    http: httpx.AsyncClient, vllm: RunningVllm, prompt: list[int], salt: str
) -> dict[str, Any]:
    body = {"model": vllm.name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
    resp = await http.post(f"{vllm.url}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


@pytest.mark.slow
async def test_real_vllm_publishes_our_hashes_per_organisation(vllm_server: RunningVllm) -> None:
    vllm = vllm_server
    bs = vllm.settings.block_size
    endpoint = vllm.server.kv_events_endpoint
    assert endpoint is not None
    mapper = KvEventMapper(endpoint, bs)
    task = asyncio.create_task(mapper.run())
    rng = random.Random(uuid.uuid4().int)  # a prompt no earlier test left in vLLM's cache
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            # Warm-up requests (not noted: their blocks are not ours to name) until the
            # subscription is through and vLLM's events reach us.
            deadline = time.monotonic() + 60
            while mapper.last_seq is None:
                assert time.monotonic() < deadline, "no KV events from vLLM"
                await _complete(
                    http, vllm, [rng.randrange(100, 10_000) for _ in range(bs)], f"warm_{uuid.uuid4().hex}"
                )
                await asyncio.sleep(0.2)
            assert mapper.drain() == []

            prompt = [rng.randrange(100, 10_000) for _ in range(2 * bs + 5)]
            salts = {org: f"salt_{uuid.uuid4().hex}" for org in ("org_a", "org_b")}
            for org, salt in salts.items():
                mapper.note(GenerateRequest(request_id=org, prompt_token_ids=prompt, cache_salt=salt))
                answer = await _complete(http, vllm, prompt, salt)
                mapper.done(org)
                assert answer["usage"]["prompt_tokens"] == len(prompt)
            expected = {
                org: [h.hex() for h in hash_blocks(prompt, bs, extra_keys(salt, None))]
                for org, salt in salts.items()
            }
            got: list[str] = []
            deadline = time.monotonic() + 30
            while len(got) < 4 and time.monotonic() < deadline:
                for op in mapper.drain():
                    assert op.op == "stored", op
                    got += op.hashes
                await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # Two full blocks per organisation, each in tokenmill.hashing's hashes for its salt.
    assert got == expected["org_a"] + expected["org_b"]
    assert set(expected["org_a"]).isdisjoint(expected["org_b"])
