"""Fenced run transitions as single conditional statements, run on SQLite AND PostgreSQL (``db_url`` fixture).

Pins what the one-statement forms (``UPDATE ... WHERE fenced RETURNING``, the revision bump riding with it, the
driver-level execution of hot statements, the reused writer connections) must keep of the multi-statement forms
they replaced: a miss writes nothing and consumes no revision, journaled facts equal a read after the change,
activation journals the row it really changed, driver errors stay typed and retried.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa
from _store_support import ownership

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.engine.ownership.arbiter import Activated, ActivationLost, HeartbeatFresh
from smthrs_plugin.errors import FenceLost, StoreError
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore, bump_run, bump_run_observed, execution_fact
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database, open_database
from smthrs_plugin.stores.schema import runs as runs_table
from smthrs_plugin.stores.statements import DriverStatement


def _steal_from_a(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> tuple[Any, Any]:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    runs.create("r", "flow")
    assert isinstance(a.claim("r"), Activated)
    clock.advance(settings.stale_after_s + 0.001)  # past the stale window: a's lease expired
    assert isinstance(b.claim("r"), Activated)
    return a, b


def test_a_fenced_miss_writes_nothing_and_consumes_no_revision(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a, b = _steal_from_a(db, runs, journal, clock, settings)
    before, row = db.revision(), runs.get("r")
    with pytest.raises(FenceLost) as err:
        a.heartbeat("r")
    assert err.value.code == "fence_lost" and "nonce-b" in err.value.message  # says who holds it now
    with pytest.raises(FenceLost):
        runs.suspend("r", a.owner, "event")

    # Inside a caller's transaction a miss leaves the transaction usable: nothing was written, so the caller
    # may recover in the same transaction and commit, and still no revision was taken.
    def recover(conn: sa.Connection) -> int:
        with pytest.raises(FenceLost):
            bump_run(conn, db, "r", {"updated_at_ms": 1}, owner=a.owner)
        return db.revision()

    assert db.write(recover) == before
    assert db.revision() == before and runs.get("r") == row


def test_journaled_facts_equal_a_read_after_the_change(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    runs.create("r", "flow", lineage_id="line", round_ordinal=2)
    seen: list[tuple[str, dict[str, Any]]] = []

    def check(kind: str) -> None:
        last = journal.read("r")[-1]
        now = db.read(lambda c: execution_fact(c, "r"))
        seen.append((last.type, last.payload["fact"]))
        assert last.payload["fact"] == now, kind

    a.claim("r")
    check("activate")
    runs.request_cancel("r")
    runs.suspend("r", a.owner, "timer", wake_at_ms=clock.now_ms() + 5, token="tok")
    check("suspend")
    a.claim("r")
    check("resume")
    a.release("r")
    check("release")
    b.claim("r")
    check("claim after release")
    clock.advance(settings.stale_after_s + 0.001)  # past the stale window: b's lease expired
    a.claim("r")
    check("steal")
    runs.finish("r", a.owner, "completed")
    check("settle")
    assert [t for t, _ in seen] == [
        "run-activated",
        "run-suspended",
        "run-activated",
        "interrupt-released",
        "run-activated",
        "stolen-and-activated",
        "run-settled",
    ]
    assert all(f["observation"]["cancel_requested_at_ms"] is not None for _, f in seen[1:])


def _set(db: Database, run_id: str, **values: Any) -> None:
    db.write(lambda c: c.execute(sa.update(runs_table).where(runs_table.c.run_id == run_id).values(**values)))


def test_activation_journals_the_row_it_changed_when_it_moved_after_the_reservation(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow")
    a.claim("r")
    runs.suspend("r", a.owner, "event")
    reserved = a._reserve_write("r")
    # Between the two transactions something else rewrote the row (a wake, say) but left the claim in place.
    _set(db, "r", status="pending", waiting_reason=None)
    decision = a._activate_write("r", reserved)
    assert isinstance(decision, Activated)
    activated = journal.read("r")[-1]
    assert activated.type == "run-activated" and activated.payload["from_status"] == "pending"
    assert "waiting_reason" not in activated.payload
    rec = runs.get("r")
    assert (
        rec is not None
        and rec.status == "running"
        and rec.owner == a.owner
        and rec.revision == decision.revision
    )


def test_activation_is_lost_when_the_claim_was_cleared_after_the_reservation(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow")
    reserved = a._reserve_write("r")
    _set(db, "r", claim_token=None, claim_host=None, claim_pid=None, claim_nonce=None, claimed_at_ms=None)
    before = db.revision()
    assert isinstance(a._activate_write("r", reserved), ActivationLost)
    assert db.revision() == before
    rec = runs.get("r")
    assert rec is not None and rec.status == "pending" and rec.owner is None


def test_a_foreign_fresh_claim_blocks_the_reservation_until_it_is_stale(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    runs.create("r", "flow")
    b._reserve_write("r")  # b crashed between its claim and its activation
    lost = a.claim("r")
    assert type(lost).__name__ == "ClaimLost" and lost.claimant == b.owner  # type: ignore[union-attr]
    clock.advance(settings.stale_after_s + 0.001)  # past the stale window: b's claim expired
    assert isinstance(a.claim("r"), Activated)
    assert isinstance(b.claim("r"), HeartbeatFresh)


def test_concurrent_heartbeats_each_commit_one_revision(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    # On PostgreSQL each heartbeat is one autocommitted SERIALIZABLE statement: writers of the hot revision row
    # collide with 40001 and are retried; none may be lost, doubled or fail.
    owners = [ownership(db, journal, clock, settings, f"o{i}") for i in range(4)]
    for i, o in enumerate(owners):
        runs.create(f"r{i}", "flow")
        o.claim(f"r{i}")
    before = db.revision()
    errors: list[BaseException] = []
    revs: list[int] = []
    lock = threading.Lock()

    def beat(i: int) -> None:
        try:
            for _ in range(25):
                r = owners[i].heartbeat(f"r{i}").revision
                with lock:
                    revs.append(r)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=beat, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(revs) == 100
    assert sorted(revs) == list(range(before + 1, before + 101))
    assert db.revision() == before + 100


def test_driver_statement_failures_are_typed_and_leave_the_next_write_clean(db: Database) -> None:
    bad = DriverStatement(sa.text("SELECT no_such_column FROM runs"))
    with pytest.raises(StoreError) as err:
        db.write(lambda c: bad.first(c))
    assert err.value.code == "store_failed"
    # The failed transaction rolled back; a writer connection handed on is idle and works.
    runs = RunStore(db)
    runs.create("r", "flow")
    assert db.write(lambda c: c.execute(sa.select(sa.func.count()).select_from(runs_table)).scalar()) == 1


def test_integrity_errors_of_driver_statements_keep_their_type(db: Database) -> None:
    RunStore(db).create("r", "flow")
    dup = DriverStatement(
        sa.insert(runs_table).values(
            run_id=sa.bindparam("b_id"),
            flow="f",
            status="pending",
            created_at_ms=0,
            updated_at_ms=0,
            revision=0,
        )
    )
    with pytest.raises(StoreError) as err:
        db.write(lambda c: dup.rowcount(c, {"b_id": "r"}))
    assert isinstance(err.value.cause, sa.exc.IntegrityError)


def test_observed_update_and_plain_bump_agree(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow")
    a.claim("r")
    rev, fact = db.write(lambda c: bump_run_observed(c, db, "r", {"updated_at_ms": 7}, owner=a.owner))
    assert rev == db.revision() and fact == db.read(lambda c: execution_fact(c, "r"))
    stranger = OwnerId("host-z", 1, "nonce-z")
    with pytest.raises(FenceLost):
        db.write(lambda c: bump_run_observed(c, db, "r", {"updated_at_ms": 8}, owner=stranger))
    assert db.revision() == rev


@pytest.mark.postgres
def test_statements_sent_alone_run_serializable(postgres_url: str) -> None:
    db = open_database(postgres_url)
    try:
        show = DriverStatement(sa.text("SHOW transaction_isolation"))
        row = db.write_statement(show, {})
        assert row is not None and row[0] == "serializable"
        # ...and the writer goes back to explicit transactions afterwards.
        assert db.write(lambda c: c.execute(sa.text("SHOW transaction_isolation")).scalar()) == "serializable"
        assert db.write(lambda c: c.connection.driver_connection.autocommit) is False  # type: ignore[union-attr]
    finally:
        db.close()


def test_a_closed_database_reopens_its_writers(db_url: str) -> None:
    db = open_database(db_url)
    RunStore(db).create("r", "flow")
    db.close()
    again = open_database(db_url)
    try:
        assert RunStore(db).get("r") is not None  # the first handle reopens lazily
        RunStore(again).create("r2", "flow")
        assert RunStore(db).get("r2") is not None
    finally:
        again.close()
        db.close()


def test_a_cancel_requested_between_claim_and_activation_is_in_the_activation_fact(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow")
    reserved = a._reserve_write("r")
    clock.advance(1)
    runs.request_cancel("r")  # an observed column changed after the claimant last saw the row
    decision = a._activate_write("r", reserved)
    assert isinstance(decision, Activated) and decision.cancel_requested_at_ms == clock.now_ms()
    activated = journal.read("r")[-1]
    assert activated.type == "run-activated"
    assert activated.payload["fact"] == db.read(lambda c: execution_fact(c, "r"))
    assert activated.payload["fact"]["observation"]["cancel_requested_at_ms"] == clock.now_ms()


def test_activation_records_reach_subscribers_only_after_the_outermost_commit(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r1", "flow")
    runs.create("r2", "flow")
    got: list[tuple[str, int, str]] = []
    with journal.subscribe(lambda e: got.append((e.partition, e.seq, e.type))):
        assert isinstance(a.claim("r1"), Activated)
        assert got == [("r1", 1, "run-activated")]

        def inside(conn: sa.Connection) -> None:
            assert isinstance(a.claim("r2"), Activated)
            assert len(got) == 1  # not before the commit

        db.write(inside)
        assert got[-1] == ("r2", 1, "run-activated")
    assert [e.seq for e in journal.read("r1")] == [0, 1] and [e.seq for e in journal.read("r2")] == [0, 1]


def test_a_hint_left_by_a_rolled_back_transition_is_never_trusted(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow")
    a.claim("r")

    def park_then_fail(conn: sa.Connection) -> None:
        runs.suspend("r", a.owner, "timer", wake_at_ms=5)  # remembers the row as suspended...
        raise RuntimeError("boom")  # ...which never commits

    with pytest.raises(RuntimeError):
        db.write(park_then_fail)
    rec = runs.get("r")
    assert rec is not None and rec.status == "running"
    out = runs.suspend("r", a.owner, "event")
    assert out.revision == db.revision()
    parked = [e for e in journal.read("r") if e.type == "run-suspended"]
    assert len(parked) == 1 and parked[0].payload["reason"] == "event"
    assert parked[0].payload["fact"] == db.read(lambda c: execution_fact(c, "r"))


@pytest.mark.postgres
def test_a_kept_writer_whose_server_session_died_is_replaced_before_use(postgres_url: str) -> None:
    import psycopg

    db = open_database(postgres_url)
    try:
        runs = RunStore(db)
        runs.create("r1", "flow")
        # The writer that ran this is kept for the next write; pretend it has been idle past the ping window.
        pid = db.write(lambda c: c.execute(sa.text("SELECT pg_backend_pid()")).scalar())
        db._handle().reuse_within_s = 0.0
        with psycopg.connect(postgres_url.replace("postgresql+psycopg://", "postgresql://")) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        runs.create("r2", "flow")  # pinged, found dead, replaced: not a failed write
        assert runs.get("r2") is not None
        assert db.write(lambda c: c.execute(sa.text("SELECT pg_backend_pid()")).scalar()) != pid
    finally:
        db.close()
