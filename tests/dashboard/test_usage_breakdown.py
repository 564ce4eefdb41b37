"""Usage by model and key, priced (issue 21): the ledger priced with the price book at the
time of use (batch requests at the batch discount) agrees with the rollups on the same rows;
the usage page's tables per model and per key, its spend under a key or model filter, the
usage CSV's cost column and the keys page's activity, each against the ledger and the price
book computed here independently (exact decimals); what an organisation admin sees of them
(their own organisation only); a bad date range answered by the usage page itself; count
axes with whole ticks; and, in Chromium at 1280 and 390 px, every chart's text inside its
chart. SQLite and PostgreSQL where the page tests run on both."""

from __future__ import annotations

import asyncio
import csv
import html
import io
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from itertools import pairwise, product
from pathlib import Path
from typing import Any

from playwright.async_api import async_playwright
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.ledger.services import UsageFilter, record_usage
from billing.models import UsageRollup
from billing.prices.services import PriceBook
from billing.rollups.services import spend_per_bucket, store_rollups
from billing.rollups.usage import ledger_spend_per_bucket, usage_by
from dashboard import charts
from tests.billing.billing_world import FEB, JAN, add_model_price, add_usage, make_world, t
from tests.control_plane.conftest import MODEL, AdminEnv
from tests.dashboard.browser import ARTIFACTS, CHROMIUM_ARGS
from tests.dashboard.conftest import PASSWORD, Session, add_user, sign_in
from tokenmill.protocol import UsageRecord

API = "/admin/v1"
MILLION = Decimal(1_000_000)


# --- count axes ---------------------------------------------------------------------------------


def _y_labels(svg: str) -> list[str]:
    return re.findall(r'<text class="axis y"[^>]*>([^<]+)</text>', svg)


def test_count_axes_have_whole_ticks() -> None:
    assert charts.axis_ticks(1, integer=True) == [0, 1]
    assert charts.axis_ticks(3, integer=True) == [0, 1, 2, 3]
    assert charts.axis_ticks(5, integer=True) == [0, 1, 2, 3, 4, 5]
    assert charts.axis_ticks(25, integer=True) == [0, 5, 10, 15, 20, 25]
    for highest in (0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 25, 99, 1234, 1_000_001):
        ticks = charts.axis_ticks(highest, integer=True)
        assert all(float(v).is_integer() for v in ticks), (highest, ticks)
        assert ticks[0] == 0 and ticks[-1] >= highest and len(ticks) <= 6, (highest, ticks)
        assert len({b - a for a, b in pairwise(ticks)}) == 1, (highest, ticks)  # evenly spaced
    # money and rates may have fractional ticks (a count axis never does)
    assert charts.axis_ticks(1) == [0, 0.2, 0.4, 0.6, 0.8, 1]
    assert charts.axis_ticks(12.5, integer=True) == [0, 5, 10, 15]

    t0 = datetime(2026, 11, 22, tzinfo=UTC)
    for highest in (1, 3, 5, 25):
        points = [charts.Point(t0 + timedelta(hours=i), v) for i, v in enumerate([0, highest, 1])]
        svg = charts.render(points, chart_id="c", title="Requests", hourly=True, integer=True)
        assert _y_labels(svg) == [str(int(v)) for v in charts.axis_ticks(highest, integer=True)]
        stacked = charts.render_stacked(
            [p.at for p in points],
            [charts.Layer("a", [0, highest, 0]), charts.Layer("b", [0, 1, 1])],
            chart_id="s",
            title="Requests by model",
            hourly=True,
        )
        assert _y_labels(stacked) == [str(int(v)) for v in charts.axis_ticks(highest + 1, integer=True)]
        assert stacked.count('data-series="a"') == 1 and stacked.count('data-series="b"') == 2
        assert f'data-bucket="{(t0 + timedelta(hours=1)).isoformat()}" data-total="{highest + 1}"' in stacked


# --- the ledger priced, against the rollups ----------------------------------------------------

