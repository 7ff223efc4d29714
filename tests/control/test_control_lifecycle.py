"""The control plane's run lifecycle entries, on SQLite and PostgreSQL (the reference's versioned lifecycle and
approval producer contract): ``control.run.accepted`` then ``pending`` (no launcher
took the launch), ``running`` (the executor activated it), ``completed``/``failed``/``cancelled`` (settlement),
each carrying ``{factVersion: 1, baseline, run}`` with ``run`` the run's summary (camelCase members, control
statuses: ``accepted`` for an admitted run not yet driven) as that transaction left it; a transition
that rolls back leaves none; ``smthrs watch`` delivers them as they were written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _control_support import RecordingLauncher, release_plan

from smthrs_plugin.cli.control_support import PlanLauncher
from smthrs_plugin.control.facade import Control
from smthrs_plugin.control.receipts import Accepted
from smthrs_plugin.engine.facts import (
    append_control_lifecycle_in,
    control_running_in,
    control_settled_in,
)
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.errors import StoreError
from smthrs_plugin.observe.watch import watch
from smthrs_plugin.plan import compile_plan, node
from smthrs_plugin.records.control import ACCEPTED_SOURCE
from smthrs_plugin.records.journal import Journal, JournalEvent
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.runtime import Runtime, open_runtime
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database

ENV = {"capabilities": ["deploy:prod"]}


def lifecycle(db: Database, run_id: str) -> list[JournalEvent]:
    """The run's ``control.run.*`` entries, in journal order."""
    return [e for e in Journal(db).read(run_id, limit=1000) if e.type.startswith("control.run.")]


def check_fact(event: JournalEvent, run_id: str, status: str, baseline: str = "created") -> None:
    p = event.payload
    assert p["factVersion"] == 1 and p["baseline"] == baseline, event
    assert p["run"]["runId"] == run_id and p["run"]["status"] == status, event


def admitted(control: Control, launcher: Any = None, key: str = "k") -> str:
    card = control.plan(release_plan(), envelope=ENV)
    receipt = control.run(card, idempotency_key=key, launcher=launcher)
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    return receipt.run_id


def test_a_run_no_launcher_takes_is_journaled_accepted_then_pending_with_the_created_baseline(
    control: Control, db: Database
) -> None:
    run_id = admitted(control)
    accepted, pending = lifecycle(db, run_id)
    assert (accepted.type, pending.type) == ("control.run.accepted", "control.run.pending")
    check_fact(accepted, run_id, "accepted")
    check_fact(pending, run_id, "accepted")
    assert (accepted.source_id, accepted.source_seq) == (ACCEPTED_SOURCE, 0)
    assert accepted.payload["receiptId"] == pending.payload["receiptId"]


def test_a_launched_run_is_not_journaled_pending(
    control: Control, db: Database, launcher: RecordingLauncher
) -> None:
    run_id = admitted(control, launcher)
    assert [e.type for e in lifecycle(db, run_id)] == ["control.run.accepted"]
    check_fact(lifecycle(db, run_id)[0], run_id, "accepted")


def test_a_refused_launch_is_journaled_failed_with_the_failed_run(
    control: Control, db: Database, launcher: RecordingLauncher
) -> None:
    launcher.refuse = RuntimeError("no capacity")
    run_id = admitted(control, launcher)
    events = lifecycle(db, run_id)
    assert [e.type for e in events] == ["control.run.accepted", "control.run.failed"]
    check_fact(events[1], run_id, "failed")
    assert events[1].payload["reason"] == "launch-refused"
    assert events[1].payload["run"]["finishedAt"] is not None


def test_cancelling_a_pending_run_is_journaled_cancel_requested_then_cancelled(
    control: Control, db: Database
) -> None:
    run_id = admitted(control)
    assert isinstance(control.cancel(run_id, reason="wrong tag"), Accepted)
    events = lifecycle(db, run_id)
    assert [e.type for e in events] == [
        "control.run.accepted",
        "control.run.pending",
        "control.run.cancel-requested",
        "control.run.cancelled",
    ]
    requested, cancelled = events[2], events[3]
    check_fact(requested, run_id, "accepted")
    assert requested.payload["run"]["cancelRequestedAt"] is not None
    assert requested.payload["reason"] == "wrong tag"
    check_fact(cancelled, run_id, "cancelled")


def test_a_resume_is_journaled_with_the_run_it_found(control: Control, db: Database) -> None:
    run_id = admitted(control)
    assert isinstance(control.resume(run_id, idempotency_key="r1"), Accepted)
    resume = lifecycle(db, run_id)[-1]
    assert resume.type == "control.run.resume"
    check_fact(resume, run_id, "accepted")


def test_activation_and_settlement_entries_carry_the_row_their_transaction_left(
    control: Control, db: Database, settings: Settings
) -> None:
    run_id = admitted(control)
    own = Ownership(db, settings=settings)
    assert isinstance(own.claim(run_id), Activated)
    journal = Journal(db)
    assert db.write(lambda c: control_running_in(c, journal, run_id)) is True
    runs = RunStore(db)

    def settle(conn: sa.Connection) -> bool:
        runs.finish(run_id, own.owner, "completed", result={"ok": True})
        return control_settled_in(conn, journal, run_id)

    assert db.write(settle) is True
    events = lifecycle(db, run_id)
    assert [e.type for e in events][-2:] == ["control.run.running", "control.run.completed"]
    check_fact(events[-2], run_id, "running")
    check_fact(events[-1], run_id, "completed")
    assert events[-1].payload["run"]["finishedAt"] is not None


