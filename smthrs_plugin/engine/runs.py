"""The run store: run rows, their lifecycle, revisions, tombstones and the run DAG.

Invariants:

- **Revisions.** Every run-row mutation (create, claim, activation, heartbeat, suspension, cancellation request
  and acknowledgement, settlement, parent edge, deletion) takes a new value of the global per-database revision
  in the same transaction (``Database.next_revision``) and stores it on the row (or its tombstone), so revision
  order is commit order and a change feed can catch up from any revision.
- **Tombstones forever.** Deleting a run leaves a ``run_tombstones`` row (kept indefinitely); recreating the id
  gives a strictly newer live revision. Deleting prunes the run's parent edges (a trigger does it for any
  deleter) and its attempts (foreign key cascade).
- **Run DAG.** ``record_run_parent(child, parent)`` is first writer wins per pair; the edge is inserted and the
  parent's ancestor chain walked over the durable edges in the SAME write transaction, so a cycle rolls back
  with nothing left behind (``RunParentCycleError``), and of two concurrent writers whose edges jointly close a
  cycle exactly one fails (serialized writes).
- **Fenced lifecycle.** ``finish`` and ``suspend`` assert the owner inside their transaction. A terminal
  transition whose run had a cancellation requested settles ``cancelled`` instead and answers
  :class:`Cancelled` (the explicit outcome; ``fence.assert_owner(terminal=True)`` is the raising variant for
  other terminal writers). Every transition journals its record in the run's partition in the same transaction,
  with the run's execution fact (``facts.py``: the observation of the row as the change left it, returned by the
  fenced UPDATE itself; on PostgreSQL a suspension may be one statement with its record, see
  ``fence.bump_run_journaled``).
- **Corruption is local.** List reads skip a row that does not decode, with ONE warning naming its key; point
  reads fail with ``decode_failed`` (reporting "no row" for a durably recorded but unreadable run would re-run
  work whose side effects already ran).

Prior art: the reference ``RunStore``/``DurableEngineState`` (seeds 000 and 004), Kubernetes resourceVersion.
"""

from __future__ import annotations

import builtins
import logging
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import canonical_bytes, sha256_hex
from ..errors import StoreError
from ..stores.database import Database
from ..stores.schema import RUN_STATUSES, TERMINAL_STATUSES, run_tombstones, runs
from .facts import execution_fact
from .fence import (
    CLEAR_CLAIM,
    CLEAR_OWNER,
    CLEAR_WAIT,
    OwnerId,
    assert_owner,
    bump_run,
    bump_run_journaled,
    bump_run_observed,
)
from .journal import Journal
from .run_dag import ParentExisting, ParentRecorded, RunEdge, cycle_error, edges, record_parent
from .run_records import (
    CancelAck,
    RunRecord,
    Undecodable,
    Waiting,
    decode_run,
    decode_run_or_raise,
    json_text,
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
]

log = logging.getLogger(__name__)

MAX_LIST_LIMIT = 1000
_MAX_ID = 1024


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
        _check_id("run_id", run_id)
        _check_id("flow", flow)
        if parent_run_id is not None:
            _check_id("parent_run_id", parent_run_id)
            if parent_run_id == run_id:
                raise cycle_error(run_id, parent_run_id)
        if lineage_id is not None:
            _check_id("lineage_id", lineage_id)
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
        _check_id("reason", reason)
        if wake_at_ms is not None and (not isinstance(wake_at_ms, int) or isinstance(wake_at_ms, bool)):
            raise StoreError("invalid_argument", f"wake_at_ms must be an int (epoch ms), got {wake_at_ms!r}")
        if token is not None and (not isinstance(token, str) or not token):
            raise StoreError("invalid_argument", "token must be a non-empty string")
        waiting = Waiting(reason, wake_at_ms, None if token is None else sha256_hex(token.encode("utf-8")))

        def values(now: int) -> dict[str, Any]:
            return {
                **CLEAR_OWNER,
                **CLEAR_CLAIM,
                "status": "suspended",
                "waiting_reason": waiting.reason,
                "wake_at_ms": waiting.wake_at_ms,
                "wait_token_digest": waiting.token_digest,
                "updated_at_ms": now,
            }

        def payload(observed: dict[str, Any]) -> dict[str, Any]:
            fact: dict[str, Any] = {"reason": reason}
            if wake_at_ms is not None:
                fact["wake_at_ms"] = wake_at_ms
            if waiting.token_digest is not None:
                fact["token_digest"] = waiting.token_digest
            fact["fact"] = observed
            return fact

        # PostgreSQL: the whole transition in one statement when this process's hint of the row still holds.
        alone = bump_run_journaled(
            self.db,
            run_id,
            values(self.clock.now_ms()),
            owner=owner,
            journal=self.journal,
            type="run-suspended",
            payload=payload,
        )
        if alone is not None:
            return Suspended(run_id, waiting, alone[0])

        def fn(conn: Connection) -> Suspended:
            rev, observed = bump_run_observed(conn, self.db, run_id, values(self.clock.now_ms()), owner=owner)
            self.journal.append_in(conn, run_id, "run-suspended", payload(observed))
            return Suspended(run_id, waiting, rev)

        return self.db.write(fn)

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
        _check_id("child_id", child_id)
        _check_id("parent_id", parent_id)
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


def _check_id(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > _MAX_ID or "\x00" in value:
        raise StoreError(
            "invalid_argument",
            f"{name} must be a non-empty string of at most {_MAX_ID} characters without NUL",
        )
