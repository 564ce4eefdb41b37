"""Deployments on vLLM end to end (issue 17, acceptance 2, 4, 5 and 6), against `tokenmill serve`
run as a user runs it (a subprocess with its own TOKENMILL_HOME and SQLite), driven over HTTP
with the admin API and the official `openai` SDK.

One serve process and one vLLM for the whole module. The vLLM is the test run's shared server
(conftest's `vllm_server`: the CPU build serving the converted SmolLM2, LoRA on): the vLLM
workers that serve's reconciler starts attach to it through TOKENMILL_VLLM_URL and
TOKENMILL_VLLM_KV_EVENTS_ENDPOINT (they inherit serve's environment) instead of each starting a
vLLM of its own, and serve runs with TOKENMILL_BLOCK_SIZE=32 because vLLM's CPU attention takes
no smaller block. The deployments declare the engine arguments that server runs with.

The workers are the reconciler's (TOKENMILL_AUTOSCALER=local), which is the real path: a
deployment with `engine: vllm` gets `tokenmill worker --engine vllm`. The platform admin stops
the bundled builtin deployment and puts a serverless vLLM deployment of the same model in its
place, so an organisation's adapter of that model (served "by the shared deployment of its base
model") lands on vLLM, whatever the names' order.

- acceptance 2: chat and completions, streamed and not, a JSON-schema response, a tool call,
  `cached_tokens` on a repeated prompt, a bad key; the ledger holds one event per request (by
  `x-request-id`) with the tokens of the response, which are the tokens vLLM counted itself
  (its own /metrics counters move by exactly the sums).
- acceptance 4: two organisations send the same prompt; the first's repeat is served from the
  prefix cache, the second gets 0 cached tokens, and vLLM's own prefix-cache hits do not move.
- acceptance 5: an adapter uploaded through the admin API is served by the vLLM worker when a
  request names it: vLLM lists it, greedy output changes, the ledger names it.
- acceptance 6: a dedicated vLLM deployment (gpu_type, 2 GPUs per replica). Its worker gets
  SIGTERM from the test while streams are in flight; the deployment is stopped right after,
  so that the reconciler does not start a replacement (its own stop is a second SIGTERM, which
  a draining worker ignores) and the worker's lifetime is the only one billed. The streams
  finish, the worker leaves the fleet, its lifetime lands in `workers`, and the invoice's
  GPU-hour line is lifetime x gpus_per_replica x the price, rounded half-even to the cent.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.control_plane.conftest import lora_files
from tests.e2e.clock import wait_out_month_end
from tests.e2e.test_admin_journey import (
    MODEL,
    Server,
    _stop_process,
    cents,
    check,
    iso,
    parse_db_time,
    seconds,
    start_server,
    wait_until,
)
from tests.e2e.test_structured_api import PARAMS, TOOLS
from tests.vllm_server import BLOCK_SIZE, ENGINE_ARGS, RunningVllm

pytestmark = pytest.mark.slow

SERVERLESS = "smollm2-vllm"  # the platform's shared deployment of SmolLM2 on vLLM
DEDICATED = "gpu-vllm-dedicated"
ADAPTER = "vllm-support-bot"
GPU_TYPE = "cpu-test"
GPU_HOUR = Decimal("97.13")
GPUS = 2
# Model prices, so invoices can be generated for every organisation (the tenants of the
# serverless deployment are billed by token); the checked invoice is a dedicated one's.
TOKEN_PRICES = {"input_per_mtok": "0.5", "cached_input_per_mtok": "0.25", "output_per_mtok": "1.5"}
# Several 32-token blocks once the chat template is around it: a repeat reads most of it from
# vLLM's prefix cache.
STORY = (
    "Here is a long story about a lighthouse keeper who lived alone on a rocky island far "
    "from the coast, kept a logbook of every ship that passed, fed the gulls each morning, "
    "repaired the great lamp each winter, and wrote letters to his sister that he could only "
    "post when the supply boat came twice a year. Summarise it in one sentence."
)
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass
class Used:
    """What one response said it used, under the request id the gateway gave it."""

    request_id: str
    prompt: int
    cached: int
    completion: int


@dataclass
class Journey:
    server: Server
    vllm: RunningVllm
    serverless: dict[str, Any]  # the shared deployment of SmolLM2 on vLLM

    def tenant(self, name: str) -> tuple[str, str]:
        """(org id, key) of a new organisation and one of its org-admin keys."""
        root = self.server.admin()
        org = check(root.post("/organizations", json={"name": name}), 201)
        key = check(
            root.post(f"/organizations/{org['id']}/keys", json={"name": "ops", "role": "org_admin"}), 201
        )
        return org["id"], key["secret"]

    def ledger(self, request_ids: list[str]) -> dict[str, tuple[Any, ...]]:
        """The usage events of these requests, once there are as many (request id -> row)."""
        marks = ",".join("?" * len(request_ids))

        def rows() -> dict[str, tuple[Any, ...]] | None:
            found = self.server.query(
                "SELECT request_id, org_id, deployment_id, prompt_tokens, cached_tokens,"
                f" completion_tokens, status, adapter FROM usage_events WHERE request_id IN ({marks})",
                *request_ids,
            )
            return {r[0]: r for r in found} if len(found) >= len(request_ids) else None

        return wait_until("the usage events in the ledger", rows, timeout=30)


def _usage(request_id: str, usage: Any) -> Used:
    assert usage is not None, "a response without usage"
    details = usage.prompt_tokens_details
    assert details is not None, "usage without prompt_tokens_details"
    return Used(request_id, usage.prompt_tokens, int(details.cached_tokens or 0), usage.completion_tokens)


def vllm_counters(url: str) -> dict[str, float]:
    """vLLM's own running totals (its /metrics): prompt, generated and prefix-cache-hit tokens."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    wanted = {
        "vllm:prompt_tokens_total": "prompt",
        "vllm:generation_tokens_total": "completion",
        "vllm:prefix_cache_hits_total": "cached",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
    return out


