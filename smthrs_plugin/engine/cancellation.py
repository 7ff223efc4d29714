"""Cancelling a run and everything it started, through the DURABLE run DAG.

Invariants:

- ``cancel_run(run_id)`` records a cancellation request on the run and on every live descendant reachable over
  the durable parent edges (``RunStore.run_children``), in ONE write transaction: a crash leaves either all of
  the requests or none, and any process may call it (no in-memory map of children is consulted: the child
  direction of ``run_parents`` is the only instance-independent way to find them). A diamond reaches a run once.
- Requests never invent intent: a repeat, a missing row or a settled run writes nothing (``AlreadyRequested``,
  ``NotFound``, ``AlreadyTerminal``), and settled runs are not walked through (a completed parent's children are
  still reached: the walk follows edges, the write skips the settled run).
- Recording is not observing: the owner of a running run sees the request at its next heartbeat (the
  cancellation poll; an owner in THIS process sees the journal record at commit) and stops at its next wait; a
  parked run is cancelled by a driver's cancel sweep; a terminal write racing the request settles ``cancelled``
  (``RunStore.finish``).

Prior art: the reference's lineage cancellation over the run DAG (descendant and inherited
requests use the same producer).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from ..records.run_dag import edges
from ..records.runs import AlreadyRequested, AlreadyTerminal, CancelRequested, NotFound, RunStore

__all__ = ["CancelReport", "cancel_run"]

CancelOutcome = CancelRequested | AlreadyRequested | AlreadyTerminal | NotFound


@dataclass(frozen=True)
class CancelReport:
    """What ``cancel_run`` did, the root first, then descendants in breadth-first order."""

    root: CancelOutcome
    descendants: tuple[CancelOutcome, ...]

    @property
    def requested(self) -> tuple[str, ...]:
        """Runs that got a NEW request from this call."""
        return tuple(o.run_id for o in (self.root, *self.descendants) if isinstance(o, CancelRequested))


def cancel_run(runs: RunStore, run_id: str, *, cascade: bool = True) -> CancelReport:
    """Request cancellation of ``run_id`` and (``cascade``) of its live descendants; see the module invariants."""

    def fn(conn: Connection) -> CancelReport:
        root = runs.request_cancel(run_id)
        out: list[CancelOutcome] = []
        if cascade:
            seen = {run_id}
            queue = deque([run_id])
            while queue:
                parent = queue.popleft()
                for edge in edges(conn, parent_id=parent):
                    if edge.child_id in seen:
                        continue
                    seen.add(edge.child_id)
                    out.append(runs.request_cancel(edge.child_id))
                    queue.append(edge.child_id)
        return CancelReport(root, tuple(out))

    return runs.db.write(fn)
