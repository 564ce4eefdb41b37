"""`tokenmill serve` as a user runs it: a subprocess, driven by the official openai SDK. On the
shared server of the e2e tests, which the SIGTERM test stops last; the kill test starts its own."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.serve import EMBED_MODEL, MODEL, READY_TIMEOUT, ROOT, Server, serve_env, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(shared_server: Server) -> Server:
    """The session's server as its first start left it: `key` is the admin key it printed."""
    return shared_server


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_first_start_prints_a_working_admin_key_once(server: Server) -> None:
    assert server.key.startswith("tm-") and len(server.key) == 51
    assert sum(server.key in ln for ln in server.lines) == 1
    # only a hash is stored
    db = (server.home / "tokenmill.db").read_bytes()
    assert server.key.encode() not in db and server.key[11:].encode() not in db


def test_list_models(server: Server) -> None:
    assert MODEL in [m.id for m in server.client().models.list()]


def test_chat_answers_paris(server: Server) -> None:
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 10 and reply.usage.completion_tokens > 0


def test_chat_streams_sse_until_done(server: Server) -> None:
    chunks = list(
        server.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=30,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 2 and "Paris" in text
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {server.key}"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "stream": True,
        },
        timeout=120,
    ) as r:
        events = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_openai_sdk_sync_and_async_on_every_endpoint(server: Server) -> None:
    sync = server.client()
    listed = [m.id for m in sync.models.list()]
    assert MODEL in listed and EMBED_MODEL in listed
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    assert sync.chat.completions.create(**chat).choices[0].message.content
    streamed = list(sync.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens > 0
    assert sync.completions.create(model=MODEL, prompt="Once upon", max_tokens=3).choices[0].text
    assert "".join(c.choices[0].text for c in sync.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=3, stream=True
    ) if c.choices)  # fmt: skip
    texts = ["The cat sat on the mat.", "A feline rested on a rug.", "Stock prices fell sharply."]
    emb = sync.embeddings.create(model=EMBED_MODEL, input=texts)
    vecs = [d.embedding for d in emb.data]
    assert len(vecs) == 3 and len(vecs[0]) == 384 and emb.usage.prompt_tokens > 10

    def cos(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))  # unit vectors

    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2])  # meaning, not just bytes
    # base64 (the SDK's default when numpy is around) decodes to the same vector
    b64 = sync.embeddings.create(model=EMBED_MODEL, input=texts[0], encoding_format="base64")
    raw = base64.b64decode(b64.data[0].embedding)  # type: ignore[arg-type]
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vecs[0], abs=1e-6)

    async def run_async() -> None:
        async with server.aclient() as client:
            assert MODEL in [m.id async for m in client.models.list()]
            r = await client.chat.completions.create(**chat)
            assert r.choices[0].message.content
            stream = await client.chat.completions.create(**chat, stream=True)
            assert [c async for c in stream]
            c = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
            assert c.usage.completion_tokens > 0
            e = await client.embeddings.create(model=EMBED_MODEL, input="hello")
            assert len(e.data[0].embedding) == 384

    asyncio.run(run_async())


def test_openai_surface_retrieval_request_ids_and_what_a_request_may_name(server: Server) -> None:
    """Issue 18 through the whole server, with the real workers: models.retrieve, request ids
    on answers and errors, unknown names refused, and `dimensions` checked by the gateway
    against the size the real encoder makes."""
    client = server.client()
    for name in (MODEL, EMBED_MODEL):
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-17", extra_headers={"X-Client-Request-Id": "trace-1"})
    assert missing.value.body["code"] == "model_not_found"
    assert missing.value.response.headers["x-request-id"].startswith("req_")
    assert missing.value.response.headers["x-client-request-id"] == "trace-1"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=2,
        store=False,
        metadata={"team": "e2e"},
        extra_body={"top_k": 1},
        extra_headers={"X-Client-Request-Id": "trace-2"},
    )
    assert raw.headers["x-request-id"].startswith("req_") and raw.headers["x-client-request-id"] == "trace-2"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], extra_body={"max_new_tokens": 2}
        )
    assert unknown.value.body["message"] == "Unrecognized request argument supplied: max_new_tokens"
    assert unknown.value.response.headers["x-request-id"].startswith("req_")
    # the size the gateway reads from the model's config is the size the worker makes
    emb = client.embeddings.create(model=EMBED_MODEL, input="hello", dimensions=384, encoding_format="float")
    assert len(emb.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as shorter:
        client.embeddings.create(model=EMBED_MODEL, input="hello", dimensions=256)
    assert shorter.value.body["param"] == "dimensions"


def test_structured_output_and_tool_call(server: Server) -> None:
    """Issue 7 through the whole server: the SDK's `parse` with a pydantic model, and a tool call."""
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    done = server.client().chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Extract the person as JSON.\nText: Tom Brown is 52."}],
        response_format=Person,
        temperature=0,
        max_tokens=40,
    )
    assert done.choices[0].message.parsed == Person(name="Tom Brown", age=52)
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0,
        max_tokens=40,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'  # type: ignore[union-attr]


