"""Contract of the durable store, run on SQLite AND PostgreSQL (``db_url`` fixture): journal, transactions,
revisions, tombstones, run DAG, fencing, corrupt rows."""

from __future__ import annotations

import logging
import threading

import pytest
import sqlalchemy as sa
from _store_support import owner, ownership

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.canonical import key
from smthrs_plugin.engine.ownership.arbiter import Activated, HeartbeatFresh, StealRefusedOwnerAlive
from smthrs_plugin.engine.recovery import fence
from smthrs_plugin.errors import FenceLost, RunParentCycleError, StoreError
from smthrs_plugin.records.attempts import AttemptStore
from smthrs_plugin.records.journal import Appended, Duplicate, Journal, JournalEvent
from smthrs_plugin.records.runs import (
    AlreadyRequested,
    Cancelled,
    CancelRequested,
    Created,
    Deleted,
    Existing,
    NotFound,
    ParentExisting,
    ParentRecorded,
    RunStore,
    Settled,
)
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database
from smthrs_plugin.stores.schema import journal_events, run_parents

# -- journal ----------------------------------------------------------------------------------------------


def test_journal_sequences_start_at_zero_per_partition_in_append_order(journal: Journal) -> None:
    for i in range(3):
        journal.append("run-a", "step", {"i": i})
    journal.append("plan:p1", "plan-recorded", {})
    journal.append("run-a", "step", {"i": 3})
    assert [(e.seq, e.payload["i"]) for e in journal.read("run-a")] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [e.seq for e in journal.read("plan:p1")] == [0]
    assert journal.high_water("run-a") == 3
    assert journal.high_water("nothing-here") is None


def test_journal_reads_page_by_sequence(journal: Journal) -> None:
    for i in range(7):
        journal.append("p", "t", {"i": i})
    first = journal.read("p", limit=3)
    rest = journal.read("p", after_seq=first[-1].seq, limit=100)
    assert [e.seq for e in first] == [0, 1, 2]
    assert [e.seq for e in rest] == [3, 4, 5, 6]
    assert journal.read("p", after_seq=6) == []


def test_journal_exact_retry_is_duplicate_and_different_record_conflicts(journal: Journal) -> None:
    first = journal.append("r", "steal-refused", {"lease": 5}, source_id="src", source_seq=0)
    again = journal.append("r", "steal-refused", {"lease": 5}, source_id="src", source_seq=0)
    assert isinstance(first, Appended) and isinstance(again, Duplicate)
    assert again.seq == first.seq == 0
    with pytest.raises(StoreError) as err:
        journal.append("r", "steal-refused", {"lease": 6}, source_id="src", source_seq=0)
    assert err.value.code == "idempotency_conflict"
    # Same address in another partition is a different address.
    assert isinstance(
        journal.append("other", "steal-refused", {"lease": 6}, source_id="src", source_seq=0), Appended
    )
    assert [e.payload for e in journal.read("r")] == [{"lease": 5}]


def test_journal_refuses_bad_input_before_writing(journal: Journal) -> None:
    bad = [
        (("", "t", {}), {}),
        (("p", "", {}), {}),
        (("p", "t", {"x": float("nan")}), {}),
        (("p", "t", {}), {"source_id": "s"}),
        (("p", "t", {}), {"source_id": "s", "source_seq": -1}),
    ]
    for args, kw in bad:
        with pytest.raises(StoreError) as err:
            journal.append(*args, **kw)  # type: ignore[arg-type]
        assert err.value.code == "invalid_argument"
    with pytest.raises(StoreError):
        journal.read("p", limit=0)
    assert journal.high_water("p") is None


def test_concurrent_appends_to_one_partition_get_distinct_contiguous_sequences(journal: Journal) -> None:
    # Four threads race on max(seq)+1: serialized writes (SQLite lock, PostgreSQL 40001 retry) keep it exact.
    def work(t: int) -> None:
        for i in range(15):
            journal.append("hot", "x", {"t": t, "i": i})

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    events = journal.read("hot", limit=1000)
    assert [e.seq for e in events] == list(range(60))
    assert sorted((e.payload["t"], e.payload["i"]) for e in events) == [
        (t, i) for t in range(4) for i in range(15)
    ]


