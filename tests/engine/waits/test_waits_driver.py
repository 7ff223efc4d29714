"""The run driver in one process (SQLite and PostgreSQL): in-process sleeps and parks, clock fires and their retry,
the wake bus and its polling fallback, cancellation (parked, running, racing, cascading), shutdown, unregistered
flows and corrupt rows. Time-sensitive tests run on a ManualClock and assert states, never elapsed time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

import smthrs_plugin as sp
from smthrs_plugin._clock import ManualClock
from smthrs_plugin.engine.cancellation import cancel_run
from smthrs_plugin.engine.context import RunContext
from smthrs_plugin.engine.drive.active_run import (
    DriveParked,
    DriveReleased,
    DriveSettled,
    DriveUnregistered,
    FlowFailed,
)
from smthrs_plugin.engine.drive.driver import RetryPolicy, RunDriver
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.engine.wakebus import NoopWakeBus, WakeBus
from smthrs_plugin.errors import StoreError, WaitError
from smthrs_plugin.records.runs import AlreadyTerminal, OwnerId, RunStore
from smthrs_plugin.records.wait_rows import EventWait, TimerWait, WaitingRun
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database
from smthrs_plugin.stores.wait_tables import deferred_completions


def eventually(cond: Callable[[], Any], timeout: float = 120.0) -> Any:
    """Poll ``cond`` until truthy (a deadline guards against hangs; nothing asserts how long it took)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


