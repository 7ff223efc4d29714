"""Deliberately naive reference models: whole-graph rescans after every event, full re-sort on every admission.

They are the specification the indexed RuntimeGraph and heap-based Admission are compared against (the rule in
smthrs_plugin/plan/admission.py). Clarity over speed; counters record how much they rescan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from smthrs_plugin.errors import GraphError

SUCCESS = {"built", "clean"}
OUTCOMES = {"built", "clean", "failed", "skipped", "deferred"}


class NaiveGraph:
    """Readiness by rescanning every node until nothing changes."""

    def __init__(self, nodes: Iterable[tuple[str, Sequence[str]]], defer: Iterable[str] = ()) -> None:
        self.order: list[str] = []
        self.deps: dict[str, tuple[str, ...]] = {}
        self.state: dict[str, str] = {}
        self.outcome: dict[str, str] = {}
        self.staged_outcome: dict[str, str] = {}
        self.attempts: dict[str, int] = {}
        self.defer: set[str] = set()
        self.scans = 0
        self.initial = self.extend(nodes, defer)

    def extend(self, nodes: Iterable[tuple[str, Sequence[str]]], defer: Iterable[str] = ()) -> list[str]:
        for node_id, deps in nodes:
            self.order.append(node_id)
            self.deps[node_id] = tuple(dict.fromkeys(deps))
            self.state[node_id] = "waiting"
            self.attempts[node_id] = 0
        self.defer |= set(defer)
        return self._fixpoint()

    def _fixpoint(self) -> list[str]:
        auto: list[str] = []
        changed = True
        while changed:
            changed = False
            for n in self.order:
                self.scans += 1
                if self.state[n] != "waiting":
                    continue
                outs = [self.outcome.get(d) for d in self.deps[n]]
                if any(o is not None and o not in SUCCESS for o in outs):
                    self._set(n, "skipped")
                    auto.append(n)
                    changed = True
                elif all(o in SUCCESS for o in outs):
                    if n in self.defer:
                        self._set(n, "deferred")
                        auto.append(n)
                        changed = True
                    else:
                        self.state[n] = "ready"
        return auto

    def _set(self, n: str, outcome: str) -> None:
        self.state[n] = "settled"
        self.outcome[n] = outcome
        self.staged_outcome.pop(n, None)

    def _select(self, state: str | tuple[str, ...]) -> tuple[str, ...]:
        states = (state,) if isinstance(state, str) else state
        return tuple(n for n in self.order if self.state[n] in states)

    def ready(self) -> tuple[str, ...]:
        return self._select("ready")

    def waiting(self) -> tuple[str, ...]:
        return self._select("waiting")

    def in_flight(self) -> tuple[str, ...]:
        return self._select(("running", "staged"))

    @property
    def remaining(self) -> int:
        return sum(1 for n in self.order if self.state[n] != "settled")

    def start(self, n: str) -> int:
        if self.state[n] not in ("ready", "running", "staged"):
            raise GraphError("invalid_transition", f"cannot start {n}")
        self.state[n] = "running"
        self.staged_outcome.pop(n, None)
        self.attempts[n] += 1
        return self.attempts[n]

    def stage(self, n: str, outcome: str) -> None:
        if self.state[n] not in ("running", "staged"):
            raise GraphError("invalid_transition", f"cannot stage {n}")
        self.state[n] = "staged"
        self.staged_outcome[n] = outcome

    def settle(self, n: str, outcome: str) -> list[str]:
        if self.state[n] not in ("ready", "running", "staged"):
            raise GraphError("invalid_transition", f"cannot settle {n}")
        self._set(n, outcome)
        return self._fixpoint()


class NaiveAdmission:
    """Re-sorts the whole ready set on every pass; ``waited`` is stored and incremented explicitly."""

    def __init__(self, steps: int | None = None, agents: int | None = None) -> None:
        self.steps = steps
        self.agents = agents
        self.ready: dict[str, tuple[int, int, bool]] = {}  # id -> (priority, position, agent)
        self.waited: dict[str, int] = {}
        self.in_flight: dict[str, bool] = {}
        self.sorted_items = 0

    def add(self, node_id: str, *, priority: int, position: int, agent: bool = False) -> None:
        self.ready[node_id] = (priority, position, agent)
        self.waited[node_id] = 0

    def admit(self) -> tuple[str, ...]:
        ranked = sorted(self.ready, key=lambda n: (-(self.ready[n][0] + self.waited[n]), self.ready[n][1]))
        self.sorted_items += len(ranked)
        used = len(self.in_flight)
        agents_used = sum(1 for a in self.in_flight.values() if a)
        admitted: list[str] = []
        for n in ranked:
            agent = self.ready[n][2]
            if self.steps is not None and used >= self.steps:
                continue
            if agent and self.agents is not None and agents_used >= self.agents:
                continue
            admitted.append(n)
            used += 1
            agents_used += agent
        for n in admitted:
            self.in_flight[n] = self.ready.pop(n)[2]
            del self.waited[n]
        for n in self.ready:
            self.waited[n] += 1
        return tuple(admitted)

    def release(self, node_id: str) -> None:
        del self.in_flight[node_id]