def wait_for_worker(server: Server, deployment_id: str) -> tuple[Any, ...]:
    """The `workers` row of the deployment's (only) running worker, once it announced itself."""

    def running() -> tuple[Any, ...] | None:
        rows = server.query(
            "SELECT id, status, gpu_type, gpus, started_at FROM workers"
            " WHERE deployment_id = ? AND status = 'running'",
            deployment_id,
        )
        assert len(rows) <= 1, rows
        return rows[0] if rows else None

    # A vLLM worker attaching to a running vLLM starts in seconds; the import of torch and
    # the model's tokenizer take most of it on a busy 2-core machine.
    return wait_until(f"a running worker of {deployment_id}", running, timeout=180)


def child_pid(server: Server, worker_id: str) -> int:
    """The pid of serve's child process running worker `worker_id`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server.proc.pid and worker_id.encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no child process of serve runs worker {worker_id}")


@pytest.fixture(scope="module")
def journey(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, vllm_server: RunningVllm
) -> Iterator[Journey]:
    wait_out_month_end()  # the dedicated deployment's GPU time goes on one monthly invoice
    env = {
        "TOKENMILL_BLOCK_SIZE": str(BLOCK_SIZE),
        "TOKENMILL_VLLM_URL": vllm_server.url,
        "TOKENMILL_VLLM_KV_EVENTS_ENDPOINT": vllm_server.server.kv_events_endpoint or "",
        "TOKENMILL_HEARTBEAT_SECONDS": "0.5",
        "PYTHONUNBUFFERED": "1",
    }
    server = start_server(tmp_path_factory.mktemp("vllm-serve"), model_cache, "local", env)
    try:
        root = server.admin()
        check(root.post("/prices/models", json={"model": MODEL, **TOKEN_PRICES}), 201)
        check(root.post("/prices/gpus", json={"gpu_type": GPU_TYPE, "per_hour": str(GPU_HOUR)}), 201)
        deployments = check(root.get("/deployments"))
        (builtin,) = [d for d in deployments if d["name"] == MODEL and d["type"] == "serverless"]
        assert builtin["engine"] == "builtin"
        # vLLM takes over the model: adapters of it go to the one active shared deployment.
        stopped = check(root.patch(f"/deployments/{builtin['id']}", json={"status": "stopped"}))
        assert stopped["status"] == "stopped"
        serverless = check(
            root.post(
                "/deployments",
                json={
                    "name": SERVERLESS,
                    "model": MODEL,
                    "type": "serverless",
                    "engine": "vllm",
                    "engine_args": ENGINE_ARGS,
                },
            ),
            201,
        )
        assert (serverless["engine"], serverless["engine_args"], serverless["gpus_per_replica"]) == (
            "vllm",
            ENGINE_ARGS,
            0,
        )
        worker = wait_for_worker(server, serverless["id"])
        assert worker[2:4] == (None, 0)  # a CPU deployment: no GPU type, no GPUs, nothing billed

        def builtin_gone() -> bool | None:
            rows = server.query("SELECT status FROM workers WHERE deployment_id = ?", builtin["id"])
            return True if rows and all(r[0] == "stopped" for r in rows) else None

        wait_until("the builtin worker's departure", builtin_gone, timeout=60)
        yield Journey(server, vllm_server, serverless)
    finally:
        _stop_process(server.proc)


# --- acceptance 2: the openai SDK through the gateway to vLLM -------------------------------------


def test_openai_sdk_on_a_vllm_deployment(journey: Journey) -> None:
    org_id, key = journey.tenant("vllm-sdk")
    client = journey.server.openai(key)
    assert SERVERLESS in {m.id for m in client.models.list()}
    tag = uuid.uuid4().hex[:8]  # this run's prompts only (the vLLM serves the whole test run)
    used: list[Used] = []
    before = vllm_counters(journey.vllm.url)

    raw = client.chat.completions.with_raw_response.create(
        model=SERVERLESS,
        messages=[{"role": "user", "content": f"[{tag}] Name three colours."}],
        temperature=0,
        max_tokens=12,
    )
    chat = raw.parse()
    assert chat.model == SERVERLESS and chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")
    used.append(_usage(raw.headers["x-request-id"], chat.usage))
    assert 0 < used[-1].completion <= 12

    raw_stream = client.chat.completions.with_raw_response.create(
        model=SERVERLESS,
        messages=[{"role": "user", "content": f"[{tag}] Count from one to five."}],
        temperature=0,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(raw_stream.parse())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed and chunks[-1].usage is not None
    used.append(_usage(raw_stream.headers["x-request-id"], chunks[-1].usage))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"]) and 0 < used[-1].completion <= 10
    assert finishes == ["stop"] or used[-1].completion == 10

    raw = client.completions.with_raw_response.create(
        model=SERVERLESS, prompt=f"[{tag}] Once upon a time", max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    completion = raw.parse()
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    used.append(_usage(raw.headers["x-request-id"], completion.usage))
    assert used[-1].completion == 8

    raw_stream = client.completions.with_raw_response.create(
        model=SERVERLESS, prompt=f"[{tag}] The capital of France is", max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(raw_stream.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    used.append(_usage(raw_stream.headers["x-request-id"], chunks[-1].usage))
    assert used[-1].completion == 6

    # A JSON-schema response: vLLM's structured outputs hold the model to the schema.
    raw = client.chat.completions.with_raw_response.create(
        model=SERVERLESS,
        messages=[
            {
                "role": "user",
                "content": f'[{tag}] Extract the person as JSON with keys "name" and "age".\n'
                "Text: Maria Garcia is 37 years old and teaches music.",
            }
        ],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
        temperature=0,
        max_tokens=60,
    )
    person = raw.parse()
    assert person.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(person.choices[0].message.content or ""), PERSON_SCHEMA)
    used.append(_usage(raw.headers["x-request-id"], person.usage))

    # A tool call, as tests/e2e/test_structured_api.py asks the builtin engine for one.
    raw = client.chat.completions.with_raw_response.create(
        model=SERVERLESS,
        messages=[{"role": "user", "content": "What is the weather like in Berlin right now?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    tool = raw.parse()
    choice = tool.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in PARAMS
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMS[call.function.name])
    used.append(_usage(raw.headers["x-request-id"], tool.usage))

    # The same long prompt twice: the repeat reads whole blocks from vLLM's prefix cache. A
    # tag of its own: the system prompt and `[tag]` fill the first block, which the prompts
    # above share (and, the same organisation's, rightly find cached).
    story = [{"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] {STORY}"}]
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=SERVERLESS, messages=story, temperature=0, max_tokens=8
        )
        used.append(_usage(raw.headers["x-request-id"], raw.parse().usage))
    first, repeat = used[-2:]
    assert first.prompt == repeat.prompt > 3 * BLOCK_SIZE
    assert first.cached == 0  # a new organisation's salt: nothing of it is cached yet
    assert 0 < repeat.cached < repeat.prompt and repeat.cached % BLOCK_SIZE == 0, repeat

    # A bad key: 401 before anything runs, and no usage event.
    bad = journey.server.openai(key[:-4] + "zzzz")
    with pytest.raises(openai.AuthenticationError) as refused:
        bad.chat.completions.create(model=SERVERLESS, messages=story, max_tokens=4)
    assert refused.value.status_code == 401
    assert refused.value.response.json()["error"]["code"] == "invalid_api_key"
    bad_id = refused.value.response.headers["x-request-id"]

    after = vllm_counters(journey.vllm.url)
    # What the responses said is what vLLM counted (nothing else ran on it meanwhile).
    assert after["prompt"] - before["prompt"] == sum(u.prompt for u in used)
    assert after["completion"] - before["completion"] == sum(u.completion for u in used)
    assert after["cached"] - before["cached"] == sum(u.cached for u in used)

    ids = [u.request_id for u in used]
    assert len(set(ids)) == len(ids)
    ledger = journey.ledger(ids)
    assert {rid: (r[1], r[2], r[3], r[4], r[5], r[6], r[7]) for rid, r in ledger.items()} == {
        u.request_id: (org_id, journey.serverless["id"], u.prompt, u.cached, u.completion, "ok", None)
        for u in used
    }
    # one event per request: no more of this organisation's, and none for the refused one
    assert journey.server.query("SELECT count(*) FROM usage_events WHERE org_id = ?", org_id) == [
        (len(used),)
    ]
    assert journey.server.query("SELECT count(*) FROM usage_events WHERE request_id = ?", bad_id) == [(0,)]


# --- acceptance 4: the cache salt on vLLM -----------------------------------------------------------


def test_a_second_organisation_gets_nothing_from_the_firsts_cache(journey: Journey) -> None:
    org_a, key_a = journey.tenant("vllm-salt-a")
    org_b, key_b = journey.tenant("vllm-salt-b")
    story = [{"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] {STORY}"}]

    def send(key: str) -> Used:
        raw = journey.server.openai(key).chat.completions.with_raw_response.create(
            model=SERVERLESS, messages=story, temperature=0, max_tokens=4
        )
        return _usage(raw.headers["x-request-id"], raw.parse().usage)

    a1, a2 = send(key_a), send(key_a)
    assert a1.cached == 0 and a2.cached > 0 and a2.prompt == a1.prompt  # the prompt is cacheable
    hits = vllm_counters(journey.vllm.url)["cached"]
    b = send(key_b)
    assert b.prompt == a1.prompt
    assert b.cached == 0, "organisation B was served from organisation A's prefix cache"
    assert vllm_counters(journey.vllm.url)["cached"] == hits  # vLLM itself found nothing to reuse
    ledger = journey.ledger([a1.request_id, a2.request_id, b.request_id])
    assert [(ledger[u.request_id][1], ledger[u.request_id][4]) for u in (a1, a2, b)] == [
        (org_a, 0),
        (org_a, a2.cached),
        (org_b, 0),
    ]


# --- acceptance 5: a LoRA adapter on the vLLM worker ------------------------------------------------


def adapter_files() -> dict[str, bytes]:
    """lora_files()'s rank-4 adapter with B no longer zero, so it changes what the model says."""
    import torch
    from safetensors.torch import load, save

    files = lora_files()
    tensors = load(files["adapter_model.safetensors"])
    gen = torch.Generator().manual_seed(17)
    for name, t in tensors.items():
        tensors[name] = torch.randn(t.shape, generator=gen) * 0.2
    buf = save(tensors)
    return {**files, "adapter_model.safetensors": buf}


