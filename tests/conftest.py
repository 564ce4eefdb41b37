"""Session fixtures: PostgreSQL, Redis and the model cache.

PLACEHOLDER written to fix fixture names; the harness (throwaway servers) replaces the bodies.
Fixture names: pg_url (fresh PostgreSQL database URL, postgresql+asyncpg://), sqlite_url,
redis_url (redis://...), model_cache (Path shared by the session).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_url() -> str:
    return os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture(scope="session")
def model_cache() -> Path:
    path = Path(os.environ.get("TOKENMILL_TEST_MODEL_CACHE", ROOT / ".pytest_cache" / "tokenmill-models"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"
