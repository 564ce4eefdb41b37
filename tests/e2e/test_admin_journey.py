"""The admin journey end to end (issue 5, acceptance 1), against `tokenmill serve` run as a
user runs it: a subprocess with its own TOKENMILL_HOME, driven over HTTP.

Through the admin API only: an organisation, an org-admin user and a key of theirs (the
secret shown once), the price book (a model's token prices, a GPU type's hourly price), a
LoRA adapter (listed, and visible in the organisation's /v1/models), a dedicated deployment
and a real worker for it, started by hand as the fleet's reconciler will one day do. Traffic
from the openai SDK goes to the shared model and to the dedicated deployment; the worker is
stopped; the hours are rolled up; the month's invoice is generated and finalized; usage is
exported as CSV. Then the numbers must reconcile exactly, with `Decimal`: the ledger's
tokens x the prices, and the worker's recorded lifetime x the GPU-hour price, each line
rounded half-even to the cent, are the invoice's lines and total; the CSV is the ledger; the
ledger is what the responses said they used.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import io
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

from tests.control_plane.conftest import lora_files
from tests.e2e.clock import wait_out_month_end

pytestmark = pytest.mark.slow

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
API = "/admin/v1"
MILLION = Decimal(1_000_000)
CENT = Decimal("0.01")
# A few hundred tokens at cents-per-Mtok prices would round to 0.00 on every line: prices
# with many decimals and large enough that each line is some cents and rounding really
# happens (half-even, once per line).
INPUT_PRICE = Decimal("1234.567891")
CACHED_PRICE = Decimal("345.678912")
OUTPUT_PRICE = Decimal("2345.678901")
GPU_TYPE = "cpu-test"
GPU_HOUR = Decimal("97.13")
DEDICATED = "acme-dedicated"
ADAPTER = "support-bot"
# Several full KV blocks (16 tokens) once the chat template is around it, so that sending it
# twice reads part of it from the prefix cache: cached input tokens get a line of their own.
LONG = (
    "Here is a long story about a lighthouse keeper who lived alone on a rocky island far "
    "from the coast, kept a logbook of every ship that passed, fed the gulls each morning, "
    "repaired the great lamp each winter, and wrote letters to his sister that he could only "
    "post when the supply boat came twice a year. Summarise it in one sentence."
)


def cents(amount: Decimal) -> Decimal:
    return amount.quantize(CENT, rounding=ROUND_HALF_EVEN)


def parse_db_time(value: str) -> datetime:
    t = datetime.fromisoformat(value)
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def seconds(delta: timedelta) -> Decimal:
    """Exact, to the microsecond (as billing counts GPU time)."""
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / 1_000_000


def iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 60.0, every: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # Linux: a hand-started worker gets SIGTERM if this test process dies, even by SIGKILL.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pump(proc: subprocess.Popen[str], lines: list[str], tag: str) -> None:
    def run() -> None:
        assert proc.stdout
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            sys.stderr.write(f"[{tag}] {line}")

    threading.Thread(target=run, daemon=True).start()


def _stop_process(proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    home: Path
    env: dict[str, str]
    root_key: str = ""
    lines: list[str] = field(default_factory=list)
    others: list[subprocess.Popen[str]] = field(default_factory=list)  # started by the test

    @property
    def db(self) -> Path:
        return self.home / "tokenmill.db"

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        """Read the server's SQLite file (read-only; WAL lets us read while it writes)."""
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def admin(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.url + API,
            headers={"authorization": f"Bearer {key or self.root_key}"},
            timeout=120,
        )

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)