def test_missing_or_wrong_key_is_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        server.client(key="tm-" + "x" * 48).models.list()
    assert err.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_admin_cli_key_works_against_the_running_server(server: Server) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "admin", "create-key", "--org", "default", "--name", "e2e"],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("tm-") and key != server.key
    assert MODEL in [m.id for m in server.client(key).models.list()]
    prefix = key[:11]
    listed = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "admin", "list-keys", "--org", "default"],
        env=server.env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert prefix in listed and key not in listed
    subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "admin", "revoke-key", prefix],
        env=server.env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    # the CLI told the server's key cache over the bus; allow it a moment to apply
    deadline = time.monotonic() + 1.0
    with pytest.raises(openai.AuthenticationError):
        while time.monotonic() < deadline:
            server.client(key).models.list()
            time.sleep(0.05)


def test_admin_cli_suspends_and_resumes_an_organisation_on_the_running_server(server: Server) -> None:
    """The CLI commits, then tells the server's gateway on its bus: a suspended organisation's
    key is refused within a second, and works again as soon as it is resumed."""

    def admin(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "tokenmill.cli", "admin", *args],
            env=server.env, capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip

    admin("create-org", "cli-org")
    key = admin("create-key", "--org", "cli-org").strip().splitlines()[-1]
    assert MODEL in [m.id for m in server.client(key).models.list()]

    def refused_within_a_second() -> bool:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                server.client(key).models.list()
            except openai.PermissionDeniedError as exc:
                return exc.body["code"] == "organization_suspended"  # type: ignore[index]
            time.sleep(0.05)
        return False

    assert admin("suspend-org", "cli-org").strip() == "suspended cli-org"
    assert refused_within_a_second()
    assert admin("resume-org", "cli-org").strip() == "resumed cli-org"
    deadline = time.monotonic() + 1.0
    while True:
        try:
            assert MODEL in [m.id for m in server.client(key).models.list()]
            break
        except openai.PermissionDeniedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.stops_shared_server
def test_sigterm_stops_everything(server: Server) -> None:
    """Runs after every other test on the shared server (the marker): stops it once both its
    workers are up, and checks for orphans and for their recorded lifetimes."""
    # a worker's row may come from its first heartbeat rather than its announcement
    deadline = time.monotonic() + 30
    while server.query("SELECT count(*) FROM workers") != [(2,)]:
        assert time.monotonic() < deadline, server.query("SELECT * FROM workers")
        time.sleep(0.2)
    children = server.stop()
    assert children, "serve had no worker subprocess"
    assert server.proc.returncode == 0
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)], "worker outlived serve"
    # the worker's lifetime was recorded from its announcement and departure on the bus
    rows = server.query("SELECT status, started_at, stopped_at FROM workers")
    assert len(rows) == 2  # the chat model's worker and the embedding model's
    for status, started, stopped in rows:
        assert status == "stopped" and started and stopped and stopped > started


def test_killed_server_leaves_no_orphan(tmp_path: Path, model_cache: Path) -> None:
    server = start_server(tmp_path, model_cache)
    try:
        children = server.stop(signal.SIGKILL)
    finally:
        server.close()
    assert children
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)], "worker outlived a killed serve"


def test_sigterm_stops_serve_whose_output_reader_is_gone(tmp_path: Path, model_cache: Path) -> None:
    """What read the server's output has died (a supervisor, a killed benchmark): every write to
    it fails. SIGTERM still stops the server and its worker; it used to fail on its "Stopping..."
    line and go on serving, restarting every worker killed by hand, through every SIGTERM."""
    env = serve_env(tmp_path, model_cache, {"TOKENMILL_EMBED_MODEL": "", "TOKENMILL_LOG_LEVEL": "WARNING"})
    read, write = os.pipe()
    command = [sys.executable, "-m", "tokenmill.cli", "serve"]
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=write, stderr=write, text=True)
    os.close(write)
    os.set_blocking(read, False)
    server = Server(proc, f"http://127.0.0.1:{env['TOKENMILL_PORT']}", tmp_path / "home", env)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            with contextlib.suppress(BlockingIOError):
                os.read(read, 1 << 16)  # drained meanwhile: a full pipe would block the server
            assert proc.poll() is None, f"serve exited with {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=2).json().get("workers", 0) >= 1:
                    break
            assert time.monotonic() < deadline, "serve did not become ready"
            time.sleep(0.2)
        children = server.children()
        assert children
        os.close(read)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in children if _alive(p)], "worker outlived serve"
    finally:
        server.close()
