"""vLLM's KV events, restated in our block hashes.

A vLLM server started with `--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": ..., "topic": ...}'` publishes its prefix-cache changes on a
ZMQ PUB socket: multipart messages (topic, 8-byte big-endian sequence number, payload), the
payload a msgpack `KVEventBatch` = [ts, [event, ...], data_parallel_rank] whose events are
maps tagged by `"type"`: BlockStored, BlockRemoved, AllBlocksCleared (vLLM 0.32's
vllm/distributed/kv_events.py). The hashes in them are vLLM's own (sha256 of its own
encoding, or 64-bit ints under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), while our router looks
blocks up by `tokenmill.hashing`'s chained hashes salted with the tenant's cache salt and the
adapter id. So `KvEventMapper` keeps, for every block vLLM holds, vLLM hash -> (our hash,
extra), and computes our hashes from the token ids each BlockStored carries:

- a stored chain whose parent vLLM hash is known extends it, with the parent's extra;
- a chain without a parent starts a prompt: its extra (salt, adapter) comes from the request
  we sent whose first block it is (`note`). vLLM 0.32 also publishes the cache salt of a
  first block (in `extra_keys`), which makes the match exact. Without it (a publisher that
  omits it), requests of several tenants with the same first block are told apart only by
  order: the oldest noted request whose first block is not already cached wins, since vLLM
  schedules first come, first served. A wrong pick there misleads routing (a prefix credited
  to the wrong tenant), never isolation: vLLM's own cache is salted by `cache_salt`.
- anything else (a parent we never mapped, a chunk of another block size, another medium or
  KV cache group, an unknown request) is skipped: a block we cannot name is not guessed.

Memory is bounded: the hash map holds what vLLM's cache holds (removals shrink it, a clear or a
lost batch empties it), and noted requests are forgotten `GRACE` seconds after `done` (vLLM may
publish a request's last blocks after it answered) or, beyond `MAX_NOTED`, oldest first.

All methods run on one event loop (the worker's): no locking.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenmill.hashing import block_hash, extra_keys, hash_blocks
from tokenmill.protocol import GenerateRequest, KvOp

log = logging.getLogger(__name__)

VllmHash = bytes | int  # vLLM's ExternalBlockHash: sha256 bytes, or an int if configured so
Extra = tuple[str | None, ...]

# vLLM's medium of its device cache; events of an offloading tier (CPU, storage) are not what
# the router scores.
_DEVICE_MEDIUM = "GPU"
# KV cache spec kinds that keep every block of a prefix (a sliding window forgets old ones).
_FULL_KINDS = frozenset({"full_attention", "mla_attention"})


# --- vLLM's wire format (mirrored, not imported: our worker image does not bundle vLLM) ----------


class _BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block: (lora name if any, multimodal (id, offset) pairs, cache salt (first
    # block only), prompt-embeds digests), untagged; None where a block has none.
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[VllmHash]
    medium: str | None = None
    group_idx: int | None = None


class _AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


_Event = _BlockStored | _BlockRemoved | _AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    # Raw, decoded one by one: an event type added by a later vLLM skips itself, not the batch.
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Kind(msgspec.Struct):
    type: str = ""


_batch_decoder = msgspec.msgpack.Decoder(_Batch)
_event_decoder = msgspec.msgpack.Decoder(_Event)
_kind_decoder = msgspec.msgpack.Decoder(_Kind)
_KNOWN = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class _Lost(Exception):
    """A batch (or an event of a known kind) could not be read: removals may be missing."""


def decode_batch(payload: bytes) -> list[_BlockStored | _BlockRemoved | _AllBlocksCleared]:
    """The events of one payload. Unknown event types are left out; an unreadable batch or
    known event raises `_Lost`."""
    try:
        batch = _batch_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise _Lost(f"unreadable KV event batch: {exc}") from exc
    events = []
    for raw in batch.events:
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.DecodeError as exc:
            try:
                kind = _kind_decoder.decode(raw).type
            except msgspec.DecodeError:
                kind = ""
            if kind in _KNOWN:
                raise _Lost(f"unreadable {kind} event: {exc}") from exc
            log.debug("skipping KV event of unknown type %r", kind)
    return events


class _Unknown:
    pass


_UNKNOWN: Any = _Unknown()


def _published_salt(event: _BlockStored) -> str | _Unknown | None:
    """The cache salt vLLM published with the first block of `event`: a string, None (the
    request had none), or `_UNKNOWN` (not published, or not readable)."""
    keys = event.extra_keys
    if keys is None or len(keys) != len(event.block_hashes):
        return _UNKNOWN
    items = list(keys[0] or ())
    if event.lora_name is not None:
        if not items or items[0] != event.lora_name:
            return _UNKNOWN
        items = items[1:]
    strings = [item for item in items if isinstance(item, str)]
    if len(strings) > 1:
        return _UNKNOWN
    return strings[0] if strings else None


# --- the mapper --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Noted:
    """A request sent to vLLM, kept to name the first block of the chains it stores."""

    request_id: str
    order: int
    head: tuple[int, ...]  # its first block's tokens (fewer: the whole prompt, if shorter)
    salt: str | None
    adapter: str | None
    extra: Extra
    root: bytes | None  # our hash of its first block (None if the prompt is shorter)
    matched: bool = False  # it already named a chain


def socket_plan(endpoint: str) -> tuple[str, str]:
    """("bind" | "connect", address) for our SUB socket, given vLLM's publisher endpoint as
    passed to `--kv-events-config`. vLLM binds wildcard, ipc and inproc endpoints and connects
    to any other, so we take the other side of the same address."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        host = "[::1]" if "[::]" in endpoint else "127.0.0.1"
        return "connect", endpoint.replace("[::]", host).replace("*", host)
    return "bind", endpoint


