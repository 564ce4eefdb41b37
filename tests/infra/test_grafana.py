"""The Grafana dashboards (infra/grafana) and the Prometheus alert rules (infra/prometheus)
hold together with the code (issue 20, acceptance 6):

- promtool (Debian's `prometheus` package; `make test` installs it) accepts the rules, their
  unit tests (alerts_test.yml) pass, and so does every PromQL expression of the dashboards;
- every metric an expression names (dashboards, variables, rules, the rules' test series) is
  one the code exports: the names come from the registries the gateway, the workers, the
  autoscaler and the ledger consumer build, with the suffixes their types expose;
- the dashboards are well formed: panels with targets, every data source a declared
  data source variable, every variable used declared;
- the usage dashboard's SQL runs on a PostgreSQL database at migration head, as the
  read-only role of grafana-reader.sql, and its figures for an organisation are the ones
  the rows inserted make.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from tests.infra.terraform_files import REPO, TERRAFORM, terraform_binary
from tests.infra.test_gpu_nodes import plan_outputs

GRAFANA = REPO / "infra" / "grafana"
PROMETHEUS = REPO / "infra" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
ALERT_TESTS = PROMETHEUS / "alerts_test.yml"
DASHBOARDS = sorted(GRAFANA.glob("*.json"))


# --- what the code exports --------------------------------------------------------------------


class _Zero:
    """Stands for the worker's engine and load: every figure its gauges read is 0."""

    def __getattr__(self, name: str) -> int:
        return 0


def _gateway() -> CollectorRegistry:
    from gateway.metrics import GatewayMetrics

    return GatewayMetrics.create().registry


def _worker() -> CollectorRegistry:
    from workers.server import Traffic, _Metrics

    return _Metrics.create(_Zero(), "smollm2", _Zero(), Traffic()).registry  # type: ignore[arg-type]


def _autoscaler() -> CollectorRegistry:
    from autoscaler.metrics import AutoscalerMetrics

    return AutoscalerMetrics.create().registry


def _ledger() -> CollectorRegistry:
    from billing.ledger.metrics import LedgerMetrics

    return LedgerMetrics.create().registry


# Every registry whose metrics a dashboard or an alert may name. The processes' default
# registries (process_*, python_*) are left out on purpose: nothing here should graph them.
SOURCES: dict[str, Callable[[], CollectorRegistry]] = {
    "gateway (gateway/metrics.py)": _gateway,
    "worker (workers/server.py)": _worker,
    "autoscaler (autoscaler/metrics.py)": _autoscaler,
    "ledger consumer (billing/ledger/metrics.py)": _ledger,
}

# The series names a metric family of each type exposes (prometheus_client strips `_total`
# from a counter family's name and adds it back on exposition).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


@dataclass(frozen=True)
class Exported:
    source: str
    family: str


def exported() -> dict[str, Exported]:
    """Series name -> the source and metric family exporting it."""
    names: dict[str, Exported] = {}
    for source, build in SOURCES.items():
        for family in build().collect():
            for suffix in SUFFIXES[family.type]:
                names[family.name + suffix] = Exported(source, family.name)
    return names


@pytest.fixture(scope="module")
def exported_names() -> dict[str, Exported]:
    return exported()


def test_the_sources_export_what_the_plan_names(exported_names: dict[str, Exported]) -> None:
    """The suffix handling itself: a counter, a histogram, a gauge and a vLLM-named worker
    counter read back as Prometheus shows them, each from its own source."""
    assert exported_names["tokenmill_gateway_requests_total"].source.startswith("gateway")
    ttft = exported_names["tokenmill_gateway_time_to_first_token_seconds_bucket"]
    assert ttft == Exported(next(iter(SOURCES)), "tokenmill_gateway_time_to_first_token_seconds")
    assert exported_names["vllm:prefix_cache_hits_total"].source.startswith("worker")
    assert exported_names["tokenmill_worker_requests_arrived_total"].source.startswith("worker")
    assert exported_names["tokenmill_autoscaler_desired_replicas"].source.startswith("autoscaler")
    assert exported_names["tokenmill_ledger_lag_seconds"].source.startswith("ledger")
    assert "tokenmill_gateway_requests" not in exported_names  # a counter is only seen with _total


