"""Test harness: real PostgreSQL and Redis, started by the tests themselves.

Fixtures (others code against these names):

- ``redis_url`` (session): ``TEST_REDIS_URL``, else a throwaway ``redis-server`` on a free port.
- ``pg_server_url`` (session): plain ``postgresql://`` URL of a server's maintenance database;
  ``TEST_DATABASE_URL``, else a throwaway ``initdb`` cluster on 127.0.0.1 and a free port.
- ``pg_url`` (function): ``postgresql+asyncpg://`` URL of a fresh ``tm_test_<random>`` database,
  dropped afterwards. Only databases this harness created are ever dropped.
- ``sqlite_url`` (function): ``sqlite+aiosqlite:///`` file in ``tmp_path``.
- ``db_url`` (function): parametrized over sqlite and postgresql, for code that must run on both.
- ``migrated_db`` (function): an ``async_sessionmaker`` on a ``db_url`` database at migration head.
  Fixtures that need a database at head call ``tests.databases.migrate`` (a copy of a template
  migrated once per run); ``tests.databases.create``/``drop`` make and remove PostgreSQL ones.
- ``model_cache`` (session): a directory shared by the session for converted model files.

Servers are started lazily (only when a test asks for them), never assumed to be running, and
removed at session end, with ``atexit`` as a backup for aborted runs. The terminal summary
says which backends actually ran.
"""

from __future__ import annotations

import asyncio
import atexit
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")

# The test tree mirrors the packages (tests/billing/, tests/gateway/, ...) without __init__.py, and
# pytest puts tests/ on sys.path. Unless the repo root comes first, `import billing` can resolve to
# the namespace package tests/billing/ instead of the real one (also with an editable install,
# whose import hook runs after the path search).
# Without a GPU, Triton kernels run in its interpreter. Triton reads the switch when it is
# first imported (which torch or transformers may do early), so set it before anything else.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.stalls import LoopWatch  # noqa: E402 (the repo root on the path first)

# --------------------------------------------------------------------------------------------
# Bookkeeping: which backends ran (for the terminal summary) and cleanup on abnormal exit
# --------------------------------------------------------------------------------------------


@dataclass
class _Backends:
    used: dict[str, str] = field(default_factory=dict)  # backend name -> description


_BACKENDS = pytest.StashKey[_Backends]()


def _record_backend(config: pytest.Config, name: str, description: str) -> None:
    config.stash.setdefault(_BACKENDS, _Backends()).used[name] = description


class _Cleanup:
    """An idempotent stop action, registered with atexit until it has run.

    Pytest tears session fixtures down on failures and Ctrl-C; atexit covers the rest
    (an exception inside pytest itself, or a fixture setup that died half-way).
    """

    def __init__(self, action: Callable[[], None]) -> None:
        self._action: Callable[[], None] | None = action
        atexit.register(self)

    def __call__(self) -> None:
        action, self._action = self._action, None
        if action is not None:
            atexit.unregister(self)
            action()


def _free_port() -> int:
    """A port that was free a moment ago; callers retry if another process wins the race."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_async(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from sync fixture code.

    In a worker thread, because ``asyncio.run`` on the main thread would replace the event loop
    that pytest-asyncio keeps for the session.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def _is_root() -> bool:
    return os.geteuid() == 0


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------------------------


def _redis_version(url: str) -> str:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return str(client.info("server")["redis_version"])
    finally:
        client.close()


def _start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server not found: install it (Debian: apt-get install redis-server) "
            "or set TEST_REDIS_URL to a Redis the tests may use.",
            pytrace=False,
        )
    import redis

    log = tmp / "redis.log"
    for _attempt in range(3):
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp), "--logfile", str(log), "--daemonize", "no"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
                    client.ping()
                return proc, port
            except redis.ConnectionError:
                time.sleep(0.05)
        _stop_process(proc)  # lost the port race, or it never came up: try another port
    pytest.fail(f"redis-server did not start; last log lines:\n{_tail(log)}", pytrace=False)


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """URL of a Redis the tests own (database 0 of a throwaway server), or TEST_REDIS_URL."""
    if url := os.environ.get("TEST_REDIS_URL"):
        _record_backend(request.config, "Redis", f"Redis {_redis_version(url)} (TEST_REDIS_URL)")
        yield url
        return

    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-redis-"))
    try:
        proc, port = _start_redis(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    def _remove() -> None:
        _stop_process(proc)
        shutil.rmtree(tmp, ignore_errors=True)

    stop = _Cleanup(_remove)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        _record_backend(
            request.config, "Redis", f"Redis {_redis_version(url)} (throwaway on 127.0.0.1:{port})"
        )
        yield url
    finally:
        stop()


# --------------------------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------------------------


def _find_pg_bindir() -> Path | None:
    """Directory holding initdb, pg_ctl and postgres: PATH first, then Debian's versioned dirs."""
    if found := shutil.which("initdb"):
        return Path(found).resolve().parent
    candidates = glob.glob("/usr/lib/postgresql/*/bin/initdb")

    def version(path: str) -> float:
        try:
            return float(Path(path).parts[-3])
        except ValueError:
            return 0.0

    return Path(max(candidates, key=version)).parent if candidates else None


