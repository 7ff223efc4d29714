"""Reconciliation: the verdict on a boundary deviation, or on a conflict the runtime strategy could not absorb.

A reconciler answers a :class:`Deviation` or a :class:`ConflictCase` with a :data:`Verdict` (``Reorder | FactorOut |
Fail``); it is injected into the scheduler's constructor. :class:`DefaultReconciler` is deterministic: ``Reorder``
(``depends_on`` in plan order) when every deviating path is one other plan nodes declare they write, ``FactorOut``
when another node of the run deviated on exactly the same paths, ``Fail`` otherwise and always for a conflict.

- :class:`ReconcileContext` carries every deviation attributed in the run so far (a journal page is attributed before
  any of it is judged): which of two identical deviations the journal listed first never decides the verdict.
- The coordinator enforces a verdict (docs/how-to/plans.md, "Deviations, conflicts and reconciliation"); every verdict is
  journaled (``node-reconciled``) and reported, a re-judged node's each time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, Union, runtime_checkable

from ..plan import Plan
from ..plan.fileset import entry_matches

__all__ = [
    "Deviation",
    "ConflictCase",
    "Reorder",
    "FactorOut",
    "Fail",
    "Verdict",
    "VERDICT_TYPES",
    "ReconcileContext",
    "Reconciler",
    "DefaultReconciler",
    "verdict_json",
]

DeviationKind = Literal["expected-set-deviation", "missing-declared-output", "surviving-declared-removal"]


@dataclass(frozen=True)
class Deviation:
    """What a node's settled boundary recorded in ``expected`` mode (hard mode refuses instead)."""

    node: str
    kind: str
    paths: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node, "kind": self.kind, "paths": list(self.paths)}


@dataclass(frozen=True)
class ConflictCase:
    """A materialisation conflict the runtime strategy could not absorb: ``reason`` says why
    (``rebase-limit``, ``irreversible``, ``merge-node``, ``merge-unavailable``)."""

    node: str
    paths: tuple[str, ...]
    peers: tuple[str, ...]
    strategy: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node,
            "paths": list(self.paths),
            "peers": list(self.peers),
            "strategy": self.strategy,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Reorder:
    """The deviation is a dependency the declaration missed: ``node`` should have come after ``depends_on``."""

    node: str
    depends_on: tuple[str, ...]
    tag: ClassVar[str] = "Reorder"


@dataclass(frozen=True)
class FactorOut:
    """Several nodes deviated on exactly ``paths``: a candidate for one extracted step."""

    node: str
    paths: tuple[str, ...]
    tag: ClassVar[str] = "FactorOut"


@dataclass(frozen=True)
class Fail:
    """Nothing explains the deviation, or the conflict could not be absorbed: the node settles ``failed``."""

    node: str
    reason: str
    tag: ClassVar[str] = "Fail"


Verdict = Union[Reorder, FactorOut, Fail]
VERDICT_TYPES: tuple[type, ...] = (Reorder, FactorOut, Fail)


def verdict_json(v: Verdict) -> dict[str, Any]:
    """Plain JSON of a verdict, as journaled in ``node-reconciled`` and printed by the CLI."""
    if isinstance(v, Reorder):
        return {"type": "Reorder", "node_id": v.node, "depends_on": list(v.depends_on)}
    if isinstance(v, FactorOut):
        return {"type": "FactorOut", "node_id": v.node, "paths": list(v.paths)}
    return {"type": "Fail", "node_id": v.node, "reason": v.reason}


@dataclass(frozen=True)
class ReconcileContext:
    """What a reconciler may look at: the plan being run and every deviation attributed so far in this run
    (the current journal page included), in attribution order."""

    plan: Plan
    deviations: tuple[Deviation, ...]
    _writers: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)

    def writers_of(self, path: str, *, exclude: str | None = None) -> tuple[str, ...]:
        """Plan nodes (plan order) that declare writing ``path``, optionally without ``exclude``."""
        hit = self._writers.get(path)
        if hit is None:
            hit = tuple(
                n.id for n in self.plan.nodes if any(entry_matches(w, path) for w in n.effects.writes)
            )
            self._writers[path] = hit
        return tuple(n for n in hit if n != exclude)


@runtime_checkable
class Reconciler(Protocol):
    """Answers a deviation or an unabsorbed conflict with a :data:`Verdict` about ``case.node``."""

    def judge(self, case: Deviation | ConflictCase, context: ReconcileContext) -> Verdict: ...


class DefaultReconciler:
    """The deterministic default (see the module docstring)."""

    def judge(self, case: Deviation | ConflictCase, context: ReconcileContext) -> Verdict:
        if isinstance(case, ConflictCase):
            return Fail(
                case.node,
                f"materialization conflict on {', '.join(case.paths) or 'the write set'} not absorbed "
                f"({case.reason}); choosing a winner between two landings needs a semantic reconciler",
            )
        paths = case.paths
        if paths:
            writers_by_path = [context.writers_of(p, exclude=case.node) for p in paths]
            if all(writers_by_path):
                position = {n.id: n.position for n in context.plan.nodes}
                writers = sorted({w for ws in writers_by_path for w in ws}, key=position.__getitem__)
                return Reorder(case.node, tuple(writers))
            mine = frozenset(paths)
            for other in context.deviations:
                if other.node != case.node and frozenset(other.paths) == mine:
                    return FactorOut(case.node, tuple(sorted(mine)))
        return Fail(
            case.node,
            f"{case.kind} on {', '.join(paths[:20]) or 'no paths'}: no other node declares these writes and no "
            "other node deviated on exactly these paths; declare them (or fix the step)",
        )


def judge_all(
    reconciler: Reconciler,
    cases: Sequence[Deviation | ConflictCase],
    context: ReconcileContext,
) -> list[Verdict]:
    """Judge ``cases`` in order, checking each answer is a verdict about the node it was asked about."""
    out: list[Verdict] = []
    for case in cases:
        v = reconciler.judge(case, context)
        if not isinstance(v, VERDICT_TYPES) or getattr(v, "node", None) != case.node:
            raise TypeError(
                f"reconciler {reconciler!r} answered {v!r} for node {case.node!r}; it must return "
                "Reorder | FactorOut | Fail about that node"
            )
        out.append(v)
    return out


def deviations_of(node: str, raw: Sequence[Any] | Sequence[Mapping[str, Any]]) -> tuple[Deviation, ...]:
    """Scheduler deviations from boundary deviations (objects with ``kind``/``paths``) or their JSON."""
    out: list[Deviation] = []
    for d in raw:
        if isinstance(d, Mapping):
            out.append(Deviation(node, str(d["kind"]), tuple(str(p) for p in d["paths"])))
        else:
            out.append(Deviation(node, str(d.kind), tuple(str(p) for p in d.paths)))
    return tuple(out)
