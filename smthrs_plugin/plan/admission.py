"""Admission: which ready nodes start now, by priority plus aging, under step and agent caps. PURE.

Rule (exact): each admission *pass* ranks the ready nodes by ``priority + waited``
descending, ties by plan position; walks them, skipping a node when the step cap is full or (an agent) the
agent cap is full — an agent counts against both caps, and a blocked agent does not stop later steps; every
ready node left waiting gets ``waited += 1`` once per pass. Arithmetic is exact (Python ints, any size).

Why a heap is equivalent to re-sorting every pass: a node never leaves the ready set except by admission, so
a node that entered before pass ``p0`` has, at pass ``p``, ``waited = p - p0`` — every node ages by exactly one
per pass. Its score ``priority + p - p0`` differs from the static key ``priority - p0`` by ``p``, the same for
all nodes of a pass, so ranking by the static key ``(p0 - priority, position)`` ascending is ranking by score.
Once the agent cap is full it stays full for the rest of the pass (admissions only add), and once the step
cap is full nothing more can be admitted, so walking the sorted list with skips equals repeatedly taking the
better of the step heap's and (while agent capacity remains) the agent heap's top. Each node is pushed and
popped once: admission work is linear in the number of nodes, not quadratic in a wide frontier. Equivalence
with the re-sorting reference is property-tested.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import GraphError
from .model import PlanNode

__all__ = ["Concurrency", "Admission", "AdmissionWork"]


def _cap(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise GraphError(
            "invalid_concurrency",
            f"concurrency {name}={value!r} must be a positive int, or None for unbounded; a cap of zero admits "
            "nothing and a round that admits nothing settles nothing",
            cap=name,
        )
    return value


@dataclass(frozen=True, slots=True)
class Concurrency:
    """Caps on in-flight nodes: ``steps`` caps all leaf execution, ``agents`` the agent subset within it.
    ``None`` is unbounded; anything else must be a positive int (``GraphError(invalid_concurrency)``)."""

    steps: int | None = None
    agents: int | None = None

    def __post_init__(self) -> None:
        _cap("steps", self.steps)
        _cap("agents", self.agents)

    @classmethod
    def of(cls, value: Concurrency | Mapping[str, Any] | None) -> Concurrency:
        """Accept a Concurrency, a mapping ``{"steps": n, "agents": m}`` or ``None`` (unbounded)."""
        if value is None:
            return cls()
        if isinstance(value, Concurrency):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {"steps", "agents"}
            if unknown:
                raise GraphError(
                    "invalid_concurrency",
                    f"unknown concurrency keys {sorted(unknown)}; use 'steps' and 'agents'",
                )
            return cls(steps=value.get("steps"), agents=value.get("agents"))
        raise GraphError("invalid_concurrency", f"concurrency {value!r} must be a mapping or Concurrency")


@dataclass(frozen=True, slots=True)
class AdmissionWork:
    """Private work counters: ``passes`` and ``prepared`` (heap pushes and pops, dead entries included)."""

    passes: int
    prepared: int


# heap entry: (entered_pass - priority, position, node_id) — ascending order is the admission order.
_Entry = tuple[int, int, str]


class Admission:
    """Priority + aging admission with step and agent caps. Feed it ready nodes (:meth:`add`), call
    :meth:`admit` once per pass, and :meth:`release` a node when it settles."""

    __slots__ = (
        "concurrency",
        "_steps",
        "_agents",
        "_live",
        "_in_flight",
        "_used",
        "_agents_used",
        "_passes",
        "_work",
    )

    def __init__(self, concurrency: Concurrency | Mapping[str, Any] | None = None) -> None:
        self.concurrency = Concurrency.of(concurrency)
        self._steps: list[_Entry] = []
        self._agents: list[_Entry] = []
        self._live: dict[str, tuple[int, int, bool]] = {}  # ready: id -> (entered pass, priority, agent)
        self._in_flight: dict[str, bool] = {}  # admitted, not released: id -> agent
        self._used = 0
        self._agents_used = 0
        self._passes = 0
        self._work = 0

    @property
    def work(self) -> AdmissionWork:
        return AdmissionWork(self._passes, self._work)

    @property
    def passes(self) -> int:
        return self._passes

    def ready_count(self) -> int:
        return len(self._live)

    def in_flight_count(self) -> int:
        return len(self._in_flight)

    def add(self, node_id: str, *, priority: int, position: int, agent: bool = False) -> None:
        """A node became ready (it ages from the next pass on)."""
        if node_id in self._live or node_id in self._in_flight:
            raise GraphError("invalid_transition", f"node {node_id!r} is already ready or admitted")
        if type(priority) is not int or type(position) is not int:
            raise GraphError("invalid_transition", f"node {node_id!r}: priority and position must be ints")
        self._push(node_id, priority, position, bool(agent))

    def _push(self, node_id: str, priority: int, position: int, agent: bool) -> None:
        entry = (self._passes - priority, position, node_id)
        heapq.heappush(self._agents if agent else self._steps, entry)
        self._live[node_id] = (self._passes, priority, agent)
        self._work += 1

    def add_node(self, node: PlanNode) -> None:
        """:meth:`add` for a compiled node (its priority, position and kind)."""
        node_id, d, position = node.id, node.draft, node.position
        priority = d.priority
        if (
            node_id in self._live
            or node_id in self._in_flight
            or type(priority) is not int
            or type(position) is not int
        ):
            self.add(node_id, priority=priority, position=position, agent=d.kind == "agent")  # refuses
            return
        self._push(node_id, priority, position, d.kind == "agent")

    def discard(self, node_id: str) -> None:
        """Forget a ready node that will not be admitted (e.g. it was settled without dispatch)."""
        if self._live.pop(node_id, None) is None:
            raise GraphError("invalid_transition", f"node {node_id!r} is not waiting for admission")

    def waited(self, node_id: str) -> int:
        """Passes a ready node has been left waiting (its aging bonus)."""
        return self._passes - self._live_info(node_id)[0]

    def _live_info(self, node_id: str) -> tuple[int, int, bool]:
        try:
            return self._live[node_id]
        except KeyError:
            raise GraphError("invalid_transition", f"node {node_id!r} is not waiting for admission") from None

    def score(self, node_id: str) -> int:
        """``priority + waited`` of a ready node."""
        return self._live_info(node_id)[1] + self.waited(node_id)

    def _top(self, heap: list[_Entry], agents: bool) -> _Entry | None:
        live = self._live
        while heap:
            entry = heap[0]
            info = live.get(entry[2])
            if info is not None and entry[0] == info[0] - info[1] and info[2] is agents:
                return entry
            heapq.heappop(heap)  # discarded or superseded entry
            self._work += 1
        return None

    def admit(self) -> tuple[str, ...]:
        """Run one admission pass; returns the admitted node ids in admission order. Every ready node left
        waiting ages by one."""
        self._passes += 1
        steps_cap = self.concurrency.steps
        agents_cap = self.concurrency.agents
        out: list[str] = []
        while steps_cap is None or self._used < steps_cap:
            best = self._top(self._steps, False)
            heap = self._steps
            if agents_cap is None or self._agents_used < agents_cap:
                a = self._top(self._agents, True)
                if a is not None and (best is None or a < best):
                    best, heap = a, self._agents
            if best is None:
                break
            heapq.heappop(heap)
            self._work += 1
            node_id = best[2]
            self._take(node_id, self._live.pop(node_id)[2])
            out.append(node_id)
        return tuple(out)

    def retake(self, node: PlanNode) -> bool:
        """Take a permit again for ``node``, admitted before and released since (its body returned, then its
        settlement asked for another turn): True when the caps have room now; False leaves nothing changed, and
        the caller asks again once a permit was released. It jumps the ready queue (it was admitted already)."""
        if node.id in self._in_flight or node.id in self._live:
            raise GraphError("invalid_transition", f"node {node.id!r} holds a permit or waits for admission")
        agent = node.kind == "agent"
        steps_cap, agents_cap = self.concurrency.steps, self.concurrency.agents
        if (steps_cap is not None and self._used >= steps_cap) or (
            agent and agents_cap is not None and self._agents_used >= agents_cap
        ):
            return False
        self._take(node.id, agent)
        return True

    def _take(self, node_id: str, agent: bool) -> None:
        self._in_flight[node_id] = agent
        self._used += 1
        if agent:
            self._agents_used += 1

    def release(self, node_id: str) -> None:
        """An admitted node's body returned or it settled: free its step (and agent) permit. Retries keep the
        permit."""
        try:
            agent = self._in_flight.pop(node_id)
        except KeyError:
            raise GraphError("invalid_transition", f"node {node_id!r} was not admitted") from None
        self._used -= 1
        if agent:
            self._agents_used -= 1
