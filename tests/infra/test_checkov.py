"""checkov finds nothing in infra/terraform, the Dockerfiles included; every suppression is
written next to its resource with a reason.

checkov cannot share the project's virtual environment (it pins packaging<24; pytest needs
>=24): install it into one of its own and put it on the PATH or in $CHECKOV, e.g.
`python3 -m venv /tmp/checkov-venv && /tmp/checkov-venv/bin/pip install checkov==3.3.30`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.infra.terraform_files import REPO, TERRAFORM, checkov_binary

CHECKOV = checkov_binary()
pytestmark = pytest.mark.skipif(
    CHECKOV is None,
    reason="checkov is not installed: set $CHECKOV or put it on the PATH "
    "(python3 -m venv /tmp/checkov-venv && /tmp/checkov-venv/bin/pip install checkov==3.3.30)",
)


def _checkov(*args: str, cwd: Path) -> list[dict[str, Any]]:
    assert CHECKOV
    done = subprocess.run(
        [CHECKOV, "--skip-download", "--output", "json", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # checkov exits 1 when a check fails; the JSON says which.
    assert done.returncode in (0, 1), done.stderr[-4000:]
    report = json.loads(done.stdout)
    return report if isinstance(report, list) else [report]


def _failures(reports: list[dict[str, Any]]) -> list[str]:
    return [
        f"{f['check_id']} {f['resource']} ({f['file_path']}:{f['file_line_range'][0]}): {f['check_name']}"
        for report in reports
        for f in report.get("results", {}).get("failed_checks", [])
    ]


@pytest.fixture(scope="module")
def terraform_reports() -> list[dict[str, Any]]:
    return _checkov("--directory", str(TERRAFORM), "--framework", "terraform", cwd=REPO)


def test_checkov_terraform_has_no_failures(terraform_reports: list[dict[str, Any]]) -> None:
    summary = terraform_reports[0]["summary"]
    assert summary["parsing_errors"] == 0
    assert summary["passed"] > 300, summary  # it really looked at the modules
    assert _failures(terraform_reports) == []


def test_every_terraform_suppression_has_a_reason(terraform_reports: list[dict[str, Any]]) -> None:
    skipped = [s for r in terraform_reports for s in r.get("results", {}).get("skipped_checks", [])]
    assert skipped, "expected the documented suppressions"
    for s in skipped:
        comment = (s.get("check_result") or {}).get("suppress_comment", "")
        assert len(comment.strip()) >= 30, f"{s['check_id']} on {s['resource']}: {comment!r}"


def test_checkov_dockerfiles_have_no_failures() -> None:
    reports = _checkov(
        "--file",
        str(REPO / "Dockerfile"),
        "--file",
        str(REPO / "Dockerfile.worker"),
        "--framework",
        "dockerfile",
        cwd=REPO,
    )
    assert _failures(reports) == []