class KvEventMapper:
    """Subscribes to one vLLM server's KV events and turns them into our `KvOp`s."""

    GRACE = 60.0  # seconds a finished request stays noted: its last blocks may come after it
    MAX_NOTED = 65_536  # noted requests beyond this are forgotten oldest first
    RETRY = (0.2, 5.0)  # socket re-creation back-off, first and longest (seconds)

    def __init__(self, endpoint: str, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.endpoint = endpoint
        self.block_size = block_size
        self._ops: deque[KvOp] = deque()
        self._blocks: dict[VllmHash, tuple[bytes, Extra]] = {}  # vLLM hash -> (ours, extra)
        # Our hash -> how many vLLM blocks map to it (vLLM keys on more than we do, e.g. a LoRA's
        # path): ours is stored on the first and removed with the last.
        self._refs: dict[bytes, int] = {}
        self._noted: OrderedDict[str, _Noted] = OrderedDict()
        self._by_head: dict[tuple[int, ...], dict[str, _Noted]] = {}  # full first blocks
        self._short: dict[str, _Noted] = {}  # prompts shorter than a block
        self._expiry: deque[tuple[float, str, int]] = deque()  # (forget at, id, order) after done
        self._order = 0
        self._group: int | None = None  # the KV cache group followed (the first full-attention one)
        self.last_seq: int | None = None  # of the last message read, for tests and logs
        self.ready = asyncio.Event()  # set once the socket is bound or connected

    # --- requests ------------------------------------------------------------------------------

    def note(self, req: GenerateRequest) -> None:
        """Remember a request about to be sent to vLLM, to name the chains it stores."""
        self._forget(req.request_id)
        bs = self.block_size
        head = tuple(req.prompt_token_ids[:bs])
        extra = extra_keys(req.cache_salt, req.adapter)
        root = block_hash(None, head, extra) if len(head) == bs else None
        self._order += 1
        noted = _Noted(req.request_id, self._order, head, req.cache_salt, req.adapter, extra, root)
        self._noted[req.request_id] = noted
        if root is not None:
            self._by_head.setdefault(head, {})[req.request_id] = noted
        elif head:
            self._short[req.request_id] = noted
        while len(self._noted) > self.MAX_NOTED:
            self._forget(next(iter(self._noted)))
        self._prune()

    def done(self, request_id: str) -> None:
        """The request ended; it stays noted for `GRACE` seconds for the events still to come."""
        noted = self._noted.get(request_id)
        if noted is not None:
            self._expiry.append((time.monotonic() + self.GRACE, request_id, noted.order))
        self._prune()

    def _prune(self) -> None:
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            _, request_id, order = self._expiry.popleft()
            noted = self._noted.get(request_id)
            if noted is not None and noted.order == order:  # not a later request of the same id
                self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        noted = self._noted.pop(request_id, None)
        if noted is None:
            return
        self._short.pop(request_id, None)
        same = self._by_head.get(noted.head)
        if same is not None:
            same.pop(request_id, None)
            if not same:
                del self._by_head[noted.head]

    # --- output --------------------------------------------------------------------------------

    def drain(self) -> list[KvOp]:
        """Our prefix-cache changes since the last drain, in order."""
        self._prune()
        ops = list(self._ops)
        self._ops.clear()
        return ops

    def _emit(self, op: str, hashes: list[bytes]) -> None:
        if hashes:
            self._ops.append(KvOp(op, [h.hex() for h in hashes]))

    # --- events --------------------------------------------------------------------------------

    def handle(self, frames: list[bytes]) -> None:
        """One multipart message from vLLM's publisher: (topic, seq, payload)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("ignoring a KV event message of %d frames", len(frames))
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last, self.last_seq = self.last_seq, seq
        if last is not None and seq != last + 1:
            # A restarted vLLM starts from 0 with an empty cache; a gap lost batches, maybe
            # removals. Either way what we know may be stale: forget it (routing loses hits, it
            # never counts blocks that are gone).
            log.info("KV event sequence went from %d to %d: forgetting vLLM's cache", last, seq)
            self._clear()
        try:
            events = decode_batch(frames[2])
        except _Lost as exc:
            log.warning("%s; forgetting vLLM's cache", exc)
            self._clear()
            return
        for event in events:
            if isinstance(event, _BlockStored):
                self._stored(event)
            elif isinstance(event, _BlockRemoved):
                self._removed(event)
            else:
                self._clear()

    def _follows(self, group: int | None, medium: str | None) -> bool:
        if medium is not None and medium != _DEVICE_MEDIUM:
            return False
        return group is None or self._group is None or group == self._group

    def _stored(self, event: _BlockStored) -> None:
        bs = self.block_size
        count = len(event.block_hashes)
        if event.kv_cache_spec_kind is not None and event.kv_cache_spec_kind not in _FULL_KINDS:
            return
        if not self._follows(event.group_idx, event.medium):
            return
        # Partial blocks (vLLM caches prompt tails of hybrid models under a finer hash block
        # size) and chunks of another block size do not name one of our blocks.
        if count == 0 or event.block_size != bs or len(event.token_ids) != count * bs:
            return
        if self._group is None and event.group_idx is not None:
            self._group = event.group_idx
        first = event.block_hashes[0]
        if event.parent_block_hash is not None:
            parent = self._blocks.get(event.parent_block_hash)
            if parent is None:
                return
            ours_parent: bytes | None = parent[0]
            extra = parent[1]
        elif first in self._blocks:  # re-reported (vLLM's "full" report mode): same chain
            ours_parent, extra = None, self._blocks[first][1]
        else:
            found = self._match_root(event)
            if found is None:
                return
            ours_parent, extra = None, found
        ours = hash_blocks(event.token_ids, bs, extra, parent=ours_parent)
        new: list[bytes] = []
        for theirs, mine in zip(event.block_hashes, ours, strict=True):
            if theirs in self._blocks:
                continue
            self._blocks[theirs] = (mine, extra)
            refs = self._refs.get(mine, 0)
            self._refs[mine] = refs + 1
            if refs == 0:
                new.append(mine)
        self._emit("stored", new)

    def _match_root(self, event: _BlockStored) -> Extra | None:
        """The extra of the request whose first block `event` stores, or None if unknown."""
        bs = self.block_size
        head = tuple(event.token_ids[:bs])
        candidates = list(self._by_head.get(head, {}).values())
        # A prompt shorter than a block fills its first block with generated tokens.
        candidates += [n for n in self._short.values() if head[: len(n.head)] == n.head]
        candidates = [n for n in candidates if self._same_adapter(n, event)]
        salt = _published_salt(event)
        if salt is not _UNKNOWN:
            # vLLM ignores an empty salt, as it does None.
            candidates = [n for n in candidates if (n.salt or None) == salt]
        if not candidates:
            return None
        if len({n.extra for n in candidates}) > 1:
            # Tenants sharing a first block, and no salt published: first come, first served;
            # a request whose first block is already cached stored nothing new.
            candidates.sort(key=lambda n: (n.root is not None and n.root in self._refs, n.matched, n.order))
        chosen = candidates[0]
        chosen.matched = True
        return chosen.extra

    @staticmethod
    def _same_adapter(noted: _Noted, event: _BlockStored) -> bool:
        # The worker registers each LoRA adapter in vLLM under our adapter id.
        if event.lora_name is not None:
            return noted.adapter == event.lora_name
        if event.lora_id is not None:  # a publisher that gives only vLLM's int id
            return noted.adapter is not None
        return noted.adapter is None

    def _removed(self, event: _BlockRemoved) -> None:
        if not self._follows(event.group_idx, event.medium):
            return
        gone: list[bytes] = []
        for theirs in event.block_hashes:
            entry = self._blocks.pop(theirs, None)
            if entry is None:
                continue
            mine = entry[0]
            refs = self._refs[mine] - 1
            if refs:
                self._refs[mine] = refs
            else:
                del self._refs[mine]
                gone.append(mine)
        self._emit("removed", gone)

    def _clear(self) -> None:
        self._emit("removed", list(self._refs))
        self._blocks.clear()
        self._refs.clear()

    # --- the subscriber ------------------------------------------------------------------------

    async def run(self) -> None:
        """Read vLLM's events until cancelled; a failed socket is re-created after a pause."""
        mode, address = socket_plan(self.endpoint)
        delay = self.RETRY[0]
        while True:
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.SUB)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)  # never drop here: a drop would clear everything
                sock.setsockopt(zmq.SUBSCRIBE, b"")  # the endpoint is this vLLM's alone
                if mode == "bind":
                    sock.bind(address)
                else:
                    sock.connect(address)
                self.ready.set()
                delay = self.RETRY[0]
                while True:
                    frames = await sock.recv_multipart()
                    try:
                        self.handle(frames)
                    except Exception:  # a bug here must not end the subscription
                        log.exception("KV event handling failed; forgetting vLLM's cache")
                        self._clear()
            except zmq.ZMQError as exc:
                log.warning("KV event socket %s %s failed: %s; retrying in %.1fs", mode, address, exc, delay)
            finally:
                self.ready.clear()
                sock.close(linger=0)
                ctx.destroy(linger=0)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.RETRY[1])


__all__ = ["KvEventMapper", "decode_batch", "socket_plan"]