# January's two price versions of the small model (per 1M tokens: input, cached input, output),
# the second from noon on the 10th; the big model has none (free), the dedicated deployment's
# tokens are free (GPU time is what it pays). Two decimals at most: every rollup row's amount is
# exact to the billionth (rollups store 10^-9), so the two agree to the last digit.
V1 = (Decimal("0.15"), Decimal("0.08"), Decimal("0.6"))
V2 = (Decimal("0.2"), Decimal("0.1"), Decimal("0.9"))
CHANGE = t(10, 12)


def _cost(row: dict[str, Any], small_dep: str) -> Decimal:
    """A ledger row's cost, from the price book as this test wrote it."""
    if row["deployment_id"] != small_dep:
        return Decimal(0)
    prices = V1 if row["created_at"] < CHANGE else V2
    if row["batch_id"] is not None:
        prices = tuple(p * Decimal("0.5") for p in prices)  # the default batch discount
    inp, cached_in, out = prices
    prompt, cached, completion = row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]
    return ((prompt - cached) * inp + cached * cached_in + completion * out) / MILLION


async def test_the_ledger_priced_agrees_with_the_rollups(
    migrated_db: async_sessionmaker[AsyncSession],
) -> None:
    sm = migrated_db
    w = await make_world(sm)
    await add_model_price(sm, w.small, JAN, *(str(p) for p in V1))
    await add_model_price(sm, w.small, CHANGE, *(str(p) for p in V2))
    rows = []
    # Five requests a day, around the price change's hour too; deployment, organisation, key,
    # batch and status cycle at other periods, so every combination turns up.
    for n, (day, hour) in enumerate(product(range(1, 32), (3, 11, 12, 13, 23))):
        i = n + 1
        dep = (w.small_dep, w.small_dep, w.big_dep, w.dedicated)[i % 4]
        row = w.usage(
            w.org_a if i % 3 else w.org_b,
            dep,
            t(day, hour, minute=i % 60),
            1000 + 37 * i,
            (11 * i) % 900,
            50 + 13 * i,
            model=("small-model", "acme-lora", "big-model", "acme-big")[i % 4],
            batch_id="batch_1" if i % 6 == 0 else None,
        )
        row["api_key_id"] = f"key_{i % 3}"
        row["status"] = "error" if i % 7 == 0 else "ok"
        rows.append(row)
    await add_usage(sm, rows)
    async with sm() as s, s.begin():
        await store_rollups(s, JAN, FEB)
    days = [JAN + timedelta(days=d) for d in range(31)]
    hours = [t(10, h) for h in range(24)]  # the day of the price change, hour by hour
    async with sm() as s:
        for org in (w.org_a, w.org_b, None):
            for starts, end in ((days, FEB), (hours, t(11))):
                _, rolled = await spend_per_bucket(s, starts, end, org)
                currency, priced = await ledger_spend_per_bucket(s, starts, end, UsageFilter(org_id=org))
                assert currency == "usd" and priced == rolled, org
                assert sum(priced) > 0
            mine = [r for r in rows if org is None or r["org_id"] == org]
            # per model name and key, against the price book applied row by row here
            expected: dict[tuple[str, str], list[Any]] = defaultdict(lambda: [0, 0, 0, 0, 0, Decimal(0)])
            for r in mine:
                e = expected[r["model"], r["api_key_id"]]
                e[0] += 1
                e[1] += r["status"] != "ok"
                e[2] += r["prompt_tokens"]
                e[3] += r["cached_tokens"]
                e[4] += r["completion_tokens"]
                e[5] += _cost(r, w.small_dep)
            groups = await usage_by(s, JAN, FEB, UsageFilter(org_id=org), ("model", "key"))
            got = {
                (g.model, g.key_id): [
                    g.requests,
                    g.errors,
                    g.prompt,
                    g.cached,
                    g.completion,
                    g.cost.get("usd", 0),
                ]
                for g in groups
            }
            assert got == dict(expected)
            assert all(set(g.cost) <= {"usd"} for g in groups)
            # the rollups' token amounts and the breakdown: the same money
            stmt = select(UsageRollup.amount).where(UsageRollup.meter != "gpu_seconds")
            if org is not None:
                stmt = stmt.where(UsageRollup.org_id == org)
            assert sum(g.total_cost for g in groups) == sum(await s.scalars(stmt), Decimal(0))
        # a key or a model name: what the rollups cannot give, from the same pricing
        for filt, keep in (
            (UsageFilter(org_id=w.org_a, key_id="key_1"), lambda r: r["api_key_id"] == "key_1"),
            (UsageFilter(model="acme-lora"), lambda r: r["model"] == "acme-lora"),
        ):
            _, spend = await ledger_spend_per_bucket(s, days, FEB, filt)
            per_day: dict[int, Decimal] = defaultdict(Decimal)
            for r in rows:
                if keep(r) and (filt.org_id is None or r["org_id"] == filt.org_id):
                    per_day[(r["created_at"] - JAN).days] += _cost(r, w.small_dep)
            assert spend == [per_day.get(d, Decimal(0)) for d in range(31)]
            assert sum(spend) > 0