# --- PromQL -------------------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE)
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_MODIFIER = re.compile(r"\b(?:offset\s+-?[\w.]+|@\s*(?:[\d.]+|start\(\)|end\(\)))", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-f]+|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)", re.IGNORECASE)
_IDENTIFIER = re.compile(r"[A-Za-z_:][\w:]*")
# Binary operators, modifiers and literals that read like identifiers; functions and
# aggregations are told apart by the parenthesis after them.
_KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"offset", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression selects: identifiers not called as functions, outside
    strings, label matchers, ranges and grouping clauses; Grafana variables taken out."""
    assert "__name__" not in expr, f"a metric chosen by a __name__ matcher escapes this check: {expr}"
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _VARIABLE.sub(" ", text)
    text = _MODIFIER.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            "histogram_quantile(0.99, sum by (le, endpoint) "
            '(rate(a_bucket{model=~"$model", x="y{z}"}[$__rate_interval])))',
            {"a_bucket"},
        ),
        ("sum(rate(a_total[5m])) by (reason) / ignoring(x) group_left(y) b offset 1h", {"a_total", "b"}),
        ("absent(vllm:num_requests_running) and on () sum(c) > 1e3", {"vllm:num_requests_running", "c"}),
        ("max without (instance) (d) > bool 0.5 unless e @ 1609746000", {"d", "e"}),
        ("rate(f[5m:1m]) > Inf or g", {"f", "g"}),
    ],
)
def test_metric_names_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def label_values_selector(query: str) -> str | None:
    """The PromQL part of a Grafana Prometheus variable query (None: names no metric)."""
    query = query.strip()
    if m := re.fullmatch(r"label_values\((.+),\s*\w+\s*\)", query, re.DOTALL):
        return m.group(1)
    if re.fullmatch(r"label_values\(\s*\w+\s*\)|label_names\(\)", query):
        return None
    if m := re.fullmatch(r"query_result\((.+)\)", query, re.DOTALL):
        return m.group(1)
    raise AssertionError(f"a variable query this test does not know how to read: {query}")


# --- the dashboards -----------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included; rows themselves excluded."""
    for panel in board["panels"]:
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def variables(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in board["templating"]["list"]}


def data_sources(board: dict[str, Any]) -> dict[str, str]:
    """`${name}` -> the plugin type of each data source variable the dashboard declares."""
    return {f"${{{n}}}": v["query"] for n, v in variables(board).items() if v["type"] == "datasource"}


@dataclass(frozen=True)
class Query:
    board: str
    where: str  # panel title and refId, or the variable
    kind: str  # "promql" or "sql"
    text: str


def queries(path: Path) -> list[Query]:
    board = load(path)
    found = []
    for panel in panels(board):
        for target in panel["targets"]:
            where = f"{panel['title']!r} {target['refId']}"
            if "expr" in target:
                found.append(Query(path.name, where, "promql", target["expr"]))
            if "rawSql" in target:
                found.append(Query(path.name, where, "sql", target["rawSql"]))
    for name, var in variables(board).items():
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        if var["datasource"]["type"] == "prometheus":
            selector = label_values_selector(query)
            if selector is not None:
                found.append(Query(path.name, f"variable {name}", "promql", selector))
        else:
            found.append(Query(path.name, f"variable {name}", "sql", query))
    return found


def test_there_are_a_fleet_and_a_usage_dashboard() -> None:
    boards = {p.name: load(p) for p in DASHBOARDS}
    assert set(boards) == {"tokenmill-fleet.json", "tokenmill-usage.json"}
    assert set(data_sources(boards["tokenmill-fleet.json"]).values()) == {"prometheus"}
    assert set(data_sources(boards["tokenmill-usage.json"]).values()) == {"grafana-postgresql-datasource"}
    assert len({b["uid"] for b in boards.values()}) == len(boards)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    board = load(path)
    for key in ("uid", "title", "panels", "templating", "schemaVersion", "time"):
        assert key in board, key
    sources = data_sources(board)
    assert sources, "the data source is a variable, so the dashboard imports into any Grafana"
    declared = set(variables(board))
    titles = [p["title"] for p in panels(board)]
    assert len(titles) == len(set(titles)), "panel titles are unique"
    ids = [p["id"] for p in board["panels"]] + [p["id"] for r in board["panels"] for p in r.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    taken: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & taken, f"{panel['title']!r} overlaps another panel"
        taken |= cells
    for panel in panels(board):
        title = panel["title"]
        assert panel["targets"], f"{title!r} has no query"
        assert panel["datasource"]["uid"] in sources, title
        plugin = sources[panel["datasource"]["uid"]]
        assert panel["datasource"]["type"] == plugin, title
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), title
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], title
            field = "expr" if plugin == "prometheus" else "rawSql"
            assert target.get(field, "").strip(), f"{title!r} {target['refId']} has no {field}"
    for name, var in variables(board).items():
        if var["type"] == "query":
            assert var["datasource"]["uid"] in sources, name
            assert var["datasource"]["type"] == sources[var["datasource"]["uid"]], name
    # Every $variable a query uses is declared, or one of Grafana's own ($__interval, ...).
    for query in queries(path):
        for used in re.findall(r"\$\{(\w+)[^}]*\}|\$(\w+)", query.text):
            name = used[0] or used[1]
            assert name.startswith("__") or name in declared, f"{query.where}: ${name} is not declared"


