"""Opening databases: migrations (idempotent, in sync with schema.py, refusing newer schemas), URL handling and
typed errors, pickling, identity."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from smthrs_plugin.stores import migrate
from smthrs_plugin.stores.database import Database, normalize_url, open_database
from smthrs_plugin.stores.migrate import VERSION_TABLE, ensure_schema, known_revisions, script_heads
from smthrs_plugin.stores.schema import metadata


def _versions(db: Database) -> list[str]:
    return sorted(
        db.read(lambda c: c.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all())
    )


def test_migrations_are_idempotent_and_keep_the_source_identity(db_url: str) -> None:
    db = open_database(db_url)
    source = db.source_id
    db.write(lambda c: db.next_revision(c))
    db.close()
    again = open_database(db_url)
    handle = again._handle()
    ensure_schema(again, handle.write_engine)  # a second explicit pass is a no-op too
    assert again.source_id == source and again.revision() == 1
    assert _versions(again) == sorted(script_heads())
    again.close()


def test_migrated_schema_matches_schema_py(db_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    db = open_database(db_url)

    def diff(conn: sa.Connection) -> list[object]:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": True})
        return list(compare_metadata(ctx, metadata))

    assert db.read(diff) == []
    db.close()


def test_a_database_newer_than_the_code_is_refused(db_url: str) -> None:
    db = open_database(db_url)
    db.write(lambda c: c.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '9999_from_the_future'")))
    db.close()
    with pytest.raises(Exception) as err:
        open_database(db_url)
    assert getattr(err.value, "code", None) == "schema_too_new"
    assert "9999_from_the_future" in str(err.value) and "upgrade smthrs_plugin" in str(err.value)
    # Nothing was written by the refused open.
    engine = sa.create_engine(normalize_url(db_url)[0])
    with engine.connect() as c:
        assert c.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all() == [
            "9999_from_the_future"
        ]
    engine.dispose()


def test_head_scan_agrees_with_alembic() -> None:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrate.MIGRATIONS_DIR))
    assert set(script.get_heads()) == set(script_heads())
    assert {r.revision for r in script.walk_revisions()} == set(known_revisions())


def test_database_pickles_as_its_url_and_reopens(sqlite_url: str) -> None:
    db = open_database(sqlite_url)
    blob = pickle.dumps(db)
    assert b"Engine" not in blob and len(blob) < 400
    clone = pickle.loads(blob)
    assert clone.url == db.url and clone.source_id == db.source_id
    db.close()


@pytest.mark.parametrize(
    "url",
    ["", "not a url", "mysql://u@h/db", "sqlite://", "sqlite:///:memory:", "postgresql+psycopg2://u@h/db"],
)
def test_unsupported_urls_are_refused_with_a_typed_error(url: str) -> None:
    with pytest.raises(Exception) as err:
        open_database(url)
    assert getattr(err.value, "code", None) == "unsupported_url"


def test_postgres_url_spellings_mean_psycopg() -> None:
    for spelling in ("postgresql://u@h:5/db", "postgres://u@h:5/db", "postgresql+psycopg://u@h:5/db"):
        assert normalize_url(spelling) == ("postgresql+psycopg://u@h:5/db", "postgresql")


def test_unreachable_server_is_a_typed_error_with_its_cause() -> None:
    with pytest.raises(Exception) as err:
        open_database("postgresql+psycopg://postgres@127.0.0.1:1/nothing")
    assert getattr(err.value, "code", None) == "unreachable"
    assert err.value.__cause__ is not None


def test_sqlite_parent_directory_is_created(tmp_path: Path) -> None:
    db = open_database(f"sqlite:///{tmp_path}/a/b/c/state.db")
    assert (tmp_path / "a/b/c/state.db").exists()
    mode = db.read(lambda c: c.exec_driver_sql("PRAGMA journal_mode").scalar())
    assert mode == "wal"
    assert db.read(lambda c: c.exec_driver_sql("PRAGMA foreign_keys").scalar()) == 1
    db.close()


def _open_without_root_powers(url: str) -> str:
    """Open ``url`` in a child process that lost CAP_DAC_OVERRIDE (root ignores file modes otherwise)."""
    code = (
        "from smthrs_plugin.stores.database import open_database\n"
        f"try:\n    open_database({url!r})\n"
        "except Exception as e:\n    print(getattr(e, 'code', repr(e)))\n"
    )
    caps = "-dac_override,-dac_read_search"
    prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"] if os.geteuid() == 0 else []
    out = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or out.stderr


@pytest.mark.skipif(
    os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root needs setpriv to drop powers"
)
@pytest.mark.parametrize("what", ["file", "directory"])
def test_read_only_sqlite_database_is_a_typed_error(tmp_path: Path, what: str) -> None:
    url = f"sqlite:///{tmp_path}/db/state.db"
    open_database(url).close()
    target = tmp_path / "db" / "state.db" if what == "file" else tmp_path / "db"
    target.chmod(0o444 if what == "file" else 0o555)
    try:
        assert _open_without_root_powers(url) == "read_only"
    finally:
        target.chmod(0o755)


def test_a_write_lock_held_past_the_busy_timeout_is_a_typed_error(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    from smthrs_plugin.stores import database as database

    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_S", 0.2)
    db = open_database(sqlite_url)
    holder = sqlite3.connect(str(db.sqlite_path), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(Exception) as err:
            db.write(lambda c: db.next_revision(c))
        assert getattr(err.value, "code", None) == "locked" and "lock" in str(err.value)
        assert isinstance(err.value.__cause__, (sqlite3.OperationalError, sa.exc.OperationalError))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert db.write(lambda c: db.next_revision(c)) == 1  # the lock is free again
    db.close()


def test_opening_a_database_whose_write_lock_another_process_holds_is_a_typed_store_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    from smthrs_plugin.errors import StoreError
    from smthrs_plugin.stores import database

    url = f"sqlite:///{tmp_path / 'state.db'}"
    open_database(url).close()  # created and migrated; the next open checks the schema again
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_S", 0.2)  # the holder never lets go: fail fast
    holder = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreError) as caught:
            open_database(url)
        assert caught.value.code == "locked" and "write lock" in caught.value.message
    finally:
        holder.execute("ROLLBACK")
        holder.close()
