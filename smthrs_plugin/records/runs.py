"""The runs owner: every run-row transition, the fence, and the only decoder of a run row.

- One owner: every statement on ``runs`` and ``run_tombstones``, and the read of the revision watermark
  (:func:`watermark_in`), is here or in its parts ``_run_rows``/``run_fence``. Callers compose ONE transaction
  through the ``*_in(conn, ...)`` functions and ``bump_run*``.
- Every run-row mutation takes a new global revision in its transaction: revision order is commit order.
- Deleting a run leaves a ``run_tombstones`` row forever; recreating the id gives a strictly newer live revision.
- ``record_run_parent(child, parent)`` is first writer wins per pair; a cycle rolls back (``RunParentCycleError``).
- ``finish`` and ``suspend`` are fenced (:func:`assert_owner`); a terminal transition of a run with a cancellation
  requested settles ``cancelled`` and answers :class:`Cancelled`. Every transition journals its record, with the
  run's execution fact, in the same transaction.
- List reads skip a row that does not decode, with ONE warning naming its key; point reads fail ``decode_failed``.
"""

from __future__ import annotations

import builtins
import enum
import logging
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql.elements import ColumnElement

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import canonical_bytes
from ..errors import StoreError
from ..stores.database import Database
from ..stores.schema import RUN_STATUSES, TERMINAL_STATUSES, meta, run_tombstones, runs
from ..stores.statements import DriverStatement
from ._run_rows import (
    BASELINE_CREATED,
    BASELINE_LEGACY,
    CLEAR_CLAIM,
    CLEAR_OWNER,
    CLEAR_WAIT,
    FACT_VERSION,
    OBSERVED_COLUMNS,
    CancelAck,
    OwnerId,
    RunRecord,
    Undecodable,
    Waiting,
    check_id,
    current_owner,
    decode_run,
    decode_run_or_raise,
    execution_fact,
    fact_of,
    json_column,
    json_text,
    observation_of,
    observed_row_in,
    suspend_payload,
    suspend_values,
    waiting_for,
)
from .control import admitted_clause
from .journal import Journal
from .run_dag import (
    ParentExisting,
    ParentRecorded,
    RunEdge,
    children_select,
    cycle_error,
    edges,
    first_parent_of,
    has_no_edge,
    record_parent,
)
from .run_fence import (
    OWNED,
    FenceRow,
    Guard,
    RunUpdate,
    assert_owner,
    bump_run,
    bump_run_journaled,
    bump_run_observed,
    remember_observed,
    update_run,
)

__all__ = [
    "RunStore",
    "RunRecord",
    "Waiting",
    "CancelAck",
    "Created",
    "Existing",
    "CancelRequested",
    "AlreadyRequested",
    "AlreadyTerminal",
    "NotFound",
    "CancelAcknowledged",
    "AlreadyAcknowledged",
    "NotRequested",
    "Deleted",
    "ParentRecorded",
    "ParentExisting",
    "RunEdge",
    "Settled",
    "Cancelled",
    "Suspended",
    "Tombstone",
    "MAX_LIST_LIMIT",
    "waiting_for",
    # identity, row shape and decoder (_run_rows)
    "OwnerId",
    "current_owner",
    "CLEAR_OWNER",
    "CLEAR_CLAIM",
    "CLEAR_WAIT",
    "FACT_VERSION",
    "BASELINE_CREATED",
    "BASELINE_LEGACY",
    "observed_row_in",
    "OBSERVED_COLUMNS",
    "observation_of",
    "execution_fact",
    "fact_of",
    "Undecodable",
    "decode_run",
    "decode_run_or_raise",
    "json_column",
    "json_text",
    # the fence and the transition statement (_run_fence)
    "assert_owner",
    "FenceRow",
    "OWNED",
    "RunUpdate",
    "Guard",
    "update_run",
    "bump_run",
    "bump_run_observed",
    "bump_run_journaled",
    "remember_observed",
    # ownership statements (claim, activate, heartbeat)
    "row_in",
    "RESERVE",
    "ACTIVATE",
    "ACTIVATE_UNADMITTED",
    "HEARTBEAT",
    "RUN_STATUSES",
    "TERMINAL_STATUSES",
    # point reads and claim transitions the control plane judges on
    "record_in",
    "status_in",
    "RunRow",
    "run_row_in",
    "clear_claim_if_in",
    # projections' reads (observe)
    "watermark_in",
    "changes_after_in",
    "changes_at_in",
    "records_in",
    "tombstone_revisions_in",
    "round_keys_in",
    "Unconstrained",
    "ANY",
    "catalog_query",
    "catalog_page_in",
]

# The logger keeps the name operators configure (it predates the move to records/).
log = logging.getLogger(__name__)

MAX_LIST_LIMIT = 1000


@dataclass(frozen=True)
class Created:
    record: RunRecord


