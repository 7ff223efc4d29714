"""The one SQL database behind every durable store: SQLite (WAL, ``BEGIN IMMEDIATE``) or PostgreSQL (SERIALIZABLE).

- Every write transaction is serializable; on PostgreSQL :meth:`Database.write` re-runs the WHOLE callback on
  SQLSTATE 40001/40P01 (a bounded number of times), so a callback must be a pure function of what it reads through
  ``conn`` and its arguments: it may run more than once, and only the last run commits.
- Every store writes through :meth:`Database.write`; a ``write`` inside an open write on the same thread is a
  SAVEPOINT of the outer transaction.
- :meth:`Database.on_commit` callbacks run only after the OUTERMOST commit, in registration order; those of a
  rolled-back savepoint or a retried attempt are discarded.
- Deferred writes (:meth:`Database.deferred`, only where the transaction's runner allowed them with
  :meth:`Database.allow_deferred`) are written in that same transaction, at its outermost level: before a savepoint
  opens and before the commit, so they commit or roll back exactly as if they had run when they were asked. On
  PostgreSQL those written at the commit are sent with the COMMIT in one round trip (psycopg's pipeline mode): an
  error of any of them is raised from the commit and rolls the whole transaction back, a 40001 retries it.
- :meth:`Database.next_revision` bumps the revision in the caller's transaction: revision order is commit order.
- :meth:`Database.write_statement` runs a statement that is a whole write transaction by itself, with the same retry.
- A :class:`~.statements.DriverStatement` is compiled once per dialect and runs on the caller's open transaction,
  with the same error mapping.
- Engines are per (process, URL) and never pickled: a :class:`Database` pickles as its URL.
- SQLite file databases run with ``synchronous = FULL`` unless ``SMTHRS_SQLITE_SYNCHRONOUS=normal`` opts in
  (:func:`open_database`); one process uses one mode per database file.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, make_url

from ..errors import SmthrsError, StoreError
from ..settings import SqliteSynchronous, sqlite_synchronous_setting
from . import schema as schema
from ._group_commit import GroupCommit
from .dberrors import RETRY_SQLSTATES, connect, sqlstate, store_error
from .statements import DriverStatement, driver_error, pipeline, pipelines_supported

__all__ = [
    "Database",
    "open_database",
    "normalize_url",
    "Dialect",
    "SQLITE_BUSY_TIMEOUT_S",
    "MAX_WRITE_ATTEMPTS",
]

T = TypeVar("T")
Dialect = Literal["sqlite", "postgresql"]

log = logging.getLogger(__name__)
# Retry jitter draws from its own generator: the global `random` state belongs to the application (a seeded
# simulation, a property test) and must not move because a background heartbeat retried a transaction.
_JITTER = random.Random()

#: How long a SQLite writer waits for the write lock before failing (the lock is held for milliseconds).
SQLITE_BUSY_TIMEOUT_S = 30.0
#: Whole-transaction attempts on PostgreSQL serialization failures (40001) and deadlocks (40P01) ...
MAX_WRITE_ATTEMPTS = 64
#: ... and for at least this long: a burst of concurrent writers (many coordinators sharing one database)
#: outlasts 64 quick retries. Like SQLite's busy timeout, a writer keeps trying this long, then reports the
#: passing fault ``contended`` (the run is left resumable, never failed).
SERIALIZATION_PATIENCE_S = 30.0
_PG_CONNECT_TIMEOUT_S = 5
#: A pooled PostgreSQL connection idle longer than this is pinged before reuse.
_PG_IDLE_PING_S = 5.0
#: Write connections kept checked out between transactions (the pool size: see _Handle.take_writer).
_IDLE_WRITERS = 8
#: SQLite readers kept between single-statement reads (Database.read_statement); the rest of the read pool
#: stays free for read transactions.
_IDLE_READERS = 4
#: This process's pid, renewed in a forked child (os.getpid() is a system call; handles are looked up per call).
_PID = os.getpid()


def _renew_pid() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_renew_pid)


def open_database(url: str, *, sqlite_synchronous: str | None = None) -> Database:
    """Open (creating if needed) the database at ``url`` and bring its schema up to date.

    ``sqlite:///path/to/state.db`` (the parent directory is created) or ``postgresql+psycopg://user@host/db``
    (``postgresql://`` and ``postgres://`` are accepted and mean psycopg 3). Raises :class:`StoreError` with code
    ``unsupported_url``, ``unreachable``, ``read_only``, ``disk_full``, ``locked``, ``not_a_database``,
    ``corrupt``, ``schema_too_new`` or ``store_failed`` (cause kept; ``dberrors.py`` names each fault).

    ``sqlite_synchronous`` (default: the ``SMTHRS_SQLITE_SYNCHRONOUS`` setting, else ``"full"``) is the SQLite
    ``PRAGMA synchronous`` of every connection to a SQLite file (ignored for PostgreSQL, whose durability is the
    server's ``synchronous_commit``):

    - ``"full"`` (default): every commit fsyncs the WAL. A committed transition survives a process crash, an OS
      crash and a power loss.
    - ``"normal"``: the WAL is fsynced only at checkpoints, saving one fsync (~1-3 ms) per commit. With WAL this
      still survives a PROCESS crash (committed frames are in the OS page cache) and never corrupts the
      database, but an OS crash or power loss can roll back the LAST commits. A node whose settlement was lost
      that way is re-executed on recovery: harmless for a hermetic step, a second execution for an
      irreversible one. That is why ``full`` stays the default; choose ``normal`` only where that is acceptable.

    A malformed value is :class:`SettingsError` (``invalid_setting``) before anything is opened; opening one
    database file in one process with two different modes is :class:`StoreError` (``invalid_argument``).
    """
    synchronous = sqlite_synchronous_setting(sqlite_synchronous)
    normalized, dialect = normalize_url(url)
    db = Database(normalized, dialect, sqlite_synchronous=synchronous)
    h = db._handle()  # connect + migrate now, so a bad URL fails here and not at the first write
    opened = h.db_for_errors.sqlite_synchronous
    if dialect == "sqlite" and opened != synchronous:
        # Engines (and the per-thread state that makes nested writes savepoints) are shared per URL and process;
        # silently keeping the first mode would give this caller weaker durability than it asked for.
        raise StoreError(
            "invalid_argument",
            f"{db!r} is already open in this process with sqlite_synchronous={opened!r}, not {synchronous!r}; use "
            "one mode per database file per process (SMTHRS_SQLITE_SYNCHRONOUS), or close() the other handle first",
        )
    return db


class Database:
    """A handle on one database. Cheap to create and to pickle; engines live in a per-process registry."""

    def __init__(self, url: str, dialect: Dialect, *, sqlite_synchronous: SqliteSynchronous = "full") -> None:
        self.url = url
        self.dialect: Dialect = dialect
        #: ``PRAGMA synchronous`` of this process's SQLite connections (see :func:`open_database`).
        self.sqlite_synchronous: SqliteSynchronous = sqlite_synchronous
        self._source_id: str | None = None
        self._h: _Handle | None = None  # this process's handle, cached (revalidated: pid, disposal)

    # -- pickling: the URL and the durability mode travel, engines never do ---------------------------------
    def __reduce__(self) -> tuple[Callable[..., Database], tuple[str, SqliteSynchronous]]:
        return (_reopen, (self.url, self.sqlite_synchronous))

    def __repr__(self) -> str:
        return f"Database({make_url(self.url).render_as_string(hide_password=True)!r})"

    # -- transactions --------------------------------------------------------------------------------------
    def write(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` in a serializable write transaction and commit; return its result.

        Inside an open write on this thread, ``fn`` runs in a SAVEPOINT of that transaction instead (its
        effects commit with the outer one). Typed errors raised by ``fn`` roll back and propagate unchanged;
        driver errors become :class:`StoreError` (cause kept) after bounded retries of serialization failures.
        """
        h = self._handle()
        tx = h.tx()
        if tx.conn is not None:
            return _nested(tx, fn)
        result, callbacks = self._retrying(lambda: _outermost(h, tx, fn))
        _run_callbacks(callbacks)
        return result

    def write_batched(self, fn: Callable[[Connection], T]) -> T:
        """Like :meth:`write`, but concurrent callers of this process may share one commit (group commit,
        ``_group_commit.py``): each returns after the commit holding its write is durable, with the result or
        error a lone :meth:`write` would have given it. For hot, small, independent transactions (settlements).
        """
        h = self._handle()
        tx = h.tx()
        if tx.conn is not None:
            return _nested(tx, fn)
        return h.group.write(fn)

    def _write_group(self, h: _Handle, fns: list[Callable[[Connection], Any]]) -> list[Any]:
        tx = h.tx()  # the leader's thread
        results, callbacks = self._retrying(lambda: _outermost(h, tx, lambda conn: [fn(conn) for fn in fns]))
        _run_callbacks(callbacks)
        return results

    def write_statement(self, stmt: DriverStatement, params: Mapping[str, Any]) -> Any | None:
        """Run ONE statement as a whole serializable write transaction; return its first row (or None).

        PostgreSQL: the statement is sent alone, outside any BEGIN (write connections default to SERIALIZABLE,
        see ``_postgres_engines``), so it is its own transaction and commits when it completes: one round trip
        instead of three (BEGIN, statement, COMMIT), the same isolation, atomicity and durability, and the same
        whole-transaction retry on 40001/40P01. SQLite: a ``BEGIN IMMEDIATE`` transaction like any write (the
        round trips cost nothing there). Inside an open write on this thread it joins it like :meth:`write`.
        Use it only where the statement alone is the whole transaction (data-modifying CTEs included); outside
        an open write it has committed when this returns, so post-commit work is the caller's to do then.
        """
        h = self._handle()
        tx = h.tx()
        if tx.conn is not None or self.dialect != "postgresql":
            return self.write(lambda c: stmt.first(c, params))
        return self._retrying(lambda: _statement_alone(h, stmt, params))

    def read_statement(self, stmt: DriverStatement, params: Mapping[str, Any]) -> Any | None:
        """Run ONE read statement as a whole read transaction; return its first row (or None).

        SQLite: sent alone on a reader connection kept between calls (one statement is one snapshot), not through
        a pool checkout and BEGIN/COMMIT around SQLAlchemy's execution: the local cache tier's lookup on every hit
        cost ~108 µs that way against ~6 µs. PostgreSQL: a :meth:`read` transaction. Inside an open write on this
        thread it joins it like :meth:`read`."""
        h = self._handle()
        tx = h.tx()
        if tx.conn is not None:
            return stmt.first(tx.conn, params)
        if self.dialect != "sqlite":
            return self.read(lambda c: stmt.first(c, params))
        conn = h.take_reader()
        kept = False
        try:
            row = stmt.first(conn, params)
            # The statement ran to completion, so SQLite ended its implicit read transaction: a reader kept
            # inside one would pin an old snapshot and serve stale rows to the next caller.
            kept = not conn.connection.driver_connection.in_transaction  # type: ignore[union-attr]
            return row
        except (sa_exc.SQLAlchemyError, sqlite3.Error) as exc:
            raise store_error(self, exc, "read") from exc
        finally:
            h.give_back_reader(conn, kept)

    def _retrying(self, attempt_once: Callable[[], T]) -> T:
        attempt = 0
        patience = time.monotonic() + SERIALIZATION_PATIENCE_S
        while True:
            attempt += 1
            try:
                return attempt_once()
            except SmthrsError:
                raise
            except sa_exc.DBAPIError as exc:
                if sqlstate(exc) in RETRY_SQLSTATES and (
                    attempt < MAX_WRITE_ATTEMPTS or time.monotonic() < patience
                ):
                    # Jittered exponential backoff: concurrent writers of one hot row (the revision counter)
                    # must not retry in lockstep.
                    time.sleep(_JITTER.uniform(0, min(0.1, 0.001 * 2 ** min(attempt, 10))))
                    continue
                raise store_error(self, exc, "write", attempts=attempt) from exc
            except (sa_exc.SQLAlchemyError, sqlite3.Error) as exc:
                # sqlite3.Error: raised unwrapped by code that sends statements on the driver connection itself
                # (DriverStatement and the transaction boundaries wrap theirs), e.g. "database is locked".
                raise store_error(self, exc, "write", attempts=attempt) from exc

    def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` in a read transaction (one coherent snapshot). Inside an open write on this thread it
        joins that transaction and sees its uncommitted writes; publish what it reads only after commit."""
        h = self._handle()
        tx = h.tx()
        if tx.conn is not None:
            return fn(tx.conn)
        try:
            with connect(self, h.read_engine) as conn, conn.begin():
                return fn(conn)
        except SmthrsError:
            raise
        except (sa_exc.SQLAlchemyError, sqlite3.Error) as exc:
            raise store_error(self, exc, "read") from exc

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` after the outermost write transaction open on this thread commits.

        Dropped if that transaction (or the savepoint it was registered in) rolls back. A callback that raises
        is logged with its traceback and does not stop the others: the commit already happened and cannot be
        undone by a notification failure."""
        tx = self._handle().tx()
        if tx.conn is None:
            raise StoreError(
                "invalid_argument",
                "on_commit() needs an open write transaction: call it from inside a Database.write callback",
            )
        tx.callbacks[-1].append(callback)

    def in_write(self) -> bool:
        """Whether this thread has a write transaction open on this database."""
        return self._handle().tx().conn is not None

    # -- deferred writes (group commits) -------------------------------------------------------------------
    def allow_deferred(self) -> None:
        """Let the stores defer their writes in the write transaction open on this thread (at its outermost level):
        for a runner of many small writes in one transaction (the scheduler's group commits), whose stores then
        write their rows with one statement per table instead of one per row (see :meth:`deferred`)."""
        tx = self._handle().tx()
        if tx.conn is None or len(tx.callbacks) != 1:
            raise StoreError(
                "invalid_argument", "allow_deferred() needs the outermost level of an open Database.write"
            )
        if tx.deferred is None:
            tx.deferred = {}

    def deferred(self, key: Any, make: Callable[[], Any]) -> Any | None:
        """The deferred-write buffer ``key`` of the write transaction open on this thread — made by ``make()`` on
        first use — or None when that transaction allows none (:meth:`allow_deferred`) or a savepoint is open.

        A buffer has ``flush(conn)``, which writes what it holds; it is called in this transaction, at its
        outermost level, before any savepoint opens and before the commit (and by :meth:`flush_deferred`), so a
        buffered write commits or rolls back with the transaction as if it had run at once. The owner of a table
        flushes before its other statements on it (:meth:`flush_deferred`), so reads and order are unchanged."""
        tx = self._handle().tx()
        buffers = tx.deferred
        if buffers is None or len(tx.callbacks) != 1:
            return None
        buffer = buffers.get(key)
        if buffer is None:
            buffer = buffers[key] = make()
        return buffer

    def flush_deferred(self) -> None:
        """Write the deferred writes of the transaction open on this thread now (nothing outside one)."""
        tx = self._handle().tx()
        if tx.deferred:
            _flush_deferred(tx)

    # -- per-database identity and revision ----------------------------------------------------------------
    @property
    def source_id(self) -> str:
        """The random durable identity minted when this database was created (kept by backups)."""
        if self._source_id is None:
            self._source_id = self.read(
                lambda c: c.execute(
                    sa.select(schema.meta.c.source_id).where(schema.meta.c.id == 1)
                ).scalar_one()
            )
        return self._source_id

    def next_revision(self, conn: Connection) -> int:
        """Bump the global revision in ``conn``'s (write) transaction and return the new value."""
        row = _BUMP_REVISION.first(conn)
        assert row is not None  # the meta row exists from the first migration on
        return int(row[0])

    def revision(self) -> int:
        """The current global revision (committed, or this thread's open write)."""
        m = schema.meta
        return int(self.read(lambda c: c.execute(sa.select(m.c.revision).where(m.c.id == 1)).scalar_one()))

    def insert_ignore(self, table: sa.Table) -> Any:
        """``INSERT ... ON CONFLICT DO NOTHING`` for this dialect (first writer wins)."""
        if self.dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            return sqlite_insert(table).on_conflict_do_nothing()
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(table).on_conflict_do_nothing()

    @property
    def sqlite_path(self) -> Path | None:
        """The database file of a SQLite database, else None."""
        if self.dialect != "sqlite":
            return None
        return Path(make_url(self.url).database or "")

    def close(self) -> None:
        """Dispose this process's engines for this URL; a later call on any handle reopens them lazily."""
        _Registry.dispose(self.url)

    def _handle(self) -> _Handle:
        h = self._h
        if h is None or h.pid != _PID or h.disposed:
            h = self._h = _Registry.get(self)
        return h


def _reopen(url: str, sqlite_synchronous: SqliteSynchronous) -> Database:
    # Unpickling cannot take keyword arguments; the receiving process keeps the sender's durability mode.
    return open_database(url, sqlite_synchronous=sqlite_synchronous)


# ---------------------------------------------------------------------------------------------------------
# Transactions


# The most executed statement of the store (every run-row mutation that does not fold the bump into its own).
_BUMP_REVISION = DriverStatement(
    sa.update(schema.meta)
    .where(schema.meta.c.id == 1)
    .values(revision=schema.meta.c.revision + 1)
    .returning(schema.meta.c.revision)
)


@dataclass
class _Tx:
    """Per-thread state of the open write transaction on one database."""

    conn: Connection | None = None
    callbacks: list[list[Callable[[], None]]] = field(default_factory=list)
    #: Deferred-write buffers of the transaction by key (None: none allowed): :meth:`Database.deferred`.
    deferred: dict[Any, Any] | None = None


def _flush_deferred(tx: _Tx) -> None:
    buffers = tx.deferred
    if buffers:
        for buffer in list(buffers.values()):
            buffer.flush(tx.conn)


def _outermost(h: _Handle, tx: _Tx, fn: Callable[[Connection], T]) -> tuple[T, list[Callable[[], None]]]:
    # The transaction is opened and ended on the driver connection itself, not through SQLAlchemy's
    # Transaction objects (two thirds of the Python cost of a small write transaction). SQLAlchemy joins it
    # lazily: a Core statement in ``fn`` autobegins its Transaction on top (the begin listener sees the open
    # SQLite transaction and sends nothing; psycopg's autobegin sends nothing either), and then SQLAlchemy
    # commits or rolls back, so its view and the driver's never disagree.
    conn = h.take_writer()
    reusable = False
    try:
        driver: Any = conn.connection.driver_connection
        tx.conn, tx.callbacks = conn, [[]]
        if h.begin_sql is not None:
            _on_driver(conn, h.begin_sql, driver.execute, h.begin_sql)
        try:
            result = fn(conn)
            # On PostgreSQL the deferred writes and the COMMIT go in ONE round trip (psycopg's pipeline mode: the
            # statements are sent without waiting, the COMMIT's sync reads every result): an error of any of them
            # is raised here, from the commit, and rolls the whole transaction back as before.
            with pipeline(driver) if tx.deferred and h.pipelines else nullcontext():
                if tx.deferred:
                    _flush_deferred(tx)
                if conn.in_transaction():
                    conn.commit()
                else:
                    # PostgreSQL may fail a SERIALIZABLE transaction at COMMIT: wrapped, it reaches the retry.
                    _on_driver(conn, "COMMIT", driver.commit)
        except BaseException:
            _rollback(conn)
            raise
        reusable = True
        return result, tx.callbacks[0]
    finally:
        tx.conn, tx.callbacks, tx.deferred = None, [], None
        h.give_back(conn, reusable)


def _statement_alone(h: _Handle, stmt: DriverStatement, params: Mapping[str, Any]) -> Any | None:
    conn = h.take_writer()
    reusable = False
    try:
        driver: Any = conn.connection.driver_connection
        driver.autocommit = True  # the connection is idle: writers are given back only outside transactions
        try:
            row = stmt.first(conn, params)
        finally:
            if not conn.invalidated:
                driver.autocommit = False
        reusable = True
        return row
    finally:
        h.give_back(conn, reusable)


def _on_driver(conn: Connection, what: str, call: Callable[..., Any], *args: Any) -> None:
    try:
        call(*args)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise driver_error(conn, what, (), exc) from exc


def _rollback(conn: Connection) -> None:
    try:
        if conn.in_transaction():
            conn.rollback()
        elif not conn.invalidated:
            conn.connection.driver_connection.rollback()  # type: ignore[union-attr]
    except Exception:
        # The original error is what matters (a 40001 must reach the retry loop); a connection that cannot roll
        # back is not trusted again.
        log.warning("rolling back a write transaction failed; discarding its connection", exc_info=True)
        conn.invalidate()


def _nested(tx: _Tx, fn: Callable[[Connection], T]) -> T:
    assert tx.conn is not None
    if tx.deferred:
        _flush_deferred(
            tx
        )  # deferred writes belong to the enclosing level: written before the savepoint opens
    tx.callbacks.append([])
    sp = tx.conn.begin_nested()
    try:
        result = fn(tx.conn)
    except BaseException:
        tx.callbacks.pop()
        if sp.is_active:
            try:
                sp.rollback()
            except Exception:
                # The original error matters (a 40001 must reach the outermost retry loop); the outer
                # transaction is doomed anyway and rolls back as a whole.
                log.warning(
                    "rolling back a savepoint failed; the outer transaction will roll back", exc_info=True
                )
        raise
    sp.commit()
    done = tx.callbacks.pop()
    tx.callbacks[-1].extend(done)
    return result


def _run_callbacks(callbacks: list[Callable[[], None]]) -> None:
    for cb in callbacks:
        try:
            cb()
        except Exception:
            log.exception("post-commit callback %r failed (the transaction is committed)", cb)


# ---------------------------------------------------------------------------------------------------------
# URLs and engines


def normalize_url(url: str) -> tuple[str, Dialect]:
    """``(canonical URL, dialect)`` of a database URL, or ``StoreError(unsupported_url)``; touches nothing."""
    if not isinstance(url, str) or not url.strip():
        raise StoreError(
            "unsupported_url", f"database URL {url!r} is empty; use sqlite:///PATH or postgresql://..."
        )
    try:
        u = make_url(url)
    except sa_exc.ArgumentError as exc:
        raise StoreError(
            "unsupported_url",
            f"{url!r} is not a database URL; use sqlite:///path/to/state.db or postgresql+psycopg://user@host/db",
            cause=exc,
        ) from exc
    driver = u.drivername
    if driver in ("sqlite", "sqlite+pysqlite"):
        if not u.database or u.database == ":memory:" or u.database.startswith("file:"):
            raise StoreError(
                "unsupported_url",
                f"{url!r}: an in-memory SQLite database cannot be shared between connections or processes; "
                "use sqlite:///path/to/state.db",
            )
        path = Path(u.database).expanduser().resolve()
        return f"sqlite:///{path.as_posix()}", "sqlite"
    if driver in ("postgresql", "postgres", "postgresql+psycopg"):
        return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False), "postgresql"
    raise StoreError(
        "unsupported_url",
        f"unsupported database URL scheme {driver!r}; smthrs supports sqlite:///PATH and "
        "postgresql+psycopg://user@host/db (psycopg 3)",
    )


@dataclass
class _Handle:
    """This process's engines for one URL, plus the per-thread transaction state shared by every handle."""

    db_for_errors: Database
    write_engine: Engine
    read_engine: Engine
    #: What opens a write transaction on the driver (SQLite); None where the driver opens it itself (psycopg
    #: sends BEGIN at the first statement, at the isolation level SQLAlchemy set on the connection).
    begin_sql: str | None = None
    #: How long an idle writer may wait in ``idle`` and still be reused without the pool's checkout (None:
    #: forever). PostgreSQL: the pool pings a connection idle longer than this at checkout, so one is not kept.
    reuse_within_s: float | None = None
    #: Whether a transaction's deferred writes and its COMMIT go in one round trip (psycopg's pipeline mode).
    pipelines: bool = False
    local: threading.local = field(default_factory=threading.local)
    #: Write connections between two transactions, most recently used last (see take_writer).
    idle: deque[tuple[Connection, float]] = field(default_factory=deque)
    #: SQLite reader connections between two :meth:`Database.read_statement` calls (see take_reader).
    readers: deque[Connection] = field(default_factory=deque)
    pid: int = field(default_factory=os.getpid)
    disposed: bool = False
    #: The group commit queue of :meth:`Database.write_batched` (one per handle: per process and URL).
    group: GroupCommit = field(init=False)

    def __post_init__(self) -> None:
        db = self.db_for_errors
        self.group = GroupCommit(lambda fns: db._write_group(self, fns), db.write)

    def tx(self) -> _Tx:
        tx = getattr(self.local, "tx", None)
        if tx is None:
            tx = self.local.tx = _Tx()
        return tx

    def take_writer(self) -> Connection:
        """A write connection, idle (no transaction open on it).

        Why not always the pool: a checkout and checkin through SQLAlchemy's pool (with the Connection object
        around it) costs more Python time than SQLite needs for a small write transaction. A writer that ended
        its transaction cleanly is kept checked out in ``idle`` instead, up to the pool size, and handed to the
        next write of any thread (one at a time: deque operations are atomic). Anything unusual closes it
        back into the pool, whose checkout then does its usual work (reset, PostgreSQL liveness ping). A
        PostgreSQL writer idle longer than ``reuse_within_s`` is pinged first, as the pool would (a server
        restart must cost a reconnect, not a failed transition); one that fails the ping is discarded."""
        idle = self.idle
        while idle:
            try:
                conn, since = idle.pop()
            except IndexError:
                break
            if self.reuse_within_s is None or time.monotonic() - since < self.reuse_within_s:
                return conn
            try:
                _ping(conn.connection.dbapi_connection)
            except Exception:
                conn.invalidate()
                conn.close()
                continue
            return conn
        return connect(self.db_for_errors, self.write_engine)

    def give_back(self, conn: Connection, reusable: bool) -> None:
        """Keep ``conn`` for the next writer when it is clean, else close it back into the pool."""
        if (
            reusable
            and not self.disposed
            and not conn.invalidated
            and not conn.in_transaction()
            and len(self.idle) < _IDLE_WRITERS
            # A callback that changed this Connection's options must not leak them into the next transaction.
            and conn.get_execution_options() is self.write_engine.get_execution_options()
        ):
            self.idle.append((conn, time.monotonic()))
            return
        conn.close()

    def take_reader(self) -> Connection:
        """An idle SQLite reader (no transaction open on it): one kept by :meth:`give_back_reader`, else the pool's."""
        try:
            return self.readers.pop()
        except IndexError:
            return connect(self.db_for_errors, self.read_engine)

    def give_back_reader(self, conn: Connection, reusable: bool) -> None:
        """Keep ``conn`` for the next single-statement read when it is clean, else close it back into the pool."""
        if reusable and not self.disposed and not conn.invalidated and len(self.readers) < _IDLE_READERS:
            self.readers.append(conn)
            return
        conn.close()

    def dispose(self) -> None:
        self.disposed = True
        while self.readers:
            try:
                self.readers.pop().close()
            except IndexError:
                break
        while self.idle:
            try:
                conn, _ = self.idle.pop()
            except IndexError:
                break
            conn.close()
        self.write_engine.dispose()
        self.read_engine.dispose()


class _Registry:
    """(pid, url) → engines. A forked child never reuses its parent's pooled connections."""

    _lock = threading.RLock()
    _handles: dict[tuple[int, str], _Handle] = {}

    @classmethod
    def get(cls, db: Database) -> _Handle:
        k = (_PID, db.url)
        h = cls._handles.get(k)
        if h is not None:
            return h
        with cls._lock:
            h = cls._handles.get(k)
            if h is None:
                h = _create_handle(db)
                cls._handles[k] = h
            return h

    @classmethod
    def dispose(cls, url: str) -> None:
        with cls._lock:
            h = cls._handles.pop((_PID, url), None)
        if h is not None:
            h.dispose()


def _create_handle(db: Database) -> _Handle:
    if db.dialect == "sqlite":
        write, read = _sqlite_engines(db)
    else:
        write, read = _postgres_engines(db)
    if db.dialect == "sqlite":
        h = _Handle(db, write, read, begin_sql=_SQLITE_WRITE_BEGIN)
    else:
        h = _Handle(db, write, read, reuse_within_s=_PG_IDLE_PING_S, pipelines=pipelines_supported())
    try:
        from .migrate import ensure_schema

        ensure_schema(db, write)
    except BaseException:
        h.dispose()
        raise
    return h


def _sqlite_engines(db: Database) -> tuple[Engine, Engine]:
    path = db.sqlite_path
    assert path is not None
    _check_sqlite_path(db, path)

    def make(mode: Literal["write", "read"]) -> Engine:
        eng = sa.create_engine(
            db.url,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
            pool_size=8,
            max_overflow=16,
        )

        @event.listens_for(eng, "connect")
        def _onconnect(dbapi_conn: Any, _record: Any) -> None:
            # We issue BEGIN ourselves (below); pysqlite's implicit transaction handling must stay out of it.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            try:
                cur.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
                cur.execute("PRAGMA foreign_keys = ON")
                if mode == "write":
                    _enable_wal(cur, db)
                # Per connection, so readers too (a checkpoint may run on any connection). The value is one of
                # two validated literals, never user text.
                cur.execute(f"PRAGMA synchronous = {db.sqlite_synchronous.upper()}")
            finally:
                cur.close()

        begin_sql = _SQLITE_WRITE_BEGIN if mode == "write" else "BEGIN"

        @event.listens_for(eng, "begin")
        def _on_begin(conn: Connection) -> None:
            # IMMEDIATE takes the write lock up front: a deferred transaction that reads then writes can fail
            # with SQLITE_BUSY at the upgrade, which no busy timeout can fix.
            # Issued on the driver connection itself (what conn.exec_driver_sql would send, minus a full
            # statement execution round through SQLAlchemy). A transaction already open on the driver is one
            # Database.write opened itself (see _outermost): SQLAlchemy is joining it.
            driver = conn.connection.driver_connection
            if not driver.in_transaction:  # type: ignore[union-attr]
                driver.execute(begin_sql)  # type: ignore[union-attr]

        return eng

    return make("write"), make("read")


_SQLITE_WRITE_BEGIN = "BEGIN IMMEDIATE"


def _enable_wal(cur: Any, db: Database) -> None:
    # Switching a brand-new file to WAL needs an exclusive lock and SQLite does not run the busy handler for
    # it: two processes creating the database at once would see "database is locked". Retry until the busy
    # timeout, and refuse (never fall back to rollback journaling) where WAL is unavailable.
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    while True:
        try:
            mode = str(cur.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
            break
        except sqlite3.OperationalError as exc:
            text = str(exc).lower()
            if ("locked" not in text and "busy" not in text) or time.monotonic() > deadline:
                raise
            time.sleep(_JITTER.uniform(0.001, 0.01))
    if mode != "wal":
        raise sqlite3.OperationalError(
            f"{db.sqlite_path}: SQLite refused WAL journaling (journal_mode={mode}); put the database on a local "
            "filesystem that supports WAL"
        )


def _check_sqlite_path(db: Database, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # Named by what happened (stores/dberrors.py): a full disk and a read-only volume are passing faults.
        code, fix = "unreachable", "check the path (SMTHRS_DB_URL / --db), or point SMTHRS_DB_URL elsewhere"
        if exc.errno == errno.ENOSPC:
            code, fix = "disk_full", "the disk is full: free space on that volume, then run the command again"
        elif isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
            code, fix = "read_only", "give this process write access there, or point SMTHRS_DB_URL elsewhere"
        raise StoreError(
            code,
            f"cannot create the directory {path.parent} for the SQLite database ({exc.strerror}); {fix}",
            cause=exc,
        ) from exc
    if path.is_dir():
        raise StoreError(
            "not_a_database",
            f"{path} is a directory, not a SQLite database; point SMTHRS_DB_URL (or --db) at the state database "
            "file (default <workspace>/.smthrs/state.db)",
        )
    # WAL needs to create -wal/-shm files beside the database, so the directory must be writable too.
    if path.exists() and not os.access(path, os.W_OK):
        raise StoreError(
            "read_only",
            f"the SQLite database {path} is read-only; give this process write access or use another SMTHRS_DB_URL",
        )
    if not os.access(path.parent, os.W_OK):
        raise StoreError(
            "read_only",
            f"the directory {path.parent} of the SQLite database is read-only (WAL needs to create files beside "
            "the database); give this process write access or use another SMTHRS_DB_URL",
        )


def _postgres_engines(db: Database) -> tuple[Engine, Engine]:
    common: dict[str, Any] = {
        "connect_args": {"connect_timeout": _PG_CONNECT_TIMEOUT_S},
        "pool_size": 8,
        "max_overflow": 16,
    }
    write = sa.create_engine(db.url, isolation_level="SERIALIZABLE", **common)
    # Read-only snapshots: REPEATABLE READ is one coherent snapshot and never fails with 40001.
    read = sa.create_engine(db.url, isolation_level="REPEATABLE READ", **common)

    @event.listens_for(write, "connect")
    def _serializable_by_default(dbapi_conn: Any, _record: Any) -> None:
        # psycopg opens explicit transactions at SERIALIZABLE (the isolation_level above); this makes a
        # statement sent outside one (Database.write_statement) its own transaction at the same level.
        with dbapi_conn.cursor() as cur:
            cur.execute("SET default_transaction_isolation TO 'serializable'")
        dbapi_conn.commit()

    for eng in (write, read):
        _ping_when_idle(eng)
    return write, read


def _ping_when_idle(engine: Engine) -> None:
    # pool_pre_ping costs a round trip on EVERY checkout (a third of a fenced heartbeat). A connection that was
    # used moments ago is alive; only one idle for a while (server restart, idle timeouts) is pinged, and a
    # failed ping makes the pool replace it before any statement of the transaction is sent.
    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_conn: Any, record: Any) -> None:
        record.info["smthrs_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("smthrs_idle_since")
        if since is None or time.monotonic() - since < _PG_IDLE_PING_S:
            return
        try:
            _ping(dbapi_conn)
        except Exception as exc:
            raise sa_exc.DisconnectionError(f"idle connection failed its ping: {exc}") from exc


def _ping(dbapi_conn: Any) -> None:
    with dbapi_conn.cursor() as cur:
        cur.execute("SELECT 1")
    dbapi_conn.rollback()