# --- the pages, over HTTP ---------------------------------------------------------------------

# The bundled model's price (per 1M tokens: input, cached input, output), in effect for weeks.
PRICE = (Decimal("100"), Decimal("50"), Decimal("200"))


def _price_of(r: UsageRecord) -> Decimal:
    """A request's cost from PRICE, as the money rules say: prompt − cached at the input price,
    cached at the cached-input price, output at the output price; a batch's at half price."""
    inp, cached_in, out = (p / 2 for p in PRICE) if r.batch_id else PRICE
    return (
        (r.prompt_tokens - r.cached_tokens) * inp + r.cached_tokens * cached_in + r.completion_tokens * out
    ) / MILLION


async def _tenants(env: AdminEnv) -> dict[str, dict[str, Any]]:
    """Organisations alpha and bravo, each with an admin, two keys and six requests on the
    shared deployment a minute or two ago (under the model's own name and a name of their
    own, one of them a batch line, one failed); the model priced; the rollups of the range;
    a platform admin."""
    c, root = env.client, env.root
    deps = (await c.get(f"{API}/deployments", headers=root)).json()
    shared = next(d["id"] for d in deps if d["type"] == "serverless")
    now = datetime.now(UTC)
    async with env.app.state.sessionmaker() as session, session.begin():
        await PriceBook(session).add_model_price(
            model_ref=MODEL,
            input_per_mtok=PRICE[0],
            cached_input_per_mtok=PRICE[1],
            output_per_mtok=PRICE[2],
            effective_from=now - timedelta(days=40),
        )
    out: dict[str, dict[str, Any]] = {}
    for n, name in enumerate(("alpha", "bravo")):
        org = (await c.post(f"{API}/organizations", headers=root, json={"name": name})).json()
        user = await add_user(env, org["id"], f"admin@{name}.test", "org_admin")
        keys = [
            (
                await c.post(
                    f"{API}/organizations/{org['id']}/keys", headers=root, json={"name": f"{name}-{k}"}
                )
            ).json()
            for k in ("app", "nightly")
        ]
        records = [
            UsageRecord(
                request_id=f"req-{name}-{i}",
                org_id=org["id"],
                model=MODEL if i % 2 else f"{name}-tuned",
                api_key_id=keys[0 if i < 4 else 1]["id"],
                deployment_id=shared,
                prompt_tokens=1000 + 111 * i + 7 * n,
                cached_tokens=10 * i,
                completion_tokens=100 + 7 * i + n,
                status="error" if i == 3 else "ok",
                batch_id=f"batch_{name}" if i == 5 else None,
                ts=time.time() - 120 + i,
            )
            for i in range(6)
        ]
        async with env.app.state.sessionmaker() as session, session.begin():
            await record_usage(session, records)
        out[name] = {"org": org, "user": user, "keys": keys, "records": records}
    async with env.app.state.sessionmaker() as session, session.begin():
        await store_rollups(session, now - timedelta(days=2), now + timedelta(hours=1))
    await add_user(env, env.default_org, "root@platform.test", "platform_admin")
    return out