# -- transactions and post-commit notification ---------------------------------------------------------------


def test_subscribers_are_notified_only_after_the_outermost_commit(db: Database, journal: Journal) -> None:
    seen: list[JournalEvent] = []
    inside: list[int] = []
    with journal.subscribe(seen.append):

        def body(conn: sa.Connection) -> None:
            journal.append("r", "a", {})
            journal.append_in(conn, "r", "b", {})
            inside.append(len(seen))

        db.write(body)
    assert inside == [0]
    assert [(e.type, e.seq) for e in seen] == [("a", 0), ("b", 1)]


def test_rolled_back_transaction_writes_nothing_and_notifies_nobody(db: Database, journal: Journal) -> None:
    seen: list[JournalEvent] = []

    class Boom(Exception):
        pass

    def body(conn: sa.Connection) -> None:
        journal.append("r", "a", {})
        raise Boom

    with journal.subscribe(seen.append), pytest.raises(Boom):
        db.write(body)
    assert seen == [] and journal.read("r") == []


def test_a_failed_nested_write_rolls_back_only_its_savepoint(db: Database, journal: Journal) -> None:
    seen: list[str] = []

    def inner(conn: sa.Connection) -> None:
        journal.append("r", "inner", {})
        raise ValueError("inner fails")

    def outer(conn: sa.Connection) -> None:
        journal.append("r", "before", {})
        with pytest.raises(ValueError):
            db.write(inner)
        journal.append("r", "after", {})

    with journal.subscribe(lambda e: seen.append(e.type)):
        db.write(outer)
    assert [e.type for e in journal.read("r")] == ["before", "after"]
    assert seen == ["before", "after"]


def test_on_commit_outside_a_write_is_refused(db: Database) -> None:
    with pytest.raises(StoreError) as err:
        db.on_commit(lambda: None)
    assert err.value.code == "invalid_argument"


def test_subscriber_partition_filter_and_close(journal: Journal) -> None:
    got: list[str] = []
    sub = journal.subscribe(lambda e: got.append(e.partition), partition="one")
    journal.append("one", "t", {})
    journal.append("two", "t", {})
    sub.close()
    journal.append("one", "t", {})
    assert got == ["one"]


# -- revisions and tombstones ---------------------------------------------------------------------------


