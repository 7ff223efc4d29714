"""Launching an admitted run: the launch target, the executor seam, and the run-row transitions the control plane
makes on runs nobody owns (a refused launch, a reclaimed admission, a cancellation of a parked run).

Invariants
- **Admission precedes execution.** The admitting transaction
  leaves the run ``pending`` with a pending *claim* by the admitting process (the claim columns of ``runs``), so a
  live admitter keeps its run: another process's claim is refused until that claim's lease lapses
  (``Ownership``: ``stale_after_s``, exactly, no skew) AND the configured liveness check, consulted only then, does
  not vouch for the admitter (the same-host pid probe refuses for a live admitter pid). :func:`reclaim_in` is that takeover: a compare-and-set on the claim token read when
  judging, journaled ``control.run.reclaimed``.
- **A refused launch** (the launcher raised before any owner activated the run) is recorded by
  :func:`fail_refused_in`: ``failed`` with the error, ``control.run.failed``, only while the row is still
  ``pending`` under no claim or ours — a run another process took over is never marked failed by us. The
  admission receipt is kept: the same key answers ``AlreadyApplied`` for the failed run.
- **A passing fault is never a failure** (``errors.passing_fault``: the store unreachable, a full disk, a lock held
  too long, a read-only store, the artifact store gone). Whenever it struck — before activation (the run is still
  ``pending``: :func:`leave_resumable` gives our claim back, journaled ``launch-fault``, so any process may launch
  it at once) or after (the run driver released it, cause ``fault:<family>/<code>``) — the run is left resumable
  and the launch raises the fault named for the run (:func:`stopped_by_fault`): the same key drives it again
  once the fault is gone, its settled nodes replay. If the store still fails, giving the claim back fails too
  and the claim's lease lapses instead (``stale_after``, like a crashed admitter's).
- **Lifecycle facts.** Every ``control.run.*`` lifecycle entry written here carries ``{factVersion: 1, baseline,
  run}`` (``engine.facts.append_control_lifecycle_in``), ``run`` read after the row change in its transaction.
- **No table here.** The run-row statements (:class:`RunRow` and its read, the claim compare-and-set) are the
  runs owner's (``records._runs``), closing a settled run's clocks is the waits owner's; this module judges.
- **Cancelling an unowned run** (``pending`` or ``suspended``) settles it ``cancelled`` at once
  (:func:`cancel_unowned_in`), conditioned on that status inside the transaction; an activation racing it reads
  a terminal row and stops. A running run only gets the request: its owner observes it at its next heartbeat.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.engine import Connection

from .._control_cards import Envelope, PlanCard
from ..canonical import canonical_bytes
from ..engine.drive.active_run import fault_cause
from ..engine.facts import append_control_lifecycle_in
from ..engine.ownership.liveness import Dead, LivenessCheck, LivenessContext
from ..errors import SmthrsError
from ..plan import Plan
from ..records.control import AdmissionRow
from ..records.journal import Journal
from ..records.runs import (
    CLEAR_CLAIM,
    CLEAR_OWNER,
    CLEAR_WAIT,
    OwnerId,
    RunRow,
    bump_run,
    clear_claim_if_in,
    execution_fact,
    run_row_in,
)
from ..records.waits import WaitStore
from ..stores.database import Database
from .identity import JSON, check_text

__all__ = [
    "Launch",
    "AdmittedRun",
    "Launcher",
    "RunRow",
    "run_row_in",
    "reclaim_in",
    "fail_refused_in",
    "cancel_unowned_in",
    "claim_holder",
    "judge_claim",
    "leave_resumable",
    "stopped_by_fault",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launch:
    """What ``run`` launches: a plan card by id, pinned by the digest and envelope the caller reviewed."""

    plan_id: str
    digest: str
    envelope: Envelope

    def __post_init__(self) -> None:
        check_text(self.plan_id, "plan_card", "the plan id")
        check_text(self.digest, "plan_card", "the card digest")
        if type(self.envelope) is not Envelope:
            object.__setattr__(self, "envelope", Envelope.from_json(self.envelope))

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def of(cls, card: PlanCard) -> Launch:
        """The launch of exactly this card."""
        return cls(card.plan_id, card.digest, card.envelope)

    def fingerprint_body(self) -> dict[str, JSON]:
        """What a run's fingerprint covers: the reviewed content (digest + envelope), not the card id — a re-plan
        of identical content (after a spent ``once`` grant) is the same intent."""
        return {"launch": {"digest": self.digest, "envelope": self.envelope.to_json()}}


@dataclass(frozen=True)
class AdmittedRun:
    """An admitted run handed to a launcher: its id, the card it was admitted under, the compiled plan that card
    pins (from the plan store), and its approval facts."""

    run_id: str
    card: PlanCard
    plan: Plan
    admission: AdmissionRow


class Launcher(Protocol):
    """The executor seam: take an admitted run and drive it (claim, heartbeat, run the plan, park or settle).

    Raising before the run was activated is a *refused launch*: the control plane records the run ``failed`` and
    keeps its receipt. Whatever happens after activation is the run's own lifecycle."""

    def launch(self, run: AdmittedRun) -> Any: ...


def claim_holder(owner: OwnerId, token: str, now_ms: int) -> dict[str, Any]:
    """Run-row values of a pending claim held by ``owner`` (written by the admitting transaction)."""
    return {
        "claim_host": owner.host_id,
        "claim_pid": owner.pid,
        "claim_nonce": owner.nonce,
        "claim_token": token,
        "claimed_at_ms": now_ms,
        "updated_at_ms": now_ms,
    }


