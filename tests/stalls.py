"""A watch on the session's event loop. When the loop stops turning for many seconds (a
blocking call on it, a thread holding the GIL, the process starved of CPU), the tests waiting on
it fail much later, as a timeout somewhere else, with nothing said about why: it happened in CI
twice, in the vLLM worker tests, and never here. The watch notes each stall while it lasts, with
every thread's stack, this process's threads' CPU time and the machine's busiest processes; a
failed test's report carries the stalls seen during it (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

TICK = 0.5  # how often the loop notes that it turns
THRESHOLD = 10.0  # silence that counts as a stall


def _thread_cpu() -> str:
    """CPU seconds of each of this process's threads (user + system), busiest first."""
    tick = os.sysconf("SC_CLK_TCK")
    rows = []
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        rows.append(((int(fields[11]) + int(fields[12])) / tick, task.name, name, fields[0]))
    rows.sort(reverse=True)
    return "\n".join(f"  {cpu:9.1f} s  tid {tid} {name} ({state})" for cpu, tid, name, state in rows[:12])


def _busiest() -> str:
    try:
        ps = subprocess.run(
            ["ps", "-eo", "pid,ppid,ni,stat,pcpu,rss,etime,time,args", "--sort=-pcpu"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"  ps failed: {exc}"
    return "\n".join(line[:200] for line in ps.stdout.splitlines()[:15])


def _stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watch itself
        stack = "".join(traceback.format_stack(frame)[-12:])
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n{stack}")
    return "\n".join(parts)


class LoopWatch:
    """Notes stalls of one event loop (`start` on it); `since(t)` returns those after `t`."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._stalls: list[tuple[float, str]] = []  # (start, what was seen), appended by the thread
        self._stop = threading.Event()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        def tick() -> None:
            self._last = time.monotonic()
            if not self._stop.is_set():
                loop.call_later(TICK, tick)

        loop.call_soon(tick)
        threading.Thread(target=self._watch, args=(loop,), name="loop-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        noted = 0.0  # the last tick of the stall already noted
        while not self._stop.wait(1.0):
            if not loop.is_running():  # between async tests, or a sync test: not a stall
                self._last = time.monotonic()
                continue
            last = self._last
            silent = time.monotonic() - last
            if silent < THRESHOLD or last == noted:
                continue
            noted = last
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            text = (
                f"the event loop had not turned for {silent:.0f} s (load {load}); "
                f"threads' CPU time:\n{_thread_cpu()}\nbusiest processes:\n{_busiest()}\n"
                f"stacks:\n{_stacks()}"
            )
            self._stalls.append((last, text))

    def since(self, start: float) -> list[str]:
        return [text for at, text in self._stalls if at >= start]