class Background:
    """Runs ``fn`` on a thread and hands its result back."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._t.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # handed to the test thread by join()
            self.error = exc

    @property
    def done(self) -> bool:
        return not self._t.is_alive()

    def join(self, timeout: float = 120.0) -> Any:
        self._t.join(timeout)
        assert not self._t.is_alive(), "background call did not finish"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def drivers(db: Database, fast: Settings) -> Iterator[Callable[..., RunDriver]]:
    made: list[RunDriver] = []

    def make(tag: str = "a", **kw: Any) -> RunDriver:
        kw.setdefault("settings", fast)
        d = RunDriver(db, owner=OwnerId("waits-host", 4242, f"nonce-{tag}"), **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop(grace_s=5)


# -- sleeping ------------------------------------------------------------------------------------------------


def test_a_sleep_within_the_budget_completes_in_process_and_never_before_its_deadline(
    drivers: Callable[..., RunDriver],
) -> None:
    clock = ManualClock()
    drv = drivers(clock=clock, wait_budget_s=3600)

    def nap(ctx: RunContext) -> dict[str, int]:
        sp.sleep(600)
        return {"woke_at_ms": ctx.clock.now_ms()}

    drv.register("nap", nap)
    drv.submit("r1", "nap")
    call = Background(lambda: drv.drive("r1"))
    clk = eventually(lambda: drv.waits.clock("nap", "r1", "sleep:1"))
    clock.advance(599.999)
    time.sleep(0.05)  # give an early wake-up every chance to happen
    assert not call.done and drv.runs.get("r1").status == "running"  # type: ignore[union-attr]
    clock.advance(0.001)
    assert call.join() == DriveSettled("r1", "completed", "completed")
    rec = drv.runs.get("r1")
    assert rec is not None and rec.result["woke_at_ms"] >= clk.due_at_ms


def test_a_sleep_beyond_the_budget_parks_timer_and_the_tick_fires_it_at_the_stored_deadline(
    drivers: Callable[..., RunDriver],
) -> None:
    clock = ManualClock()
    drv = drivers(clock=clock, wait_budget_s=0)
    executions: list[int] = []

    def nap(ctx: RunContext) -> dict[str, int]:
        executions.append(ctx.clock.now_ms())
        sp.sleep_until(datetime.fromtimestamp((clock.now_ms() + 60_000) / 1000).astimezone(), name="nap")
        return {"woke_at_ms": ctx.clock.now_ms()}

    drv.register("nap", nap)
    drv.submit("r1", "nap")
    parked = drv.drive("r1")
    due = drv.waits.clock("nap", "r1", "nap").due_at_ms  # type: ignore[union-attr]
    assert parked == DriveParked("r1", TimerWait(due))
    clock.advance(59.999)
    assert drv.tick().fired == ()
    clock.advance(0.001)
    assert drv.tick().fired == (("r1", "nap"),)
    assert drv.drain() == [DriveSettled("r1", "completed", "completed")]
    rec = drv.runs.get("r1")
    assert rec is not None and rec.result["woke_at_ms"] >= due
    # The re-execution found the clock fired: the ORIGINAL deadline held, nothing was rescheduled.
    assert len(executions) == 2 and [e.type for e in drv.journal.read("r1")].count("clock-scheduled") == 1


def test_bad_waits_are_refused_before_anything_is_written(drivers: Callable[..., RunDriver]) -> None:
    with pytest.raises(WaitError) as outside:
        sp.sleep(1)
    assert outside.value.code == "no_run_context"
    drv = drivers()
    seen: list[str] = []

    def bad(ctx: RunContext) -> None:
        for call in (
            lambda: sp.sleep(-1),
            lambda: sp.sleep(float("inf")),
            lambda: sp.sleep_until(datetime(2030, 1, 1)),
            lambda: sp.sleep_until("tomorrow"),
            lambda: sp.wait_for(""),
        ):
            with pytest.raises(WaitError) as err:
                call()
            seen.append(err.value.code)

    drv.register("bad", bad)
    drv.submit("r1", "bad")
    assert drv.drive("r1") == DriveSettled("r1", "completed", "completed")
    assert seen == ["invalid_wait"] * 5
    assert drv.waits.pending_clocks() == []


def test_a_flow_failure_and_a_non_json_value_settle_failed(drivers: Callable[..., RunDriver]) -> None:
    drv = drivers()
    drv.register("boom", lambda ctx: 1 / 0)
    drv.register("odd", lambda ctx: object())
    drv.register("says-no", lambda ctx: FlowFailed({"why": "no"}))
    for rid, flow in (("r1", "boom"), ("r2", "odd"), ("r3", "says-no")):
        drv.submit(rid, flow)
        assert drv.drive(rid) == DriveSettled(rid, "failed", "failed")
    errors = [drv.runs.get(r).error for r in ("r1", "r2", "r3")]  # type: ignore[union-attr]
    assert errors[0]["type"] == "ZeroDivisionError" and errors[1]["code"] == "invalid_argument"
    assert errors[2] == {"why": "no"}


# -- deferreds and the wake bus ------------------------------------------------------------------------------------


def _waiter(ctx: RunContext) -> dict[str, Any]:
    value = sp.wait_for("go")
    return {
        "value": value,
        "checks": ctx.stats.checks,
        "woken": ctx.stats.woken,
        "timed_out": ctx.stats.timed_out,
    }


class ObservedWaits(WaitStore):
    """The real store; :attr:`missed` is set once the flow's check found its deferred not completed yet.

    The waiter subscribes to the bus BEFORE that check, so a subscription alone does not prove the check is over: a
    completion landing in between would be found by the first check, and neither a wake nor a poll would be
    exercised. Completing only after :attr:`missed` is set pins the path under test on any machine."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.missed = threading.Event()

    def deferred(self, flow: str, execution_id: str, name: str) -> Any:
        seen = super().deferred(flow, execution_id, name)
        if seen is None:
            self.missed.set()
        return seen


def test_a_completed_deferred_wakes_the_waiter_through_the_bus_without_a_poll_tick(
    db: Database, drivers: Callable[..., RunDriver]
) -> None:
    bus = WakeBus()
    waits = ObservedWaits(db)
    drv = drivers(bus=bus, waits=waits, wait_budget_s=3600, wait_poll_s=3600)  # only a wake can end the wait
    drv.register("waiter", _waiter)
    drv.submit("r1", "waiter")
    call = Background(lambda: drv.drive("r1"))
    assert waits.missed.wait(120) and bus.waiters("r1") == 1  # the flow checked, found nothing, and listens
    sp.complete("r1", "go", 7, db=db, bus=bus)
    assert call.join() == DriveSettled("r1", "completed", "completed")
    assert drv.runs.get("r1").result == {"value": 7, "checks": 2, "woken": 1, "timed_out": 0}  # type: ignore[union-attr]
    assert bus.watched() == 0  # the finished wait left no registration behind
    assert drv.waits.deferred("waiter", "r1", "go").consumed_at_ms is not None  # type: ignore[union-attr]


