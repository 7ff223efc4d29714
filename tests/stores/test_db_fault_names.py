"""Database faults are named by what they are (``stores/dberrors.py``), each with the fix, never with SQL text.

Real faults only: a file that is not SQLite, a malformed database image, a full disk (an 8 MB tmpfs, filled), a
read-only volume (the tmpfs remounted read-only), SQLite's write lock held by another connection past the busy
timeout, a PostgreSQL URL on a closed port, a schema newer than the code. Each is a typed ``StoreError`` whose code
names the fault, whose message says what to do, whose ``cause`` is the driver's own exception — and whose message
and ``--json`` form carry none of the statement that failed. The passing ones (``disk_full``, ``locked``,
``read_only``, ``unreachable``) are what ``errors.passing_fault`` finds; the others are not.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from smthrs_plugin.cli import app
from smthrs_plugin.errors import StoreError, passing_fault
from smthrs_plugin.stores.database import Database, open_database
from smthrs_plugin.stores.migrate import VERSION_TABLE

# A statement whose text would be recognised anywhere: it must never reach a message.
MARKER_SQL = "CREATE TABLE IF NOT EXISTS smthrs_fault_marker_table (payload BLOB)"


def _assert_named(err: StoreError, code: str, *fix: str, driver: bool = True) -> None:
    assert err.code == code, (err.code, err.message)
    for words in fix:
        assert words in err.message, (words, err.message)
    shown = json.dumps(err.to_dict())
    for sql in ("[SQL", "smthrs_fault_marker", "SELECT ", "INSERT ", "UPDATE ", "PRAGMA "):
        assert sql not in err.message and sql not in shown, (sql, shown)
    if driver:
        assert err.cause is not None and err.__cause__ is not None  # the driver's exception is kept
    assert (passing_fault(err) is err) == (
        code in {"disk_full", "locked", "read_only", "unreachable", "contended"}
    )


def _grow(db: Database) -> None:
    db.write(lambda c: c.exec_driver_sql(MARKER_SQL))
    db.write(
        lambda c: c.exec_driver_sql(
            "INSERT INTO smthrs_fault_marker_table VALUES (randomblob(4000000))"  # 4 MB: the WAL must grow
        )
    )


def test_a_file_that_is_not_a_database_is_named_so_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_text("this is a CSV export, not a database\n" * 200)
    with pytest.raises(StoreError) as caught:
        open_database(f"sqlite:///{path}")
    _assert_named(caught.value, "not_a_database", str(path), "is not a SQLite database", "SMTHRS_DB_URL")
    assert "server" not in caught.value.message  # no "check that the server is running" for a file
    assert path.read_text().startswith("this is a CSV export")  # nothing was written into it


def test_the_cli_names_a_file_that_is_not_a_database_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("not sqlite\n" * 200)
    result = CliRunner().invoke(app, ["runs", "--db", f"sqlite:///{path}", "--json"])
    assert result.exit_code == 2, result.output
    err = json.loads(result.output)["error"]
    assert (err["family"], err["code"]) == ("store", "not_a_database") and "SMTHRS_DB_URL" in err["message"]


def test_a_malformed_database_is_named_corrupt_with_the_fix_and_no_sql(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    open_database(url).close()
    checkpoint = sqlite3.connect(tmp_path / "state.db")
    checkpoint.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    checkpoint.close()
    size = (tmp_path / "state.db").stat().st_size
    with open(tmp_path / "state.db", "r+b") as f:  # the header page stays; every table page is garbage
        f.seek(4096)
        f.write(bytes((i * 131 + 7) % 256 for i in range(size - 4096)))
    with pytest.raises(StoreError) as caught:
        open_database(url)
    _assert_named(caught.value, "corrupt", "damaged", "smthrs recover restore")


def test_a_full_disk_is_named_disk_full_with_the_fix_and_no_sql(
    volume: Path, fill_volume: Callable[[Path], None]
) -> None:
    db = open_database(f"sqlite:///{volume / 'state.db'}")
    try:
        fill_volume(volume / "filler")
        with pytest.raises(StoreError) as caught:
            _grow(db)
        _assert_named(caught.value, "disk_full", "disk", "full", "free space")
        (volume / "filler").unlink()
        _grow(db)  # the fault passed: the same write succeeds
    finally:
        db.close()


def test_a_read_only_volume_is_named_read_only_with_the_fix(volume: Path) -> None:
    url = f"sqlite:///{volume / 'state.db'}"
    open_database(url).close()  # closed: a volume with files open for writing cannot be remounted read-only
    subprocess.run(["mount", "-o", "remount,ro", str(volume)], check=True)
    try:
        with pytest.raises(StoreError) as caught:
            open_database(url)
        # Refused before the driver is asked (the file is checked first): no driver exception to keep.
        _assert_named(caught.value, "read_only", "read-only", "write access", driver=False)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(volume)], check=True)
    open_database(url).close()  # writable again: the same open succeeds


def test_a_write_lock_held_past_the_busy_timeout_is_named_locked(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from smthrs_plugin.stores import database

    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_S", 0.2)  # the holder never lets go: fail fast
    db = open_database(sqlite_url)
    holder = sqlite3.connect(str(db.sqlite_path), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreError) as caught:
            _grow(db)
        _assert_named(caught.value, "locked", "write lock", "another process holds it")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    _grow(db)  # the lock is free again
    db.close()


def test_a_postgresql_url_on_a_closed_port_is_named_unreachable_with_the_fix() -> None:
    with socket.socket() as s:  # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StoreError) as caught:
        open_database(f"postgresql://smthrs:secret-password@127.0.0.1:{port}/state")
    _assert_named(caught.value, "unreachable", "PostgreSQL server", "running", f"127.0.0.1:{port}")
    assert "secret-password" not in json.dumps(caught.value.to_dict())  # the URL is shown without it


def test_a_schema_newer_than_the_code_is_named_with_the_fix(sqlite_url: str) -> None:
    db = open_database(sqlite_url)
    db.write(lambda c: c.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '9999_from_the_future'")))
    db.close()
    with pytest.raises(StoreError) as caught:
        open_database(sqlite_url)
    assert caught.value.code == "schema_too_new" and "upgrade smthrs_plugin" in caught.value.message
    assert passing_fault(caught.value) is None


@pytest.mark.postgres
def test_serialization_conflicts_past_the_retry_budget_are_the_passing_fault_contended(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every attempt reads a row, another session updates it and commits, then the attempt updates it too: a real
    # 40001 each time. The budget is made small here; by default it is 64 attempts and at least 30 s.
    from smthrs_plugin.stores import database as database_module

    monkeypatch.setattr(database_module, "MAX_WRITE_ATTEMPTS", 3)
    monkeypatch.setattr(database_module, "SERIALIZATION_PATIENCE_S", 0.0)
    other = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with other.connect() as o:
        o.exec_driver_sql("CREATE TABLE contention_probe (id integer PRIMARY KEY, v integer NOT NULL)")
        o.exec_driver_sql("INSERT INTO contention_probe VALUES (1, 0)")
    db = open_database(postgres_url)
    attempts: list[int] = []

    def conflicting(conn: sa.Connection) -> None:
        attempts.append(1)
        conn.exec_driver_sql("SELECT v FROM contention_probe WHERE id = 1").all()
        with other.connect() as o:
            o.exec_driver_sql("UPDATE contention_probe SET v = v + 1 WHERE id = 1")
        conn.exec_driver_sql("UPDATE contention_probe SET v = v + 1 WHERE id = 1")

    try:
        with pytest.raises(StoreError) as caught:
            db.write(conflicting)
    finally:
        db.close()
        other.dispose()
    _assert_named(
        caught.value, "contended", "serialization conflicts after 3 attempts", "run the same command again"
    )
    assert (
        len(attempts) == 3
    )  # the whole transaction re-ran each time, then the fault was named, not store_failed
