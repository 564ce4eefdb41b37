"""The reconciler in the embedded server: real `tokenmill worker` processes (SmolLM2 on the
CPU) started, scaled, replaced and stopped while the openai SDK sends traffic.

The three tests share one server and run in order: a burst scales the chat deployment
from 1 to 3 workers and idleness back to 1 with no failed request (issue 6, acceptance 1);
a worker killed under load costs at most its in-flight requests, as clean errors, and is
replaced (acceptance 2); a serverless deployment idles down to zero workers and the next
request waits out a cold start (acceptance 3). Windows are seconds, not minutes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.serve import MODEL, Server, start_server

pytestmark = pytest.mark.slow

ENV = {
    "TOKENMILL_EMBED_MODEL": "",
    "TOKENMILL_TORCH_THREADS": "1",
    "TOKENMILL_KV_CACHE_GIB": "0.25",
    "TOKENMILL_AUTOSCALE_INTERVAL_SECONDS": "0.5",
    "TOKENMILL_SCHEDULER": "false",
    "TOKENMILL_DEFAULT_REQUESTS_PER_MINUTE": "0",
    "TOKENMILL_DEFAULT_TOKENS_PER_MINUTE": "0",
    "TOKENMILL_DEFAULT_MAX_CONCURRENT": "0",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("autoscale"), model_cache, ENV)
    yield s
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(60)
        except Exception:
            s.proc.kill()
            s.proc.wait()


def admin(server: Server, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    r = httpx.request(
        method,
        f"{server.url}/admin/v1{path}",
        json=body,
        headers={"Authorization": f"Bearer {server.key}"},
        timeout=30,
    )
    assert r.status_code < 300, r.text
    return r.json()


def chat_deployment(server: Server) -> str:
    deployments = admin(server, "GET", "/deployments")
    deployments = deployments.get("data", deployments) if isinstance(deployments, dict) else deployments
    return next(d["id"] for d in deployments if d["name"] == MODEL)


def worker_pids(server: Server) -> list[int]:
    """The server's `tokenmill worker` child processes still running (draining included)."""
    pids = []
    for pid in server.children():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"worker" in cmdline and state != "Z":
            pids.append(pid)
    return pids


def routable(server: Server) -> int:
    """Workers the gateway routes to (live, not draining)."""
    return int(httpx.get(f"{server.url}/health", timeout=5).json().get("workers", 0))


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@dataclass
class Outcome:
    started: float
    ended: float
    error: BaseException | None = None


@dataclass
class Load:
    """`clients` threads sending chat requests back to back until stopped."""

    server: Server
    clients: int
    stream: bool = False
    max_tokens: int = 24
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for i in range(self.clients):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def _run(self, i: int) -> None:
        client = self.server.client()
        n = 0
        while not self._stop.is_set():
            n += 1
            messages = [{"role": "user", "content": f"Client {i}, request {n}: name a colour and a fruit."}]
            outcome = Outcome(time.monotonic(), 0.0)
            try:
                if self.stream:
                    chunks = client.chat.completions.create(
                        model=MODEL,
                        messages=messages,
                        max_tokens=self.max_tokens,
                        stream=True,  # type: ignore[arg-type]
                    )
                    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
                else:
                    reply = client.chat.completions.create(
                        model=MODEL,
                        messages=messages,
                        max_tokens=self.max_tokens,  # type: ignore[arg-type]
                    )
                    assert reply.usage is not None and reply.usage.completion_tokens > 0
            except BaseException as exc:
                outcome.error = exc
            outcome.ended = time.monotonic()
            self.outcomes.append(outcome)

    def failures(self) -> list[BaseException]:
        return [o.error for o in self.outcomes if o.error is not None]


def test_a_burst_scales_to_max_and_idleness_back_to_min_without_failures(server: Server) -> None:
    dep = chat_deployment(server)
    wait_for("the first worker", lambda: routable(server) == 1, 120)
    admin(
        server,
        "PATCH",
        f"/deployments/{dep}",
        {
            "min_replicas": 1,
            "max_replicas": 3,
            "autoscaling": {
                "target_concurrency": 2,
                "stable_window_seconds": 8,
                "panic_window_seconds": 2,
                "scale_down_cooldown_seconds": 4,
            },
        },
    )
    with Load(server, clients=8) as burst:
        took = wait_for("3 routable workers", lambda: routable(server) == 3, 180)
        assert len(worker_pids(server)) == 3
        time.sleep(3)  # all three serve a while
    print(f"scaled 1 -> 3 in {took:.1f}s; {len(burst.outcomes)} burst requests")
    # A trickle keeps going while the fleet shrinks: none of it may fail.
    with Load(server, clients=1) as trickle:
        took = wait_for("scale-down to 1 worker", lambda: len(worker_pids(server)) == 1, 120)
        assert routable(server) == 1
        time.sleep(2)
    print(f"scaled 3 -> 1 in {took:.1f}s; {len(trickle.outcomes)} requests meanwhile")
    assert burst.failures() == [] and trickle.failures() == []
    assert len(burst.outcomes) >= 8 and len(trickle.outcomes) >= 2


