"""The docs/explanation/durability.md store example, run verbatim (in a temporary working directory)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner


def test_readme_store_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    # --- example (keep identical to docs/explanation/durability.md, "Durable store") ---
    from smthrs_plugin.engine.ownership import Activated, Ownership
    from smthrs_plugin.records import Journal, RunStore
    from smthrs_plugin.stores import open_database

    db = open_database("sqlite:///.smthrs/state.db")  # creates + migrates; or postgresql+psycopg://...
    runs, journal = RunStore(db), Journal(db)
    runs.create("build-42", "ci/build")
    own = Ownership(db)  # this process incarnation: OwnerId(host_id, pid, nonce)
    assert isinstance(own.claim("build-42"), Activated)

    def progress(conn):  # ONE transaction: a fenced state change and its journal record
        own.heartbeat("build-42")
        journal.append("build-42", "progress", {"pct": 50})

    with journal.subscribe(lambda e: print("committed", e.partition, e.seq, e.type)):
        db.write(progress)  # subscribers hear of it only after the commit
    print(
        runs.finish("build-42", own.owner, "completed", result={"ok": True})
    )  # Settled(...) | Cancelled(...)
    print([e.type for e in journal.read("build-42")])
    # --- end of the example ---
    out = capsys.readouterr().out
    assert "committed build-42 2 progress" in out
    assert "Settled(run_id='build-42', status='completed'" in out
    assert "['run-created', 'run-activated', 'progress', 'run-settled']" in out
    from smthrs_plugin.cli import app

    backed = CliRunner().invoke(app, ["recover", "backup", "bk", "--db", "sqlite:///.smthrs/state.db"])
    assert backed.exit_code == 0 and (tmp_path / "bk" / "manifest.json").exists()
    db.close()
