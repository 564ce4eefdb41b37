"""No secret in any log (issue 5, acceptance 6): `tokenmill serve` as a subprocess at DEBUG,
with Stripe configured (recognisable fake key and webhook secret, the API pointed at the
local fake Stripe), through a full journey: an organisation, a user with a password (and a
new one), keys created, rotated and revoked, a wrong key and a revoked key refused, chat
traffic, Stripe webhooks with a bad and with a good signature, rollups, an invoice generated
and finalized, exports. Everything the server and its worker subprocesses print (stdout and
stderr, which the server's children share) and the whole audit log are then searched for
every API key secret, the passwords, the Stripe key, the webhook secret, and the internal
token and secret key of TOKENMILL_HOME/secrets.json. The bootstrap admin key is printed
once on purpose at the first start (the only way to learn it): there and nowhere else.
Nor is any prompt's text in them.

The journey runs twice: with readable text logs (the default), and with
TOKENMILL_LOG_FORMAT=json (issue 20, acceptance 3), where every line logged while the journey's
inference requests ran is a JSON object, and each line of a request carries its request id.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.billing.fake_stripe import FakeStripe
from tests.e2e.clock import wait_out_month_end
from tests.e2e.test_admin_journey import _free_port, _pump, _stop_process, check, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
API = "/admin/v1"
STRIPE_KEY = "sk_test_LEAKCANARY" + secrets.token_hex(12)
WEBHOOK_SECRET = "whsec_LEAKCANARY" + secrets.token_hex(12)
PASSWORD = "canary-password-" + secrets.token_hex(6)
NEW_PASSWORD = "canary-password-2-" + secrets.token_hex(6)
PROMPT = "canary-prompt-" + secrets.token_hex(6)  # in every prompt of the journey


def iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


class Serve:
    def __init__(
        self, proc: subprocess.Popen[str], url: str, home: Path, lines: list[str], log_format: str
    ) -> None:
        self.proc, self.url, self.home, self.lines = proc, url, home, lines
        self.log_format = log_format
        self.root_key = ""

    def admin(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.url + API, headers={"authorization": f"Bearer {key or self.root_key}"}, timeout=120
        )


@pytest.fixture
def stripe() -> Iterator[FakeStripe]:
    with FakeStripe(api_key=STRIPE_KEY) as fake:
        yield fake


@pytest.fixture(params=["text", "json"])
def serve(
    request: pytest.FixtureRequest, tmp_path: Path, model_cache: Path, stripe: FakeStripe
) -> Iterator[Serve]:
    port = _free_port()
    home = tmp_path / "home"
    env = {
        **os.environ,
        "TOKENMILL_HOME": str(home),
        "TOKENMILL_MODEL_CACHE": str(model_cache),
        "TOKENMILL_PORT": str(port),
        "TOKENMILL_TORCH_THREADS": "1",
        "TOKENMILL_EMBED_MODEL": "",
        "TOKENMILL_LOG_LEVEL": "DEBUG",
        "TOKENMILL_LOG_FORMAT": request.param,
        "TOKENMILL_STRIPE_API_KEY": STRIPE_KEY,
        "TOKENMILL_STRIPE_WEBHOOK_SECRET": WEBHOOK_SECRET,
        "TOKENMILL_STRIPE_API_BASE": stripe.url,
        "PYTHONUNBUFFERED": "1",
    }
    for var in ("DATABASE_URL", "REDIS_URL", "TOKENMILL_INTERNAL_TOKEN", "TOKENMILL_SECRET_KEY"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # all output, the worker subprocesses' too (they inherit it)
        text=True,
    )
    lines: list[str] = []
    _pump(proc, lines, "serve")
    server = Serve(proc, f"http://127.0.0.1:{port}", home, lines, request.param)

    def ready() -> bool | None:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n" + "\n".join(lines))
        server.root_key = next((ln.strip() for ln in lines if ln.startswith("tm-")), "")
        try:
            health = httpx.get(f"{server.url}/health", timeout=2).json()
        except httpx.HTTPError:
            return None
        return True if server.root_key and health.get("workers", 0) >= 1 else None

    try:
        wait_until("serve to be ready", ready, timeout=300, every=0.3)
        yield server
    finally:
        _stop_process(proc)


def all_audit(root: httpx.Client) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 500}
    while True:
        page = check(root.get("/audit", params=params))
        out += page["data"]
        if not page["has_more"]:
            return out
        params["after"] = page["last_id"]


def test_no_secret_in_the_logs_or_the_audit_log(serve: Serve, stripe: FakeStripe) -> None:
    wait_out_month_end()  # the whole journey's usage goes on one monthly invoice
    t0 = datetime.now(UTC)
    root = serve.admin()
    created: list[str] = []  # every API key secret of the journey

    # --- tenant, user and password, keys created / rotated / revoked ------------------------
    org = check(root.post("/organizations", json={"name": "canary-org"}), 201)
    user = check(
        root.post(
            f"/organizations/{org['id']}/users",
            json={"email": "ops@canary.test", "password": PASSWORD, "role": "org_admin"},
        ),
        201,
    )
    check(root.patch(f"/users/{user['id']}", json={"password": NEW_PASSWORD}))
    admin_key = check(
        root.post(f"/organizations/{org['id']}/keys", json={"role": "org_admin", "user_id": user["id"]}), 201
    )
    created.append(admin_key["secret"])
    tenant = serve.admin(admin_key["secret"])
    member = check(tenant.post(f"/organizations/{org['id']}/keys", json={"name": "app"}), 201)
    created.append(member["secret"])
    rotated = check(tenant.post(f"/keys/{member['id']}/rotate"), 201)
    created.append(rotated["secret"])
    spare = check(tenant.post(f"/organizations/{org['id']}/keys", json={"name": "spare"}), 201)
    created.append(spare["secret"])
    check(tenant.patch(f"/keys/{spare['id']}", json={"max_concurrent": 2}))
    check(tenant.delete(f"/keys/{spare['id']}"))

    # --- refused keys: a wrong one, a rotated-out one, a revoked one, a member on /admin -----
    wrong = "tm-" + secrets.token_urlsafe(36)
    created.append(wrong)
    for bad in (wrong, member["secret"], spare["secret"]):
        r = httpx.get(f"{serve.url}/v1/models", headers={"authorization": f"Bearer {bad}"}, timeout=30)
        assert r.status_code == 401, r.text
        assert serve.admin(bad).get("/organizations").status_code == 401
    assert serve.admin(rotated["secret"]).get("/organizations").status_code == 403

    # --- chat traffic ----------------------------------------------------------------------
    # (priced first: usage is billed at the price in effect when it happened)
    check(
        root.post("/prices/models", json={"model": MODEL, "input_per_mtok": "1.5", "output_per_mtok": "2"}),
        201,
    )
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key=rotated["secret"], max_retries=0, timeout=120)
    traffic_from = len(serve.lines)
    request_ids = []
    for prompt in ("Say hello.", "Name a colour."):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{prompt} {PROMPT}"}],
            max_tokens=4,
            temperature=0,
        )
        request_ids.append(raw.headers["x-request-id"])
        r = raw.parse()
        assert r.usage is not None and r.usage.completion_tokens > 0
    raw_stream = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Count to three. {PROMPT}"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    request_ids.append(raw_stream.headers["x-request-id"])
    chunks = list(raw_stream.parse())
    assert chunks[-1].usage is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{serve.url}/v1", api_key=wrong, max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hi {PROMPT}"}], max_tokens=2
        )
    time.sleep(1.0)  # the requests' last lines through the pipe
    traffic = serve.lines[traffic_from:]

    # --- Stripe webhooks: a forged signature (400) and a genuine one ----------------------
    event = json.dumps(stripe.event("invoice.paid", {"id": "in_canary", "object": "invoice"})).encode()
    r = httpx.post(
        f"{serve.url}/webhooks/stripe",
        content=event,
        headers={
            "stripe-signature": FakeStripe.sign(event, "whsec_wrong"),
            "content-type": "application/json",
        },
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_signature", r.text
    r = httpx.post(
        f"{serve.url}/webhooks/stripe",
        content=event,
        headers={
            "stripe-signature": FakeStripe.sign(event, WEBHOOK_SECRET),
            "content-type": "application/json",
        },
    )
    assert r.status_code == 200, r.text

    # --- billing: prices, rollups, invoice, exports --------------------------------------

    def ledger() -> bool | None:
        r = root.get("/exports/usage", params={"format": "json", "org": org["id"]})
        return True if r.status_code == 200 and len(r.json()) >= 3 else None

    wait_until("the usage in the ledger", ledger, timeout=30)
    t1 = datetime.now(UTC)
    span = {"from": iso(t0 - timedelta(hours=1)), "to": iso(t1 + timedelta(hours=1))}
    assert root.post("/rollups", json=span).status_code in (200, 201)
    month = t0.strftime("%Y-%m")
    assert t1.strftime("%Y-%m") == month, "the journey outlasted the margin before the month's end"
    check(root.post("/invoices/generate", json={"month": month}))
    (invoice,) = check(root.get("/invoices", params={"org": org["id"], "month": month}))
    check(root.post(f"/invoices/{invoice['id']}/finalize", params={"force": "true"}))
    for what in ("usage", "rollups", "invoices"):
        assert tenant.get(f"/exports/{what}", params={"format": "csv"}).status_code == 200
    audit = all_audit(root)
    time.sleep(1.0)  # let the last lines through the pipe

    # --- search everything ---------------------------------------------------------------
    stored = json.loads((serve.home / "secrets.json").read_text())
    searched = {
        "the Stripe API key": STRIPE_KEY,
        "the Stripe webhook secret": WEBHOOK_SECRET,
        "the internal token": stored["internal_token"],
        "the secret key": stored["secret_key"],
        "the password": PASSWORD,
        "the new password": NEW_PASSWORD,
    }
    for i, secret in enumerate(created):
        searched[f"API key {i} ({secret[:11]})"] = secret
        searched[f"API key {i}'s part after its prefix"] = secret[11:]
    # What stands for them is secret too (README, audit log): key hashes, password hashes,
    # organisations' cache salts.
    db = sqlite3.connect(f"file:{serve.home / 'tokenmill.db'}?mode=ro", uri=True, timeout=30)
    try:
        for (value,) in db.execute("SELECT hash FROM api_keys"):
            searched[f"an API key hash ({value[:8]}...)"] = value
        for (value,) in db.execute("SELECT password_hash FROM users WHERE password_hash IS NOT NULL"):
            searched["a password hash"] = value
        for (value,) in db.execute("SELECT cache_salt FROM organizations"):
            searched["an organisation's cache salt"] = value
    finally:
        db.close()
    searched["the bootstrap admin key"] = serve.root_key
    searched["the bootstrap admin key's part after its prefix"] = serve.root_key[11:]
    for name, value in searched.items():
        assert len(value) >= 16, name  # so a hit cannot be a coincidence

    # The bootstrap key is printed once, alone on its line, on purpose; no other line has it.
    shown = [ln for ln in serve.lines if serve.root_key[11:] in ln]
    assert [ln.strip() for ln in shown] == [serve.root_key], shown
    lines = [ln for ln in serve.lines if ln.strip() != serve.root_key]
    # The lines as written and, for JSON lines, as read (JSON escapes what a search would miss).
    logs = "\n".join(lines + [text for ln in lines for text in _texts(ln)])
    audit_text = json.dumps(audit)

    # The search was over real logs: DEBUG output of the server, its worker and this journey.
    assert len(serve.lines) > 50, serve.lines
    assert any("DEBUG" in ln for ln in serve.lines), "nothing logged at DEBUG"
    # the access log (on at DEBUG) shows the journey's requests
    assert '"POST /admin/v1/organizations HTTP' in logs, "the journey left no trace"
    assert '"POST /webhooks/stripe HTTP' in logs, "no webhook trace"
    assert "workers.main" in logs, "nothing from the worker subprocess"
    if serve.log_format == "json":
        check_json_lines(traffic, request_ids)
    assert {(e["action"], e["resource_type"]) for e in audit} >= {
        ("create", "user"),
        ("update", "user"),
        ("rotate", "api_key"),
        ("revoke", "api_key"),
        ("finalize", "invoice"),
    }

    searched["the prompts' text"] = PROMPT
    leaks = [
        f"{name} in {where}"
        for name, value in searched.items()
        for where, text in (("the server's output", logs), ("the audit log", audit_text))
        if value in text
    ]
    assert leaks == [], leaks


def _texts(line: str) -> list[str]:
    """What a JSON log line says, unescaped: its values."""
    if not line.startswith("{"):
        return []
    try:
        return [str(v) for v in json.loads(line).values()]
    except ValueError:
        return []


def check_json_lines(traffic: list[str], request_ids: list[str]) -> None:
    """Every line logged while the inference requests ran (server, gateway, workers, engine) is
    a JSON object with ts, level, logger and message; each line of a request (the gateway's
    access log of /v1, anything logged with a request id) carries its own request's id, and
    no line of another kind (heartbeats on the internal bus) carries one."""
    assert traffic, "nothing logged while the requests ran"
    parsed = []
    for line in traffic:
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(obj, dict) and {"ts", "level", "logger", "message"} <= obj.keys(), line
        parsed.append(obj)
    access = [o for o in parsed if o["logger"] == "uvicorn.access"]
    of_v1 = [o for o in access if '"POST /v1/' in o["message"]]
    assert len(of_v1) == len(request_ids) + 1, of_v1  # and the refused key's request
    assert all(o.get("request_id", "").startswith(("chatcmpl-", "req_")) for o in of_v1), of_v1
    for rid in request_ids:
        mine = [o for o in parsed if o.get("request_id") == rid]
        assert mine, f"no line carries {rid}"
        assert all(o.get("model") == MODEL for o in mine if o["logger"] == "uvicorn.access"), mine
    others = [o for o in access if "/v1/" not in o["message"]]
    assert all("request_id" not in o for o in others), others
