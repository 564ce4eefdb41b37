"""What the pages do, in process: keys (secret shown once, revoke and rotate reach the
gateway), adapter upload, users, deployments, prices and plans, invoice downloads; and the
aggregation behind the charts against the ledger, on SQLite and PostgreSQL."""

from __future__ import annotations

import html
import random
import re
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.common import month_bounds
from billing.invoices.services import build_invoice_drafts
from billing.ledger.services import record_usage
from billing.prices.services import PriceBook
from billing.rollups.services import store_rollups
from dashboard import charts
from dashboard.services import DAY, HOUR, UsageFilter, usage_series, window
from tests.control_plane.conftest import GPU, MODEL, AdminEnv, lora_files
from tests.dashboard.conftest import Session, add_user, csrf_of, sign_in
from tokenmill.errors import APIError
from tokenmill.protocol import UsageRecord

API = "/admin/v1"


async def _root(env: AdminEnv) -> Session:
    await add_user(env, env.default_org, "root@example.com", "platform_admin")
    return await sign_in(str(env.client.base_url), "root@example.com")


def _flash(html: str) -> str:
    found = re.search(r'class="flash (ok|error)"[^>]*>([^<]*)<', html)
    assert found, "no message on the page"
    return f"{found.group(1)}: {found.group(2)}"


async def _follow(s: Session, r: Any) -> str:
    assert r.status_code == 303, r.text[:1000]
    return (await s.client.get(r.headers["location"], follow_redirects=True)).text


async def test_key_secret_shown_once_and_revoke_and_rotate_reach_the_gateway(env: AdminEnv) -> None:
    s = await _root(env)
    r = await s.post("/keys", {"org": env.default_org, "name": "app", "scopes": f"{MODEL}"})
    assert r.status_code == 303  # to the page showing the secret (tests/dashboard/test_keys_flow.py)
    shown = await s.get(r.headers["location"].removeprefix("/dashboard"))
    secret = re.search(r'id="new-secret"[^>]*>(tm-[A-Za-z0-9]+)<', shown.text)
    assert secret, shown.text
    key = secret.group(1)
    assert "no-store" in shown.headers["cache-control"]
    listing = (await s.get("/keys")).text
    assert key[:11] in listing and key not in listing and key[11:] not in listing
    models = await env.client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [MODEL]
    key_id = re.search(rf'data-key="([^"]+)" data-prefix="{key[:11]}"', listing)
    assert key_id
    # rotate: a new secret, shown once; the old one stops working
    r = await s.post(f"/keys/{key_id.group(1)}/rotate")
    assert r.status_code == 303
    rotated = re.search(r'id="new-secret"[^>]*>(tm-[A-Za-z0-9]+)<', await _follow(s, r))
    assert rotated and rotated.group(1) != key
    new = rotated.group(1)
    assert (await env.client.get("/v1/models", headers={"authorization": f"Bearer {key}"})).status_code == 401
    assert (await env.client.get("/v1/models", headers={"authorization": f"Bearer {new}"})).status_code == 200
    # revoke the new one from the list
    listing = (await s.get("/keys")).text
    new_id = re.search(rf'data-key="([^"]+)" data-prefix="{new[:11]}"', listing)
    assert new_id
    text = await _follow(s, await s.post(f"/keys/{new_id.group(1)}/revoke"))
    assert _flash(text).startswith("ok: Revoked key")
    assert (await env.client.get("/v1/models", headers={"authorization": f"Bearer {new}"})).status_code == 401
    # the audit log names the dashboard user who acted
    audit = (await env.client.get(f"{API}/audit", headers=env.root, params={"action": "revoke"})).json()
    assert audit["data"][0]["actor_user_id"] is not None and audit["data"][0]["actor_key_id"] is None
    # bad input comes back as a message, nothing created
    text = await _follow(s, await s.post("/keys", {"org": env.default_org, "expires_at": "2001-01-01"}))
    assert _flash(text) == "error: expires_at must be in the future."
    await s.client.aclose()


