"""Lifecycle observations ("execution facts"): what a run looked like right after a lifecycle transition.

Invariants
- Every lifecycle transition (create, activate/resume, park, wake, release, settle) journals its record IN THE
  SAME TRANSACTION as the row change, carrying ``fact = {version: 1, baseline, observation}`` read after the
  change on that connection: the journal alone replays the semantic run view.
- The execution fact itself is the runs owner's (``records.runs``: ``fact_of``); this module adds the control
  plane's lifecycle facts, reading admission state through ``records.control``.
- Control run entries (``control.run.*``) add ``{factVersion: 1, baseline, run}``, ``run`` being the control
  plane's camelCase run summary; they are written only for a run the control plane admitted
  (:func:`control_running_in`, :func:`control_settled_in`). The shapes are in docs/rules.md ("Lifecycle facts").
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Connection

from ..errors import StoreError
from ..records.control import ACCEPTED_SOURCE, admission_in, admission_state_in
from ..records.journal import Journal
from ..records.runs import (
    BASELINE_CREATED,
    BASELINE_LEGACY,
    FACT_VERSION,
    observation_of,
    row_in,
    status_in,
)

__all__ = [
    "CONTROL_SETTLED_KINDS",
    "SUMMARY_STATUSES",
    "summary_status",
    "run_summary_in",
    "lifecycle_fact",
    "control_admitted_in",
    "control_baseline_in",
    "append_control_lifecycle_in",
    "control_running_in",
    "control_settled_in",
]

#: The control entry a run's settlement journals, by the status it settled with.
CONTROL_SETTLED_KINDS = {
    "completed": "control.run.completed",
    "failed": "control.run.failed",
    "cancelled": "control.run.cancelled",
}


#: The statuses of a lifecycle fact's run summary (the control plane's names, not the engine's).
SUMMARY_STATUSES = ("accepted", "running", "parked", "waiting-approval", "cancelled", "completed", "failed")
_APPROVAL_REASON = "waiting-approval"


def summary_status(status: str, waiting_reason: str | None) -> str:
    """The control status of an engine run status (see the module docstring); ``ValueError`` for an unknown one."""
    if status == "pending":
        return "accepted"
    if status == "suspended":
        return "waiting-approval" if waiting_reason == _APPROVAL_REASON else "parked"
    if status in ("running", "completed", "failed", "cancelled"):
        return status
    raise ValueError(f"unknown run status {status!r}")


def run_summary_in(conn: Connection, run_id: str) -> dict[str, Any] | None:
    """The run summary of ``run_id`` as ``conn`` sees it now (module docstring), None when the row is gone;
    ``ValueError`` when the row cannot encode one."""
    row = row_in(conn, run_id)
    if row is None:
        return None
    obs = observation_of(row)  # validates every observed column (ValueError)
    if type(row.updated_at_ms) is not int:
        raise ValueError(f"run row {run_id!r} has no valid updated_at_ms")
    summary: dict[str, Any] = {
        "runId": obs["run_id"],
        "flowId": obs["flow"],
        "status": summary_status(obs["status"], row.waiting_reason),
    }
    admission = admission_in(conn, run_id)
    if admission is not None:
        summary["planId"] = admission.plan_id
        summary["planDigest"] = admission.card_digest
    if obs["status"] == "running" and row.owner_host is not None:
        summary["ownerId"] = f"{row.owner_host}/{row.owner_pid}/{row.owner_nonce}"
    waiting = obs["waiting"]
    summary.update(
        {
            "createdAt": obs["created_at_ms"],
            "updatedAt": row.updated_at_ms,
            "startedAt": obs["started_at_ms"],
            "finishedAt": obs["finished_at_ms"],
            "parentRunId": obs["parent_run_id"],
            "lineageId": obs["lineage_id"],
            "roundOrdinal": obs["round_ordinal"],
            "cancelRequestedAt": obs["cancel_requested_at_ms"],
            "waiting": None
            if waiting is None
            else {
                "reason": waiting["reason"],
                "wakeAtMs": waiting["wake_at_ms"],
                "tokenDigest": waiting["token_digest"],
            },
        }
    )
    return summary


# -- control lifecycle facts -----------------------------------------------------------------------------------


def _control_state(conn: Connection, run_id: str) -> tuple[bool, str]:
    # (admitted by the control plane, baseline): one round trip, two primary/unique-key probes.
    admitted, accepted = admission_state_in(conn, run_id)
    return admitted, BASELINE_CREATED if accepted else BASELINE_LEGACY


def control_admitted_in(conn: Connection, run_id: str) -> bool:
    """Whether the control plane admitted ``run_id`` (it has a ``control_runs`` row). Immutable once known: the
    admission commits with the run row's creation and goes only with the row, so a caller may ask before its
    transition's transaction (e.g. to choose a path that can also journal ``control.run.running``)."""
    return _control_state(conn, run_id)[0]


