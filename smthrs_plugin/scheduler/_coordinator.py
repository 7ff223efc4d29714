"""The coordinator: the single writer of one pass's scheduling state, driving an indexed ``RuntimeGraph`` and
priority-with-aging ``Admission`` (both from ``plan``), a host for executions, and a ``RunSession`` for writes.

Invariants
- Every write goes through the pass's commit queue (``_commits.py``: group commits, led by whichever thread is
  free), so a crash loses at most the commit in progress and the writes queued behind it, none of them reported;
  an outcome is learned from its committed settlement. The loop:
  admission pass (event-driven, so a node ages the same on every host) → drain completions in plan order →
  reconciliation page once nothing runs (every deviation attributed before any is judged) → merge elaboration
  (``<id>+merge`` as a new generation).
- Permits: a node's permit is freed when its job announces its queued settlement (its body returned), unless
  ``steps`` is 1; its outcome and its dependents still wait for the commit. A node sent round again takes a permit
  again before its body reruns (:meth:`Admission.retake`), ahead of new admissions.
- Verdicts: any ``Fail`` fails the node; else a ``Reorder`` adds a discovered readiness edge and runs the node
  again afresh (an unhonourable one fails it, saying why); else the staged outcome stands.
- A typed scheduler failure stops admission, cancels the pass's :class:`~.cancel.CancelToken` (a ``run:``
  command's process group is killed), marks this owner's ``started`` attempts ``failed`` in ONE fenced
  transaction, waits for the interrupted jobs and raises the original error (cleanup failures attached). A lost
  fence (``FenceLost``) and parking (``RunParked``) propagate unchanged after running jobs settle themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future, wait
from typing import Any

from .._metrics import Observer
from ..engine.context import RunParked
from ..errors import (
    ArtifactError,
    BoundaryError,
    FenceLost,
    GraphError,
    PlanError,
    ReplayError,
    SchedulerError,
    StoreError,
)
from ..plan import Plan, RuntimeGraph
from ..plan.admission import Admission
from ..plan.graph import Propagation
from ._merge import MergeElaborator
from ._session import Prep, RunSession
from .job import JobOutcome, error_line, is_conflict
from .model import Outcome, Report
from .reconcile import (
    ConflictCase,
    Deviation,
    FactorOut,
    Fail,
    ReconcileContext,
    Reorder,
    Verdict,
    deviations_of,
    judge_all,
)
from .timer import is_timer

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


def _pipelinable(p: Prep) -> bool:
    """May this dispatch start before the transaction beginning its attempt commits? Only sealed, non-timer work:
    compensable and irreversible recovery reads the begun attempt, and a timer parks on it."""
    return p.node.tier == "sealed" and not is_timer(p.node)


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
        #: Submitted jobs whose outcome the coordinator has not learned yet, and the future of each running node.
        self.running: dict[Future[Any], str] = {}
        self.future_of: dict[str, Future[Any]] = {}
        #: Jobs whose outcome it learned from their committed settlement, still returning on their threads: each is
        #: waited for before the pass ends, and one that raises fails the pass as any job's exception does.
        self.finishing: dict[Future[Any], str] = {}
        self.admitted: set[str] = set()
        #: Admitted nodes whose permit was freed when their bodies returned (their settlements not yet learned).
        self.freed: set[str] = set()
        #: With one step permit a node keeps it until its settlement commits: one node at a time, admitted in the
        #: same order on every host (with more, which permit frees first depends on the bodies' timing anyway).
        self._free_on_return = self.admission.concurrency.steps != 1
        self.queued: set[str] = set()
        self.redo: list[str] = []
        self.staged: list[str] = []
        self.devs: dict[str, tuple[Deviation, ...]] = {}
        self.merges = merges
        # A pass-local order of events: when each node's current attempt began and when each node settled, so a
        # Reorder verdict can tell whether the order it asks for already held.
        self._tick = 0
        self.began: dict[str, int] = {}
        self.settled_at: dict[str, int] = {}
        #: Nodes a Reorder verdict sent back to waiting: their next preparation executes afresh, never replays.
        self.rerun: set[str] = set()
        #: The ``scheduler dispatch duration`` timing of each dispatched node, admission through settlement.
        self.timing: dict[str, Observer] = {}
        #: Whether an admission pass may admit something the last one did not (module docstring, step 1).
        self._admit_due = True
        #: The admission pass count when each ready node became ready, and each admitted node's aging bonus.
        self._entered: dict[str, int] = {}
        self._waited: dict[str, int] = {}

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
            self._join_finishing()
            self.s.flush(everything=True)
            self.s.commits.close()
            for err in self.s.await_publications():
                raise err
            return self.s.report()
        except BaseException as exc:
            mapped = self._abort(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    def _abort(self, exc: BaseException) -> BaseException:
        typed = isinstance(map_error(exc, []), SchedulerError)
        external = not isinstance(exc, (Exception, RunParked))
        if typed:
            # Before the cancellation below ends running jobs: their settlements must find their attempts marked,
            # never commit first (jobs lead group commits of their own: _commits.py).
            self.s.commits.hold()
        if typed or external:
            self.s.cancel.cancel(f"{type(exc).__name__}: {exc}")
        try:
            if typed:
                # Mark first, then stop serving the commit queue, then wait: a settlement still queued (never
                # committed, never reported) then finds its attempt failed and writes nothing, and a job that
                # settled first keeps its terminal row (the update re-checks ``started``).
                cleanup = self.s.fail_running()
                self.s.commits.close()
                self._wait_running(keep_open=False)
                cleanup += self.s.await_publications()
            else:
                # What this pass decided before the failure (pipelined begins, settlements of replays) and the
                # settlements jobs queued are true facts: commit them, so running jobs can settle. A lost fence
                # commits nothing (another owner holds the run).
                early: list[BaseException] = []
                if not isinstance(exc, FenceLost):
                    # A failure here is reported with the cleanup errors; the original error stays primary.
                    try:
                        self.s.flush(everything=True)
                    except BaseException as err:
                        early.append(err)
                # Running jobs settle on their own threads from now on, so waiting for them cannot deadlock.
                self.s.commits.close()
                self._wait_running(keep_open=True)
                cleanup = early + ([] if isinstance(exc, FenceLost) else self.s.cleanup())
                cleanup += self.s.await_publications()
        finally:
            for node_id in list(self.timing):
                self._untime(node_id, exc)
        return map_error(exc, cleanup)

    def _wait_running(self, *, keep_open: bool) -> None:
        """Wait for every running job. ``keep_open``: a job that raised leaves its attempt for :meth:`cleanup`."""
        if not self.running and not self.finishing:
            return
        wait([*self.running, *self.finishing])
        for fut, node_id in list(self.running.items()):
            err = fut.exception()
            if err is None or not keep_open:
                self.s.open_rows.pop(node_id, None)
            if err is not None and not keep_open:
                # Expected after an interrupt: its settlement found the row already failed by fail_running.
                log.debug("interrupted node %r ended with %r", node_id, err)
        self.running.clear()
        self.future_of.clear()
        self.finishing.clear()

    def _join_finishing(self) -> None:
        """Wait for the jobs whose outcomes were learned from their commits; raise the first (plan order) that
        raised after its settlement committed: a job's exception is a scheduler failure (see _abort)."""
        if not self.finishing:
            return
        wait(list(self.finishing))
        pos = self.s.positions
        for fut in sorted(self.finishing, key=lambda f: pos[self.finishing[f]]):
            if fut.exception() is not None:
                self.finishing.pop(fut)
                fut.result()
        self.finishing.clear()

    # ----------------------------------------------------------------------------------------- admission
    def _pass(self) -> tuple[bool, bool]:
        """One admission pass: ``(anything dispatched or settled, anything settled without dispatch)``."""
        redo: list[str] = []
        waiting: list[str] = []
        for n in sorted(self.redo, key=self.s.positions.__getitem__):
            # A node going round again runs its body again: it needs the permit it freed when its body returned.
            if n in self.freed:
                if not self.admission.retake(self.s.plan.node(n)):
                    waiting.append(n)
                    continue
                self.freed.discard(n)
            redo.append(n)
        self.redo = waiting
        admitted: list[str] = []
        if self._admit_due and self.admission.ready_count():
            admitted = list(self.admission.admit())
            passes = self.admission.passes
            for n in admitted:
                # Passes before this one in which it was ready and not admitted (Admission ranks by this).
                self._waited[n] = passes - 1 - self._entered.pop(n)
        self._admit_due = False
        if admitted:
            self.s.cfg.metrics.scheduler_admission()
        for n in admitted:
            self.queued.discard(n)
            self.admitted.add(n)
            self.graph.start(n)
        batch = [(n, True) for n in redo] + [(n, False) for n in admitted]
        if not batch:
            return False, False
        for n, _ in batch:
            self.began[n] = self._next_tick()
        preps = [self._prepare(n, rebase) for n, rebase in batch]
        to_submit: list[Prep] = []
        piped: list[Prep] = []
        pipelining = getattr(self.s.cfg.host, "shares_process", False) is True
        for p in preps:
            if p.action == "dispatch":
                self._time(p.node.id)
                self.s.begin(p)
                (piped if pipelining and _pipelinable(p) else to_submit).append(p)
            elif p.action == "replay":
                value, devs = self.s.replay_value(p)
                self.s.set_result(p.node.id, value)
                if devs:
                    self._stage(p.node.id, "clean", devs)
                else:
                    self.settle(p.node.id, "clean", journal=True)
            else:
                self.settle(p.node.id, "failed", journal=True, error=p.error)
        # Pipelined jobs start now, their begins queued first: the group that commits a job's settlement holds its
        # begin (RunSession invariants). The others start only after the flush that began them.
        if piped:
            self.s.hand_off()
        for p in piped:
            p.pipelined = True
            self._running(p)
        if to_submit or not piped:
            # ``everything``: the hand-off above took the other jobs' begins with it (it queues all that is
            # buffered), and a plain flush waits only for what is still buffered; they must be durable before
            # their jobs start, or a crash would re-run an irreversible body whose attempt nobody recorded.
            self.s.flush(everything=bool(piped))
        for p in to_submit:
            self._running(p)
        return True, len(to_submit) + len(piped) < len(preps)

    def _running(self, p: Prep) -> None:
        fut = self.s.submit(p)
        self.running[fut] = p.node.id
        self.future_of[p.node.id] = fut

    def _prepare(self, node_id: str, rebase: bool) -> Prep:
        if node_id not in self.rerun:
            prep = self.s.prepare(node_id, rebase=rebase)
        else:
            # A reordered node executes afresh: its completed attempt ran before the order it was judged to need.
            self.rerun.discard(node_id)
            prep = self.s.prepare(node_id, rebase=True)
            if prep.invalidated is not None:
                prep.invalidated = (prep.invalidated[0], "reordered")
        prep.waited = self._waited.get(node_id, 0)
        return prep

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _time(self, node_id: str) -> None:
        if node_id not in self.timing:  # a rebase turn stays inside the node's one timing
            obs = self.s.cfg.metrics.observe_scheduler_dispatch()
            obs.__enter__()
            self.timing[node_id] = obs

    def _untime(self, node_id: str, exc: BaseException | None = None) -> None:
        obs = self.timing.pop(node_id, None)
        if obs is not None:
            obs.__exit__(None if exc is None else type(exc), exc, None)

    def _on_ready(self, node_id: str) -> None:
        if self.merges.is_stopped(node_id):
            # A durable stop-merge decision: the node settles skipped again, without a new record.
            self.settle(node_id, "skipped", journal=False, error=self.merges.stopped_error(node_id))
            return
        self.queued.add(node_id)
        self._entered[node_id] = self.admission.passes
        self.admission.add_node(self.s.node(node_id))
        self._admit_due = True

    # ---------------------------------------------------------------------------------------- settlement
    def settle(self, node_id: str, outcome: Outcome, *, journal: bool, error: str | None = None) -> None:
        """Record ``node_id``'s outcome and propagate it (the merge elaborator settles stop-merge losers here)."""
        self.s.record(node_id, outcome, journal=journal, error=error)
        prop = self.graph.settle(node_id, outcome)
        self.settled_at[node_id] = self._next_tick()
        self._untime(node_id)
        if node_id in self.admitted:
            self.admitted.discard(node_id)
            self._release(node_id)
        elif node_id in self.queued:
            self.queued.discard(node_id)
            self._entered.pop(node_id, None)
            self.admission.discard(node_id)
        self.apply(prop, first=1)

    def _release(self, node_id: str) -> None:
        """Free ``node_id``'s permit unless its body's return freed it already."""
        if node_id in self.freed:
            self.freed.discard(node_id)
        else:
            self.admission.release(node_id)
            self._admit_due = True  # a freed permit: the next pass may admit a waiting node

    def _returned(self, node_ids: list[str]) -> None:
        """Jobs whose bodies returned and whose settlements were queued: free their permits now, so the next
        bodies start while those settlements wait for their group commit (their outcomes, and so their dependents,
        still wait for that commit)."""
        if not self._free_on_return:
            return
        for node_id in node_ids:
            if node_id in self.admitted and node_id not in self.freed and node_id in self.future_of:
                self.freed.add(node_id)
                self.admission.release(node_id)
                self._admit_due = True

    def apply(self, prop: Propagation, first: int = 0) -> None:
        """Record the settlements a propagation implied and queue the nodes it made ready."""
        for st in sorted(prop.settled[first:], key=lambda x: self.s.positions[x.node]):
            self.s.record(st.node, st.outcome, journal=True)
            self.settled_at[st.node] = self._next_tick()
        for r in prop.ready:
            if self.graph.state(r) == "ready":
                self._on_ready(r)

    def _stage(self, node_id: str, outcome: Outcome, devs: tuple[Deviation, ...]) -> None:
        self.graph.stage(node_id, outcome)
        self.devs[node_id] = devs
        self.staged.append(node_id)

    # ------------------------------------------------------------------------------------------- drain
    def _drain(self) -> None:
        # Wake on committed settlements (the jobs' threads lead their group commits: _commits.py; each outcome is
        # durable once reported here) or on finished jobs: jobs that settled elsewhere (an inline or remote host)
        # and jobs that raised.
        # A body's return frees a permit: worth waking for only while a node waits for one (a ready node, or one
        # going round again); a chain has none.
        self.s.commits.wake_on_return = self._free_on_return and (
            self.admission.ready_count() > 0 or bool(self.redo)
        )
        settled, done, written, returned = self.s.commits.wait()
        self.s.count(written)
        self._returned(returned)
        pos = self.s.positions
        outcomes: dict[str, JobOutcome] = {}
        for job in settled:
            fut = self.future_of.pop(job.node_id, None)
            if fut is None:
                continue  # not a job of this pass's coordinator (cannot happen: each pass has its own queue)
            del self.running[fut]
            self.finishing[fut] = job.node_id
            self.s.commits.learned(fut)
            outcomes[job.node_id] = job
        raised: list[Future[Any]] = []
        for fut in done:
            if fut.cancelled() or fut.exception() is not None:
                raised.append(fut)
            elif fut in self.running:
                node_id = self.running.pop(fut)
                del self.future_of[node_id]
                outcomes[node_id] = fut.result()
            else:
                self.finishing.pop(fut, None)  # learned already; it returned
        for node_id in sorted(outcomes, key=pos.__getitem__):
            self.s.open_rows.pop(node_id, None)
            self._complete(node_id, outcomes[node_id])
        if raised:
            first = min(raised, key=lambda f: pos.get(self.running.get(f) or self.finishing.get(f) or "", -1))
            node_id = self.running.pop(first, "") or self.finishing.pop(first, "")
            if node_id:
                self.future_of.pop(node_id, None)
            first.result()  # a job's exception is a scheduler failure (see _abort)
        # Settlements decided here (skips propagating from a failure, ...) are durable before anything else is
        # admitted, as before; the common case (jobs settled themselves) buffers nothing and commits nothing here.
        self.s.flush()
        self.merges.maybe_elaborate(self)

    def _complete(self, node_id: str, job: JobOutcome) -> None:
        r = job.result
        s = self.s
        s.decisions[node_id] = None if r.decision is None else str(r.decision.tag)
        if r.outcome in _SUCCESS:
            s.set_result(node_id, r.value, job.value_json)
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
        verdicts = judge_all(s.cfg.reconciler, [case], ctx)
        for v in verdicts:
            s.record_verdict(v)
        self._resolve(node_id, verdicts, None, error_line(error))

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
            self._resolve(n, verdicts, staged, None)
        s.flush()
        self.merges.maybe_elaborate(self)

    def _resolve(
        self, node_id: str, verdicts: list[Verdict], staged: Outcome | None, error: str | None
    ) -> None:
        """Settle (or reorder) a judged node by its verdicts (see the module docstring); ``staged`` is its
        provisional outcome, ``None`` for a conflict, whose ``error`` is the copy-back refusal."""
        fails = [v for v in verdicts if isinstance(v, Fail)]
        if fails:
            self.settle(node_id, "failed", journal=True, error=fails[0].reason)
            return
        after = tuple(dict.fromkeys(d for v in verdicts if isinstance(v, Reorder) for d in v.depends_on))
        if after and not self._order_held(node_id, after):
            refused = self._reorder(node_id, after)
            if refused is None:
                return
            self.settle(node_id, "failed", journal=True, error=refused)
        elif staged is not None:
            self.settle(node_id, staged, journal=True)
        else:
            kinds = sorted({v.tag for v in verdicts if isinstance(v, (Reorder, FactorOut))})
            why = f" ({', '.join(kinds)} cannot absorb it)" if kinds else ""
            self.settle(node_id, "failed", journal=True, error=f"{error or 'materialization conflict'}{why}")

    def _order_held(self, node_id: str, after: tuple[str, ...]) -> bool:
        """Did every node of ``after`` settle before ``node_id``'s current attempt began?"""
        began = self.began.get(node_id, 0)
        return all(self.settled_at.get(d, began) < began for d in after)

    def _reorder(self, node_id: str, after: tuple[str, ...]) -> str | None:
        """Add the discovered readiness edges and send the node back to wait; the reason it cannot, if so."""
        s = self.s
        unknown = [d for d in after if d not in self.graph]
        if unknown:
            return f"Reorder after {unknown} cannot be honoured: no such node in plan {s.plan.plan_id!r}"
        if s.plan.node(node_id).tier == "irreversible":
            return (
                f"Reorder after {list(after)} cannot be honoured: irreversible node {node_id!r} would run again, and "
                "retries of irreversible work are refused; declare the dependency and start a new run"
            )
        try:
            prop = self.graph.discover(node_id, after)
        except GraphError as exc:
            return f"Reorder cannot be honoured: {exc.message}"
        self._untime(node_id)
        self.admitted.discard(node_id)
        self._release(node_id)
        self.rerun.add(node_id)
        self.apply(prop)
        return None