async def test_adapter_upload_as_the_page_script_sends_it(env: AdminEnv) -> None:
    s = await _root(env)
    token = csrf_of((await s.get("/models")).text)
    files = lora_files()
    parts = {
        "config": ("adapter_config.json", files["adapter_config.json"], "application/json"),
        "weights": (
            "adapter_model.safetensors",
            files["adapter_model.safetensors"],
            "application/octet-stream",
        ),
    }
    # the script posts the form by XHR with the token as a header
    r = await s.client.post(
        "/dashboard/adapters",
        data={"org": env.default_org, "name": "support-bot", "model": MODEL},
        files=parts,
        headers={"x-csrftoken": token},
    )
    text = await _follow(s, r)
    assert _flash(text) == "ok: Uploaded adapter support-bot (rank 4); use it as the model name."
    assert 'data-adapter="' in text and "support-bot" in text
    listed = (
        await env.client.get(f"{API}/organizations/{env.default_org}/adapters", headers=env.root)
    ).json()
    assert [a["name"] for a in listed] == ["support-bot"]
    # an adapter the base model cannot take is refused with the reason, nothing stored
    bad = lora_files(rank=4, shapes={"q_proj": (100, 576)})
    parts["weights"] = (
        "adapter_model.safetensors",
        bad["adapter_model.safetensors"],
        "application/octet-stream",
    )
    r = await s.client.post(
        "/dashboard/adapters",
        data={"org": env.default_org, "name": "broken", "model": MODEL},
        files=parts,
        headers={"x-csrftoken": token},
    )
    assert _flash(await _follow(s, r)).startswith("error: ")
    # delete it
    text = await _follow(s, await s.post(f"/adapters/{listed[0]['id']}/delete"))
    assert _flash(text) == "ok: Deleted adapter support-bot."
    assert (
        await env.client.get(f"{API}/organizations/{env.default_org}/adapters", headers=env.root)
    ).json() == []
    await s.client.aclose()


async def test_organisations_users_plans_and_prices(env: AdminEnv) -> None:
    s = await _root(env)
    text = await _follow(s, await s.post("/orgs", {"name": "acme"}))
    assert _flash(text) == "ok: Created organisation acme."
    org = next(
        o
        for o in (await env.client.get(f"{API}/organizations", headers=env.root)).json()
        if o["name"] == "acme"
    )
    text = await _follow(
        s,
        await s.post(
            f"/orgs/{org['id']}/users", {"email": "a@acme.test", "password": "p" * 10, "role": "org_admin"}
        ),
    )
    assert _flash(text) == "ok: Created user a@acme.test."
    text = await _follow(
        s, await s.post(f"/orgs/{org['id']}/users", {"email": "b@acme.test", "password": "short"})
    )
    assert _flash(text) == "error: The password needs at least 8 characters."
    user = (await env.client.get(f"{API}/organizations/{org['id']}/users", headers=env.root)).json()[0]
    await _follow(s, await s.post(f"/users/{user['id']}", {"role": "member"}))
    await _follow(s, await s.post(f"/users/{user['id']}", {"disabled": "true"}))
    got = (await env.client.get(f"{API}/users/{user['id']}", headers=env.root)).json()
    assert (got["role"], got["disabled"]) == ("member", True)
    # plans, prices, a plan assigned, suspension
    text = await _follow(
        s, await s.post("/plans", {"name": "pro", "requests_per_minute": "100", "monthly_budget": "50"})
    )
    assert _flash(text) == "ok: Created plan pro."
    plan = (await env.client.get(f"{API}/plans", headers=env.root)).json()[0]
    assert (plan["requests_per_minute"], Decimal(str(plan["monthly_budget"]))) == (100, Decimal(50))
    await _follow(s, await s.post(f"/orgs/{org['id']}/plan", {"plan_id": plan["id"]}))
    await _follow(s, await s.post(f"/orgs/{org['id']}/status", {"status": "suspended"}))
    got = (await env.client.get(f"{API}/organizations/{org['id']}", headers=env.root)).json()
    assert (got["plan_id"], got["status"]) == (plan["id"], "suspended")
    text = await _follow(
        s,
        await s.post("/prices/models", {"model": MODEL, "input_per_mtok": "0.5", "output_per_mtok": "1.25"}),
    )
    assert _flash(text) == f"ok: New price of {MODEL} in effect from now."
    text = await _follow(s, await s.post("/prices/gpus", {"gpu_type": "a100", "per_hour": "2.5"}))
    assert _flash(text) == "ok: New price of a100 in effect from now."
    page = (await s.get("/prices")).text
    assert "1.25" in page and "a100" in page and "pro" in page
    assert 'data-batch-discount="0.5' in page and "50.00%" in page  # the default
    # a batch discount set on the form, and one out of range refused with the service's reason
    text = await _follow(
        s,
        await s.post(
            "/prices/models",
            {"model": MODEL, "input_per_mtok": "1", "output_per_mtok": "2", "batch_discount": "0.25"},
        ),
    )
    assert _flash(text) == f"ok: New price of {MODEL} in effect from now."
    prices = (await env.client.get(f"{API}/prices/models", headers=env.root)).json()
    newest = max(prices, key=lambda p: p["effective_from"])
    assert Decimal(str(newest["batch_discount"])) == Decimal("0.25")
    assert "25.00%" in (await s.get("/prices")).text
    text = await _follow(
        s,
        await s.post(
            "/prices/models",
            {"model": MODEL, "input_per_mtok": "1", "output_per_mtok": "2", "batch_discount": "1.5"},
        ),
    )
    assert _flash(text).startswith("error: "), text
    assert len((await env.client.get(f"{API}/prices/models", headers=env.root)).json()) == len(prices)
    text = await _follow(s, await s.post("/prices/gpus", {"gpu_type": "a100", "per_hour": "lots"}))
    assert _flash(text) == "error: per_hour must be a number."
    await s.client.aclose()


