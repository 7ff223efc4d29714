"""The run DAG: parent edges between runs, recorded first-writer-wins with an in-transaction cycle check.

Invariants:

- An edge (child → parent) is recorded at most once (first writer wins; its ``seq`` is the global revision of the
  transaction that recorded it, so edges order oldest first across the database).
- The cycle check runs in the SAME write transaction as the insert: the edge is inserted, then the parent's
  ancestors are walked over the durable edges; reaching the child raises ``RunParentCycleError`` and the whole
  transaction rolls back, leaving no trace. Writes are serialized, so of two concurrent writers whose edges
  jointly close a cycle exactly one fails.
- Recording an edge is a mutation of the child's row (its effective parent may change): the child's revision is
  refreshed and ``run-parent-recorded`` journaled in the child's partition, in the same transaction.

Prior art: the reference's ``recordRunParent`` (seed 004, "The run DAG").
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import RunParentCycleError
from ..stores.database import Database
from ..stores.schema import run_parents
from .fence import update_run
from .journal import Journal

__all__ = ["ParentRecorded", "ParentExisting", "RunEdge", "record_parent", "edges", "cycle_error"]

_IN_CHUNK = 500


@dataclass(frozen=True)
class ParentRecorded:
    child_id: str
    parent_id: str
    seq: int


@dataclass(frozen=True)
class ParentExisting:
    """The edge was already recorded (first writer wins); ``seq`` is the original one."""

    child_id: str
    parent_id: str
    seq: int


@dataclass(frozen=True)
class RunEdge:
    child_id: str
    parent_id: str
    seq: int
    created_at_ms: int


def cycle_error(child_id: str, parent_id: str) -> RunParentCycleError:
    return RunParentCycleError(
        "run_parent_cycle",
        f"recording {parent_id!r} as a parent of {child_id!r} would create a cycle in the run DAG; nothing was "
        "written (a run cannot be its own ancestor)",
        child_id=child_id,
        parent_id=parent_id,
    )


def record_parent(
    conn: Connection, db: Database, journal: Journal, now_ms: int, child_id: str, parent_id: str
) -> ParentRecorded | ParentExisting:
    """Record child → parent on ``conn`` (an open write of ``db``); see module invariants."""
    if child_id == parent_id:
        raise cycle_error(child_id, parent_id)
    e = run_parents.c
    seq = conn.execute(sa.select(e.seq).where(e.child_id == child_id, e.parent_id == parent_id)).scalar()
    if seq is not None:
        return ParentExisting(child_id, parent_id, int(seq))
    rev = db.next_revision(conn)
    conn.execute(
        sa.insert(run_parents).values(child_id=child_id, parent_id=parent_id, seq=rev, created_at_ms=now_ms)
    )
    seen: set[str] = set()
    frontier = {parent_id}
    while frontier:
        if child_id in frontier:
            raise cycle_error(child_id, parent_id)
        seen |= frontier
        nxt: set[str] = set()
        batch = sorted(frontier)
        for i in range(0, len(batch), _IN_CHUNK):
            chunk = batch[i : i + _IN_CHUNK]
            nxt.update(conn.execute(sa.select(e.parent_id).where(e.child_id.in_(chunk))).scalars())
        frontier = nxt - seen
    update_run(conn, child_id, {"revision": rev, "updated_at_ms": now_ms})
    journal.append_in(conn, child_id, "run-parent-recorded", {"parent_id": parent_id, "seq": rev})
    return ParentRecorded(child_id, parent_id, rev)


def edges(conn: Connection, *, child_id: str | None = None, parent_id: str | None = None) -> list[RunEdge]:
    """Edges of a child (or of a parent), oldest first."""
    e = run_parents.c
    if child_id is not None:
        q = sa.select(run_parents).where(e.child_id == child_id).order_by(e.seq, e.parent_id)
    elif parent_id is not None:
        q = sa.select(run_parents).where(e.parent_id == parent_id).order_by(e.seq, e.child_id)
    else:
        raise ValueError("give child_id or parent_id")
    return [RunEdge(r.child_id, r.parent_id, int(r.seq), int(r.created_at_ms)) for r in conn.execute(q).all()]
