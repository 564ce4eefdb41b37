"""OpenAI's Batch API (issue 19) through `tokenmill serve` with the real SmolLM2 and MiniLM
workers, driven by the official `openai` SDK: a chat batch whose answers are the online API's,
an embeddings batch, cancelling, another organisation's 404s, a server killed mid-batch and
started again (no line lost or run twice, one usage event per line), and a batch expiring.

One server for the module, restarted in place by the last tests (same home, same port)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.test_serve import EMBED_MODEL, MODEL, ROOT, Server, _wait_for_embeddings, start_server

pytestmark = pytest.mark.slow

DONE = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("batches"), model_cache)
    _wait_for_embeddings(s)
    yield s
    _kill(s)


def _kill(server: Server, sig: int = signal.SIGKILL) -> None:
    """The server and the workers it started, as a crash takes them."""
    children = server.children()
    if server.proc.poll() is None:
        server.proc.send_signal(sig)
        server.proc.wait(timeout=60)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _restart(server: Server, extra_env: dict[str, str] | None = None) -> None:
    """Start the server again on its home and port (its keys and batches are in its database)."""
    server.env.update(extra_env or {})
    server.proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve"],
        env=server.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc = server.proc

    def pump() -> None:
        assert proc.stdout
        for line in proc.stdout:
            sys.stderr.write(f"[serve] {line}")

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited with {proc.returncode}"
        try:
            if httpx.get(f"{server.url}/health", timeout=2).json().get("workers", 0) >= 1:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("serve did not come back")


def query(server: Server, sql: str, *args: object) -> list[tuple[Any, ...]]:
    with sqlite3.connect(server.home / "tokenmill.db") as db:
        return list(db.execute(sql, args))


def chat_line(i: int, max_tokens: int = 8) -> dict[str, Any]:
    return {
        "custom_id": f"chat-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Give me one word that rhymes with number {i}."}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def upload(client: openai.OpenAI, lines: list[str]) -> str:
    return client.files.create(file=("batch.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch").id


def wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...] = DONE, timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.5)


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def ledger(server: Server, batch_id: str) -> list[tuple[Any, ...]]:
    """(request id, prompt, completion tokens) of the batch's usage events, once the billing
    consumer has caught up (it stops changing)."""
    rows: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = query(
            server,
            "SELECT request_id, prompt_tokens, completion_tokens FROM usage_events WHERE batch_id = ?",
            batch_id,
        )
        if now and now == rows:
            return now
        rows = now
        time.sleep(1.0)
    return rows


def other_org_client(server: Server) -> openai.OpenAI:
    admin = {"authorization": f"Bearer {server.key}"}
    with httpx.Client(base_url=server.url, headers=admin, timeout=30) as c:
        r = c.post("/admin/v1/organizations", json={"name": "batches-other-org"})
        assert r.status_code == 201, r.text
        r = c.post(f"/admin/v1/organizations/{r.json()['id']}/keys", json={"name": "other", "role": "member"})
        assert r.status_code == 201, r.text
        return server.client(r.json()["secret"])


def test_a_chat_batch_answers_as_the_online_api_does(server: Server) -> None:
    """Acceptance 1: 200 lines, 3 of them malformed: 197 answers keyed by custom_id, the
    online API's greedy tokens, the 3 bad lines in the error file, one usage event each."""
    client = server.client()
    lines = [json.dumps(chat_line(i)) for i in range(197)]
    bad = [
        '{"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions", "body": {',
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"}),
        json.dumps({**chat_line(999), "custom_id": "wrong-url", "url": "/v1/embeddings"}),
    ]
    for at, line in zip((10, 100, 150), bad, strict=True):
        lines.insert(at, line)
    input_id = upload(client, lines)
    created = client.batches.create(
        input_file_id=input_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"purpose": "e2e"},
    )
    assert created.status == "validating" and created.metadata == {"purpose": "e2e"}
    b = wait(client, created.id)
    assert b.status == "completed", b
    assert b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (200, 197, 3)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.expires_at

    output = jsonl(client, b.output_file_id)
    assert len(output) == 197
    answers = {o["custom_id"]: o for o in output}
    assert set(answers) == {f"chat-{i}" for i in range(197)}
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)

    errors = jsonl(client, b.error_file_id)
    assert len(errors) == 3
    assert {e["custom_id"] for e in errors} == {None, "no-body", "wrong-url"}
    assert all(e["response"] is None and e["error"]["code"] for e in errors)

    for i in range(0, 197, 20):  # 10 lines: the online API, the same greedy tokens
        online = client.chat.completions.create(**chat_line(i)["body"])
        body = answers[f"chat-{i}"]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == online.choices[0].message.content
        assert body["usage"]["completion_tokens"] == online.usage.completion_tokens  # type: ignore[union-attr]

    # One usage event per output line, under the line's request id, with its counts.
    rows = ledger(server, b.id)
    assert len(rows) == 197
    by_id = {rid: (p, c) for rid, p, c in rows}
    for o in output:
        usage = o["response"]["body"]["usage"]
        assert by_id[o["response"]["request_id"]] == (usage["prompt_tokens"], usage["completion_tokens"])
    assert b.usage is not None and b.usage.output_tokens == sum(c for _, _, c in rows)
    assert client.batches.list().data[0].id == b.id