async def test_dedicated_deployment_forms(env: AdminEnv) -> None:
    s = await _root(env)
    r = await s.post(
        "/deployments",
        {
            "name": "mine",
            "model": MODEL,
            "org": env.default_org,
            "gpu_type": GPU,
            "min_replicas": "0",
            "max_replicas": "2",
        },
    )
    assert r.status_code == 303 and re.fullmatch(r"/dashboard/deployments/dep_\w+", r.headers["location"])
    dep_id = r.headers["location"].rsplit("/", 1)[1]
    assert _flash(await _follow(s, r)) == "ok: Created dedicated deployment mine; use it as the model name."
    text = await _follow(
        s, await s.post(f"/deployments/{dep_id}", {"min_replicas": "3", "max_replicas": "2"})
    )
    assert _flash(text) == "error: min_replicas (3) exceeds max_replicas (2)."
    text = await _follow(
        s, await s.post(f"/deployments/{dep_id}", {"max_replicas": "4", "status": "stopped"})
    )
    assert _flash(text) == "ok: Updated mine: 0 to 4 replicas, stopped, builtin engine, 1 GPU per replica."
    text = await _follow(s, await s.post("/deployments", {"name": "bad name!", "model": MODEL}))
    assert _flash(text).startswith("error: Invalid value")
    # the admin API's rules: a GPU type from the price book
    text = await _follow(
        s, await s.post("/deployments", {"name": "free", "model": MODEL, "org": env.default_org})
    )
    assert _flash(text).startswith("error: A dedicated deployment needs a gpu_type from the price book")
    await s.client.aclose()


def _cells(html: str, dep_id: str) -> list[str]:
    """The cells of a deployment's row in the deployments table."""
    row = re.search(rf'<tr data-deployment="{dep_id}">(.*?)</tr>', html, re.S)
    assert row, f"no row for {dep_id}"
    return [
        re.sub(r"<[^>]+>", "", c).strip()
        for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row.group(1), re.S)
    ]


async def test_deployment_engine_forms(env: AdminEnv) -> None:
    s = await _root(env)
    form = {"name": "big", "model": MODEL, "org": env.default_org, "gpu_type": GPU, "min_replicas": "0"}
    args = "tensor_parallel_size=2\r\nquantization=awq\r\n\r\nenable_prefix_caching=false"
    r = await s.post("/deployments", form | {"engine": "vllm", "engine_args": args, "gpus_per_replica": ""})
    assert r.status_code == 303 and "/deployments/dep_" in r.headers["location"], r.text
    dep_id = r.headers["location"].rsplit("/", 1)[1]
    page = await _follow(s, r)
    assert re.search(r'id="engine">vllm<', page) and re.search(r'id="gpus-per-replica">2<', page)
    assert (
        '<dd id="engine-args"><code>tensor_parallel_size=2</code>, <code>quantization=awq</code>, '
        "<code>enable_prefix_caching=false</code></dd>"
    ) in page
    # the edit form holds what is set, so saving it unchanged changes nothing
    assert "tensor_parallel_size=2\nquantization=awq\nenable_prefix_caching=false</textarea>" in page
    assert 'name="gpus_per_replica" type="number" min="0" max="64" value="2"' in page
    assert 'value="vllm" selected' in page
    listing = await s.get("/deployments")
    cells = _cells(listing.text, dep_id)
    assert cells[0] == "big" and cells[3:5] == ["vllm", "2"]
    api = (await env.client.get(f"{API}/deployments/{dep_id}", headers=env.root)).json()
    assert api["engine_args"] == {
        "tensor_parallel_size": 2,
        "quantization": "awq",
        "enable_prefix_caching": False,
    }

    edit = {"min_replicas": "0", "max_replicas": "1", "status": "active", "engine": "vllm"}
    text = await _follow(
        s,
        await s.post(
            f"/deployments/{dep_id}",
            edit | {"engine_args": "tensor_parallel_sise=4", "gpus_per_replica": "2"},
        ),
    )
    assert html.unescape(_flash(text)).startswith(
        "error: Unknown vLLM engine argument 'tensor_parallel_sise'"
    )
    text = await _follow(
        s,
        await s.post(
            f"/deployments/{dep_id}", edit | {"engine_args": "tensor_parallel_size", "gpus_per_replica": "2"}
        ),
    )
    assert _flash(text).startswith("error: Write engine arguments as name=value")
    text = await _follow(
        s,
        await s.post(
            f"/deployments/{dep_id}",
            edit | {"engine_args": "tensor_parallel_size=4", "gpus_per_replica": "2"},
        ),
    )
    assert _flash(text).startswith("error: gpus_per_replica (2) is below what one replica spans")
    text = await _follow(
        s,
        await s.post(
            f"/deployments/{dep_id}",
            edit | {"engine_args": "tensor_parallel_size=4", "gpus_per_replica": "4"},
        ),
    )
    assert _flash(text) == "ok: Updated big: 0 to 1 replicas, active, vllm engine, 4 GPUs per replica."
    # back to builtin: the arguments still in the box are vLLM's, and go
    text = await _follow(
        s,
        await s.post(
            f"/deployments/{dep_id}",
            edit | {"engine": "builtin", "engine_args": "tensor_parallel_size=4", "gpus_per_replica": "4"},
        ),
    )
    assert _flash(text) == "ok: Updated big: 0 to 1 replicas, active, builtin engine, 4 GPUs per replica."
    assert re.search(r'id="engine-args">—<', text)
    api = (await env.client.get(f"{API}/deployments/{dep_id}", headers=env.root)).json()
    assert (api["engine"], api["engine_args"], api["gpus_per_replica"]) == ("builtin", {}, 4)
    await s.client.aclose()