@dataclass(frozen=True)
class Existing:
    """A run with that id already exists (first writer wins); ``record`` is the stored one."""

    record: RunRecord


@dataclass(frozen=True)
class CancelRequested:
    run_id: str
    requested_at_ms: int
    revision: int


@dataclass(frozen=True)
class AlreadyRequested:
    run_id: str
    requested_at_ms: int


@dataclass(frozen=True)
class AlreadyTerminal:
    run_id: str
    status: str


@dataclass(frozen=True)
class NotFound:
    run_id: str


@dataclass(frozen=True)
class CancelAcknowledged:
    run_id: str
    at_ms: int
    revision: int


@dataclass(frozen=True)
class AlreadyAcknowledged:
    run_id: str
    ack: CancelAck


@dataclass(frozen=True)
class NotRequested:
    run_id: str


@dataclass(frozen=True)
class Deleted:
    run_id: str
    revision: int


@dataclass(frozen=True)
class Settled:
    """The run settled with the requested terminal ``status``."""

    run_id: str
    status: str
    revision: int


@dataclass(frozen=True)
class Cancelled:
    """A cancellation was requested before the terminal write: the run settled ``cancelled`` instead."""

    run_id: str
    requested_status: str
    cancel_requested_at_ms: int
    revision: int


@dataclass(frozen=True)
class Suspended:
    run_id: str
    waiting: Waiting
    revision: int


@dataclass(frozen=True)
class Tombstone:
    run_id: str
    deleted_at_ms: int
    revision: int