def _clean(error: BaseException) -> bool:
    """A failure the client can act on: the gateway's own 503 (as a status or, once the
    stream started, as its error event), never a broken connection or a 500."""
    if isinstance(error, openai.APIStatusError):
        return error.status_code == 503
    return (
        isinstance(error, openai.APIError)
        and not isinstance(error, openai.APIConnectionError)
        and ("worker" in str(error))
    )


def test_a_killed_worker_costs_only_its_inflight_requests_and_is_replaced(server: Server) -> None:
    dep = chat_deployment(server)
    admin(server, "PATCH", f"/deployments/{dep}", {"min_replicas": 2, "max_replicas": 2})
    wait_for("2 routable workers", lambda: routable(server) == 2 and len(worker_pids(server)) == 2, 180)
    with Load(server, clients=4, stream=True, max_tokens=48) as load:
        time.sleep(4)
        victim = worker_pids(server)[0]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(12)
        took = wait_for(
            "a replacement worker",
            lambda: (
                routable(server) == 2 and victim not in worker_pids(server) and len(worker_pids(server)) == 2
            ),
            180,
        )
        time.sleep(2)
    print(f"replaced in {12 + took:.1f}s after the kill; {len(load.outcomes)} requests")
    failures = load.failures()
    assert all(_clean(e) for e in failures), [repr(e) for e in failures]
    # Only requests already running at the kill can fail; later ones go elsewhere at once.
    assert all(o.started < killed for o in load.outcomes if o.error is not None)
    late = [o for o in load.outcomes if o.started >= killed + 3]
    assert late and all(o.error is None for o in late)


def test_an_idle_serverless_deployment_scales_to_zero_and_wakes_on_a_request(server: Server) -> None:
    dep = chat_deployment(server)
    admin(
        server,
        "PATCH",
        f"/deployments/{dep}",
        {
            "min_replicas": 0,
            "max_replicas": 1,
            "autoscaling": {
                "stable_window_seconds": 4,
                "scale_down_cooldown_seconds": 2,
                "scale_to_zero_grace_seconds": 3,
            },
        },
    )
    wait_for("zero workers", lambda: worker_pids(server) == [] and routable(server) == 0, 120)
    # Scaled to zero, the model is still listed, and a request waits for its worker.
    assert MODEL in [m.id for m in server.client().models.list()]
    started = time.monotonic()
    reply = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    cold = time.monotonic() - started
    print(f"cold start answered in {cold:.1f}s")
    assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens > 0
    assert len(worker_pids(server)) == 1 and routable(server) == 1
    assert cold > 1.0  # a worker really had to start (a warm request takes well under that)


def test_a_model_in_object_storage_is_fetched_by_the_worker_the_reconciler_starts(
    server: Server, model_cache: Path
) -> None:
    """The control plane accepts a model whose files are in the object storage; the worker
    the reconciler starts for its deployment fetches them through the storage interface
    (as a worker on another machine would) and serves them."""
    from tokenmill.settings import Settings
    from tokenmill.storage import open_storage

    storage = open_storage(Settings(home=server.home))  # the server's: TOKENMILL_HOME/storage
    converted = model_cache / MODEL  # the bundled model as HF files (config, safetensors...)
    for path in sorted(converted.iterdir()):
        if not path.name.startswith("."):
            with path.open("rb") as f:
                storage.put(f"models/smol-stored/{path.name}", f)
    admin(server, "POST", "/models", {"name": "smol-stored", "source": "store:models/smol-stored"})
    dep = admin(
        server,
        "POST",
        "/deployments",
        {"name": "smol-stored", "model": "smol-stored", "type": "serverless", "min_replicas": 1},
    )
    wait_for("the stored model's worker", lambda: _routable_for(server, "smol-stored"), 180)
    reply = server.client().chat.completions.create(
        model="smol-stored",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    fetched = model_cache / "store" / "models--smol-stored"
    assert (fetched / ".tokenmill-fetched.json").exists()
    assert (fetched / "model.safetensors").stat().st_size == (converted / "model.safetensors").stat().st_size
    admin(server, "PATCH", f"/deployments/{dep['id']}", {"status": "stopped"})


def _routable_for(server: Server, model: str) -> bool:
    """Whether a request for `model` finds a worker now (a short wait is not a cold start)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0, timeout=2)
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    except openai.APITimeoutError:
        return False
    return True
