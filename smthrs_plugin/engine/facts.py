"""Lifecycle observations ("execution facts"): what a run looked like right after a lifecycle transition.

Invariant: every lifecycle transition of a run (create, activate/resume, park, wake, release, settle) journals its
record in the run's partition IN THE SAME TRANSACTION as the row change, and that record carries ``fact =
{version: 1, observation: {...}}`` read from the row on the transaction's own connection after the change. So
the journal alone replays the semantic run view, and a rolled-back transition leaves no fact behind.

The observation holds the semantic fields only (run id, flow, status, creation/start/finish times, effective
parent, lineage and round, the actual cancellation-request time, the waiting reason/deadline/token digest);
ownership, claims and heartbeats stay operational store state (a heartbeat never produces a fact). A row that
cannot encode a valid observation records ``{version: 1, unavailable: "invalid-observation"}``: the marker never
invents the missing facts.

Prior art: seed 004 "Native lifecycle observations" (``executionFact``), the transactional outbox pattern.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..stores.schema import RUN_STATUSES, runs

__all__ = ["FACT_VERSION", "execution_fact", "observation_of"]

FACT_VERSION = 1

_r = runs.c
#: The columns an execution fact observes (also what a transition RETURNs instead of reading back: fence.py).
OBSERVED_COLUMNS = (
    _r.run_id,
    _r.flow,
    _r.status,
    _r.created_at_ms,
    _r.started_at_ms,
    _r.finished_at_ms,
    _r.parent_run_id,
    _r.lineage_id,
    _r.round_ordinal,
    _r.cancel_requested_at_ms,
    _r.waiting_reason,
    _r.wake_at_ms,
    _r.wait_token_digest,
)
_OBSERVE = sa.select(*OBSERVED_COLUMNS).where(_r.run_id == sa.bindparam("b_run_id"))


class _Invalid(Exception):
    pass


def _int_or_none(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Invalid
    return v


def _str_or_none(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise _Invalid
    return v


def observation_of(row: Any) -> dict[str, Any]:
    """The observation of a run row (raises ``ValueError`` when the row cannot encode one)."""
    try:
        if row.status not in RUN_STATUSES or not isinstance(row.run_id, str) or not isinstance(row.flow, str):
            raise _Invalid
        waiting: dict[str, Any] | None = None
        if row.waiting_reason is not None:
            waiting = {
                "reason": _str_or_none(row.waiting_reason),
                "wake_at_ms": _int_or_none(row.wake_at_ms),
                "token_digest": _str_or_none(row.wait_token_digest),
            }
        return {
            "run_id": row.run_id,
            "flow": row.flow,
            "status": row.status,
            "created_at_ms": _int_or_none(row.created_at_ms),
            "started_at_ms": _int_or_none(row.started_at_ms),
            "finished_at_ms": _int_or_none(row.finished_at_ms),
            "parent_run_id": _str_or_none(row.parent_run_id),
            "lineage_id": _str_or_none(row.lineage_id),
            "round_ordinal": _int_or_none(row.round_ordinal),
            "cancel_requested_at_ms": _int_or_none(row.cancel_requested_at_ms),
            "waiting": waiting,
        }
    except _Invalid as exc:
        raise ValueError(f"run row {getattr(row, 'run_id', '?')!r} cannot encode an observation") from exc


def execution_fact(conn: Connection, run_id: str) -> dict[str, Any]:
    """``{version: 1, observation}`` of ``run_id`` as ``conn`` sees it now (call after the row change, inside the
    transition's transaction); ``{version: 1, unavailable: ...}`` when the row is gone or does not encode."""
    row = conn.execute(_OBSERVE, {"b_run_id": run_id}).first()
    if row is None:
        return {"version": FACT_VERSION, "unavailable": "missing-row"}
    try:
        return {"version": FACT_VERSION, "observation": observation_of(row)}
    except ValueError:
        return {"version": FACT_VERSION, "unavailable": "invalid-observation"}
