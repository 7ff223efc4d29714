"""The run lease's contract on a real database: it claims through the arbiter once, refuses a second holder while
fresh, keeps the run by heartbeating, interrupts itself when the lease is lost or a cancel is requested, concludes
exactly once, and each policy picks the run it is documented to pick."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from smthrs_plugin._clock import ManualClock
from smthrs_plugin._metrics import ClaimDecision as ClaimTag
from smthrs_plugin._metrics import NullMetrics
from smthrs_plugin.engine.context import RunCancelled
from smthrs_plugin.engine.lease import (
    EXISTING,
    FRESH,
    NAMED,
    RETRY_SUFFIX,
    DriveLost,
    DriveSettled,
    FlowCompleted,
    LeasePolicy,
    Refused,
    RunLease,
    acquire,
    chain_on_failure,
)
from smthrs_plugin.engine.ownership.arbiter import HeartbeatFresh, Ownership, Terminal
from smthrs_plugin.errors import StoreError
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database

Acquire = Callable[..., RunLease | Refused]


class _CountedClaims(NullMetrics):
    def __init__(self) -> None:
        self.tags: list[ClaimTag] = []

    def claim_decision(self, tag: ClaimTag) -> None:
        self.tags.append(tag)


@pytest.fixture
def waits(db: Database, journal: Journal, runs: RunStore, clock: ManualClock) -> WaitStore:
    return WaitStore(db, journal=journal, runs_store=runs, clock=clock)


def _ownership(db: Database, journal: Journal, clock: ManualClock, settings: Settings, tag: str) -> Ownership:
    return Ownership(
        db, owner=OwnerId("host-a", 4242, f"nonce-{tag}"), journal=journal, clock=clock, settings=settings
    )


@pytest.fixture
def lease_as(
    db: Database, journal: Journal, clock: ManualClock, settings: Settings, runs: RunStore, waits: WaitStore
) -> Callable[[str], Acquire]:
    """``lease_as("a")(run_id, flow, policy, **kw)``: acquire as owner ``a`` over this test's stores."""

    def as_owner(tag: str) -> Acquire:
        own = _ownership(db, journal, clock, settings, tag)

        def take(run_id: str, flow: str, policy: LeasePolicy, **kw: object) -> RunLease | Refused:
            return acquire(run_id, flow, policy, ownership=own, runs=runs, waits=waits, **kw)  # type: ignore[arg-type]

        return take

    return as_owner


def _held(out: RunLease | Refused) -> RunLease:
    assert isinstance(out, RunLease), out
    return out


def _heartbeat_threads(run_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"smthrs-heartbeat-{run_id}"]


def test_lease_claims_the_run_once_and_refuses_a_second_holder_while_fresh(
    lease_as: Callable[[str], Acquire], runs: RunStore
) -> None:
    with _held(lease_as("a")("r", "flow", NAMED)) as lease:
        rec = runs.get("r")
        assert rec is not None and rec.status == "running" and rec.owner == lease.ownership.owner
        second = lease_as("b")("r", "flow", NAMED)
        assert isinstance(second, Refused) and isinstance(second.decision, HeartbeatFresh)
        assert second.run_id == "r" and not second.exhausted
        lease.conclude(FlowCompleted(1))


def test_heartbeat_keeps_the_lease_past_the_stale_window(
    db: Database, journal: Journal, settings: Settings, waits: WaitStore
) -> None:
    clock = ManualClock(auto_advance=True)  # each heartbeat wait of 1 s advances the clock by 1 s
    runs = RunStore(db, journal=journal, clock=clock)
    a = _ownership(db, journal, clock, settings, "a")
    b = _ownership(db, journal, clock, settings, "b")
    lease = _held(acquire("r", "flow", NAMED, ownership=a, runs=runs, waits=waits))
    claimed_at = clock.now_ms()
    with lease:
        # The beats come as fast as the database commits them; the deadline only guards against a hang.
        deadline = time.monotonic() + 120
        while True:
            rec = runs.get("r")
            assert rec is not None and rec.heartbeat_at_ms is not None
            if rec.heartbeat_at_ms > claimed_at + 40_000:
                break
            if time.monotonic() > deadline:
                pytest.fail("the lease never heartbeat 40 s past its claim")
            threading.Event().wait(0.005)
        assert isinstance(
            b.claim("r"), HeartbeatFresh
        )  # 40 s after the claim, yet fresh: the beat renewed it
        assert lease.conclude(FlowCompleted()) == DriveSettled("r", "completed", "completed")
    assert _heartbeat_threads("r") == []


