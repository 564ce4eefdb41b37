"""OpenAI's Batch API (issue 19) through `tokenmill serve` with the real SmolLM2 and MiniLM
workers, driven by the official `openai` SDK: a chat batch whose answers are the online API's,
an embeddings batch, cancelling, another organisation's 404s, a server killed mid-batch and
started again (no line lost or run twice, one usage event per line), and a batch expiring.

The first tests run on the shared server, as an organisation of their own; the last two kill
and restart a server of their own in place (same home, same port)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.serve import EMBED_MODEL, MODEL, Server, start_server

pytestmark = pytest.mark.slow

DONE = ("completed", "failed", "expired", "cancelled")


# The batch window is fixed when a batch is created: a server restarted with a short one still
# runs the batches it had to the end, and expires the new ones within seconds.
SHORT_WINDOW = {"TOKENMILL_BATCH_WINDOW_SECONDS": "8"}


@pytest.fixture(scope="module")
def server(shared_server: Server) -> Server:
    return shared_server.for_org("batches")


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Server]:
    """A server the tests may kill and restart; the chat model's worker only."""
    s = start_server(tmp_path_factory.mktemp("batches"), model_cache, {"TOKENMILL_EMBED_MODEL": ""})
    try:
        yield s
    finally:
        s.close()


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


def ledger(server: Server, batch_id: str, expect: int | None = None) -> list[tuple[Any, ...]]:
    """(request id, prompt, completion tokens) of the batch's usage events, once the billing
    consumer has caught up (it stops changing) and, with `expect`, holds that many. Events a
    killed server had published but not recorded are delivered again by the restarted one's
    bus as it starts (its journal): `expect` waits a minute at most."""
    rows: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + (30 if expect is None else 60)
    while time.monotonic() < deadline:
        now = server.query(
            "SELECT request_id, prompt_tokens, completion_tokens FROM usage_events WHERE batch_id = ?",
            batch_id,
        )
        if now and now == rows and (expect is None or len(now) >= expect):
            return now
        rows = now
        time.sleep(1.0)
    return rows


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


def test_another_organisation_gets_404(server: Server, other_org_client: openai.OpenAI) -> None:
    """Acceptance 6: the files and the batch are the organisation's own."""
    client = server.client()
    b = client.batches.list().data[0]
    for call in (
        lambda: other_org_client.batches.retrieve(b.id),
        lambda: other_org_client.batches.cancel(b.id),
        lambda: other_org_client.files.retrieve(b.input_file_id),
        lambda: other_org_client.files.content(b.output_file_id or b.input_file_id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert all(x.id != b.id for x in other_org_client.batches.list().data)
    # Nor can the other organisation run a batch on this one's input file.
    with pytest.raises(openai.BadRequestError):
        other_org_client.batches.create(
            input_file_id=b.input_file_id, endpoint=b.endpoint, completion_window="24h"
        )


def test_cancel_stops_new_lines_and_keeps_what_ran(server: Server) -> None:
    """Acceptance 5 (cancel): new lines stop within seconds; the files hold what ran."""
    client = server.client()
    lines = [json.dumps(chat_line(i, max_tokens=16)) for i in range(400)]  # far from done in 5 lines' time
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
    rows = ledger(server, b.id, expect=counts.completed)
    assert sorted(r[0] for r in rows) == sorted(o["response"]["request_id"] for o in output)
    time.sleep(3)
    assert len(server.query("SELECT 1 FROM usage_events WHERE batch_id = ?", b.id)) == len(rows)
    # Cancelling it again changes nothing; a completed batch cannot be cancelled.
    assert client.batches.cancel(b.id).status == "cancelled"
    done = next(x for x in client.batches.list().data if x.status == "completed")
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(done.id)


def test_killed_mid_batch_then_started_again_every_line_once(own_server: Server) -> None:
    """Acceptance 4: SIGKILL the server (and its workers) mid-batch, start it again: the batch
    completes with every line once in the output and once in the ledger."""
    server = own_server
    client = server.client()
    lines = [json.dumps(chat_line(i)) for i in range(150)]
    b = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while (b := client.batches.retrieve(b.id)).request_counts.completed < 20:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, b
        time.sleep(0.2)
    server.kill()
    ran = server.query("SELECT count(*) FROM batch_lines WHERE batch_id = ? AND state = 'ok'", b.id)[0][0]
    assert 20 <= ran < 150  # killed mid-way
    server.restart(SHORT_WINDOW)  # what the next test needs; this batch keeps its 24 hours
    b = wait(client, b.id)
    assert b.status == "completed" and b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (150, 150, 0)
    output = jsonl(client, b.output_file_id)
    ids = [o["custom_id"] for o in output]
    assert sorted(ids) == sorted(f"chat-{i}" for i in range(150)) and len(set(ids)) == 150
    rows = ledger(server, b.id, expect=150)
    assert sorted(r[0] for r in rows) == sorted(o["response"]["request_id"] for o in output)


def test_an_expired_batch_ends_with_what_ran(own_server: Server) -> None:
    """Acceptance 5 (expiry), with the window setting shortened: what ran is in the output,
    the rest in the error file as `batch_expired`."""
    server = own_server
    if not SHORT_WINDOW.items() <= server.env.items():  # the test above restarted it so already
        server.restart(SHORT_WINDOW)
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
