"""The attempts owner: node attempts of a run, the durable record a reclaiming owner replays settled work from.

Invariants:

- **One owner.** Every statement on ``attempts`` is in this module and :func:`_decode` is the only decoder of its
  rows; the scheduler (and anything else) calls :class:`AttemptStore`. The fence is the runs owner's
  (:func:`~.runs.assert_owner`), checked inside the same transaction.
- Rows are keyed by (run_id, key_digest, attempt) where ``key_digest = sha256(utf8(key))`` of the node's
  ``key1_`` key. :meth:`AttemptStore.begin` allocates ``attempt = max + 1`` for that pair
  inside its transaction; an attempt moves ``started → completed | failed`` exactly once.
- Every write is FENCED: it asserts, inside its transaction, that the writer still owns the running run, so a
  zombie owner (stalled, then resumed after a steal) can neither start nor settle an attempt.
- In a transaction that allows deferred writes (``Database.allow_deferred``: the scheduler's group commits) a
  begun row is written with the others of that transaction by one statement, settled already when its settlement
  came in the same transaction; every other statement of this module writes the deferred rows first.
- :meth:`AttemptStore.latest_completed` is what a scheduler replays after a restart: the completed attempt with
  the highest number for (run, key). Reads decode JSON themselves: list reads skip an undecodable row with one
  warning naming its key; point reads fail with ``decode_failed``.

Prior art: the reference's attempt rows ("attempts and replay"), Temporal's activity task attempts.
"""

from __future__ import annotations

import builtins
import logging
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import is_key, key_digest
from ..errors import StoreError
from ..stores.database import Database
from ..stores.schema import ATTEMPT_STATES, attempts
from ..stores.statements import DriverStatement
from .runs import OwnerId, Undecodable, assert_owner, json_column, json_text

__all__ = ["AttemptStore", "AttemptRecord", "AttemptStarted", "AttemptCompleted", "AttemptFailed"]

# The logger keeps the name operators configure (it predates the move to records/).
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttemptRecord:
    run_id: str
    key: str
    key_digest: str
    attempt: int
    state: str
    node_id: str | None
    owner_nonce: str
    started_at_ms: int
    finished_at_ms: int | None = None
    meta: Any = None
    result: Any = None
    error: Any = None


@dataclass(frozen=True)
class AttemptStarted:
    run_id: str
    key_digest: str
    attempt: int


@dataclass(frozen=True)
class AttemptCompleted:
    run_id: str
    key_digest: str
    attempt: int


@dataclass(frozen=True)
class AttemptFailed:
    run_id: str
    key_digest: str
    attempt: int


_A = attempts.c
#: Begin attempt ``b_attempt`` of (run, key) in ONE statement; a number already taken violates the primary key.
_BEGIN_AT = DriverStatement(
    sa.insert(attempts).values(
        run_id=sa.bindparam("b_run_id", type_=sa.Text),
        key_digest=sa.bindparam("b_digest", type_=sa.Text),
        key=sa.bindparam("b_key", type_=sa.Text),
        attempt=sa.bindparam("b_attempt", type_=sa.Integer),
        state="started",
        node_id=sa.bindparam("b_node_id", type_=sa.Text),
        owner_nonce=sa.bindparam("b_nonce", type_=sa.Text),
        meta_json=sa.bindparam("b_meta", type_=sa.Text),
        started_at_ms=sa.bindparam("b_now", type_=sa.BigInteger),
    )
)
#: Settle a started attempt in ONE statement; no row matched means it was never begun or is already settled.
_SETTLE_STARTED = DriverStatement(
    sa.update(attempts)
    .where(
        _A.run_id == sa.bindparam("b_run_id", type_=sa.Text),
        _A.key_digest == sa.bindparam("b_digest", type_=sa.Text),
        _A.attempt == sa.bindparam("b_attempt", type_=sa.Integer),
        _A.state == "started",
    )
    .values(
        state=sa.bindparam("v_state", type_=sa.Text),
        finished_at_ms=sa.bindparam("v_now", type_=sa.BigInteger),
        result_json=sa.func.coalesce(sa.bindparam("v_result", type_=sa.Text), _A.result_json),
        error_json=sa.func.coalesce(sa.bindparam("v_error", type_=sa.Text), _A.error_json),
        meta_json=sa.func.coalesce(sa.bindparam("v_meta", type_=sa.Text), _A.meta_json),
    )
)


