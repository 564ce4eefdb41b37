"""Hostile input against `tokenmill serve` with its real workers (issue 14, points 1 and 2).

While one tenant sends a request built to be expensive, the platform must keep serving
everyone else: `/health` answers within a second, another organisation's short chat
within two, no worker is declared dead and replaced, and the hostile request itself is
refused (4xx, with a message naming what is wrong) within five seconds; a refusal that
burns a core for twenty is itself a denial of service.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.serve import MODEL, Server, start_server

pytestmark = pytest.mark.slow

HEALTH_WITHIN = 1.0
CHAT_WITHIN = 2.0
REFUSED_WITHIN = 5.0


@dataclass
class Tenant:
    org_id: str
    key: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Server]:
    # No embeddings worker: the point is the chat worker and the server's own loop.
    s = start_server(tmp_path_factory.mktemp("hostile"), model_cache, {"TOKENMILL_EMBED_MODEL": ""})
    # The first request loads the gateway's tokenizer and warms the worker: not what is measured.
    warm = httpx.post(
        f"{s.url}/v1/chat/completions",
        json=chat_body("Hello."),
        headers={"authorization": f"Bearer {s.key}"},
        timeout=120,
    )
    assert warm.status_code == 200, warm.text
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


def tenant(server: Server, name: str, role: str = "member", **key_limits: int) -> Tenant:
    admin = {"authorization": f"Bearer {server.key}"}
    with httpx.Client(base_url=server.url, headers=admin, timeout=30) as c:
        r = c.post("/admin/v1/organizations", json={"name": name})
        assert r.status_code == 201, r.text
        org_id = r.json()["id"]
        body = {"name": name, "role": role, **key_limits}
        r = c.post(f"/admin/v1/organizations/{org_id}/keys", json=body)
        assert r.status_code == 201, r.text
        return Tenant(org_id, r.json()["secret"])


def chat_body(content: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


@dataclass
class Watch:
    """Probes `/health` and another organisation's short chat while a hostile request runs."""

    server: Server
    bystander: Tenant
    health: list[float] = field(default_factory=list)
    chats: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _health(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=30) as c:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    ok = c.get("/health").status_code == 200
                except httpx.HTTPError as exc:
                    ok = False
                    self.failures.append(f"/health: {exc!r}")
                self.health.append(time.monotonic() - started)
                if not ok:
                    self.failures.append("/health was not 200")
                time.sleep(0.1)

    def _chat(self) -> None:
        headers = {"authorization": f"Bearer {self.bystander.key}"}
        with httpx.Client(base_url=self.server.url, headers=headers, timeout=60) as c:
            while not self._stop.is_set():
                started = time.monotonic()
                r = c.post("/v1/chat/completions", json=chat_body("Say hello."))
                self.chats.append(time.monotonic() - started)
                if r.status_code != 200:
                    self.failures.append(f"bystander chat: {r.status_code} {r.text[:200]}")
                time.sleep(0.2)

    def __enter__(self) -> Watch:
        self._threads = [threading.Thread(target=t, daemon=True) for t in (self._health, self._chat)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        # Let the probes see the aftermath too: a stall shows as the next answer's delay.
        time.sleep(1.0)
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def check(self) -> None:
        assert not self.failures, self.failures
        assert self.health and self.chats, "the probes never answered"
        assert max(self.health) < HEALTH_WITHIN, f"/health took {max(self.health):.2f}s"
        assert max(self.chats) < CHAT_WITHIN, f"another organisation's chat took {max(self.chats):.2f}s"


def worker_pids(server: Server) -> set[int]:
    return set(server.children())


def send(server: Server, key: str, path: str, body: bytes) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    r = httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=120)
    return r, time.monotonic() - started


def refused(r: httpx.Response, took: float, *words: str) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert took < REFUSED_WITHIN, f"refused after {took:.1f}s"
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def _prose(n_chars: int) -> str:
    words = ("the", "mill", "grinds", "grain", "as", "the", "river", "turns", "its", "wheel", "at", "night")
    out, size, i = [], 0, 0
    while size < n_chars:
        w = words[i % len(words)] + f"{i % 97}"
        out.append(w)
        size += len(w) + 1
        i += 1
    return " ".join(out)[:n_chars]


