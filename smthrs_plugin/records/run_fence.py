"""The fence every durable write of an owned run passes, and the one statement shape of a run transition.

Part of the runs owner (:mod:`smthrs_plugin.records.runs`, which re-exports it).

- :func:`assert_owner` runs INSIDE the caller's write transaction and refuses (``FenceLost``) unless the run row is
  ``running`` and owned by exactly this incarnation; ``terminal=True`` also refuses when a cancellation was
  requested (``FenceLost(cancel_requested)``).
- A transition is one conditional statement (:class:`RunUpdate`): a miss writes nothing and consumes no revision;
  its RETURNING is the row the journaled fact is built from (:func:`bump_run_observed`).
- On PostgreSQL a journaled transition may be ONE statement with its record (:func:`bump_run_journaled`,
  :meth:`RunUpdate.write_journaled`); a stale or missing hint (:func:`remember_observed`) writes nothing and the
  caller runs the transaction path. The journal bytes are the same either way.
- :func:`fenced_block` checks the fence ONCE for a block of writes that cannot change the run row; terminal checks
  (``terminal=True``) always read the row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import FenceLost, StoreError
from ..stores.database import Database
from ..stores.schema import meta, runs
from ..stores.statements import DriverStatement
from ._run_rows import OBSERVED_COLUMNS, OwnerId, fact_of
from .journal import Appended, Journal, PendingRecord, record_cte

__all__ = [
    "assert_owner",
    "fenced_block",
    "update_run",
    "bump_run",
    "bump_run_observed",
    "bump_run_journaled",
    "remember_observed",
    "RunUpdate",
    "OWNED",
    "FenceRow",
    "Guard",
]

_r = runs.c
_FENCE_ROW = DriverStatement(
    sa.select(
        _r.status, _r.owner_host, _r.owner_pid, _r.owner_nonce, _r.cancel_requested_at_ms, _r.revision
    ).where(_r.run_id == sa.bindparam("b_run_id"))
)

# SET columns come from the execution parameters: one cached compiled form per column set, no expression
# building per call (the hot transitions run thousands of times a second).
_UPDATE_RUN = sa.update(runs).where(runs.c.run_id == sa.bindparam("b_run_id"))


#: Running and owned by the incarnation in the ``b_host``/``b_pid``/``b_nonce`` parameters.
OWNED = sa.and_(
    _r.status == "running",
    _r.owner_host == sa.bindparam("b_host"),
    _r.owner_pid == sa.bindparam("b_pid"),
    _r.owner_nonce == sa.bindparam("b_nonce"),
)

_NEXT_REVISION = sa.select(meta.c.revision + 1).where(meta.c.id == 1).scalar_subquery()
_BUMP_META = DriverStatement(sa.update(meta).where(meta.c.id == 1).values(revision=meta.c.revision + 1))


class RunUpdate:
    """One compare-and-set of one run row that takes the next global revision, as one unit of the caller's write.

    ``UPDATE runs SET <values>, revision = <next> WHERE run_id = :b_run_id AND <where> RETURNING revision,
    <returning>``: the row gets exactly the value the revision counter is bumped to, and ONLY when the row
    matched. A miss writes nothing and consumes no revision, so a caller may diagnose it (or take another path)
    inside the same transaction. The condition is evaluated by the database inside the transaction, never on a
    value read earlier: this is where the fence is checked.

    PostgreSQL: one statement (the counter bump is a data-modifying CTE conditioned on the row update).
    SQLite: the row update, then the counter bump when it matched; both under the write lock the transaction
    holds since ``BEGIN IMMEDIATE``, so nothing can come between them.

    ``journaled=True`` also builds the PostgreSQL form of :meth:`write_journaled`.
    """

    __slots__ = ("_sqlite", "_pg", "_pg_journaled")

    def __init__(
        self,
        values: Mapping[str, Any],
        *,
        where: sa.ColumnElement[bool] | None = None,
        returning: Sequence[sa.ColumnElement[Any]] = (),
        journaled: bool = False,
    ) -> None:
        cond = [_r.run_id == sa.bindparam("b_run_id")]
        if where is not None:
            cond.append(where)
        values = {**values, "revision": _NEXT_REVISION}
        upd = sa.update(runs).where(*cond).values(values).returning(_r.revision, *returning)
        self._sqlite = DriverStatement(upd)
        self._pg = DriverStatement(_with_revision_bump(upd))
        self._pg_journaled: DriverStatement | None = None
        if journaled:
            # The row must still show exactly the observed columns the caller predicted the fact from.
            seen = [
                c.is_not_distinct_from(sa.bindparam("p_" + c.key, type_=c.type)) for c in OBSERVED_COLUMNS
            ]
            upd = sa.update(runs).where(*cond, *seen).values(values).returning(_r.revision, *returning)
            self._pg_journaled = DriverStatement(_with_revision_bump(upd, journaled=True))

    def first(self, conn: Connection, params: Mapping[str, Any]) -> Any | None:
        """Run it in ``conn``'s write transaction: the changed row (``revision`` first), or None on a miss."""
        if conn.dialect.name == "postgresql":
            return self._pg.first(conn, params)
        row = self._sqlite.first(conn, params)
        if row is not None:
            _BUMP_META.rowcount(conn)
        return row

    def write(self, db: Database, params: Mapping[str, Any]) -> Any | None:
        """Run it as a write transaction of its own (joining an open write on this thread), like :meth:`first`.

        On PostgreSQL it is one statement, so :meth:`Database.write_statement` sends it without BEGIN/COMMIT:
        one round trip for the whole fenced, revision-bumping transition."""
        if db.dialect == "postgresql":
            return db.write_statement(self._pg, params)
        return db.write(lambda c: self.first(c, params))

    def write_journaled(
        self, db: Database, params: Mapping[str, Any], seen: Any, record: PendingRecord
    ) -> Any | None:
        """PostgreSQL: the update, its revision bump AND its journal record as ONE statement sent alone (one
        round trip for a whole journaled transition); returns the changed row plus the record's ``seq``.

        For a record that embeds the run's execution fact, the caller computes the fact from ``seen`` (the
        :data:`OBSERVED_COLUMNS` it last saw, e.g. returned by the previous transition) with its own changes
        applied; the update then matches only while every observed column still equals ``seen``, so that fact
        is exactly the one a read after the change would give. None, with nothing written, when the row does
        not match (fence, condition, or a column changed since ``seen``): take the multi-statement path then.
        The caller reports the record with :meth:`Journal.written` after a row came back."""
        assert self._pg_journaled is not None and db.dialect == "postgresql"
        args = {**params, **record.params()}
        for c in OBSERVED_COLUMNS:
            args["p_" + c.key] = getattr(seen, c.key)
        return db.write_statement(self._pg_journaled, args)


