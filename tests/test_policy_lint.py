"""One front door's rules are every front door's (issue 16, acceptance 1).

The admin API's controllers, the dashboard and the `tokenmill admin` CLI only call services:
none of them commits, publishes on the bus or announces a key change itself (the unit of work
of control_plane/unit.py does, after the commit), so none can forget to. And who may do what
is decided in one module, control_plane/policy.py: nowhere else is a role compared, an
organisation's status checked, or a 403 raised. Each check is tried on code that breaks it,
so a check that finds nothing cannot pass by being blind.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Calls a front door leaves to the unit of work.
FORBIDDEN_CALLS = ("KeysChanged(", ".publish(", "session.begin(", "commit(")

# Where role and organisation-status checks are looked for, and the one module they belong to.
PACKAGES = ("control_plane", "billing", "dashboard", "autoscaler", "gateway")
CORE_MODULES = ("tokenmill/cli.py", "tokenmill/app.py")
POLICY = "control_plane/policy.py"
# Known exceptions, each with the reason it stands.
ALLOWED: set[tuple[str, str]] = set()

ROLE_NAMES = frozenset({"platform_admin", "org_admin", "member"})
REFUSAL_CODES = frozenset({"insufficient_permissions", "organization_suspended"})


def _front_doors() -> list[Path]:
    doors = [ROOT / "tokenmill" / "cli.py"]
    doors += sorted((ROOT / "dashboard").rglob("*.py"))
    for package in PACKAGES:
        doors += [p for p in sorted((ROOT / package).rglob("controllers.py")) if p not in doors]
    return doors


def _code_only(source: str) -> str:
    """The source without comments and strings: what runs, not what is said about it."""
    kept = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            kept.append(tok.string)
    return " ".join(kept).replace(" (", "(").replace(" . ", ".").replace(" .", ".").replace(". ", ".")


def side_effects(source: str) -> list[str]:
    code = _code_only(source)
    return [call for call in FORBIDDEN_CALLS if call in code]


def _is_sql_column(node: ast.expr) -> bool:
    # `User.role == ...` on a mapped class builds a query; it decides nothing by itself.
    return (
        isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id[:1].isupper()
    )


def _orgish(node: ast.expr) -> bool:
    text = ast.unparse(node).lower()
    return "org" in text


def policy_checks(source: str) -> list[tuple[int, str]]:
    """(line, kind) of every role or organisation-status decision in `source`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_sql_column(o) for o in operands):
                continue
            for operand in operands:
                constants = [operand] if isinstance(operand, ast.Constant) else []
                if isinstance(operand, ast.Tuple | ast.List | ast.Set):
                    constants = [e for e in operand.elts if isinstance(e, ast.Constant)]
                if any(c.value in ROLE_NAMES for c in constants):
                    found.append((node.lineno, "role"))
                if isinstance(operand, ast.Name) and operand.id in ("ROLES", "ADMIN_ROLES"):
                    found.append((node.lineno, "role"))
                if isinstance(operand, ast.Attribute) and operand.attr == "role":
                    found.append((node.lineno, "role"))
                if isinstance(operand, ast.Attribute) and operand.attr == "status" and _orgish(operand.value):
                    found.append((node.lineno, "organisation status"))
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            status = (
                node.args[0]
                if node.args
                else next((k.value for k in node.keywords if k.arg == "status"), None)
            )
            if name.endswith("APIError") and isinstance(status, ast.Constant) and status.value == 403:
                found.append((node.lineno, "403"))
            if name.split(".")[-1] in ("forbidden", "_forbidden"):
                found.append((node.lineno, "403"))
        elif isinstance(node, ast.Constant) and node.value in REFUSAL_CODES:
            found.append((node.lineno, "403"))
    return found


def _modules() -> list[Path]:
    paths = [ROOT / m for m in CORE_MODULES]
    for package in PACKAGES:
        paths += sorted((ROOT / package).rglob("*.py"))
    return [p for p in paths if p.relative_to(ROOT).as_posix() != POLICY]


def test_front_doors_leave_commits_and_announcements_to_the_unit_of_work() -> None:
    doors = _front_doors()
    assert ROOT / "control_plane" / "orgs" / "controllers.py" in doors  # the scan sees the doors
    assert ROOT / "dashboard" / "controllers.py" in doors
    offenders = {
        p.relative_to(ROOT).as_posix(): calls for p in doors if (calls := side_effects(p.read_text()))
    }
    assert offenders == {}


def test_roles_and_organisation_status_are_checked_in_the_policy_module_only() -> None:
    offenders, excused = [], set()
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        for line, kind in policy_checks(path.read_text()):
            if (rel, kind) in ALLOWED:
                excused.add((rel, kind))
            else:
                offenders.append(f"{rel}:{line}: {kind} check")
    assert offenders == []
    assert excused == ALLOWED, "an exception no longer needed: drop it from ALLOWED"
    # and the policy module does hold them
    assert {kind for _, kind in policy_checks((ROOT / POLICY).read_text())} >= {"role", "403"}


@pytest.mark.parametrize(
    "source",
    [
        "await session.commit()",
        "await db.commit()",
        "await bus.publish(KEYS, event)",
        "events = [KeysChanged(prefix=p)]",
        "async with sm() as session, session.begin():\n    pass",
    ],
)
def test_the_side_effect_scan_sees_each_call(source: str) -> None:
    assert side_effects(source)
    # ... and not its mention in a comment or a docstring
    assert not side_effects(f'"""{source}"""\n# {source}\n')


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("if admin.role != 'platform_admin':\n    pass", "role"),
        ("if user.role not in ADMIN_ROLES:\n    pass", "role"),
        ("ok = role in ('platform_admin', 'org_admin')", "role"),
        ("if org.status != 'active':\n    pass", "organisation status"),
        ("if entry.org.status == SUSPENDED:\n    pass", "organisation status"),
        ("raise APIError(403, 'Only platform admins may.')", "403"),
        ("raise APIError(status=403, message='no')", "403"),
        ("raise _forbidden('no')", "403"),
        ("raise APIError(400, 'x', code='insufficient_permissions')", "403"),
    ],
)
def test_the_policy_scan_sees_each_kind_of_check(source: str, kind: str) -> None:
    assert kind in {k for _, k in policy_checks(source)}


def test_queries_and_other_statuses_are_not_policy_checks() -> None:
    source = (
        "q = select(User.id).where(User.role == 'platform_admin')\n"
        "if dep.status == STOPPED:\n    pass\n"
        "if invoice.status != 'finalized':\n    pass\n"
        "key = ApiKey(role='member')\n"
    )
    assert policy_checks(source) == []