def _span() -> str:
    today = datetime.now(UTC).date()
    return f"from={(today - timedelta(days=1)).isoformat()}&to={today.isoformat()}"


def _rows(page: str, table_id: str) -> list[dict[str, str]]:
    """The attributes of a table's rows (those with `data-` attributes)."""
    start = page.index(f'id="{table_id}"')
    body = page[start : page.index("</table>", start)]
    rows = []
    for attrs in re.findall(r"<tr ([^>]*)>", body):
        found = {k: html.unescape(v) for k, v in re.findall(r'([\w-]+)="([^"]*)"', attrs)}
        if any(k.startswith("data-") for k in found):
            rows.append(found)
    return rows


def _expected(records: Iterable[UsageRecord], by: Callable[[UsageRecord], str]) -> dict[str, tuple[Any, ...]]:
    """Requests, prompt, cached, completion, errors and cost per group, from the records."""
    out: dict[str, list[Any]] = defaultdict(lambda: [0, 0, 0, 0, 0, Decimal(0)])
    for r in records:
        e = out[by(r)]
        e[0] += 1
        e[1] += r.prompt_tokens
        e[2] += r.cached_tokens
        e[3] += r.completion_tokens
        e[4] += r.status != "ok"
        e[5] += _price_of(r)
    return {k: tuple(v) for k, v in out.items()}


def _shown(rows: list[dict[str, str]], key: str) -> dict[str, tuple[Any, ...]]:
    return {
        r[key]: (
            int(r["data-requests"]),
            int(r["data-prompt"]),
            int(r["data-cached"]),
            int(r["data-completion"]),
            int(r["data-errors"]),
            Decimal(r.get("data-cost-usd", "0")),
        )
        for r in rows
    }


def _spend(page: str) -> tuple[Decimal, str]:
    found = re.search(r'id="usage-spend" data-spend="([^"]+)" data-currency="usd" data-source="(\w+)"', page)
    assert found, page[:3000]
    return Decimal(found.group(1)), found.group(2)


def _model_options(page: str) -> list[str]:
    select = page[
        page.index('<select id="f-model"') : page.index("</select>", page.index('<select id="f-model"'))
    ]
    return [html.unescape(v) for v in re.findall(r'<option value="([^"]*)"', select)]


async def _csv(s: Session, query: str) -> list[dict[str, str]]:
    r = await s.get(f"/usage.csv?{query}")
    assert r.status_code == 200, r.text[:500]
    assert r.text.splitlines()[0].endswith(",batch_id,cost,currency")
    return list(csv.DictReader(io.StringIO(r.text)))


