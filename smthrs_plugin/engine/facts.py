"""Lifecycle observations ("execution facts"): what a run looked like right after a lifecycle transition.

Invariant: every lifecycle transition of a run (create, activate/resume, park, wake, release, settle) journals its
record in the run's partition IN THE SAME TRANSACTION as the row change, and that record carries ``fact =
{version: 1, baseline, observation: {...}}`` read from the row on the transaction's own connection after the
change. So the journal alone replays the semantic run view, and a rolled-back transition leaves no fact behind.

The execution fact itself (its columns, observation and ``fact_of``) is owned by the runs owner
(``records._runs``; import it from there); this module adds the control plane's lifecycle facts (the admission
state they depend on is read through the control records' owner, ``records._control``).

``baseline`` names where the run's unbroken fact stream starts: ``created`` (its creation fact) or ``legacy`` (a
later complete fact, for a run whose earlier history carries no facts; a fold then claims nothing about the
missing prefix). An execution fact is always ``created``: the only writer of a run row
(``RunStore.create``) journals the creation fact in the row's own transaction, and journal records are never
deleted, so every run's stream provably starts at its creation.

The observation holds the semantic fields only (run id, flow, status, creation/start/finish times, effective
parent, lineage and round, the actual cancellation-request time, the waiting reason/deadline/token digest);
ownership, claims and heartbeats stay operational store state (a heartbeat never produces a fact). A row that
cannot encode a valid observation records ``{version: 1, unavailable: "invalid-observation"}``: the marker never
invents the missing facts (and carries no baseline: it never establishes coverage).

Control lifecycle facts (the control plane's versioned producer contract): the control plane's own run entries
(``control.run.accepted``, ``pending``, ``running``, ``completed``, ``failed``, ``cancelled``, ``cancel-requested``,
``resume``, ``reclaimed``) add ``{factVersion: 1, baseline, run}`` to their payload, committed in the transaction of
the row change they describe. ``run`` is the run's SUMMARY in the control plane's own vocabulary, which differs
from the engine observation above on purpose (a control consumer decodes control names): camelCase members
``runId``, ``flowId``, ``status``, ``createdAt``, ``updatedAt`` (epoch ms), ``planId``/``planDigest`` (the admitted
card) and ``ownerId`` (``host/pid/nonce``, only while an owner holds the run) — each optional member absent when it
does not apply, never null — plus the observation's remaining fields, ``startedAt``, ``finishedAt``,
``parentRunId``, ``lineageId``, ``roundOrdinal``, ``cancelRequestedAt`` and ``waiting`` (``{reason, wakeAtMs,
tokenDigest}`` or null). Its ``status`` is a control status (:data:`SUMMARY_STATUSES`): ``accepted`` (admitted, not
yet driven: the engine's ``pending``), ``running``, ``waiting-approval`` (suspended on a node approval),
``parked`` (suspended on anything else), ``completed``, ``failed``, ``cancelled``. ``control.run.accepted`` starts the
``created`` baseline and is journaled at the fixed address ``(run, ACCEPTED_SOURCE, 0)``; a later lifecycle fact
of a run admitted before that address existed (an older producer) says ``legacy``. The entries the run driver's
transitions cause (``running`` on activation, ``completed``/``failed``/``cancelled`` on settlement) are written
only for a run the control plane admitted (it has a ``control_runs`` row): :func:`control_running_in`,
:func:`control_settled_in`.

Prior art: the reference engine's native lifecycle observations (``executionFact``) and its control plane's
``ControlFacts`` / ``RunSummary``, the transactional outbox pattern.
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
