"""Backup, verify, restore and fence (library and ``smthrs recover`` CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _store_support import owner, ownership
from typer.testing import CliRunner

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.canonical import key
from smthrs_plugin.cli import app
from smthrs_plugin.engine.ownership.arbiter import Activated
from smthrs_plugin.engine.recovery import MANIFEST_NAME, backup, restore, verify
from smthrs_plugin.errors import FenceLost, StoreError
from smthrs_plugin.records.attempts import AttemptStore
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import open_database


def test_backup_mid_run_then_restore_fences_the_pre_backup_owner(
    sqlite_url: str, tmp_path: Path, clock: ManualClock, settings: Settings
) -> None:
    db = open_database(sqlite_url)
    journal = Journal(db, clock=clock)
    runs = RunStore(db, journal=journal, clock=clock)
    attempts = AttemptStore(db, clock=clock)
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r1", "flow")
    runs.create("r2", "flow")
    a.claim("r1")
    k = key({"node": "n"})
    first = attempts.begin("r1", a.owner, k)
    attempts.complete("r1", a.owner, k, first.attempt, result={"v": 1})
    written = backup(db, tmp_path / "bk", clock=clock)
    assert written.manifest.source_id == db.source_id and written.manifest.revision == db.revision()
    # The run goes on after the backup...
    attempts.begin("r1", a.owner, k)
    a.heartbeat("r1")
    # ...then disaster: restore the backup over the live database.
    restored = restore(tmp_path / "bk", sqlite_url, force=True, clock=clock)
    assert restored.fenced is not None and restored.fenced.released == ("r1",)
    with pytest.raises(FenceLost):
        attempts.begin("r1", a.owner, k)
    with pytest.raises(FenceLost):
        a.heartbeat("r1")
    rec = runs.get("r1")
    assert rec is not None and rec.status == "suspended" and rec.waiting is not None
    assert rec.waiting.reason == "released" and rec.owner is None
    assert [x.attempt for x in attempts.list("r1")] == [1]  # the post-backup attempt is gone
    b = ownership(db, journal, clock, settings, "b")
    assert isinstance(b.claim("r1"), Activated)  # claimable at once: no stale-window wait
    replay = attempts.latest_completed("r1", k)
    assert replay is not None and replay.result == {"v": 1}
    assert db.source_id == written.manifest.source_id
    db.close()


def test_verify_refuses_an_unfinished_or_corrupt_backup(sqlite_url: str, tmp_path: Path) -> None:
    db = open_database(sqlite_url)
    RunStore(db).create("r", "flow")
    backup(db, tmp_path / "bk")
    assert verify(tmp_path / "bk").manifest.sha256
    with pytest.raises(StoreError) as again:
        backup(db, tmp_path / "bk")
    assert again.value.code == "backup_failed"
    (tmp_path / "bk" / "state.db").write_bytes(b"garbage")
    with pytest.raises(StoreError) as corrupt:
        verify(tmp_path / "bk")
    assert corrupt.value.code == "restore_failed" and "manifest" in corrupt.value.message
    (tmp_path / "bk" / MANIFEST_NAME).unlink()
    with pytest.raises(StoreError) as unfinished:
        verify(tmp_path / "bk")
    assert "never finished" in unfinished.value.message
    db.close()


def test_restore_needs_force_to_overwrite(sqlite_url: str, tmp_path: Path) -> None:
    db = open_database(sqlite_url)
    backup(db, tmp_path / "bk")
    with pytest.raises(StoreError) as err:
        restore(tmp_path / "bk", sqlite_url)
    assert err.value.code == "restore_failed" and "--force" in err.value.message
    fresh = f"sqlite:///{tmp_path}/elsewhere/state.db"
    assert restore(tmp_path / "bk", fresh).manifest.source_id == db.source_id
    db.close()


@pytest.mark.postgres
def test_postgres_backup_and_restore_are_refused_with_a_pointer_to_pg_tools(
    postgres_url: str, tmp_path: Path
) -> None:
    db = open_database(postgres_url)
    with pytest.raises(StoreError) as err:
        backup(db, tmp_path / "bk")
    assert err.value.code == "backup_failed" and "pg_dump" in err.value.message
    assert not (tmp_path / "bk").exists()
    sqlite_db = open_database(f"sqlite:///{tmp_path}/s.db")
    backup(sqlite_db, tmp_path / "sqlite-bk")
    with pytest.raises(StoreError) as err2:
        restore(tmp_path / "sqlite-bk", postgres_url)
    assert err2.value.code == "restore_failed" and "pg_restore" in err2.value.message
    db.close()
    sqlite_db.close()


def test_cli_recover_backup_restore_fence(sqlite_url: str, tmp_path: Path) -> None:
    # The example of docs/explanation/durability.md: back up, restore over the live store, fence.
    db = open_database(sqlite_url)
    runs = RunStore(db)
    runs.create("r1", "flow")
    from smthrs_plugin.engine.ownership.arbiter import Ownership

    own = Ownership(db, owner=owner("cli"))
    own.claim("r1")
    cli = CliRunner()
    out = cli.invoke(app, ["recover", "backup", str(tmp_path / "bk"), "--db", sqlite_url, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["manifest"]["source_id"] == db.source_id
    refused = cli.invoke(app, ["recover", "restore", str(tmp_path / "bk"), "--db", sqlite_url, "--json"])
    assert refused.exit_code == 2 and json.loads(refused.output)["error"]["code"] == "restore_failed"
    ok = cli.invoke(
        app, ["recover", "restore", str(tmp_path / "bk"), "--db", sqlite_url, "--force", "--json"]
    )
    assert ok.exit_code == 0 and json.loads(ok.output)["released"] == ["r1"]
    with pytest.raises(FenceLost):
        own.heartbeat("r1")
    fenced = cli.invoke(app, ["recover", "fence", "--db", sqlite_url])
    assert fenced.exit_code == 0 and "released 0" in fenced.output
    bad = cli.invoke(app, ["recover", "fence", "--db", "mysql://nope", "--json"])
    assert bad.exit_code == 2 and json.loads(bad.output)["error"]["code"] == "unsupported_url"
    db.close()