def test_with_the_noop_bus_the_polling_fallback_still_completes_the_run(
    db: Database, drivers: Callable[..., RunDriver]
) -> None:
    bus = NoopWakeBus()
    waits = ObservedWaits(db)
    drv = drivers(bus=bus, waits=waits, wait_budget_s=3600, wait_poll_s=0.02)
    drv.register("waiter", _waiter)
    drv.submit("r1", "waiter")
    call = Background(lambda: drv.drive("r1"))
    assert waits.missed.wait(120) and bus.waiters("r1") == 1  # the flow checked, found nothing, and listens
    sp.complete("r1", "go", 8, db=db, bus=bus)
    assert call.join() == DriveSettled("r1", "completed", "completed")
    result = drv.runs.get("r1").result  # type: ignore[union-attr]
    assert result["value"] == 8 and result["woken"] == 0 and result["timed_out"] >= 1


def test_a_run_parked_on_a_deferred_is_woken_by_its_completion_and_re_driven_by_the_sweep(
    db: Database, drivers: Callable[..., RunDriver]
) -> None:
    drv = drivers(wait_budget_s=0)
    drv.register("waiter", _waiter)
    drv.submit("r1", "waiter")
    parked = drv.drive("r1")
    assert isinstance(parked, DriveParked) and isinstance(parked.wait, EventWait)
    assert drv.tick().runnable == ()  # nothing completed it yet: it stays parked
    first = sp.complete("r1", "go", {"ok": True}, db=db)
    second = sp.complete("r1", "go", {"ok": False}, db=db)
    assert type(first).__name__ == "Completed" and type(second).__name__ == "Existing"
    assert drv.tick().runnable == ("r1",)
    assert drv.drain() == [DriveSettled("r1", "completed", "completed")]
    assert drv.runs.get("r1").result["value"] == {"ok": True}  # type: ignore[union-attr]


# -- cancellation --------------------------------------------------------------------------------------------------


def test_cancelling_a_parked_run_settles_it_on_the_next_sweep_and_closes_its_clocks(
    drivers: Callable[..., RunDriver],
) -> None:
    drv = drivers(wait_budget_s=0)
    drv.register("nap", lambda ctx: sp.sleep(3600))
    drv.submit("r1", "nap")
    assert isinstance(drv.drive("r1"), DriveParked)
    other = drivers("b")  # any process may request; this one has not even registered the flow
    assert cancel_run(other.runs, "r1").requested == ("r1",)
    assert drv.tick().cancelling == ("r1",)
    assert drv.drain() == [DriveSettled("r1", "cancelled", "cancelled")]
    assert drv.waits.pending_clocks() == []


def test_cancelling_a_running_run_interrupts_its_wait(drivers: Callable[..., RunDriver]) -> None:
    drv = drivers(wait_budget_s=3600)
    drv.register("nap", lambda ctx: sp.sleep(3600))
    drv.submit("r1", "nap")
    call = Background(lambda: drv.drive("r1"))
    eventually(lambda: drv.waits.clock("nap", "r1", "sleep:1"))
    cancel_run(RunStore(drv.db), "r1")
    assert call.join() == DriveSettled("r1", "cancelled", "cancelled")
    rec = drv.runs.get("r1")
    assert rec is not None and rec.cancel_ack is not None and rec.cancel_ack.owner == drv.owner


def test_a_cancellation_racing_the_last_poll_turns_the_completion_into_cancelled(
    drivers: Callable[..., RunDriver], fast: Settings
) -> None:
    drv = drivers(settings=fast.model_copy(update={"heartbeat_interval_s": 3600.0}))

    def finishes(ctx: RunContext) -> str:
        RunStore(ctx.waits.db).request_cancel(ctx.run_id)  # arrives after the flow's last wait
        return "done"

    drv.register("quick", finishes)
    drv.submit("r1", "quick")
    assert drv.drive("r1") == DriveSettled("r1", "cancelled", "completed")
    rec = drv.runs.get("r1")
    assert rec is not None and rec.status == "cancelled" and rec.result is None