def test_a_run_the_control_plane_did_not_admit_gets_no_control_entries(db: Database) -> None:
    runs = RunStore(db)
    runs.create("flow-run-1", "flows.etl")
    journal = Journal(db)
    assert db.write(lambda c: control_running_in(c, journal, "flow-run-1")) is False
    assert lifecycle(db, "flow-run-1") == []


def test_a_settlement_entry_for_an_unsettled_run_is_refused_and_writes_nothing(
    control: Control, db: Database
) -> None:
    run_id = admitted(control)
    before = lifecycle(db, run_id)
    journal = Journal(db)
    with pytest.raises(StoreError) as caught:
        db.write(lambda c: control_settled_in(c, journal, run_id))
    assert caught.value.code == "invalid_argument"
    assert lifecycle(db, run_id) == before


def test_a_transition_that_rolls_back_leaves_no_lifecycle_entry(control: Control, db: Database) -> None:
    run_id = admitted(control)
    before = lifecycle(db, run_id)
    journal = Journal(db)

    class Boom(Exception):
        pass

    def transition(conn: sa.Connection) -> None:
        conn.execute(sa.text("UPDATE runs SET status = 'failed' WHERE run_id = :r"), {"r": run_id})
        append_control_lifecycle_in(conn, journal, run_id, "control.run.failed", {"reason": "test"})
        raise Boom

    with pytest.raises(Boom):
        db.write(transition)
    assert lifecycle(db, run_id) == before
    assert control.show(run_id).status == "pending"


def refuse_journal_entries_of_type(db: Database, kind: str) -> None:
    """A real database failure: every later journal INSERT of an entry ``kind`` aborts (a trigger)."""
    if db.dialect == "sqlite":
        ddl = [
            "CREATE TRIGGER refuse_kind BEFORE INSERT ON journal_events "
            f"WHEN NEW.type = '{kind}' BEGIN SELECT RAISE(ABORT, 'refused'); END"
        ]
    else:
        ddl = [
            "CREATE FUNCTION refuse_kind() RETURNS trigger AS $$ BEGIN "
            f"IF NEW.type = '{kind}' THEN RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER refuse_kind BEFORE INSERT ON journal_events FOR EACH ROW EXECUTE FUNCTION refuse_kind()",
        ]
    db.write(lambda c: [c.execute(sa.text(stmt)) for stmt in ddl])


def test_a_failed_admission_leaves_no_run_and_no_lifecycle_entry(control: Control, db: Database) -> None:
    card = control.plan(release_plan(), envelope=ENV)
    # The admission's last write fails: the run row, its receipt and ``control.run.accepted`` before it go too.
    refuse_journal_entries_of_type(db, "control.run.pending")
    with pytest.raises(StoreError):
        control.run(card, idempotency_key="k")
    types = db.read(lambda c: list(c.execute(sa.text("SELECT type FROM journal_events")).scalars()))
    assert [t for t in types if t.startswith("control.run.") or t.startswith("run-")] == []
    assert db.read(lambda c: c.execute(sa.text("SELECT count(*) FROM runs")).scalar_one()) == 0
    assert db.read(lambda c: c.execute(sa.text("SELECT count(*) FROM control_receipts")).scalar_one()) == 0


def test_a_run_admitted_by_an_older_producer_gets_the_legacy_baseline(control: Control, db: Database) -> None:
    run_id = admitted(control)
    # An older producer journaled its acceptance without the v1 fact, hence at no address.
    db.write(
        lambda c: c.execute(
            sa.text("UPDATE journal_events SET source_id = NULL, source_seq = NULL WHERE partition = :r"),
            {"r": run_id},
        )
    )
    assert isinstance(control.cancel(run_id), Accepted)
    for event in lifecycle(db, run_id)[-2:]:
        assert event.payload["baseline"] == "legacy", event


def test_watch_delivers_the_lifecycle_entries_as_written(control: Control, db: Database) -> None:
    run_id = admitted(control)
    control.cancel(run_id)
    watched = [e for e in watch(db, run_id, follow=False) if e.kind.startswith("control.run.")]
    written = lifecycle(db, run_id)
    assert [(e.kind, e.sequence, e.payload) for e in watched] == [(e.type, e.seq, e.payload) for e in written]
    assert watched[-1].to_json()["payload"]["run"]["status"] == "cancelled"


# -- a real plan run through the runtime's driver ------------------------------------------------------------------


@pytest.fixture
def rt(tmp_path: Path, db_url: str) -> Iterator[Runtime]:
    ws = tmp_path / "ws"
    ws.mkdir()
    with open_runtime(
        workspace=ws, db=db_url, artifacts=str(tmp_path / "artifacts"), host_id="ctl-host"
    ) as r:
        yield r


def test_a_driven_plan_run_is_journaled_accepted_running_completed_in_order(rt: Runtime) -> None:
    control = rt.control()
    card = control.plan(compile_plan("hello", "ci/hello", [node("hi", body={"run": "true"})]), envelope=ENV)
    receipt = control.run(card, idempotency_key="k", launcher=PlanLauncher(rt, {}))
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    events = lifecycle(rt.db, receipt.run_id)
    assert [e.type for e in events] == [
        "control.run.accepted",
        "control.run.running",
        "control.run.completed",
    ]
    for event, status in zip(events, ("accepted", "running", "completed"), strict=True):
        check_fact(event, receipt.run_id, status)