#: Insert a row in any state, from the parameters :class:`_Begun` collected.
_INSERT_ROW = DriverStatement(
    sa.insert(attempts).values(
        run_id=sa.bindparam("b_run_id", type_=sa.Text),
        key_digest=sa.bindparam("b_digest", type_=sa.Text),
        key=sa.bindparam("b_key", type_=sa.Text),
        attempt=sa.bindparam("b_attempt", type_=sa.Integer),
        state=sa.bindparam("v_state", type_=sa.Text),
        node_id=sa.bindparam("b_node_id", type_=sa.Text),
        owner_nonce=sa.bindparam("b_nonce", type_=sa.Text),
        meta_json=sa.bindparam("b_meta", type_=sa.Text),
        started_at_ms=sa.bindparam("b_now", type_=sa.BigInteger),
        finished_at_ms=sa.bindparam("v_finished", type_=sa.BigInteger),
        result_json=sa.bindparam("v_result", type_=sa.Text),
        error_json=sa.bindparam("v_error", type_=sa.Text),
    )
)


class _Begun:
    """Attempts begun in one transaction that allows deferred writes (:meth:`Database.deferred`), not written yet:
    a settlement in the same transaction settles the row here, and the rows are written together, in begin order,
    by one statement before any other statement on ``attempts`` (or the commit)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, int], dict[str, Any]] = {}

    def flush(self, conn: Connection) -> None:
        rows, self.rows = self.rows, {}
        _INSERT_ROW.many(conn, list(rows.values()))


class AttemptStore:
    """Fenced attempt lifecycle over the ``attempts`` table."""

    def __init__(self, db: Database, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.db = db
        self.clock = clock

    def begin(
        self, run_id: str, owner: OwnerId, key: str, *, node_id: str | None = None, meta: Any = None
    ) -> AttemptStarted:
        """Start the next attempt of ``key`` in ``run_id`` (fenced)."""
        digest = _digest(key)
        meta_json = json_text("meta", meta)

        def fn(conn: Connection) -> AttemptStarted:
            assert_owner(conn, run_id, owner)
            a = attempts.c
            n = conn.execute(
                sa.select(sa.func.coalesce(sa.func.max(a.attempt), 0)).where(
                    a.run_id == run_id, a.key_digest == digest
                )
            ).scalar_one()
            attempt = int(n) + 1
            conn.execute(
                sa.insert(attempts).values(
                    run_id=run_id,
                    key_digest=digest,
                    key=key,
                    attempt=attempt,
                    state="started",
                    node_id=node_id,
                    owner_nonce=owner.nonce,
                    meta_json=meta_json,
                    started_at_ms=self.clock.now_ms(),
                )
            )
            return AttemptStarted(run_id, digest, attempt)

        return self.db.write(fn)

    def begin_in(
        self,
        conn: Connection,
        run_id: str,
        owner: OwnerId,
        key: str,
        *,
        attempt: int,
        node_id: str | None,
        meta: Any,
    ) -> AttemptStarted:
        """Begin attempt number ``attempt`` of ``key`` inside the caller's write transaction ``conn`` (fenced
        there), in one statement and no savepoint. For the run's single writer (the scheduler's coordinator),
        which numbers its attempts itself from the rows it read at the start of its pass, so a job can know its
        row before this commits; a number already taken is refused by the primary key (``StoreError``), never
        reused."""
        return self.begin_text_in(
            conn, run_id, owner, key, attempt=attempt, node_id=node_id, meta_json=json_text("meta", meta)
        )

    def begin_text_in(
        self,
        conn: Connection,
        run_id: str,
        owner: OwnerId,
        key: str,
        *,
        attempt: int,
        node_id: str | None,
        meta_json: str | None,
    ) -> AttemptStarted:
        """:meth:`begin_in` with the ``meta`` column already written as canonical JSON text by the caller (it MUST
        be ``canonical_bytes(meta).decode()`` of plain JSON data, or None): for the scheduler, which writes the
        meta of every attempt it begins from parts it validated once."""
        digest = _begin_digest(key, attempt)
        return self._begin_at(conn, run_id, owner, key, digest, attempt, node_id, meta_json)

    def _begin_at(
        self,
        conn: Connection,
        run_id: str,
        owner: OwnerId,
        key: str,
        digest: str,
        attempt: int,
        node_id: str | None,
        meta_json: str | None,
    ) -> AttemptStarted:
        assert_owner(conn, run_id, owner)
        params = {
            "b_run_id": run_id,
            "b_digest": digest,
            "b_key": key,
            "b_attempt": attempt,
            "b_node_id": node_id,
            "b_nonce": owner.nonce,
            "b_meta": meta_json,
            "b_now": self.clock.now_ms(),
        }
        begun = self.db.deferred(_Begun, _Begun)
        if begun is not None and (run_id, digest, attempt) not in begun.rows:
            begun.rows[(run_id, digest, attempt)] = {
                **params,
                "v_state": "started",
                "v_finished": None,
                "v_result": None,
                "v_error": None,
            }
            return AttemptStarted(run_id, digest, attempt)
        self.db.flush_deferred()  # a number begun twice is refused by the primary key, as always
        _BEGIN_AT.rowcount(conn, params)
        return AttemptStarted(run_id, digest, attempt)

    def complete_in(
        self, conn: Connection, run_id: str, owner: OwnerId, key: str, attempt: int, *, result: Any, meta: Any
    ) -> AttemptCompleted:
        """:meth:`complete` inside the caller's write transaction ``conn`` (fenced there), in one statement."""
        values = {"v_result": json_text("result", result), "v_error": None, "v_meta": json_text("meta", meta)}
        return AttemptCompleted(
            run_id, self._settle_in(conn, run_id, owner, key, attempt, "completed", values), attempt
        )

    def complete_text_in(
        self,
        conn: Connection,
        run_id: str,
        owner: OwnerId,
        key: str,
        attempt: int,
        *,
        result_json: str | None,
        meta_json: str | None,
    ) -> AttemptCompleted:
        """:meth:`complete_in` with ``result`` and ``meta`` already written as canonical JSON text by the caller
        (each MUST be ``canonical_bytes(value).decode()`` of plain JSON data, or None for a None value)."""
        values = {"v_result": result_json, "v_error": None, "v_meta": meta_json}
        return AttemptCompleted(
            run_id, self._settle_in(conn, run_id, owner, key, attempt, "completed", values), attempt
        )

    def fail_in(
        self, conn: Connection, run_id: str, owner: OwnerId, key: str, attempt: int, *, error: Any, meta: Any
    ) -> AttemptFailed:
        """:meth:`fail` inside the caller's write transaction ``conn`` (fenced there), in one statement."""
        values = {"v_result": None, "v_error": json_text("error", error), "v_meta": json_text("meta", meta)}
        return AttemptFailed(
            run_id, self._settle_in(conn, run_id, owner, key, attempt, "failed", values), attempt
        )

    def _settle_in(
        self,
        conn: Connection,
        run_id: str,
        owner: OwnerId,
        key: str,
        attempt: int,
        state: str,
        values: dict[str, Any],
    ) -> str:
        """Settle on ``conn``; returns the key digest (or refuses: never begun, already settled)."""
        digest = _digest(key)
        assert_owner(conn, run_id, owner)
        now = self.clock.now_ms()
        begun = self.db.deferred(_Begun, _Begun)
        row = None if begun is None else begun.rows.get((run_id, digest, attempt))
        if row is not None and row["v_state"] == "started":
            # Begun in this transaction and not written yet: the row is written settled, exactly what the insert
            # followed by the update below would leave.
            row["v_state"], row["v_finished"] = state, now
            # The update's coalesce(new, old) of each JSON column.
            if values["v_result"] is not None:
                row["v_result"] = values["v_result"]
            if values["v_error"] is not None:
                row["v_error"] = values["v_error"]
            if values["v_meta"] is not None:
                row["b_meta"] = values["v_meta"]
            return digest
        self.db.flush_deferred()
        params = {"b_run_id": run_id, "b_digest": digest, "b_attempt": attempt, "v_state": state}
        params.update(values, v_now=now)
        if _SETTLE_STARTED.rowcount(conn, params) == 1:
            return digest
        a = attempts.c
        found = conn.execute(
            sa.select(a.state).where(a.run_id == run_id, a.key_digest == digest, a.attempt == attempt)
        ).first()
        if found is None:
            raise StoreError(
                "not_found",
                f"attempt {attempt} of {key} in run {run_id!r} was never begun; call begin() first",
            )
        raise StoreError(
            "invalid_argument",
            f"attempt {attempt} of {key} in run {run_id!r} is already {found.state}; begin a new attempt",
        )

    def complete(
        self, run_id: str, owner: OwnerId, key: str, attempt: int, *, result: Any = None, meta: Any = None
    ) -> AttemptCompleted:
        """Settle a started attempt as completed with ``result`` (fenced), in a transaction of its own (or a
        savepoint of the caller's open write)."""
        return self.db.write(
            lambda conn: self.complete_in(conn, run_id, owner, key, attempt, result=result, meta=meta)
        )

    def fail(
        self, run_id: str, owner: OwnerId, key: str, attempt: int, *, error: Any = None, meta: Any = None
    ) -> AttemptFailed:
        """Settle a started attempt as failed with ``error`` (fenced), in a transaction of its own (or a savepoint
        of the caller's open write)."""
        return self.db.write(
            lambda conn: self.fail_in(conn, run_id, owner, key, attempt, error=error, meta=meta)
        )

    def fail_started_in(
        self, conn: Connection, run_id: str, owner: OwnerId, *, error: Any
    ) -> builtins.list[AttemptRecord]:
        """Settle every attempt of ``run_id`` that ``owner`` began and that is still ``started`` as ``failed`` with
        ``error``, inside the caller's transaction ``conn`` (fenced): the interrupt of a scheduler pass marks all
        its running attempts at once, so no reader sees some interrupted siblings settled and others running.

        Only this owner's rows move (``owner_nonce``): an attempt a previous owner left ``started`` is recovery's
        uncertainty, not this pass's to settle; terminal rows are never overwritten (the update re-checks
        ``started``). Returns the rows it settled, ordered by (key digest, attempt), as they are now."""
        error_json = json_text("error", error)
        assert_owner(conn, run_id, owner)
        self.db.flush_deferred()
        a = attempts.c
        still = sa.and_(a.run_id == run_id, a.owner_nonce == owner.nonce, a.state == "started")
        rows = conn.execute(sa.select(attempts).where(still).order_by(a.key_digest, a.attempt)).all()
        if not rows:
            return []
        now = self.clock.now_ms()
        conn.execute(
            sa.update(attempts).where(still).values(state="failed", finished_at_ms=now, error_json=error_json)
        )
        out: builtins.list[AttemptRecord] = []
        for row in rows:
            try:
                rec = _decode(row)
            except Undecodable:
                # The row still settles (its state column is what matters); its unreadable JSON stays unread.
                rec = AttemptRecord(
                    row.run_id, row.key, row.key_digest, int(row.attempt), "started", row.node_id,
                    row.owner_nonce, int(row.started_at_ms),
                )  # fmt: skip
            out.append(replace(rec, state="failed", finished_at_ms=now, result=None, error=error))
        return out

    def state_in(self, conn: Connection, run_id: str, key: str, attempt: int) -> str | None:
        """The state of attempt ``attempt`` of ``key`` in ``run_id`` on ``conn`` (None when never begun): what a
        cleanup re-checks inside its transaction before settling an attempt it thinks is still open."""
        self.db.flush_deferred()
        a = attempts.c
        return conn.execute(
            sa.select(a.state).where(
                a.run_id == run_id, a.key_digest == key_digest(key), a.attempt == attempt
            )
        ).scalar()

    def latest_completed(self, run_id: str, key: str) -> AttemptRecord | None:
        """The highest-numbered completed attempt of ``key`` in ``run_id`` (what a restarted owner replays)."""
        digest = _digest(key)
        self.db.flush_deferred()
        a = attempts.c
        q = (
            sa.select(attempts)
            .where(a.run_id == run_id, a.key_digest == digest, a.state == "completed")
            .order_by(a.attempt.desc())
            .limit(1)
        )
        row = self.db.read(lambda c: c.execute(q).first())
        if row is None:
            return None
        try:
            return _decode(row)
        except Undecodable as exc:
            raise StoreError(
                "decode_failed",
                f"attempt {row.attempt} of {key} in run {run_id!r} does not decode ({exc}); the row is corrupt",
                cause=exc,
            ) from exc

    def list(self, run_id: str) -> builtins.list[AttemptRecord]:
        """Every attempt of ``run_id`` by (key_digest, attempt); undecodable rows skipped with one warning each."""
        self.db.flush_deferred()
        a = attempts.c
        q = sa.select(attempts).where(a.run_id == run_id).order_by(a.key_digest, a.attempt)
        out: builtins.list[AttemptRecord] = []
        for row in self.db.read(lambda c: c.execute(q).all()):
            try:
                out.append(_decode(row))
            except Undecodable as exc:
                log.warning(
                    "storage integrity: skipping undecodable attempts row (%r, %r, %d): %s",
                    row.run_id, row.key_digest, row.attempt, exc,
                )  # fmt: skip
        return out


def _begin_digest(key: str, attempt: Any) -> str:
    digest = _digest(key)
    if type(attempt) is not int or attempt < 1:
        raise StoreError("invalid_argument", f"attempt must be a positive int, got {attempt!r}")
    return digest


def _digest(key: str) -> str:
    if not is_key(key):
        raise StoreError(
            "invalid_argument", f"{key!r} is not a key1_ key; compute it with smthrs_plugin.canonical.key"
        )
    return key_digest(key)


def _decode(row: Row[Any]) -> AttemptRecord:
    if row.state not in ATTEMPT_STATES:
        raise Undecodable(f"unknown state {row.state!r}")
    return AttemptRecord(
        run_id=row.run_id,
        key=row.key,
        key_digest=row.key_digest,
        attempt=int(row.attempt),
        state=row.state,
        node_id=row.node_id,
        owner_nonce=row.owner_nonce,
        started_at_ms=int(row.started_at_ms),
        finished_at_ms=row.finished_at_ms,
        meta=json_column(row.meta_json, "meta"),
        result=json_column(row.result_json, "result"),
        error=json_column(row.error_json, "error"),
    )
