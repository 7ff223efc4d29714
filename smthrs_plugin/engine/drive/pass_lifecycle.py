"""The lifecycle of a scheduler pass that drives its own run (the scheduler's ``RunLifecycle`` seam), on a run
lease: create → claim → heartbeat → settle.

Invariants:

- :meth:`PassLifecycle.enter` creates the run if needed and claims it (``NAMED`` lease: stealing it from a dead
  owner on liveness evidence only); a settled run is refused with ``SchedulerError(invalid_plan)``, one held by
  another owner with ``FenceLost``. Between enter and exit the lease heartbeats (doubling as the cancellation poll)
  and its run context — what a timer node or ``sp.sleep`` in a node reads — is current on the pass's thread.
- :meth:`PassLifecycle.exit` ends the run in one transition: ``completed`` (every node built, clean or deferred)
  or ``failed`` from the report; ``failed`` for a scheduler failure; a park (``RunParked``: a timer node beyond
  the wait budget, at its stored deadline), ``cancelled`` (``RunCancelled``) or a release (``RunReleased``, a
  passing fault of the environment) through the lease's own mapping; a release ``refused`` for an input the run
  refuses (``invalid_plan``) or ``interrupted`` for anything else, so ``--run-id`` resumes it; nothing after
  ``FenceLost`` (another owner holds the run).
- Kept apart from :class:`~.driver.RunDriver`: a pass is entered and exited by a scheduler on its caller's thread
  and answers with a report or a typed scheduler error, never a ``DriveOutcome``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any, Protocol

from ...errors import FenceLost, SchedulerError, passing_fault
from ...plan import Plan
from ...records.runs import RunStore
from ...records.waits import WaitStore
from ..context import RunCancelled, RunParked, RunReleased
from ..lease import NAMED, Refused, RunLease, acquire
from ..ownership.arbiter import Ownership, Terminal

__all__ = ["PassLifecycle", "PassReport"]


class PassReport(Protocol):
    """What the lifecycle reads of a scheduler's report (``scheduler.Report``)."""

    @property
    def plan_id(self) -> str: ...

    @property
    def digest(self) -> str: ...

    @property
    def failed(self) -> Any: ...

    @property
    def outcomes(self) -> Mapping[str, Any]: ...


class PassLifecycle:
    """Create → claim → heartbeat → settle for scheduler passes over one runtime's stores (see the module
    invariants). Thread-safe per run id: each pass enters and exits its own run."""

    def __init__(self, runs: RunStore, ownership: Ownership, waits: WaitStore) -> None:
        self.runs = runs
        self.ownership = ownership
        self.waits = waits
        self._active: dict[str, tuple[RunLease, ExitStack]] = {}

    def enter(self, run_id: str, plan: Plan) -> None:
        """Create and claim ``run_id`` and make its run context current on this thread."""
        claimed = acquire(
            run_id, plan.flow, NAMED, ownership=self.ownership, runs=self.runs, waits=self.waits
        )
        if isinstance(claimed, Refused):
            decision = claimed.decision
            if isinstance(decision, Terminal):
                raise SchedulerError(
                    "invalid_plan",
                    f"run {run_id!r} already settled ({decision.status}); start a new run id — work it built is "
                    "served from the cache",
                    run_id=run_id,
                )
            raise FenceLost(
                "fence_lost",
                f"run {run_id!r} is held by another owner ({type(decision).__name__}); wait for it to finish, or "
                "for its lease to lapse if it died",
                run_id=run_id,
            )
        scope = ExitStack()
        scope.enter_context(claimed.activated())
        self._active[run_id] = (claimed, scope)

    def exit(self, run_id: str, report: PassReport | None, error: BaseException | None) -> None:
        """End the pass's run in one transition (see the module invariants)."""
        lease, scope = self._active.pop(run_id)
        scope.close()
        lease.stop_heartbeat()
        if isinstance(error, FenceLost):
            return  # another owner holds the run: nothing of ours to write
        if isinstance(error, (RunParked, RunCancelled, RunReleased)) or passing_fault(error) is not None:
            # A timer node beyond the wait budget parks the run at its stored deadline (``error.waiting`` says
            # how); a cancellation settles it ``cancelled``; a shutdown, or a passing fault of the environment (a
            # full disk, the store gone: never the run's failure), releases it.
            lease.conclude(error=error)
            return
        if report is not None:
            status = "failed" if report.failed else "completed"
            # Settling closes the run's pending clocks in the same transaction (and turns a completion racing a
            # cancellation request into ``cancelled``).
            lease.settle(
                status,
                result={"plan_id": report.plan_id, "digest": report.digest, "outcomes": report.outcomes},
            )
        elif isinstance(error, SchedulerError) and error.code != "invalid_plan":
            lease.settle("failed", error=error.to_dict())
        else:
            # A refused input (wrong plan/environment for this run) or an interruption: the run stays resumable.
            lease.release("refused" if isinstance(error, SchedulerError) else "interrupted")