def test_cancelling_a_parent_cascades_through_durable_parent_edges(
    db: Database, drivers: Callable[..., RunDriver]
) -> None:
    drv = drivers(wait_budget_s=0)
    drv.register("nap", lambda ctx: sp.sleep(3600))
    drv.register("quick", lambda ctx: "ok")
    drv.submit("parent", "nap")
    drv.submit("done-child", "quick", parent_run_id="parent")
    assert drv.drive("done-child") == DriveSettled("done-child", "completed", "completed")
    drv.submit("child", "nap", parent_run_id="parent")
    drv.submit("grandchild", "quick", parent_run_id="child")
    drv.submit("diamond", "quick", parent_run_id="parent")
    RunStore(db).record_run_parent("diamond", "child")
    assert isinstance(drv.drive("parent"), DriveParked)
    assert isinstance(drv.drive("child"), DriveParked)
    report = cancel_run(RunStore(db), "parent")  # a fresh store: no in-memory map of children exists
    assert report.requested == ("parent", "child", "diamond", "grandchild")
    assert isinstance(report.descendants[0], AlreadyTerminal)
    drv.tick()
    drv.drain()
    drv.tick()
    drv.drain()
    statuses = {r: drv.runs.get(r).status for r in ("parent", "child", "grandchild", "diamond", "done-child")}  # type: ignore[union-attr]
    assert statuses == {
        "parent": "cancelled",
        "child": "cancelled",
        "grandchild": "cancelled",
        "diamond": "cancelled",
        "done-child": "completed",
    }


# -- shutdown, unregistered flows, retries, corruption ------------------------------------------------------------


def test_shutdown_releases_the_runs_it_drives_and_another_driver_re_drives_them(
    drivers: Callable[..., RunDriver],
) -> None:
    first = drivers("a", wait_budget_s=3600)
    first.register("nap", lambda ctx: sp.sleep(3600))
    first.submit("r1", "nap")
    first.start()
    eventually(lambda: first.waits.clock("nap", "r1", "sleep:1"))
    outcomes = first.stop()
    assert outcomes == [DriveReleased("r1", "shutdown")]
    w = first.waits.waiting("r1")
    assert isinstance(w, WaitingRun) and w.wait.reason == "released" and w.cancel_requested_at_ms is None
    second = drivers("b")
    second.register("nap", lambda ctx: "resumed")
    assert second.tick().runnable == ("r1",)
    assert second.drain() == [DriveSettled("r1", "completed", "completed")]