def _with_revision_bump(upd: sa.Update, *, journaled: bool = False) -> sa.Select[Any]:
    # PostgreSQL: the run update as a CTE, the counter bumped only if it changed a row, and (journaled) the
    # record appended only then. Selecting through the joins keeps every part in the statement.
    changed = upd.cte("changed")
    rev = (
        sa.update(meta)
        .where(meta.c.id == 1, sa.exists(sa.select(sa.literal(1)).select_from(changed)))
        .values(revision=meta.c.revision + 1)
        .returning(meta.c.revision)
        .cte("rev")
    )
    joined = changed.join(rev, sa.true())
    if not journaled:
        return sa.select(*changed.c).select_from(joined)
    record = record_cte(changed)
    return sa.select(*changed.c, record.c.seq).select_from(joined.join(record, sa.true()))


def update_run(conn: Connection, run_id: str, values: dict[str, Any]) -> int:
    """``UPDATE runs SET <values> WHERE run_id = :run_id`` on ``conn``; returns the matched row count."""
    return int(conn.execute(_UPDATE_RUN, {"b_run_id": run_id, **values}).rowcount)


_BUMPS: dict[tuple[tuple[str, ...], bool, bool, str | None], RunUpdate] = {}


@dataclass(frozen=True)
class Guard:
    """An extra condition a one-statement journaled transition must also meet (:func:`bump_run_journaled`): a
    boolean clause over the run row and bind parameters, built once by its owner and named for the statement cache.
    When it does not hold, nothing is written and the caller takes its transaction path, which decides and
    journals the case the guard excluded (e.g. a park that must wake at once)."""

    name: str
    clause: sa.ColumnElement[bool]


