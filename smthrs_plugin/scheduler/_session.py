"""One pass of one run: node preparation (measure → key → replay/refuse/dispatch) and every durable write.

The coordinator (``_coordinator.py``) decides *when*; this module decides *what* and writes it (shared with the naive
reference coordinator of the differential tests, so both write identical journals, attempt rows and cache keys).

- Writes are buffered, then queued in decision order on the pass's commit queue (``_commits.py``): by
  :meth:`RunSession.hand_off` without waiting, by :meth:`RunSession.flush` waiting until they are durable. A
  settlement never commits without its attempt row, and nothing is reported before its commit.
- A job is submitted after its attempt row's begin committed, except a pipelined job (a sealed, non-timer node on
  a host that ``shares_process``), whose begin is queued before it starts and so commits with or before its
  settlement.
- The records and attempt-row columns written for every node are composed from parts validated once
  (``_records.py``); anything else takes the generic, validating path.
- Attempt rows are numbered by this pass (:attr:`RunSession.last_row`); a number already taken is refused by the
  primary key.
- A measurement failure is ``SchedulerError(boundary_unavailable)``, raised before an attempt or cache row exists.
- :meth:`RunSession.fail_running` (after an interrupt) and :meth:`RunSession.cleanup` (any other abort) settle
  unsettled attempts ``failed``.
- A completed attempt of the same node under the same key replays ``clean``; an irreversible node whose previous
  attempt did not complete is refused, a compensable one gets its pre-image restored first.
"""

from __future__ import annotations

import json
import typing as t
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Connection

from .._metrics import MetricsPort
from ..boundary import Declaration
from ..cache.model import DispatchRequest
from ..cache.requests import build_request
from ..cache.requests import declaration_of as request_declaration
from ..canonical import canonical_bytes
from ..errors import ArtifactError, BoundaryError, SchedulerError, passing_fault
from ..plan import Plan, PlanNode
from ..plan.keys import resolve_refs
from ..records.attempts import AttemptRecord, AttemptStore
from ..records.journal import Journal
from ..records.run_fence import fenced_block
from ..records.runs import OwnerId, assert_owner
from ..stores.artifacts import ArtifactStore
from ..stores.database import Database
from ._commits import CommitQueue, Written
from ._inputs import Pins, ReadPlan
from ._preimage import PreImage, capture_preimage, restore_preimage
from ._records import append_record, begin_meta_text, quoted, scheduled_text, settled_text
from .cancel import CancelToken
from .job import NodeJob, SettleSpec, error_line, settled_payload
from .model import Outcome, Report, Settlement
from .reconcile import Deviation, Reconciler, Verdict, verdict_json
from .timer import TIMER_DISPATCHER, check_wait_spec, is_timer, run_timer

if t.TYPE_CHECKING:  # pragma: no cover
    from ..boundary.measure import Measurer

__all__ = ["RunSession", "Prep", "SessionConfig"]

Write = Callable[[Connection], object]


@dataclass(frozen=True)
class SessionConfig:
    """The collaborators and options of one run (built by ``PlanScheduler``)."""

    run_id: str
    owner: OwnerId
    source_id: str
    db: Database
    journal: Journal
    attempts: AttemptStore
    dispatcher: Any
    host: Any
    workspace: Path
    measurer: Measurer
    artifacts: ArtifactStore | None
    environment: Any
    rebase_limit: int
    reconciler: Reconciler
    metrics: MetricsPort
    concurrency: Any
    #: The approval gate of nodes declaring ``approval:`` (``PlanScheduler(gate=...)``); None refuses such nodes.
    gate: Any = None


@dataclass
class Prep:
    """A prepared node attempt: what to write and what to do."""

    node: PlanNode
    attempt: int
    key: str
    action: t.Literal["dispatch", "replay", "refuse"]
    inputs: tuple[Any, ...] = ()
    reads: tuple[tuple[str, str], ...] = ()
    request: DispatchRequest | None = None
    invalidated: tuple[str, str] | None = None
    replayed: AttemptRecord | None = None
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    row: int = 0
    #: Submitted before the transaction beginning its attempt commits (see the module invariants).
    pipelined: bool = False
    #: Admission passes in which capacity left the node waiting before it was admitted (its aging bonus), journaled
    #: in ``node-scheduled``; set by the coordinator that admitted it.
    waited: int = 0


def _ordinal(rec: AttemptRecord) -> int:
    meta = rec.meta if isinstance(rec.meta, dict) else {}
    o = meta.get("ordinal")
    return o if type(o) is int else 0


