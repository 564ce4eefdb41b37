"""`tokenmill serve` as a user runs it, for the e2e tests: a subprocess with a home of its own on
a free port, the real workers it starts, driven over HTTP (the official `openai` SDK, httpx).

The one way an e2e module starts a server. Most modules share the session's server (the
`shared_server` fixture in `tests/e2e/conftest.py`); a module that needs other settings, or
stops, kills or restarts its server, starts its own with `start_server(tmp, model_cache, env)`
and tears it down with `Server.close()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

MODEL = "SmolLM2-135M-Instruct"
EMBED_MODEL = "all-MiniLM-L6-v2"
ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 300.0


@dataclass
class Server:
    """A running `tokenmill serve`. `key` is what `client()` sends: the admin key the first start
    printed (the `default` organisation's), or an organisation's own (see `for_org`);
    `admin_key` is always the printed one. `lines` is everything the server (and the workers,
    which share its stdout) printed so far."""

    proc: subprocess.Popen[str]
    url: str
    home: Path
    env: dict[str, str]
    key: str = ""
    admin_key: str = ""
    lines: list[str] = field(default_factory=list)

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, max_retries=0, timeout=120)

    def aclient(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=key or self.key, max_retries=0, timeout=120
        )

    def query(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        """Rows of the server's SQLite database (WAL: readable while the server writes)."""
        with contextlib.closing(sqlite3.connect(self.home / "tokenmill.db")) as db:
            return list(db.execute(sql, args))

    def create_org_key(self, name: str, **key: Any) -> str:
        """A new organisation `name` (unique on this server) and the secret of a key in it;
        `key` adds to the key's body (`role`, `requests_per_minute`, ...; a member by default)."""
        admin = {"authorization": f"Bearer {self.admin_key}"}
        with httpx.Client(base_url=f"{self.url}/admin/v1", headers=admin, timeout=30) as c:
            r = c.post("/organizations", json={"name": name})
            assert r.status_code == 201, r.text
            r = c.post(f"/organizations/{r.json()['id']}/keys", json={"name": name, "role": "member", **key})
            assert r.status_code == 201, r.text
            return str(r.json()["secret"])

    def for_org(self, prefix: str) -> Server:
        """This server seen by a new organisation of its own: its `key` (and so `client()`) is
        a member key of an organisation named `prefix` plus a random suffix. What a module
        sharing a server counts (usage, batches, stored responses) is then its own. The same
        process: never stop or restart a server through such a view."""
        name = f"{prefix}-{secrets.token_hex(3)}"
        return dataclasses.replace(self, key=self.create_org_key(name))

    def children(self) -> list[int]:
        """Pids whose parent is the server (its workers)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == self.proc.pid:
                pids.append(int(stat.parent.name))
        return pids

    def stop(self, sig: int = signal.SIGTERM) -> list[int]:
        """Send `sig` to the server alone and wait for it to exit; its children of before."""
        children = self.children()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        return children

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """The server and the workers it started gone at once, as a crash takes them."""
        children = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        """Teardown: nothing of the server left running, whatever state a test left it in."""
        self.kill()

    def restart(self, extra_env: dict[str, str] | None = None) -> None:
        """Kill the server and its workers, then start it again on the same home and port (its
        keys, batches and ledger are in its database), `extra_env` added to its environment."""
        self.kill()
        self.env.update(extra_env or {})
        self.proc = _spawn(self.env, self.lines)
        self._wait_ready()

    def wait_for_embeddings(self) -> None:
        """Until the embeddings worker answers (`/health` counts the first worker up)."""
        deadline = time.monotonic() + 120
        while True:
            try:
                self.client(self.admin_key).embeddings.create(model=EMBED_MODEL, input="ready?")
                return
            except openai.APIStatusError as exc:
                if exc.status_code != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n" + "\n".join(self.lines))
            # printed by the first start only; a restart keeps the one it had
            self.admin_key = self.admin_key or next((ln for ln in self.lines if ln.startswith("tm-")), "")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2).json()
                if self.admin_key and health.get("workers", 0) >= 1:
                    self.key = self.key or self.admin_key
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise AssertionError("serve did not become ready:\n" + "\n".join(self.lines))


def _spawn(env: dict[str, str], lines: list[str]) -> subprocess.Popen[str]:
    """`tokenmill serve` in `env`, its output appended to `lines` and echoed to stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def pump() -> None:
        assert proc.stdout
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            sys.stderr.write(f"[serve] {line}")

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_env(tmp: Path, model_cache: Path, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment `start_server` runs a server in: this process's, without any database,
    Redis or secret settings (the embedded default: SQLite in the home, in-process bus), with
    its home in `tmp`, a free port, the model cache shared by the session, two torch threads,
    and `extra_env` on top."""
    env = {
        **os.environ,
        "TOKENMILL_HOME": str(tmp / "home"),
        "TOKENMILL_MODEL_CACHE": str(model_cache),
        "TOKENMILL_PORT": str(_free_port()),
        "TOKENMILL_TORCH_THREADS": "2",
        **(extra_env or {}),
    }
    for var in ("DATABASE_URL", "REDIS_URL", "TOKENMILL_INTERNAL_TOKEN", "TOKENMILL_SECRET_KEY"):
        env.pop(var, None)
    return env


def start_server(tmp: Path, model_cache: Path, extra_env: dict[str, str] | None = None) -> Server:
    """Start `tokenmill serve` in `serve_env(tmp, model_cache, extra_env)` and wait until it is
    ready: it printed its admin key and `/health` counts a worker (with the default settings
    the embeddings worker may come later: `Server.wait_for_embeddings`). `extra_env`:
    `{"TOKENMILL_EMBED_MODEL": ""}` for no embeddings worker, a short batch window... The
    caller owns the server: `close()` it.
    """
    env = serve_env(tmp, model_cache, extra_env)
    lines: list[str] = []
    proc = _spawn(env, lines)
    server = Server(proc, f"http://127.0.0.1:{env['TOKENMILL_PORT']}", tmp / "home", env, lines=lines)
    server._wait_ready()
    return server