def rule_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [
        (rule.get("alert") or rule["record"], rule["expr"])
        for group in rules["groups"]
        for rule in group["rules"]
    ]


def recorded() -> set[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {rule["record"] for group in rules["groups"] for rule in group["rules"] if "record" in rule}


def test_every_expression_names_only_exported_metrics(exported_names: dict[str, Exported]) -> None:
    allowed = set(exported_names) | recorded()
    checked: list[tuple[str, str]] = [
        (f"{q.board} {q.where}", q.text) for p in DASHBOARDS for q in queries(p) if q.kind == "promql"
    ]
    checked += [(f"alerts.yml {name}", expr) for name, expr in rule_exprs()]
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    checked += [
        (f"alerts_test.yml input {s['series']}", s["series"])
        for t in tests["tests"]
        for s in t["input_series"]
    ]
    unknown = []
    used: set[str] = set()
    for where, expr in checked:
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        used |= names
        unknown += [f"{where}: {name}" for name in sorted(names - allowed)]
    assert unknown == [], "names no source exports (sources: " + ", ".join(SOURCES) + ")"
    # And the other way: every metric the code exports is on a dashboard or in a rule, so a
    # metric added later comes with its panel.
    families = {e.family for e in exported_names.values()}
    shown = {exported_names[name].family for name in used if name in exported_names}
    assert sorted(families - shown) == [], "exported, but on no dashboard and in no alert rule"


# --- promtool -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    assert path, (
        "promtool is not installed: `make test` installs it (tests/ensure_services.sh); "
        "by hand: apt-get install prometheus"
    )
    return path


