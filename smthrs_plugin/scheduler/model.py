"""What the scheduler hands an executor and what it returns: :class:`NodeInput`, :class:`Settlement`,
:class:`Report`.

Invariants
- An executor sees exactly what the dispatch key folds: the node, its attempt number, the boundary it was
  keyed under, and the *projected* values of its material ``Ref`` inputs (in input order). Ordering-only
  (``Pending``) dependencies and unprojected sibling fields are absent, or a cached settlement could be served
  for an execution that consumed something else. ``root`` is the sandbox root the node reads and writes in.
- A report lists one settlement per node in plan order (merge nodes included, after the nodes they were
  appended behind). ``deferred`` is selection debt, never a pass: :attr:`Report.passed` is false while any
  node is deferred, and :attr:`Report.debt` names them.
- Outcomes are ``built | clean | failed | skipped | deferred``; ``cache_decision`` is the tag of the one cache
  decision of the node's last dispatch (``None`` when nothing was dispatched).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..plan import PlanNode
from .cancel import NEVER_CANCELLED, CancelToken
from .reconcile import Verdict, verdict_json

__all__ = ["NodeInput", "Settlement", "Report", "Outcome", "Recorded", "AlreadyRecorded", "RecordResult"]

Outcome = Literal["built", "clean", "failed", "skipped", "deferred"]


@dataclass(frozen=True)
class NodeInput:
    """One node execution's input. ``inputs``: the projected value of every ``Ref`` input, in input order
    (``ABSENT`` where the projection found nothing), in its stored form (canonical JSON decoded: sorted object
    keys, lists for tuples) whether the upstream value was built now, replayed or served from the cache. ``key`` is the dispatch key; ``boundary`` the boundary mode
    it was keyed under. ``cancel`` is the pass's :class:`~.cancel.CancelToken`: a long-running executor polls
    ``ni.cancel.cancelled``, blocks on ``ni.cancel.wait(...)`` or registers ``with ni.cancel.on_cancel(fn):`` so a
    typed scheduler failure can interrupt it (an executor that ignores it still works; it is waited for). It is
    not data: no key folds it."""

    node: PlanNode
    attempt: int
    inputs: tuple[Any, ...]
    root: Path
    key: str
    boundary: str
    cancel: CancelToken = field(default=NEVER_CANCELLED, repr=False, compare=False)
    #: The real workspace and the node's boundary declaration (how an executor isolates its body from the live
    #: workspace: ``boundary.IsolatedCall``). Not data: no key folds them.
    workspace: Path | None = field(default=None, repr=False, compare=False)
    declaration: Any = field(default=None, repr=False, compare=False)

    @property
    def id(self) -> str:
        return self.node.id


@dataclass(frozen=True)
class Settlement:
    """How one node settled. ``dispatch_key`` is ``None`` for a node never dispatched (skipped/deferred);
    ``error`` is a one-line reason for ``failed`` (and for a ``skipped`` stop-merge loser)."""

    node: str
    outcome: Outcome
    plan_key: str
    dispatch_key: str | None
    attempts: int
    rebases: int
    cache_decision: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` shape of a report (``error`` only when present)."""
        out: dict[str, Any] = {
            "node": self.node,
            "outcome": self.outcome,
            "plan_key": self.plan_key,
            "dispatch_key": self.dispatch_key,
            "attempts": self.attempts,
            "rebases": self.rebases,
            "cache_decision": self.cache_decision,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True)
class Report:
    """The result of :meth:`PlanScheduler.run`: ``plan_id``, the ``digest`` of the plan as run (grown by merge
    generations, if any), settlements in plan order, ``results`` (values of built/clean nodes) by node id,
    reconciliation ``verdicts`` in judgement order and the ids of appended merge nodes."""

    plan_id: str
    digest: str
    settlements: tuple[Settlement, ...]
    results: Mapping[str, Any] = field(default_factory=dict)
    verdicts: tuple[Verdict, ...] = ()
    merges: tuple[str, ...] = ()

    def settlement(self, node_id: str) -> Settlement:
        for s in self.settlements:
            if s.node == node_id:
                return s
        raise KeyError(node_id)

    @property
    def outcomes(self) -> dict[str, Outcome]:
        return {s.node: s.outcome for s in self.settlements}

    @property
    def debt(self) -> tuple[str, ...]:
        """Deferred nodes: postponed by selection, to be repaid by a later guess-free pass."""
        return tuple(s.node for s in self.settlements if s.outcome == "deferred")

    @property
    def failed(self) -> bool:
        return any(s.outcome in ("failed", "skipped") for s in self.settlements)

    @property
    def passed(self) -> bool:
        """Every node built or clean (deferred debt is not a pass)."""
        return all(s.outcome in ("built", "clean") for s in self.settlements)

    def to_json(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id,
            "digest": self.digest,
            "settlements": [s.to_json() for s in self.settlements],
            "results": dict(self.results),
            "verdicts": [verdict_json(v) for v in self.verdicts],
            "merges": list(self.merges),
        }


@dataclass(frozen=True)
class Recorded:
    """``record``/``append`` persisted this generation."""

    plan_id: str
    digest: str
    generation: int


@dataclass(frozen=True)
class AlreadyRecorded:
    """The generation was already persisted (identical digest): nothing was written."""

    plan_id: str
    digest: str
    generation: int


RecordResult = Recorded | AlreadyRecorded