def test_every_run_mutation_bumps_the_global_revision_monotonically(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    revisions = [db.revision()]

    def step(expect_row_revision: bool = True) -> None:
        rev = db.revision()
        assert rev > revisions[-1]
        revisions.append(rev)
        rec = runs.get("r1")
        if expect_row_revision:
            assert rec is not None and rec.revision == rev

    runs.create("r1", "flow")
    step()
    a.claim("r1")
    step()
    a.heartbeat("r1")
    step()
    runs.request_cancel("r1")
    step()
    runs.acknowledge_cancel("r1", a.owner)
    step()
    runs.suspend("r1", a.owner, "timer", wake_at_ms=clock.now_ms() + 1000, token="wake-me")
    step()
    a.claim("r1")
    step()
    runs.record_run_parent("r1", "root")
    step()
    runs.finish("r1", a.owner, "completed")
    step()
    runs.delete("r1")
    step(expect_row_revision=False)
    stone = runs.tombstone("r1")
    assert stone is not None and stone.revision == revisions[-1]


def test_tombstones_survive_and_a_recreated_run_is_newer(runs: RunStore) -> None:
    runs.create("gone", "flow")
    assert isinstance(runs.delete("gone", force=True), Deleted)
    assert runs.get("gone") is None
    first = runs.tombstone("gone")
    assert first is not None
    recreated = runs.create("gone", "flow")
    assert isinstance(recreated, Created) and recreated.record.revision > first.revision
    assert runs.tombstone("gone") == first  # kept forever, even while the id lives again
    assert isinstance(runs.delete("gone", force=True), Deleted)
    second = runs.tombstone("gone")
    assert second is not None and second.revision > recreated.record.revision
    assert isinstance(runs.delete("never-existed"), NotFound)


def test_create_is_first_writer_wins(runs: RunStore) -> None:
    assert isinstance(runs.create("r", "flow-a"), Created)
    again = runs.create("r", "flow-b")
    assert isinstance(again, Existing) and again.record.flow == "flow-a"


def test_deleting_a_live_run_needs_force(runs: RunStore) -> None:
    runs.create("live", "flow")
    with pytest.raises(StoreError) as err:
        runs.delete("live")
    assert err.value.code == "invalid_argument"
    assert runs.get("live") is not None and runs.tombstone("live") is None


# -- run DAG -----------------------------------------------------------------------------------------------


def test_parent_edges_are_first_writer_wins_and_listed_oldest_first(runs: RunStore) -> None:
    a = runs.record_run_parent("child", "p1")
    b = runs.record_run_parent("child", "p2")
    again = runs.record_run_parent("child", "p1")
    assert isinstance(a, ParentRecorded) and isinstance(b, ParentRecorded)
    assert isinstance(again, ParentExisting) and again.seq == a.seq
    assert [e.parent_id for e in runs.run_parents("child")] == ["p1", "p2"]
    assert [e.child_id for e in runs.run_children("p1")] == ["child"]


def test_parent_cycle_is_refused_with_nothing_left_behind(
    db: Database, runs: RunStore, journal: Journal
) -> None:
    runs.record_run_parent("c", "b")
    runs.record_run_parent("b", "a")
    rev = db.revision()
    with pytest.raises(RunParentCycleError) as err:
        runs.record_run_parent("a", "c")
    assert err.value.code == "run_parent_cycle"
    with pytest.raises(RunParentCycleError):
        runs.record_run_parent("x", "x")
    with pytest.raises(RunParentCycleError):
        runs.create("a2", "flow", parent_run_id="a2")
    edges = db.read(lambda c: c.execute(sa.select(run_parents.c.child_id, run_parents.c.parent_id)).all())
    assert sorted(map(tuple, edges)) == [("b", "a"), ("c", "b")]
    assert db.revision() == rev
    assert journal.read("a") == []


def test_deleting_a_run_prunes_its_parent_edges(db: Database, runs: RunStore) -> None:
    runs.create("p", "flow")
    runs.create("c", "flow", parent_run_id="p")
    runs.record_run_parent("grandchild", "c")
    runs.delete("c", force=True)
    assert runs.run_parents("c") == [] and runs.run_children("c") == []
    assert runs.run_children("p") == []


# -- ownership and fencing -----------------------------------------------------------------------------------


def test_fenced_writes_are_refused_after_a_steal(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    attempts = AttemptStore(db, clock=clock)
    runs.create("r", "flow")
    assert isinstance(a.claim("r"), Activated)
    k = key({"node": 1})
    attempts.begin("r", a.owner, k)
    assert isinstance(b.claim("r"), HeartbeatFresh)
    # A lease is fresh while heartbeat_at >= now - stale_after (30 s, no skew added): exactly 30 s of age is fresh.
    clock.advance(settings.stale_after_s)
    assert isinstance(b.claim("r"), HeartbeatFresh)
    clock.advance(0.001)
    stolen = b.claim("r")
    assert (
        isinstance(stolen, Activated) and stolen.evidence == "lease-expired" and stolen.stolen_from == a.owner
    )
    before = runs.get("r")
    writes = [
        lambda: a.heartbeat("r"),
        lambda: attempts.begin("r", a.owner, k),
        lambda: attempts.complete("r", a.owner, k, 1, result={}),
        lambda: runs.finish("r", a.owner, "completed"),
        lambda: runs.suspend("r", a.owner, "event"),
        lambda: runs.acknowledge_cancel("r", a.owner),
        lambda: a.release("r"),
    ]
    for write in writes:
        with pytest.raises(FenceLost) as err:
            write()
        assert err.value.code == "fence_lost"
    assert runs.get("r") == before  # state intact: owned by b, nothing written by a
    assert [x.state for x in attempts.list("r")] == ["started"]
    types = [e.type for e in journal.read("r")]
    # Two fresh-lease refusals of b against a, journaled once; then the steal.
    refusals = [e.payload for e in journal.read("r") if e.type == "steal-refused-owner-alive"]
    assert [(r["evidence"], r["owner"]) for r in refusals] == [("lease-fresh", a.owner.to_json())]
    assert types.count("stolen-and-activated") == 1


def test_refusal_is_journaled_once_per_owner_lease_and_evidence(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    from smthrs_plugin.engine.ownership.liveness import Alive

    class Vouching:
        """A deployment's ``isAlive`` that vouches for every owner (consulted only once the lease expired)."""

        def check(self, owner: object, ctx: object) -> Alive:
            return Alive("probe")

    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b", liveness=Vouching())
    c = ownership(db, journal, clock, settings, "c", liveness=Vouching())
    runs.create("r", "flow")
    a.claim("r")
    clock.advance(settings.stale_after_s + 1)
    for claimant in (b, c, b, c):
        assert isinstance(claimant.claim("r"), StealRefusedOwnerAlive)
    a.heartbeat("r")  # a new lease...
    clock.advance(settings.stale_after_s + 1)
    assert isinstance(b.claim("r"), StealRefusedOwnerAlive)  # ...refused again: a second record
    refusals = [e for e in journal.read("r") if e.type == "steal-refused-owner-alive"]
    assert len(refusals) == 2 and refusals[0].payload["lease"] != refusals[1].payload["lease"]


def test_two_claimants_of_a_pending_run_activate_exactly_once(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    runs.create("r", "flow")
    decisions = [ownership(db, journal, clock, settings, t).claim("r") for t in ("a", "b")]
    assert [type(d).__name__ for d in decisions] == ["Activated", "HeartbeatFresh"]


def test_release_makes_a_run_claimable_at_once(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    runs.create("r", "flow")
    a.claim("r")
    a.release("r", cause="shutdown")
    rec = runs.get("r")
    assert rec is not None and rec.status == "suspended" and rec.waiting is not None
    assert rec.waiting.reason == "released" and rec.owner is None
    assert isinstance(b.claim("r"), Activated)
    rec = runs.get("r")
    assert rec is not None and rec.waiting is None and rec.owner == b.owner


def test_a_late_cancel_turns_completion_into_cancellation(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow")
    a.claim("r")
    assert isinstance(runs.request_cancel("r"), CancelRequested)
    assert isinstance(runs.request_cancel("r"), AlreadyRequested)
    out = runs.finish("r", a.owner, "completed", result={"v": 1})
    assert isinstance(out, Cancelled) and out.requested_status == "completed"
    rec = runs.get("r")
    assert rec is not None and rec.status == "cancelled" and rec.result is None
    assert rec.cancel_ack is not None and rec.cancel_ack.owner == a.owner
    # Without a request, finish settles as asked.
    runs.create("r2", "flow")
    a.claim("r2")
    assert isinstance(runs.finish("r2", a.owner, "completed", result={"v": 2}), Settled)
    rec2 = runs.get("r2")
    assert rec2 is not None and rec2.result == {"v": 2}


def test_fence_lost_on_terminal_assert_when_cancel_requested(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow")
    a.claim("r")
    runs.request_cancel("r")
    with pytest.raises(FenceLost) as err:
        db.write(lambda c: a.assert_owner(c, "r", terminal=True))
    assert err.value.code == "cancel_requested"
    db.write(lambda c: a.assert_owner(c, "r"))  # non-terminal writes still pass


def test_attempts_replay_the_latest_completed_attempt(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    attempts = AttemptStore(db, clock=clock)
    runs.create("r", "flow")
    a.claim("r")
    k = key({"node": "build"})
    first = attempts.begin("r", a.owner, k, node_id="build")
    attempts.fail("r", a.owner, k, first.attempt, error={"exit": 1})
    second = attempts.begin("r", a.owner, k, node_id="build")
    assert (first.attempt, second.attempt) == (1, 2)
    assert attempts.latest_completed("r", k) is None
    attempts.complete("r", a.owner, k, second.attempt, result={"out": "ok"})
    latest = attempts.latest_completed("r", k)
    assert latest is not None and latest.attempt == 2 and latest.result == {"out": "ok"}
    with pytest.raises(StoreError) as err:
        attempts.complete("r", a.owner, k, second.attempt, result={})
    assert err.value.code == "invalid_argument"
    with pytest.raises(StoreError):
        attempts.begin("r", a.owner, "not-a-key")


def test_fence_releases_running_runs_and_clears_claims(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    for r in ("r1", "r2", "pending"):
        runs.create(r, "flow")
    a.claim("r1")
    a.claim("r2")
    db.write(lambda c: b._reserve(c, "pending"))  # a pending claim left behind by a crashed claimant
    fenced = fence(db, clock=clock)
    assert fenced.released == ("r1", "r2") and fenced.claims_cleared == 1
    with pytest.raises(FenceLost):
        a.heartbeat("r1")
    c = ownership(db, journal, clock, settings, "c")
    assert all(isinstance(c.claim(r), Activated) for r in ("r1", "r2", "pending"))
    assert [e.payload["cause"] for e in journal.read("r1") if e.type == "interrupt-released"] == [
        "recovery-fence"
    ]


# -- corrupt rows ----------------------------------------------------------------------------------------------


def test_undecodable_row_is_skipped_by_list_with_one_warning_and_fails_a_point_read(
    db: Database, runs: RunStore, caplog: pytest.LogCaptureFixture
) -> None:
    for r in ("r1", "r2", "r3"):
        runs.create(r, "flow")
    db.write(lambda c: c.execute(sa.text("UPDATE runs SET result_json = '{not json' WHERE run_id = 'r2'")))
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.records.runs"):
        listed = runs.list()
    assert [r.run_id for r in listed] == ["r1", "r3"]
    warnings = [rec for rec in caplog.records if rec.name == "smthrs_plugin.records.runs"]
    assert len(warnings) == 1 and "'r2'" in warnings[0].getMessage()
    with pytest.raises(StoreError) as err:
        runs.get("r2")
    assert err.value.code == "decode_failed" and "r2" in err.value.message
    db.write(lambda c: c.execute(sa.text("UPDATE runs SET status = 'exploded' WHERE run_id = 'r3'")))
    assert [r.run_id for r in runs.list()] == ["r1"]


def test_undecodable_journal_record_fails_the_read(db: Database, journal: Journal) -> None:
    journal.append("p", "t", {})
    db.write(lambda c: c.execute(sa.update(journal_events).values(payload_json="{oops")))
    with pytest.raises(StoreError) as err:
        journal.read("p")
    assert err.value.code == "decode_failed"


def test_owner_ids_pin_the_incarnation() -> None:
    assert owner("a") != owner("b") and owner("a") == owner("a")


@pytest.mark.postgres
def test_a_serialization_failure_reruns_the_whole_transaction(postgres_url: str) -> None:
    # Two transactions read the same partition head, then both append at it: PostgreSQL aborts one with 40001
    # and Database.write runs that callback again from the start, on a fresh snapshot.
    from smthrs_plugin.stores.database import open_database

    db = open_database(postgres_url)
    journal = Journal(db)
    barrier = threading.Barrier(2, timeout=120)
    calls: list[str] = []
    results: dict[str, int] = {}

    def body(conn: sa.Connection, name: str) -> int:
        calls.append(name)
        head = journal.high_water("p")
        if calls.count(name) == 1:
            barrier.wait()  # both have read the same head before either writes
        out = journal.append_in(conn, "p", "t", {"by": name})
        assert isinstance(out, Appended)
        return (head if head is not None else -1) + 1 - out.seq

    def run(name: str) -> None:
        results[name] = db.write(lambda c: body(c, name))

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == ["a", "a", "b"] or sorted(calls) == ["a", "b", "b"]
    assert results == {"a": 0, "b": 0}  # each committed attempt appended right after the head it read
    assert [e.seq for e in journal.read("p")] == [0, 1]
    db.close()
