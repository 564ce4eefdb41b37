"""The README's OpenAI compatibility tables against the code and the official SDK.

Fast, no server: the tables are parsed and held to the installed `openai` SDK's request
parameters, the gateway's request structs, their ignored/refused lists and the routes the
gateway serves. What the server answers for each kind of parameter is tested elsewhere, on
a running gateway:

- refused by name, each with its own message: tests/gateway/test_api.py
  (`test_openai_parameters_we_refuse_are_named`) and tests/gateway/test_responses_api.py
  (`test_what_is_not_served_is_refused_before_any_work`);
- any other name, `400 Unrecognized request argument supplied: <name>`: test_api.py
  (`test_unknown_request_fields_are_refused_by_name`);
- ignored ones change nothing: test_api.py (`test_openai_parameters_we_ignore_are_accepted`),
  test_responses_api.py (`test_openais_parameters_that_mean_nothing_here_are_accepted_and_change_nothing`);
- extensions reach the worker: test_api.py (`test_extensions_are_accepted_and_reach_the_worker`);
- an unknown path is a 404 and a wrong method a 405: tests/gateway/test_request_limits.py
  (`test_every_answer_carries_a_fresh_request_id`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest
from litestar import Litestar
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from gateway.batches import BatchesController
from gateway.controllers import OpenAIController
from gateway.files import FilesController
from gateway.responses import ResponsesController
from tokenmill.openai_responses import RESPONSES_PARAMETERS, ResponseCreateRequest
from tokenmill.openai_types import (
    PARAMETERS,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    Parameters,
)

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "### OpenAI compatibility"

PARAMETER_STATUSES = {"supported", "ignored", "refused by name", "refused by value", "extension"}
ENDPOINT_STATUSES = {"supported", "refused", "not served"}


class Endpoint(NamedTuple):
    body: type[msgspec.Struct]  # the gateway's request struct
    known: Parameters  # its ignored, extension and refused-by-name lists
    sdk: tuple[Any, ...]  # the SDK's TypedDicts of the request (`stream` is on the streaming one)


ENDPOINTS = {
    "/v1/chat/completions": Endpoint(
        ChatCompletionRequest,
        PARAMETERS[ChatCompletionRequest],
        (chat_create_params.CompletionCreateParamsBase, chat_create_params.CompletionCreateParamsStreaming),
    ),
    "/v1/completions": Endpoint(
        CompletionRequest,
        PARAMETERS[CompletionRequest],
        (
            completion_create_params.CompletionCreateParamsBase,
            completion_create_params.CompletionCreateParamsStreaming,
        ),
    ),
    "/v1/embeddings": Endpoint(
        EmbeddingRequest, PARAMETERS[EmbeddingRequest], (embedding_create_params.EmbeddingCreateParams,)
    ),
    "/v1/responses": Endpoint(
        ResponseCreateRequest,
        RESPONSES_PARAMETERS,
        (
            response_create_params.ResponseCreateParamsBase,
            response_create_params.ResponseCreateParamsStreaming,
        ),
    ),
}


# --- reading the README --------------------------------------------------------------------


def section() -> list[str]:
    """The lines of the README's "OpenAI compatibility" subsection."""
    lines = README.read_text().splitlines()
    start = lines.index(SECTION)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(("## ", "### "))), len(lines))
    return lines[start + 1 : end]


def tables() -> list[list[list[str]]]:
    """Every table of the section: rows of cells, the header first (the |---| line dropped)."""
    found: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in section():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(set(c) <= {"-", ":"} for c in cells):
            continue
        if current is None:
            current = []
            found.append(current)
        current.append(cells)
    return found


def code(cell: str) -> list[str]:
    """The `backticked` parts of a cell."""
    return re.findall(r"`([^`]+)`", cell)


def parameter_table(endpoint: str) -> dict[str, tuple[str, str]]:
    """name -> (status, notes) of the endpoint's table (its header's first cell is the path)."""
    matching = [t for t in tables() if code(t[0][0]) == [endpoint]]
    assert len(matching) == 1, f"README's {SECTION} should have one table headed `{endpoint}`"
    header, *rows = matching[0]
    assert header[1:] == ["status", "notes"], f"`{endpoint}` table: columns are {header}"
    out: dict[str, tuple[str, str]] = {}
    for cells in rows:
        names = code(cells[0])
        assert len(names) == 1 and cells[0] == f"`{names[0]}`", (
            f"`{endpoint}` table: one parameter per row, as `name`; got {cells[0]!r}"
        )
        assert names[0] not in out, f"`{endpoint}` table: '{names[0]}' has two rows"
        out[names[0]] = (cells[1], cells[2])
    return out