async def test_usage_by_model_and_key_is_the_ledger_priced(admin_env: AdminEnv) -> None:
    env = admin_env
    world = await _tenants(env)
    alpha, bravo = world["alpha"], world["bravo"]
    mine = alpha["records"]
    span = _span()
    s = await sign_in(str(env.client.base_url), alpha["user"]["email"])

    r = await s.get(f"/usage?{span}")
    assert r.status_code == 200, r.text[:2000]
    page = r.text
    assert _shown(_rows(page, "usage-by-model"), "data-model") == _expected(mine, lambda r: r.model)
    assert _shown(_rows(page, "usage-by-key"), "data-key") == _expected(mine, lambda r: r.api_key_id or "")
    base = {row["data-model"]: row["data-base-model"] for row in _rows(page, "usage-by-model")}
    assert base == {MODEL: MODEL, "alpha-tuned": MODEL}
    # unfiltered spend is the rollups', and the same money as the ledger priced
    total = sum((_price_of(r) for r in mine), Decimal(0))
    assert _spend(page) == (total, "rollups")
    assert sum(Decimal(row["data-spend"]) for row in _rows(page, "usage-table")) == total
    # the model filter is a choice of the organisation's models; never another organisation's
    assert {MODEL, "alpha-tuned"} <= set(_model_options(page)) and "bravo-tuned" not in page
    # "Prompt" counts cached tokens, the invoice's input line does not: the page says so
    assert 'id="prompt-note"' in page and "prompt − cached" in page
    # the charts stack requests and tokens by model, with a legend
    for chart in ("usage-requests", "usage-tokens"):
        assert f'id="{chart}" viewBox' in page and f'id="{chart}-box"' in page
        svg = page[
            page.index(f'id="{chart}" viewBox') : page.index("</svg>", page.index(f'id="{chart}" viewBox'))
        ]
        assert (
            'data-kind="stacked"' in svg
            and f'data-series="{MODEL}"' in svg
            and 'data-series="alpha-tuned"' in svg
        )
    assert '<li data-series="alpha-tuned">' in page

    # a key or a model: spend from the ledger, priced the same way
    app_key, nightly = alpha["keys"]
    for query, keep in (
        (f"key={app_key['id']}", lambda r: r.api_key_id == app_key["id"]),
        (f"key={nightly['id']}", lambda r: r.api_key_id == nightly["id"]),
        ("model=alpha-tuned", lambda r: r.model == "alpha-tuned"),
        (f"model={MODEL}", lambda r: r.model == MODEL),
    ):
        page = (await s.get(f"/usage?{span}&{query}")).text
        kept = [r for r in mine if keep(r)]
        assert _spend(page) == (sum((_price_of(r) for r in kept), Decimal(0)), "ledger"), query
        assert _shown(_rows(page, "usage-by-model"), "data-model") == _expected(kept, lambda r: r.model)
        assert sum(Decimal(row["data-spend"]) for row in _rows(page, "usage-table")) == _spend(page)[0]
        # the CSV of the same filter: each request with its cost at the price of its time
        rows = await _csv(s, f"{span}&{query}")
        assert {x["request_id"]: (Decimal(x["cost"]), x["currency"]) for x in rows} == {
            r.request_id: (_price_of(r), "usd") for r in kept
        }

    # the whole CSV: alpha's requests only, each priced
    rows = await _csv(s, span)
    assert {x["request_id"]: Decimal(x["cost"]) for x in rows} == {r.request_id: _price_of(r) for r in mine}
    assert [x["batch_id"] for x in rows if x["batch_id"]] == ["batch_alpha"]

    # the keys page: each key's requests, tokens and spend over the range chosen
    for query, preset in (("", "30d"), ("?range=24h", "24h"), ("?range=7d", "7d")):
        page = (await s.get(f"/keys{query}")).text
        assert f'aria-current="true">{preset}</a>' in page, preset
        shown = {
            row["data-key"]: (
                int(row["data-requests"]),
                int(row["data-tokens"]),
                Decimal(row["data-cost-usd"]),
            )
            for row in _rows(page, "keys")
            if row.get("data-cost-usd")
        }
        expected = {
            k: (n, prompt + completion, cost)
            for k, (n, prompt, _, completion, _, cost) in _expected(
                mine, lambda r: r.api_key_id or ""
            ).items()
        }
        assert shown == expected

    # another organisation's key, model or organisation: 404, or nothing of theirs
    b_key = bravo["keys"][0]["id"]
    for path in (
        f"/usage?{span}&key={b_key}",
        f"/usage?{span}&key={bravo['keys'][0]['prefix']}",
        f"/usage.csv?{span}&key={b_key}",
        f"/usage?{span}&org={bravo['org']['id']}",
        f"/usage.csv?{span}&org={bravo['org']['id']}",
        f"/keys?org={bravo['org']['id']}",
        f"/keys?org={bravo['org']['id']}&range=24h",
    ):
        r = await s.get(path)
        assert r.status_code == 404, (path, r.status_code)
        # nothing of theirs but what was asked for (a 404 names it)
        unasked = ["bravo-tuned", bravo["keys"][1]["id"], *(x.request_id for x in bravo["records"])]
        assert [m for m in unasked if m in r.text] == [], path
    page = (await s.get(f"/usage?{span}&model=bravo-tuned")).text
    assert _rows(page, "usage-by-model") == [] and _rows(page, "usage-by-key") == []
    assert _spend(page) == (Decimal(0), "ledger")
    assert await _csv(s, f"{span}&model=bravo-tuned") == []
    forbidden = [bravo["org"]["id"], b_key, bravo["keys"][1]["id"], *(r.request_id for r in bravo["records"])]
    for path in (f"/usage?{span}", "/keys", "/keys?range=7d", f"/usage.csv?{span}"):
        text = (await s.get(path)).text
        assert [m for m in forbidden if m in text] == [], path
    await s.client.aclose()

    # a platform admin: both organisations, and the admin API's grouping says the same
    root = await sign_in(str(env.client.base_url), "root@platform.test")
    everyone = alpha["records"] + bravo["records"]
    page = (await root.get(f"/usage?{span}")).text
    assert _shown(_rows(page, "usage-by-key"), "data-key") == _expected(
        everyone, lambda r: r.api_key_id or ""
    )
    assert _shown(_rows(page, "usage-by-model"), "data-model") == _expected(everyone, lambda r: r.model)
    assert {"alpha-tuned", "bravo-tuned", MODEL} <= set(_model_options(page))
    await root.client.aclose()
    today = datetime.now(UTC).date()
    params = {"from": (today - timedelta(days=1)).isoformat(), "to": (today + timedelta(days=1)).isoformat()}
    r = await env.client.get(f"{API}/usage", headers=env.root, params=params | {"group_by": "model,key"})
    assert r.status_code == 200, r.text
    got = {
        (g["model"], g["key_id"]): (g["requests"], g["prompt_tokens"], Decimal(g["cost"]["usd"]))
        for g in r.json()["data"]
    }
    want = {
        tuple(k.split("|")): (v[0], v[1], v[5])
        for k, v in _expected(everyone, lambda r: f"{r.model}|{r.api_key_id}").items()
    }
    assert got == want


