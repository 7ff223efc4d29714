"""The retry loop of ``smthrs run --key`` / ``resume`` (``cli/_control_support.follow``), in-process on a manual clock:
a dead owner's run is taken over at EXACTLY the lease expiry (the first millisecond past 30,000 ms of heartbeat
age: exactly 30,000 ms is still fresh), waited for with a progress line; a live owner is reported with who it is (``--no-wait``); a live owner
past its lease (the liveness check vouches) is refused once in the journal and not stolen. Time moves only through
the clock the control plane was given (``auto_advance``: each poll sleeps exactly ``wait_poll_s``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from _control_support import journal_types, release_plan

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.cli.control_support import follow
from smthrs_plugin.control.facade import AdmittedRun, Control
from smthrs_plugin.control.follow import Held
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.engine.ownership.liveness import Alive
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database

GONE = OwnerId("ctl-host", 999_999, "gone")


@dataclass
class Finishing:
    """A launcher that claims the run as this control plane's owner and, when it activates, settles it completed
    (recording the clock time of each attempt)."""

    db: Database
    control: Control
    attempts: list[tuple[int, str]] = field(default_factory=list)

    def launch(self, run: AdmittedRun) -> None:
        own = Ownership(
            self.db,
            owner=self.control.owner,
            clock=self.control.clock,
            settings=self.control.settings,
            liveness=self.control.liveness,
        )
        decision = own.claim(run.run_id)
        self.attempts.append((self.control.clock.now_ms(), type(decision).__name__))
        if isinstance(decision, Activated):
            RunStore(self.db, clock=self.control.clock).finish(run.run_id, own.owner, "completed")


class Vouching:
    def check(self, owner: Any, ctx: Any) -> Alive:
        return Alive("probe")


def _held_by_gone(db: Database, settings: Settings, clock: ManualClock) -> tuple[Any, str]:
    admitter = Control(db, settings=settings, owner=GONE, clock=clock)
    card = admitter.plan(release_plan())
    receipt = admitter.run(card, idempotency_key="k")
    assert receipt.run_id is not None  # type: ignore[union-attr]
    gone = Ownership(db, owner=GONE, clock=clock, settings=settings)
    assert isinstance(gone.claim(receipt.run_id), Activated)  # type: ignore[union-attr]
    return card, receipt.run_id  # type: ignore[union-attr]


def test_a_dead_owner_is_taken_over_at_exactly_30_001_ms_of_lease_age_with_a_progress_line(
    db: Database, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = ManualClock(auto_advance=True)
    card, run_id = _held_by_gone(db, settings, clock)
    lease = clock.now_ms()
    retry = Control(db, settings=settings, clock=clock)
    launcher = Finishing(db, retry)
    again = lambda: retry.run(card, idempotency_key="k", launcher=launcher)  # noqa: E731
    assert follow(retry, run_id, again) is None
    assert launcher.attempts == [(lease + 30_001, "Activated")]  # the first attempt, and not one tick earlier
    assert RunStore(db).get(run_id).status == "completed"  # type: ignore[union-attr]
    steal = [e for e in Journal(db).read(run_id, limit=1000) if e.type == "stolen-and-activated"]
    assert [(e.payload["evidence"], e.payload["lease"]) for e in steal] == [("lease-expired", lease)]
    err = capsys.readouterr().err
    assert f"owned by host 'ctl-host' pid {GONE.pid}" in err and "waiting for the lease to expire" in err


def test_with_no_wait_a_held_run_is_answered_with_its_owner_and_nothing_is_attempted(
    db: Database, settings: Settings
) -> None:
    clock = ManualClock(auto_advance=True)
    card, run_id = _held_by_gone(db, settings, clock)
    clock.advance(12)
    retry = Control(db, settings=settings, clock=clock)
    launcher = Finishing(db, retry)
    held = follow(retry, run_id, lambda: retry.run(card, idempotency_key="k", launcher=launcher), wait=False)
    assert held == Held(run_id, "running", GONE, 12_000, 18_001)
    assert held.to_json() == {
        "host": "ctl-host",
        "pid": 999_999,
        "nonce": "gone",
        "lease_age_ms": 12_000,
        "lease_expires_in_ms": 18_001,
    }
    assert launcher.attempts == []


def test_a_live_owner_past_its_lease_is_refused_once_in_the_journal_and_never_stolen(
    db: Database, settings: Settings
) -> None:
    clock = ManualClock(auto_advance=True)
    card, run_id = _held_by_gone(db, settings, clock)
    clock.advance(settings.stale_after_s + 0.001)
    retry = Control(db, settings=settings, clock=clock, liveness=Vouching())
    launcher = Finishing(db, retry)
    again = lambda: retry.run(card, idempotency_key="k", launcher=launcher)  # noqa: E731
    for _ in range(3):
        held = follow(retry, run_id, again, wait=False)
        assert held is not None and held.expires_in_ms == 0 and held.owner == GONE
    assert {name for _, name in launcher.attempts} == {"StealRefusedOwnerAlive"}
    assert journal_types(db, run_id).count("steal-refused-owner-alive") == 1
    assert RunStore(db).get(run_id).status == "running"  # type: ignore[union-attr]