async def test_invoice_downloads_match_the_admin_api(env: AdminEnv) -> None:
    s = await _root(env)
    deps = (await env.client.get(f"{API}/deployments", headers=env.root)).json()
    sm = env.app.state.sessionmaker
    now = datetime.now(UTC)
    async with sm() as session, session.begin():
        await PriceBook(session).add_model_price(
            model_ref=MODEL, input_per_mtok=Decimal("3.3"), output_per_mtok=Decimal("7.7"),
            effective_from=now - timedelta(days=40),
        )  # fmt: skip
        start = month_bounds(now)[0].timestamp()
        await record_usage(
            session,
            [
                UsageRecord(
                    request_id=f"r{i}",
                    org_id=env.default_org,
                    model=MODEL,
                    deployment_id=deps[0]["id"],
                    prompt_tokens=123_457 * (i + 1),
                    completion_tokens=54_321,
                    ts=max(start + 1, time.time() - i),
                )
                for i in range(3)
            ],
        )
    async with sm() as session, session.begin():
        await store_rollups(session, month_bounds(now)[0], now + timedelta(hours=1))
        await build_invoice_drafts(session, now)
    (listed,) = (await env.client.get(f"{API}/invoices", headers=env.root)).json()
    api = (await env.client.get(f"{API}/invoices/{listed['id']}", headers=env.root)).json()
    page = (await s.get("/invoices")).text
    assert listed["id"] in page
    detail = (await s.get(f"/invoices/{listed['id']}")).text
    assert f"{Decimal(str(api['total'])):,} USD" in detail
    as_json = (await s.get(f"/invoices/{listed['id']}/download/json")).json()
    assert as_json["total"] == str(api["total"]) and len(as_json["lines"]) == len(api["lines"])
    assert [line["amount"] for line in as_json["lines"]] == [str(x["amount"]) for x in api["lines"]]
    as_csv = await s.get(f"/invoices/{listed['id']}/download/csv")
    assert as_csv.headers["content-disposition"] == f'attachment; filename="invoice-{listed["id"]}.csv"'
    exported = await env.client.get(
        f"{API}/exports/invoices", headers=env.root, params={"format": "csv", "from": now.strftime("%Y-%m")}
    )
    assert as_csv.text == exported.text  # one invoice: the same rows as the admin export
    await s.client.aclose()


# --- the numbers behind the charts -----------------------------------------------------------


