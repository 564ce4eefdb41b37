"""Reading infra/terraform with python-hcl2: the modules, what they define and what they use.

Terraform cannot download providers here: `terraform validate` runs only on the modules whose
provider is in the local plugin mirror (AWS's); for the others (kubernetes, helm) these helpers
let the tests check what it would: every reference resolves, every module call passes the
variables its module declares.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import hcl2
from hcl2.utils import SerializationOptions

REPO = Path(__file__).resolve().parents[2]
TERRAFORM = REPO / "infra" / "terraform"

_OPTIONS = SerializationOptions(strip_string_quotes=True, with_comments=False, explicit_blocks=False)

# Resource types are recognised by their provider's prefix.
PROVIDER_PREFIXES = ("aws", "kubernetes", "helm", "random", "tls")
META_ARGUMENTS = {"source", "version", "count", "for_each", "depends_on", "providers", "lifecycle"}

_REFERENCE = re.compile(
    r"(?<![\w.])(?:"
    r"(?P<kind>var|local|module)\.(?P<name>[A-Za-z_][\w-]*)(?:\.(?P<attr>[A-Za-z_][\w-]*))?"
    r"|data\.(?P<dtype>[a-z][\w]*)\.(?P<dname>[A-Za-z_][\w-]*)"
    r"|(?P<rtype>(?:" + "|".join(PROVIDER_PREFIXES) + r")_[a-z0-9_]+)\.(?P<rname>[A-Za-z_][\w-]*)"
    r")"
)


def parse(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return hcl2.load(f, serialization_options=_OPTIONS)


@dataclass
class Module:
    """One directory of .tf files."""

    path: Path
    files: dict[Path, dict[str, Any]]
    variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    locals: dict[str, Any] = field(default_factory=dict)
    modules: dict[str, dict[str, Any]] = field(default_factory=dict)
    resources: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    data: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    terraform: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(TERRAFORM))

    def blocks_except_variables(self) -> Iterator[Any]:
        """Everything whose expressions count as a use of a variable (a variable's own
        validation block refers to it, which is no use)."""
        for parsed in self.files.values():
            for kind, blocks in parsed.items():
                if kind != "variable":
                    yield blocks

    def references(self) -> set[tuple[str, ...]]:
        found: set[tuple[str, ...]] = set()
        for tree in self.blocks_except_variables():
            for expression in expressions(tree):
                found |= references_in(expression)
        return found


@cache
def modules() -> dict[Path, Module]:
    """Every directory under infra/terraform holding .tf files, parsed."""
    found: dict[Path, Module] = {}
    for tf in sorted(TERRAFORM.rglob("*.tf")):
        if ".terraform" in tf.parts:
            continue
        module = found.setdefault(tf.parent, Module(tf.parent, {}))
        parsed = parse(tf)
        module.files[tf] = parsed
        for block in parsed.get("variable", []):
            module.variables.update(block)
        for block in parsed.get("output", []):
            module.outputs.update(block)
        for block in parsed.get("locals", []):
            module.locals.update(block)
        for block in parsed.get("module", []):
            module.modules.update(block)
        for block in parsed.get("resource", []):
            for rtype, named in block.items():
                for rname, body in named.items():
                    module.resources[(rtype, rname)] = body
        for block in parsed.get("data", []):
            for dtype, named in block.items():
                for dname, body in named.items():
                    module.data[(dtype, dname)] = body
        module.terraform.extend(parsed.get("terraform", []))
    return found


def module_at(relative: str) -> Module:
    return modules()[TERRAFORM / relative]


def strings(tree: Any) -> Iterator[str]:
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from strings(key)
            yield from strings(value)
    elif isinstance(tree, list):
        for item in tree:
            yield from strings(item)


def interpolations(text: str) -> Iterator[str]:
    """The outermost `${...}` expressions of a serialized value (quote- and brace-aware)."""
    i = 0
    while True:
        start = text.find("${", i)
        if start < 0:
            return
        if start > 0 and text[start - 1] == "$":  # $${ is a literal
            i = start + 2
            continue
        depth, j, quoted = 0, start + 1, False
        while j < len(text):
            c = text[j]
            if quoted:
                if c == "\\":
                    j += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        yield text[start + 2 : j]
        i = j + 1


def expressions(tree: Any) -> Iterator[str]:
    for text in strings(tree):
        yield from interpolations(text)


def references_in(expression: str) -> set[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()
    for m in _REFERENCE.finditer(expression):
        if m["kind"]:
            found.add((m["kind"], m["name"], m["attr"] or ""))
        elif m["dtype"]:
            found.add(("data", m["dtype"], m["dname"]))
        else:
            found.add(("resource", m["rtype"], m["rname"]))
    return found


def local_source(module: Module, call: dict[str, Any]) -> Path | None:
    source = call.get("source", "")
    if not source.startswith(("./", "../")):
        return None
    return (module.path / source).resolve()


# --- tools ------------------------------------------------------------------------------


def terraform_binary() -> str | None:
    return os.environ.get("TERRAFORM") or shutil.which("terraform")


def checkov_binary() -> str | None:
    """checkov conflicts with the project's pins (it wants packaging<24, pytest wants >=24),
    so it usually lives in a virtual environment of its own: $CHECKOV, the PATH, this
    interpreter's bin directory, or /tmp/checkov-venv."""
    candidates = [
        os.environ.get("CHECKOV"),
        shutil.which("checkov"),
        str(Path(sys.executable).parent / "checkov"),
        "/tmp/checkov-venv/bin/checkov",
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def plugin_mirror() -> Path | None:
    """The local filesystem mirror holding hashicorp/aws (TF_PLUGIN_MIRROR, else under /opt)."""
    candidates = [os.environ.get("TF_PLUGIN_MIRROR"), "/opt/tf-plugins"]
    candidates += [
        str(p.parent.parent.parent) for p in Path("/opt").glob("*/registry.terraform.io/hashicorp/aws")
    ]
    for candidate in candidates:
        if candidate and (Path(candidate) / "registry.terraform.io" / "hashicorp" / "aws").is_dir():
            return Path(candidate)
    return None


def terraform_env(tmp: Path) -> dict[str, str]:
    """No user configuration, no plugin downloads, no telemetry."""
    env = dict(os.environ)
    env.update(
        TF_CLI_CONFIG_FILE=os.devnull,
        TF_IN_AUTOMATION="1",
        CHECKPOINT_DISABLE="1",
        TF_DATA_DIR=str(tmp / ".terraform"),
    )
    return env


def run(cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout
