"""``PlanScheduler``: record a plan, append generations, and drive a persisted plan to completion.

It owns identity, admission, caching and journaling, and deliberately nothing about what a node means: turning
a node into work is the one seam the caller supplies (the executor). Prior art: the reference
``PlanScheduler`` of ``@smthrs/engine-store``; Bazel's action graph
(content-keyed actions, a single scheduler thread, remote/local executors behind one interface).

Invariants
- ``record``, ``append`` and ``run`` verify the complete plan first (``verify_plan`` recomputes keys, graph
  annotations and digests): invalid input is ``SchedulerError(invalid_plan)`` before any store call, journal
  write, filesystem measurement or dispatch. The verified plan is immutable, so caller mutation cannot change an
  admitted plan.
- ``run`` requires the run to be owned by ``owner`` (``running``): every durable write is fenced. It does not
  terminalise the run: the run driver owns the run's lifecycle (``runtime.Runtime`` provides a local one).
- Before the first dispatch of a run, its source pins and environment fingerprint are persisted; reopening the
  same run restores them and refuses a changed environment, plan id or approved base (``invalid_plan``). See
  ``_inputs.py``.
- A node's own failure is an outcome (``failed``); its cone settles ``skipped``; siblings outside it keep
  running. ``SchedulerError`` is a refusal of the scheduler itself: ``invalid_plan``, ``boundary_unavailable``,
  ``key_uncomputable``, ``elaboration_failed``, ``store_failed`` (with ``cleanup_errors``). One raised mid-run
  interrupts the running siblings (``NodeInput.cancel``; a ``run:`` command's process group is killed) and marks
  every attempt this owner still has ``started`` ``failed`` in one fenced transaction before it propagates.
- Reconciliation verdicts are enforced, not only journaled: ``Fail`` fails the node, ``Reorder`` re-runs it after
  the named nodes (a discovered readiness edge), ``FactorOut`` keeps its staged outcome (``_coordinator.py``).
- Options are copied and validated at construction: caps must be positive ints (zero admits nothing),
  ``rebase_limit`` a non-negative int.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from .._metrics import NULL_METRICS, MetricsPort
from ..boundary import Declaration
from ..boundary.measure import Measurer
from ..errors import PlanError, SchedulerError, SettingsError
from ..plan import ABSENT, Concurrency, Plan
from ..records.attempts import AttemptStore
from ..records.journal import Journal
from ..records.runs import OwnerId, assert_owner
from ..stores.artifacts import ArtifactStore
from ..stores.database import Database
from ._coordinator import Coordinator, map_error
from ._inputs import (
    InputHead,
    InputStore,
    MergeStore,
    Pins,
    classify_reads,
    environment_fingerprint,
    normalize_environment,
    unpinned_sources,
)
from ._merge import MergeElaborator, measure_pins
from ._session import RunSession, SessionConfig, declaration_of
from .host import Host, ThreadHost
from .model import RecordResult, Report
from .plans import PlanStore, generation_digests
from .reconcile import DefaultReconciler, Reconciler

__all__ = ["PlanScheduler", "Executor", "RunLifecycle"]

#: ``executor(node_input) -> JSON value``; raising fails the node.
Executor = Callable[..., Any]


@runtime_checkable
class RunLifecycle(Protocol):
    """The run driver seam: who makes the run owned before a pass and settles it after. Without one, the caller is
    the driver (the run must already be ``running`` under the scheduler's owner)."""

    def enter(self, run_id: str, plan: Plan) -> None:
        """Make ``run_id`` exist and be owned by the scheduler's owner (called after the plan verified)."""
        ...

    def exit(self, run_id: str, report: Report | None, error: BaseException | None) -> None:
        """The pass ended with ``report`` or raised ``error``; settle or release the run."""
        ...


def _verified(plan: Any) -> Plan:
    from ..plan import verify_plan

    try:
        return verify_plan(plan)
    except PlanError as exc:
        raise SchedulerError(
            "invalid_plan", f"plan refused before anything was written: {exc.message}", cause=exc
        ) from exc


class PlanScheduler:
    """Drives plans for one run. See the module docstring for the contract.

    ``environment``: the runtime identity folded into every sealed dispatch key and fingerprinted per run (plain
    JSON; omit it for none — omission is its own identity). ``concurrency``: ``{"steps": n, "agents": m}``
    (default unbounded). ``host``: where executions run (default: a :class:`ThreadHost` owned by this scheduler).
    ``artifacts``: the artifact store compensable pre-images are kept in. ``reconciler``: judges deviations and
    unabsorbed conflicts (default :class:`DefaultReconciler`)."""

    def __init__(
        self,
        run_id: str,
        owner: OwnerId,
        source_id: str = "scheduler",
        environment: Any = ABSENT,
        concurrency: Concurrency | Mapping[str, Any] | None = None,
        rebase_limit: int = 3,
        *,
        db: Database,
        dispatcher: Any,
        workspace: str | Path,
        host: Host | None = None,
        reconciler: Reconciler | None = None,
        metrics: MetricsPort = NULL_METRICS,
        artifacts: ArtifactStore | None = None,
        journal: Journal | None = None,
        measurer: Measurer | None = None,
        clock: Clock = SYSTEM_CLOCK,
        lifecycle: RunLifecycle | None = None,
        gate: Callable[[Any], None] | None = None,
    ) -> None:
        for name, value in (("run_id", run_id), ("source_id", source_id)):
            if type(value) is not str or not value or "\x00" in value:
                raise SettingsError("invalid_setting", f"{name} {value!r} must be a non-empty string")
        if not isinstance(owner, OwnerId):
            raise SettingsError("invalid_setting", f"owner must be an OwnerId, not {type(owner).__name__}")
        if type(rebase_limit) is not int or rebase_limit < 0:
            raise SettingsError(
                "invalid_setting", f"rebase_limit={rebase_limit!r} must be a non-negative int (default 3)"
            )
        self.run_id = run_id
        self.owner = owner
        self.source_id = source_id
        self.environment = normalize_environment(environment)
        self.concurrency = Concurrency.of(concurrency)
        self.rebase_limit = rebase_limit
        self.db = db
        self.dispatcher = dispatcher
        self.workspace = Path(workspace).resolve()
        self.reconciler: Reconciler = reconciler if reconciler is not None else DefaultReconciler()
        self.metrics = metrics
        self.artifacts = artifacts
        self.clock = clock
        self.journal = journal or Journal(db, clock=clock)
        self.attempts = AttemptStore(db, clock=clock)
        self.plans = PlanStore(db, journal=self.journal, clock=clock)
        self.inputs = InputStore(db, clock=clock)
        self.merge_store = MergeStore(db, clock=clock)
        self._measurer = measurer
        self.lifecycle = lifecycle
        #: ``gate(node)`` for nodes declaring ``approval:`` (the control plane's ``NodeGate``, wired by the runtime):
        #: returns when approved, raises ``RunParked`` while pending, raises an Exception when denied (the node
        #: fails). Checked before the node's attempt begins; without a gate such nodes fail.
        self.gate = gate
        self._own_host = host is None
        self._host: Host | None = host

    # -------------------------------------------------------------------------------------------- plumbing
    @property
    def host(self) -> Host:
        if self._host is None:
            self._host = ThreadHost()
        return self._host

    @property
    def measurer(self) -> Measurer:
        if self._measurer is None:
            self._measurer = Measurer(self.workspace)
        return self._measurer

    def close(self) -> None:
        """Release the host this scheduler created (an injected host belongs to the caller)."""
        if self._own_host and self._host is not None:
            self._host.close()
            self._host = None

    def __enter__(self) -> PlanScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- record / append
    def record(self, plan: Plan) -> RecordResult:
        """Persist generation 0 (and any later generation of ``plan`` not stored yet); journal ``plan-recorded``
        (``subgraph-appended`` for later generations). Idempotent: an identical plan answers AlreadyRecorded."""
        plan = _verified(plan)
        try:
            return self.db.write(lambda conn: self.plans.record_in(conn, plan))
        except SchedulerError:
            raise
        except Exception as exc:
            raise map_error(exc, []) from exc

    def append(self, plan: Plan) -> RecordResult:
        """Persist the newest generation of ``plan`` (its earlier generations must be recorded); journal
        ``subgraph-appended``."""
        plan = _verified(plan)
        if plan.generation == 0:
            raise SchedulerError(
                "invalid_plan",
                f"plan {plan.plan_id!r} has no appended generation; use record() for generation 0",
            )
        parent = generation_digests(plan)[-2]

        def fn(conn: Connection) -> RecordResult:
            if self.plans.load_in(conn, plan.plan_id, parent) is None:
                raise SchedulerError(
                    "invalid_plan",
                    f"the parent generation of plan {plan.plan_id!r} ({parent}) is not recorded; record it first",
                    plan_id=plan.plan_id,
                )
            return self.plans.record_in(conn, plan)

        try:
            return self.db.write(fn)
        except SchedulerError:
            raise
        except Exception as exc:
            raise map_error(exc, []) from exc

    # ------------------------------------------------------------------------------------------------- run
    def run(self, plan: Plan, executor: Executor, defer: Iterable[str] = ()) -> Report:
        """Drive ``plan`` to completion with ``executor(node_input) -> JSON value``; nodes in ``defer``
        (selected sinks) settle ``deferred`` once their dependencies succeeded and never dispatch."""
        plan = _verified(plan)
        if not callable(executor):
            raise SettingsError("invalid_setting", f"executor {executor!r} is not callable")
        selected = self._check_defer(plan, defer)
        declarations = self._declarations(plan)
        if self.lifecycle is None:
            return self._run(plan, executor, selected, declarations)
        self.lifecycle.enter(self.run_id, plan)
        try:
            report = self._run(plan, executor, selected, declarations)
        except BaseException as exc:
            self.lifecycle.exit(self.run_id, None, exc)
            raise
        self.lifecycle.exit(self.run_id, report, None)
        return report

    def _run(
        self, plan: Plan, executor: Executor, selected: tuple[str, ...], declarations: dict[str, Declaration]
    ) -> Report:
        session, merges = self._session(plan, executor, declarations)
        return Coordinator(session, defer=selected, merges=merges).run()

    def _session(
        self, plan: Plan, executor: Executor, declarations: dict[str, Declaration] | None = None
    ) -> tuple[RunSession, MergeElaborator]:
        """Open the run's inputs (create or restore) and build the pass's session; ``plan`` is verified."""
        try:
            run_plan, head, prior, decisions = self._open(plan)
        except SchedulerError:
            raise
        except Exception as exc:
            raise map_error(exc, []) from exc
        if declarations is None or run_plan is not plan:
            declarations = self._declarations(run_plan)
        cfg = SessionConfig(
            run_id=self.run_id,
            owner=self.owner,
            source_id=self.source_id,
            db=self.db,
            journal=self.journal,
            attempts=self.attempts,
            dispatcher=self.dispatcher,
            host=self.host,
            workspace=self.workspace,
            measurer=self.measurer,
            artifacts=self.artifacts,
            environment=self.environment,
            rebase_limit=self.rebase_limit,
            reconciler=self.reconciler,
            metrics=self.metrics,
            concurrency=self.concurrency,
            gate=self.gate,
        )
        session = RunSession(
            cfg,
            run_plan,
            executor,
            pins=head.pins,
            reads=classify_reads(run_plan),
            declarations=declarations,
            prior=prior,
        )
        merges = MergeElaborator(
            plans=self.plans, inputs=self.inputs, store=self.merge_store, decisions=decisions
        )
        return session, merges

    def _check_defer(self, plan: Plan, defer: Iterable[str]) -> tuple[str, ...]:
        if isinstance(defer, str):
            defer = [defer]
        selected = tuple(dict.fromkeys(defer))
        if not selected:
            return selected
        has_dependents = {d for n in plan.nodes for d in n.depends_on}
        for node_id in selected:
            if node_id not in plan:
                raise SchedulerError(
                    "invalid_plan", f"cannot defer {node_id!r}: plan {plan.plan_id!r} has no such node"
                )
            if node_id in has_dependents:
                raise SchedulerError(
                    "invalid_plan",
                    f"cannot defer {node_id!r}: only sinks (nodes nothing depends on) can be deferred; its "
                    "dependents would be skipped instead of repaid",
                    node=node_id,
                )
        return selected

    @staticmethod
    def _declarations(plan: Plan) -> dict[str, Declaration]:
        out: dict[str, Declaration] = {}
        for n in plan.nodes:
            try:
                out[n.id] = declaration_of(n)
            except PlanError as exc:
                raise SchedulerError(
                    "invalid_plan",
                    f"node {n.id!r}: the step boundary cannot honour its effects: {exc.message}",
                    cause=exc,
                    node=n.id,
                ) from exc
        return out

    # ------------------------------------------------------------------------------------- input identity
    def _open(self, plan: Plan) -> tuple[Plan, InputHead, list[Any], list[Any]]:
        """Create or restore the run's input head (see ``_inputs.py``); the plan to run, with its generations."""
        head = self.inputs.load(self.run_id)
        prior = self.attempts.list(self.run_id)
        fingerprint = environment_fingerprint(self.environment)
        if head is None:
            if prior:
                raise SchedulerError(
                    "invalid_plan",
                    f"run {self.run_id!r} has attempts but no recorded input observations (a run started by an "
                    "older runtime): it has no reliable source snapshot; finish it with the runtime that started it "
                    "or start a new run",
                    run_id=self.run_id,
                )
            pins = measure_pins(self.measurer, unpinned_sources(classify_reads(plan), Pins()))

            def create(conn: Connection) -> None:
                assert_owner(conn, self.run_id, self.owner)
                self.plans.record_in(conn, plan)
                self.inputs.create_in(conn, self.run_id, plan, self.environment, pins)
                self._observed(conn, plan, len(pins), fingerprint)

            self.db.write(create)
            return plan, InputHead(self.run_id, plan.plan_id, plan.base_digest, plan.digest, plan.generation,
                                   fingerprint, Pins(pins)), [], []  # fmt: skip
        if head.plan_id != plan.plan_id or head.base_digest != plan.base_digest:
            raise SchedulerError(
                "invalid_plan",
                f"run {self.run_id!r} was started for plan {head.plan_id!r} with base {head.base_digest}; it cannot "
                f"switch to plan {plan.plan_id!r} with base {plan.base_digest} — start a new run for changed work",
                run_id=self.run_id,
            )
        if head.environment_fingerprint != fingerprint:
            raise SchedulerError(
                "invalid_plan",
                f"run {self.run_id!r} was started in another environment ({head.environment_fingerprint}, now "
                f"{fingerprint}); recover it with the original runtime, or reconcile its effects and start a new run",
                run_id=self.run_id,
            )
        stored = self.plans.load(head.plan_id, head.digest)
        if stored is None:
            raise SchedulerError(
                "invalid_plan",
                f"run {self.run_id!r} observed plan generation {head.digest}, which is not stored; the stores are "
                "inconsistent — restore them from a backup or start a new run",
                run_id=self.run_id,
            )
        decisions = self.merge_store.load(self.run_id)
        if plan.digest == stored.digest:
            return stored, head, prior, decisions
        mine, theirs = generation_digests(plan), generation_digests(stored)
        if len(mine) < len(theirs) and theirs[: len(mine)] == mine:
            return stored, head, prior, decisions  # resume the grown plan from its base (or an older prefix)
        if len(mine) > len(theirs) and mine[: len(theirs)] == theirs:
            reads = classify_reads(plan, start=len(stored.nodes))
            pins = measure_pins(self.measurer, unpinned_sources(reads, head.pins))

            def advance(conn: Connection) -> None:
                assert_owner(conn, self.run_id, self.owner)
                self.plans.record_in(conn, plan)
                self.inputs.advance_in(conn, self.run_id, plan, pins)
                self._observed(conn, plan, len(pins), fingerprint)

            self.db.write(advance)
            grown = InputHead(head.run_id, head.plan_id, head.base_digest, plan.digest, plan.generation,
                              fingerprint, head.pins.merged(pins))  # fmt: skip
            return plan, grown, prior, decisions
        raise SchedulerError(
            "invalid_plan",
            f"plan {plan.plan_id!r} ({plan.digest}) diverges from the generations run {self.run_id!r} recorded "
            f"({stored.digest}); resume with the recorded plan or its base, or start a new run",
            run_id=self.run_id,
        )

    def _observed(self, conn: Connection, plan: Plan, sources: int, fingerprint: str) -> None:
        self.journal.append_in(
            conn,
            self.run_id,
            "inputs-observed",
            {
                "plan_id": plan.plan_id,
                "digest": plan.digest,
                "generation": plan.generation,
                "sources": sources,
                "environment": fingerprint,
                "source_id": self.source_id,
            },
        )