class RunStore:
    """Run rows of one database. Every method is one serialized transaction (joining an open write, if any)."""

    def __init__(self, db: Database, *, journal: Journal | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.db = db
        self.clock = clock
        self.journal = journal or Journal(db, clock=clock)

    # -- create / read -----------------------------------------------------------------------------------
    def create(
        self,
        run_id: str,
        flow: str,
        *,
        parent_run_id: str | None = None,
        lineage_id: str | None = None,
        round_ordinal: int = 0,
    ) -> Created | Existing:
        """Create a ``pending`` run (first writer wins). ``lineage_id`` defaults to the run id (round 0).

        A parent is recorded as a DAG edge in the same transaction (cycle-checked)."""
        check_id("run_id", run_id)
        check_id("flow", flow)
        if parent_run_id is not None:
            check_id("parent_run_id", parent_run_id)
            if parent_run_id == run_id:
                raise cycle_error(run_id, parent_run_id)
        if lineage_id is not None:
            check_id("lineage_id", lineage_id)
        if not isinstance(round_ordinal, int) or isinstance(round_ordinal, bool) or round_ordinal < 0:
            raise StoreError(
                "invalid_argument", f"round_ordinal must be a non-negative int, got {round_ordinal!r}"
            )

        def fn(conn: Connection) -> Created | Existing:
            row = _select(conn, run_id)
            if row is not None:
                return Existing(decode_run_or_raise(row))
            now = self.clock.now_ms()
            rev = self.db.next_revision(conn)
            values = {
                "run_id": run_id,
                "flow": flow,
                "status": "pending",
                "parent_run_id": parent_run_id,
                "lineage_id": lineage_id if lineage_id is not None else run_id,
                "round_ordinal": round_ordinal,
                "created_at_ms": now,
                "updated_at_ms": now,
                "revision": rev,
            }
            conn.execute(sa.insert(runs).values(values))
            fact: dict[str, Any] = {
                "flow": flow,
                "lineage_id": values["lineage_id"],
                "round_ordinal": round_ordinal,
            }
            if parent_run_id is not None:
                fact["parent_run_id"] = parent_run_id
            fact["fact"] = execution_fact(conn, run_id)
            self.journal.append_in(conn, run_id, "run-created", fact)
            if parent_run_id is not None:
                self._record_parent(conn, run_id, parent_run_id)
            created = _select(conn, run_id)
            assert created is not None
            return Created(decode_run_or_raise(created))

        return self.db.write(fn)

    def get(self, run_id: str) -> RunRecord | None:
        """The run, or None when absent. A row that does not decode raises ``StoreError(decode_failed)``."""
        row = self.db.read(lambda c: _select(c, run_id))
        return None if row is None else decode_run_or_raise(row)

    def tombstone(self, run_id: str) -> Tombstone | None:
        """The tombstone of a deleted run id (kept forever), or None."""
        t = run_tombstones.c
        row = self.db.read(lambda c: c.execute(sa.select(run_tombstones).where(t.run_id == run_id)).first())
        return None if row is None else Tombstone(row.run_id, int(row.deleted_at_ms), int(row.revision))

    # -- cancellation ----------------------------------------------------------------------------------------
    def request_cancel(self, run_id: str) -> CancelRequested | AlreadyRequested | AlreadyTerminal | NotFound:
        """Record a cancellation request (any process may). Repeats, missing and settled rows write nothing."""

        def fn(conn: Connection) -> CancelRequested | AlreadyRequested | AlreadyTerminal | NotFound:
            row = conn.execute(
                sa.select(runs.c.status, runs.c.cancel_requested_at_ms).where(runs.c.run_id == run_id)
            ).first()
            if row is None:
                return NotFound(run_id)
            if row.status in TERMINAL_STATUSES:
                return AlreadyTerminal(run_id, row.status)
            if row.cancel_requested_at_ms is not None:
                return AlreadyRequested(run_id, int(row.cancel_requested_at_ms))
            now = self.clock.now_ms()
            rev = bump_run(conn, self.db, run_id, {"cancel_requested_at_ms": now, "updated_at_ms": now})
            self.journal.append_in(conn, run_id, "run-cancel-requested", {"requested_at_ms": now})
            return CancelRequested(run_id, now, rev)

        return self.db.write(fn)

    def acknowledge_cancel(
        self, run_id: str, owner: OwnerId
    ) -> CancelAcknowledged | AlreadyAcknowledged | NotRequested:
        """The owning driver records that it observed the request (fenced: only the owner may)."""

        def fn(conn: Connection) -> CancelAcknowledged | AlreadyAcknowledged | NotRequested:
            fence = assert_owner(conn, run_id, owner)
            if fence.cancel_requested_at_ms is None:
                return NotRequested(run_id)
            row = _select(conn, run_id)
            assert row is not None
            if row.cancel_ack_nonce is not None:
                ack = CancelAck(
                    OwnerId(row.cancel_ack_host, int(row.cancel_ack_pid), row.cancel_ack_nonce),
                    int(row.cancel_ack_at_ms),
                )
                return AlreadyAcknowledged(run_id, ack)
            now = self.clock.now_ms()
            rev = bump_run(conn, self.db, run_id, {**_ack_values(owner, now), "updated_at_ms": now})
            self.journal.append_in(
                conn, run_id, "run-cancel-acknowledged", {"owner": owner.to_json(), "at_ms": now}
            )
            return CancelAcknowledged(run_id, now, rev)

        return self.db.write(fn)

    # -- fenced lifecycle -------------------------------------------------------------------------------------
    def finish(
        self, run_id: str, owner: OwnerId, status: str, *, result: Any = None, error: Any = None
    ) -> Settled | Cancelled:
        """Settle an owned run as ``completed``, ``failed`` or ``cancelled`` (fenced). A pending cancellation
        request turns it into ``cancelled`` and answers :class:`Cancelled`."""
        if status not in TERMINAL_STATUSES:
            raise StoreError(
                "invalid_argument", f"finish() needs a terminal status {sorted(TERMINAL_STATUSES)}"
            )
        result_json = json_text("result", result)
        error_json = json_text("error", error)

        def fn(conn: Connection) -> Settled | Cancelled:
            fence = assert_owner(conn, run_id, owner)
            now = self.clock.now_ms()
            values: dict[str, Any] = {
                **CLEAR_OWNER,
                **CLEAR_CLAIM,
                **CLEAR_WAIT,
                "status": status,
                "finished_at_ms": now,
                "updated_at_ms": now,
                "result_json": result_json,
                "error_json": error_json,
            }
            requested = fence.cancel_requested_at_ms
            if requested is not None and status != "cancelled":
                values.update(
                    status="cancelled",
                    result_json=None,
                    error_json=canonical_bytes(
                        {"type": "cancelled", "cancel_requested_at_ms": requested}
                    ).decode(),
                )
            if requested is not None:
                # Settling under a request is an observation of it: record the ack if nobody did yet.
                row = _select(conn, run_id)
                if row is not None and row.cancel_ack_nonce is None:
                    values.update(_ack_values(owner, now))
            rev, observed = bump_run_observed(conn, self.db, run_id, values)
            fact: dict[str, Any] = {"status": values["status"]}
            if values["status"] != status:
                fact["requested_status"] = status
            fact["fact"] = observed
            self.journal.append_in(conn, run_id, "run-settled", fact)
            if values["status"] != status:
                assert requested is not None
                return Cancelled(run_id, status, requested, rev)
            return Settled(run_id, status, rev)

        return self.db.write(fn)

    def suspend(
        self,
        run_id: str,
        owner: OwnerId,
        reason: str,
        *,
        wake_at_ms: int | None = None,
        token: str | None = None,
    ) -> Suspended:
        """Park an owned run (fenced): ``suspended``, no owner, waiting ``reason`` (timer|event|released|
        quarantine|...), optional deadline and wake token (only its SHA-256 is stored)."""
        waiting = waiting_for(reason, wake_at_ms=wake_at_ms, token=token)
        alone = self.suspend_alone(run_id, owner, waiting)
        if alone is not None:
            return alone
        return self.db.write(lambda conn: self.suspend_in(conn, run_id, owner, waiting))

    def suspend_alone(
        self,
        run_id: str,
        owner: OwnerId,
        waiting: Waiting,
        *,
        guard: Guard | None = None,
        guard_params: dict[str, Any] | None = None,
    ) -> Suspended | None:
        """PostgreSQL, outside an open write: :meth:`suspend` with ``waiting`` (:func:`waiting_for`) as ONE
        statement, its journal record included, when this process's hint of the row still holds and ``guard``
        (a condition of the caller's, e.g. "no pending clock") does too. None, with nothing written, otherwise
        (and always on SQLite): then run :meth:`suspend_in` in a transaction, which decides and raises."""
        alone = bump_run_journaled(
            self.db,
            run_id,
            suspend_values(waiting, self.clock.now_ms()),
            owner=owner,
            journal=self.journal,
            type="run-suspended",
            payload=lambda _seen, fact: suspend_payload(waiting, fact),
            guard=guard,
            guard_params=guard_params,
        )
        return None if alone is None else Suspended(run_id, waiting, alone[0])

    def suspend_in(self, conn: Connection, run_id: str, owner: OwnerId, waiting: Waiting) -> Suspended:
        """:meth:`suspend` with ``waiting`` (:func:`waiting_for`) on ``conn``, the connection of the caller's open
        write (no savepoint of its own): fenced, ``FenceLost`` (nothing written) when ``owner`` does not hold it."""
        rev, observed = bump_run_observed(
            conn, self.db, run_id, suspend_values(waiting, self.clock.now_ms()), owner=owner
        )
        self.journal.append_in(conn, run_id, "run-suspended", suspend_payload(waiting, observed))
        return Suspended(run_id, waiting, rev)

    # -- deletion ---------------------------------------------------------------------------------------------
    def delete(self, run_id: str, *, force: bool = False) -> Deleted | NotFound:
        """Delete a settled run (``force=True`` also deletes a live one), leaving a tombstone forever."""

        def fn(conn: Connection) -> Deleted | NotFound:
            row = conn.execute(sa.select(runs.c.status).where(runs.c.run_id == run_id)).first()
            if row is None:
                return NotFound(run_id)
            if row.status not in TERMINAL_STATUSES and not force:
                raise StoreError(
                    "invalid_argument",
                    f"run {run_id!r} is {row.status}; cancel it and let it settle first, or pass force=True",
                    run_id=run_id,
                )
            now = self.clock.now_ms()
            rev = self.db.next_revision(conn)
            conn.execute(sa.delete(runs).where(runs.c.run_id == run_id))
            t = run_tombstones
            updated = conn.execute(
                sa.update(t).where(t.c.run_id == run_id).values(deleted_at_ms=now, revision=rev)
            ).rowcount
            if not updated:
                conn.execute(sa.insert(t).values(run_id=run_id, deleted_at_ms=now, revision=rev))
            self.journal.append_in(conn, run_id, "run-deleted", {"revision": rev})
            return Deleted(run_id, rev)

        return self.db.write(fn)

    # -- run DAG ----------------------------------------------------------------------------------------------
    def record_run_parent(self, child_id: str, parent_id: str) -> ParentRecorded | ParentExisting:
        """Record the edge child → parent (first writer wins); ``RunParentCycleError`` leaves nothing behind."""
        check_id("child_id", child_id)
        check_id("parent_id", parent_id)
        if child_id == parent_id:
            raise cycle_error(child_id, parent_id)
        return self.db.write(lambda c: self._record_parent(c, child_id, parent_id))

    def _record_parent(
        self, conn: Connection, child_id: str, parent_id: str
    ) -> ParentRecorded | ParentExisting:
        return record_parent(conn, self.db, self.journal, self.clock.now_ms(), child_id, parent_id)

    def run_parents(self, child_id: str) -> builtins.list[RunEdge]:
        """Edges naming ``child_id`` as child, oldest first."""
        return self.db.read(lambda c: edges(c, child_id=child_id))

    def run_children(self, parent_id: str) -> builtins.list[RunEdge]:
        """Edges naming ``parent_id`` as parent, oldest first (the cancellation cascade reads this)."""
        return self.db.read(lambda c: edges(c, parent_id=parent_id))

    def list(
        self,
        *,
        status: str | None = None,
        flow: str | None = None,
        limit: int = 100,
        after: tuple[int, str] | None = None,
    ) -> builtins.list[RunRecord]:
        """Runs ordered by (created_at_ms, run_id), after the ``after`` key. Undecodable rows are skipped with one
        warning each naming the run id (see module invariants)."""
        if status is not None and status not in RUN_STATUSES:
            raise StoreError("invalid_argument", f"unknown status {status!r}; one of {list(RUN_STATUSES)}")
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise StoreError(
                "invalid_argument", f"limit must be an int in 1..{MAX_LIST_LIMIT}, got {limit!r}"
            )
        r = runs.c
        q = sa.select(runs)
        if status is not None:
            q = q.where(r.status == status)
        if flow is not None:
            q = q.where(r.flow == flow)
        if after is not None:
            at, rid = after
            q = q.where(sa.or_(r.created_at_ms > at, sa.and_(r.created_at_ms == at, r.run_id > rid)))
        q = q.order_by(r.created_at_ms, r.run_id).limit(limit)
        rows = self.db.read(lambda c: c.execute(q).all())
        out: builtins.list[RunRecord] = []
        for row in rows:
            try:
                out.append(decode_run(row))
            except Undecodable as exc:
                log.warning("storage integrity: skipping undecodable runs row run_id=%r: %s", row.run_id, exc)
        return out


# -------------------------------------------------------------------------------------------------------------


_SELECT = sa.select(runs).where(runs.c.run_id == sa.bindparam("b_run_id"))


def _select(conn: Connection, run_id: str) -> Row[Any] | None:
    return conn.execute(_SELECT, {"b_run_id": run_id}).first()


def _ack_values(owner: OwnerId, now: int) -> dict[str, Any]:
    return {
        "cancel_ack_host": owner.host_id,
        "cancel_ack_pid": owner.pid,
        "cancel_ack_nonce": owner.nonce,
        "cancel_ack_at_ms": now,
    }


# -- ownership transitions (engine.ownership judges; these statements are the writes) -------------------------

_r = runs.c
_SELECT_ROW = DriverStatement(sa.select(runs).where(_r.run_id == sa.bindparam("b_run_id")))
#: Renew the lease of an owned run: fenced in its WHERE clause, one statement, revision bump only on a match.
HEARTBEAT = RunUpdate(
    {"heartbeat_at_ms": sa.bindparam("b_now"), "updated_at_ms": sa.bindparam("b_now")},
    where=OWNED,
    returning=(_r.cancel_requested_at_ms,),
)
# Reserve a claimable row unless another incarnation holds a claim younger than the stale window (the same
# judgement _reserve makes in Python on a row it read; a row this misses gets that judgement).
RESERVE = RunUpdate(
    {
        "claim_host": sa.bindparam("b_host"),
        "claim_pid": sa.bindparam("b_pid"),
        "claim_nonce": sa.bindparam("b_nonce"),
        "claim_token": sa.bindparam("b_token"),
        "claimed_at_ms": sa.bindparam("b_now"),
        "updated_at_ms": sa.bindparam("b_now"),
    },
    where=sa.and_(
        sa.or_(_r.status == "pending", _r.status == "suspended"),
        sa.or_(
            _r.claim_token.is_(None),
            sa.and_(
                _r.claim_host == sa.bindparam("b_host"),
                _r.claim_pid == sa.bindparam("b_pid"),
                _r.claim_nonce == sa.bindparam("b_nonce"),
            ),
            sa.bindparam("b_now", type_=sa.BigInteger) - _r.claimed_at_ms
            >= sa.bindparam("b_stale", type_=sa.BigInteger),
        ),
    ),
    returning=OBSERVED_COLUMNS,
)
_ACTIVATE_VALUES: dict[str, Any] = {
    "status": "running",
    "owner_host": sa.bindparam("b_host"),
    "owner_pid": sa.bindparam("b_pid"),
    "owner_nonce": sa.bindparam("b_nonce"),
    "owner_proc_start": sa.bindparam("b_proc_start", type_=sa.Text),
    "heartbeat_at_ms": sa.bindparam("b_now"),
    **{c: None for c in CLEAR_CLAIM},
    **{c: None for c in CLEAR_WAIT},
    "started_at_ms": sa.func.coalesce(_r.started_at_ms, sa.bindparam("b_now", type_=sa.BigInteger)),
    "updated_at_ms": sa.bindparam("b_now"),
}
_ACTIVATE_WHERE = sa.and_(
    _r.claim_token == sa.bindparam("b_token"),
    _r.status == sa.bindparam("b_from_status"),
    _r.waiting_reason.is_not_distinct_from(sa.bindparam("b_from_reason", type_=sa.Text)),
)
#: Activate a reserved claim: matches only while the row still carries the token, status and waiting reason.
ACTIVATE = RunUpdate(
    _ACTIVATE_VALUES,
    where=_ACTIVATE_WHERE,
    returning=OBSERVED_COLUMNS,  # cancel_requested_at_ms is among them
)
#: :data:`ACTIVATE` for :meth:`RunUpdate.write_journaled` (PostgreSQL, one statement with ``run-activated``): it
#: also matches only a run the control plane did not admit, because an admitted run's activation must journal
#: ``control.run.running`` in the same transaction, which one record cannot. Asking inside the statement saves the
#: separate admission read (a read transaction) every activation paid before it; a miss writes nothing and the
#: caller takes the transaction path, which journals both.
ACTIVATE_UNADMITTED = RunUpdate(
    _ACTIVATE_VALUES,
    where=sa.and_(_ACTIVATE_WHERE, ~admitted_clause(sa.bindparam("b_run_id"))),
    returning=OBSERVED_COLUMNS,
    journaled=True,
)


def row_in(conn: Connection, run_id: str) -> Any | None:
    """The whole undecoded row of ``run_id`` on ``conn`` (None when absent), for a caller that judges raw
    ownership columns (claim arbitration); its statement is prepared once."""
    return _SELECT_ROW.first(conn, {"b_run_id": run_id})


# -- sweeps and recovery: set reads and the whole-store fence ---------------------------------------------------


def pending_runs(
    db: Database, flows: tuple[str, ...] | None, limit: int, *, cancel_requested: bool | None
) -> builtins.list[Any]:
    """``(run_id, flow)`` rows of pending runs (of ``flows`` when given; with a cancellation request when
    ``cancel_requested``), oldest change first, at most ``limit``."""
    q = sa.select(_r.run_id, _r.flow).where(_r.status == "pending")
    if flows is not None:
        q = q.where(_r.flow.in_(flows))
    if cancel_requested:
        q = q.where(_r.cancel_requested_at_ms.is_not(None))
    q = q.order_by(_r.updated_at_ms, _r.run_id).limit(limit)
    return builtins.list(db.read(lambda c: c.execute(q).all()))


def stale_running_page_in(
    conn: Connection, horizon: int, after: tuple[int, str] | None, limit: int
) -> builtins.list[Any]:
    """Running rows whose heartbeat is at or before ``horizon``, by ``(heartbeat_at_ms, run_id)`` after
    ``after``, at most ``limit``: ``run_id, heartbeat_at_ms, owner_host, owner_pid, owner_nonce``."""
    q = sa.select(_r.run_id, _r.heartbeat_at_ms, _r.owner_host, _r.owner_pid, _r.owner_nonce).where(
        _r.status == "running", _r.heartbeat_at_ms <= horizon
    )
    if after is not None:
        q = q.where(
            sa.or_(
                _r.heartbeat_at_ms > after[0], sa.and_(_r.heartbeat_at_ms == after[0], _r.run_id > after[1])
            )
        )
    return builtins.list(conn.execute(q.order_by(_r.heartbeat_at_ms, _r.run_id).limit(limit)).all())


def leases(db: Database, run_ids: builtins.list[str]) -> builtins.list[Any]:
    """``run_id, status, heartbeat_at_ms, owner_nonce`` of the existing runs among ``run_ids``."""
    q = sa.select(_r.run_id, _r.status, _r.heartbeat_at_ms, _r.owner_nonce).where(_r.run_id.in_(run_ids))
    return db.read(lambda c: builtins.list(c.execute(q).all()))


def running_owners_in(conn: Connection) -> builtins.list[Any]:
    """``run_id, owner_host, owner_pid, owner_nonce`` of every running run, by run id."""
    return builtins.list(
        conn.execute(
            sa.select(_r.run_id, _r.owner_host, _r.owner_pid, _r.owner_nonce)
            .where(_r.status == "running")
            .order_by(_r.run_id)
        ).all()
    )


def claimed_count_in(conn: Connection) -> int:
    """How many runs carry a pending claim."""
    return int(conn.execute(sa.select(sa.func.count()).where(_r.claim_token.is_not(None))).scalar_one())


def release_all_in(conn: Connection, now: int, revision: int) -> None:
    """Recovery's fence on ``conn``: clear every pending claim and release every running run (suspended,
    ``released``, no owner), all at ``revision`` (one revision for the whole fence, taken by the caller)."""
    conn.execute(
        sa.update(runs)
        .where(_r.claim_token.is_not(None))
        .values({**CLEAR_CLAIM, "updated_at_ms": now, "revision": revision})
    )
    conn.execute(
        sa.update(runs)
        .where(_r.status == "running")
        .values(
            {
                **CLEAR_OWNER,
                **CLEAR_WAIT,
                "status": "suspended",
                "waiting_reason": "released",
                "updated_at_ms": now,
                "revision": revision,
            }
        )
    )


def statuses_in(conn: Connection, run_ids: builtins.list[str]) -> dict[str, tuple[str, int | None]]:
    """``run_id → (status, finished_at_ms)`` of the existing runs among ``run_ids`` (an absent id is a run this
    database never knew, or one deleted since); read in bounded chunks so any number of ids is one read."""
    out: dict[str, tuple[str, int | None]] = {}
    ids = sorted(set(run_ids))
    for i in range(0, len(ids), 500):
        q = sa.select(_r.run_id, _r.status, _r.finished_at_ms).where(_r.run_id.in_(ids[i : i + 500]))
        for row in conn.execute(q):
            out[row.run_id] = (row.status, None if row.finished_at_ms is None else int(row.finished_at_ms))
    return out


# -- point reads and claim transitions the control plane judges on ------------------------------------------------


def record_in(conn: Connection, run_id: str) -> RunRecord | None:
    """The decoded run on ``conn`` (None when absent); a row that does not decode raises
    ``StoreError(decode_failed)``."""
    row = _select(conn, run_id)
    return None if row is None else decode_run_or_raise(row)


def status_in(conn: Connection, run_id: str) -> str | None:
    """The stored status of ``run_id`` on ``conn``, undecoded (None when absent): for a writer that still reports
    a row whose observation does not encode."""
    return conn.execute(sa.select(_r.status).where(_r.run_id == run_id)).scalar()


@dataclass(frozen=True)
class RunRow:
    """The run-row columns the control plane judges on (its claim, owner and wait), decoded without the JSON
    columns."""

    run_id: str
    flow: str
    status: str
    waiting_reason: str | None
    wake_at_ms: int | None
    claim: OwnerId | None
    claim_token: str | None
    claimed_at_ms: int | None
    owner: OwnerId | None
    heartbeat_at_ms: int | None = None
    wait_token_digest: str | None = None


def _run_row(r: Row[Any]) -> RunRow:
    claim = None if r.claim_nonce is None else OwnerId(r.claim_host, int(r.claim_pid), r.claim_nonce)
    owner = None if r.owner_nonce is None else OwnerId(r.owner_host, int(r.owner_pid), r.owner_nonce)
    return RunRow(
        r.run_id, r.flow, r.status, r.waiting_reason,
        None if r.wake_at_ms is None else int(r.wake_at_ms), claim, r.claim_token,
        None if r.claimed_at_ms is None else int(r.claimed_at_ms), owner,
        None if r.heartbeat_at_ms is None else int(r.heartbeat_at_ms), r.wait_token_digest,
    )  # fmt: skip


def run_row_in(conn: Connection, run_id: str) -> RunRow | None:
    """The :class:`RunRow` of ``run_id`` on ``conn`` (None when absent)."""
    r = _select(conn, run_id)
    return None if r is None else _run_row(r)


def clear_claim_if_in(conn: Connection, run_id: str, claim_token: str | None) -> bool:
    """Clear the pending claim of a ``pending`` run if it still carries ``claim_token`` (compare-and-set, no
    revision: the caller bumps it); False when the claim changed."""
    n = conn.execute(
        sa.update(runs)
        .where(_r.run_id == run_id, _r.status == "pending", _r.claim_token == claim_token)
        .values(**CLEAR_CLAIM)
    ).rowcount
    return bool(n)


# -- projections' reads (observe: feed, catalog, snapshots), composed into the caller's read transaction ------------

_IN_CHUNK = 500
_t = run_tombstones.c


def watermark_in(conn: Connection) -> tuple[str, int]:
    """(source identity, global revision) as seen by ``conn``'s transaction."""
    row = conn.execute(sa.select(meta.c.source_id, meta.c.revision).where(meta.c.id == 1)).one()
    return str(row.source_id), int(row.revision)


def changes_after_in(conn: Connection, after: int, n: int) -> builtins.list[tuple[int, str, bool]]:
    """Up to ``n`` ``(revision, run_id, deleted)`` with ``revision > after``, in that order: live rows and the
    tombstones of ids not recreated (a recreated id's live row is strictly newer and supersedes its tombstone)."""
    live = (
        sa.select(_r.revision, _r.run_id).where(_r.revision > after).order_by(_r.revision, _r.run_id).limit(n)
    )
    dead = (
        sa.select(_t.revision, _t.run_id)
        .where(_t.revision > after, ~sa.exists().where(_r.run_id == _t.run_id))
        .order_by(_t.revision, _t.run_id)
        .limit(n)
    )
    merged = [(int(x.revision), x.run_id, False) for x in conn.execute(live)]
    merged += [(int(x.revision), x.run_id, True) for x in conn.execute(dead)]
    merged.sort()
    return merged[:n]


def changes_at_in(conn: Connection, rev: int) -> builtins.list[tuple[int, str, bool]]:
    """Every ``(rev, run_id, deleted)`` at exactly revision ``rev``, in that order."""
    out = [(rev, x, False) for x in conn.execute(sa.select(_r.run_id).where(_r.revision == rev)).scalars()]
    dead = sa.select(_t.run_id).where(_t.revision == rev, ~sa.exists().where(_r.run_id == _t.run_id))
    out += [(rev, x, True) for x in conn.execute(dead).scalars()]
    return sorted(out)


def records_in(conn: Connection, run_ids: builtins.list[str]) -> builtins.list[RunRecord]:
    """The decoded runs among ``run_ids`` (distinct ids; absent ones left out); a row that does not decode raises
    ``StoreError(decode_failed)``."""
    rows: builtins.list[Row[Any]] = []
    for i in range(0, len(run_ids), _IN_CHUNK):
        chunk = run_ids[i : i + _IN_CHUNK]
        rows.extend(conn.execute(sa.select(runs).where(_r.run_id.in_(chunk))).all())
    return [decode_run_or_raise(r) for r in rows]


def tombstone_revisions_in(conn: Connection, run_ids: builtins.list[str]) -> dict[str, int]:
    """The deletion revision of each of ``run_ids`` that has a tombstone."""
    out: dict[str, int] = {}
    for k in range(0, len(run_ids), _IN_CHUNK):
        chunk = run_ids[k : k + _IN_CHUNK]
        for row in conn.execute(sa.select(_t.run_id, _t.revision).where(_t.run_id.in_(chunk))):
            out[row.run_id] = int(row.revision)
    return out


def round_keys_in(
    conn: Connection, lineage_id: str, after: tuple[int, str] | None, n: int
) -> builtins.list[tuple[int, str]]:
    """``(round_ordinal, run_id)`` of the runs of ``lineage_id`` after the key ``after``, in that order, at most
    ``n``."""
    q = sa.select(_r.round_ordinal, _r.run_id).where(_r.lineage_id == lineage_id)
    if after is not None:
        q = q.where(
            sa.tuple_(_r.round_ordinal, _r.run_id) > sa.tuple_(sa.literal(after[0]), sa.literal(after[1]))
        )
    rows = conn.execute(q.order_by(_r.round_ordinal, _r.run_id).limit(n)).all()
    return [(int(x.round_ordinal), x.run_id) for x in rows]


class Unconstrained(enum.Enum):
    """The type of :data:`ANY`."""

    ANY = "any"

    def __repr__(self) -> str:
        return "ANY"


#: "This filter is omitted", for the filters where ``None`` itself is a value to match.
ANY = Unconstrained.ANY


def catalog_query(
    *,
    status: str | None = None,
    flow: str | None = None,
    parent_run_id: str | None | Unconstrained = ANY,
    lineage_id: str | None = None,
    waiting_reason: str | None | Unconstrained = ANY,
    created_after_ms: int | None = None,
    created_before_ms: int | None = None,
    after: tuple[int, str] | None = None,
    n: int,
) -> sa.Select[Any]:
    """The catalog's statement: up to ``n`` whole run rows matching the filters after the key ``after`` in
    ``(created_at_ms, run_id)`` order. ``parent_run_id`` is the effective parent (the column, else the earliest spawn
    edge): None selects runs without one, :data:`ANY` leaves it open (so does :data:`ANY` for ``waiting_reason``,
    whose None selects runs with no stored wait). Its index choice is documented in ``observe/catalog.py``; read it
    with :func:`catalog_page_in` (exposed for EXPLAIN)."""
    conds: builtins.list[ColumnElement[bool]] = []
    if status is not None:
        conds.append(_r.status == status)
    if flow is not None:
        conds.append(_r.flow == flow)
    if lineage_id is not None:
        conds.append(_r.lineage_id == lineage_id)
    if waiting_reason is None:
        conds.append(_r.waiting_reason.is_(None))
    elif waiting_reason is not ANY:
        conds.append(_r.waiting_reason == waiting_reason)
    if created_after_ms is not None:
        conds.append(_r.created_at_ms >= created_after_ms)
    if created_before_ms is not None:
        conds.append(_r.created_at_ms <= created_before_ms)
    if parent_run_id is None:
        conds.append(_r.parent_run_id.is_(None))
        conds.append(has_no_edge(_r.run_id))
    elif parent_run_id is not ANY:
        p = parent_run_id
        # Candidates: the column, or a spawn edge naming p; then the exact rule (the EARLIEST edge decides).
        by_column = runs.alias("by_column")
        candidates = sa.union(
            sa.select(by_column.c.run_id).where(by_column.c.parent_run_id == p),
            children_select(p),
        )
        # COALESCE on purpose: an OR here lets SQLite drive from "parent_run_id IS NULL" (most of the history)
        # instead of from the candidates.
        conds.append(_r.run_id.in_(candidates))
        conds.append(sa.func.coalesce(_r.parent_run_id, first_parent_of(_r.run_id)) == p)
    if after is not None:
        conds.append(
            sa.tuple_(_r.created_at_ms, _r.run_id) > sa.tuple_(sa.literal(after[0]), sa.literal(after[1]))
        )
    return sa.select(runs).where(*conds).order_by(_r.created_at_ms, _r.run_id).limit(n)


def catalog_page_in(
    conn: Connection, filters: dict[str, Any], after: tuple[int, str] | None, limit: int
) -> tuple[builtins.list[RunRecord], bool]:
    """Up to ``limit`` decoded runs of :func:`catalog_query` (``filters`` are its keyword filters) and whether
    more match (one row of lookahead, never decoded: a corrupt row beyond the page does not fail this page)."""
    rows = conn.execute(catalog_query(**filters, after=after, n=limit + 1)).all()
    return [decode_run_or_raise(r) for r in rows[:limit]], len(rows) > limit