def _bump_for(
    columns: tuple[str, ...], fenced: bool, observed: bool, guard: Guard | None = None
) -> RunUpdate:
    k = (columns, fenced, observed, None if guard is None else guard.name)
    u = _BUMPS.get(k)
    if u is None:
        if "revision" in columns:
            raise StoreError("invalid_argument", "bump_run sets the revision itself; do not pass one")
        conds = [
            c for c in (OWNED if fenced else None, None if guard is None else guard.clause) if c is not None
        ]
        # A racing thread may build the same statement too; either copy is equivalent.
        u = _BUMPS[k] = RunUpdate(
            {c: sa.bindparam("v_" + c, type_=runs.c[c].type) for c in columns},
            where=sa.and_(*conds) if conds else None,
            returning=OBSERVED_COLUMNS if observed else (),
            journaled=observed,
        )
    return u


# The observed columns of a run as this process's last transition of it left them: a HINT for the one-statement
# journaled transitions (bump_run_journaled), which verify it in SQL and fall back when it is stale. A hint is
# never trusted: a stale one (another process's write, a rolled-back transaction) only costs that fallback.
_HINTS: dict[tuple[str, str], Any] = {}
_MAX_HINTS = 4096
_OBSERVED_KEYS = frozenset(c.key for c in OBSERVED_COLUMNS)


def remember_observed(db: Database, row: Any) -> None:
    """Record ``row`` (holding :data:`OBSERVED_COLUMNS`, as a transition's RETURNING gives it) as the hint for
    the next journaled transition of its run."""
    hints = _HINTS
    if len(hints) >= _MAX_HINTS:
        try:
            del hints[next(iter(hints))]  # the oldest entry
        except (KeyError, StopIteration, RuntimeError):
            pass  # another thread evicted or inserted concurrently: the bound is approximate by design
    hints[(db.url, row.run_id)] = row


def bump_run(
    conn: Connection, db: Database, run_id: str, values: dict[str, Any], *, owner: OwnerId | None = None
) -> int:
    """Update run ``run_id`` with ``values`` and a new global revision (same transaction); return the revision.

    With ``owner``, the update is FENCED in its own WHERE clause (running and owned by ``owner``), which saves
    the separate fence read; a miss is diagnosed by :func:`assert_owner` and raises ``FenceLost``."""
    return bump_run_observed(conn, db, run_id, values, owner=owner, observe=False)[0]


def bump_run_observed(
    conn: Connection,
    db: Database,
    run_id: str,
    values: dict[str, Any],
    *,
    owner: OwnerId | None = None,
    observe: bool = True,
) -> tuple[int, dict[str, Any]]:
    """:func:`bump_run` that also returns the run's execution fact as the update left it (facts.py), from the
    update's own RETURNING instead of a read after it (``{}`` with ``observe=False``)."""
    params = _bump_params(run_id, values, owner)
    row = _bump_for(tuple(values), owner is not None, observe).first(conn, params)
    if row is None:
        if owner is not None:
            assert_owner(conn, run_id, owner)  # raises FenceLost saying who holds the run now
        raise StoreError("store_failed", f"run {run_id!r} vanished inside its own write transaction")
    if not observe:
        return int(row.revision), {}
    remember_observed(db, row)
    return int(row.revision), fact_of(row)


def bump_run_journaled(
    db: Database,
    run_id: str,
    values: dict[str, Any],
    *,
    owner: OwnerId | None,
    journal: Journal,
    type: str,
    payload: Callable[[Any, dict[str, Any]], dict[str, Any] | None],
    guard: Guard | None = None,
    guard_params: Mapping[str, Any] | None = None,
) -> tuple[int, Appended] | None:
    """The transition of :func:`bump_run_observed` (fenced on ``owner``; unfenced with None) AND its journal
    record ``type`` as ONE statement sent alone (PostgreSQL, outside an open write): one round trip for the whole
    transition. ``payload(seen, fact)`` builds the record from the hinted row as it was and the fact after it (None:
    the hint does not make one; take the transaction path).

    The fact is computed from this process's hint of the row (:func:`remember_observed`) with ``values``
    applied; the statement matches only while the row is exactly that hint, owned by ``owner`` when given, and
    ``guard`` (with its ``guard_params``) holds. Returns ``(revision, appended)``, or None (nothing written) when
    there is no hint, the row moved, the fence or the guard does not hold, or the database is SQLite (one round
    trip buys nothing there): then run the transaction path, which decides and raises exactly as before."""
    if db.dialect != "postgresql" or db.in_write():
        return None
    seen = _HINTS.get((db.url, run_id))
    if seen is None:
        return None
    after = seen._replace(**{k: v for k, v in values.items() if k in _OBSERVED_KEYS})
    body = payload(seen, fact_of(after))
    if body is None:
        return None
    record = journal.encode(run_id, type, body)
    update = _bump_for(tuple(values), owner is not None, True, guard)
    params = _bump_params(run_id, values, owner)
    if guard_params:
        params.update(guard_params)
    row = update.write_journaled(db, params, seen, record)
    if row is None:
        _HINTS.pop((db.url, run_id), None)
        return None
    remember_observed(db, row)
    return int(row.revision), journal.written(record, int(row.seq))


