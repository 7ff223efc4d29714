"""A deliberately naive reference coordinator: the pre-index scheduler the indexed one is compared against.

Readiness is a whole-plan rescan after every settlement (a node is ready when every dependency succeeded,
skipped when any settled otherwise, deferred when selected and ready); admission sorts the whole ready set by
``priority + waited`` (ties by plan position) on every pass and walks it under the caps. No RuntimeGraph, no
Admission heap, no reverse edges: clarity over speed. It shares the RunSession (preparation and every durable
write) with the indexed coordinator, so journals, attempt rows and cache keys must come out byte-identical when
the scheduling decisions are the same — which is what the differential test checks.

It supports what the generated plans exercise (success, failure, skips, deferral, replay on a second pass,
priorities, agents, caps); it refuses anything else loudly rather than guessing.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from smthrs_plugin.scheduler._session import RunSession

SUCCESS = ("built", "clean")


class ReferenceCoordinator:
    def __init__(self, session: RunSession, defer: tuple[str, ...] = ()) -> None:
        self.s = session
        self.order = [n.id for n in session.plan.nodes]
        self.deps = {n.id: n.depends_on for n in session.plan.nodes}
        self.node = {n.id: n for n in session.plan.nodes}
        self.state = {n: "waiting" for n in self.order}
        self.outcome: dict[str, str] = {}
        self.waited: dict[str, int] = {}
        self.in_flight: set[str] = set()
        self.running: dict[Future[Any], str] = {}
        self.defer = set(defer)
        self.scans = 0
        c = session.cfg.concurrency
        self.steps, self.agents = c.steps, c.agents

    # -- readiness by rescanning -----------------------------------------------------------------------------
    def _rescan(self) -> None:
        """Settle what follows from the current outcomes (skips/deferrals, journaled in plan order) and mark newly
        ready nodes, repeating whole-plan scans until nothing changes."""
        changed = True
        settled: list[tuple[str, str]] = []
        while changed:
            changed = False
            for n in self.order:
                self.scans += 1
                if self.state[n] != "waiting":
                    continue
                outs = [self.outcome.get(d) for d in self.deps[n]]
                if any(o is not None and o not in SUCCESS for o in outs):
                    self._finish(n, "skipped")
                    settled.append((n, "skipped"))
                    changed = True
                elif all(o in SUCCESS for o in outs):
                    if n in self.defer:
                        self._finish(n, "deferred")
                        settled.append((n, "deferred"))
                        changed = True
                    else:
                        self.state[n] = "ready"
                        self.waited[n] = 0
        for n, o in sorted(settled, key=lambda x: self.order.index(x[0])):
            self.s.record(n, o, journal=True)  # type: ignore[arg-type]

    def _finish(self, n: str, outcome: str) -> None:
        self.state[n] = "settled"
        self.outcome[n] = outcome

    def _settle(self, n: str, outcome: str, *, journal: bool, error: str | None = None) -> None:
        self.s.record(n, outcome, journal=journal, error=error)  # type: ignore[arg-type]
        self._finish(n, outcome)
        self.in_flight.discard(n)
        self._rescan()

    # -- admission by sorting everything ----------------------------------------------------------------------
    def _admit(self) -> list[str]:
        ready = [n for n in self.order if self.state[n] == "ready"]
        if not ready:
            return []
        ranked = sorted(ready, key=lambda n: (-(self.node[n].priority + self.waited[n]), self.order.index(n)))
        used = len(self.in_flight)
        agents_used = sum(1 for n in self.in_flight if self.node[n].kind == "agent")
        admitted: list[str] = []
        for n in ranked:
            if self.steps is not None and used >= self.steps:
                break
            agent = self.node[n].kind == "agent"
            if agent and self.agents is not None and agents_used >= self.agents:
                continue
            admitted.append(n)
            used += 1
            agents_used += agent
        for n in ready:
            if n not in admitted:
                self.waited[n] += 1
        return admitted

    def _pass(self) -> tuple[bool, bool]:
        admitted = self._admit()
        if not admitted:
            return False, False
        for n in admitted:
            self.state[n] = "running"
            self.in_flight.add(n)
        preps = [self.s.prepare(n, rebase=False) for n in admitted]
        for p in preps:
            p.waited = self.waited[p.node.id]  # its aging bonus when admitted (journaled in node-scheduled)
        submit = []
        for p in preps:
            if p.action == "dispatch":
                self.s.begin(p)
                submit.append(p)
            elif p.action == "replay":
                value, devs = self.s.replay_value(p)
                assert not devs, "the reference does not reconcile deviations"
                self.s.set_result(p.node.id, value)
                self._settle(p.node.id, "clean", journal=True)
            else:
                self._settle(p.node.id, "failed", journal=True, error=p.error)
        self.s.flush()
        for p in submit:
            self.running[self.s.submit(p)] = p.node.id
        return True, len(submit) < len(preps)

    def _drain(self) -> None:
        # Inline jobs commit their settlements themselves: process the finished jobs.
        events = self.s.commits.wait()
        done = events.done
        self.s.count(events.written)
        for fut in sorted(
            (f for f in done if f in self.running), key=lambda f: self.order.index(self.running[f])
        ):
            n = self.running.pop(fut)
            job = fut.result()
            self.s.open_rows.pop(n, None)
            r = job.result
            self.s.decisions[n] = None if r.decision is None else str(r.decision.tag)
            if r.outcome in SUCCESS:
                self.s.set_result(n, r.value)
            assert job.final is not None, "the reference does not handle conflicts or deviations"
            from smthrs_plugin.scheduler.job import error_line

            self._settle(n, job.final, journal=False, error=error_line(r.error))
        self.s.flush()

    def run(self) -> Any:
        self._rescan()
        self.s.flush()
        while any(st != "settled" for st in self.state.values()):
            batch, settled_now = self._pass()
            if settled_now:
                continue
            if self.running:
                self._drain()
            elif not batch:
                raise AssertionError("the reference stalled")
        self.s.flush()
        self.s.commits.close()
        return self.s.report()