# --- parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_parameter_has_a_row_that_matches_the_gateway(endpoint: str) -> None:
    spec = ENDPOINTS[endpoint]
    rows = parameter_table(endpoint)
    openai_names = {n for t in spec.sdk for n in t.__annotations__}
    declared = {f.encode_name for f in msgspec.structs.fields(spec.body)}
    problems = [
        f"OpenAI's parameter '{n}' has no row: add it (supported, ignored with why, or refused)"
        for n in sorted(openai_names - rows.keys())
    ]
    problems += [
        f"'{n}' is declared by {spec.body.__name__} but has no row" for n in sorted(declared - rows.keys())
    ]
    for name, (status, notes) in rows.items():
        if status not in PARAMETER_STATUSES:
            problems.append(f"'{name}': status {status!r} is none of {sorted(PARAMETER_STATUSES)}")
            continue
        if name not in openai_names and name not in spec.known.extensions:
            problems.append(f"'{name}' is neither OpenAI's parameter (in the SDK) nor a listed extension")
        if (status == "extension") != (name in spec.known.extensions):
            problems.append(f"'{name}' is marked {status!r}; an extension is marked so, and only one")
        if (status == "ignored") != (name in spec.known.ignored):
            where = "is not in" if status == "ignored" else "is in"
            problems.append(f"'{name}' is marked {status!r} but {where} the endpoint's ignored table")
        if (status == "refused by name") != (name in spec.known.refused):
            where = "is not in" if status == "refused by name" else "is in"
            problems.append(f"'{name}' is marked {status!r} but {where} the endpoint's refused table")
        # Anything the body accepts (some values of it, at least) must be a field of the struct,
        # and what is refused by name must not be one (it would be accepted by the decoder).
        if (status == "refused by name") == (name in declared):
            problems.append(
                f"'{name}' is marked {status!r} but {'is' if name in declared else 'is not'} a field "
                f"of {spec.body.__name__}"
            )
        if status != "supported" and not notes:
            problems.append(f"'{name}' is marked {status!r}: its notes must say why (or which values)")
    assert not problems, f"README's `{endpoint}` table:\n  " + "\n  ".join(problems)


# --- endpoints -----------------------------------------------------------------------------

_METHOD = re.compile(r"^(GET|POST|PUT|PATCH|DELETE) (/v1\S*)$")


def served() -> dict[tuple[str, str], re.Pattern[str]]:
    """(method, path as OpenAI writes it) -> a pattern of the concrete paths, for every route of
    the controllers `tokenmill/app.py` mounts under /v1."""
    app = Litestar(
        route_handlers=[OpenAIController, ResponsesController, FilesController, BatchesController],
        openapi_config=None,
    )
    out = {}
    for route in app.routes:
        pattern = re.escape(route.path)
        for param in re.findall(r"\{[^}]+\}", route.path):
            pattern = pattern.replace(re.escape(param), ".+" if param.endswith(":path}") else "[^/]+")
        for method in route.methods - {"OPTIONS", "HEAD"}:
            out[(method, re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", route.path))] = re.compile(pattern + "$")
    return out


def endpoint_rows() -> list[list[str]]:
    matching = [t for t in tables() if t[0][0] == "endpoint"]
    assert len(matching) == 1, f"README's {SECTION} should have one table headed `endpoint`"
    header, *rows = matching[0]
    assert header == ["endpoint", "SDK (`client.`…)", "status", "notes"], header
    return rows


def test_endpoint_table_lists_every_route_and_only_those_as_served() -> None:
    routes = served()
    listed: set[tuple[str, str]] = set()
    problems = []
    for cells in endpoint_rows():
        first, _, status, notes = cells
        if status not in ENDPOINT_STATUSES:
            problems.append(f"{first}: status {status!r} is none of {sorted(ENDPOINT_STATUSES)}")
            continue
        for path in code(first):
            exact = _METHOD.match(path)
            if status != "not served":
                # A served (or served-and-refusing) endpoint is one route: METHOD /path.
                if exact is None or (exact[1], exact[2]) not in routes:
                    problems.append(f"`{path}` is marked {status!r} but is no route of the gateway")
                else:
                    listed.add((exact[1], exact[2]))
            elif exact is not None:
                # Not served: no route of that method takes it. The answer is a 405 when a route of
                # another method does (Litestar's), else a 404.
                concrete = re.sub(r"\{\w+\}", "x", exact[2])
                takes = {m for (m, _), p in routes.items() if p.match(concrete)}
                if exact[1] in takes:
                    problems.append(f"`{path}` is marked not served but the gateway serves it")
                expected = "405" if takes else "404"
                if "WebSocket" not in first and not notes.startswith(expected):
                    problems.append(f"`{path}`: a client gets {expected}; the notes say {notes!r}")
            else:
                # A family of paths: nothing at or under it is served.
                under = sorted({p for (_, p) in routes if p == path or p.startswith(path + "/")})
                if not path.startswith("/v1/") or under:
                    problems.append(f"`{path}` is marked not served but the gateway serves {under}")
                elif not notes.startswith("404"):
                    problems.append(f"`{path}`: a client gets 404; the notes say {notes!r}")
    problems += [f"the route {m} {p} has no row marked served" for m, p in sorted(routes.keys() - listed)]
    assert not problems, "README's endpoint table:\n  " + "\n  ".join(problems)
