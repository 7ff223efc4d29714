"""The unit a host runs: one node attempt through the cache dispatch seam, settled durably in the seam's
own write transaction.

Invariants
- A job is plain data (ids, keys, the plan node, the owner, the database handle — which pickles as its URL)
  plus two callables that pickle by reference: the dispatcher and the executor. It never carries an engine,
  an open file or a closure, so a process host can run it.
- The attempt row the coordinator began is settled (``completed`` with the node's value, or ``failed`` with its
  error) *inside* the dispatch seam's write transaction (``DispatchRequest.on_settled``), with its
  ``attempt-finished`` journal record and — when the dispatch alone decides the node's outcome — its
  ``node-settled`` record: the local cache row, the attempt row and the settlement commit together or not at
  all. The outcome is final when the node succeeded without deviations, or failed for any reason but a
  materialisation conflict; otherwise the coordinator decides (reconciliation, rebase, stop-merge).
- If the seam returns without having called the hook (it refused before recording anything), the job settles
  the attempt itself, in its own fenced transaction: an attempt row is never left ``started`` by a job that
  returned.
- An executor's value must be plain JSON: anything else fails the node (typed ``CanonicalError``), never the
  run.
- The executor receives the pass's cancellation token as ``NodeInput.cancel`` (``cancel.py``): a typed scheduler
  failure cancels it and marks the attempt ``failed`` first, so an interrupted job's own settlement finds a
  terminal row and writes nothing (``AttemptStore`` refuses to settle an attempt twice).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Connection

from ..cache.model import DispatchRequest, DispatchResult
from ..canonical import canonical_bytes
from ..errors import CanonicalError, MaterializationConflict, SchedulerError, SmthrsError
from ..plan import PlanNode
from ..records.attempts import AttemptStore
from ..records.journal import Journal
from ..records.runs import OwnerId
from ..stores.database import Database
from ._commits import CommitQueue
from ._records import append_record, finished_text, settle_meta_text, settled_text
from .cancel import CancelToken
from .host import body_returned
from .model import NodeInput, Outcome

__all__ = [
    "SettleSpec",
    "NodeJob",
    "JobOutcome",
    "final_outcome",
    "is_conflict",
    "error_json",
    "error_line",
    "settled_payload",
]


def is_conflict(error: BaseException | None) -> bool:
    """A copy-back compare-and-set refusal (the sandbox's ``MaterializationConflict``)."""
    return isinstance(error, MaterializationConflict) or (
        isinstance(error, SmthrsError) and error.code == "materialization_conflict"
    )


def final_outcome(result: DispatchResult) -> Outcome | None:
    """The node outcome a dispatch decides on its own, or ``None`` when the coordinator must decide."""
    if result.outcome in ("built", "clean"):
        return None if result.deviations else result.outcome
    return None if is_conflict(result.error) else "failed"


def error_line(error: BaseException | None) -> str | None:
    if error is None:
        return None
    if isinstance(error, SmthrsError):
        return f"{type(error).__name__}[{error.code}]: {error.message}"
    return f"{type(error).__name__}: {error}"


def error_json(error: BaseException | None) -> dict[str, Any]:
    if error is None:
        return {"type": "unknown", "message": "the dispatch failed without an error"}
    out: dict[str, Any] = {"type": type(error).__name__, "message": str(error)}
    if isinstance(error, SmthrsError):
        out["code"] = error.code
        out["message"] = error.message
    return out


@dataclass(frozen=True)
class SettleSpec:
    """What the job writes when its dispatch settles. ``attempt`` counts this node's dispatches in this pass;
    ``row`` is the attempt row's number under ``key`` (begun by the coordinator). ``plan_text``/``node_text``: the
    JSON text of ``plan_id``/``node_id`` when the coordinator could write it (``_records.quoted``), for the
    records this job composes."""

    run_id: str
    owner: OwnerId
    plan_id: str
    node_id: str
    plan_key: str
    key: str
    attempt: int
    row: int
    rebases: int
    meta: dict[str, Any]
    plan_text: str | None = None
    node_text: str | None = None


def settled_payload(
    plan_id: str, node_id: str, plan_key: str, key: str | None, outcome: str, attempts: int, rebases: int
) -> dict[str, Any]:
    """``node-settled {plan_id, node_id, plan_key, dispatch_key?, outcome, attempts, rebases}``."""
    out: dict[str, Any] = {"plan_id": plan_id, "node_id": node_id, "plan_key": plan_key}
    if key is not None:
        out["dispatch_key"] = key
    out.update(outcome=outcome, attempts=attempts, rebases=rebases)
    return out


@dataclass(frozen=True)
class JobOutcome:
    """A finished job. ``final`` is the outcome journaled with the attempt (``None``: the coordinator decides).
    ``value_json``: the canonical JSON text of ``result.value`` when the job wrote it (None: not known)."""

    node_id: str
    result: DispatchResult
    final: Outcome | None
    value_json: str | None = None


class _State:
    """Per-job scratch: the executor's value and its canonical text, as :meth:`NodeJob._execute` checked them, and
    whether a settlement of this job committed (set by its ``on_commit`` callback, read by the job's own thread
    after the commit released it)."""

    __slots__ = ("value", "text", "settled")

    def __init__(self) -> None:
        self.value: Any = _UNSET
        self.text = ""
        self.settled = False

    def mark_settled(self) -> None:
        self.settled = True

    def text_of(self, value: Any) -> str | None:
        """The canonical text of ``value`` when it is the very value the executor returned."""
        return self.text if self.value is value and value is not _UNSET else None


_UNSET = object()
_SAFE_INT = 2**53 - 1


def _scalar_text(value: Any) -> str | None:
    """The canonical text of a null, boolean, JSON-safe int or ASCII string (None for anything else: the caller
    encodes it generically): the values most nodes return, without the generic walk."""
    if value is None:
        return "null"
    t = type(value)
    if t is bool:
        return "true" if value else "false"
    if t is int and -_SAFE_INT <= value <= _SAFE_INT:
        return str(value)
    if t is str and value.isascii():
        return encode_basestring(value)
    return None


def _value_text(value: Any) -> str | None:
    """The canonical text of ``value``; None when it has none (the generic path then refuses it as it always did)."""
    text = _scalar_text(value)
    if text is not None:
        return text
    try:
        return canonical_bytes(value).decode("utf-8")
    except CanonicalError:
        return None


#: ``dataclasses.replace`` re-runs ``__init__`` over every field of a request (a measurable share of a no-op node):
#: a request without ``__post_init__`` or slots is copied by its fields instead, which is the same object.
_PLAIN_REQUEST = not hasattr(DispatchRequest, "__post_init__") and not hasattr(DispatchRequest, "__slots__")


def _hooked(request: DispatchRequest, on_settled: Any, commit: Any) -> DispatchRequest:
    """``replace(request, on_settled=..., commit=...)``."""
    if not _PLAIN_REQUEST or type(request) is not DispatchRequest:
        return replace(request, on_settled=on_settled, commit=commit)
    new = object.__new__(DispatchRequest)
    fields = new.__dict__
    fields.update(request.__dict__)
    fields["on_settled"] = on_settled
    fields["commit"] = commit
    return new


#: The stores a settlement writes through, per database URL (stateless handles: made once per process).
_STORES: dict[str, tuple[AttemptStore, Journal]] = {}


def _stores(db: Database) -> tuple[AttemptStore, Journal]:
    stores = _STORES.get(db.url)
    if stores is None or stores[0].db.sqlite_synchronous != db.sqlite_synchronous:
        stores = _STORES[db.url] = (AttemptStore(db), Journal(db))
    return stores


def _decision_tag(result: DispatchResult) -> str | None:
    return None if result.decision is None else str(result.decision.tag)


@dataclass(frozen=True)
class NodeJob:
    """One node attempt for a host. ``request`` has no hook yet: :meth:`run` adds it."""

    db: Database
    dispatcher: Any
    executor: Callable[[NodeInput], Any]
    request: DispatchRequest
    spec: SettleSpec
    node: PlanNode
    inputs: tuple[Any, ...]
    boundary: str
    #: The pass's cancellation token, handed to the executor as ``NodeInput.cancel`` (pickles as a fresh token).
    cancel: CancelToken = field(default_factory=CancelToken, repr=False, compare=False)
    #: The coordinator's commit queue (``_commits.py``): in its process, the settlement commits in the
    #: coordinator's transaction. It never pickles: a job in another process commits itself, fenced.
    commits: CommitQueue | None = field(default=None, repr=False, compare=False)
    #: Started before its attempt row committed (``_session.py``, pipelining): its settlement MUST commit through
    #: ``commits``, after that row.
    pipelined: bool = False
    #: The coordinator's list of shared-tier publications queued by its in-process jobs, which it waits for before
    #: its pass ends (``_session.py``). It never pickles: elsewhere a job's dispatcher publishes inline.
    publications: list[Future[str]] | None = field(default=None, repr=False, compare=False)
    _state: _State = field(default_factory=_State, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_state", None)
        state["commits"] = None
        state["publications"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "__dict__", {**state, "_state": _State()})

    # -- executor side ---------------------------------------------------------------------------------------
    def _execute(self, root: Path) -> Any:
        workspace = self.request.workspace
        value = self.executor(
            NodeInput(
                node=self.node,
                attempt=self.spec.attempt,
                inputs=self.inputs,
                root=root if isinstance(root, Path) else Path(root),
                key=self.spec.key,
                boundary=self.boundary,
                cancel=self.cancel,
                workspace=workspace if isinstance(workspace, Path) else Path(workspace),
                declaration=self.request.declaration,
            )
        )
        try:
            # Kept with the value: the settlement stores this text, and the coordinator decodes it, unless the
            # dispatcher settles another object (then each encodes it again).
            self._state.text = _scalar_text(value) or canonical_bytes(value).decode("utf-8")
            self._state.value = value
        except CanonicalError as exc:
            raise CanonicalError(
                "not_canonicalizable",
                f"node {self.node.id!r} returned a value that is not plain JSON ({exc.message}); return dicts, "
                "lists, strings, finite numbers, booleans or None",
                cause=exc,
            ) from exc
        return value

    # -- settlement --------------------------------------------------------------------------------------------
    def _settle(self, conn: Connection, result: DispatchResult) -> None:
        s = self.spec
        if self.pipelined and not CommitQueue.serving():
            # Its attempt row may not exist yet: only the coordinator's flush orders the two.
            raise SchedulerError(
                "store_failed",
                f"the dispatcher settled node {s.node_id!r} in a transaction of its own; a dispatcher must commit "
                "the transaction that calls request.on_settled through request.commit (see DispatchRequest)",
                node=s.node_id,
            )
        attempts, journal = _stores(self.db)
        final = final_outcome(result)
        decision = _decision_tag(result)
        value_json: str | None = None
        if result.outcome in ("built", "clean"):
            value_json = self._state.text_of(result.value)
            if value_json is None:
                # A hit's value (decoded from its entry; the executor never ran) or one the dispatcher substituted:
                # encoded once here for the row and the coordinator, not by the generic path and again by it.
                value_json = _value_text(result.value)
            meta_json = settle_meta_text(s.meta, result.outcome, decision, list(result.deviations))
            if value_json is not None and meta_json is not None:
                attempts.complete_text_in(
                    conn,
                    s.run_id,
                    s.owner,
                    s.key,
                    s.row,
                    result_json=None if result.value is None else value_json,
                    meta_json=meta_json,
                )
            else:
                attempts.complete_in(
                    conn,
                    s.run_id,
                    s.owner,
                    s.key,
                    s.row,
                    result=result.value,
                    meta=self._meta(result, decision),
                )
        else:
            meta = self._meta(result, decision)
            meta["conflict"] = is_conflict(result.error)
            attempts.fail_in(conn, s.run_id, s.owner, s.key, s.row, error=error_json(result.error), meta=meta)
        append_record(
            journal,
            conn,
            s.run_id,
            "attempt-finished",
            finished_text(s.plan_text, s.node_text, s.key, s.row, result.outcome),
            lambda: {
                "plan_id": s.plan_id,
                "node_id": s.node_id,
                "dispatch_key": s.key,
                "attempt": s.row,
                "outcome": result.outcome,
            },
        )
        if final is not None:
            append_record(
                journal,
                conn,
                s.run_id,
                "node-settled",
                settled_text(s.plan_text, s.node_text, s.plan_key, s.key, final, s.attempt, s.rebases),
                lambda: settled_payload(s.plan_id, s.node_id, s.plan_key, s.key, final, s.attempt, s.rebases),
            )
        self.db.on_commit(self._state.mark_settled)
        # The coordinator learns this outcome from the commit itself (``_commits.py``), not from the return.
        CommitQueue.settled(JobOutcome(s.node_id, result, final, value_json))

    def _meta(self, result: DispatchResult, decision: str | None) -> dict[str, Any]:
        return {
            **self.spec.meta,
            "outcome": result.outcome,
            "decision": decision,
            "deviations": [{"kind": d.kind, "paths": list(d.paths)} for d in result.deviations],
        }

    def _queued_commit(self, fn: Callable[[Connection], Any]) -> Any:
        """Commit a settle transaction through the coordinator's queue. The body returned by now (the seam commits
        its settlement after the body), so the host may start another job and the coordinator may free this node's
        permit while the settlement waits for its group: a group commit then holds every settlement that is ready,
        not only one per permit. Its outcome is still learned only from the commit."""
        assert self.commits is not None
        body_returned()
        return self.commits.commit(fn, returned=self.spec.node_id)

    def run(self) -> JobOutcome:
        """Dispatch through the seam; settle the attempt durably (see the module invariants)."""
        if self.pipelined and self.commits is None:
            raise SchedulerError(
                "store_failed",
                f"node {self.spec.node_id!r} started before its attempt row committed, in another process than its "
                "coordinator; a host that runs jobs elsewhere must not declare shares_process",
                node=self.spec.node_id,
            )
        commit = self.db.write_batched if self.commits is None else self._queued_commit
        request = _hooked(self.request, self._settle, commit)
        result: DispatchResult = self.dispatcher.dispatch(request, self._execute)
        if result.publication is not None and self.publications is not None:
            # Before this job returns: the coordinator waits for it before its pass ends (RunSession.await_publications).
            self.publications.append(result.publication)
        if not self._state.settled:
            commit(lambda conn: self._settle(conn, result))
        return JobOutcome(self.spec.node_id, result, final_outcome(result), self._state.text_of(result.value))
