"""The coordinator: the single writer of one pass's scheduling state, driving an indexed ``RuntimeGraph`` and
priority-with-aging ``Admission`` (both from ``plan``), a host for executions, and a ``RunSession`` for writes.

Loop (every step is one durable transaction, so a crash loses at most the step in progress):
1. **Admission pass** — admit ready nodes (priority + aging, step and agent caps); delay-rebased nodes re-enter
   first, keeping their permit. Prepare each (measure, key); replays and refusals settle at once; the others'
   attempt rows begin in one transaction; then they are submitted to the host.
2. **Drain** — wait for at least one completion, take every completed job, and process them in plan order: a
   final outcome settles (skips propagate in dependency order before anything else is admitted); a deviating
   success is staged; a materialisation conflict is absorbed by its runtime strategy (delay-rebase while
   ``rebases < rebase_limit``; stop-merge: the loser settles ``skipped`` and its decision is durable) or
   reconciled (``Fail``).
3. **Reconciliation page** — once nothing is running, every staged node's deviations are attributed
   (``deviation-recorded``) before any is judged, then each staged node settles with its verdict.
4. **Merge elaboration** — a stop-merge decision whose winners all settled appends ``<id>+merge`` (or the first
   free ``<id>+merge#n``) as a new plan generation, committed with its input generation, journal record and
   decision completion; the graph is extended synchronously.

A typed scheduler failure stops admission, lets running jobs finish, marks attempts it began and never saw
settle ``failed`` (cleanup failures are attached as ``cleanup_errors``, the original error stays primary) and
propagates. A lost fence (``FenceLost``) propagates unchanged: another owner holds the run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from ..errors import (
    ArtifactError,
    BoundaryError,
    FenceLost,
    PlanError,
    ReplayError,
    SchedulerError,
    StoreError,
)
from ..plan import Admission, Plan, Propagation, RuntimeGraph
from ._merge import MergeElaborator
from ._session import Prep, RunSession
from .job import JobOutcome, error_line, is_conflict
from .model import Outcome, Report
from .reconcile import ConflictCase, Deviation, ReconcileContext, deviations_of, judge_all

__all__ = ["Coordinator", "conflict_strategy", "map_error"]

log = logging.getLogger(__name__)
_SUCCESS = ("built", "clean")


def conflict_strategy(plan: Plan, node_id: str, paths: Iterable[str]) -> tuple[str, tuple[str, ...]]:
    """The runtime strategy for a materialisation conflict of ``node_id`` on ``paths``, and the peers (plan order)
    it races: the lane pairs whose other member produces one of those paths (``stop-merge`` if any such pair
    says so), else every lane peer; with no lane pair, the node's own ``runtime_strategy``."""
    from ..plan.fileset import entry_matches

    node = plan.node(node_id)
    pairs: list[tuple[str, str]] = [(c.with_, c.runtime) for c in node.conflicts if c.strategy == "lane"]
    for other in plan.nodes:
        for c in other.conflicts:
            if c.with_ == node_id and c.strategy == "lane":
                pairs.append((other.id, c.runtime))
    if not pairs:
        return node.draft.runtime_strategy, ()
    wanted = tuple(paths)
    hit = [
        (peer, rt)
        for peer, rt in pairs
        if any(entry_matches(e, p) for e in plan.node(peer).effects.produces for p in wanted)
    ]
    chosen = hit or pairs
    strategy = "stop-merge" if any(rt == "stop-merge" for _, rt in chosen) else "delay-rebase"
    pos = {n.id: n.position for n in plan.nodes}
    return strategy, tuple(sorted({p for p, _ in chosen}, key=pos.__getitem__))


def map_error(exc: BaseException, cleanup: list[BaseException]) -> BaseException:
    """The error a failed pass raises: typed scheduler errors keep their code; store/boundary failures become
    ``store_failed`` / ``boundary_unavailable`` with their cause; anything else propagates unchanged."""
    if isinstance(exc, SchedulerError):
        if cleanup:
            exc.cleanup_errors = (*exc.cleanup_errors, *cleanup)
        return exc
    if isinstance(exc, FenceLost):
        return exc
    if isinstance(exc, (StoreError, ArtifactError)):
        return SchedulerError(
            "store_failed", f"a durable write or read failed: {exc}", cause=exc, cleanup_errors=cleanup
        )
    if isinstance(exc, (BoundaryError, ReplayError)):
        return SchedulerError(
            "boundary_unavailable", f"the workspace boundary failed: {exc}", cause=exc, cleanup_errors=cleanup
        )
    if isinstance(exc, PlanError):
        return SchedulerError("invalid_plan", f"plan refused: {exc}", cause=exc, cleanup_errors=cleanup)
    for err in cleanup:
        log.error("cleanup after %r failed: %r", exc, err)
    return exc


