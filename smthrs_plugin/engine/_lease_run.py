"""What a held lease is while its run's code executes (``lease.py`` composes it): heartbeat + cancellation poll,
the run context, and the ONE durable transition that ends the drive (settle, park, or release).

Invariants:

- Between activation and its end, the run's lease is renewed every heartbeat interval by a
  :class:`~.ownership.heartbeat.Heartbeater` whose beat doubles as the cancellation poll: the first beat that sees
  ``cancel_requested_at_ms`` interrupts the run's context (``cancelled``), so a waiting flow is interrupted
  within one poll (a request committed in this same process is seen at once, from the journal's post-commit
  publication). A lost fence or a heartbeat failing past its deadline interrupts it too.
- :meth:`ActiveRun.conclude` maps what the code did to exactly one durable transition, after stopping the
  heartbeat: a value / :class:`FlowCompleted` → ``completed``; an ``Exception`` / :class:`FlowFailed` →
  ``failed`` — except a *passing fault of the environment* (``errors.passing_fault``: the store unreachable, a
  full disk, a lock held too long, a read-only store, the artifact store gone), which is no failure of the run:
  it releases the run (cause ``fault:<family>/<code>``, e.g. ``fault:store/disk_full``), so the same request
  drives it again once the fault is gone; :class:`~.context.RunParked` / :class:`FlowParked` → park (``timer``
  with the earliest pending deadline, else ``event``); :class:`~.context.RunCancelled` → ``cancelled``;
  :class:`~.context.RunReleased` or any other ``BaseException`` (shutdown, ``KeyboardInterrupt``) → release
  (``suspended``/``released`` with its cause: never a cancellation); ``FenceLost`` → nothing (another owner holds
  the run). Terminal transitions close the run's pending clocks in the same transaction, and ``RunStore.finish``
  turns a completion racing a cancellation request into ``cancelled``.
- The outcome is a small frozen union (:data:`DriveOutcome`), never a boolean.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.engine import Connection

from ..errors import FenceLost, SmthrsError, StoreError, passing_fault
from ..records.journal import JournalEvent
from ..records.runs import Cancelled, RunStore, Settled
from ..records.wait_rows import Wait
from ..records.waits import WaitStore
from .context import RunCancelled, RunContext, RunParked, RunReleased, activate
from .facts import control_settled_in
from .ownership.arbiter import Activated, ClaimDecision, Ownership
from .ownership.heartbeat import Heartbeater, Interrupt

__all__ = [
    "ActiveRun",
    "FlowCompleted",
    "FlowFailed",
    "FlowParked",
    "FlowOutcome",
    "DriveSettled",
    "DriveParked",
    "DriveReleased",
    "DriveLost",
    "DriveNotClaimed",
    "DriveUnregistered",
    "DriveOutcome",
    "error_json",
    "fault_cause",
]

log = logging.getLogger(__name__)


# -- what a flow may return (anything else is a completion value) ------------------------------------------------
@dataclass(frozen=True)
class FlowCompleted:
    """The flow finished with ``value`` (plain JSON)."""

    value: Any = None


@dataclass(frozen=True)
class FlowFailed:
    """The flow failed; ``error`` (plain JSON) is stored on the run."""

    error: Any


@dataclass(frozen=True)
class FlowParked:
    """The flow asks to be parked (``auto``: timer if it has a pending clock, else event; or ``quarantine``)."""

    reason: Literal["auto", "event", "quarantine"] = "auto"
    token: str | None = None


FlowOutcome = FlowCompleted | FlowFailed | FlowParked


# -- how a drive ended ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DriveSettled:
    """The run settled ``status``; ``requested_status`` differs when a cancellation request won the race."""

    run_id: str
    status: str
    requested_status: str


@dataclass(frozen=True)
class DriveParked:
    run_id: str
    wait: Wait


@dataclass(frozen=True)
class DriveReleased:
    run_id: str
    cause: str


@dataclass(frozen=True)
class DriveLost:
    """Another owner took the run over mid-drive (its writes were refused); nothing more was written."""

    run_id: str
    reason: str


@dataclass(frozen=True)
class DriveNotClaimed:
    """The claim did not activate (``decision`` says why: terminal, held by a live owner, claim lost...)."""

    run_id: str
    decision: ClaimDecision


@dataclass(frozen=True)
class DriveUnregistered:
    """This process has no code for the run's flow; the run was left (or put back) parked."""

    run_id: str
    flow: str


