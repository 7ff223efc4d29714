"""Stop-and-merge: the durable decision, merge-node elaboration as a new plan generation, and its recovery.

Invariants
- The decision is persisted independently of the attempt's failure: the ``plan_merges`` intent, a
  ``merge-decided`` record and the loser's one ``skipped`` settlement commit in one transaction. Reopening the run
  preserves that record (it is not written again) and settles the loser ``skipped`` without dispatching it.
- Once every winner settled, the merge node — the loser's declaration with ``kind: merge``, ``Pending`` inputs on
  the winners and ``lane`` conflicts (it races nobody: it is ordered after every winner) — is appended as a new
  generation with ``append_plan``. Its id is ``<loser>+merge`` or the first free ``<loser>+merge#<n>``: a user
  node's name is never taken over, and a name alone never establishes ownership — the durable decision does.
- The plan generation, the run's input generation (only new source pins), the ``subgraph-appended`` and
  ``merge-appended`` records and the decision's completion commit together. Exceeding ``maximum_plan_nodes`` is
  ``SchedulerError(elaboration_failed)`` with nothing committed (the intent stays recoverable).
- Recovery validates every decision against the plan it resumes: a completed decision's merge node, generation,
  parent digest and digest must be exactly where it says; an open intent's decided plan must be a prefix of the
  plan. Anything else is ``invalid_plan`` — missing or inconsistent recovery data is not permission to invent an
  extension. A merge node has no rebase budget of its own: a merge that loses a landing race fails.
"""

from __future__ import annotations

import typing as t
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ..boundary.measure import Measurer
from ..errors import BoundaryError, PlanError, SchedulerError
from ..plan import NodeDraft, Pending, Plan, PlanNode, append_plan
from ..plan.model import KeyMaterial
from ..records.runs import assert_owner
from ._inputs import InputStore, MergeDecision, MergeStore, classify_reads, entry_id, unpinned_sources
from .plans import PlanStore, generation_digests

if t.TYPE_CHECKING:  # pragma: no cover
    from ..plan import RuntimeGraph
    from ..plan.graph import Propagation
    from ._session import RunSession
    from .model import Outcome


class Coordinator(t.Protocol):
    """What the elaborator needs of the run's coordinator (its single writer). A protocol rather than an import of
    ``_coordinator``, which owns this elaborator: the dependency points one way only."""

    s: RunSession
    graph: RuntimeGraph

    def settle(self, node_id: str, outcome: Outcome, *, journal: bool, error: str | None = None) -> None: ...

    def apply(self, prop: Propagation, first: int = 0) -> None: ...


__all__ = ["MergeElaborator", "merge_node_id", "merge_draft", "measure_pins"]


def merge_node_id(plan: Plan, loser: str) -> str:
    """``<loser>+merge``, or the first ``<loser>+merge#<n>`` (n = 1, 2, ...) no node of ``plan`` uses."""
    name = f"{loser}+merge"
    n = 0
    while name in plan:
        n += 1
        name = f"{loser}+merge#{n}"
    return name


def merge_draft(loser: PlanNode, winners: tuple[str, ...], name: str) -> NodeDraft:
    """The merge node: the loser's work, ordered after the winners."""
    d = loser.draft
    m = d.material
    material: dict[str, Any] = {
        "tier": m.tier,
        "body": m.body,
        "inputs": [*m.inputs, *(Pending(w) for w in winners)],
        "layers": m.layers,
        "capabilities": m.capabilities,
    }
    if m.nondeterministic is not None:
        material["nondeterministic"] = m.nondeterministic
    data: dict[str, Any] = {
        "id": name,
        "material": KeyMaterial(**material),
        "effects": d.effects,
        "kind": "merge",
        "priority": d.priority,
        "conflict_strategy": "lane",
        "runtime_strategy": "delay-rebase",
    }
    if d.approval is not None:
        data["approval"] = d.approval
    if d.wait is not None:
        data["wait"] = d.wait
    return NodeDraft(**data)


def measure_pins(measurer: Measurer, entries: list[Any]) -> dict[str, tuple[tuple[str, str], ...]]:
    """Expand and hash source entries once: ``entry id → ((path, digest | "absent"), ...)``."""
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for e in entries:
        try:
            states = measurer.measure_entries([e])
        except BoundaryError as exc:
            raise SchedulerError(
                "boundary_unavailable",
                f"source input {entry_id(e)} cannot be measured: {exc.message}",
                cause=exc,
            ) from exc
        out[entry_id(e)] = tuple((p, s.digest if s is not None else "absent") for p, s in states.items())
    return out


@dataclass
class _Stopped:
    winners: tuple[str, ...]
    paths: tuple[str, ...]
    error: str


