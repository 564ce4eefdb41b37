from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tokenmill.settings import Settings, describe

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_embedded_mode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("DATABASE_URL", "REDIS_URL", "TOKENMILL_HOST", "TOKENMILL_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    s = Settings()
    assert (s.host, s.port) == ("127.0.0.1", 8000)
    assert s.db_url == f"sqlite+aiosqlite:///{tmp_path / 'tokenmill.db'}"
    assert s.redis_url is None
    assert s.cache_dir == tmp_path / "models"


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://u@db/tm")
    monkeypatch.setenv("REDIS_URL", "redis://cache:6379/0")
    monkeypatch.setenv("TOKENMILL_PORT", "9001")
    s = Settings()
    assert s.db_url == "postgresql://u@db/tm"
    assert s.redis_url == "redis://cache:6379/0"
    assert s.port == 9001


def test_bad_value_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_PORT", "eighty")
    with pytest.raises(ValueError, match="port"):
        Settings()


def test_secrets_generated_once_and_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("TOKENMILL_SECRET_KEY", raising=False)
    first = Settings()
    first.ensure_secrets()
    assert first.internal_token and first.secret_key and first.internal_token != first.secret_key
    path = tmp_path / "secrets.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Settings()
    again.ensure_secrets()
    assert (again.internal_token, again.secret_key) == (first.internal_token, first.secret_key)


def test_environment_secret_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    monkeypatch.setenv("TOKENMILL_INTERNAL_TOKEN", "from-env")
    s = Settings()
    s.ensure_secrets()
    assert s.internal_token == "from-env"


def test_readme_lists_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [env for env, _, _ in describe() if f"`{env}`" not in readme]
    assert not missing, f"README's configuration reference lacks {missing}"


def test_the_embedded_home_is_made_private_and_kept_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    s = Settings(home=home)
    s.secure_home()  # a worker's start: nothing of a database appears
    assert stat.S_IMODE(home.stat().st_mode) == 0o700 and list(home.iterdir()) == []
    s.secure_home(create_db=True)  # what `serve` and `migrate` do before SQLite opens it
    db = home / "tokenmill.db"
    assert db.exists() and db.stat().st_size == 0 and stat.S_IMODE(db.stat().st_mode) == 0o600
    # left readable by an older version: tightened; made stricter by someone: kept
    home.chmod(0o755)
    db.chmod(0o644)
    (home / "tokenmill.db-wal").write_bytes(b"")
    (home / "tokenmill.db-wal").chmod(0o664)
    (home / "secrets.json").write_text("{}")
    (home / "secrets.json").chmod(0o400)
    s.secure_home()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in home.iterdir()}
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert modes == {"tokenmill.db": 0o600, "tokenmill.db-wal": 0o600, "secrets.json": 0o400}
    # with a database elsewhere, no SQLite file appears in the home
    other = Settings(home=tmp_path / "other", database_url="postgresql://u@db/tm")
    other.secure_home(create_db=True)
    assert list((tmp_path / "other").iterdir()) == []
