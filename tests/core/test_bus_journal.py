"""The embedded server's usage events survive a crash: `MemoryBus` with a journal
(`tokenmill.journal`).

A real process publishes usage events, hands some to the billing group, acknowledges part of
them and is SIGKILLed; a new bus on the same directory delivers every event the group had not
acknowledged, under its old id, before anything new, and forgets them once acknowledged.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tokenmill.bus import MemoryBus
from tokenmill.journal import Journal, JournalBusy
from tokenmill.protocol import USAGE, WORKERS

GROUP = "billing-ledger"

# Publishes 10 usage events and one heartbeat, reads 8 into the group, acks the first 3,
# publishes 2 more, prints the ids and waits for its SIGKILL (no close, no cleanup).
_CRASH = """
import asyncio, json, sys
from pathlib import Path
from tokenmill.bus import MemoryBus
from tokenmill.protocol import USAGE, WORKERS

async def main(d: str) -> None:
    bus = MemoryBus(journal_dir=Path(d))
    ids = [await bus.publish(USAGE, {"request_id": f"req-{i}"}) for i in range(10)]
    await bus.publish(WORKERS, {"worker": "w"})
    got = await bus.read_group(USAGE, "billing-ledger", "server-1", count=8)
    await bus.ack(USAGE, "billing-ledger", *[e for e, _ in got[:3]])
    ids += [await bus.publish(USAGE, {"request_id": f"req-{i}"}) for i in (10, 11)]
    print(json.dumps(ids), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1]))
"""


def _crash(journal_dir: Path) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASH, str(journal_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else line
        return msgspec.json.decode(line, type=list[str])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


async def test_a_crashed_servers_unacknowledged_usage_is_delivered_again(tmp_path: Path) -> None:
    ids = _crash(tmp_path)
    bus = MemoryBus(journal_dir=tmp_path)
    try:
        got = await bus.read_group(USAGE, GROUP, "server-2", block=0)
        # The 5 read and not acknowledged, the 4 never read: old ids, in order, data intact.
        assert [e for e, _ in got] == ids[3:]
        assert [msgspec.json.decode(d)["request_id"] for _, d in got] == [f"req-{i}" for i in range(3, 12)]
        assert await bus.read(WORKERS, "0", block=0) == []  # heartbeats are not journaled
        new = await bus.publish(USAGE, {"request_id": "req-12"})
        assert new > ids[-1]
        assert [e for e, _ in await bus.read_group(USAGE, GROUP, "server-2", block=0)] == [new]

        # Acknowledged, they are gone from the file: nothing is delivered twice after that.
        await bus.ack(USAGE, GROUP, *ids[3:], new)
        assert (tmp_path / "tm-usage.journal").stat().st_size == 0
    finally:
        await bus.close()
    again = MemoryBus(journal_dir=tmp_path)
    try:
        assert await again.read_group(USAGE, GROUP, "server-3", block=0) == []
    finally:
        await again.close()


async def test_an_entry_is_kept_until_every_group_has_acknowledged_it(tmp_path: Path) -> None:
    bus = MemoryBus(journal_dir=tmp_path)
    first = await bus.publish(USAGE, {"n": 1})
    second = await bus.publish(USAGE, {"n": 2})
    for group in ("a", "b"):
        assert len(await bus.read_group(USAGE, group, "c", block=0)) == 2
    await bus.ack(USAGE, "a", first, second)
    await bus.ack(USAGE, "b", first)
    await bus.close()

    bus = MemoryBus(journal_dir=tmp_path)
    try:
        assert [e for e, _ in await bus.read_group(USAGE, "b", "c", block=0)] == [second]
    finally:
        await bus.close()


async def test_a_second_bus_on_the_same_journal_runs_without_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = MemoryBus(journal_dir=tmp_path)
    with pytest.raises(JournalBusy):
        Journal(tmp_path / "tm-usage.journal")
    with caplog.at_level(logging.WARNING, logger="tokenmill.bus"):
        second = MemoryBus(journal_dir=tmp_path)
    assert "in use by another server" in caplog.text
    try:
        await second.publish(USAGE, {"n": "second"})  # in its memory only
        kept = await first.publish(USAGE, {"n": "first"})
    finally:
        await second.close()
    await first.close()  # a close is not an acknowledgement: still due
    bus = MemoryBus(journal_dir=tmp_path)
    try:
        assert [e for e, _ in await bus.read_group(USAGE, GROUP, "c", block=0)] == [kept]
    finally:
        await bus.close()


def test_the_journal_is_compacted_and_damaged_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    journal = Journal(path, compact_bytes=2000)
    assert journal.recover() == []
    ids = [f"{1000 + i}-0" for i in range(100)]
    for i, sid in enumerate(ids):
        journal.append(sid, b'{"i":%d}' % i)
    journal.ack("g", {"g"}, ids[:99])
    # Rewritten once it grew past 2000 bytes: only the live entry is left in the file.
    assert path.read_bytes() == b'E 1099-0 {"i":99}\n'
    journal.close()

    with open(path, "ab") as f:  # what a crash of the machine can leave behind
        f.write(b"E 1100-0 {not json\n")
        f.write(b"Z what\n")
        f.write(b"E 11x3-0 {}\n")
        f.write(b'E 1101-0 {"i":101}\n')
        f.write(b'A ["g", "1101-0"]\n')
        f.write(b'E 1102-0 {"i":1')  # cut short
    journal = Journal(path)
    try:
        assert journal.recover() == [("1099-0", b'{"i":99}')]
        assert path.read_bytes() == b'E 1099-0 {"i":99}\n'
    finally:
        journal.close()
