"""Real processes and real signals against the store (SQLite and PostgreSQL): claim races, a SIGSTOPped zombie
owner, a SIGKILLed owner reclaimed by a same-host probe, concurrent first opens, and a crash inside a write
transaction. Process bodies are in ``_store_proc.py``; every wait has a deadline and asserts states, not times."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from smthrs_plugin._clock import ManualClock, SystemClock
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.engine.ownership.liveness import SameHostPidProbe
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.settings import load_settings
from smthrs_plugin.stores.database import Database, open_database
from smthrs_plugin.stores.migrate import VERSION_TABLE, script_heads
from smthrs_plugin.stores.schema import attempts

pytestmark = pytest.mark.slow

HELPER = str(Path(__file__).with_name("_store_proc.py"))
DEADLINE_S = 120.0  # far above any step here, however busy the machine; a failure bound, never a measurement
FAST = {"SMTHRS_STALE_AFTER_S": "1", "SMTHRS_SKEW_ALLOWANCE_S": "0", "SMTHRS_HEARTBEAT_INTERVAL_S": "0.1"}


class Proc:
    """A helper process whose JSON stdout lines are read one at a time."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen(
            [sys.executable, HELPER, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[dict[str, Any]] = []

    def next(self, timeout: float = 60) -> dict[str, Any]:
        import selectors

        sel = selectors.DefaultSelector()
        assert self.p.stdout is not None
        sel.register(self.p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"helper said nothing for {timeout}s")
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(
                f"helper exited: {self.p.wait()} {self.p.stderr.read() if self.p.stderr else ''}"
            )
        msg = json.loads(line)
        self.lines.append(msg)
        return msg

    def until(self, event: str, timeout: float = 60) -> dict[str, Any]:
        while True:
            msg = self.next(timeout)
            if msg["event"] == event:
                return msg

    def finish(self, timeout: float = 60) -> list[dict[str, Any]]:
        out, err = self.p.communicate(timeout=timeout)
        self.lines += [json.loads(x) for x in out.splitlines() if x.strip()]
        assert self.p.returncode == 0, err
        return self.lines

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        if p.p.poll() is None:
            os.kill(p.p.pid, signal.SIGCONT)
        p.kill()


def test_two_processes_opening_a_new_database_both_succeed(
    db_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    go = tmp_path / "go"
    procs += [Proc("migrate", db_url, str(go)) for _ in range(2)]
    for p in procs:
        p.until("ready")  # both at the start line, so the opens really race
    go.touch()
    ids = [p.until("opened")["source_id"] for p in procs]
    for p in procs:
        p.finish()
    assert ids[0] == ids[1]
    db = open_database(db_url)
    assert sorted(
        db.read(lambda c: c.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all())
    ) == sorted(script_heads())
    assert db.source_id == ids[0]
    db.close()


def test_two_processes_racing_to_claim_a_run_activate_it_exactly_once(
    db: Database, tmp_path: Path, procs: list[Proc]
) -> None:
    n = 20
    runs = RunStore(db)
    for i in range(n):
        runs.create(f"race-{i}", "flow")
    go = tmp_path / "go"
    procs += [Proc("claim", db.url, str(go), str(n)) for _ in range(2)]
    for p in procs:
        p.until("ready")
    go.touch()
    decisions = [m for p in procs for m in p.finish() if m["event"] == "decision"]
    assert len(decisions) == 2 * n
    for i in range(n):
        kinds = sorted(m["kind"] for m in decisions if m["run_id"] == f"race-{i}")
        assert kinds.count("activated") == 1, (i, kinds)
        rec = runs.get(f"race-{i}")
        winner = next(
            m["nonce"] for m in decisions if m["run_id"] == f"race-{i}" and m["kind"] == "activated"
        )
        assert (
            rec is not None
            and rec.status == "running"
            and rec.owner is not None
            and rec.owner.nonce == winner
        )


def _quiescent(db: Database) -> bool:
    """No other session is inside a transaction (a stopped process must not hold the write lock)."""
    if db.dialect == "sqlite":
        path = db.sqlite_path
        conn = sqlite3.connect(str(path), timeout=0.2, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            conn.close()
    busy = db.read(
        lambda c: c.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state IS NOT NULL AND state <> 'idle'"
            )
        ).scalar()
    )
    return busy == 0


def _stop_quiescent(db: Database, proc: Proc) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        os.kill(proc.p.pid, signal.SIGSTOP)
        if _quiescent(db):
            return
        os.kill(proc.p.pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError("could not stop the owner outside a transaction")


def test_a_sigstopped_owner_is_stolen_from_and_every_write_after_sigcont_is_refused(
    db: Database, procs: list[Proc]
) -> None:
    RunStore(db).create("zombie", "flow")
    owner_proc = Proc("own", db.url, "zombie", "write", env=FAST)
    procs.append(owner_proc)
    activated = owner_proc.until("activated")
    owner_proc.until("wrote")
    owner_proc.until("wrote")
    _stop_quiescent(db, owner_proc)
    thief = Ownership(db, settings=load_settings(stale_after_s=1, skew_allowance_s=0))
    deadline = time.monotonic() + DEADLINE_S
    while True:
        decision = thief.claim("zombie")
        if isinstance(decision, Activated) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert isinstance(decision, Activated) and decision.evidence == "lease-expired"
    assert decision.stolen_from is not None and decision.stolen_from.nonce == activated["nonce"]

    def count(c: sa.Connection) -> int:
        return int(
            c.execute(
                sa.select(sa.func.count()).where(attempts.c.owner_nonce == activated["nonce"])
            ).scalar_one()
        )

    at_steal = db.read(count)
    os.kill(owner_proc.p.pid, signal.SIGCONT)
    lines = owner_proc.finish()
    after_resume = lines[next(i for i, m in enumerate(lines) if m["event"] == "refused") :]
    assert [m["event"] for m in after_resume] == ["refused", "refused", "refused", "done"]
    assert all(m["code"] == "fence_lost" for m in after_resume[:3])
    assert after_resume[-1]["interrupt"] == "fence_lost"
    assert db.read(count) == at_steal  # nothing the zombie tried after the steal reached the store
    rec = RunStore(db).get("zombie")
    assert rec is not None and rec.status == "running" and rec.owner == thief.owner


def test_a_sigkilled_owner_is_reclaimed_by_a_same_host_pid_probe_at_its_lease_expiry_never_earlier(
    db: Database, procs: list[Proc]
) -> None:
    RunStore(db).create("killed", "flow")
    owner_proc = Proc("own", db.url, "killed", "idle")  # default 30 s stale window
    procs.append(owner_proc)
    activated = owner_proc.until("activated")
    claimant = Ownership(db, liveness=SameHostPidProbe())
    assert type(claimant.claim("killed")).__name__ == "HeartbeatFresh"  # alive and pulsing
    owner_proc.p.send_signal(signal.SIGKILL)
    owner_proc.p.wait()
    # The probe is consulted only once the lease expired — a dead pid under a fresh lease is
    # not stolen early. A manual clock (from now) stands for the 30 s of waiting.
    clock = ManualClock(start_ms=SystemClock().now_ms())
    claimant = Ownership(db, owner=claimant.owner, liveness=SameHostPidProbe(), clock=clock)
    assert type(claimant.claim("killed")).__name__ == "HeartbeatFresh"
    clock.advance(claimant.settings.stale_after_s + 0.001)  # past the stale window from the last beat
    decision = claimant.claim("killed")
    assert isinstance(decision, Activated) and decision.evidence == "same-host-pid-dead"
    assert decision.stolen_from is not None and decision.stolen_from.pid == activated["pid"]
    stolen = [e for e in Journal(db).read("killed") if e.type == "stolen-and-activated"]
    assert [e.payload["evidence"] for e in stolen] == ["same-host-pid-dead"]


def test_a_crash_inside_a_write_leaves_neither_the_state_change_nor_its_journal_record(
    db: Database, tmp_path: Path, procs: list[Proc]
) -> None:
    runs = RunStore(db)
    runs.create("crashy", "flow")
    journal = Journal(db)
    before = (runs.get("crashy"), journal.read("crashy"), db.revision())
    marker = tmp_path / "inside"
    proc = Proc("crash-in-tx", db.url, "crashy", str(marker))
    procs.append(proc)
    proc.until("starting")
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline and proc.p.poll() is None
        time.sleep(0.01)
    proc.p.send_signal(signal.SIGKILL)
    proc.p.wait()
    assert (runs.get("crashy"), journal.read("crashy"), db.revision()) == before
    # The dead writer's lock or transaction is gone: the same change now commits normally.
    assert type(runs.request_cancel("crashy")).__name__ == "CancelRequested"
    assert [e.type for e in journal.read("crashy")] == ["run-created", "run-cancel-requested"]
