"""The run DAG's owner: parent edges between runs, recorded first-writer-wins with an in-transaction cycle check.

Invariants:

- Every statement on ``run_parents`` is in this module; readers (the run store, the cancellation cascade, the
  catalog and snapshot projections) get :class:`RunEdge` values or keys from here, and the runs owner's catalog
  query composes the edge conditions built here (:func:`has_no_edge`, :func:`children_select`,
  :func:`first_parent_of`) into its own statement.
- An edge (child → parent) is recorded at most once (first writer wins; its ``seq`` is the global revision of the
  transaction that recorded it, so edges order oldest first across the database).
- The cycle check runs in the SAME write transaction as the insert: the edge is inserted, then the parent's
  ancestors are walked over the durable edges; reaching the child raises ``RunParentCycleError`` and the whole
  transaction rolls back, leaving no trace. Writes are serialized, so of two concurrent writers whose edges
  jointly close a cycle exactly one fails.
- Recording an edge is a mutation of the child's row (its effective parent may change): the child's revision is
  refreshed and ``run-parent-recorded`` journaled in the child's partition, in the same transaction.

Prior art: the reference's ``recordRunParent`` (the run DAG).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from ..errors import RunParentCycleError
from ..stores.database import Database
from ..stores.schema import run_parents
from .journal import Journal
from .run_fence import update_run

__all__ = [
    "ParentRecorded",
    "ParentExisting",
    "RunEdge",
    "record_parent",
    "edges",
    "cycle_error",
    "child_keys_in",
    "first_parents_in",
    "has_no_edge",
    "children_select",
    "first_parent_of",
]

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


# -- projections' reads (the catalog and the snapshots compose these into their own read transaction) -----------


def child_keys_in(
    conn: Connection, parent_id: str, after: tuple[int, str] | None, n: int
) -> list[tuple[int, str]]:
    """``(seq, child_id)`` of the direct children of ``parent_id`` after the key ``after``, in that order, at most
    ``n``."""
    e = run_parents.c
    q = sa.select(e.seq, e.child_id).where(e.parent_id == parent_id)
    if after is not None:
        q = q.where(sa.tuple_(e.seq, e.child_id) > sa.tuple_(sa.literal(after[0]), sa.literal(after[1])))
    rows = conn.execute(q.order_by(e.seq, e.child_id).limit(n)).all()
    return [(int(r.seq), r.child_id) for r in rows]


def first_parents_in(conn: Connection, child_ids: list[str]) -> dict[str, str]:
    """The earliest edge's parent (lowest ``seq``, ties by parent id) of each of ``child_ids`` that has one."""
    out: dict[str, str] = {}
    e = run_parents.c
    for i in range(0, len(child_ids), _IN_CHUNK):
        chunk = child_ids[i : i + _IN_CHUNK]
        q = (
            sa.select(e.child_id, e.parent_id)
            .where(e.child_id.in_(chunk))
            .order_by(e.child_id, e.seq, e.parent_id)
        )
        for row in conn.execute(q):
            out.setdefault(row.child_id, row.parent_id)
    return out


def has_no_edge(child_id: Any) -> ColumnElement[bool]:
    """SQL condition: no edge names the run id expression ``child_id`` as child (for a filter of another owner)."""
    e = run_parents.c
    return ~sa.exists().where(e.child_id == child_id)


def children_select(parent_id: str) -> sa.Select[Any]:
    """``SELECT child_id`` of the edges naming ``parent_id`` as parent (a candidate set for another owner's query)."""
    e = run_parents.c
    return sa.select(e.child_id).where(e.parent_id == parent_id)


def first_parent_of(child_id: Any) -> Any:
    """Scalar subquery: the earliest edge's parent of the run id expression ``child_id`` (NULL without edges)."""
    e = run_parents.c
    return (
        sa.select(e.parent_id)
        .where(e.child_id == child_id)
        .order_by(e.seq, e.parent_id)
        .limit(1)
        .scalar_subquery()
    )
