"""Park and wake on SQLite AND PostgreSQL (``db_url`` fixture): whichever path they take (PostgreSQL: one statement
when this process's hint of the row holds and nothing else decides; otherwise, and on SQLite, a transaction), the
outcome and the journal are the same: a park with a pending clock is a timer wait, a park whose deferred already
completed wakes in the same park, a wake after another writer moved the row journals the row as it really is, and
every journaled fact equals a read after the change.
"""

from __future__ import annotations

from typing import Any

import pytest
from _store_support import ownership

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.engine.ownership.arbiter import Activated
from smthrs_plugin.errors import FenceLost
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore, execution_fact
from smthrs_plugin.records.wait_rows import (
    EventWait,
    NotFound,
    NotWaiting,
    Parked,
    TimerWait,
    Woken,
    deferred_token,
)
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database


@pytest.fixture
def waits(db: Database, journal: Journal, runs: RunStore, clock: ManualClock) -> WaitStore:
    return WaitStore(db, journal=journal, runs_store=runs, clock=clock)


def _last(journal: Journal, run_id: str) -> Any:
    return journal.read(run_id, limit=1000)[-1]


def _fact_now(db: Database, run_id: str) -> dict[str, Any]:
    return db.read(lambda c: execution_fact(c, run_id))


def test_park_and_wake_journal_facts_equal_a_read_after_the_change(
    db: Database, runs: RunStore, journal: Journal, waits: WaitStore, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow", lineage_id="line", round_ordinal=1)
    assert isinstance(a.claim("r"), Activated)

    parked = waits.park("r", a.owner, token="tok")  # no clock: an event wait
    assert isinstance(parked, Parked) and isinstance(parked.wait, EventWait)
    rec = _last(journal, "r")
    assert rec.type == "run-suspended" and rec.payload["reason"] == "event" and "token_digest" in rec.payload
    assert rec.payload["fact"] == _fact_now(db, "r") and parked.revision == db.revision()

    woken = waits.wake("r")
    assert isinstance(woken, Woken) and isinstance(woken.was, EventWait) and woken.revision == db.revision()
    rec = _last(journal, "r")
    assert rec.type == "run-woken" and rec.payload == {"from_reason": "event", "fact": _fact_now(db, "r")}

    assert isinstance(a.claim("r"), Activated)
    waits.schedule_clock("r", "t", clock.now_ms() + 60_000, a.owner)
    timer = waits.park("r", a.owner)  # a pending clock decides: a timer wait at its deadline
    assert isinstance(timer, Parked) and timer.wait == TimerWait(clock.now_ms() + 60_000)
    rec = _last(journal, "r")
    assert rec.payload["reason"] == "timer" and rec.payload["wake_at_ms"] == clock.now_ms() + 60_000
    assert rec.payload["fact"] == _fact_now(db, "r")

    # Another writer moves the row between this process's park and its wake (an observed column changes):
    # the wake still journals the row it really changed.
    runs.request_cancel("r")
    woken = waits.wake("r")
    assert isinstance(woken, Woken) and isinstance(woken.was, TimerWait)
    rec = _last(journal, "r")
    assert rec.payload["from_reason"] == "timer" and rec.payload["fact"] == _fact_now(db, "r")
    assert rec.payload["fact"]["observation"]["cancel_requested_at_ms"] is not None
    assert isinstance(waits.wake("r"), NotWaiting)
    assert [e.seq for e in journal.read("r", limit=1000)] == list(range(len(journal.read("r", limit=1000))))


def test_a_park_whose_deferred_already_completed_wakes_the_run_in_the_same_park(
    db: Database, runs: RunStore, journal: Journal, waits: WaitStore, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow")
    assert isinstance(a.claim("r"), Activated)
    # Completed while the run still ran (its completion found nothing parked to wake)...
    done = waits.complete_deferred("r", "approval", {"ok": True})
    assert isinstance(done.wake, NotWaiting)  # type: ignore[union-attr]
    # ...so the park on it wakes the run at once, in the park's transaction.
    parked = waits.park("r", a.owner, token=deferred_token("approval"), deferred="approval")
    assert isinstance(parked, Parked)
    rec = runs.get("r")
    assert rec is not None and rec.status == "pending" and rec.waiting is None
    tail = [e.type for e in journal.read("r", limit=1000)][-2:]
    assert tail == ["run-suspended", "run-woken"]
    assert _last(journal, "r").payload["fact"] == _fact_now(db, "r")

    # A deferred that has not completed parks the run and leaves it parked.
    assert isinstance(a.claim("r"), Activated)
    parked = waits.park("r", a.owner, token=deferred_token("other"), deferred="other")
    assert isinstance(parked, Parked)
    rec = runs.get("r")
    assert rec is not None and rec.status == "suspended" and rec.waiting is not None
    assert _last(journal, "r").type == "run-suspended"


def test_a_park_of_a_missing_run_is_not_found_and_of_a_lost_run_raises_and_writes_nothing(
    db: Database, runs: RunStore, journal: Journal, waits: WaitStore, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    assert isinstance(waits.park("ghost", a.owner), NotFound)
    runs.create("r", "flow")
    assert isinstance(a.claim("r"), Activated)
    clock.advance(settings.stale_after_s + 0.001)  # past the stale window: a's lease expired
    assert isinstance(b.claim("r"), Activated)
    before, entries = db.revision(), len(journal.read("r", limit=1000))
    with pytest.raises(FenceLost):
        waits.park("r", a.owner)  # a's hint of the row is stale and its fence lost: nothing is written
    assert db.revision() == before and len(journal.read("r", limit=1000)) == entries
    rec = runs.get("r")
    assert rec is not None and rec.status == "running" and rec.owner == b.owner
    runs.delete("r", force=True)
    assert isinstance(waits.park("r", b.owner), NotFound)