def _bump_params(run_id: str, values: dict[str, Any], owner: OwnerId | None) -> dict[str, Any]:
    params: dict[str, Any] = {"v_" + k: v for k, v in values.items()}
    params["b_run_id"] = run_id
    if owner is not None:
        params.update(b_host=owner.host_id, b_pid=owner.pid, b_nonce=owner.nonce)
    return params


@dataclass(frozen=True)
class FenceRow:
    """What the fence read from the run row (so the caller need not read it again)."""

    run_id: str
    status: str
    cancel_requested_at_ms: int | None
    revision: int


#: The fence checked by the innermost :func:`fenced_block` of this thread: (connection, run id, owner, row).
_BLOCK = threading.local()


@contextmanager
def fenced_block(conn: Connection, run_id: str, owner: OwnerId) -> Iterator[FenceRow]:
    """Check the fence once (``FenceLost`` otherwise) for writes on ``conn`` that never change the run row of
    ``run_id``; :func:`assert_owner` inside answers from this check (see the module invariants)."""
    row = assert_owner(conn, run_id, owner)
    outer = getattr(_BLOCK, "fence", None)
    _BLOCK.fence = (conn, run_id, owner, row)
    try:
        yield row
    finally:
        _BLOCK.fence = outer


def assert_owner(conn: Connection, run_id: str, owner: OwnerId, *, terminal: bool = False) -> FenceRow:
    """Refuse (``FenceLost``) unless ``run_id`` is running and owned by ``owner``; call inside the write.

    With ``terminal=True`` also refuse when a cancellation was requested (code ``cancel_requested``)."""
    block = getattr(_BLOCK, "fence", None)
    if (
        block is not None
        and not terminal
        and block[0] is conn
        and block[1] == run_id
        and (block[2] is owner or block[2] == owner)
    ):
        return block[3]  # type: ignore[no-any-return]
    row = _FENCE_ROW.first(conn, {"b_run_id": run_id})
    if row is None:
        raise FenceLost(
            "fence_lost",
            f"run {run_id!r} no longer exists, so {owner} cannot write to it; stop working on this run",
            run_id=run_id,
            owner=str(owner),
        )
    holder = (row.owner_host, row.owner_pid, row.owner_nonce)
    if row.status != "running" or holder != (owner.host_id, owner.pid, owner.nonce):
        now_held = (
            "nobody" if row.owner_nonce is None else f"{row.owner_host}/{row.owner_pid}/{row.owner_nonce}"
        )
        raise FenceLost(
            "fence_lost",
            f"{owner} no longer owns run {run_id!r} (status {row.status}, owner {now_held}); another process took "
            "it over or recovery fenced it: stop working on this run and never retry the write under this owner",
            run_id=run_id,
            owner=str(owner),
            status=row.status,
        )
    if terminal and row.cancel_requested_at_ms is not None:
        raise FenceLost(
            "cancel_requested",
            f"run {run_id!r} had a cancellation requested at {row.cancel_requested_at_ms} ms; settle it as "
            "cancelled instead of completing it",
            run_id=run_id,
            cancel_requested_at_ms=int(row.cancel_requested_at_ms),
        )
    return FenceRow(
        run_id,
        row.status,
        None if row.cancel_requested_at_ms is None else int(row.cancel_requested_at_ms),
        int(row.revision),
    )