def _run(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_alert_rules(promtool: str) -> None:
    done = _run(promtool, "check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in done.stdout


def test_the_alert_rules_unit_tests_pass(promtool: str) -> None:
    done = _run(promtool, "test", "rules", str(ALERT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = {name for name, _ in rule_exprs()} - recorded()
    tested = {
        case["alertname"]
        for t in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        for case in t.get("alert_rule_test", [])
    }
    assert tested == alerts, "every alert has a unit test"


def test_promtool_parses_every_dashboard_expression(promtool: str, tmp_path: Path) -> None:
    """Each PromQL query as a recording rule, Grafana's variables filled in as Grafana would."""
    fill = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "6h"}
    rules = []
    for path in DASHBOARDS:
        for q in queries(path):
            if q.kind != "promql":
                continue
            expr = q.text
            for variable, value in fill.items():
                expr = expr.replace(variable, value)
            expr = re.sub(r"\$\{?\w+\}?", ".*", expr)  # selections ($model): regex matchers
            rules.append({"record": f"dashboard:query_{len(rules)}", "expr": expr})
    assert rules
    file = tmp_path / "dashboards.yml"
    file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    done = _run(promtool, "check", "rules", str(file))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(terraform_binary() is None, reason="terraform is not on the PATH (set TERRAFORM=...)")
def test_the_terraform_prometheus_rule_carries_the_same_rules(promtool: str, tmp_path: Path) -> None:
    """On Kubernetes the monitoring module's PrometheusRule holds alerts.yml's groups beside
    its own (cluster) alerts, and Prometheus accepts the whole of it."""
    # A relative source, as the platform stack's: terraform reads the module where it is.
    source = os.path.relpath(TERRAFORM / "modules" / "tokenmill" / "modules" / "monitoring", tmp_path)
    outputs = plan_outputs(
        tmp_path,
        f'module "m" {{\n  source = "{source}"\n  namespace = "tokenmill"\n'
        '  services = ["tokenmill-gateway"]\n  metrics_secret = "tokenmill-metrics"\n}\n'
        'output "manifests" { value = module.m.manifests }\n',
    )
    manifests = outputs["manifests"]
    (rule,) = [m for m in manifests if m["kind"] == "PrometheusRule"]
    groups = rule["spec"]["groups"]
    assert groups[1:] == yaml.safe_load(ALERTS.read_text())["groups"]
    file = tmp_path / "prometheus-rule.yml"
    file.write_text(yaml.safe_dump({"groups": groups}))
    done = _run(promtool, "check", "rules", str(file))
    assert done.returncode == 0, done.stdout + done.stderr


# --- the usage dashboard's SQL --------------------------------------------------------------------

NOW = datetime.now(UTC).replace(second=0, microsecond=0)
FROM, TO = NOW - timedelta(days=2), NOW + timedelta(minutes=1)


def expand(sql: str, values: dict[str, str], interval_seconds: int) -> str:
    """What Grafana's PostgreSQL data source sends: variables filled in, then its macros
    (pkg/tsdb/grafana-postgresql-datasource/macros.go); an unknown macro fails."""
    values = values | {"__interval": f"{interval_seconds}s"}
    sql = re.sub(r"\$\{(\w+)\}|\$(\w+)(?!\w*\()", lambda m: values[m.group(1) or m.group(2)], sql)

    def macro(m: re.Match[str]) -> str:
        name, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        # As Grafana: a $__timeGroup followed by a comma is the old form, which adds the alias.
        if name == "__timeGroup" and sql[m.end() : m.end() + 1] == ",":
            name = "__timeGroupAlias"
        start, end = FROM.isoformat().replace("+00:00", "Z"), TO.isoformat().replace("+00:00", "Z")
        if name == "__timeFilter":
            return f"{args[0]} BETWEEN '{start}' AND '{end}'"
        if name in ("__timeGroup", "__timeGroupAlias"):
            seconds = int(args[1].rstrip("s"))
            group = f"floor(extract(epoch from {args[0]})/{seconds})*{seconds}"
            return group + (' AS "time"' if name == "__timeGroupAlias" else "")
        if name == "__timeFrom":
            return f"'{start}'"
        if name == "__timeTo":
            return f"'{end}'"
        raise AssertionError(f"a macro this test does not expand: ${name}")

    sql = re.sub(r"\$(\w+)\(([^)]*)\)", macro, sql)
    assert "$" not in sql, sql
    return sql


async def _fill(url: str) -> dict[str, str]:
    """Two organisations: acme with a little of everything, globex with one request."""
    from billing.models import Refusal, UsageEvent, UsageRollup
    from control_plane.orgs.models import ApiKey, Organization
    from tokenmill.db import make_engine, make_sessionmaker

    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as session, session.begin():
            acme, globex = Organization(name="acme"), Organization(name="globex")
            session.add_all([acme, globex])
            await session.flush()
            key = ApiKey(org_id=acme.id, name="ci", prefix="tm_ci", hash="x")
            session.add(key)
            await session.flush()
            hour = NOW.replace(minute=0) - timedelta(hours=1)
            for i, status in enumerate(("ok", "ok", "cancelled", "error")):
                session.add(
                    UsageEvent(
                        request_id=f"req_{i}",
                        org_id=acme.id,
                        api_key_id=key.id,
                        model="smollm2",
                        prompt_tokens=100,
                        cached_tokens=20,
                        completion_tokens=10,
                        ttft_ms=200.0 * (i + 1),
                        duration_ms=900.0,
                        status=status,
                        created_at=hour + timedelta(minutes=5),
                    )
                )
            session.add(UsageEvent(request_id="req_g", org_id=globex.id, model="smollm2", status="error"))
            for reason, n in (("rate_limit_requests", 5), ("auth", 1)):
                session.add(Refusal(org_id=acme.id, minute=hour, api_key_id=key.id, reason=reason, count=n))
            session.add(Refusal(org_id=globex.id, minute=hour, api_key_id="key_g", reason="budget", count=9))
            for meter, quantity, amount in (
                ("input", 320, "0.5"),
                ("cached_input", 80, "0.1"),
                ("output", 40, "0.4"),
                ("gpu_seconds", 7200, "2.0"),
            ):
                session.add(
                    UsageRollup(
                        org_id=acme.id,
                        hour=hour,
                        model="smollm2",
                        meter=meter,
                        quantity=Decimal(quantity),
                        unit_price=Decimal(1),
                        amount=Decimal(amount),
                        currency="usd",
                    )
                )
        return {"acme": acme.id, "globex": globex.id}
    finally:
        await engine.dispose()


READER_SQL = GRAFANA / "grafana-reader.sql"


async def _as_reader(url: str, statements: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """Each statement's rows, read as the role grafana-reader.sql creates (under a name of its
    own: roles are the server's, not the database's); the role is dropped afterwards."""
    role = f"grafana_reader_{secrets.token_hex(4)}"
    script = READER_SQL.read_text().replace("grafana_reader", role)
    grants = [s.strip() for s in re.sub(r"--[^\n]*", "", script).split(";") if s.strip()]
    engine = create_async_engine(url)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        async with engine.begin() as conn:
            for grant in grants:
                await conn.exec_driver_sql(grant)
        try:
            # One transaction, rolled back at the end, which also undoes the SET ROLE.
            async with engine.connect() as conn:
                await conn.exec_driver_sql(f"SET ROLE {role}")
                for where, sql in statements.items():
                    result = await conn.exec_driver_sql(sql)
                    results[where] = [dict(row._mapping) for row in result]
                # What the role must not read, and so what a Grafana user cannot see.
                for secret in ("SELECT hash FROM api_keys", "SELECT cache_salt FROM organizations"):
                    with pytest.raises(DBAPIError, match="permission denied"):
                        async with conn.begin_nested():
                            await conn.exec_driver_sql(secret)
                await conn.rollback()
        finally:
            async with engine.begin() as conn:
                await conn.exec_driver_sql(f"DROP OWNED BY {role}")
                await conn.exec_driver_sql(f"DROP ROLE {role}")
    finally:
        await engine.dispose()
    return results


def test_the_usage_dashboard_sql_runs_and_adds_up(pg_url: str) -> None:
    import migrations

    migrations.upgrade(pg_url, "head")
    orgs = asyncio.run(_fill(pg_url))
    path = GRAFANA / "tokenmill-usage.json"
    board = load(path)
    formats = {
        f"{p['title']!r} {t['refId']}": t["format"]
        for p in panels(board)
        for t in p["targets"]
        if "rawSql" in t
    }
    sql_queries = [q for q in queries(path) if q.kind == "sql"]
    statements = {q.where: expand(q.text, {"org": orgs["acme"]}, 3600) for q in sql_queries}
    # A second interval (minutes) for the time series: the grouping must hold for both.
    statements |= {
        f"{q.where} (1m)": expand(q.text, {"org": orgs["acme"]}, 60)
        for q in sql_queries
        if "$__timeGroup" in q.text
    }
    results = asyncio.run(_as_reader(pg_url, statements))

    for where, rows in results.items():
        assert rows, f"{where} found nothing of acme's"
        if formats.get(where.removesuffix(" (1m)")) == "time_series":
            assert all("time" in row for row in rows), f"{where}: a time series needs a time column"

    def one(title: str) -> Any:
        (row,) = results[f"{title!r} A"]
        (value,) = row.values()
        return value

    assert one("Requests") == 4
    assert one("Refused") == 6
    assert one("Error rate") == pytest.approx(7 / 10)  # 1 failed + 6 refused of 4 + 6
    assert one("Tokens") == 440
    assert results["'Spend' A"] == [{"currency": "USD", "spend": Decimal("3.0")}]
    assert one("GPU hours") == 2
    assert results["variable org"] == [
        {"__text": "acme", "__value": orgs["acme"]},
        {"__text": "globex", "__value": orgs["globex"]},
    ]
    (bucket,) = results["'Requests per interval' A"]
    assert (bucket["answered"], bucket["failed"]) == (3, 1)
    (refused,) = results["'Requests per interval' B"]
    assert refused["refused"] == 6
    assert [r["error_rate"] for r in results["'Error rate per interval' A"]] == [pytest.approx(7 / 10)]
    assert sorted(r["metric"] for r in results["'Tokens by meter' A"]) == ["cached_input", "input", "output"]
    assert sorted((r["metric"], r["value"]) for r in results["'Refusals by reason' A"]) == [
        ("auth", 1),
        ("rate_limit_requests", 5),
    ]
    assert [r["value"] for r in results["'Time to first token (p90)' A"]] == [pytest.approx(0.74)]
    assert results["'Refusals by API key and reason' A"][0] == {
        "key_name": "ci",
        "key_prefix": "tm_ci",
        "reason": "rate_limit_requests",
        "refused": 5,
    }
    by_status = {r["status"]: r["requests"] for r in results["'Requests by model and status' A"]}
    assert by_status == {"ok": 2, "cancelled": 1, "error": 1}