class Coordinator:
    """Drives one pass of a run to completion (see the module docstring)."""

    def __init__(
        self,
        session: RunSession,
        *,
        defer: Iterable[str] = (),
        merges: MergeElaborator,
    ) -> None:
        self.s = session
        self.graph = RuntimeGraph(session.plan, defer=defer)
        self.admission = Admission(session.cfg.concurrency)
        self.running: dict[Future[Any], str] = {}
        self.admitted: set[str] = set()
        self.queued: set[str] = set()
        self.redo: list[str] = []
        self.staged: list[str] = []
        self.devs: dict[str, tuple[Deviation, ...]] = {}
        self.merges = merges

    # ------------------------------------------------------------------------------------------------- run
    def run(self) -> Report:
        try:
            self.merges.recover(self)
            self.apply(self.graph.initial)
            self.s.flush()
            while not self.graph.done:
                batch, settled_now = self._pass()
                if settled_now:
                    continue  # capacity freed and nodes became ready without waiting: admit again first
                if self.running:
                    self._drain()
                elif self.staged:
                    self._judge_page()
                elif self.merges.ready(self):
                    self.merges.elaborate(self)
                elif not batch:
                    raise SchedulerError(
                        "store_failed",
                        f"internal: the run stalled with {self.graph.remaining} unsettled nodes "
                        f"(waiting {list(self.graph.waiting())[:10]})",
                    )
            self.s.flush()
            return self.s.report()
        except BaseException as exc:
            mapped = self._abort(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    def _abort(self, exc: BaseException) -> BaseException:
        # Running jobs cannot be interrupted (threads): let them finish so their attempts settle durably.
        if self.running:
            wait(list(self.running))
            for fut, node_id in list(self.running.items()):
                if fut.exception() is None:
                    self.s.open_rows.pop(node_id, None)
            self.running.clear()
        cleanup = [] if isinstance(exc, FenceLost) else self.s.cleanup()
        mapped = map_error(exc, cleanup)
        return mapped

    # ----------------------------------------------------------------------------------------- admission
    def _pass(self) -> tuple[bool, bool]:
        """One admission pass: ``(anything dispatched or settled, anything settled without dispatch)``."""
        redo = sorted(self.redo, key=self.s.positions.__getitem__)
        self.redo = []
        admitted = list(self.admission.admit()) if self.admission.ready_count() else []
        if admitted:
            self.s.cfg.metrics.scheduler_admission()
        for n in admitted:
            self.queued.discard(n)
            self.admitted.add(n)
            self.graph.start(n)
        batch = [(n, True) for n in redo] + [(n, False) for n in admitted]
        if not batch:
            return False, False
        preps = [self.s.prepare(n, rebase=rebase) for n, rebase in batch]
        to_submit: list[Prep] = []
        for p in preps:
            if p.action == "dispatch":
                self.s.begin(p)
                to_submit.append(p)
            elif p.action == "replay":
                value, devs = self.s.replay_value(p)
                self.s.set_result(p.node.id, value)
                if devs:
                    self._stage(p.node.id, "clean", devs)
                else:
                    self.settle(p.node.id, "clean", journal=True)
            else:
                self.settle(p.node.id, "failed", journal=True, error=p.error)
        self.s.flush()
        for p in to_submit:
            self.running[self.s.submit(p)] = p.node.id
        return True, len(to_submit) < len(preps)

    def _on_ready(self, node_id: str) -> None:
        if self.merges.is_stopped(node_id):
            # A durable stop-merge decision: the node settles skipped again, without a new record.
            self.settle(node_id, "skipped", journal=False, error=self.merges.stopped_error(node_id))
            return
        self.queued.add(node_id)
        self.admission.add_node(self.s.plan.node(node_id))

    # ---------------------------------------------------------------------------------------- settlement
    def settle(self, node_id: str, outcome: Outcome, *, journal: bool, error: str | None = None) -> None:
        """Record ``node_id``'s outcome and propagate it (the merge elaborator settles stop-merge losers here)."""
        self.s.record(node_id, outcome, journal=journal, error=error)
        prop = self.graph.settle(node_id, outcome)
        if node_id in self.admitted:
            self.admitted.discard(node_id)
            self.admission.release(node_id)
        elif node_id in self.queued:
            self.queued.discard(node_id)
            self.admission.discard(node_id)
        self.apply(prop, first=1)

    def apply(self, prop: Propagation, first: int = 0) -> None:
        """Record the settlements a propagation implied and queue the nodes it made ready."""
        for st in sorted(prop.settled[first:], key=lambda x: self.s.positions[x.node]):
            self.s.record(st.node, st.outcome, journal=True)
        for r in prop.ready:
            if self.graph.state(r) == "ready":
                self._on_ready(r)

    def _stage(self, node_id: str, outcome: Outcome, devs: tuple[Deviation, ...]) -> None:
        self.graph.stage(node_id, outcome)
        self.devs[node_id] = devs
        self.staged.append(node_id)

    # ------------------------------------------------------------------------------------------- drain
    def _drain(self) -> None:
        done, _ = wait(list(self.running), return_when=FIRST_COMPLETED)
        finished = sorted(done, key=lambda f: self.s.positions[self.running[f]])
        for fut in finished:
            node_id = self.running.pop(fut)
            outcome: JobOutcome = fut.result()  # a job's exception is a scheduler failure (see _abort)
            self.s.open_rows.pop(node_id, None)
            self._complete(node_id, outcome)
        self.s.flush()
        self.merges.maybe_elaborate(self)

    def _complete(self, node_id: str, job: JobOutcome) -> None:
        r = job.result
        s = self.s
        s.decisions[node_id] = None if r.decision is None else str(r.decision.tag)
        if r.outcome in _SUCCESS:
            s.set_result(node_id, r.value)
        if job.final is not None:
            self.settle(node_id, job.final, journal=False, error=error_line(r.error))
        elif r.outcome in _SUCCESS:
            self._stage(node_id, r.outcome, deviations_of(node_id, r.deviations))
        else:
            assert is_conflict(r.error)
            self._conflict(node_id, r.error)

    def _conflict(self, node_id: str, error: BaseException | None) -> None:
        s = self.s
        node = s.plan.node(node_id)
        details = getattr(error, "details", {}) or {}
        paths = tuple(str(p) for p in details.get("paths", ()) or ())
        strategy, peers = conflict_strategy(s.plan, node_id, paths)
        reason: str
        if node.tier == "irreversible":
            reason = "irreversible"
        elif node.kind == "merge":
            reason = "merge-node"
        elif strategy == "stop-merge":
            self.merges.decide(self, node_id, peers, paths, error_line(error))
            return
        elif s.rebases.get(node_id, 0) < s.cfg.rebase_limit:
            s.rebases[node_id] = s.rebases.get(node_id, 0) + 1
            self.graph.start(node_id)
            self.redo.append(node_id)
            return
        else:
            reason = "rebase-limit"
        case = ConflictCase(node_id, paths, peers, strategy, reason)
        ctx = ReconcileContext(s.plan, tuple(s.deviations))
        for v in judge_all(s.cfg.reconciler, [case], ctx):
            s.record_verdict(v)
        self.settle(node_id, "failed", journal=True, error=error_line(error))

    # --------------------------------------------------------------------------------- reconciliation page
    def _judge_page(self) -> None:
        s = self.s
        page = sorted(self.staged, key=s.positions.__getitem__)
        self.staged = []
        for n in page:  # attribute every deviation of the page before judging any
            for d in self.devs[n]:
                s.record_deviation(d)
        ctx = ReconcileContext(s.plan, tuple(s.deviations))
        for n in page:
            verdicts = judge_all(s.cfg.reconciler, self.devs.pop(n), ctx)
            for v in verdicts:
                s.record_verdict(v)
            staged = self.graph.staged(n)
            assert staged is not None
            failed = [v for v in verdicts if v.tag == "Fail"]
            if failed:
                self.settle(n, "failed", journal=True, error=getattr(failed[0], "reason", None))
            else:
                self.settle(n, staged, journal=True)
        s.flush()
        self.merges.maybe_elaborate(self)
