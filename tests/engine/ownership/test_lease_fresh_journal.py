"""A claim refused because the owner's lease is fresh is journaled — ``steal-refused-owner-alive {owner, lease,
evidence: "lease-fresh"}`` — once per run and owner, never once per retry; and the lease boundary is the reference
engine's: ``heartbeat_at >= now - 30,000 ms`` is fresh, so 30,000 ms of age is fresh and 30,001 ms is expired (the
same for a pending claim, the liveness context and the stale sweep). Time moves only through a ManualClock."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from _store_support import owner, ownership

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.engine.ownership import LeaseLiveness, LivenessContext, StaleSweep
from smthrs_plugin.engine.ownership.arbiter import Activated, ClaimLost, HeartbeatFresh
from smthrs_plugin.engine.ownership.liveness import Alive, Dead
from smthrs_plugin.records.journal import Journal, high_water
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database
from smthrs_plugin.stores.schema import runs as runs_table

_REFUSED = "steal-refused-owner-alive"


def _refusals(journal: Journal, run_id: str) -> list[dict[str, Any]]:
    return [e.payload for e in journal.read(run_id, limit=1000) if e.type == _REFUSED]


def test_a_claim_refused_by_a_fresh_lease_is_journaled_once_naming_the_owner_and_the_lease(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    runs.create("r", "flow")
    assert isinstance(a.claim("r"), Activated)
    first_lease = clock.now_ms()
    # A waiting claimer retries every second while the owner keeps renewing its lease.
    for _ in range(5):
        clock.advance(1)
        refused = b.claim("r")
        assert isinstance(refused, HeartbeatFresh) and refused.owner == a.owner
        a.heartbeat("r")
    assert _refusals(journal, "r") == [
        {"owner": a.owner.to_json(), "lease": first_lease, "evidence": "lease-fresh"}
    ]


def test_a_repeated_lease_fresh_refusal_writes_nothing(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    c = ownership(db, journal, clock, settings, "c")
    runs.create("r", "flow")
    a.claim("r")
    assert isinstance(b.claim("r"), HeartbeatFresh)
    mark = high_water(db, "r")
    revision = db.revision()
    for claimant in (b, c, b, c):
        a.heartbeat("r")  # a renewed lease: still the same owner, so still no new record
        mark_rev = db.revision()
        assert isinstance(claimant.claim("r"), HeartbeatFresh)
        assert db.revision() == mark_rev  # the refusal itself changed nothing durable
    assert high_water(db, "r") == mark
    assert db.revision() > revision  # (the heartbeats did write)
    assert len(_refusals(journal, "r")) == 1


def test_a_new_owner_of_the_run_is_named_by_a_record_of_its_own(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    c = ownership(db, journal, clock, settings, "c")
    runs.create("r", "flow")
    a.claim("r")
    assert isinstance(b.claim("r"), HeartbeatFresh)
    clock.advance(settings.stale_after_s + 0.001)  # a stopped heartbeating: its lease expired
    stolen = c.claim("r")
    assert isinstance(stolen, Activated) and stolen.evidence == "lease-expired"
    assert isinstance(b.claim("r"), HeartbeatFresh)  # c's lease is fresh
    assert [(r["owner"], r["evidence"]) for r in _refusals(journal, "r")] == [
        (a.owner.to_json(), "lease-fresh"),
        (c.owner.to_json(), "lease-fresh"),
    ]


def test_the_lease_is_fresh_at_exactly_30_000_ms_of_age_and_expired_at_30_001(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    runs.create("r", "flow")
    a.claim("r")
    lease = clock.now_ms()
    clock.advance(settings.stale_after_s)
    assert clock.now_ms() - lease == 30_000
    assert isinstance(b.claim("r"), HeartbeatFresh)
    clock.advance(0.001)
    stolen = b.claim("r")
    assert (
        isinstance(stolen, Activated) and stolen.evidence == "lease-expired" and stolen.stolen_from == a.owner
    )


def test_the_liveness_context_uses_the_same_boundary() -> None:
    me, them = owner("me"), owner("them", host="elsewhere")

    def ctx(age_ms: int) -> LivenessContext:
        return LivenessContext(me, 1_000_000 - age_ms, 1_000_000, 30_000, 10_000)

    assert not ctx(30_000).lease_expired and ctx(30_001).lease_expired
    assert LeaseLiveness().check(them, ctx(30_000)) == Alive("lease-fresh")
    assert LeaseLiveness().check(them, ctx(30_001)) == Dead("lease-expired")


def test_a_foreign_pending_claim_is_fresh_at_exactly_30_000_ms_and_reclaimable_at_30_001(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    a = ownership(db, journal, clock, settings, "a")
    b = ownership(db, journal, clock, settings, "b")
    runs.create("r", "flow")
    b._reserve_write("r")  # b claimed and died before activating
    clock.advance(settings.stale_after_s)
    lost = a.claim("r")
    assert isinstance(lost, ClaimLost) and lost.claimant == b.owner
    clock.advance(0.001)
    assert isinstance(a.claim("r"), Activated)


def test_the_stale_sweep_probes_a_run_only_once_its_lease_is_past_30_000_ms(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock, settings: Settings
) -> None:
    gone = owner("gone", host="host-z")
    runs.create("r", "flow")
    at = clock.now_ms()
    db.write(
        lambda c: c.execute(
            sa.update(runs_table)
            .where(runs_table.c.run_id == "r")
            .values(
                status="running",
                owner_host=gone.host_id,
                owner_pid=gone.pid,
                owner_nonce=gone.nonce,
                heartbeat_at_ms=at,
            )
        )
    )
    sweep = StaleSweep(ownership(db, journal, clock, settings, "sweeper"))
    clock.advance(settings.stale_after_s)
    assert sweep.tick().probed == ()  # exactly 30,000 ms: a fresh lease, not even looked at
    clock.advance(0.001)
    ((run_id, decision),) = sweep.tick().probed
    assert run_id == "r" and isinstance(decision, Activated) and decision.evidence == "lease-expired"
