"""Ownership beyond the contract basics: liveness evidence, the heartbeat thread, the stale sweep's batches and
backoff, the clock. Time is a ManualClock throughout: nothing here sleeps through a stale window."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import sqlalchemy as sa
from _store_support import owner, ownership

from smthrs_plugin._clock import ManualClock, SystemClock
from smthrs_plugin.engine.ownership.arbiter import (
    Activated,
    HeartbeatFresh,
    Ownership,
    StealRefusedOwnerAlive,
)
from smthrs_plugin.engine.ownership.heartbeat import Heartbeater, Interrupt
from smthrs_plugin.engine.ownership.liveness import (
    Alive,
    Dead,
    LeaseLiveness,
    LivenessContext,
    SameHostPidProbe,
    pid_alive,
    process_start_token,
)
from smthrs_plugin.engine.ownership.stale_sweep import StaleSweep
from smthrs_plugin.errors import StoreError
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore, current_owner
from smthrs_plugin.settings import Settings, load_settings
from smthrs_plugin.stores.database import Database
from smthrs_plugin.stores.schema import runs as runs_table

# -- clock ----------------------------------------------------------------------------------------------------


def test_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(start_ms=1_000)
    assert clock.now_ms() == 1_000
    clock.advance(2.5)
    assert clock.now_ms() == 3_500 and clock.monotonic() == pytest.approx(3.5)
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_manual_clock_sleep_blocks_until_advanced() -> None:
    clock = ManualClock()
    woke = threading.Event()

    def sleeper() -> None:
        clock.sleep(30)
        woke.set()

    t = threading.Thread(target=sleeper)
    t.start()
    clock.advance(29)
    assert not woke.wait(0.05)
    clock.advance(1)
    assert woke.wait(60)
    t.join()


def test_manual_clock_wait_returns_at_once_when_the_event_is_set() -> None:
    clock = ManualClock()
    ev = threading.Event()
    ev.set()
    assert clock.wait(ev, 1000) is True and clock.now_ms() == ManualClock().now_ms()
    auto = ManualClock(start_ms=0, auto_advance=True)
    assert auto.wait(threading.Event(), 1.5) is False and auto.now_ms() == 1500


def test_system_clock_is_epoch_milliseconds() -> None:
    assert abs(SystemClock().now_ms() - time.time() * 1000) < 5_000


# -- identity and liveness ------------------------------------------------------------------------------------


def test_current_owner_is_minted_once_per_process() -> None:
    s = load_settings(host_id="h1")
    assert current_owner(s) == current_owner(s) and current_owner(s).pid == os.getpid()
    code = "from smthrs_plugin.records.runs import current_owner; print(current_owner().nonce)"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout.strip()
    assert other and other != current_owner().nonce


def _ctx(age_ms: int, claimant: OwnerId, proc_start: str | None = None) -> LivenessContext:
    return LivenessContext(claimant, 1_000_000 - age_ms, 1_000_000, 30_000, 10_000, proc_start)


def test_the_lease_expires_after_exactly_30_000_ms_of_heartbeat_age_with_no_skew_added() -> None:
    # heartbeat_at >= now - 30 s is fresh (30,000 ms of age included); the skew allowance (10 s in _ctx) is NOT added.
    check, me, them = LeaseLiveness(), owner("me"), owner("them", host="elsewhere")
    assert check.check(them, _ctx(29_999, me)) == Alive("lease-fresh")
    assert check.check(them, _ctx(30_000, me)) == Alive("lease-fresh")
    assert check.check(them, _ctx(30_001, me)) == Dead("lease-expired")


def test_the_same_host_probe_is_consulted_only_for_an_expired_lease() -> None:
    probe = SameHostPidProbe()
    me = OwnerId("host-a", os.getpid(), "me")
    alive_owner = OwnerId("host-a", os.getpid(), "other-incarnation")
    assert probe.check(alive_owner, _ctx(10**6, me)) == Alive("probe")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = OwnerId("host-a", dead.pid, "x")
    # A dead same-host pid under a FRESH lease is not stolen early: the lease answers, the pid is not consulted.
    assert probe.check(gone, _ctx(0, me)) == Alive("lease-fresh")
    assert probe.check(gone, _ctx(30_000, me)) == Alive("lease-fresh")
    assert probe.check(gone, _ctx(30_001, me)) == Dead("same-host-pid-dead")
    # A live pid whose start time differs from the recorded one was recycled: the owner is dead (lease expired).
    assert probe.check(alive_owner, _ctx(30_001, me, proc_start="boot:1")) == Dead("same-host-pid-dead")
    assert probe.check(alive_owner, _ctx(0, me, proc_start="boot:1")) == Alive("lease-fresh")
    assert probe.check(alive_owner, _ctx(30_001, me, proc_start=process_start_token(os.getpid()))) == Alive(
        "probe"
    )
    remote = OwnerId("host-b", os.getpid(), "r")
    assert probe.check(remote, _ctx(1_000, me)) == Alive("lease-fresh")
    assert probe.check(remote, _ctx(30_001, me)) == Dead("cross-host-unreachable-stale")


def test_a_dead_same_host_owner_is_stolen_at_30_s_never_earlier(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    runs.create("r", "flow")
    gone = Ownership(
        db, owner=OwnerId("host-a", dead.pid, "gone"), journal=journal, clock=clock, settings=settings
    )
    assert isinstance(gone.claim("r"), Activated)
    thief = Ownership(
        db, owner=owner("thief"), journal=journal, clock=clock, settings=settings, liveness=SameHostPidProbe()
    )
    clock.advance(settings.stale_after_s)
    assert isinstance(thief.claim("r"), HeartbeatFresh)  # exactly the stale window old: still fresh
    clock.advance(0.001)
    stolen = thief.claim("r")
    assert isinstance(stolen, Activated) and stolen.evidence == "same-host-pid-dead"


def test_a_live_same_host_owner_with_an_expired_lease_is_refused_with_probe_evidence_once(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    runs.create("r", "flow")
    live = Ownership(
        db, owner=OwnerId("host-a", os.getpid(), "live"), journal=journal, clock=clock, settings=settings
    )
    assert isinstance(live.claim("r"), Activated)
    thief = Ownership(
        db, owner=owner("thief"), journal=journal, clock=clock, settings=settings, liveness=SameHostPidProbe()
    )
    assert isinstance(thief.claim("r"), HeartbeatFresh)
    records = [e for e in journal.read("r") if e.type == "steal-refused-owner-alive"]
    assert [r.payload["evidence"] for r in records] == ["lease-fresh"]  # the fresh lease refused, journaled
    clock.advance(settings.stale_after_s + 0.001)
    for _ in range(3):
        refused = thief.claim("r")
        assert isinstance(refused, StealRefusedOwnerAlive) and refused.evidence == "probe"
    records = [e for e in journal.read("r") if e.type == "steal-refused-owner-alive"]
    assert [r.payload["evidence"] for r in records] == ["lease-fresh", "probe"]


def test_pid_alive_treats_zombies_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Not reaped yet: a zombie once it exits.
    deadline = time.monotonic() + 120  # a Python start on a busy machine; a hang bound, not a measurement
    while pid_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pid_alive(child.pid)
    child.wait()
    assert pid_alive(os.getpid())


def test_claim_of_an_unknown_run_is_not_found(
    db: Database, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    with pytest.raises(StoreError) as err:
        ownership(db, journal, clock, settings, "a").claim("ghost")
    assert err.value.code == "not_found"


# -- heartbeater ----------------------------------------------------------------------------------------------


def test_heartbeater_renews_the_lease_and_reports_a_cancel_request_once(
    db: Database, runs: RunStore, journal: Journal, settings: Settings
) -> None:
    clock = ManualClock(auto_advance=True)
    own = Ownership(db, owner=owner("a"), journal=journal, clock=clock, settings=settings)
    RunStore(db, journal=journal, clock=clock).create("r", "flow")
    own.claim("r")
    cancels: list[int] = []
    hb = Heartbeater(own, "r", on_cancel=cancels.append)
    runs.request_cancel("r")
    hb.start()
    deadline = time.monotonic() + 120  # beats come as fast as the database commits them; a hang bound only
    try:
        while hb.beats < 5 and time.monotonic() < deadline:
            threading.Event().wait(0.01)
    finally:
        hb.stop()
    assert hb.beats >= 5 and hb.interrupt is None
    assert len(cancels) == 1
    rec = runs.get("r")
    assert rec is not None and rec.heartbeat_at_ms == hb.last.at_ms  # type: ignore[union-attr]


def test_a_heartbeater_told_to_wait_writes_nothing_until_its_first_interval_passed(
    db: Database, runs: RunStore, journal: Journal, settings: Settings
) -> None:
    clock = ManualClock()  # moves only when advanced below
    own = Ownership(db, owner=owner("a"), journal=journal, clock=clock, settings=settings)
    RunStore(db, journal=journal, clock=clock).create("r", "flow")
    own.claim("r")
    activated_at = runs.get("r").heartbeat_at_ms  # type: ignore[union-attr]
    hb = Heartbeater(own, "r", first_beat_after_s=5.0).start()
    try:
        clock.advance(4.9)
        assert not hb.interrupted.wait(0.2) and hb.beats == 0  # nothing written before the interval
        assert runs.get("r").heartbeat_at_ms == activated_at  # type: ignore[union-attr]
        clock.advance(0.2)
        deadline = time.monotonic() + 120  # a hang bound only: the beat follows the advance
        while hb.beats < 1 and time.monotonic() < deadline:
            threading.Event().wait(0.01)
    finally:
        hb.stop()
    assert hb.beats >= 1
    assert runs.get("r").heartbeat_at_ms == clock.now_ms()  # type: ignore[union-attr]


def test_heartbeater_interrupts_at_once_on_fence_lost(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    runs.create("r", "flow")
    a.claim("r")
    runs.finish("r", a.owner, "failed")  # the run is gone from a's hands
    got: list[Interrupt] = []
    hb = Heartbeater(a, "r", on_interrupt=got.append).start()
    assert hb.interrupted.wait(60)
    hb.stop()
    assert [i.reason for i in got] == ["fence_lost"] and hb.beats == 0


def test_heartbeater_interrupts_after_19_seconds_of_failing_writes(
    db: Database, runs: RunStore, journal: Journal, settings: Settings
) -> None:
    clock = ManualClock(auto_advance=True)  # each wait of 1 s advances the clock by 1 s
    own = Ownership(db, owner=owner("a"), journal=journal, clock=clock, settings=settings)
    RunStore(db, journal=journal, clock=clock).create("r", "flow")
    own.claim("r")

    class Flaky(Ownership):
        def heartbeat(self, run_id: str):  # type: ignore[no-untyped-def]
            raise StoreError("unreachable", "database down (simulated outage of the server)")

    flaky = Flaky(db, owner=own.owner, journal=journal, clock=clock, settings=settings)
    hb = Heartbeater(flaky, "r").start()
    assert hb.interrupted.wait(60)
    hb.stop()
    assert hb.interrupt is not None and hb.interrupt.reason == "heartbeat_failing"
    assert hb.interrupt.cause.code == "unreachable"  # type: ignore[attr-defined]
    # Failed at t = 0, 1, ..., 19 s: the 20th failure is the first one 19 s after the last success.
    assert hb.failures == 20


# -- stale sweep ----------------------------------------------------------------------------------------------


def _stale_rows(db: Database, runs: RunStore, clock: ManualClock, n: int, owner_of: OwnerId) -> list[str]:
    ids = [f"stale-{i:03d}" for i in range(n)]
    for i, run_id in enumerate(ids):
        runs.create(run_id, "flow")
        # Owned by a live process of this host (this test process) with heartbeats oldest-first by index.
        db.write(
            lambda c, run_id=run_id, i=i: c.execute(
                sa.update(runs_table)
                .where(runs_table.c.run_id == run_id)
                .values(
                    status="running",
                    owner_host=owner_of.host_id,
                    owner_pid=owner_of.pid,
                    owner_nonce=f"{owner_of.nonce}-{i}",
                    heartbeat_at_ms=clock.now_ms() - 60_000 + i,
                )
            )
        )
    return ids


def test_stale_sweep_batches_64_oldest_first_and_reads_past_deferred_rows(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    ids = _stale_rows(db, runs, clock, 65, OwnerId("host-a", os.getpid(), "live"))
    sweeper = Ownership(
        db,
        owner=owner("sweeper"),
        journal=journal,
        clock=clock,
        settings=settings,
        liveness=SameHostPidProbe(),
    )
    sweep = StaleSweep(sweeper)
    probed_at: dict[str, list[int]] = {r: [] for r in ids}
    ticks = []
    for _ in range(10):
        tick = sweep.tick()
        ticks.append(tick)
        for run_id, decision in tick.probed:
            assert isinstance(decision, StealRefusedOwnerAlive) and decision.evidence == "probe"
            probed_at[run_id].append(tick.tick)
        clock.advance(1)
    assert [r for r, _ in ticks[0].probed] == ids[:64]
    assert [r for r, _ in ticks[1].probed] == [ids[64]] and ticks[1].deferred == tuple(ids[:64])
    # Backoff per consecutive refusal against the same lease: 2 ticks, then 4, then 8...
    assert probed_at[ids[0]] == [1, 4, 9]
    assert probed_at[ids[64]] == [2, 5, 10]
    # One refusal record per (run, owner, lease, evidence), however many passes probed it.
    for run_id in ids:
        records = [e for e in journal.read(run_id) if e.type == "steal-refused-owner-alive"]
        assert len(records) == 1 and records[0].payload["evidence"] == "probe"


def test_stale_sweep_forgets_a_deferral_when_the_row_leaves_the_stale_window(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    (run_id,) = _stale_rows(db, runs, clock, 1, OwnerId("host-a", os.getpid(), "live"))
    sweeper = Ownership(
        db,
        owner=owner("sweeper"),
        journal=journal,
        clock=clock,
        settings=settings,
        liveness=SameHostPidProbe(),
    )
    sweep = StaleSweep(sweeper)
    assert len(sweep.tick().probed) == 1 and sweep.deferred_runs == {run_id}
    # The owner pulses again (fresh lease) and then stalls under that new lease.
    db.write(lambda c: c.execute(sa.update(runs_table).values(heartbeat_at_ms=clock.now_ms())))
    assert sweep.tick().probed == () and sweep.deferred_runs == frozenset()
    clock.advance(settings.stale_after_s + 1)
    third = sweep.tick()
    assert [r for r, _ in third.probed] == [run_id]  # probed on the first tick that sees the new stall
    assert len([e for e in journal.read(run_id) if e.type == "steal-refused-owner-alive"]) == 2


def test_stale_sweep_steals_runs_of_dead_owners(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ids = _stale_rows(db, runs, clock, 3, OwnerId("host-a", dead.pid, "gone"))
    sweeper = Ownership(
        db,
        owner=owner("sweeper"),
        journal=journal,
        clock=clock,
        settings=settings,
        liveness=SameHostPidProbe(),
    )
    tick = StaleSweep(sweeper).tick()
    assert [(r, type(d).__name__) for r, d in tick.probed] == [(r, "Activated") for r in ids]
    assert all(isinstance(d, Activated) and d.evidence == "same-host-pid-dead" for _, d in tick.probed)