DriveOutcome = DriveSettled | DriveParked | DriveReleased | DriveLost | DriveNotClaimed | DriveUnregistered


def fault_cause(fault: SmthrsError) -> str:
    """The release cause recorded for a run a passing fault stopped (``fault:store/disk_full``)."""
    return f"fault:{fault.family}/{fault.code}"


def error_json(exc: BaseException) -> dict[str, Any]:
    """The plain-JSON error stored on a failed run."""
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, SmthrsError):
        out.update(code=exc.code, message=exc.message)
    return out


class ActiveRun:
    """The lifetime of one activation (see the module invariants). Not reusable."""

    def __init__(
        self,
        activated: Activated,
        flow: str,
        *,
        ownership: Ownership,
        runs: RunStore,
        waits: WaitStore,
        context: RunContext | None = None,
        budget_s: float | None = None,
        poll_s: float | None = None,
        bus: Any = None,
    ) -> None:
        self.run_id = activated.run_id
        self.flow = flow
        self.ownership = ownership
        self.runs = runs
        self.waits = waits
        self.db = runs.db
        settings = ownership.settings
        if context is None:
            kwargs: dict[str, Any] = {}
            if bus is not None:
                kwargs["bus"] = bus
            context = RunContext(
                run_id=self.run_id,
                flow=flow,
                owner=ownership.owner,
                waits=waits,
                clock=ownership.clock,
                budget_s=settings.wait_budget_s if budget_s is None else budget_s,
                poll_s=settings.wait_poll_s if poll_s is None else poll_s,
                **kwargs,
            )
        self.context = context
        if activated.cancel_requested_at_ms is not None:
            context.interrupt_with("cancelled", at_ms=activated.cancel_requested_at_ms)
        # A request committed by THIS process is seen at once (journal records publish after commit); one from
        # another process at the next heartbeat.
        self._sub = runs.journal.subscribe(
            self._on_record, partition=self.run_id, types=("run-cancel-requested",)
        )
        # The activation just wrote the lease (``heartbeat_at_ms``) and read the cancel request: the first beat
        # waits one interval, like every later one, rather than writing the same lease again at once (a commit
        # on another thread, contending with the caller's first writes, for every run a process binds).
        self._beat = Heartbeater(
            ownership,
            self.run_id,
            on_interrupt=self._on_interrupt,
            on_cancel=self._on_cancel,
            first_beat_after_s=ownership.settings.heartbeat_interval_s,
        ).start()

    # -- heartbeat / journal callbacks (other threads) -------------------------------------------------------
    def _on_record(self, event: JournalEvent) -> None:
        if event.type == "run-cancel-requested" and isinstance(event.payload, dict):
            at = event.payload.get("requested_at_ms")
            self.context.interrupt_with("cancelled", at_ms=at if isinstance(at, int) else None)

    def _on_cancel(self, at_ms: int) -> None:
        self.context.interrupt_with("cancelled", at_ms=at_ms)

    def _on_interrupt(self, interrupt: Interrupt) -> None:
        reason: Literal["fence_lost", "heartbeat_failing"] = (
            "fence_lost" if interrupt.reason == "fence_lost" else "heartbeat_failing"
        )
        self.context.interrupt_with(reason, cause=interrupt.cause)

    @contextmanager
    def activated(self) -> Iterator[RunContext]:
        """Make the run's context current on this thread for the ``with`` block."""
        with activate(self.context):
            yield self.context

    @property
    def cancel_requested(self) -> bool:
        return self.context.interrupt_reason == "cancelled"

    def stop_heartbeat(self) -> None:
        self._sub.close()
        self._beat.stop()

    # -- ending the drive ---------------------------------------------------------------------------------------
    def conclude(self, outcome: Any = None, error: BaseException | None = None) -> DriveOutcome:
        """Write the one transition that ends this drive (see the module invariants)."""
        self.stop_heartbeat()
        try:
            return self._conclude(outcome, error)
        except FenceLost as exc:
            return DriveLost(self.run_id, exc.message)

    def _conclude(self, outcome: Any, error: BaseException | None) -> DriveOutcome:
        reason = self.context.interrupt_reason
        if isinstance(error, FenceLost) or reason == "fence_lost":
            return DriveLost(self.run_id, "another owner holds the run" if error is None else str(error))
        if isinstance(error, RunParked):
            return self.park(token=error.token, parked=error)
        if isinstance(error, RunCancelled):
            return self.settle(
                "cancelled", error={"type": "cancelled", "requested_at_ms": error.requested_at_ms}
            )
        if isinstance(error, RunReleased):
            return self.release(error.cause)
        if reason == "heartbeat_failing":
            return self.release("lease-lapsed")
        fault = passing_fault(error)
        if fault is not None:
            # Never a settled failure: that would burn the request's idempotency key on a passing fault. If the
            # store still fails, this release raises too and the run's lease lapses instead (taken over then).
            return self.release(fault_cause(fault))
        if isinstance(error, Exception):
            return self.settle("failed", error=error_json(error))
        if error is not None:
            # KeyboardInterrupt, SystemExit...: give the run back; an interruption is never a cancellation.
            return self.release("interrupted")
        if isinstance(outcome, FlowParked):
            return self.park(reason=outcome.reason, token=outcome.token)
        if isinstance(outcome, FlowFailed):
            return self.settle("failed", error=outcome.error)
        value = outcome.value if isinstance(outcome, FlowCompleted) else outcome
        return self.settle("completed", result=value)

    def park(
        self,
        *,
        reason: Literal["auto", "event", "quarantine"] = "auto",
        token: str | None = None,
        parked: RunParked | None = None,
    ) -> DriveParked | DriveLost:
        awaiting = parked.name if parked is not None and parked.kind == "event" else None
        # A node approval parks ``waiting-approval`` (control plane): only a decision on its token wakes it.
        how: Literal["auto", "event", "quarantine", "waiting-approval"] = (
            "waiting-approval" if parked is not None and parked.kind == "approval" else reason
        )
        out = self.waits.park(self.run_id, self.ownership.owner, reason=how, token=token, deferred=awaiting)
        if not hasattr(out, "wait"):
            return DriveLost(self.run_id, "the run row vanished before it could be parked")
        if parked is not None:
            parked.waiting = out.wait  # type: ignore[union-attr]
        return DriveParked(self.run_id, out.wait)  # type: ignore[union-attr]

    def settle(self, status: str, *, result: Any = None, error: Any = None) -> DriveSettled:
        """Settle the run ``status`` and close its pending clocks, in one transaction."""
        owner = self.ownership.owner

        def fn(conn: Connection) -> Settled | Cancelled:
            out = self.runs.finish(self.run_id, owner, status, result=result, error=error)
            control_settled_in(conn, self.runs.journal, self.run_id)
            self.waits.complete_run_clocks_in(conn, self.run_id)
            return out

        try:
            out = self.db.write(fn)
        except StoreError as exc:
            if exc.code != "invalid_argument" or status != "completed":
                raise
            # The flow returned something that is not plain JSON: that is the flow's failure, not the store's.
            return self.settle("failed", error=error_json(exc))
        if isinstance(out, Cancelled):
            return DriveSettled(self.run_id, "cancelled", status)
        return DriveSettled(self.run_id, out.status, status)

    def release(self, cause: str) -> DriveReleased:
        self.ownership.release(self.run_id, cause=cause)
        return DriveReleased(self.run_id, cause)