def control_baseline_in(conn: Connection, run_id: str) -> str:
    """The baseline of ``run_id``'s control lifecycle facts: ``created`` when its ``control.run.accepted`` carried
    the v1 fact (journaled at ``(run, ACCEPTED_SOURCE, 0)``), else ``legacy``."""
    return _control_state(conn, run_id)[1]


def lifecycle_fact(conn: Connection, run_id: str, baseline: str) -> dict[str, Any]:
    """``{factVersion: 1, baseline, run}``: what a control lifecycle entry adds to its payload, ``run`` being the
    run's summary (:func:`run_summary_in`) as ``conn`` sees it now (call after the row change, inside its
    transaction). A row that is gone or cannot encode one gives ``{factVersion: 1, unavailable: ...}``: no
    baseline, no invented run."""
    if baseline not in (BASELINE_CREATED, BASELINE_LEGACY):
        raise StoreError(
            "invalid_argument",
            f"baseline must be {BASELINE_CREATED!r} or {BASELINE_LEGACY!r}, got {baseline!r}",
        )
    try:
        summary = run_summary_in(conn, run_id)
    except ValueError:
        return {"factVersion": FACT_VERSION, "unavailable": "invalid-observation"}
    if summary is None:
        return {"factVersion": FACT_VERSION, "unavailable": "missing-row"}
    return {"factVersion": FACT_VERSION, "baseline": baseline, "run": summary}


def append_control_lifecycle_in(
    conn: Connection,
    journal: Journal,
    run_id: str,
    kind: str,
    payload: dict[str, Any] | None = None,
    *,
    baseline: str | None = None,
) -> None:
    """Journal the control lifecycle entry ``kind`` for ``run_id`` on ``conn`` (inside the transaction of the row
    change it describes, after it): ``payload`` plus the lifecycle fact. ``baseline`` None reads it
    (:func:`control_baseline_in`); the admission passes ``created`` and is journaled at its fixed address."""
    if baseline is None:
        baseline = control_baseline_in(conn, run_id)
    body = {**(payload or {}), **lifecycle_fact(conn, run_id, baseline)}
    if kind == "control.run.accepted":
        journal.append_in(conn, run_id, kind, body, source_id=ACCEPTED_SOURCE, source_seq=0)
    else:
        journal.append_in(conn, run_id, kind, body)


def control_running_in(conn: Connection, journal: Journal, run_id: str) -> bool:
    """``control.run.running`` for a control-admitted run the executor just activated: call it in the
    activation's transaction, after the row turned ``running``. False (nothing written) for a run the control
    plane did not admit — its lifecycle has no control entries."""
    admitted, baseline = _control_state(conn, run_id)
    if not admitted:
        return False
    append_control_lifecycle_in(conn, journal, run_id, "control.run.running", baseline=baseline)
    return True


def control_settled_in(conn: Connection, journal: Journal, run_id: str) -> bool:
    """``control.run.completed|failed|cancelled`` (by the status the row now holds) for a control-admitted run
    the run driver just settled: call it in the settlement's transaction, after the row change. False (nothing
    written) for a run the control plane did not admit; ``StoreError(invalid_argument)`` when the row is not
    settled (a caller bug: the entry would claim a settlement that did not happen)."""
    admitted, baseline = _control_state(conn, run_id)
    if not admitted:
        return False
    fact = lifecycle_fact(conn, run_id, baseline)
    # A row whose observation does not encode still has its settlement journaled, without a fact.
    status = fact["run"]["status"] if "run" in fact else status_in(conn, run_id)
    kind = CONTROL_SETTLED_KINDS.get(status) if isinstance(status, str) else None
    if kind is None:
        raise StoreError(
            "invalid_argument",
            f"run {run_id!r} is {status!r}, not settled: call control_settled_in after the settling row change",
        )
    journal.append_in(conn, run_id, kind, {"reason": "launch-settled", **fact})
    return True
