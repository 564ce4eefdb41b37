"""The layout holds (issue 16, acceptance 4): DESIGN.md's dependency arrows, and files small
enough to read.

Arrows point one way: core ← control_plane ← billing ← gateway / autoscaler / dashboard, and
core ← engine ← workers. Only the composition root (`tokenmill/app.py`, `tokenmill/cli.py`)
imports the packages above the core, and lazily: inside a function or for type checking, so
importing the core never drags in the services. Each rule is also tried on code that breaks
it, so a scan that finds nothing cannot pass by being blind.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CORE = "tokenmill"
ENGINE = "workers.engine"
# What each layer may import of ours, by DESIGN.md's layout table.
MAY_IMPORT: dict[str, frozenset[str]] = {
    CORE: frozenset(),
    ENGINE: frozenset({"tokenmill.hashing", "tokenmill.tokenization"}),
    "workers": frozenset({CORE, ENGINE}),
    "control_plane": frozenset({CORE}),
    "billing": frozenset({CORE, "control_plane"}),
    "gateway": frozenset({CORE, "control_plane", "billing"}),
    "autoscaler": frozenset({CORE, "control_plane", "billing"}),
    "dashboard": frozenset({CORE, "control_plane", "billing"}),
}
COMPOSITION_ROOT = frozenset({"tokenmill/app.py", "tokenmill/cli.py"})
OURS = frozenset(name.split(".")[0] for name in MAY_IMPORT)

SMALL_FILES = ("control_plane", "billing", "dashboard", "gateway")
MAX_LINES = 500


@dataclass(frozen=True, slots=True)
class Import:
    module: str
    line: int
    lazy: bool  # inside a function or an `if TYPE_CHECKING:` block


def _is_type_checking(node: ast.If) -> bool:
    return ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def imports(source: str) -> list[Import]:
    """Absolute imports of our packages in `source` (relative ones stay in their package)."""
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                # `from pkg import mod` imports pkg.mod when mod is a module: count it as pkg.mod.
                names = [f"{child.module}.{a.name}" for a in child.names]
            else:
                names = []
            found.extend(Import(n, child.lineno, lazy) for n in names if n.split(".")[0] in OURS)
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            inner = inner or (isinstance(child, ast.If) and _is_type_checking(child))
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def layer(path: str) -> str:
    """The layer of a file (`workers/engine/x.py` → workers.engine, `billing/a/b.py` → billing)."""
    parts = path.removesuffix(".py").split("/")
    return ENGINE if parts[:2] == ["workers", "engine"] else parts[0]


def _within(module: str, allowed: str) -> bool:
    return module == allowed or module.startswith(allowed + ".")


def violations(path: str, source: str) -> list[str]:
    own = layer(path)
    out = []
    for imp in imports(source):
        if _within(imp.module, own) or any(_within(imp.module, a) for a in MAY_IMPORT[own]):
            continue
        if own == "workers" and _within(imp.module, ENGINE):
            continue
        if path in COMPOSITION_ROOT and imp.lazy:
            continue
        out.append(f"{path}:{imp.line}: {own} imports {imp.module}")
    return out


def _sources() -> list[str]:
    paths = []
    for package in sorted(OURS):
        paths += [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / package).rglob("*.py"))]
    return paths


def test_imports_follow_the_arrows_of_design_md() -> None:
    paths = _sources()
    assert "workers/engine/engine.py" in paths and "tokenmill/app.py" in paths  # the walk sees them
    offenders = [v for path in paths for v in violations(path, (ROOT / path).read_text())]
    assert offenders == []


def test_no_file_of_the_services_is_over_500_lines() -> None:
    sizes = {
        p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
        for package in SMALL_FILES
        for p in (ROOT / package).rglob("*.py")
    }
    assert len(sizes) > 20
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("control_plane/orgs/services.py", "from billing.ledger import services\n"),
        ("billing/invoices/services.py", "from gateway.keys import KeyCache\n"),
        ("control_plane/unit.py", "import dashboard.app\n"),
        ("dashboard/web.py", "from gateway import admission\n"),
        ("autoscaler/reconciler.py", "from dashboard.fleet import view\n"),
        ("workers/engine/runner.py", "from tokenmill.db import Base\n"),
        ("workers/engine/runner.py", "from workers.server import serve\n"),
        ("tokenmill/bus.py", "def f():\n    from control_plane.unit import UnitOfWork\n"),
        ("tokenmill/app.py", "from gateway.keys import KeyCache\n"),  # eager in the root
        ("tokenmill/cli.py", "from tokenmill import x\nif True:\n    from billing import jobs\n"),
    ],
)
def test_the_scan_sees_each_wrong_arrow(path: str, source: str) -> None:
    assert violations(path, source)


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("billing/ledger/services.py", "from control_plane.orgs.models import Organization\n"),
        ("gateway/keys.py", "from billing.prices import services\n"),
        ("workers/engine/runner.py", "from tokenmill.hashing import hash_blocks\n"),
        ("workers/server.py", "from workers.engine import LLMEngine\n"),
        ("tokenmill/app.py", "def create_app():\n    from gateway.keys import KeyCache\n"),
        ("tokenmill/cli.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import billing\n"),
        ("control_plane/orgs/keys.py", "from control_plane.policy import admit\nimport litestar\n"),
    ],
)
def test_the_scan_passes_each_right_arrow(path: str, source: str) -> None:
    assert violations(path, source) == []
