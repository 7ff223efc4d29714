"""RuntimeGraph: the indexed readiness state of one run of a plan. PURE, in memory, single-threaded.

Invariants
- Stable plan positions, forward and reverse edges, per-vertex ``unresolved`` (dependencies not yet settled
  successfully) and ``blocked`` (dependencies settled failed/skipped/deferred) counts, explicit ready /
  waiting / in-flight sets and a ``remaining`` count replace whole-plan readiness rescans: every settlement
  touches only the settled vertex's dependents (Kahn's algorithm, kept incremental).
- A node settles exactly once. ``start`` on a running or staged node is a retry/rebase: it counts an attempt
  and never touches dependents. ``stage`` records a provisional outcome while deviations drain; only
  ``settle`` (the reconciled outcome) updates dependents, so no dependent is ever decremented twice.
- Propagation runs to a fixpoint inside ``settle``, in dependency order, before anything else can be admitted:
  a node with a failed/skipped/deferred dependency settles ``skipped`` at once (it can never run; unrelated
  work is unaffected — a failed cone blocks only its descendants); a node selected for deferral settles
  ``deferred`` only once all its dependencies *succeeded* (a failed cone creates skipped work, never deferral
  debt).
- ``extend`` admits an appended generation without disturbing earlier positions or states. A dependency may
  name a node at a later position of the same generation (compile orders a reader after a writer declared after
  it); an added generation whose dependencies form a cycle is refused before anything changes.
- ``discover`` adds reconciliation edges (a ``Reorder`` verdict): the started node goes back to waiting until
  the named nodes settle, whatever their outcome, and then becomes ready to run again. Discovered edges change
  ONLY readiness (declared predecessors still determine file versions): they never block, skip or defer
  a node, never enter ``PlanNode.depends_on``, read classification, keys or inputs, and are never persisted. An
  edge that would close a cycle (the named node waits, declared or discovered, on this one) is refused.
- The indexes are private, never persisted and never part of a key. Work counters (``work``) count index
  updates, settlements and frontier-snapshot items so tests can assert linear work without timing anything.
"""

from __future__ import annotations

import typing as t
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import GraphError
from .model import Plan, PlanNode

__all__ = [
    "Outcome",
    "OUTCOMES",
    "SUCCESS",
    "Settled",
    "Propagation",
    "GraphWork",
    "RuntimeGraph",
    "NodeState",
]

Outcome = t.Literal["built", "clean", "failed", "skipped", "deferred"]
NodeState = t.Literal["waiting", "ready", "running", "staged", "settled"]
OUTCOMES: frozenset[str] = frozenset(("built", "clean", "failed", "skipped", "deferred"))
#: Outcomes that let dependents run.
SUCCESS: frozenset[str] = frozenset(("built", "clean"))

_WAITING, _READY, _RUNNING, _STAGED, _SETTLED = range(5)
_STATE_NAMES: tuple[NodeState, ...] = ("waiting", "ready", "running", "staged", "settled")


@dataclass(frozen=True, slots=True)
class Settled:
    """One settlement. ``cause`` names the dependency whose outcome propagated into a ``skipped``; it is
    ``None`` for a settlement the caller made and for a ``deferred`` selection."""

    node: str
    outcome: Outcome
    cause: str | None = None


@dataclass(frozen=True, slots=True)
class Propagation:
    """What one graph transition settled (in dependency order) and which nodes it made ready (plan order of
    discovery). Journal ``settled`` in order; hand ``ready`` to admission."""

    settled: tuple[Settled, ...]
    ready: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GraphWork:
    """Private work counters (operation counts, not time)."""

    index_updates: int
    settlements: int
    frontier_snapshots: int