def test_an_embeddings_batch(server: Server) -> None:
    """Acceptance 2."""
    client = server.client()
    texts = [f"Sentence number {i} about batches." for i in range(30)]
    lines = [
        json.dumps(
            {
                "custom_id": f"e{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": EMBED_MODEL, "input": t},
            }
        )
        for i, t in enumerate(texts)
    ]
    b = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/embeddings", completion_window="24h"
    )
    b = wait(client, b.id)
    assert b.status == "completed" and b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (30, 0)
    output = {o["custom_id"]: o["response"]["body"] for o in jsonl(client, b.output_file_id)}
    for i in (0, 17, 29):
        online = client.embeddings.create(model=EMBED_MODEL, input=texts[i]).data[0].embedding
        batched = output[f"e{i}"]["data"][0]["embedding"]
        assert max(abs(x - y) for x, y in zip(online, batched, strict=True)) < 1e-5
    assert len(ledger(server, b.id)) == 30


def test_another_organisation_gets_404(server: Server) -> None:
    """Acceptance 6: the files and the batch are the organisation's own."""
    client = server.client()
    b = client.batches.list().data[0]
    other = other_org_client(server)
    for call in (
        lambda: other.batches.retrieve(b.id),
        lambda: other.batches.cancel(b.id),
        lambda: other.files.retrieve(b.input_file_id),
        lambda: other.files.content(b.output_file_id or b.input_file_id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert all(x.id != b.id for x in other.batches.list().data)
    # Nor can the other organisation run a batch on this one's input file.
    with pytest.raises(openai.BadRequestError):
        other.batches.create(input_file_id=b.input_file_id, endpoint=b.endpoint, completion_window="24h")


def test_cancel_stops_new_lines_and_keeps_what_ran(server: Server) -> None:
    """Acceptance 5 (cancel): new lines stop within seconds; the files hold what ran."""
    client = server.client()
    lines = [json.dumps(chat_line(i, max_tokens=32)) for i in range(400)]
    b = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while (b := client.batches.retrieve(b.id)).request_counts.completed < 5:  # type: ignore[union-attr]
        assert time.monotonic() < deadline and b.status in ("validating", "in_progress"), b
        time.sleep(0.2)
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    b = wait(client, b.id, timeout=60)
    assert b.status == "cancelled" and b.cancelled_at is not None and b.cancelling_at is not None
    assert b.cancelled_at - b.cancelling_at <= 15
    counts = b.request_counts
    assert counts is not None and 5 <= counts.completed < 400 and counts.failed == 0
    output = jsonl(client, b.output_file_id)
    assert len(output) == counts.completed and b.error_file_id is None
    # Nothing ran after: the ledger holds exactly the output's lines, and stays so.
    rows = ledger(server, b.id)
    assert sorted(r[0] for r in rows) == sorted(o["response"]["request_id"] for o in output)
    time.sleep(3)
    assert len(query(server, "SELECT 1 FROM usage_events WHERE batch_id = ?", b.id)) == len(rows)
    # Cancelling it again changes nothing; a completed batch cannot be cancelled.
    assert client.batches.cancel(b.id).status == "cancelled"
    done = next(x for x in client.batches.list().data if x.status == "completed")
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(done.id)


def test_killed_mid_batch_then_started_again_every_line_once(server: Server) -> None:
    """Acceptance 4: SIGKILL the server (and its workers) mid-batch, start it again: the batch
    completes with every line once in the output and once in the ledger."""
    client = server.client()
    lines = [json.dumps(chat_line(i, max_tokens=16)) for i in range(150)]
    b = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while (b := client.batches.retrieve(b.id)).request_counts.completed < 20:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, b
        time.sleep(0.2)
    _kill(server)
    ran = query(server, "SELECT count(*) FROM batch_lines WHERE batch_id = ? AND state = 'ok'", b.id)[0][0]
    assert 20 <= ran < 150  # killed mid-way
    _restart(server)
    b = wait(client, b.id)
    assert b.status == "completed" and b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (150, 150, 0)
    output = jsonl(client, b.output_file_id)
    ids = [o["custom_id"] for o in output]
    assert sorted(ids) == sorted(f"chat-{i}" for i in range(150)) and len(set(ids)) == 150
    rows = ledger(server, b.id)
    assert sorted(r[0] for r in rows) == sorted(o["response"]["request_id"] for o in output)


def test_an_expired_batch_ends_with_what_ran(server: Server) -> None:
    """Acceptance 5 (expiry), with the window setting shortened: what ran is in the output,
    the rest in the error file as `batch_expired`."""
    _kill(server, signal.SIGTERM)
    _restart(server, {"TOKENMILL_BATCH_WINDOW_SECONDS": "8"})
    client = server.client()
    lines = [json.dumps(chat_line(i, max_tokens=32)) for i in range(400)]
    b = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.expires_at is not None and b.expires_at - b.created_at <= 9
    b = wait(client, b.id, timeout=120)
    assert b.status == "expired" and b.expired_at is not None
    counts = b.request_counts
    assert counts is not None and counts.total == 400 and counts.completed + counts.failed == 400
    assert 0 < counts.completed < 400
    output = jsonl(client, b.output_file_id)
    errors = jsonl(client, b.error_file_id)
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert all(e["error"]["code"] == "batch_expired" for e in errors)
    assert {o["custom_id"] for o in output} | {e["custom_id"] for e in errors} == {
        f"chat-{i}" for i in range(400)
    }