HOSTILE: dict[str, tuple[Callable[[], bytes], tuple[str, ...]]] = {
    "10 MB prompt": (
        lambda: json.dumps(chat_body(_prose(10 * 1024 * 1024))).encode(),
        ("too large", "bytes"),
    ),
    "200,000 messages": (
        lambda: json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 200_000, "max_tokens": 4}
        ).encode(),
        ("messages", "200000"),
    ),
    "100,000 guided_choice entries": (
        lambda: json.dumps(
            chat_body("Pick one.", guided_choice=[f"choice {i}" for i in range(100_000)])
        ).encode(),
        ("guided_choice",),
    ),
    "40,000 stop strings": (
        lambda: json.dumps(chat_body("Count.", stop=[f"stop-{i}" for i in range(40_000)])).encode(),
        ("stop",),
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_request_is_refused_fast_and_nobody_else_notices(server: Server, name: str) -> None:
    build, words = HOSTILE[name]
    body = build()
    attacker = tenant(server, f"attacker-{len(body)}")
    bystander = tenant(server, f"bystander-{len(body)}")
    pids = worker_pids(server)
    assert pids, "serve runs no worker"
    with Watch(server, bystander) as watch:
        r, took = send(server, attacker.key, "/v1/chat/completions", body)
    refused(r, took, *words)
    watch.check()
    assert worker_pids(server) == pids, "a worker was replaced"


def upload_forever(server: Server, tenant: Tenant, field_bytes: int) -> tuple[int, str, float]:
    """An adapter upload whose `name` field is `field_bytes` long, sent as fast as the server
    reads it until the server answers: (status, error message, seconds until the answer)."""
    boundary = "hostile-boundary"
    head = f'--{boundary}\r\ncontent-disposition: form-data; name="name"\r\n\r\n'.encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        (
            f"POST /admin/v1/organizations/{tenant.org_id}/adapters HTTP/1.1\r\nhost: {host}\r\n"
            f"authorization: Bearer {tenant.key}\r\n"
            f"content-type: multipart/form-data; boundary={boundary}\r\n"
            f"content-length: {len(head) + field_bytes}\r\n\r\n"
        ).encode()
        + head
    )
    answered = threading.Event()

    def pour() -> None:
        chunk = b"a" * (1 << 16)
        sent = 0
        try:
            while sent < field_bytes and not answered.is_set():
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server answered and closed: exactly what should happen
            pass

    started = time.monotonic()
    threading.Thread(target=pour, daemon=True).start()
    sock.settimeout(30)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head_end = data.index(b"\r\n\r\n") + 4
        length = int(re.search(rb"content-length: *(\d+)", data[:head_end], re.IGNORECASE)[1])  # type: ignore[index]
        while len(data) < head_end + length:
            data += sock.recv(65536)
    finally:
        answered.set()
        took = time.monotonic() - started
        sock.close()
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data[head_end : head_end + length])["error"]["message"], took


def test_a_400_mb_multipart_field_is_refused_fast_and_nobody_else_notices(server: Server) -> None:
    attacker = tenant(server, "attacker-upload", role="org_admin")
    bystander = tenant(server, "bystander-upload")
    pids = worker_pids(server)
    with Watch(server, bystander) as watch:
        status, message, took = upload_forever(server, attacker, 400 << 20)
    assert 400 <= status < 500 and took < REFUSED_WITHIN, (status, message, took)
    assert "name" in message and "bytes" in message, message
    watch.check()
    assert worker_pids(server) == pids, "a worker was replaced"


def test_concurrent_over_context_prompts_under_the_body_cap(server: Server) -> None:
    """Size caps alone do not pass this: each body is under the cap, and must still be refused
    without tokenizing a megabyte eight times over on the server's event loop."""
    attacker = tenant(server, "attacker-concurrent")
    bystander = tenant(server, "bystander-concurrent")
    body = json.dumps(chat_body(_prose(1024 * 1024))).encode()
    pids = worker_pids(server)
    results: list[tuple[httpx.Response, float]] = []
    with Watch(server, bystander) as watch:
        threads = [
            threading.Thread(
                target=lambda: results.append(send(server, attacker.key, "/v1/chat/completions", body))
            )
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert len(results) == 8
    for r, took in results:
        refused(r, took, "context length")
        assert r.json()["error"]["code"] == "context_length_exceeded"
    watch.check()
    assert worker_pids(server) == pids, "a worker was replaced"


def test_expensive_refusals_count_against_the_request_limit(server: Server) -> None:
    """A key limited to 2 requests a minute sending 6 over-context prompts: the first two are
    looked at (400), the rest are refused before anything is spent on them (429)."""
    limited = tenant(server, "limited", requests_per_minute=2, request_burst=2)
    body = json.dumps(chat_body(_prose(200_000))).encode()  # ~40k tokens, far over 8192
    statuses = []
    for _ in range(6):
        r, _took = send(server, limited.key, "/v1/chat/completions", body)
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert "retry-after" in r.headers and r.headers["x-ratelimit-limit-requests"] == "2"
    assert statuses == [400, 400, 429, 429, 429, 429]