def start_server(
    tmp: Path, model_cache: Path, autoscaler: str = "local", extra_env: dict[str, str] | None = None
) -> Server:
    """`tokenmill serve` in `tmp`, once it printed its root key and has a worker; `extra_env`
    on top of the environment set here (a vLLM to attach to, a block size...)."""
    port = _free_port()
    env = {
        **os.environ,
        "TOKENMILL_HOME": str(tmp / "home"),
        "TOKENMILL_MODEL_CACHE": str(model_cache),
        "TOKENMILL_PORT": str(port),
        "TOKENMILL_TORCH_THREADS": "1",
        "TOKENMILL_EMBED_MODEL": "",  # no embedding worker: not part of this journey
        "TOKENMILL_SCHEDULER": "false",  # the test runs the billing jobs itself, through the API
        "TOKENMILL_AUTOSCALER": autoscaler,
        **(extra_env or {}),
    }
    for var in ("DATABASE_URL", "REDIS_URL", "TOKENMILL_INTERNAL_TOKEN", "TOKENMILL_SECRET_KEY"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = Server(proc, f"http://127.0.0.1:{port}", tmp / "home", env)
    _pump(proc, server.lines, "serve")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n" + "\n".join(server.lines))
        server.root_key = next((ln for ln in server.lines if ln.startswith("tm-")), "")
        try:
            health = httpx.get(f"{server.url}/health", timeout=2).json()
            if server.root_key and health.get("workers", 0) >= 1:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    _stop_process(proc)
    raise AssertionError("serve did not become ready:\n" + "\n".join(server.lines))


@pytest.fixture
def server(tmp_path: Path, model_cache: Path) -> Iterator[Server]:
    # The journey starts the dedicated deployment's worker by hand and bills its lifetime; the
    # reconciler would start a second one whose lifetime keeps growing during the checks.
    s = start_server(tmp_path, model_cache, autoscaler="none")
    try:
        yield s
    finally:
        for proc in s.others:
            _stop_process(proc, timeout=30)
        _stop_process(s.proc)


def start_worker(server: Server, deployment_id: str, worker_id: str) -> subprocess.Popen[str]:
    """A real worker for `deployment_id`, with the environment `serve` gives its own workers
    (the internal token from HOME/secrets.json, the server's bus endpoint, the model cache).
    There is no GPU-type setting for a worker (see the report): its lifetime is billed at the
    deployment's GPU type, as billing does when the worker announces none."""
    secrets = json.loads((server.home / "secrets.json").read_text())
    env = {
        **server.env,
        "TOKENMILL_INTERNAL_TOKEN": secrets["internal_token"],
        "TOKENMILL_BUS_URL": f"{server.url}/internal/bus",
        "TOKENMILL_TORCH_THREADS": "1",
    }
    for var in ("TOKENMILL_PORT", "TOKENMILL_EMBED_MODEL", "TOKENMILL_SCHEDULER"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "worker", "--model", "bundled:smollm2",
         "--deployment", deployment_id, "--worker-id", worker_id],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_die_with_parent,
    )  # fmt: skip
    server.others.append(proc)
    _pump(proc, [], "worker")
    return proc


@dataclass
class Used:
    """What the responses said one request used."""

    deployment: str  # "shared" or "dedicated"
    prompt: int
    cached: int
    completion: int


def _used(deployment: str, usage: Any) -> Used:
    assert usage is not None, "a response without usage"
    details = getattr(usage, "prompt_tokens_details", None)
    cached = int(getattr(details, "cached_tokens", 0) or 0)
    return Used(deployment, usage.prompt_tokens, cached, usage.completion_tokens)


def send_traffic(client: openai.OpenAI) -> list[Used]:
    """Chat (plain and streamed) and completions to the shared model and to the dedicated
    deployment; the long prompt twice on each, so the second is partly cached."""
    used: list[Used] = []
    long_chat = [{"role": "user", "content": LONG}]
    for name, tag in ((MODEL, "shared"), (DEDICATED, "dedicated")):
        for _ in range(2):
            r = client.chat.completions.create(model=name, messages=long_chat, temperature=0, max_tokens=8)
            assert r.choices[0].message.content is not None
            used.append(_used(tag, r.usage))
        c = client.completions.create(model=name, prompt="Once upon a time", max_tokens=6, temperature=0)
        assert c.choices[0].text
        used.append(_used(tag, c.usage))
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    used.append(_used("shared", chunks[-1].usage))
    return used