@dataclass
class _PgCluster:
    """A throwaway cluster in a temp dir; run as `postgres` when we are root (initdb refuses root)."""

    bindir: Path
    root: Path
    port: int = 0

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    def _cmd(self, tool: str, *args: str) -> list[str]:
        argv = [str(self.bindir / tool), *args]
        return ["runuser", "-u", "postgres", "--", *argv] if _is_root() else argv

    def _run(self, tool: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._cmd(tool, *args), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    def init(self) -> None:
        result = self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-locale",
            "--no-sync",
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{result.stdout}\n{result.stderr}")
        # Durability is pointless for a cluster that is deleted at the end of the run.
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.root}'",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            "shared_buffers": "64MB",
            "log_min_messages": "warning",
        }
        conf = "".join(f"{key} = {value}\n" for key, value in settings.items())
        # Written by root is fine: the postgres user only needs to read it.
        with (self.data / "postgresql.conf").open("a") as f:
            f.write("\n# tokenmill test harness\n" + conf)

    def start(self) -> None:
        """pg_ctl start on a free port, retrying on the (rare) race for the port."""
        for _attempt in range(3):
            self.port = _free_port()
            result = self._run(
                "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                "-o", f"-p {self.port}", "start",
            )  # fmt: skip
            if result.returncode == 0:
                return
        raise RuntimeError(f"pg_ctl start failed:\n{result.stdout}\n{result.stderr}\n{_tail(self.log)}")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def _make_cluster_root() -> Path:
    if not _is_root():
        return Path(tempfile.mkdtemp(prefix="tokenmill-pg-"))
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail(
            "running as root, and there is no `postgres` user to run initdb as: install PostgreSQL "
            "from Debian packages (apt-get install postgresql) or set TEST_DATABASE_URL.",
            pytrace=False,
        )
    # Under /tmp rather than $TMPDIR, which for root may sit where `postgres` cannot traverse.
    root = Path(tempfile.mkdtemp(prefix="tokenmill-pg-", dir="/tmp"))
    os.chown(root, pw.pw_uid, pw.pw_gid)
    return root