def test_losing_the_lease_interrupts_the_run_and_concludes_as_lost(
    lease_as: Callable[[str], Acquire], runs: RunStore, clock: ManualClock
) -> None:
    lease = _held(lease_as("a")("r", "flow", NAMED))
    with lease:
        runs.finish("r", lease.ownership.owner, "failed")  # the run is gone from the lease's hands
        # The next beat finds the fence lost. Time is the test's: move it one beat at a time until the lease
        # notices (the first beat may already have run before the finish), within a deadline far above a beat.
        for _ in range(2400):
            if lease.context.interrupt.wait(0.05):
                break
            clock.advance(1.0)
        else:
            pytest.fail("the lease never noticed that its fence was lost")
        assert lease.context.interrupt_reason == "fence_lost"
        out = lease.conclude(FlowCompleted("late"))
    assert isinstance(out, DriveLost) and out.run_id == "r"
    rec = runs.get("r")
    assert rec is not None and rec.status == "failed"  # nothing more was written


def test_a_cancel_request_interrupts_the_run_at_once_and_concludes_cancelled(
    lease_as: Callable[[str], Acquire], runs: RunStore
) -> None:
    with _held(lease_as("a")("r", "flow", NAMED)) as lease:
        assert not lease.cancel_requested
        runs.request_cancel("r")  # committed in this process: seen from the journal, not the next beat
        assert lease.cancel_requested
        out = lease.conclude(error=RunCancelled("r", lease.context.cancel_requested_at_ms))
    assert out == DriveSettled("r", "cancelled", "cancelled")


def test_conclude_settles_exactly_once(
    lease_as: Callable[[str], Acquire], runs: RunStore, journal: Journal
) -> None:
    with _held(lease_as("a")("r", "flow", NAMED)) as lease:
        first = lease.conclude(FlowCompleted({"n": 1}))
        records = journal.read("r", limit=1000)
        again = lease.conclude(error=RuntimeError("a second ending"))
    assert first == again == DriveSettled("r", "completed", "completed") and lease.outcome == first
    assert journal.read("r", limit=1000) == records  # the second call wrote nothing
    rec = runs.get("r")
    assert rec is not None and rec.status == "completed" and rec.result == {"n": 1}


def test_leaving_the_block_stops_the_heartbeat_and_writes_nothing(
    lease_as: Callable[[str], Acquire], runs: RunStore
) -> None:
    with _held(lease_as("a")("r", "flow", NAMED)) as lease:
        assert _heartbeat_threads("r")
    assert _heartbeat_threads("r") == [] and lease.outcome is None
    rec = runs.get("r")
    assert (
        rec is not None and rec.status == "running"
    )  # not concluded: the lease lapses, never a silent settle


def test_existing_policy_claims_a_run_as_it_stands_and_counts_the_decision(
    lease_as: Callable[[str], Acquire], runs: RunStore
) -> None:
    with pytest.raises(StoreError) as missing:
        lease_as("a")("nope", "flow", EXISTING)
    assert missing.value.code == "not_found" and runs.get("nope") is None  # never created
    runs.create("r", "flow")
    counted = _CountedClaims()
    with _held(lease_as("a")("r", "flow", EXISTING, metrics=counted)) as lease:
        refused = lease_as("b")("r", "flow", EXISTING, metrics=counted)
        lease.conclude(FlowCompleted())
    assert isinstance(refused, Refused)
    assert counted.tags == ["Activated", "HeartbeatFresh"]


def test_named_policy_refuses_a_settled_run(lease_as: Callable[[str], Acquire]) -> None:
    with _held(lease_as("a")("r", "flow", NAMED)) as lease:
        lease.conclude(FlowCompleted())
    refused = lease_as("b")("r", "flow", NAMED)
    assert isinstance(refused, Refused) and refused.decision == Terminal("r", "completed")