def check(r: httpx.Response, status: int = 200) -> Any:
    assert r.status_code == status, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    return r.json() if r.content else None


def test_admin_journey_reconciles_to_the_cent(server: Server) -> None:
    wait_out_month_end()  # the whole journey's usage goes on one monthly invoice
    t0 = datetime.now(UTC)
    root = server.admin()

    # --- tenant: organisation, org-admin user, a key of theirs (secret shown once) ---------
    org = check(root.post("/organizations", json={"name": "acme-journey"}), 201)
    org_id = org["id"]
    password = "correct horse battery staple"
    user = check(
        root.post(
            f"/organizations/{org_id}/users",
            json={"email": "ops@acme.test", "password": password, "role": "org_admin"},
        ),
        201,
    )
    assert user["role"] == "org_admin" and user["org_id"] == org_id
    assert not any(password in json.dumps(v) for v in user.values())
    key = check(
        root.post(
            f"/organizations/{org_id}/keys",
            json={"name": "ops", "role": "org_admin", "user_id": user["id"]},
        ),
        201,
    )
    secret = key["secret"]
    assert secret.startswith("tm-") and key["user_id"] == user["id"]
    assert "secret" not in check(root.get(f"/keys/{key['id']}"))
    assert secret not in root.get(f"/organizations/{org_id}/keys").text
    tenant = server.admin(secret)

    # --- the price book (platform admin) ----------------------------------------------------
    price = check(
        root.post(
            "/prices/models",
            json={
                "model": MODEL,
                "input_per_mtok": str(INPUT_PRICE),
                "cached_input_per_mtok": str(CACHED_PRICE),
                "output_per_mtok": str(OUTPUT_PRICE),
            },
        ),
        201,
    )
    assert Decimal(str(price["input_per_mtok"])) == INPUT_PRICE
    assert Decimal(str(price["cached_input_per_mtok"])) == CACHED_PRICE
    assert Decimal(str(price["output_per_mtok"])) == OUTPUT_PRICE
    gpu = check(root.post("/prices/gpus", json={"gpu_type": GPU_TYPE, "per_hour": str(GPU_HOUR)}), 201)
    assert Decimal(str(gpu["per_hour"])) == GPU_HOUR
    # an org admin reads the price book but may not write it
    check(tenant.post("/prices/gpus", json={"gpu_type": GPU_TYPE, "per_hour": "0.01"}), 403)

    # --- a LoRA adapter, uploaded by the organisation's admin --------------------------------
    files = lora_files()
    r = tenant.post(
        f"/organizations/{org_id}/adapters",
        data={"name": ADAPTER, "model": MODEL},
        files=[("file", (n, content, "application/octet-stream")) for n, content in files.items()],
    )
    adapter = check(r, 201)
    assert (adapter["org_id"], adapter["name"], adapter["rank"]) == (org_id, ADAPTER, 4)
    assert [a["id"] for a in check(tenant.get(f"/organizations/{org_id}/adapters"))] == [adapter["id"]]

    # --- a dedicated deployment of the organisation ------------------------------------------
    dep = check(
        tenant.post(
            "/deployments",
            json={
                "name": DEDICATED,
                "model": MODEL,
                "type": "dedicated",
                "gpu_type": GPU_TYPE,
                "min_replicas": 1,
                "max_replicas": 1,
                "adapters": [adapter["id"]],
            },
        ),
        201,
    )
    assert (dep["org_id"], dep["type"], dep["gpu_type"], dep["status"]) == (
        org_id,
        "dedicated",
        GPU_TYPE,
        "active",
    )
    assert dep["adapters"] == [adapter["id"]]
    shared = next(
        d for d in check(root.get("/deployments")) if d["type"] == "serverless" and d["name"] == MODEL
    )

    client = server.openai(secret)
    listed = {m.id for m in client.models.list()}
    assert {MODEL, DEDICATED, ADAPTER} <= listed, listed
    # another tenant (the platform admin's default organisation) sees neither
    assert not {DEDICATED, ADAPTER} & {m.id for m in server.openai(server.root_key).models.list()}

    # --- a worker for the dedicated deployment, by hand ---------------------------------------
    worker_id = f"e2e-dedicated-{os.getpid()}"
    worker = start_worker(server, dep["id"], worker_id)

    def announced() -> tuple[Any, ...] | None:
        if worker.poll() is not None:
            raise AssertionError(f"the worker exited with {worker.returncode}")
        rows = server.query("SELECT deployment_id, status FROM workers WHERE id = ?", worker_id)
        return rows[0] if rows else None

    assert wait_until("the worker's announcement", announced, timeout=180) == (dep["id"], "running")

    # --- traffic with the organisation's key -------------------------------------------------
    used = send_traffic(client)
    n_requests = len(used)

    def ledger_rows() -> list[tuple[Any, ...]] | None:
        rows = server.query(
            "SELECT request_id, deployment_id, prompt_tokens, cached_tokens, completion_tokens,"
            " status, adapter FROM usage_events WHERE org_id = ?",
            org_id,
        )
        return rows if len(rows) >= n_requests else None

    ledger = wait_until("the usage events in the ledger", ledger_rows, timeout=30)
    assert len(ledger) == n_requests
    assert {row[1] for row in ledger} == {shared["id"], dep["id"]}
    assert all(row[5] == "ok" and row[6] is None for row in ledger)

    # --- stop the worker; its lifetime is recorded -------------------------------------------
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0

    def stopped() -> tuple[Any, ...] | None:
        rows = server.query(
            "SELECT status, started_at, stopped_at, gpu_type FROM workers WHERE id = ?", worker_id
        )
        return rows[0] if rows and rows[0][0] == "stopped" else None

    _, started_at, stopped_at, _worker_gpu = wait_until("the worker's departure", stopped, timeout=30)
    started, ended = parse_db_time(started_at), parse_db_time(stopped_at)
    assert t0 < started < ended <= datetime.now(UTC)
    gpu_seconds = seconds(ended - started)

    # --- roll up, generate, finalize ---------------------------------------------------------
    t1 = datetime.now(UTC)
    month = t0.strftime("%Y-%m")
    assert t1.strftime("%Y-%m") == month, "the journey outlasted the margin before the month's end"
    span = {"from": iso(t0 - timedelta(hours=1)), "to": iso(t1 + timedelta(hours=1))}

    def roll_up() -> Any:
        r = root.post("/rollups", json=span)
        assert r.status_code in (200, 201), r.text  # the README says neither
        return r.json()

    rolled = roll_up()
    assert rolled["rows"] > 0 and rolled["inserted"] == rolled["rows"]
    again = roll_up()  # a rerun changes nothing
    assert (again["rows"], again["inserted"], again["updated"], again["deleted"]) == (rolled["rows"], 0, 0, 0)

    generated = check(root.post("/invoices/generate", json={"month": month}))
    invoices = check(root.get("/invoices", params={"org": org_id, "month": month}))
    assert len(invoices) == 1, invoices
    invoice_id = invoices[0]["id"]
    assert invoice_id in generated["created"]
    assert invoices[0]["status"] == "draft" and invoices[0]["number"] is None
    # the month is not over: finalizing needs force
    refused = check(root.post(f"/invoices/{invoice_id}/finalize"), 409)
    assert refused["error"]["code"] == "period_not_over"
    invoice = check(root.post(f"/invoices/{invoice_id}/finalize", params={"force": "true"}))
    assert invoice["status"] == "finalized" and invoice["number"].startswith("TM-")
    assert invoice["org_id"] == org_id and invoice["currency"] == "usd"
    # the organisation's admin reads the same frozen invoice
    assert check(tenant.get(f"/invoices/{invoice_id}")) == invoice

    # --- export usage as CSV -----------------------------------------------------------------
    export_range = {"from": iso(t0 - timedelta(minutes=1)), "to": iso(t1 + timedelta(minutes=1))}
    r = root.get("/exports/usage", params={"format": "csv", "org": org_id, **export_range})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/csv")
    exported = list(csv.DictReader(io.StringIO(r.text)))
    # the organisation's admin exports the same rows (and only its own)
    r2 = tenant.get("/exports/usage", params={"format": "csv", **export_range})
    assert r2.status_code == 200, r2.text
    assert list(csv.DictReader(io.StringIO(r2.text))) == exported

    # --- reconcile ---------------------------------------------------------------------------
    def sums(rows: list[tuple[str, int, int, int]], deployment_id: str) -> tuple[int, int, int]:
        mine = [r for r in rows if r[0] == deployment_id]
        return sum(r[1] for r in mine), sum(r[2] for r in mine), sum(r[3] for r in mine)

    ledger_tokens = [(str(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in ledger]
    csv_tokens = [
        (e["deployment_id"], int(e["prompt_tokens"]), int(e["cached_tokens"]), int(e["completion_tokens"]))
        for e in exported
    ]
    ids = {"shared": shared["id"], "dedicated": dep["id"]}
    response_tokens = [(ids[u.deployment], u.prompt, u.cached, u.completion) for u in used]
    # the CSV is the ledger, row for row; the ledger is what the responses reported
    assert len(exported) == n_requests
    assert {e["request_id"] for e in exported} == {str(r[0]) for r in ledger}
    assert all(e["org_id"] == org_id and e["status"] == "ok" for e in exported)
    assert sorted(csv_tokens) == sorted(ledger_tokens)
    for dep_id in ids.values():
        assert sums(csv_tokens, dep_id) == sums(ledger_tokens, dep_id) == sums(response_tokens, dep_id)

    prompt, cached, completion = sums(ledger_tokens, shared["id"])
    assert cached > 0, "the repeated prompt was not served from the prefix cache"
    expected = [
        ("input", shared["id"], Decimal(prompt - cached), INPUT_PRICE, MILLION),
        ("cached_input", shared["id"], Decimal(cached), CACHED_PRICE, MILLION),
        ("output", shared["id"], Decimal(completion), OUTPUT_PRICE, MILLION),
        # the dedicated deployment: its worker's lifetime at the GPU-hour price, its tokens free
        ("gpu_seconds", dep["id"], gpu_seconds, GPU_HOUR, Decimal(3600)),
    ]
    expected_lines = [
        (meter, dep_id, MODEL, quantity, unit_price, cents(quantity * unit_price / per))
        for meter, dep_id, quantity, unit_price, per in expected
        if quantity
    ]
    got_lines = [
        (
            line["meter"],
            line["deployment_id"],
            line["model"],
            Decimal(str(line["quantity"])),
            Decimal(str(line["unit_price"])),
            Decimal(str(line["amount"])),
        )
        for line in invoice["lines"]
    ]
    assert got_lines == expected_lines
    assert all(line["adapter"] is None for line in invoice["lines"])
    assert invoice["lines"][-1]["unit"] == "GPU-hour"
    total = sum((line[-1] for line in expected_lines), Decimal(0))
    assert total > 0
    assert Decimal(str(invoice["total"])) == Decimal(str(invoice["subtotal"])) == total
    # every amount is whole cents, exactly as in the invoices export
    r = root.get("/exports/invoices", params={"format": "csv", "org": org_id, "from": month})
    assert r.status_code == 200, r.text
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert [Decimal(x["line_amount"]) for x in rows] == [line[-1] for line in expected_lines]
    assert {(x["number"], x["status"], Decimal(x["total"])) for x in rows} == {
        (invoice["number"], "finalized", total)
    }

    # no secret in the audit log of this journey
    audit = root.get("/audit", params={"org_id": org_id, "limit": 500})
    assert audit.status_code == 200, audit.text
    assert audit.json()["data"]
    assert secret not in audit.text and secret[11:] not in audit.text and password not in audit.text