def test_an_uploaded_adapter_is_served_by_the_vllm_worker(journey: Journey) -> None:
    org_id, key = journey.tenant("vllm-lora")
    _, other_key = journey.tenant("vllm-lora-other")
    tenant = journey.server.admin(key)
    r = tenant.post(
        f"/organizations/{org_id}/adapters",
        data={"name": ADAPTER, "model": MODEL},
        files=[("file", (n, c, "application/octet-stream")) for n, c in adapter_files().items()],
    )
    adapter = check(r, 201)
    assert (adapter["org_id"], adapter["name"], adapter["rank"]) == (org_id, ADAPTER, 4)
    client = journey.server.openai(key)
    assert ADAPTER in {m.id for m in client.models.list()}

    ask = [{"role": "user", "content": "Say hello to the new lighthouse keeper."}]
    opts: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    base = client.chat.completions.create(model=SERVERLESS, messages=ask, **opts)
    raw = client.chat.completions.with_raw_response.create(model=ADAPTER, messages=ask, **opts)
    tuned = raw.parse()
    assert tuned.model == ADAPTER and tuned.choices[0].finish_reason == "length"
    assert tuned.usage is not None and tuned.usage.completion_tokens == 12
    assert tuned.choices[0].message.content != base.choices[0].message.content

    # vLLM itself holds it, under the adapter's id, on the base model it serves
    cards = httpx.get(f"{journey.vllm.url}/v1/models", timeout=10).json()["data"]
    assert {"id": adapter["id"], "parent": journey.vllm.name} in [
        {"id": c["id"], "parent": c.get("parent")} for c in cards
    ]
    (row,) = journey.ledger([raw.headers["x-request-id"]]).values()
    assert (row[1], row[2], row[5], row[6], row[7]) == (
        org_id,
        journey.serverless["id"],
        12,
        "ok",
        adapter["id"],
    )

    # another organisation cannot name it
    with pytest.raises(openai.NotFoundError):
        journey.server.openai(other_key).chat.completions.create(model=ADAPTER, messages=ask, max_tokens=2)