def test_an_unregistered_flow_is_left_parked_with_one_warning_per_run(
    db: Database, drivers: Callable[..., RunDriver], fast: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    drv = drivers()
    drv.register("mine", lambda ctx: "ok")
    drv.submit("theirs", "not-mine")
    dead = Ownership(db, owner=OwnerId("waits-host", 1, "dead"), settings=fast)
    assert isinstance(dead.claim("theirs"), Activated)
    dead.release("theirs", cause="shutdown")
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.engine.drive.driver"):
        assert drv.drive("theirs") == DriveUnregistered("theirs", "not-mine")
        assert drv.drive("theirs") == DriveUnregistered("theirs", "not-mine")
        assert drv.tick().runnable == ()
    warnings = [r.getMessage() for r in caplog.records if "theirs" in r.getMessage()]
    assert len(warnings) == 1 and "not-mine" in warnings[0]
    assert drv.runs.get("theirs").status == "suspended"  # type: ignore[union-attr]


class FlakyWaits(WaitStore):
    """The real store, with the first ``failures`` clock fires failing like a dropped connection would."""

    def __init__(self, db: Database, failures: int) -> None:
        super().__init__(db)
        self.left = failures
        self.attempts = 0

    def complete_clock(self, *a: Any, **kw: Any) -> Any:
        self.attempts += 1
        if self.left > 0:
            self.left -= 1
            raise StoreError("store_failed", "injected: the connection dropped")
        return super().complete_clock(*a, **kw)


def test_a_failing_clock_fire_is_retried_with_doubling_backoff_until_it_fires(
    db: Database, drivers: Callable[..., RunDriver]
) -> None:
    clock = ManualClock()
    flaky = FlakyWaits(db, failures=3)
    drv = drivers(clock=clock, waits=flaky, wait_budget_s=0)
    drv.register("nap", lambda ctx: sp.sleep(1))
    drv.submit("r1", "nap")
    assert isinstance(drv.drive("r1"), DriveParked)
    clock.advance(1)
    delays: list[int] = []
    for _ in range(3):
        at = clock.now_ms()
        assert drv.tick().retrying == (("r1", "sleep:1"),)
        ((failures, next_ms),) = drv.retry_state.values()
        delays.append(next_ms - at)
        attempts = flaky.attempts
        assert drv.tick().retrying == () and flaky.attempts == attempts  # not before its backoff
        clock.advance((next_ms - at) / 1000)
    assert delays == [100, 200, 400]
    assert drv.tick().fired == (("r1", "sleep:1"),) and flaky.attempts == 4
    assert drv.drain() == [DriveSettled("r1", "completed", "completed")]
    assert RetryPolicy().delay(20) == 30.0 and RetryPolicy(limit=2).delay(3) is None


def test_a_corrupt_waiting_row_does_not_stop_a_sweep_or_a_registration(
    db: Database, drivers: Callable[..., RunDriver], caplog: pytest.LogCaptureFixture
) -> None:
    setup = drivers("setup", wait_budget_s=0)
    setup.register("waiter", _waiter)
    for rid in ("bad", "good", "bad-cancel", "good-cancel"):
        setup.submit(rid, "waiter")
        assert isinstance(setup.drive(rid), DriveParked)
    for rid in ("bad", "good"):
        setup.waits.complete_deferred(rid, "go", rid, wake=False)  # arrived while nothing listened
    for rid in ("bad-cancel", "good-cancel"):
        setup.runs.request_cancel(rid)
    d = deferred_completions
    db.write(lambda c: c.execute(sa.update(d).where(d.c.execution_id == "bad").values(value_json="{")))
    db.write(
        lambda c: c.execute(sa.text("UPDATE runs SET waiting_reason = 'bogus' WHERE run_id = 'bad-cancel'"))
    )
    drv = drivers("b")
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.records.waits"):
        reg = drv.register("waiter", _waiter)
        tick = drv.tick()
    assert reg.woken == ("good",)
    assert tick.cancelling == ("good-cancel",) and tick.runnable == ("good",)
    drv.drain()
    statuses = {r: drv.runs.get(r).status for r in ("bad", "good", "bad-cancel", "good-cancel")}  # type: ignore[union-attr]
    assert statuses == {
        "bad": "suspended",
        "good": "completed",
        "bad-cancel": "suspended",
        "good-cancel": "cancelled",
    }
    assert any("'bad'" in r.getMessage() for r in caplog.records)
    assert any("bad-cancel" in r.getMessage() for r in caplog.records)


class LateCompletion(WaitStore):
    """The real store; the completion of ``go`` lands right after the flow's check saw it missing."""

    def deferred(self, flow: str, execution_id: str, name: str) -> Any:
        seen = super().deferred(flow, execution_id, name)
        if seen is None:
            self.complete_deferred(execution_id, name, "late")  # finds the run running: it wakes nothing
        return seen


def test_a_completion_landing_between_the_check_and_the_park_is_not_lost(
    db: Database, drivers: Callable[..., RunDriver]
) -> None:
    drv = drivers(waits=LateCompletion(db), wait_budget_s=0)
    drv.register("waiter", _waiter)
    drv.submit("r1", "waiter")
    assert isinstance(drv.drive("r1"), DriveParked)
    assert drv.runs.get("r1").status == "pending"  # type: ignore[union-attr]  # parked, then woken in one transaction
    assert drv.tick().runnable == ("r1",)
    assert drv.drain() == [DriveSettled("r1", "completed", "completed")]
    assert drv.runs.get("r1").result["value"] == "late"  # type: ignore[union-attr]