async def test_a_bad_date_range_is_the_usage_page_with_its_message(env: AdminEnv) -> None:
    world = await _tenants(env)
    s = await sign_in(str(env.client.base_url), world["alpha"]["user"]["email"])
    key = world["alpha"]["keys"][1]["id"]
    for query, message, param in (
        ("from=2026-02-10&to=2026-02-01", "&#39;to&#39; must not be before &#39;from&#39;.", "to"),
        ("from=last+tuesday&to=2026-02-01", "from must be a date like 2026-11-01", "from"),
        ("from=2020-01-01&to=2026-01-01", "Choose at most 400 days.", "from"),
    ):
        r = await s.get(f"/usage?{query}&model=alpha-tuned&key={key}")
        assert r.status_code == 400, (query, r.status_code)
        page = r.text
        error = re.search(
            r'<p class="form-outcome error usage-error" id="usage-error" role="alert">([^<]*)</p>', page
        )
        assert error and message in error.group(1), (query, error)
        assert '<nav aria-label="Main">' in page and 'id="usage-filters"' in page
        # what was typed stays in the form, the faulty field marked
        start, end = (v.replace("+", " ") for v in re.findall(r"=([^&]*)", query))
        assert (
            f'name="from" type="date" value="{start}"' in page
            and f'name="to" type="date" value="{end}"' in page
        )
        assert (
            f'name="{param}" type="date" value="{start if param == "from" else end}" aria-invalid="true"'
            in page
        )
        assert '<option value="alpha-tuned" selected>' in page and f'<option value="{key}" selected>' in page
        assert 'id="usage-table"' not in page and 'id="usage-empty"' in page
    await s.client.aclose()


# --- in a browser ------------------------------------------------------------------------------

# Every chart's text boxes, relative to the chart's own box (negative: outside it).
CHART_TEXT = """() => Array.from(document.querySelectorAll('svg.chart')).map(svg => {
  const box = svg.getBoundingClientRect();
  return {
    id: svg.id,
    width: box.width,
    texts: Array.from(svg.querySelectorAll('text')).map(t => {
      const r = t.getBoundingClientRect();
      return {text: t.textContent, left: r.left - box.left, top: r.top - box.top,
              right: box.right - r.right, bottom: box.bottom - r.bottom, width: r.width};
    }),
  };
})"""


