"""Contract of the durable-waits store (SQLite and PostgreSQL): deferreds, clocks, park/wake, the waiting
taxonomy, registration-time listings, corruption handling and lifecycle facts."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa

from smthrs_plugin.canonical import sha256_hex
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.errors import FenceLost, StoreError
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.records.wait_rows import (
    AlreadyCompleted,
    ApprovalWait,
    Completed,
    EventWait,
    Existing,
    NotFound,
    NotWaiting,
    Parked,
    QuarantineWait,
    ReleasedWait,
    Scheduled,
    TimerWait,
    WaitingFilter,
    WaitingRun,
    Woken,
    deferred_token,
)
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database
from smthrs_plugin.stores.wait_tables import clock_deadlines, deferred_completions


def own(db: Database, journal: Journal, fast: Settings, run_id: str, tag: str = "a") -> Ownership:
    o = Ownership(db, owner=OwnerId("waits-host", 4242, f"nonce-{tag}"), journal=journal, settings=fast)
    assert isinstance(o.claim(run_id), Activated)
    return o


# -- deferreds ------------------------------------------------------------------------------------------------


def test_a_deferred_completes_once_and_the_second_writer_learns_the_first_value(
    runs: RunStore, waits: WaitStore
) -> None:
    runs.create("r1", "flow")
    first = waits.complete_deferred("r1", "approval", {"ok": True})
    second = waits.complete_deferred("r1", "approval", {"ok": False})
    assert isinstance(first, Completed) and first.record.value == {"ok": True}
    assert isinstance(second, Existing) and second.record.value == {"ok": True}
    stored = waits.deferred("flow", "r1", "approval")
    assert stored is not None and stored.value == {"ok": True} and stored.consumed_at_ms is None
    assert waits.deferred("flow", "r1", "other") is None


def test_bad_completions_are_refused_before_anything_is_written(
    db: Database, runs: RunStore, waits: WaitStore
) -> None:
    runs.create("r1", "flow")
    with pytest.raises(StoreError) as missing:
        waits.complete_deferred("nope", "approval", 1)
    assert missing.value.code == "not_found"
    with pytest.raises(StoreError) as bad:
        waits.complete_deferred("r1", "approval", {"x": float("nan")})
    assert bad.value.code == "invalid_argument"
    with pytest.raises(StoreError):
        waits.complete_deferred("r1", "", 1)
    assert (
        db.read(lambda c: c.execute(sa.select(sa.func.count()).select_from(deferred_completions)).scalar())
        == 0
    )


def test_consuming_marks_the_completion_before_serving_and_recovery_then_leaves_it_out(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow")
    o = own(db, journal, fast, "r1")
    waits.complete_deferred("r1", "approval", "yes")
    assert [d.execution_id for d in waits.completed_deferreds("flow")] == ["r1"]
    served = waits.consume_deferred("r1", "approval", o.owner)
    assert not isinstance(served, NotFound) and served.value == "yes" and served.consumed_at_ms is not None
    assert waits.completed_deferreds("flow") == []
    again = waits.consume_deferred("r1", "approval", o.owner)
    assert (
        not isinstance(again, NotFound) and again.consumed_at_ms == served.consumed_at_ms
    )  # replay keeps it
    assert isinstance(waits.consume_deferred("r1", "later", o.owner), NotFound)
    with pytest.raises(FenceLost):  # only the owner may consume
        waits.consume_deferred("r1", "approval", OwnerId("waits-host", 1, "zombie"))


def test_registration_listings_exclude_settled_runs(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    for rid in ("live", "done"):
        runs.create(rid, "flow")
        o = own(db, journal, fast, rid)
        waits.schedule_clock(rid, "t", 10_000, o.owner)
        waits.complete_deferred(rid, "d", 1)
    runs.finish("done", o.owner, "completed")
    assert [c.execution_id for c in waits.pending_clocks(["flow"])] == ["live"]
    assert [c.execution_id for c in waits.due_clocks(10_000, ["flow"])] == ["live"]
    assert waits.due_clocks(9_999, ["flow"]) == []
    assert [d.execution_id for d in waits.completed_deferreds("flow")] == ["live"]
    assert waits.pending_clocks(["other-flow"]) == []


# -- clocks ---------------------------------------------------------------------------------------------------


def test_scheduling_a_clock_is_fenced_and_a_rerun_keeps_the_original_deadline(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow")
    o = own(db, journal, fast, "r1")
    first = waits.schedule_clock("r1", "cool-down", 5_000, o.owner)
    rerun = waits.schedule_clock("r1", "cool-down", 9_000, o.owner)
    assert isinstance(first, Scheduled) and first.record.due_at_ms == 5_000
    assert isinstance(rerun, Existing) and rerun.record.due_at_ms == 5_000
    with pytest.raises(FenceLost):
        waits.schedule_clock("r1", "zombie", 1_000, OwnerId("waits-host", 1, "zombie"))
    assert waits.clock("flow", "r1", "zombie") is None  # the refused write left nothing behind


def test_complete_clock_answers_completed_then_already_completed_and_not_found(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow")
    o = own(db, journal, fast, "r1")
    waits.schedule_clock("r1", "t", 1_000, o.owner)
    first = waits.complete_clock("flow", "r1", "t")
    assert isinstance(first, Completed) and first.record.completed_at_ms is not None
    assert isinstance(waits.complete_clock("flow", "r1", "t"), AlreadyCompleted)
    assert isinstance(waits.complete_clock("flow", "r1", "missing"), NotFound)
    fired = [e for e in journal.read("r1") if e.type == "clock-fired"]
    assert len(fired) == 1 and fired[0].payload["fired_at_ms"] >= fired[0].payload["due_at_ms"]


def test_a_terminal_transaction_closes_the_runs_pending_clocks_or_leaves_them_when_it_rolls_back(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow")
    o = own(db, journal, fast, "r1")
    waits.schedule_clock("r1", "a", 1_000, o.owner)
    waits.schedule_clock("r1", "b", 2_000, o.owner)

    def zombie_settles(conn: sa.Connection) -> None:
        waits.complete_run_clocks_in(conn, "r1")
        runs.finish("r1", OwnerId("waits-host", 1, "zombie"), "completed")

    with pytest.raises(FenceLost):
        db.write(zombie_settles)
    assert len(waits.pending_clocks(["flow"])) == 2
    closed = db.write(
        lambda c: (runs.finish("r1", o.owner, "completed"), waits.complete_run_clocks_in(c, "r1"))[1]
    )
    assert closed == 2
    assert all(c is not None and not c.pending for c in (waits.clock("flow", "r1", n) for n in "ab"))


# -- park / wake ----------------------------------------------------------------------------------------------


def test_park_is_timer_at_the_earliest_pending_deadline_else_event(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("t", "flow")
    o = own(db, journal, fast, "t")
    waits.schedule_clock("t", "late", 9_000, o.owner)
    waits.schedule_clock("t", "soon", 4_000, o.owner)
    parked = waits.park("t", o.owner)
    assert parked == Parked("t", TimerWait(4_000), parked.revision)  # type: ignore[union-attr]
    runs.create("e", "flow")
    o2 = own(db, journal, fast, "e")
    ev = waits.park("e", o2.owner, token=deferred_token("approval"))
    assert isinstance(ev, Parked)
    assert ev.wait == EventWait(sha256_hex(deferred_token("approval").encode()))
    runs.create("q", "flow")
    o3 = own(db, journal, fast, "q")
    assert isinstance(waits.park("q", o3.owner, reason="quarantine"), Parked)
    assert isinstance(waits.park("ghost", o3.owner), NotFound)
    with pytest.raises(StoreError):
        waits.park("q", o3.owner, reason="released")  # type: ignore[arg-type]


def test_a_run_parked_on_an_approval_is_listed_as_such_and_woken_only_explicitly(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow")
    o = own(db, journal, fast, "r1")
    parked = waits.park("r1", o.owner, reason="waiting-approval", token="token-1")
    assert isinstance(parked, Parked) and parked.wait == ApprovalWait(sha256_hex(b"token-1"))
    assert [w.run_id for w in waits.waiting_runs(WaitingFilter(reason="waiting-approval"))] == ["r1"]
    # A completion of some deferred of this run does not open an approval gate.
    assert isinstance(waits.complete_deferred("r1", "d", 1).wake, NotWaiting)  # type: ignore[union-attr]
    assert isinstance(waits.wake("r1"), Woken)  # the control plane's decision does, explicitly


def test_a_park_under_a_lost_fence_rolls_back_and_keeps_the_earlier_waiting_row(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow")
    o = own(db, journal, fast, "r1")
    waits.park("r1", o.owner)
    with pytest.raises(FenceLost):
        waits.park("r1", o.owner)  # no longer running: the fence refuses
    w = waits.waiting("r1")
    assert isinstance(w, WaitingRun) and w.wait == EventWait()
    assert [e.type for e in journal.read("r1")].count("run-suspended") == 1


def test_wake_answers_woken_not_waiting_and_not_found(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow")
    o = own(db, journal, fast, "r1")
    assert isinstance(waits.wake("r1"), NotWaiting)  # running
    waits.park("r1", o.owner)
    woke = waits.wake("r1")
    assert isinstance(woke, Woken) and woke.was == EventWait()
    rec = runs.get("r1")
    assert rec is not None and rec.status == "pending" and rec.waiting is None
    assert isinstance(waits.wake("r1"), NotWaiting)
    assert isinstance(waits.wake("ghost"), NotFound)


def test_a_completion_wakes_only_a_run_parked_on_it(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow")
    o = own(db, journal, fast, "r1")
    waits.park("r1", o.owner, token=deferred_token("approval"))
    other = waits.complete_deferred("r1", "unrelated", 1)
    assert isinstance(other, Completed) and isinstance(other.wake, NotWaiting)
    mine = waits.complete_deferred("r1", "approval", 2)
    assert isinstance(mine, Completed) and isinstance(mine.wake, Woken)


def test_firing_the_last_pending_clock_wakes_a_timer_run_and_an_earlier_one_moves_its_wake_time(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow")
    o = own(db, journal, fast, "r1")
    now = o.clock.now_ms()
    waits.schedule_clock("r1", "a", now - 10, o.owner)
    waits.schedule_clock("r1", "b", now + 3_600_000, o.owner)
    waits.park("r1", o.owner)
    first = waits.complete_clock("flow", "r1", "a", wake=True)
    assert isinstance(first, Completed) and isinstance(first.wake, NotWaiting)
    w = waits.waiting("r1")
    assert isinstance(w, WaitingRun) and w.wait == TimerWait(now + 3_600_000)
    last = waits.complete_clock("flow", "r1", "b", wake=True)
    assert isinstance(last, Completed) and isinstance(last.wake, Woken)


# -- the waiting taxonomy and its listing ----------------------------------------------------------------------


def test_waiting_runs_filter_by_reason_deadline_cancellation_and_flow(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("timer-soon", "f1")
    runs.create("timer-late", "f1")
    runs.create("event", "f2")
    runs.create("released", "f2")
    for rid, due in (("timer-soon", 1_000), ("timer-late", 50_000)):
        o = own(db, journal, fast, rid)
        waits.schedule_clock(rid, "t", due, o.owner)
        waits.park(rid, o.owner)
    o = own(db, journal, fast, "event")
    waits.park("event", o.owner)
    o = own(db, journal, fast, "released")
    o.release("released", cause="shutdown")
    runs.request_cancel("event")

    def ids(f: WaitingFilter) -> list[str]:
        return sorted(w.run_id for w in waits.waiting_runs(f))

    assert ids(WaitingFilter()) == ["event", "released", "timer-late", "timer-soon"]
    assert ids(WaitingFilter(reason="timer")) == ["timer-late", "timer-soon"]
    assert ids(WaitingFilter(due_before_ms=1_000)) == ["timer-soon"]
    assert ids(WaitingFilter(cancel_requested=True)) == ["event"]
    assert ids(WaitingFilter(cancel_requested=False, flows=("f2",))) == ["released"]
    released = waits.waiting("released")
    assert isinstance(released, WaitingRun) and released.wait == ReleasedWait("shutdown")
    runs.create("q", "f1")
    o = own(db, journal, fast, "q")
    waits.park("q", o.owner, reason="quarantine")
    assert [w.wait for w in waits.waiting_runs(WaitingFilter(reason="quarantine"))] == [QuarantineWait()]


def test_a_corrupt_row_is_skipped_by_list_reads_with_one_warning_naming_it_and_fails_point_reads(
    db: Database,
    journal: Journal,
    runs: RunStore,
    waits: WaitStore,
    fast: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for rid in ("good", "bad"):
        runs.create(rid, "flow")
        o = own(db, journal, fast, rid)
        waits.complete_deferred(rid, "d", {"v": rid})
        waits.park(rid, o.owner)
        runs.request_cancel(rid)
    db.write(
        lambda c: c.execute(
            sa.update(deferred_completions)
            .where(deferred_completions.c.execution_id == "bad")
            .values(value_json="{nope")
        )
    )
    # A timer wait without a deadline is outside the taxonomy.
    db.write(lambda c: c.execute(sa.text("UPDATE runs SET waiting_reason = 'timer' WHERE run_id = 'bad'")))
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.records.waits"):
        deferreds = waits.completed_deferreds("flow")
        waiting = waits.waiting_runs(WaitingFilter(cancel_requested=True))
    assert [d.execution_id for d in deferreds] == ["good"]
    assert [w.run_id for w in waiting] == ["good"]
    warnings = [r.getMessage() for r in caplog.records if "bad" in r.getMessage()]
    assert len(warnings) == 2 and all("undecodable" in w for w in warnings)
    for read in (lambda: waits.deferred("flow", "bad", "d"), lambda: waits.waiting("bad")):
        with pytest.raises(StoreError) as err:
            read()
        assert err.value.code == "decode_failed"


# -- lifecycle facts ---------------------------------------------------------------------------------------------


def test_every_lifecycle_transition_journals_its_observation_with_the_row_change(
    db: Database, journal: Journal, runs: RunStore, waits: WaitStore, fast: Settings
) -> None:
    runs.create("r1", "flow", parent_run_id="p")
    o = own(db, journal, fast, "r1")
    waits.schedule_clock("r1", "t", 7_000, o.owner)
    waits.park("r1", o.owner)
    waits.wake("r1")
    assert isinstance(o.claim("r1"), Activated)
    o.release("r1", cause="shutdown")
    assert isinstance(o.claim("r1"), Activated)
    runs.finish("r1", o.owner, "completed", result=1)
    facts = [(e.type, e.payload["fact"]["observation"]) for e in journal.read("r1") if "fact" in e.payload]
    assert [(t, obs["status"]) for t, obs in facts] == [
        ("run-created", "pending"),
        ("run-activated", "running"),
        ("run-suspended", "suspended"),
        ("run-woken", "pending"),
        ("run-activated", "running"),
        ("interrupt-released", "suspended"),
        ("run-activated", "running"),
        ("run-settled", "completed"),
    ]
    by_type = dict(facts)
    assert by_type["run-suspended"]["waiting"] == {
        "reason": "timer",
        "wake_at_ms": 7_000,
        "token_digest": None,
    }
    assert by_type["interrupt-released"]["waiting"]["reason"] == "released"
    assert all(obs["parent_run_id"] == "p" and obs["flow"] == "flow" for _, obs in facts)
    assert facts[-1][1]["waiting"] is None and facts[-1][1]["finished_at_ms"] is not None
    assert db.read(lambda c: c.execute(sa.select(sa.func.count()).select_from(clock_deadlines)).scalar()) == 1
