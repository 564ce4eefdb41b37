"""How an engine process's OpenMP threads wait between parallel regions. Torch-free: it must
be set before torch loads libgomp (bench/engine.py imports it first)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# Spin briefly when a parallel region ends (30k spins: about 0.7 ms on a 2-core Xeon), then
# sleep. libgomp's default is to spin for up to ~300k iterations when it believes it has the
# cores to itself, and a child process that only ever ran one team does believe it; on cores
# shared with the server, the gateway and the clients, the spinning thread takes the time the
# step's own thread needs (measured: 24.3 and 24.7 tokens/s spinning, 48.9 and 47.8 passive).
# But sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs a futex wake-up at each of a decode
# step's ~120 matmuls, whose gaps are far shorter: bench/served.py on a 2-core Xeon, in one
# run, 203 tok/s passive, 217 and 227 at 30k spins, 220 at 100k, 211 at 300k.
SPIN = {"GOMP_SPINCOUNT": "30000"}
_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def user_chose() -> bool:
    """Whether the environment already says how OpenMP waits: a user's own setting wins."""
    return any(name in os.environ for name in _USER_SETTINGS)


@contextlib.contextmanager
def spin_env() -> Iterator[None]:
    """SPIN in os.environ while a child is spawned (it reads it as its OpenMP starts), unless
    the user chose; the server's own environment is left as it was."""
    if user_chose():
        yield
        return
    saved = {name: os.environ.get(name) for name in SPIN}
    os.environ.update(SPIN)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
