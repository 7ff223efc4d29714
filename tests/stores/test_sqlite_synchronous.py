"""The SQLite durability knob (``SMTHRS_SQLITE_SYNCHRONOUS``): applied on every connection, FULL by default,
validated before anything is opened, one mode per database file per process."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import sqlalchemy as sa

import smthrs_plugin as sp
from smthrs_plugin.errors import SettingsError, StoreError
from smthrs_plugin.settings import load_settings
from smthrs_plugin.stores.database import Database, open_database

# SQLite's numeric answer to ``PRAGMA synchronous``.
_PRAGMA_VALUE = {"normal": 1, "full": 2}


def _synchronous(db: Database) -> tuple[int, int]:
    """(write connection, read connection) values of ``PRAGMA synchronous``."""
    query = sa.text("PRAGMA synchronous")
    return (
        int(db.write(lambda c: c.execute(query).scalar_one())),
        int(db.read(lambda c: c.execute(query).scalar_one())),
    )


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SMTHRS_SQLITE_SYNCHRONOUS", raising=False)


@pytest.mark.parametrize("mode", ["full", "normal", "NORMAL"])
def test_explicit_sqlite_synchronous_is_the_pragma_of_write_and_read_connections(
    tmp_path: Path, mode: str
) -> None:
    db = open_database(f"sqlite:///{tmp_path / 'state.db'}", sqlite_synchronous=mode)
    try:
        assert db.sqlite_synchronous == mode.lower()
        assert _synchronous(db) == (_PRAGMA_VALUE[mode.lower()],) * 2
    finally:
        db.close()


def test_sqlite_synchronous_defaults_to_full(tmp_path: Path) -> None:
    db = open_database(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        assert load_settings().sqlite_synchronous == "full"
        assert _synchronous(db) == (_PRAGMA_VALUE["full"],) * 2
    finally:
        db.close()


def test_environment_setting_reaches_open_database_and_open_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_SQLITE_SYNCHRONOUS", "normal")
    db = open_database(f"sqlite:///{tmp_path / 'a.db'}")
    try:
        assert _synchronous(db) == (_PRAGMA_VALUE["normal"],) * 2
    finally:
        db.close()
    with sp.open_runtime(workspace=tmp_path / "ws") as rt:
        assert rt.settings.sqlite_synchronous == "normal"
        assert _synchronous(rt.db) == (_PRAGMA_VALUE["normal"],) * 2
        rt.db.close()


def test_open_runtime_argument_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_SQLITE_SYNCHRONOUS", "normal")
    with sp.open_runtime(workspace=tmp_path, sqlite_synchronous="full") as rt:
        assert _synchronous(rt.db) == (_PRAGMA_VALUE["full"],) * 2
        rt.db.close()


@pytest.mark.parametrize("bad", ["off", "extra", "", "2"])
def test_invalid_sqlite_synchronous_is_a_settings_error_before_anything_is_opened(
    tmp_path: Path, bad: str
) -> None:
    path = tmp_path / "sub" / "state.db"
    with pytest.raises(SettingsError) as excinfo:
        open_database(f"sqlite:///{path}", sqlite_synchronous=bad)
    assert excinfo.value.code == "invalid_setting"
    with pytest.raises(SettingsError):
        load_settings(sqlite_synchronous=bad)
    with pytest.raises(SettingsError):
        sp.open_runtime(workspace=tmp_path / "ws", sqlite_synchronous=bad)
    assert not path.parent.exists()
    assert not (tmp_path / "ws").exists()


def test_invalid_environment_value_is_a_settings_error_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_SQLITE_SYNCHRONOUS", "off")
    with pytest.raises(SettingsError, match="SMTHRS_SQLITE_SYNCHRONOUS"):
        open_database(f"sqlite:///{tmp_path / 'state.db'}")
    assert not (tmp_path / "state.db").exists()


def test_one_database_file_cannot_be_opened_with_two_modes_in_one_process(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    db = open_database(url, sqlite_synchronous="normal")
    try:
        with pytest.raises(StoreError) as excinfo:
            open_database(url, sqlite_synchronous="full")
        assert excinfo.value.code == "invalid_argument"
        # The first handle is untouched by the refusal.
        assert _synchronous(db) == (_PRAGMA_VALUE["normal"],) * 2
    finally:
        db.close()


def test_a_pickled_database_keeps_its_mode(tmp_path: Path) -> None:
    db = open_database(f"sqlite:///{tmp_path / 'state.db'}", sqlite_synchronous="normal")
    try:
        copy = pickle.loads(pickle.dumps(db))
        assert copy.sqlite_synchronous == "normal"
        assert _synchronous(copy) == (_PRAGMA_VALUE["normal"],) * 2
    finally:
        db.close()


def test_readme_example_opens_a_runtime_with_normal_sync(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    # --- example of docs/explanation/durability.md ---
    import smthrs_plugin as sp

    with sp.open_runtime(workspace=workspace, sqlite_synchronous="normal") as rt:
        assert rt.settings.sqlite_synchronous == "normal"
        assert rt.db.sqlite_synchronous == "normal"
    # --- end of the example ---
    rt.db.close()
