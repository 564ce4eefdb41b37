"""Fixtures of the e2e tests: one `tokenmill serve` shared by the modules that can share it.

Starting a server with its real workers takes 10-70 s on a 2-core machine, so modules whose tests
run against the default settings share one (`shared_server`), each seeing it as an
organisation of its own:

    @pytest.fixture(scope="module")
    def server(shared_server: Server) -> Server:
        return shared_server.for_org("my-module")  # `key`, `client()`: the org's member key

- ``shared_server`` (session): a `tests.e2e.serve.Server` started with the default settings
  (SmolLM2 chat worker and MiniLM embeddings worker, both ready), its `key` the admin key it
  printed. Never stop, kill or restart it, nor change its settings; count only what your module
  made (its own organisation, request ids, batch ids): other modules use it too. (One test,
  marked ``stops_shared_server``, stops it with SIGTERM: it runs after all the others.)
- ``other_org_client`` (function): an `openai.OpenAI` of a new organisation on the module's own
  `server` fixture, for "another organisation gets 404" tests.

A module that needs other settings, or stops, kills or restarts its server, starts its own with
`tests.e2e.serve.start_server(tmp, model_cache, extra_env)` and `close()`s it.

The tests using `shared_server` run one after the other (collection moves them together, in
their order, the marked one last), and the server is stopped after the last of them rather than
at the end of the session: an idle server and its workers would otherwise take memory and CPU
from the rest.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.serve import Server, start_server

SHARED = "shared_server"
STOPS = "stops_shared_server"
_SERVER = pytest.StashKey[Server]()
_LAST_USER = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def shared_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_cache: Path
) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("shared-serve"), model_cache)
    request.config.stash[_SERVER] = server
    try:
        server.wait_for_embeddings()
        yield server
    finally:
        server.close()


@pytest.fixture
def other_org_client(server: Server) -> openai.OpenAI:
    return server.for_org("other-org").client()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{STOPS}: stops the shared server; runs after its other tests")


@pytest.hookimpl(trylast=True)  # after deselection (-k, -m): the last user must be one that runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the tests using the shared server together, where the first of them is."""
    users = [item for item in items if SHARED in getattr(item, "fixturenames", ())]
    if not users:
        return
    first = items.index(users[0])
    others = [item for item in items if SHARED not in getattr(item, "fixturenames", ())]
    # a stable sort: the marked test goes last, the others keep their order
    users.sort(key=lambda item: item.get_closest_marker(STOPS) is not None)
    items[:] = others[:first] + users + others[first:]
    config.stash[_LAST_USER] = users[-1].nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    yield
    if item.nodeid == item.config.stash.get(_LAST_USER, None) and _SERVER in item.config.stash:
        item.config.stash[_SERVER].close()  # the fixture's own teardown, at session end, is then a no-op