class MergeElaborator:
    """Stop-merge decisions of one pass."""

    def __init__(
        self,
        *,
        plans: PlanStore,
        inputs: InputStore,
        store: MergeStore,
        decisions: list[MergeDecision],
    ) -> None:
        self.plans = plans
        self.inputs = inputs
        self.store = store
        self.decisions = decisions
        self.stopped: dict[str, _Stopped] = {}
        self.pending: list[str] = []

    # -------------------------------------------------------------------------------------------- queries
    def is_stopped(self, node_id: str) -> bool:
        return node_id in self.stopped

    def stopped_error(self, node_id: str) -> str:
        return self.stopped[node_id].error

    def ready(self, coord: Coordinator) -> bool:
        return self._next(coord) is not None

    def _next(self, coord: Coordinator) -> str | None:
        for loser in self.pending:
            if all(coord.graph.outcome(w) is not None for w in self.stopped[loser].winners):
                return loser
        return None

    # ----------------------------------------------------------------------------------------- recovery
    def recover(self, coord: Coordinator) -> None:
        plan = coord.s.plan
        digests = generation_digests(plan)
        for d in self.decisions:
            if d.node not in plan:
                raise self._inconsistent(d, f"the stopped node {d.node!r} is not in the plan being run")
            why = f"stopped by a stop-merge decision in favour of {', '.join(d.winners) or 'an external writer'}"
            self.stopped[d.node] = _Stopped(d.winners, d.paths, why)
            if d.completed:
                g = d.generation
                assert g is not None and d.merge_node is not None
                ok = (
                    d.merge_node in plan
                    and plan.node(d.merge_node).generation == g
                    and plan.node(d.merge_node).kind == "merge"
                    and 0 < g < len(digests)
                    and digests[g] == d.digest
                    and digests[g - 1] == d.parent_digest
                )
                if not ok:
                    raise self._inconsistent(
                        d,
                        f"its merge node {d.merge_node!r} (generation {g}, {d.digest}) is not in the plan as recorded",
                    )
                coord.s.merges.append(d.merge_node)
            else:
                if d.decided_digest not in digests:
                    raise self._inconsistent(
                        d, "the plan it was decided on is not a prefix of the plan being run"
                    )
                self.pending.append(d.node)

    @staticmethod
    def _inconsistent(d: MergeDecision, why: str) -> SchedulerError:
        return SchedulerError(
            "invalid_plan",
            f"run {d.run_id!r}: the stop-merge decision of {d.node!r} does not match the plan: {why}; missing or "
            "inconsistent recovery data is not permission to invent an extension — resume with the plan this run "
            "recorded (or its base)",
            run_id=d.run_id,
            node=d.node,
        )

    # -------------------------------------------------------------------------------------------- decide
    def decide(
        self,
        coord: Coordinator,
        loser: str,
        winners: tuple[str, ...],
        paths: tuple[str, ...],
        error: str | None,
    ) -> None:
        s = coord.s
        run_id, plan = s.cfg.run_id, s.plan
        self.stopped[loser] = _Stopped(
            winners, paths, error or f"stopped by a stop-merge decision in favour of {', '.join(winners)}"
        )
        self.pending.append(loser)
        s.write(lambda conn: self.store.decide_in(conn, run_id, plan, loser, winners, paths))
        s.journal(
            "merge-decided",
            {"plan_id": plan.plan_id, "node_id": loser, "winners": list(winners), "paths": list(paths)},
        )
        coord.settle(loser, "skipped", journal=True, error=self.stopped[loser].error)

    # ------------------------------------------------------------------------------------------- elaborate
    def maybe_elaborate(self, coord: Coordinator) -> None:
        while self.ready(coord):
            self.elaborate(coord)

    def elaborate(self, coord: Coordinator) -> None:
        loser = self._next(coord)
        if loser is None:
            return
        s = coord.s
        cfg = s.cfg
        parent = s.plan
        stopped = self.stopped[loser]
        name = merge_node_id(parent, loser)
        try:
            grown = append_plan(parent, [merge_draft(parent.node(loser), stopped.winners, name)])
        except PlanError as exc:
            code = "elaboration_failed" if exc.code == "elaboration_failed" else "invalid_plan"
            raise SchedulerError(
                code,
                f"cannot append merge node {name!r} for {loser!r}: {exc.message}; nothing was committed",
                cause=exc,
                node=loser,
            ) from exc
        reads = classify_reads(grown, start=len(parent.nodes))
        new_pins = measure_pins(cfg.measurer, unpinned_sources(reads, s.pins))
        s.flush()

        def fn(conn: Connection) -> None:
            assert_owner(conn, cfg.run_id, cfg.owner)
            self.plans.record_in(conn, grown)
            self.inputs.advance_in(conn, cfg.run_id, grown, new_pins)
            self.store.complete_in(conn, cfg.run_id, loser, name, parent, grown)
            cfg.journal.append_in(
                conn,
                cfg.run_id,
                "merge-appended",
                {
                    "plan_id": grown.plan_id,
                    "node_id": loser,
                    "merge_node_id": name,
                    "generation": grown.generation,
                    "parent_digest": parent.digest,
                    "digest": grown.digest,
                },
            )

        cfg.db.write(fn)
        self.pending.remove(loser)
        from ._session import declaration_of

        s.plan = grown
        for n in grown.nodes[len(parent.nodes) :]:
            s.positions[n.id] = n.position
            s.declarations[n.id] = declaration_of(n)
        s.reads.update(reads)
        s.pins = s.pins.merged(new_pins)
        s.merges.append(name)
        coord.apply(coord.graph.extend(grown))
        s.flush()