async def _pg_server_version(url: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        # "15.20 (Debian 15.20-0+deb12u1)" -> "15.20"
        return str(await conn.fetchval("SHOW server_version")).split()[0]
    finally:
        await conn.close()


def _plain_pg_url(url: str) -> str:
    """asyncpg.connect wants a libpq-style URL, without SQLAlchemy's +driver suffix."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_server_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """Plain ``postgresql://`` URL of a server the tests may create databases on."""
    if url := os.environ.get("TEST_DATABASE_URL"):
        url = _plain_pg_url(url.replace("postgres://", "postgresql://", 1))
        version = _run_async(lambda: _pg_server_version(url))
        _record_backend(request.config, "PostgreSQL", f"PostgreSQL {version} (TEST_DATABASE_URL)")
        yield url
        return

    bindir = _find_pg_bindir()
    if bindir is None:
        pytest.fail(
            "PostgreSQL server binaries (initdb) not found in PATH or /usr/lib/postgresql/*/bin: "
            "install them (Debian: apt-get install postgresql) or set TEST_DATABASE_URL.",
            pytrace=False,
        )
    cluster = _PgCluster(bindir=bindir, root=_make_cluster_root())
    stop = _Cleanup(cluster.stop)
    try:
        try:
            cluster.init()
            cluster.start()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            pytest.fail(f"could not start a throwaway PostgreSQL cluster: {exc}", pytrace=False)
        url = f"postgresql://postgres@127.0.0.1:{cluster.port}/postgres"
        version = _run_async(lambda: _pg_server_version(url))
        _record_backend(
            request.config,
            "PostgreSQL",
            f"PostgreSQL {version} (throwaway cluster on 127.0.0.1:{cluster.port})",
        )
        yield url
    finally:
        stop()


@pytest.fixture
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A fresh, empty database of its own for one test, as a ``postgresql+asyncpg://`` URL."""
    from tests import databases

    name = f"tm_test_{secrets.token_hex(6)}"
    _run_async(lambda: databases.create(pg_server_url, name))
    try:
        yield (
            make_url(pg_server_url)
            .set(drivername="postgresql+asyncpg", database=name)
            .render_as_string(hide_password=False)
        )
    finally:
        _run_async(lambda: databases.drop(pg_server_url, name))


# --------------------------------------------------------------------------------------------
# SQLite, both-backend parametrization, model cache
# --------------------------------------------------------------------------------------------


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Either database URL; resolved lazily so a sqlite-only selection never starts PostgreSQL."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
async def migrated_db(db_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """A session factory on a database at migration head, on SQLite and on PostgreSQL."""
    # Imported here so a broken project module fails the tests that need it, not the harness.
    from tests import databases
    from tokenmill.db import make_engine, make_sessionmaker

    # migrate() runs its own event loop (as the migrations do): keep it off this one.
    await asyncio.to_thread(databases.migrate, db_url)
    engine = make_engine(db_url)
    try:
        yield make_sessionmaker(engine)
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """Where converted model files (e.g. tokenizer.json from the bundled GGUF) persist across runs."""
    path = Path(os.environ.get("TOKENMILL_TEST_MODEL_CACHE", ROOT / ".pytest_cache" / "tokenmill-models"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def vllm_server(request: pytest.FixtureRequest, model_cache: Path) -> Iterator[Any]:
    """One vLLM server (the CPU build in .venv-vllm, serving the converted SmolLM2) for the
    whole run: a `tests.vllm_server.RunningVllm`. Fails, never skips, without .venv-vllm."""
    from tests.vllm_server import start_test_vllm

    log_dir = Path(tempfile.mkdtemp(prefix="tokenmill-vllm-"))
    running = start_test_vllm(model_cache, log_dir)
    stop = _Cleanup(running.stop)
    _record_backend(request.config, "vLLM", f"vLLM CPU (started in {running.start_seconds:.0f}s)")
    try:
        yield running
    finally:
        stop()
        shutil.rmtree(log_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------------


def _terminate_as_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"received signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """Treat SIGTERM (CI cancel, `timeout`, `kill`) like Ctrl-C.

    By default SIGTERM ends Python without fixture teardown or atexit, which would leave the
    throwaway servers running; as a KeyboardInterrupt, pytest tears the session down first.
    """
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate_as_interrupt)


_LOOP_WATCH = LoopWatch()


@pytest.fixture(scope="session", autouse=True)
async def _loop_watch() -> AsyncIterator[None]:
    """Stalls of the session's event loop, noted for the reports of the tests they fail."""
    _LOOP_WATCH.start(asyncio.get_running_loop())
    yield
    _LOOP_WATCH.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test that used the shared vLLM gets its processes' states and log's end: a
    hang or crash in vLLM shows only as a timeout on our side. Any failed test gets the stalls
    of the event loop seen since its setup began (tests/stalls.py)."""
    report = yield
    if report.failed:
        running = getattr(item, "funcargs", {}).get("vllm_server")
        if running is not None:
            report.sections.append(("vLLM server", running.report()))
        stalls = _LOOP_WATCH.since(item.stash.get(_STARTED, time.monotonic()))
        if stalls:
            report.sections.append(("event loop stalls", "\n\n".join(stalls)))
    return report


_STARTED = pytest.StashKey[float]()
_NICE = os.getpriority(os.PRIO_PROCESS, 0)  # this (main) thread's, as the run started


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = time.monotonic()


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A test that lowers the main thread's priority (the KV prefault's C function, called on
    it) leaves every later test, and every process they start, starved by any busy server:
    the vLLM worker tests timed out in CI that way. It errors here instead."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice != _NICE:
        raise RuntimeError(f"{item.nodeid} changed the main thread's nice from {_NICE} to {nice}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `@pytest.mark.gpu` tests without CUDA; torch is imported only if such tests exist."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line saying which real backends the run exercised, so a green run can't hide a skip."""
    used = config.stash.get(_BACKENDS, _Backends()).used
    parts = [used.get(name, f"{name} not used") for name in ("PostgreSQL", "Redis")]
    terminalreporter.write_line("backends: " + ", ".join(parts))