async def test_usage_series_is_the_ledger_bucket_by_bucket(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    rng = random.Random(8)
    now = datetime.now(UTC)
    records = [
        UsageRecord(
            request_id=f"r{i}",
            org_id=rng.choice(["org_a", "org_b"]),
            model=rng.choice(["m1", "m2"]),
            api_key_id=rng.choice(["key_1", "key_2"]),
            prompt_tokens=rng.randint(1, 1000),
            cached_tokens=rng.randint(0, 1),
            completion_tokens=rng.randint(1, 100),
            status=rng.choice(["ok", "ok", "ok", "error", "cancelled"]),
            ts=(now - timedelta(seconds=rng.uniform(0, 9 * 86400))).timestamp(),
        )
        for i in range(600)
    ]
    async with migrated_db() as session, session.begin():
        await record_usage(session, records)

    def expect(win: Any, keep: Any) -> dict[datetime, list[int]]:
        out: dict[datetime, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
        for r in records:
            at = datetime.fromtimestamp(r.ts, UTC)
            if keep(r) and win.start <= at < win.end:
                b = datetime.fromtimestamp(int(r.ts) // win.bucket * win.bucket, UTC)
                failed = r.status not in ("ok", "cancelled")
                for i, n in enumerate((1, r.prompt_tokens, r.cached_tokens, r.completion_tokens, failed)):
                    out[b][i] += n
        return dict(out)

    async with migrated_db() as session:
        for win in (window("24h"), window("7d"), window(None, (now - timedelta(days=1)).date().isoformat())):
            for filt, keep in (
                (UsageFilter(), lambda r: True),
                (UsageFilter(org_id="org_a"), lambda r: r.org_id == "org_a"),
                (
                    UsageFilter(org_id="org_b", key_id="key_2"),
                    lambda r: r.org_id == "org_b" and r.api_key_id == "key_2",
                ),
                (UsageFilter(model="m1"), lambda r: r.model == "m1"),
            ):
                series = await usage_series(session, win, filt)
                got = {
                    b.at: [b.requests, b.prompt, b.cached, b.completion, b.errors]
                    for b in series.buckets
                    if b.requests
                }
                assert got == expect(win, keep), (win, filt)
                assert len(series.buckets) == (24 if win.bucket == HOUR and win.preset else len(win.starts()))
                # spend of a key or model name: the ledger priced (the rollups are per base model)
                filtered = filt.key_id is not None or filt.model is not None
                assert series.spend_from == ("ledger" if filtered else "rollups")


def test_windows() -> None:
    now = datetime(2026, 11, 22, 8, 30, tzinfo=UTC)
    day = window("24h", now=now)
    assert (day.start, day.end, day.bucket) == (
        datetime(2026, 11, 21, 9, tzinfo=UTC),
        datetime(2026, 11, 22, 9, tzinfo=UTC),
        HOUR,
    )
    assert len(day.starts()) == 24
    week = window("7d", now=now)
    assert (week.start, week.end, week.bucket, len(week.starts())) == (
        datetime(2026, 11, 16, tzinfo=UTC), datetime(2026, 11, 23, tzinfo=UTC), DAY, 7,
    )  # fmt: skip
    two = window(None, "2026-11-01", "2026-11-02", now=now)
    assert (two.bucket, len(two.starts()), two.from_date, two.to_date) == (
        HOUR,
        48,
        "2026-11-01",
        "2026-11-02",
    )
    assert window(None, "2026-10-01", "2026-10-31", now=now).bucket == DAY
    for start, end, param in (
        ("2026-11-05", "2026-11-01", "to"),
        ("yesterday", None, "from"),
        ("2020-01-01", "2026-01-01", "from"),
    ):
        with pytest.raises(APIError) as err:
            window(None, start, end, now=now)
        assert err.value.param == param


def test_charts() -> None:
    tops = [charts.axis_ticks(v)[-1] for v in (0, 0.7, 3, 10, 11, 240, 2600)]
    assert tops == [1, 0.8, 3, 10, 12.5, 250, 3000]  # count axes: tests/dashboard/test_usage_breakdown.py
    assert [charts.compact(v) for v in (0, 12, 1500, 2_500_000, 0.125)] == ["0", "12", "1.5k", "2.5M", "0.12"]
    empty = charts.render([], chart_id="c", title="Requests", hourly=True)
    assert "No data in this range" in empty and 'role="img"' in empty
    t0 = datetime(2026, 11, 22, tzinfo=UTC)
    points = [charts.Point(t0 + timedelta(hours=i), v) for i, v in enumerate([1, 0, 3])]
    svg = charts.render(points, chart_id="c", title="A <b>", hourly=True)
    assert svg.count('class="mark"') == 3 and "A &lt;b&gt;" in svg  # escaped
    assert f'data-bucket="{t0.isoformat()}" data-value="1"' in svg
    assert "highest 3, total 4" in svg
    line = charts.render(points, chart_id="e", title="Errors", hourly=False, kind="line")
    assert "<polyline" in line and line.count("<circle") == 3
