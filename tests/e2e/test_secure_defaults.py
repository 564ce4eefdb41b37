"""Secure defaults of `tokenmill serve` as a user runs it (issue 14, acceptance 6): a private
embedded home, `Secure` cookies and HSTS under an https public URL, and X-Forwarded-For
believed from trusted proxies only, through the real server (uvicorn as the CLI configures
it, which must not rewrite the peer itself)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_URL = "https://llm.example.test"
FAILURES = 3  # TOKENMILL_AUTH_FAILURES_PER_MINUTE of the server under test
BAD_KEY = "tm-" + "0" * 48  # well formed, unknown


@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str
    home: Path
    lines: list[str] = field(default_factory=list)

    def after(self, marker: str) -> str:
        """The first non-empty line printed after the one containing `marker`."""
        at = next(i for i, line in enumerate(self.lines) if marker in line)
        return next(line for line in self.lines[at + 1 :] if line.strip())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Served]:
    """`serve --no-worker` on a home an older version left readable (0755, secrets 0644)."""
    home = tmp_path_factory.mktemp("secure") / "home"
    home.mkdir()
    home.chmod(0o755)
    secrets_file = home / "secrets.json"
    secrets_file.write_text(json.dumps({"internal_token": "old-internal", "secret_key": "old-secret"}))
    secrets_file.chmod(0o644)
    port = _free_port()
    env = {
        **os.environ,
        "TOKENMILL_HOME": str(home),
        "TOKENMILL_MODEL_CACHE": str(model_cache),
        "TOKENMILL_PORT": str(port),
        "TOKENMILL_EMBED_MODEL": "",
        "TOKENMILL_PUBLIC_URL": PUBLIC_URL,
        # The proxy is 127.0.0.2. Not 127.0.0.1: uvicorn believes the header from there unless
        # told not to, which is what the untrusted half of the test catches.
        "TOKENMILL_TRUSTED_PROXIES": "127.0.0.2",
        "TOKENMILL_AUTH_FAILURES_PER_MINUTE": str(FAILURES),
    }
    for var in ("DATABASE_URL", "REDIS_URL", "TOKENMILL_INTERNAL_TOKEN", "TOKENMILL_SECRET_KEY"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--no-worker"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = Served(proc, f"http://127.0.0.1:{port}", home)

    def pump() -> None:
        assert proc.stdout
        for line in proc.stdout:
            server.lines.append(line.rstrip("\n"))
            sys.stderr.write(f"[serve] {line}")

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited with {proc.returncode}:\n" + "\n".join(server.lines))
            if any(line.startswith("Tokenmill ") and " serving " in line for line in server.lines):
                try:
                    if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
        else:
            raise AssertionError("serve did not become ready:\n" + "\n".join(server.lines))
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_embedded_home_is_private(served: Served) -> None:
    home = served.home
    assert mode(home) == 0o700  # tightened from 0755
    assert mode(home / "secrets.json") == 0o600  # tightened from 0644
    assert mode(home / "tokenmill.db") == 0o600  # created private, password hashes inside
    for journal in home.glob("tokenmill.db-*"):
        assert mode(journal) == 0o600, journal
    # the secrets it found were kept, not regenerated
    assert json.loads((home / "secrets.json").read_text())["secret_key"] == "old-secret"


def test_cookies_are_secure_and_pages_send_hsts_under_an_https_public_url(served: Served) -> None:
    password = served.after("sign in as admin@tokenmill.local").strip()
    with httpx.Client(base_url=served.url) as c:
        r = c.get("/dashboard/login")
        assert r.status_code == 200
        assert r.headers["strict-transport-security"] == "max-age=31536000"
        csrf_cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("tm_csrf="))
        assert "Secure" in csrf_cookie and "HttpOnly" in csrf_cookie
        token = re.search(r'name="_csrf_token" value="([^"]+)"', r.text)
        assert token
        # A browser sends a Secure cookie only over https; httpx would not send it to an http
        # URL, so it goes by hand (what the proxy in front would pass on).
        cookie = csrf_cookie.split(";", 1)[0]
        r = c.post(
            "/dashboard/login",
            data={"email": "admin@tokenmill.local", "password": password, "_csrf_token": token[1]},
            headers={"cookie": cookie},
        )
        assert r.status_code == 303, r.text
        session = next(h for h in r.headers.get_list("set-cookie") if h.startswith("tm_session="))
        assert "Secure" in session and "HttpOnly" in session and "samesite=lax" in session.lower()
        assert r.headers["strict-transport-security"] == "max-age=31536000"
    # The API is not the dashboard: no HSTS promise is made for it here.
    assert "strict-transport-security" not in httpx.get(f"{served.url}/health").headers


def _bad_key(c: httpx.Client, forwarded: str | None = None) -> int:
    headers = {"authorization": f"Bearer {BAD_KEY}"}
    if forwarded:
        headers["x-forwarded-for"] = forwarded
    return c.get("/v1/models", headers=headers).status_code


def test_forwarded_for_is_believed_from_trusted_proxies_only(served: Served) -> None:
    # 127.0.0.1 is not a trusted proxy: rotating the header buys nothing.
    untrusted = httpx.HTTPTransport(local_address="127.0.0.1")
    with httpx.Client(base_url=served.url, transport=untrusted) as c:
        codes = [_bad_key(c, f"198.51.100.{i}") for i in range(FAILURES + 2)]
    assert codes == [401] * FAILURES + [429] * 2
    # 127.0.0.2 is: each client it names has its own count, and the one that fails too often
    # is throttled while the proxy's other clients are not.
    trusted = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=served.url, transport=trusted) as c:
        assert [_bad_key(c, f"203.0.113.{i}") for i in range(FAILURES + 2)] == [401] * (FAILURES + 2)
        codes = [_bad_key(c, "192.0.2.77") for _ in range(FAILURES + 1)]
        assert codes == [401] * FAILURES + [429]
        # What a client wrote into the header itself (left of what our proxy appended) is not
        # believed: this is 192.0.2.77 again, however it introduces itself.
        assert _bad_key(c, "10.9.9.9, 192.0.2.77") == 429
        assert _bad_key(c, "192.0.2.78") == 401