def test_fresh_policy_creates_and_claims_the_id_it_is_given(
    lease_as: Callable[[str], Acquire], runs: RunStore
) -> None:
    with _held(lease_as("a")("step-1", "flow", FRESH)) as lease:
        assert lease.run_id == "step-1" and lease.displaced is None
        lease.settle("completed")
    rec = runs.get("step-1")
    assert rec is not None and rec.status == "completed" and rec.flow == "flow"


def test_a_run_the_lease_creates_is_created_and_activated_in_one_transaction(
    lease_as: Callable[[str], Acquire], runs: RunStore, journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Activation refused after the creation was written: nothing of the run may remain, no pending row another
    # claimant could pick up and no ``run-created`` record without its activation.
    def refuse(self: Ownership, run_id: str, reserved: object) -> None:
        raise StoreError("store_failed", "activation refused by the test")

    monkeypatch.setattr(Ownership, "_activate_write", refuse)
    with pytest.raises(StoreError, match="activation refused"):
        lease_as("a")("fresh-1", "flow", FRESH)
    assert runs.get("fresh-1") is None
    assert journal.read("fresh-1") == []
    monkeypatch.undo()
    with _held(lease_as("a")("fresh-1", "flow", FRESH)) as lease:
        types = [e.type for e in journal.read("fresh-1")]
        assert types[:2] == ["run-created", "run-activated"]
        lease.settle("completed")


def test_retry_suffix_policy_moves_to_a_fresh_suffix_when_the_run_is_held(
    lease_as: Callable[[str], Acquire], runs: RunStore
) -> None:
    with _held(lease_as("a")("prefect-x", "flow", RETRY_SUFFIX)) as held:
        assert held.run_id == "prefect-x" and held.displaced is None
        with _held(lease_as("b")("prefect-x", "flow", RETRY_SUFFIX)) as moved:
            assert moved.run_id.startswith("prefect-x-") and len(moved.run_id) == len("prefect-x-") + 8
            assert moved.displaced is not None and moved.displaced.run_id == "prefect-x"
            assert isinstance(moved.displaced.decision, HeartbeatFresh)
            moved.conclude(FlowCompleted())
        held.conclude(FlowCompleted())
    rec = runs.get(moved.run_id)
    assert rec is not None and rec.flow == "flow" and rec.status == "completed"


def test_chain_on_failure_policy_moves_past_failed_runs_and_stops_at_any_other_refusal(
    lease_as: Callable[[str], Acquire],
) -> None:
    take = lease_as("a")
    with _held(take("d", "flow", chain_on_failure())) as first:
        assert first.run_id == "d"
        first.conclude(error=RuntimeError("boom"))  # failed: the next execution is a retry
    with _held(take("d", "flow", chain_on_failure())) as second:
        assert second.run_id == "d-2"
        held_elsewhere = lease_as("b")("d", "flow", chain_on_failure())
        assert isinstance(held_elsewhere, Refused) and held_elsewhere.run_id == "d-2"
        assert isinstance(held_elsewhere.decision, HeartbeatFresh) and not held_elsewhere.exhausted
        second.conclude(FlowCompleted())
    settled = take("d", "flow", chain_on_failure())
    assert settled == Refused("d-2", Terminal("d-2", "completed"))


def test_chain_on_failure_policy_is_exhausted_when_every_run_failed(
    lease_as: Callable[[str], Acquire],
) -> None:
    take = lease_as("a")
    for expected in ("d", "d-2"):
        with _held(take("d", "flow", chain_on_failure(2))) as lease:
            assert lease.run_id == expected
            lease.conclude(error=RuntimeError("boom"))
    assert take("d", "flow", chain_on_failure(2)) == Refused("d-2", Terminal("d-2", "failed"), exhausted=True)


@pytest.mark.parametrize("limit", [0, -1, True, 1.5])
def test_a_chain_limit_must_be_a_positive_int(limit: object) -> None:
    with pytest.raises(StoreError) as err:
        LeasePolicy("chain_on_failure", limit)  # type: ignore[arg-type]
    assert err.value.code == "invalid_argument"