class RunSession:
    """Scheduling-independent state and durable operations of one pass over ``plan``."""

    def __init__(
        self,
        cfg: SessionConfig,
        plan: Plan,
        executor: Callable[..., Any],
        *,
        pins: Pins,
        reads: Mapping[str, ReadPlan],
        declarations: Mapping[str, Declaration],
        prior: list[AttemptRecord],
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.executor = executor
        self.pins = pins
        self.reads: dict[str, ReadPlan] = dict(reads)
        self.declarations: dict[str, Declaration] = dict(declarations)
        self.positions: dict[str, int] = {n.id: n.position for n in plan.nodes}
        self._nodes: dict[str, PlanNode] = {n.id: n for n in plan.nodes}
        self.results: dict[str, Any] = {}
        self.keys: dict[str, str] = {}
        self.attempts: dict[str, int] = {}
        self.rebases: dict[str, int] = {}
        self.decisions: dict[str, str | None] = {}
        self.settled: dict[str, Settlement] = {}
        self.verdicts: list[Verdict] = []
        self.merges: list[str] = []
        self.deviations: list[Deviation] = []
        self.memo: dict[tuple[str, tuple[str, ...]], str] = {}
        self.open_rows: dict[str, tuple[str, int]] = {}
        #: Interrupts every execution of this pass (``NodeInput.cancel``); cancelled by the coordinator's abort.
        self.cancel = CancelToken()
        #: The pass's commit queue: this session's writes and the settlements of this process's jobs (made on the
        #: coordinator's thread, which is what makes it the coordinator's).
        self.commits = CommitQueue(cfg.db, cfg.run_id, cfg.owner)
        self._pending: list[Write] = []
        self._metric_outcomes: list[Outcome] = []
        #: Shared-tier publications this pass's in-process jobs queued (``published["shared"] == "queued"``),
        #: appended by each job before it returns (list.append: safe from its thread).
        self.publications: list[Future[str]] = []
        #: The last batch of writes queued (what :meth:`flush` waits for).
        self._last: Written | None = None
        #: JSON text of the plan id and of node ids, for composed records (None: not composable).
        self.plan_text = quoted(plan.plan_id)
        self._texts: dict[str, str | None] = {}
        self.prior_by_node: dict[str, list[AttemptRecord]] = {}
        #: The highest attempt row number per key in this run: this pass numbers its attempts itself (it is the
        #: run's only writer, fenced), so a job knows its row before the transaction that begins it commits.
        self.last_row: dict[str, int] = {}
        for rec in prior:
            self.last_row[rec.key] = max(self.last_row.get(rec.key, 0), rec.attempt)
        for rec in prior:
            if rec.node_id is not None:
                self.prior_by_node.setdefault(rec.node_id, []).append(rec)
        for recs in self.prior_by_node.values():
            recs.sort(key=lambda r: (_ordinal(r), r.started_at_ms, r.attempt))

    def node(self, node_id: str) -> PlanNode:
        """``self.plan.node(node_id)`` from a dict of the pass's nodes (a grown plan's new nodes are looked up in
        it; nodes of earlier generations never change)."""
        node = self._nodes.get(node_id)
        return node if node is not None else self.plan.node(node_id)

    # ------------------------------------------------------------------------------------------ writes
    def write(self, fn: Write) -> None:
        """Buffer a coordinator write for the next :meth:`flush`."""
        self._pending.append(fn)

    def hand_off(self) -> None:
        """Queue the buffered writes for the next group commit without waiting (``_commits.py``): the begin of a
        pipelined job is queued before the job starts, so its settlement commits after it."""
        if not self._pending:
            return
        writes, self._pending = self._pending, []
        outcomes, self._metric_outcomes = self._metric_outcomes, []
        self._last = self.commits.push(writes, outcomes)

    def flush(self, *, everything: bool = False) -> None:
        """Queue the buffered writes and return once they (and everything queued before them) committed, in one
        fenced transaction with whatever else was queued meanwhile — leading that commit when no job does — then
        count the settlements made durable. Raises what failed that transaction.

        With nothing buffered it returns at once: writes handed off earlier (the begins of pipelined jobs) commit
        with those jobs' settlements, not in a commit of their own — unless ``everything`` (the end of a pass, an
        abort), which waits for them too."""
        pushed = bool(self._pending)
        self.hand_off()
        last = self._last
        if last is not None and not last.done and (pushed or everything):
            self.commits.drive(last)
        self.count(self.commits.collect())

    def count(self, written: list[Any]) -> None:
        """Count the journaled settlements of committed batches (their :meth:`hand_off` tags)."""
        metrics = self.cfg.metrics
        for outcomes in written:
            for o in outcomes:
                metrics.node_settled(o)

    def node_text(self, node_id: str) -> str | None:
        """The JSON text of a node id (None: not composable), written once per pass."""
        try:
            return self._texts[node_id]
        except KeyError:
            text = self._texts[node_id] = quoted(node_id)
            return text

    def journal(self, type_: str, payload: dict[str, Any]) -> None:
        run_id = self.cfg.run_id
        self.write(lambda conn: self.cfg.journal.append_in(conn, run_id, type_, payload))

    def _append_text(self, type_: str, text: str) -> None:
        run_id, journal = self.cfg.run_id, self.cfg.journal
        self.write(lambda conn: journal.append_canonical_in(conn, run_id, type_, text))

    def record(
        self, node_id: str, outcome: Outcome, *, journal: bool, error: str | None = None
    ) -> Settlement:
        """Remember how ``node_id`` settled; journal ``node-settled`` unless a job already did. A journaled
        ``deferred`` settlement is preceded by its ``selection-deferred`` record (``plan_id``, ``node_id``,
        ``plan_key``): the debt opens under the plan key before the settlement that results from it, and only here —
        a node is deferred only when its dependencies succeeded, so a failed cone never opens selection debt."""
        node = self.node(node_id)
        s = Settlement(
            node=node_id,
            outcome=outcome,
            plan_key=node.key,
            dispatch_key=self.keys.get(node_id),
            attempts=self.attempts.get(node_id, 0),
            rebases=self.rebases.get(node_id, 0),
            cache_decision=self.decisions.get(node_id),
            error=error,
        )
        self.settled[node_id] = s
        if journal:
            if outcome == "deferred":
                self.journal(
                    "selection-deferred",
                    {"plan_id": self.plan.plan_id, "node_id": node_id, "plan_key": node.key},
                )
            text = settled_text(
                self.plan_text,
                self.node_text(node_id),
                node.key,
                s.dispatch_key,
                outcome,
                s.attempts,
                s.rebases,
            )
            if text is not None:
                self._append_text("node-settled", text)
            else:
                self.journal(
                    "node-settled",
                    settled_payload(
                        self.plan.plan_id, node_id, node.key, s.dispatch_key, outcome, s.attempts, s.rebases
                    ),
                )
            self._metric_outcomes.append(outcome)
        else:
            self.cfg.metrics.node_settled(outcome)
        return s

    def set_result(self, node_id: str, value: Any, value_json: str | None = None) -> None:
        """Remember a node's value in its stored (canonical JSON) form, so every consumer — a downstream
        executor, a key, the report — sees the same value whether it was built now, replayed or served.
        ``value_json``: its canonical text when the job already wrote it."""
        if value is None:
            self.results[node_id] = None
        else:
            self.results[node_id] = json.loads(canonical_bytes(value) if value_json is None else value_json)

    def record_deviation(self, d: Deviation) -> None:
        self.deviations.append(d)
        self.journal("deviation-recorded", {"plan_id": self.plan.plan_id, **d.to_json()})

    def record_verdict(self, v: Verdict) -> None:
        self.verdicts.append(v)
        self.journal("node-reconciled", {"plan_id": self.plan.plan_id, "verdict": verdict_json(v)})

    # ---------------------------------------------------------------------------------------- preparation
    def _read_set(self, node: PlanNode) -> tuple[tuple[str, str], ...]:
        rp = self.reads[node.id]
        pairs: dict[str, str] = {}
        for e in rp.sources:
            pairs.update(self.pins.files(e))
        if rp.produced:
            try:
                measured = self.cfg.measurer.measure_entries(rp.produced)
            except BoundaryError as exc:
                raise SchedulerError(
                    "boundary_unavailable",
                    f"the produced inputs of node {node.id!r} cannot be measured: {exc.message}",
                    cause=exc,
                    node=node.id,
                ) from exc
            for p, st in measured.items():
                pairs[p] = st.digest if st is not None else "absent"
        return tuple(sorted(pairs.items()))

    def prepare(self, node_id: str, *, rebase: bool) -> Prep:
        """Measure, key and decide one attempt of ``node_id`` (counts the attempt). May raise
        ``SchedulerError(boundary_unavailable | key_uncomputable)``; writes nothing itself."""
        cfg = self.cfg
        node = self.node(node_id)
        draft = node.draft
        attempt = self.attempts[node_id] = self.attempts.get(node_id, 0) + 1
        refs = resolve_refs(draft, self.results)
        tier = draft.material.tier
        # The one request builder picks the key kind (content, or run-local: non-sealed tiers and timer nodes)
        # and records the explain components in the shape a @step's have (cache/requests.py).
        request = build_request(
            draft,
            run_id=cfg.run_id,
            workspace=cfg.workspace,
            reads=self._read_set(node),
            declaration=self.declarations[node_id],
            ref_values=refs,
            environment=cfg.environment,
            plan_id=self.plan.plan_id,
            node_key=node.key,
            attempt=attempt,
            memo=self.memo,
            owner=cfg.owner,
        )
        key, reads = request.key, request.reads
        prior = self.prior_by_node.get(node_id, [])
        previous = self.keys.get(node_id)
        invalidated: tuple[str, str] | None = None
        if rebase and previous is not None:
            invalidated = (previous, "materialization-conflict")
        elif previous is None and prior and prior[-1].key != key:
            invalidated = (prior[-1].key, "measured-inputs-changed")
        self.keys[node_id] = key
        inputs = tuple(refs[i] for i in sorted(refs))
        base_ordinal = max((_ordinal(r) for r in prior), default=0)
        meta: dict[str, Any] = {
            "plan_id": self.plan.plan_id,
            "node_id": node_id,
            "tier": tier,
            "ordinal": base_ordinal + attempt,
        }
        prep = Prep(node, attempt, key, "dispatch", inputs, reads, invalidated=invalidated, meta=meta)
        if not rebase:
            done = [r for r in prior if r.key == key and r.state == "completed"]
            if done:
                prep.action, prep.replayed = "replay", done[-1]
                return prep
        if draft.approval is not None and not rebase:
            refused = self._gate(node)
            if refused is not None:
                prep.action, prep.error = "refuse", refused
                return prep
        unfinished = bool(prior) and prior[-1].state != "completed" and not rebase
        if tier == "irreversible" and unfinished:
            prep.action = "refuse"
            prep.error = (
                f"irreversible node {node_id!r} has an attempt in this run that did not complete "
                f"({prior[-1].state}); uncertain recovery and retries of irreversible work are refused — "
                "reconcile its effects by hand, then start a new run"
            )
            return prep
        if tier == "compensable":
            self._compensate(node, prior[-1] if unfinished else None, meta)
        prep.request = request
        return prep

    def _gate(self, node: PlanNode) -> str | None:
        """Ask the approval gate BEFORE the node's attempt begins and before any cache lookup (a gated node must not
        be served or started unapproved): None when approved; the refusal line when denied (the node fails); a
        pending request raises the gate's ``RunParked`` (a BaseException), which stops the pass with no attempt of
        this node begun, so a resumed run asks again rather than finding uncertain irreversible work."""
        gate = self.cfg.gate
        if gate is None:
            return (
                f"node {node.id!r} declares an approval gate and this scheduler has none; run the plan through the "
                "runtime (open_runtime(...).scheduler) or the control plane (smthrs run --key), which enforce it"
            )
        try:
            gate(node)
        except Exception as exc:  # a denial (ApprovalDenied) or a refused gate spec: the node's outcome
            if passing_fault(exc) is not None:
                raise  # the store failed under the gate: no decision was read, the run stays resumable
            return error_line(exc)
        return None

    def _compensate(self, node: PlanNode, retry_of: AttemptRecord | None, meta: dict[str, Any]) -> None:
        cfg = self.cfg
        if cfg.artifacts is None:
            raise SchedulerError(
                "boundary_unavailable",
                f"compensable node {node.id!r} needs an artifact store to capture its pre-image; pass artifacts=",
                node=node.id,
            )
        try:
            if retry_of is not None:
                image_doc = (retry_of.meta or {}).get("preimage") if isinstance(retry_of.meta, dict) else None
                if image_doc is None:
                    raise SchedulerError(
                        "boundary_unavailable",
                        f"compensable node {node.id!r}: its unfinished attempt recorded no pre-image, so its "
                        "effects cannot be compensated; reconcile them by hand and start a new run",
                        node=node.id,
                    )
                restored = restore_preimage(
                    cfg.workspace, cfg.measurer, node.effects, PreImage.from_json(image_doc), cfg.artifacts
                )
                meta["restored"] = {"rewritten": list(restored.rewritten), "removed": list(restored.removed)}
            meta["preimage"] = capture_preimage(
                cfg.workspace, cfg.measurer, node.effects, cfg.artifacts
            ).to_json()
        except (BoundaryError, ArtifactError, OSError) as exc:
            raise SchedulerError(
                "boundary_unavailable",
                f"compensable node {node.id!r}: its pre-image could not be captured or restored ({exc})",
                cause=exc,
                node=node.id,
            ) from exc

    # -------------------------------------------------------------------------------------------- dispatch
    def begin(self, prep: Prep) -> None:
        """Buffer the attempt start: ``node-invalidated`` (if the key moved), the attempt row, ``node-scheduled``
        (with ``waited``: the admission passes in which capacity left the node waiting before it was admitted)."""
        cfg = self.cfg
        node_id = prep.node.id
        if prep.invalidated is not None:
            self.journal(
                "node-invalidated",
                {
                    "plan_id": self.plan.plan_id,
                    "node_id": node_id,
                    "from": prep.invalidated[0],
                    "to": prep.key,
                    "reason": prep.invalidated[1],
                },
            )

        row = prep.row = self.last_row[prep.key] = self.last_row.get(prep.key, 0) + 1
        self.open_rows[node_id] = (prep.key, row)
        key, meta = prep.key, prep.meta
        meta_json = begin_meta_text(meta)
        scheduled = scheduled_text(self.plan_text, self.node_text(node_id), key, prep.attempt, prep.waited)
        payload = (
            None
            if scheduled is not None
            else {
                "plan_id": self.plan.plan_id,
                "node_id": node_id,
                "dispatch_key": key,
                "attempt": prep.attempt,
                "waited": prep.waited,
            }
        )

        def start(conn: Connection) -> None:
            if meta_json is not None:
                cfg.attempts.begin_text_in(
                    conn, cfg.run_id, cfg.owner, key, attempt=row, node_id=node_id, meta_json=meta_json
                )
            else:
                cfg.attempts.begin_in(
                    conn, cfg.run_id, cfg.owner, key, attempt=row, node_id=node_id, meta=meta
                )
            append_record(cfg.journal, conn, cfg.run_id, "node-scheduled", scheduled, lambda: payload)

        self.write(start)

    def submit(self, prep: Prep) -> Future[Any]:
        """Hand a begun attempt to the host (after the transaction that began it committed)."""
        cfg = self.cfg
        node = prep.node
        decl = self.declarations[node.id]
        spec = SettleSpec(
            run_id=cfg.run_id,
            owner=cfg.owner,
            plan_id=self.plan.plan_id,
            node_id=node.id,
            plan_key=node.key,
            key=prep.key,
            attempt=prep.attempt,
            row=prep.row,
            rebases=self.rebases.get(node.id, 0),
            meta=prep.meta,
            plan_text=self.plan_text,
            node_text=self.node_text(node.id),
        )
        # The request ``prepare()`` built (cache.requests.build_request, the one builder): the key it recorded is
        # the key this attempt dispatches under.
        request = prep.request
        assert request is not None, "submit() of a prep that prepare() did not build a request for"
        timer = is_timer(node)  # a durable clock, dispatched around the cache (timer.py)
        job = NodeJob(
            db=cfg.db,
            dispatcher=TIMER_DISPATCHER if timer else cfg.dispatcher,
            executor=run_timer if timer else self.executor,
            request=request,
            spec=spec,
            node=node,
            inputs=prep.inputs,
            boundary=decl.mode,
            cancel=self.cancel,
            commits=self.commits,
            publications=self.publications,
            pipelined=prep.pipelined,
        )
        fut = t.cast("Future[Any]", cfg.host.submit(job))
        self.commits.watch(fut)
        return fut

    def replay_value(self, prep: Prep) -> tuple[Any, tuple[Deviation, ...]]:
        rec = prep.replayed
        assert rec is not None
        meta = rec.meta if isinstance(rec.meta, dict) else {}
        devs = tuple(
            Deviation(prep.node.id, str(d["kind"]), tuple(d["paths"])) for d in meta.get("deviations") or ()
        )
        self.decisions[prep.node.id] = "VerifiedHit"
        return rec.result, devs

    # --------------------------------------------------------------------------------------------- cleanup
    def await_publications(self) -> list[BaseException]:
        """Wait for the shared-tier publications this pass's builds queued and return their failures. Their
        records are fenced by this pass's owner (``cache/dispatch.py``): they must be written while it still holds
        the run, so a pass never returns, parks or fails before them."""
        errors: list[BaseException] = []
        for fut in self.publications:
            try:
                fut.result()
            except BaseException as exc:  # returned: the caller raises it, or reports it with its own error
                errors.append(exc)
        self.publications.clear()
        return errors

    def fail_running(self) -> list[BaseException]:
        """After an interrupt: mark every attempt this owner still has ``started`` in the run ``failed``, each with
        its ``attempt-finished`` record, in ONE fenced transaction (a lost fence writes nothing). Returns the
        failures (the caller's error stays primary)."""
        cfg = self.cfg
        # The coordinator held its commit queue first (``Coordinator._abort``): no group commits until it closes,
        # so nothing begins or settles behind this marking. The writes it took off the queue commit here, first:
        # they hold the begins of pipelined jobs whose bodies already run, and a body that ran must have its
        # attempt (marked below). Writes still buffered were never handed off: no job of theirs started.
        self.commits.hold()
        held = self.commits.take_held()
        self._pending = []
        error = {
            "type": "interrupted",
            "message": "a typed scheduler failure interrupted this pass before the attempt settled",
        }

        def fn(conn: Connection) -> None:
            if held:
                with fenced_block(conn, cfg.run_id, cfg.owner):
                    for w in held:
                        w(conn)
            for rec in cfg.attempts.fail_started_in(conn, cfg.run_id, cfg.owner, error=error):
                meta = rec.meta if isinstance(rec.meta, dict) else {}
                cfg.journal.append_in(
                    conn,
                    cfg.run_id,
                    "attempt-finished",
                    {
                        "plan_id": meta.get("plan_id", self.plan.plan_id),
                        "node_id": rec.node_id,
                        "dispatch_key": rec.key,
                        "attempt": rec.attempt,
                        "outcome": "failed",
                    },
                )

        try:
            cfg.db.write(fn)
        except BaseException as exc:  # reported as cleanup_errors; the original error stays primary
            return [exc]
        self.open_rows.clear()
        return []

    def cleanup(self) -> list[BaseException]:
        """Mark attempts begun in this pass and never settled ``failed`` (with ``attempt-finished``), in one
        transaction. Returns the failures (the caller's error stays primary)."""
        cfg = self.cfg
        rows = dict(self.open_rows)
        self._pending = []
        if not rows:
            return []
        open_rows = {k: v for k, v in rows.items()}

        def fn(conn: Connection) -> None:
            assert_owner(conn, cfg.run_id, cfg.owner)
            for node_id, (key, row) in sorted(open_rows.items()):
                state = cfg.attempts.state_in(conn, cfg.run_id, key, row)
                if state != "started":
                    continue  # its job settled it (or a terminal row: never overwritten)
                cfg.attempts.fail(
                    cfg.run_id,
                    cfg.owner,
                    key,
                    row,
                    error={
                        "type": "interrupted",
                        "message": "the scheduler stopped before this attempt settled",
                    },
                )
                cfg.journal.append_in(
                    conn,
                    cfg.run_id,
                    "attempt-finished",
                    {
                        "plan_id": self.plan.plan_id,
                        "node_id": node_id,
                        "dispatch_key": key,
                        "attempt": row,
                        "outcome": "failed",
                    },
                )

        try:
            cfg.db.write(fn)
        except BaseException as exc:  # reported as cleanup_errors; the original error stays primary
            return [exc]
        return []

    # ---------------------------------------------------------------------------------------------- report
    def report(self) -> Report:
        missing = [n.id for n in self.plan.nodes if n.id not in self.settled]
        if missing:
            raise SchedulerError(
                "store_failed",
                f"internal: the run ended with unsettled nodes {missing[:10]}",
                nodes=len(missing),
            )
        return Report(
            plan_id=self.plan.plan_id,
            digest=self.plan.digest,
            settlements=tuple(self.settled[n.id] for n in self.plan.nodes),
            results={
                n.id: self.results[n.id]
                for n in self.plan.nodes
                if self.settled[n.id].outcome in ("built", "clean")
            },
            verdicts=tuple(self.verdicts),
            merges=tuple(self.merges),
        )

    def error_of(self, error: BaseException | None) -> str | None:
        return error_line(error)


def declaration_of(node: PlanNode) -> Declaration:
    """The boundary declaration of a node (``PlanError`` for one the boundary cannot honour, e.g. a glob removal,
    or for a malformed ``wait:`` timer spec: refused with the other declarations, before anything is written)."""
    if is_timer(node):
        check_wait_spec(node.id, node.draft.wait)  # type: ignore[arg-type]
    return request_declaration(node.draft)