async def test_chart_text_stays_inside_each_chart(env: AdminEnv, chromium: str) -> None:
    """The overview and usage pages with data (millions of tokens, spend in the thousands, a
    long model name, hourly and daily buckets), at 1280 and 390 px: every SVG text of every
    chart lies inside the chart's box."""
    world = await _tenants(env)
    alpha = world["alpha"]
    async with env.app.state.sessionmaker() as session, session.begin():
        await record_usage(
            session,
            [
                UsageRecord(
                    request_id=f"big-{i}",
                    org_id=alpha["org"]["id"],
                    model="a-fine-tuned-model-with-a-rather-long-name-v2" if i % 2 else MODEL,
                    api_key_id=alpha["keys"][0]["id"],
                    deployment_id=alpha["records"][0].deployment_id,
                    prompt_tokens=3_456_789 + i,
                    completion_tokens=987_654,
                    ts=time.time() - 3600 * i - 30,
                )
                for i in range(30)
            ],
        )
        now = datetime.now(UTC)
        await store_rollups(session, now - timedelta(days=2), now + timedelta(hours=1))
    base = str(env.client.base_url)
    pages = ["/", "/?range=7d", f"/usage?{_span()}", "/usage", f"/usage?{_span()}&model={MODEL}"]
    await asyncio.to_thread(ARTIFACTS.mkdir, parents=True, exist_ok=True)
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 900})
            context.set_default_timeout(30_000)
            page = await context.new_page()
            await page.goto(f"{base}/dashboard/login")
            await page.get_by_label("Email").fill("root@platform.test")
            await page.get_by_label("Password").fill(PASSWORD)
            await page.get_by_role("button", name="Sign in").click()
            await page.wait_for_url(f"{base}/dashboard/")
            for width in (1280, 390):
                await page.set_viewport_size({"width": width, "height": 900})
                for path in pages:
                    await page.goto(f"{base}/dashboard{path}")
                    found = await page.evaluate(CHART_TEXT)
                    assert len(found) >= 3, (path, width, [c["id"] for c in found])
                    for chart in found:
                        assert chart["texts"], (path, chart["id"])
                        outside = [
                            x
                            for x in chart["texts"]
                            if min(x["left"], x["top"], x["right"], x["bottom"]) < -0.5 or not x["width"]
                        ]
                        assert outside == [], (path, width, chart["id"], outside)
                    overflow = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
                    assert overflow <= 1, f"{path} is {overflow}px wider than the screen at {width}px"
                # the usage page, stacked by model, as people see it
                await page.goto(f"{base}/dashboard/usage?{_span()}")
                legend = page.locator("#usage-tokens-box .legend li")
                assert "a-fine-tuned-model-with-a-rather-long-name-v2" in await legend.all_inner_texts()
                await page.screenshot(path=str(ARTIFACTS / f"usage-by-model-{width}.png"), full_page=True)
            # the per-model rows as the browser shows them, and the CSV the page downloads
            models = await page.locator("#usage-by-model tbody tr").evaluate_all(
                "rows => rows.map(r => r.dataset.model).filter(m => m)"
            )
            assert {"a-fine-tuned-model-with-a-rather-long-name-v2", MODEL} <= set(models), models
            async with page.expect_download() as download:
                await page.locator("#usage-csv").click()
            saved = await (await download.value).path()
            table = list(csv.DictReader(io.StringIO(await asyncio.to_thread(Path(saved).read_text))))
            big = {r["request_id"]: r for r in table if r["request_id"].startswith("big-")}
            # (the span starts at yesterday's midnight: the oldest of them may be before it)
            assert "big-0" in big and "big-1" in big, sorted(big)
            # every one priced (the price book has the model's price), in the money's currency
            assert all(Decimal(r["cost"]) > 0 and r["currency"] == "usd" for r in big.values()), big
            await context.close()
        finally:
            await browser.close()