class RuntimeGraph:
    """Indexed readiness of one run. Build it from a verified :class:`Plan` (or its nodes, in plan order)."""

    __slots__ = (
        "_ids",
        "_index",
        "_nodes",
        "_deps",
        "_dependents",
        "_unresolved",
        "_blocked",
        "_state",
        "_outcome",
        "_staged",
        "_attempts",
        "_defer",
        "_disc_dependents",
        "_disc_unresolved",
        "_disc_deps",
        "_ready",
        "_waiting",
        "_in_flight",
        "_remaining",
        "_w_index",
        "_w_settle",
        "_w_snap",
        "initial",
    )

    def __init__(self, nodes: Plan | Iterable[PlanNode], *, defer: Iterable[str] = ()) -> None:
        self._ids: list[str] = []
        self._index: dict[str, int] = {}
        self._nodes: list[PlanNode] = []
        self._deps: list[tuple[int, ...]] = []
        self._dependents: list[list[int] | tuple[()]] = []  # () until a vertex's first dependent
        self._unresolved: list[int] = []
        self._blocked: list[int] = []
        self._state: list[int] = []
        self._outcome: list[str | None] = []
        self._staged: dict[int, str] = {}
        self._attempts: list[int] = []
        self._defer: set[int] = set()
        # Discovered (reconciliation) edges, kept apart from the declared ones: they gate readiness only.
        self._disc_dependents: dict[int, list[int]] = {}
        self._disc_unresolved: dict[int, int] = {}
        self._disc_deps: dict[int, set[int]] = {}
        self._ready: set[int] = set()
        self._waiting: set[int] = set()
        self._in_flight: set[int] = set()
        self._remaining = 0
        self._w_index = 0
        self._w_settle = 0
        self._w_snap = 0
        #: Settlements and readiness produced by construction itself (selected roots settle ``deferred``).
        self.initial: Propagation = self.extend(nodes, defer=defer)

    # ------------------------------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._index

    @property
    def remaining(self) -> int:
        """Nodes not yet settled (waiting, ready, running or staged)."""
        return self._remaining

    @property
    def done(self) -> bool:
        return self._remaining == 0

    @property
    def work(self) -> GraphWork:
        return GraphWork(self._w_index, self._w_settle, self._w_snap)

    def node(self, node_id: str) -> PlanNode:
        return self._nodes[self._idx(node_id)]

    def position(self, node_id: str) -> int:
        return self._idx(node_id)

    def state(self, node_id: str) -> NodeState:
        return _STATE_NAMES[self._state[self._idx(node_id)]]

    def outcome(self, node_id: str) -> Outcome | None:
        """The settled outcome, or ``None`` while the node is unsettled."""
        return t.cast("Outcome | None", self._outcome[self._idx(node_id)])

    def staged(self, node_id: str) -> Outcome | None:
        """The provisional outcome of a staged node, else ``None``."""
        return t.cast("Outcome | None", self._staged.get(self._idx(node_id)))

    def attempts(self, node_id: str) -> int:
        return self._attempts[self._idx(node_id)]

    def discovered(self, node_id: str) -> tuple[str, ...]:
        """The nodes a ``Reorder`` verdict ordered ``node_id`` after (plan order); never its declared ones."""
        return self._snapshot(self._disc_deps.get(self._idx(node_id), set()))

    def _snapshot(self, members: set[int]) -> tuple[str, ...]:
        self._w_snap += len(members)
        ids = self._ids
        return tuple(ids[i] for i in sorted(members))

    def ready(self) -> tuple[str, ...]:
        """Nodes whose dependencies all succeeded and that have not started, in plan order."""
        return self._snapshot(self._ready)

    def waiting(self) -> tuple[str, ...]:
        """Unsettled nodes with a dependency not yet settled, in plan order."""
        return self._snapshot(self._waiting)

    def in_flight(self) -> tuple[str, ...]:
        """Started (running or staged) nodes, in plan order."""
        return self._snapshot(self._in_flight)

    def outcomes(self) -> dict[str, Outcome]:
        """Every settled node's outcome, in plan order."""
        ids, out = self._ids, self._outcome
        return {ids[i]: t.cast("Outcome", o) for i, o in enumerate(out) if o is not None}

    # -------------------------------------------------------------------------------------- transitions

    def _idx(self, node_id: str) -> int:
        try:
            return self._index[node_id]
        except (KeyError, TypeError):
            raise GraphError("unknown_node", f"node {node_id!r} is not part of this run's graph") from None

    def _refuse(self, i: int, action: str) -> GraphError:
        return GraphError(
            "invalid_transition",
            f"cannot {action} node {self._ids[i]!r}: it is {_STATE_NAMES[self._state[i]]}",
            node=self._ids[i],
            state=_STATE_NAMES[self._state[i]],
        )

    def start(self, node_id: str) -> int:
        """Dispatch a ready node, or retry/rebase a running or staged one. Returns the attempt number."""
        i = self._idx(node_id)
        st = self._state[i]
        if st == _READY:
            self._ready.discard(i)
            self._in_flight.add(i)
        elif st == _STAGED:
            del self._staged[i]
        elif st != _RUNNING:
            raise self._refuse(i, "start")
        self._state[i] = _RUNNING
        self._attempts[i] += 1
        return self._attempts[i]

    def stage(self, node_id: str, outcome: Outcome) -> None:
        """Record a provisional outcome for a running (or staged) node; dependents are not touched."""
        i = self._idx(node_id)
        _check_outcome(outcome)
        if self._state[i] not in (_RUNNING, _STAGED):
            raise self._refuse(i, "stage")
        self._state[i] = _STAGED
        self._staged[i] = outcome

    def settle(self, node_id: str, outcome: Outcome | None = None) -> Propagation:
        """Settle a ready, running or staged node with its reconciled ``outcome`` (default: the staged one) and
        propagate to dependents. Settling twice is refused."""
        i = self._idx(node_id)
        st = self._state[i]
        if st not in (_READY, _RUNNING, _STAGED):
            raise self._refuse(i, "settle")
        if outcome is None:
            if st != _STAGED:
                raise GraphError(
                    "invalid_outcome", f"node {node_id!r} has no staged outcome; pass the reconciled outcome"
                )
            outcome = t.cast("Outcome", self._staged[i])
        _check_outcome(outcome)
        self._finish(i, outcome)
        if not self._dependents[i] and not self._disc_dependents:
            # nothing waits on this vertex: the propagation is this settlement alone (most of a wide plan)
            return Propagation((Settled(node_id, outcome),), ())
        settled: list[Settled] = [Settled(node_id, outcome)]
        ready: list[str] = []
        self._propagate([i], settled, ready)
        return Propagation(tuple(settled), tuple(ready))

    def _finish(self, i: int, outcome: str) -> None:
        st = self._state[i]
        if st == _READY:
            self._ready.discard(i)
        elif st == _WAITING:
            self._waiting.discard(i)
        else:
            self._in_flight.discard(i)
            self._staged.pop(i, None)
        self._state[i] = _SETTLED
        self._outcome[i] = outcome
        self._remaining -= 1
        self._w_settle += 1

    def _propagate(self, queue: list[int], settled: list[Settled], ready: list[str]) -> None:
        # FIFO over settled vertices: a vertex is settled before any vertex its outcome settles (dependency
        # order). Each (vertex, dependent) edge is visited exactly once, when the vertex settles.
        state, unresolved, blocked, outcome = self._state, self._unresolved, self._blocked, self._outcome
        dependents, ids, defer = self._dependents, self._ids, self._defer
        head = 0
        while head < len(queue):
            j = queue[head]
            head += 1
            ok = outcome[j] in SUCCESS
            if self._disc_dependents:
                self._release_discovered(j, ready)
            deps_of_j = dependents[j]
            self._w_index += len(deps_of_j)
            for d in deps_of_j:
                if ok:
                    unresolved[d] -= 1
                    if (
                        unresolved[d] == 0
                        and blocked[d] == 0
                        and state[d] == _WAITING
                        and not self._disc_unresolved.get(d)
                    ):
                        if d in defer:
                            self._finish(d, "deferred")
                            settled.append(Settled(ids[d], "deferred"))
                            queue.append(d)
                        else:
                            self._waiting.discard(d)
                            state[d] = _READY
                            self._ready.add(d)
                            ready.append(ids[d])
                else:
                    blocked[d] += 1
                    if state[d] == _WAITING:
                        self._finish(d, "skipped")
                        settled.append(Settled(ids[d], "skipped", ids[j]))
                        queue.append(d)

    def discover(self, node_id: str, after: Iterable[str]) -> Propagation:
        """Order a started (running or staged) node after the nodes ``after`` — a reconciliation edge. Its staged
        outcome is dropped and it waits until every one of them has settled (any outcome), then it is ready to run
        again (``ready`` names it at once when all of them already settled). Refused, with nothing changed, for an
        unknown node, the node itself, or a node that waits on this one (a cycle)."""
        i = self._idx(node_id)
        if self._state[i] not in (_RUNNING, _STAGED):
            raise self._refuse(i, "reorder")
        preds = list(dict.fromkeys(self._idx(p) for p in after))
        if i in preds:
            raise GraphError(
                "invalid_transition", f"node {node_id!r} cannot be ordered after itself", node=node_id
            )
        unsettled = [p for p in preds if self._outcome[p] is None]
        closing = self._waits_on(set(unsettled), i)
        if closing is not None:
            raise GraphError(
                "invalid_transition",
                f"cannot order {node_id!r} after {self._ids[closing]!r}: {self._ids[closing]!r} waits on "
                f"{node_id!r} (a cycle)",
                node=node_id,
                after=self._ids[closing],
            )
        self._in_flight.discard(i)
        self._staged.pop(i, None)
        self._disc_deps.setdefault(i, set()).update(preds)
        for p in unsettled:
            self._disc_dependents.setdefault(p, []).append(i)
        self._w_index += len(preds)
        if unsettled:
            self._disc_unresolved[i] = self._disc_unresolved.get(i, 0) + len(unsettled)
            self._state[i] = _WAITING
            self._waiting.add(i)
            return Propagation((), ())
        self._state[i] = _READY
        self._ready.add(i)
        return Propagation((), (node_id,))

    def _waits_on(self, targets: set[int], i: int) -> int | None:
        """The first of ``targets`` reachable from ``i`` through unsettled dependents (declared or discovered), if
        any. The visited set lives for this query only: no transitive closure is kept."""
        if not targets:
            return None
        seen = {i}
        queue = [i]
        head = 0
        while head < len(queue):
            j = queue[head]
            head += 1
            for d in (*self._dependents[j], *self._disc_dependents.get(j, ())):
                self._w_index += 1
                if d in seen or self._outcome[d] is not None:
                    continue
                if d in targets:
                    return d
                seen.add(d)
                queue.append(d)
        return None

    def _release_discovered(self, j: int, ready: list[str]) -> None:
        # A discovered edge waits for settlement, not success: whatever ``j`` settled as, the reordered node may
        # run again once nothing it was ordered after is unsettled.
        for d in self._disc_dependents.pop(j, ()):
            self._w_index += 1
            left = self._disc_unresolved[d] - 1
            if left:
                self._disc_unresolved[d] = left
                continue
            del self._disc_unresolved[d]
            if self._state[d] == _WAITING and self._unresolved[d] == 0 and self._blocked[d] == 0:
                self._waiting.discard(d)
                self._state[d] = _READY
                self._ready.add(d)
                ready.append(self._ids[d])

    def extend(self, nodes: Plan | Iterable[PlanNode], *, defer: Iterable[str] = ()) -> Propagation:
        """Add an appended generation (a :class:`Plan` whose prefix is this graph, or the new nodes alone, in
        plan order). Earlier positions and states are untouched; new nodes whose dependencies already settled
        become ready, deferred or skipped at once. A dependency may be any other node of the graph or of the
        generation; a cycle among the added nodes is refused (``invalid_transition``), nothing changed."""
        items = list(nodes.nodes if isinstance(nodes, Plan) else nodes)
        base = len(self._ids)
        if isinstance(nodes, Plan):
            for k, n in enumerate(items[:base]):
                if self._ids[k] != n.id:
                    raise GraphError(
                        "invalid_transition",
                        f"plan position {k} is {n.id!r} but this graph has {self._ids[k]!r}; "
                        "extend with an appended generation of the same plan",
                    )
            items = items[base:]
        selected = set(defer)
        new_index: dict[str, int] = {}
        for k, n in enumerate(items):
            if n.id in self._index or n.id in new_index:
                raise GraphError("invalid_transition", f"node {n.id!r} is already part of this graph")
            if n.position != base + k:
                raise GraphError(
                    "invalid_transition",
                    f"node {n.id!r} has position {n.position}, expected {base + k}; pass nodes in plan order",
                )
            new_index[n.id] = base + k
        for s in selected:
            if s not in new_index:
                raise GraphError("unknown_node", f"deferred node {s!r} is not among the nodes being added")
        # Validate every dependency before mutating anything: nothing partial on refusal. A dependency may sit at
        # a later position (compile orders a reader after a writer declared after it), so the added nodes must be
        # checked for a cycle, which would leave its members waiting forever.
        resolved: list[tuple[int, ...]] = []
        index = self._index
        forward = False
        for k, n in enumerate(items):
            names = n.depends_on
            if not names:
                resolved.append(())
                continue
            dep_ix: list[int] = []
            for dep in names:
                x = index.get(dep, new_index.get(dep))
                if x is None or x == base + k:
                    raise GraphError(
                        "unknown_node",
                        f"node {n.id!r} depends on {dep!r}, which is not another node of this graph",
                    )
                forward = forward or x > base + k
                dep_ix.append(x)
            resolved.append(tuple(dict.fromkeys(dep_ix)) if len(dep_ix) > 1 else tuple(dep_ix))
        if forward:
            _refuse_cycle(items, resolved, base)
        # Column-wise: one C-level extend per index instead of a dozen appends per node. A vertex's dependents
        # list is created at its first dependent (a shared empty tuple until then: a list per vertex would be
        # 100,000 objects the cyclic GC scans for a plan that never needs most of them).
        end = base + len(items)
        self._ids.extend([n.id for n in items])
        self._index.update(new_index)
        self._nodes.extend(items)
        self._deps.extend(resolved)
        self._dependents.extend([()] * len(items))
        self._state.extend([_WAITING] * len(items))
        self._outcome.extend([None] * len(items))
        self._attempts.extend([0] * len(items))
        dependents, outcome, unresolved_l, blocked_l = (
            self._dependents,
            self._outcome,
            self._unresolved,
            self._blocked,
        )
        w_index = 0
        for i in range(base, end):
            unresolved = blocked = 0
            for x in resolved[i - base]:
                w_index += 1
                o = outcome[x]
                if o is None:
                    unresolved += 1
                    dl = dependents[x]
                    if dl:
                        dl.append(i)
                    else:
                        dependents[x] = [i]
                elif o not in SUCCESS:
                    blocked += 1
            unresolved_l.append(unresolved)
            blocked_l.append(blocked)
        self._w_index += w_index
        self._waiting.update(range(base, end))
        self._remaining += len(items)
        for s in selected:
            self._defer.add(new_index[s])
        settled: list[Settled] = []
        ready: list[str] = []
        state, ids, deferred, waiting, ready_set = (
            self._state,
            self._ids,
            self._defer,
            self._waiting,
            self._ready,
        )
        for i in range(base, end):
            if state[i] != _WAITING:
                continue
            if not blocked_l[i] and not unresolved_l[i] and i not in deferred:
                waiting.discard(i)
                state[i] = _READY
                ready_set.add(i)
                ready.append(ids[i])
            elif self._blocked[i]:
                cause = next(self._ids[x] for x in self._deps[i] if self._outcome[x] not in (None, *SUCCESS))
                self._finish(i, "skipped")
                settled.append(Settled(self._ids[i], "skipped", cause))
                self._propagate([i], settled, ready)
            elif self._unresolved[i] == 0:
                if i in self._defer:
                    self._finish(i, "deferred")
                    settled.append(Settled(self._ids[i], "deferred"))
                    self._propagate([i], settled, ready)
                else:
                    self._waiting.discard(i)
                    self._state[i] = _READY
                    self._ready.add(i)
                    ready.append(self._ids[i])
        return Propagation(tuple(settled), tuple(ready))


def _refuse_cycle(items: list[PlanNode], resolved: list[tuple[int, ...]], base: int) -> None:
    # Kahn's algorithm over the added nodes (their dependencies on earlier generations cannot close a cycle:
    # those nodes never depend on a newer one).
    waiting = [sum(1 for x in deps if x >= base) for deps in resolved]
    dependents: dict[int, list[int]] = {}
    for k, deps in enumerate(resolved):
        for x in deps:
            if x >= base:
                dependents.setdefault(x - base, []).append(k)
    queue = [k for k, w in enumerate(waiting) if w == 0]
    for j in queue:
        for k in dependents.get(j, ()):
            waiting[k] -= 1
            if waiting[k] == 0:
                queue.append(k)
    if len(queue) < len(items):
        stuck = [items[k].id for k, w in enumerate(waiting) if w]
        raise GraphError(
            "invalid_transition",
            f"the dependencies of nodes {stuck[:10]!r} form a cycle; build the graph from a verified plan",
            nodes=stuck,
        )


def _check_outcome(outcome: object) -> None:
    if type(outcome) is not str or outcome not in OUTCOMES:
        raise GraphError(
            "invalid_outcome", f"outcome {outcome!r} is not one of built, clean, failed, skipped, deferred"
        )