def judge_claim(
    row: RunRow,
    me: OwnerId,
    liveness: LivenessCheck,
    *,
    now_ms: int,
    stale_after_ms: int,
    skew_allowance_ms: int,
) -> str | None:
    """Evidence that a FOREIGN pending claim on ``row`` may be taken over (``lease-expired``,
    ``same-host-pid-dead`` ...), or None when the claimant may still be alive (or there is no foreign claim)."""
    if row.status != "pending" or row.claim is None or row.claim == me or row.claimed_at_ms is None:
        return None
    ctx = LivenessContext(
        claimant=me,
        heartbeat_at_ms=row.claimed_at_ms,
        now_ms=now_ms,
        stale_after_ms=stale_after_ms,
        skew_allowance_ms=skew_allowance_ms,
    )
    if not ctx.lease_expired:
        return None  # liveness is consulted only once the claim's lease (30 s, no skew) expired
    verdict = liveness.check(row.claim, ctx)
    return verdict.evidence if isinstance(verdict, Dead) else None


def reclaim_in(
    conn: Connection, db: Database, journal: Journal, judged: RunRow, evidence: str, now_ms: int
) -> bool:
    """Clear the foreign pending claim ``judged`` carried (compare-and-set on its token); False when it changed."""
    if not clear_claim_if_in(conn, judged.run_id, judged.claim_token):
        return False
    bump_run(conn, db, judged.run_id, {"updated_at_ms": now_ms})
    assert judged.claim is not None
    append_control_lifecycle_in(
        conn,
        journal,
        judged.run_id,
        "control.run.reclaimed",
        {"from": judged.claim.to_json(), "evidence": evidence},
    )
    return True


def _settle_unowned(
    conn: Connection, waits: WaitStore, run_id: str, status: str, error: Any, now_ms: int
) -> None:
    db, journal = waits.db, waits.journal
    bump_run(
        conn,
        db,
        run_id,
        {
            **CLEAR_OWNER,
            **CLEAR_CLAIM,
            **CLEAR_WAIT,
            "status": status,
            "finished_at_ms": now_ms,
            "updated_at_ms": now_ms,
            "error_json": canonical_bytes(error).decode("utf-8"),
        },
    )
    waits.complete_run_clocks_in(conn, run_id)
    journal.append_in(conn, run_id, "run-settled", {"status": status, "fact": execution_fact(conn, run_id)})


def fail_refused_in(
    conn: Connection,
    waits: WaitStore,
    run_id: str,
    me: OwnerId,
    error: dict[str, Any],
    now_ms: int,
) -> bool:
    """Record a refused launch (see the module invariants); False when the run is no longer ours to fail."""
    row = run_row_in(conn, run_id)
    if row is None or row.status != "pending" or (row.claim is not None and row.claim != me):
        return False
    _settle_unowned(conn, waits, run_id, "failed", {"type": "launch-refused", **error}, now_ms)
    append_control_lifecycle_in(
        conn, waits.journal, run_id, "control.run.failed", {"reason": "launch-refused", "error": error}
    )
    return True


def cancel_unowned_in(
    conn: Connection, waits: WaitStore, run_id: str, requested_at_ms: int, now_ms: int
) -> bool:
    """Settle a ``pending``/``suspended`` run ``cancelled`` (nobody owns it); False for any other status."""
    row = run_row_in(conn, run_id)
    if row is None or row.status not in ("pending", "suspended"):
        return False
    _settle_unowned(
        conn, waits, run_id, "cancelled", {"type": "cancelled", "cancel_requested_at_ms": requested_at_ms},
        now_ms,
    )  # fmt: skip
    append_control_lifecycle_in(
        conn, waits.journal, run_id, "control.run.cancelled", {"from_status": row.status}
    )
    return True


def stopped_by_fault(run_id: str, error: BaseException, fault: SmthrsError) -> SmthrsError:
    """The error a launch stopped by passing ``fault`` raises: the fault's own family and code (so the CLI exits
    75 and a script can branch on what it is), a message naming the run, the fault and what to do; ``cause`` the
    error the launch raised."""
    return type(fault)(
        fault.code,
        f"run {run_id} was stopped by a passing fault of the environment, not by its own work: {fault.message}. "
        "The run is left resumable, not failed: repeat the same request with the same idempotency key (--key) "
        "once the fault is gone — its settled nodes replay",
        cause=error,
        run_id=run_id,
    )


def leave_resumable(
    waits: WaitStore, run_id: str, me: OwnerId, error: BaseException, fault: SmthrsError, now_ms: int
) -> SmthrsError:
    """A launch of ``run_id`` raised ``error``, a passing ``fault``: give back our pending claim (when the run was
    never activated) and return :func:`stopped_by_fault` for the caller to raise (see the module invariants)."""
    db, journal = waits.db, waits.journal

    def fn(conn: Connection) -> None:
        row = run_row_in(conn, run_id)
        if row is None or row.status != "pending" or row.claim != me:
            return  # activated (the run driver released it) or taken over: nothing of ours to give back
        if clear_claim_if_in(conn, run_id, row.claim_token):
            bump_run(conn, db, run_id, {"updated_at_ms": now_ms})
            journal.append_in(
                conn,
                run_id,
                "launch-fault",
                {"cause": fault_cause(fault), "owner": me.to_json(), "message": fault.message},
            )

    try:
        db.write(fn)
    except SmthrsError as exc:
        # The store still fails: our claim stays until its lease lapses. The fault the caller raises says what
        # happened; this is the reason the next attempt may wait for that lease.
        log.warning("could not give back the claim on run %r after a passing fault: %s", run_id, exc)
    return stopped_by_fault(run_id, error, fault)
