"""The follow/takeover policy as a library (``smthrs_plugin.control.follow.follow``), without the CLI: the answer
is a tagged value (``Held``, ``Settled``, ``Suspended``), the library prints nothing (progress goes to
``on_wait``), and time moves only through the control plane's manual clock (``auto_advance``: each poll sleeps
exactly ``wait_poll_s``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from _control_support import release_plan

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.control.facade import AdmittedRun, Control
from smthrs_plugin.control.follow import Held, Settled, Suspended, follow
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database

GONE = OwnerId("ctl-host", 999_999, "gone")


@dataclass
class Finishing:
    """Claims the run as the retrying control plane's owner and, once activated, settles it completed (recording
    the clock time and decision of each attempt)."""

    db: Database
    control: Control
    attempts: list[tuple[int, str]] = field(default_factory=list)

    def launch(self, run: AdmittedRun) -> None:
        c = self.control
        own = Ownership(self.db, owner=c.owner, clock=c.clock, settings=c.settings, liveness=c.liveness)
        decision = own.claim(run.run_id)
        self.attempts.append((c.clock.now_ms(), type(decision).__name__))
        if isinstance(decision, Activated):
            RunStore(self.db, clock=c.clock).finish(run.run_id, own.owner, "completed")


def _held_by_gone(db: Database, settings: Settings, clock: ManualClock) -> tuple[Any, str]:
    """A run admitted and activated by an owner that will never heartbeat again."""
    admitter = Control(db, settings=settings, owner=GONE, clock=clock)
    card = admitter.plan(release_plan())
    receipt = admitter.run(card, idempotency_key="k")
    run_id = receipt.run_id  # type: ignore[union-attr]
    assert isinstance(Ownership(db, owner=GONE, clock=clock, settings=settings).claim(run_id), Activated)
    return card, run_id


def test_a_held_run_answers_held_at_once_without_waiting_or_relaunching(
    db: Database, settings: Settings
) -> None:
    clock = ManualClock(auto_advance=True)
    _, run_id = _held_by_gone(db, settings, clock)
    clock.advance(5)
    retry = Control(db, settings=settings, clock=clock)
    relaunched: list[int] = []
    before = clock.now_ms()
    out = follow(retry, run_id, lambda: relaunched.append(1), wait=False)
    assert out == Held(run_id, "running", GONE, 5_000, 25_001)
    assert out.type == "Held"
    assert relaunched == [] and clock.now_ms() == before


def test_an_expired_holder_is_taken_over_via_relaunch_and_the_run_answers_settled(
    db: Database, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = ManualClock(auto_advance=True)
    card, run_id = _held_by_gone(db, settings, clock)
    lease = clock.now_ms()
    retry = Control(db, settings=settings, clock=clock)
    launcher = Finishing(db, retry)
    notes: list[Held] = []
    out = follow(
        retry,
        run_id,
        lambda: retry.run(card, idempotency_key="k", launcher=launcher),
        on_wait=notes.append,
    )
    assert out == Settled(run_id, "completed") and out.type == "Settled"
    assert launcher.attempts == [(lease + 30_001, "Activated")]  # at the lease expiry, not one tick earlier
    # Told when the wait began, then every 10 s of clock time while the lease ran.
    assert [(n.owner, n.age_ms) for n in notes] == [(GONE, 0), (GONE, 10_000), (GONE, 20_000), (GONE, 30_000)]
    assert capsys.readouterr().err == ""  # the library prints nothing; the CLI prints on_wait


def test_a_settled_run_returns_at_once(db: Database, settings: Settings) -> None:
    clock = ManualClock(auto_advance=True)
    _, run_id = _held_by_gone(db, settings, clock)
    RunStore(db, clock=clock).finish(run_id, GONE, "failed")
    retry = Control(db, settings=settings, clock=clock)
    relaunched: list[int] = []
    before = clock.now_ms()
    assert follow(retry, run_id, lambda: relaunched.append(1)) == Settled(run_id, "failed")
    assert relaunched == [] and clock.now_ms() == before


def test_a_parked_run_answers_suspended_with_its_reason(db: Database, settings: Settings) -> None:
    clock = ManualClock(auto_advance=True)
    _, run_id = _held_by_gone(db, settings, clock)
    RunStore(db, clock=clock).suspend(run_id, GONE, "timer", wake_at_ms=clock.now_ms() + 60_000)
    retry = Control(db, settings=settings, clock=clock)
    relaunched: list[int] = []
    out = follow(retry, run_id, lambda: relaunched.append(1))
    assert out == Suspended(run_id, "timer") and out.type == "Suspended"
    assert relaunched == []
