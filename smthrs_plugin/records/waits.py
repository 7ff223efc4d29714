"""The waits owner: deferreds, clocks, park and wake — the state that lets a waiting run survive its process.

- One owner of ``deferred_completions`` and ``clock_deadlines`` (row decoders in ``wait_rows``); run-row changes go
  through ``runs``, journal records through ``journal``, in the caller's one transaction.
- Deferreds, addressed by (flow, execution id, name), and clocks, with an absolute ``due_at_ms``, are completed
  once: first writer wins. Scheduling a clock is also fenced on the run's owner; a re-run gets the ORIGINAL deadline.
- Park is fenced and atomic with the status change; wake turns a parked run ``pending`` and journals ``run-woken``
  (``wake=True`` wakes in the completing transaction). A settled run's clocks close in its terminal transaction.
- Every mutation journals its record in the same transaction; a mutation that returned is durable, so callers wake
  in-process waiters only after it returns.
- List reads skip a row that does not decode, with one warning naming its key; point reads fail ``decode_failed``;
  listings exclude rows of settled runs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import canonical_bytes, sha256_hex
from ..errors import CanonicalError, FenceLost, StoreError
from ..stores.database import Database
from ..stores.schema import TERMINAL_STATUSES, runs
from ..stores.statements import DriverStatement
from ..stores.wait_tables import clock_deadlines, deferred_completions
from .journal import Journal
from .runs import (
    CLEAR_CLAIM,
    CLEAR_WAIT,
    Guard,
    OwnerId,
    RunStore,
    assert_owner,
    bump_run,
    bump_run_journaled,
    bump_run_observed,
    row_in,
    status_in,
    waiting_for,
)
from .wait_rows import (
    WAITING_COLUMNS,
    AlreadyCompleted,
    ClockRecord,
    Completed,
    DeferredRecord,
    Existing,
    NotFound,
    NotWaiting,
    Parked,
    Scheduled,
    TimerWait,
    Undecodable,
    Wait,
    WaitingFilter,
    WaitingRun,
    Woken,
    decode_clock,
    decode_deferred,
    decode_wait,
    deferred_token,
    point_read_failed,
    waiting_run,
)

__all__ = ["WaitStore", "MAX_LIST_LIMIT"]

# The logger keeps the name operators configure (it predates the move to records/).
log = logging.getLogger(__name__)

MAX_LIST_LIMIT = 1000
_MAX_NAME = 1024
_LIVE = runs.c.status.not_in(sorted(TERMINAL_STATUSES))
_d = deferred_completions.c
_k = clock_deadlines.c
_r = runs.c


def _check_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_NAME or "\x00" in value:
        raise StoreError(
            "invalid_argument",
            f"{what} must be a non-empty string of at most {_MAX_NAME} characters without NUL",
        )
    return value


def _check_ms(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StoreError(
            "invalid_argument", f"{what} must be a non-negative int of epoch milliseconds, got {value!r}"
        )
    return value


def _check_limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise StoreError("invalid_argument", f"limit must be an int in 1..{MAX_LIST_LIMIT}, got {limit!r}")
    return limit


T = TypeVar("T")


def _skip(table: str, key: Any, exc: Exception) -> None:
    log.warning("storage integrity: skipping undecodable %s row %r: %s", table, key, exc)


def _decode_listed(rows: Iterable[Row[Any]], decode: Callable[[Row[Any]], T], table: str) -> list[T]:
    """A list read's rows, decoded; an undecodable row is skipped with one warning naming its address
    (flow, execution id, name), so one bad row never hides the others (point reads fail instead)."""
    out: list[T] = []
    for row in rows:
        try:
            out.append(decode(row))
        except Undecodable as exc:
            _skip(table, (row.flow, row.execution_id, row.name), exc)
    return out


class WaitStore:
    """Deferreds, clocks and the waiting rows of one database. Every mutation is one serialized transaction that
    joins an open write on this thread, if any (so a caller can make it part of a larger atomic unit)."""

    def __init__(
        self,
        db: Database,
        *,
        journal: Journal | None = None,
        runs_store: RunStore | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.db = db
        self._time = clock  # (``clock`` is the point read of a durable clock)
        self.journal = journal or Journal(db, clock=clock)
        self.runs = runs_store or RunStore(db, journal=self.journal, clock=clock)

    # -- deferreds -------------------------------------------------------------------------------------------
    def complete_deferred(
        self, execution_id: str, name: str, value: Any, *, wake: bool = True
    ) -> Completed[DeferredRecord] | Existing[DeferredRecord]:
        """Complete the deferred ``name`` of run ``execution_id`` with ``value`` (first writer wins). The flow part
        of the address is read from the run row. With ``wake``, a run parked on this deferred (or on an untokened
        event) is woken in the same transaction. Refuses an unknown run (``not_found``) or a value that is not plain
        JSON (``invalid_argument``) before writing anything."""
        _check_name("execution_id", execution_id)
        _check_name("name", name)
        try:
            value_json = canonical_bytes(value).decode("utf-8")
        except CanonicalError as exc:
            raise StoreError(
                "invalid_argument",
                f"the value of deferred {name!r} is not plain JSON data: {exc.message}",
                cause=exc,
            ) from exc

        def fn(conn: Connection) -> Completed[DeferredRecord] | Existing[DeferredRecord]:
            flow = conn.execute(sa.select(_r.flow).where(_r.run_id == execution_id)).scalar()
            if flow is None:
                raise StoreError(
                    "not_found",
                    f"run {execution_id!r} does not exist; a deferred completes a wait of an existing run",
                    run_id=execution_id,
                )
            row = conn.execute(_deferred_q(flow, execution_id, name)).first()
            if row is not None:
                try:
                    return Existing(decode_deferred(row))
                except Undecodable as exc:
                    raise point_read_failed("deferred", (flow, execution_id, name), exc) from exc
            now = self._time.now_ms()
            conn.execute(
                sa.insert(deferred_completions).values(
                    flow=flow,
                    execution_id=execution_id,
                    name=name,
                    value_json=value_json,
                    completed_at_ms=now,
                )
            )
            self.journal.append_in(conn, execution_id, "deferred-completed", {"name": name})
            record = DeferredRecord(flow, execution_id, name, json.loads(value_json), now, None)
            woke = self._wake_for_deferred(conn, execution_id, name) if wake else None
            return Completed(record, woke)

        return self.db.write(fn)

    def _wake_for_deferred(self, conn: Connection, run_id: str, name: str) -> Woken | NotWaiting | NotFound:
        row = conn.execute(
            sa.select(_r.status, _r.waiting_reason, _r.wait_token_digest).where(_r.run_id == run_id)
        ).first()
        if row is None:
            return NotFound(run_id)
        if row.status != "suspended" or row.waiting_reason not in ("event", "timer"):
            return NotWaiting(run_id, row.status)
        digest = sha256_hex(deferred_token(name).encode("utf-8"))
        if row.wait_token_digest != digest and not (
            row.wait_token_digest is None and row.waiting_reason == "event"
        ):
            return NotWaiting(
                run_id, row.status
            )  # parked on something else: a spurious resume would only re-park
        return self._wake_in(conn, run_id)

    def wake_for_deferred(self, execution_id: str, name: str) -> Woken | NotWaiting | NotFound:
        """Wake the run if it is parked on the deferred ``name`` (or on an untokened event): registration-time
        recovery of a completion that arrived while nothing was listening."""
        return self.db.write(lambda c: self._wake_for_deferred(c, execution_id, name))

    def deferred(self, flow: str, execution_id: str, name: str) -> DeferredRecord | None:
        """The completion of a deferred, or None while it is pending. A corrupt row raises ``decode_failed``."""
        row = self.db.read(lambda c: c.execute(_deferred_q(flow, execution_id, name)).first())
        if row is None:
            return None
        try:
            return decode_deferred(row)
        except Undecodable as exc:
            raise point_read_failed("deferred", (flow, execution_id, name), exc) from exc

    def consume_deferred(self, execution_id: str, name: str, owner: OwnerId) -> DeferredRecord | NotFound:
        """Mark the completion consumed (fenced on ``owner``) and return it; the caller serves the value only after
        this returned. ``NotFound`` while the deferred is pending. Consuming twice keeps the first time."""

        def fn(conn: Connection) -> DeferredRecord | NotFound:
            assert_owner(conn, execution_id, owner)
            flow = conn.execute(sa.select(_r.flow).where(_r.run_id == execution_id)).scalar_one()
            row = conn.execute(_deferred_q(flow, execution_id, name)).first()
            if row is None:
                return NotFound(execution_id, name)
            try:
                record = decode_deferred(row)
            except Undecodable as exc:
                raise point_read_failed("deferred", (flow, execution_id, name), exc) from exc
            if record.consumed_at_ms is not None:
                return record
            now = self._time.now_ms()
            conn.execute(
                sa.update(deferred_completions)
                .where(_d.flow == flow, _d.execution_id == execution_id, _d.name == name)
                .values(consumed_at_ms=now)
            )
            return DeferredRecord(flow, execution_id, name, record.value, record.completed_at_ms, now)

        return self.db.write(fn)

    def completed_deferreds(
        self, flow: str, *, limit: int = 100, after: tuple[str, str] | None = None
    ) -> list[DeferredRecord]:
        """Unconsumed completions of ``flow`` whose run has not settled, ordered by (execution id, name), after
        ``after``; what a driver registering ``flow`` recovers. Undecodable rows are skipped with a warning."""
        _check_limit(limit)
        q = (
            sa.select(deferred_completions)
            .join(runs, _r.run_id == _d.execution_id)
            .where(_d.flow == flow, _d.consumed_at_ms.is_(None), _LIVE)
        )
        if after is not None:
            q = q.where(sa.tuple_(_d.execution_id, _d.name) > sa.tuple_(*after))
        q = q.order_by(_d.execution_id, _d.name).limit(limit)
        rows = self.db.read(lambda c: c.execute(q).all())
        return _decode_listed(rows, decode_deferred, "deferred_completions")

    # -- clocks ----------------------------------------------------------------------------------------------
    def schedule_clock(
        self, execution_id: str, name: str, due_at_ms: int, owner: OwnerId
    ) -> Scheduled | Existing[ClockRecord]:
        """Arm the clock ``name`` of an owned run at ``due_at_ms`` (fenced on ``owner``: ``FenceLost`` otherwise).
        First writer wins: an existing clock answers ``Existing`` with its ORIGINAL deadline (pending or not)."""
        _check_name("execution_id", execution_id)
        _check_name("name", name)
        _check_ms("due_at_ms", due_at_ms)

        def fn(conn: Connection) -> Scheduled | Existing[ClockRecord]:
            assert_owner(conn, execution_id, owner)
            flow = conn.execute(sa.select(_r.flow).where(_r.run_id == execution_id)).scalar_one()
            row = conn.execute(_clock_q(flow, execution_id, name)).first()
            if row is not None:
                try:
                    return Existing(decode_clock(row))
                except Undecodable as exc:
                    raise point_read_failed("clock", (flow, execution_id, name), exc) from exc
            now = self._time.now_ms()
            conn.execute(
                sa.insert(clock_deadlines).values(
                    flow=flow, execution_id=execution_id, name=name, due_at_ms=due_at_ms, scheduled_at_ms=now
                )
            )
            self.journal.append_in(
                conn, execution_id, "clock-scheduled", {"name": name, "due_at_ms": due_at_ms}
            )
            return Scheduled(ClockRecord(flow, execution_id, name, due_at_ms, now, None))

        return self.db.write(fn)

    def clock(self, flow: str, execution_id: str, name: str) -> ClockRecord | None:
        """The clock, or None when it was never scheduled. A corrupt row raises ``decode_failed``."""
        row = self.db.read(lambda c: c.execute(_clock_q(flow, execution_id, name)).first())
        if row is None:
            return None
        try:
            return decode_clock(row)
        except Undecodable as exc:
            raise point_read_failed("clock", (flow, execution_id, name), exc) from exc

    def complete_clock(
        self, flow: str, execution_id: str, name: str, *, wake: bool = False
    ) -> Completed[ClockRecord] | AlreadyCompleted | NotFound:
        """Fire the clock (first writer wins). With ``wake``, a run parked ``timer`` whose clocks are now all
        complete is woken in the same transaction; one that still has a pending clock gets its wake time moved to
        the next deadline instead. Journals ``clock-fired {name, due_at_ms, fired_at_ms}``."""

        def fn(conn: Connection) -> Completed[ClockRecord] | AlreadyCompleted | NotFound:
            row = conn.execute(_clock_q(flow, execution_id, name)).first()
            if row is None:
                return NotFound(execution_id, name)
            try:
                record = decode_clock(row)
            except Undecodable as exc:
                raise point_read_failed("clock", (flow, execution_id, name), exc) from exc
            if record.completed_at_ms is not None:
                return AlreadyCompleted(record)
            now = self._time.now_ms()
            conn.execute(
                sa.update(clock_deadlines)
                .where(_k.flow == flow, _k.execution_id == execution_id, _k.name == name)
                .values(completed_at_ms=now)
            )
            self.journal.append_in(
                conn,
                execution_id,
                "clock-fired",
                {"name": name, "due_at_ms": record.due_at_ms, "fired_at_ms": now},
            )
            fired = ClockRecord(flow, execution_id, name, record.due_at_ms, record.scheduled_at_ms, now)
            woke = self._wake_for_clock(conn, execution_id) if wake else None
            return Completed(fired, woke)

        return self.db.write(fn)

    def _wake_for_clock(self, conn: Connection, run_id: str) -> Woken | NotWaiting | NotFound:
        row = conn.execute(sa.select(_r.status, _r.waiting_reason).where(_r.run_id == run_id)).first()
        if row is None:
            return NotFound(run_id)
        if row.status != "suspended" or row.waiting_reason != "timer":
            return NotWaiting(run_id, row.status)
        nxt = _earliest_pending(conn, run_id)
        if nxt is not None and nxt > self._time.now_ms():
            bump_run(conn, self.db, run_id, {"wake_at_ms": nxt, "updated_at_ms": self._time.now_ms()})
            return NotWaiting(run_id, row.status)  # still parked: its next timer is in the future
        return self._wake_in(conn, run_id)

    def complete_run_clocks_in(self, conn: Connection, execution_id: str) -> int:
        """Close every pending clock of one run in ONE statement on ``conn`` (call it inside the run's terminal
        transaction); returns how many were closed."""
        return int(
            conn.execute(
                sa.update(clock_deadlines)
                .where(_k.execution_id == execution_id, _k.completed_at_ms.is_(None))
                .values(completed_at_ms=self._time.now_ms())
            ).rowcount
        )

    def complete_run_clocks(self, execution_id: str) -> int:
        """:meth:`complete_run_clocks_in` in its own transaction."""
        return self.db.write(lambda c: self.complete_run_clocks_in(c, execution_id))

    def pending_clocks(
        self,
        flows: Iterable[str] | None = None,
        *,
        limit: int = 100,
        after: tuple[int, str, str, str] | None = None,
    ) -> list[ClockRecord]:
        """Pending clocks (of ``flows``) whose run has not settled, earliest deadline first (ties by flow,
        execution id, name), after the ``after`` key: what a registering driver re-arms."""
        return self._clocks(flows, None, limit, after)

    def due_clocks(
        self,
        now_ms: int,
        flows: Iterable[str] | None = None,
        *,
        limit: int = 64,
        after: tuple[int, str, str, str] | None = None,
    ) -> list[ClockRecord]:
        """Pending clocks (of ``flows``) due at or before ``now_ms`` whose run has not settled, earliest first
        (same order and ``after`` key as :meth:`pending_clocks`)."""
        return self._clocks(flows, _check_ms("now_ms", now_ms), limit, after)

    def _clocks(
        self,
        flows: Iterable[str] | None,
        due_by: int | None,
        limit: int,
        after: tuple[int, str, str, str] | None,
    ) -> list[ClockRecord]:
        _check_limit(limit)
        q = (
            sa.select(clock_deadlines)
            .join(runs, _r.run_id == _k.execution_id)
            .where(_k.completed_at_ms.is_(None), _LIVE)
        )
        if flows is not None:
            q = q.where(_k.flow.in_(sorted(set(flows))))
        if due_by is not None:
            q = q.where(_k.due_at_ms <= due_by)
        if after is not None:
            q = q.where(sa.tuple_(_k.due_at_ms, _k.flow, _k.execution_id, _k.name) > sa.tuple_(*after))
        q = q.order_by(_k.due_at_ms, _k.flow, _k.execution_id, _k.name).limit(limit)
        rows = self.db.read(lambda c: c.execute(q).all())
        return _decode_listed(rows, decode_clock, "clock_deadlines")

    # -- park / wake -----------------------------------------------------------------------------------------
    def park(
        self,
        run_id: str,
        owner: OwnerId,
        *,
        reason: Literal["auto", "event", "quarantine", "waiting-approval"] = "auto",
        token: str | None = None,
        deferred: str | None = None,
    ) -> Parked | NotFound:
        """Park an owned run (fenced: ``FenceLost`` when ``owner`` no longer holds it). ``auto``: ``timer`` with
        the earliest pending clock deadline as wake time when the run has a pending clock, else ``event``.
        ``token`` (opaque; only its SHA-256 is stored) names what the run waits for.

        ``deferred``: the deferred the run waits for. If it completed between the flow's last check and this park
        (its completion found the run still running, so it woke nothing), the run is woken in the same
        transaction: a completion can never be lost between a check and a park."""
        if reason not in ("auto", "event", "quarantine", "waiting-approval"):
            raise StoreError(
                "invalid_argument",
                f"park reason {reason!r} is not one of auto|event|quarantine|waiting-approval (release a run with "
                "Ownership.release)",
            )

        # PostgreSQL: the whole park in ONE statement (its record included) when this process's hint of the row
        # holds and the park needs no decision from another table: with ``auto``, no pending clock (else it is a
        # timer wait, whose deadline must be read); with ``deferred``, no completion yet (else it wakes at once).
        # The guard is evaluated by the statement itself, so a clock or completion committed just before it makes
        # it miss; a miss writes nothing and the transaction below decides as always.
        if self.db.dialect == "postgresql" and not self.db.in_write():
            plain = self.runs.suspend_alone(
                run_id,
                owner,
                waiting_for("event" if reason == "auto" else reason, token=token),
                guard=_PARK_GUARDS[(reason == "auto", deferred is not None)],
                guard_params=None if deferred is None else {"g_deferred": deferred},
            )
            if plain is not None:
                return Parked(
                    run_id,
                    decode_wait(plain.waiting.reason, None, plain.waiting.token_digest),
                    plain.revision,
                )

        def fn(conn: Connection) -> Parked | NotFound:
            earliest = _earliest_pending(conn, run_id) if reason == "auto" else None
            if earliest is not None:
                waiting = waiting_for("timer", wake_at_ms=earliest, token=token)
            else:
                waiting = waiting_for("event" if reason == "auto" else reason, token=token)
            try:
                # On the write's own connection: no savepoint (a fenced miss writes nothing to roll back).
                s = self.runs.suspend_in(conn, run_id, owner, waiting)
            except FenceLost:
                if status_in(conn, run_id) is None:
                    return NotFound(run_id)
                raise
            if earliest is not None:
                wait: Wait = TimerWait(earliest, s.waiting.token_digest)
            else:
                wait = decode_wait(s.waiting.reason, None, s.waiting.token_digest)
            if deferred is not None and _DEFERRED_DONE.first(conn, {"b_run_id": run_id, "b_name": deferred}):
                self._wake_in(conn, run_id)
            return Parked(run_id, wait, s.revision)

        return self.db.write(fn)

    def wake(self, run_id: str) -> Woken | NotWaiting | NotFound:
        """Make a parked run runnable: ``pending``, waiting cleared, claimable by any driver; journals
        ``run-woken``. Anything that is not ``suspended`` answers ``NotWaiting``."""
        woken = self._wake_alone(run_id)
        if woken is not None:
            return woken
        return self.db.write(lambda c: self._wake_in(c, run_id))

    def _wake_alone(self, run_id: str) -> Woken | None:
        # PostgreSQL: the wake and its record as ONE statement when this process's hint of the row (e.g. from its
        # own park) still holds; the statement matches only while the row is exactly that suspended row, so the
        # journaled ``from_reason`` and fact are the true ones. None (nothing written): the transaction path.
        was: list[Wait] = []

        def payload(seen: Any, fact: dict[str, Any]) -> dict[str, Any] | None:
            if seen.status != "suspended":
                return None
            try:
                was.append(decode_wait(seen.waiting_reason, seen.wake_at_ms, seen.wait_token_digest))
            except Undecodable:
                return None  # the transaction path reads the row and reports it corrupt
            return {"from_reason": was[0].reason, "fact": fact}

        done = bump_run_journaled(
            self.db,
            run_id,
            _wake_values(self._time.now_ms()),
            owner=None,
            journal=self.journal,
            type="run-woken",
            payload=payload,
        )
        return None if done is None else Woken(run_id, was[0], done[0])

    def _wake_in(self, conn: Connection, run_id: str) -> Woken | NotWaiting | NotFound:
        row = row_in(conn, run_id)
        if row is None:
            return NotFound(run_id)
        if row.status != "suspended":
            return NotWaiting(run_id, row.status)
        try:
            was = decode_wait(row.waiting_reason, row.wake_at_ms, row.wait_token_digest)
        except Undecodable as exc:
            raise point_read_failed("waiting run", run_id, exc) from exc
        # The fact comes from the update's own RETURNING (the row as this transaction leaves it), not a read.
        rev, fact = bump_run_observed(conn, self.db, run_id, _wake_values(self._time.now_ms()))
        self.journal.append_in(conn, run_id, "run-woken", {"from_reason": was.reason, "fact": fact})
        return Woken(run_id, was, rev)

    # -- the waiting taxonomy ------------------------------------------------------------------------------
    def waiting(self, run_id: str) -> WaitingRun | NotWaiting | NotFound:
        """The decoded wait of one run. A corrupt waiting row raises ``decode_failed``."""

        def fn(conn: Connection) -> WaitingRun | NotWaiting | NotFound:
            row = conn.execute(WAITING_COLUMNS.where(_r.run_id == run_id)).first()
            if row is None:
                return NotFound(run_id)
            if row.status != "suspended":
                return NotWaiting(run_id, row.status)
            try:
                return waiting_run(conn, row)
            except Undecodable as exc:
                raise point_read_failed("waiting run", run_id, exc) from exc

        return self.db.read(fn)

    def waiting_runs(
        self,
        where: WaitingFilter = WaitingFilter(),
        *,
        limit: int = 100,
        after: tuple[int, str] | None = None,
    ) -> list[WaitingRun]:
        """Parked runs matching ``where``, oldest change first (by (updated_at_ms, run_id), after ``after``).
        Undecodable rows are skipped with one warning each naming the run id."""
        _check_limit(limit)
        q = WAITING_COLUMNS.where(_r.status == "suspended", _r.waiting_reason.is_not(None))
        if where.reason is not None:
            q = q.where(_r.waiting_reason == where.reason)
        if where.due_before_ms is not None:
            q = q.where(
                _r.wake_at_ms.is_not(None), _r.wake_at_ms <= _check_ms("due_before_ms", where.due_before_ms)
            )
        if where.cancel_requested is True:
            q = q.where(_r.cancel_requested_at_ms.is_not(None))
        elif where.cancel_requested is False:
            q = q.where(_r.cancel_requested_at_ms.is_(None))
        if where.flows is not None:
            q = q.where(_r.flow.in_(sorted(set(where.flows))))
        if after is not None:
            q = q.where(sa.tuple_(_r.updated_at_ms, _r.run_id) > sa.tuple_(*after))
        q = q.order_by(_r.updated_at_ms, _r.run_id).limit(limit)

        def fn(conn: Connection) -> list[WaitingRun]:
            out: list[WaitingRun] = []
            for row in conn.execute(q).all():
                try:
                    out.append(waiting_run(conn, row))
                except Undecodable as exc:
                    _skip("runs (waiting)", row.run_id, exc)
            return out

        return self.db.read(fn)


# -------------------------------------------------------------------------------------------------------------


_EARLIEST_PENDING = DriverStatement(
    sa.select(sa.func.min(_k.due_at_ms)).where(
        _k.execution_id == sa.bindparam("b_run_id"), _k.completed_at_ms.is_(None)
    )
)


def _earliest_pending(conn: Connection, run_id: str) -> int | None:
    row = _EARLIEST_PENDING.first(conn, {"b_run_id": run_id})
    return None if row is None or row[0] is None else int(row[0])


# Whether the deferred ``b_name`` of run ``b_run_id`` completed (its address's flow is the run's).
_DEFERRED_DONE = DriverStatement(
    sa.select(sa.literal(1)).where(
        sa.exists().where(
            _d.execution_id == sa.bindparam("b_run_id"),
            _d.name == sa.bindparam("b_name"),
            _d.flow == sa.select(_r.flow).where(_r.run_id == sa.bindparam("b_run_id")).scalar_subquery(),
        )
    )
)

# The guards of a one-statement park, over the run row being updated (correlated): (auto, deferred) -> guard.
_NO_PENDING_CLOCK = ~sa.exists().where(_k.execution_id == _r.run_id, _k.completed_at_ms.is_(None))
_NOT_COMPLETED = ~sa.exists().where(
    _d.flow == _r.flow, _d.execution_id == _r.run_id, _d.name == sa.bindparam("g_deferred", type_=sa.Text)
)
_PARK_GUARDS: dict[tuple[bool, bool], Guard | None] = {
    (False, False): None,
    (True, False): Guard("park-auto", _NO_PENDING_CLOCK),
    (False, True): Guard("park-deferred", _NOT_COMPLETED),
    (True, True): Guard("park-auto-deferred", sa.and_(_NO_PENDING_CLOCK, _NOT_COMPLETED)),
}


def _wake_values(now: int) -> dict[str, Any]:
    return {**CLEAR_WAIT, **CLEAR_CLAIM, "status": "pending", "updated_at_ms": now}


def _deferred_q(flow: str, execution_id: str, name: str) -> Any:
    return sa.select(deferred_completions).where(
        _d.flow == flow, _d.execution_id == execution_id, _d.name == name
    )


def _clock_q(flow: str, execution_id: str, name: str) -> Any:
    return sa.select(clock_deadlines).where(_k.flow == flow, _k.execution_id == execution_id, _k.name == name)