# --- acceptance 6: SIGTERM under load, GPU-hours of a dedicated vLLM deployment -----------------------


@dataclass
class Stream:
    """One streamed completion in a thread: when its chunks came, and how it ended."""

    first: threading.Event = field(default_factory=threading.Event)
    times: list[float] = field(default_factory=list)
    finish: str | None = None
    usage: Any = None
    request_id: str = ""
    error: BaseException | None = None


def stream_in_thread(client: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[Stream, threading.Thread]:
    out = Stream()

    def run() -> None:
        try:
            raw = client.completions.with_raw_response.create(
                model=DEDICATED, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            out.request_id = raw.headers["x-request-id"]
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].text:
                    out.times.append(time.monotonic())
                    out.first.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    out.finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    out.usage = chunk.usage
        except BaseException as exc:  # reported by the test, not lost in the thread
            out.error = exc
        finally:
            out.first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return out, thread


def test_sigterm_under_load_then_gpu_hours_are_billed(journey: Journey) -> None:
    t0 = datetime.now(UTC)
    server = journey.server
    org_id, key = journey.tenant("vllm-gpu")
    tenant = server.admin(key)
    dep = check(
        tenant.post(
            "/deployments",
            json={
                "name": DEDICATED,
                "model": MODEL,
                "type": "dedicated",
                "gpu_type": GPU_TYPE,
                "engine": "vllm",
                "engine_args": ENGINE_ARGS,
                "gpus_per_replica": GPUS,
            },
        ),
        201,
    )
    assert (dep["org_id"], dep["engine"], dep["gpus_per_replica"], dep["gpu_type"]) == (
        org_id,
        "vllm",
        GPUS,
        GPU_TYPE,
    )
    worker_id, _, worker_gpu, worker_gpus, _ = wait_for_worker(server, dep["id"])
    assert (worker_gpu, worker_gpus) == (GPU_TYPE, GPUS)
    pid = child_pid(server, worker_id)

    def fleet_size() -> int:
        return int(httpx.get(f"{server.url}/health", timeout=5).json()["workers"])

    # serving: the shared vLLM deployment's worker and this one
    wait_until("the dedicated worker in the fleet", lambda: True if fleet_size() == 2 else None, timeout=30)

    client = server.openai(key)
    # Long enough to be mid-way when the last of them has started, on a busy machine too.
    max_tokens = 96
    streams = [stream_in_thread(client, f"Chapter {i}: the lighthouse keeper", max_tokens) for i in range(3)]
    for s, _ in streams:
        assert s.first.wait(120), "a stream never started"
        assert s.error is None, s.error
    signalled = time.monotonic()
    assert all(s.finish is None for s, _ in streams), "a request ended before the SIGTERM"
    os.kill(pid, signal.SIGTERM)
    # Stopped, so the reconciler lets it go instead of replacing it.
    assert check(tenant.patch(f"/deployments/{dep['id']}", json={"status": "stopped"}))["status"] == "stopped"
    for s, thread in streams:
        thread.join(180)
        assert not thread.is_alive(), "a stream did not end"
        assert s.error is None, s.error
        # in flight at the SIGTERM, and finished in full afterwards
        assert s.times[0] < signalled < s.times[-1]
        assert s.finish == "length" and s.usage is not None and s.usage.completion_tokens == max_tokens

    def row() -> tuple[Any, ...] | None:
        rows = server.query("SELECT status, started_at, stopped_at FROM workers WHERE id = ?", worker_id)
        return rows[0] if rows else None

    def stopped() -> tuple[Any, ...] | None:
        found = row()
        return found if found and found[0] == "stopped" else None

    try:
        _, started_at, stopped_at = wait_until("the worker's departure", stopped, timeout=60)
    except AssertionError as exc:
        # "lost" here: the reconciler gave up on it and its own goodbye never landed
        raise AssertionError(f"{exc}; its row: {row()}, alive: {Path(f'/proc/{pid}').exists()}") from None
    wait_until("the worker out of the fleet", lambda: True if fleet_size() == 1 else None, timeout=30)
    wait_until(
        "the worker process to exit", lambda: None if Path(f"/proc/{pid}").exists() else True, timeout=30
    )
    started, ended = parse_db_time(started_at), parse_db_time(stopped_at)
    assert t0 < started < ended <= datetime.now(UTC)
    # it drained and exited by itself: serve's provider never had to kill it
    assert not [line for line in server.lines if worker_id in line and "kill" in line]
    # no replacement was started: this worker is the deployment's only lifetime
    assert server.query("SELECT id FROM workers WHERE deployment_id = ?", dep["id"]) == [(worker_id,)]
    ledger = journey.ledger([s.request_id for s, _ in streams])
    assert (
        sorted((r[1], r[2], r[5], r[6]) for r in ledger.values())
        == [(org_id, dep["id"], max_tokens, "ok")] * 3
    )

    # --- roll up, generate: the GPU-hour line ----------------------------------------------------
    t1 = datetime.now(UTC)
    month = t0.strftime("%Y-%m")
    assert t1.strftime("%Y-%m") == month, "the test outlasted the margin before the month's end"
    root = server.admin()
    r = root.post("/rollups", json={"from": iso(t0 - timedelta(hours=1)), "to": iso(t1 + timedelta(hours=1))})
    assert r.status_code in (200, 201), r.text
    check(root.post("/invoices/generate", json={"month": month}))
    (listed,) = check(root.get("/invoices", params={"org": org_id, "month": month}))
    invoice = check(tenant.get(f"/invoices/{listed['id']}"))
    gpu_seconds = seconds(ended - started) * GPUS
    got = [
        (
            line["meter"],
            line["deployment_id"],
            Decimal(str(line["quantity"])),
            Decimal(str(line["unit_price"])),
            Decimal(str(line["amount"])),
            line["unit"],
        )
        for line in invoice["lines"]
    ]
    # its tokens are free: a dedicated deployment is billed by the GPU-hour only
    assert got == [
        ("gpu_seconds", dep["id"], gpu_seconds, GPU_HOUR, cents(gpu_seconds * GPU_HOUR / 3600), "GPU-hour")
    ]
    assert Decimal(str(invoice["total"])) == cents(gpu_seconds * GPU_HOUR / 3600) > 0
