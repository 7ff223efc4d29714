"""The plan store: persisted, content-addressed plan generations (``record`` / ``append``); the rows are
``records._plans``'s, this module holds the rules (verification, journaling).

Invariants
- Append-only and first writer wins: a generation is stored once under ``(plan_id, digest)`` with only the
  nodes it added and the digest of its parent generation, so earlier nodes are never rewritten and two runs
  that grow a plan identically store one row.
- Storing a generation requires its parent to be stored (``record`` stores every missing generation of the
  plan it is given, oldest first), so every stored digest chains back to a generation 0 — the approved base.
- Plans are verified (``verify_plan``) before they are stored and after they are loaded: a stored plan that does
  not recompile is ``SchedulerError(invalid_plan)``, never used.
- ``record`` journals ``plan-recorded`` and ``append`` journals ``subgraph-appended`` in the plan's partition
  (``plan:<plan_id>``), in the same transaction as the row. Both records carry the graph itself under
  ``graph.nodes`` (each node with the tag it dispatches, i.e. its kind) beside the node count ``nodes``, and no
  edges (a plan names its edges through each node's ``depends_on``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from ..errors import PlanError, SchedulerError
from ..plan import Plan, PlanNode, verify_plan
from ..plan.compile import plan_digest
from ..records import plans as plan_records
from ..records.plans import StoredGeneration
from ..stores.database import Database
from .model import AlreadyRecorded, Recorded, RecordResult

__all__ = ["PlanStore", "StoredGeneration", "generation_digests"]

_PLAN_JOURNAL_TYPES = ("plan-recorded", "subgraph-appended")


def generation_digests(plan: Plan) -> list[str]:
    """The plan digest after each generation of ``plan`` (index = generation); the last one is ``plan.digest``."""
    out: list[str] = []
    nodes = plan.nodes
    for i, n in enumerate(nodes):
        if i + 1 == len(nodes) or nodes[i + 1].generation != n.generation:
            out.append(
                plan.base_digest
                if n.generation == 0
                else plan_digest(plan.plan_id, plan.flow, nodes[: i + 1])
            )
    if not out:
        out.append(plan.digest)
    return out


def _graph(nodes: Sequence[PlanNode]) -> list[dict[str, str]]:
    return [{"id": n.id, "tag": n.kind} for n in nodes]


class PlanStore:
    """Plan generations of one database. Methods named ``*_in`` write on the caller's open write transaction."""

    def __init__(self, db: Database, *, journal: Any, clock: Clock = SYSTEM_CLOCK) -> None:
        self.db = db
        self.journal = journal
        self.clock = clock

    # -- writes --------------------------------------------------------------------------------------------
    def record_in(self, conn: Connection, plan: Plan) -> RecordResult:
        """Store every generation of ``plan`` not stored yet (oldest first) and journal each one. Answers for
        the newest generation: :class:`Recorded` when this call stored it, else :class:`AlreadyRecorded`."""
        digests = generation_digests(plan)
        stored = self._stored(conn, plan.plan_id, digests)
        result: RecordResult = AlreadyRecorded(plan.plan_id, plan.digest, plan.generation)
        for gen, digest in enumerate(digests):
            if digest in stored:
                continue
            nodes = [n for n in plan.nodes if n.generation == gen]
            parent = digests[gen - 1] if gen else None
            plan_records.insert_generation_in(
                conn,
                plan,
                digest=digest,
                parent_digest=parent,
                generation=gen,
                nodes=nodes,
                now_ms=self.clock.now_ms(),
            )
            prefix = [n for n in plan.nodes if n.generation <= gen]
            payload: dict[str, Any] = {
                "plan_id": plan.plan_id,
                "flow": plan.flow,
                "digest": digest,
                "base_digest": plan.base_digest,
                "generation": gen,
                "nodes": len(prefix),
                "graph": {"nodes": _graph(prefix if gen == 0 else nodes)},
            }
            if parent is not None:
                payload["parent_digest"] = parent
            self.journal.append_in(conn, f"plan:{plan.plan_id}", _PLAN_JOURNAL_TYPES[gen > 0], payload)
            result = Recorded(plan.plan_id, digest, gen)
        return result

    def record(self, plan: Plan) -> RecordResult:
        """:meth:`record_in` in its own transaction (the plan must verify)."""
        _verified(plan)
        return self.db.write(lambda conn: self.record_in(conn, plan))

    # -- reads ---------------------------------------------------------------------------------------------
    def _stored(self, conn: Connection, plan_id: str, digests: Sequence[str]) -> set[str]:
        return plan_records.stored_digests_in(conn, plan_id, digests)

    def load_in(self, conn: Connection, plan_id: str, digest: str) -> Plan | None:
        """The stored plan whose newest generation has ``digest`` (``None`` when not stored), verified."""
        chain = plan_records.generation_chain_in(conn, plan_id, digest)
        if chain is None:
            return None
        nodes: list[Any] = []
        for row in chain:
            nodes.extend(row.nodes)
        top = chain[-1]
        doc = {
            "plan_id": plan_id,
            "flow": top.flow,
            "nodes": nodes,
            "digest": top.digest,
            "base_digest": chain[0].digest,
            "generation": top.generation,
            "maximum_plan_nodes": top.maximum_plan_nodes,
        }
        try:
            return verify_plan(Plan.from_json(doc))
        except PlanError as exc:
            raise SchedulerError(
                "invalid_plan",
                f"stored plan {plan_id!r} ({digest}) does not verify: {exc.message}; either it was stored by a "
                "version whose plan keys or digests differ from this one (finish or cancel such runs with the "
                "version that started them, or start a new run of the plan) or the plan store was edited",
                cause=exc,
                plan_id=plan_id,
            ) from exc

    def load(self, plan_id: str, digest: str) -> Plan | None:
        return self.db.read(lambda conn: self.load_in(conn, plan_id, digest))

    def generations(self, plan_id: str) -> list[StoredGeneration]:
        """Every stored generation of ``plan_id`` (all bases), by (base, generation)."""
        return plan_records.generations(self.db, plan_id)


def _verified(plan: Any) -> Plan:
    try:
        return verify_plan(plan)
    except PlanError as exc:
        raise SchedulerError(
            "invalid_plan", f"plan refused before anything was written: {exc.message}", cause=exc
        ) from exc
