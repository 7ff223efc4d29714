"""Hot statements run on the driver connection of an open transaction (:class:`DriverStatement`), the mapping of a
driver error to the ``DBAPIError`` SQLAlchemy would have raised (:func:`driver_error`), and psycopg's pipeline mode
without its warnings (:func:`pipeline`): every store module that writes its table thousands of times a second uses
them, through :mod:`.database`'s transactions."""

from __future__ import annotations

import threading
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection
from sqlalchemy.engine import Dialect as SaDialect
from sqlalchemy.sql.expression import Executable

__all__ = ["DriverStatement", "driver_error", "pipeline", "pipelines_supported"]


class DriverStatement:
    """A hot Core statement, compiled once per dialect and executed on the driver connection of an open transaction.

    Why: SQLAlchemy's per-execution layer (execution context, events, result wrapping) costs tens of µs a
    statement, several times what SQLite needs for a one-row UPDATE, and the fenced run transitions, fence reads
    and journal appends run thousands of times a second. Only that layer is skipped: the SQL is what SQLAlchemy
    compiles for the engine's own dialect, it runs on the caller's connection inside the caller's transaction
    (savepoints included), psycopg still prepares it server-side after a few executions, and a driver error is
    re-raised as the ``DBAPIError`` SQLAlchemy would have raised (a lost connection is invalidated first), so
    :meth:`Database.write` retries serialization failures and maps errors exactly as for any other statement.

    Allowed statements (checked at first compile, a programming error otherwise): scalar binds of types the
    driver adapts itself (integers, text, NULL), no expanding ``IN``. Result rows are named tuples (attribute
    access like SQLAlchemy rows).
    """

    __slots__ = ("stmt", "_compiled", "_lock")

    def __init__(self, stmt: Executable) -> None:
        self.stmt = stmt
        self._compiled: dict[str, _DriverForm] = {}
        self._lock = threading.Lock()

    def first(self, conn: Connection, params: Mapping[str, Any] | None = None) -> Any | None:
        """The first result row (a named tuple), or None when the statement returned no row."""
        rows = self._run(conn, params, fetch=True)
        return rows[0] if rows else None

    def all(self, conn: Connection, params: Mapping[str, Any] | None = None) -> list[Any]:
        """Every result row (named tuples)."""
        return self._run(conn, params, fetch=True)  # type: ignore[no-any-return]

    def rowcount(self, conn: Connection, params: Mapping[str, Any] | None = None) -> int:
        """Execute a statement that returns no rows; the number of rows it matched."""
        return self._run(conn, params, fetch=False)  # type: ignore[no-any-return]

    def many(self, conn: Connection, params: Sequence[Mapping[str, Any]]) -> None:
        """Execute a statement that returns no rows once per parameter set, in one driver call (``executemany``:
        one prepared statement; psycopg pipelines the round trips)."""
        if not params:
            return
        form = self._compiled.get(conn.dialect.name) or self._form(conn.dialect)
        defaults, make = form.defaults, form.args
        args = [make({**defaults, **p}) for p in params]
        driver: Any = conn.connection.driver_connection
        try:
            if conn.dialect.name == "sqlite":
                driver.executemany(form.sql, args)
            else:
                with driver.cursor() as cur:
                    if driver.pgconn.pipeline_status or not pipelines_supported():
                        # Rides the open pipeline (its sync reports errors), or, with a libpq too old for
                        # pipeline mode, runs the rows one after another (psycopg's own fallback).
                        cur.executemany(form.sql, args)
                    else:
                        with pipeline(driver):
                            cur.executemany(form.sql, args)
        except conn.dialect.loaded_dbapi.Error as exc:
            raise driver_error(conn, form.sql, args, exc) from exc

    def _form(self, dialect: SaDialect) -> _DriverForm:
        form = self._compiled.get(dialect.name)
        if form is None:
            with self._lock:
                form = self._compiled.get(dialect.name)
                if form is None:
                    form = self._compiled[dialect.name] = _DriverForm.compile(self.stmt, dialect)
        return form

    def _run(self, conn: Connection, params: Mapping[str, Any] | None, *, fetch: bool) -> Any:
        form = self._compiled.get(conn.dialect.name) or self._form(conn.dialect)
        args = form.args({**form.defaults, **params} if params else form.defaults)
        try:
            cur = conn.connection.driver_connection.execute(form.sql, args)  # type: ignore[union-attr]
            if not fetch:
                return cur.rowcount
            rows = cur.fetchall()
            if not rows:
                return rows
            make = form.row_type
            if make is None:
                names = [d[0] for d in cur.description]
                make = form.row_type = namedtuple("DriverRow", names, rename=True)  # type: ignore[misc]
            return list(map(make._make, rows))
        except conn.dialect.loaded_dbapi.Error as exc:
            raise driver_error(conn, form.sql, args, exc) from exc


@dataclass
class _DriverForm:
    sql: str
    order: tuple[str, ...] | None  # bind names in placeholder order (positional paramstyles), else None
    defaults: dict[str, Any]  # values of the statement's literal binds (status = 'running', revision + 1)
    row_type: Any = None  # named tuple of the result columns, made at the first result
    args: Callable[[dict[str, Any]], Any] = field(init=False)  # merged parameters -> what the driver takes

    def __post_init__(self) -> None:
        if self.order is None:
            self.args = dict  # named paramstyle (psycopg): a fresh mapping the driver may keep
        elif len(self.order) > 1:
            self.args = itemgetter(*self.order)
        else:
            self.args = lambda merged: tuple(merged[k] for k in self.order or ())

    @classmethod
    def compile(cls, stmt: Executable, dialect: SaDialect) -> _DriverForm:
        compiled = stmt.compile(dialect=dialect)  # type: ignore[attr-defined]
        binds = list(compiled.binds.values())
        for b in binds:
            if b.expanding or not isinstance(b.type, (sa.Integer, sa.String, sa.types.NullType)):
                raise TypeError(
                    f"DriverStatement cannot pass bind {b.key!r} ({b.type!r}) to the driver as is"
                )
        required = {b.key for b in binds if b.required}
        defaults = {
            k: v
            for k, v in compiled.construct_params({k: None for k in required}).items()
            if k not in required
        }
        order = tuple(compiled.positiontup) if compiled.positional else None
        return cls(compiled.string, order, defaults)


def driver_error(conn: Connection, sql: str, args: Any, exc: Any) -> sa_exc.StatementError:
    """The ``DBAPIError`` SQLAlchemy would raise for the driver error ``exc`` of ``sql`` run on ``conn``'s driver
    connection (an ``OperationalError``, ``IntegrityError``, ...); a lost connection is invalidated first, so
    the pool replaces it. What ``Connection._handle_dbapi_exception`` does for a statement it ran itself."""
    dialect = conn.dialect
    lost = dialect.is_disconnect(exc, conn.connection.dbapi_connection, None)
    wrapped = sa_exc.DBAPIError.instance(
        sql, args, exc, dialect.loaded_dbapi.Error, connection_invalidated=lost, dialect=dialect
    )
    if lost:
        conn.invalidate(exc)
    return wrapped


def pipelines_supported() -> bool:
    """Whether psycopg's libpq has pipeline mode (libpq 14 and newer; the ``psycopg[binary]`` wheels bundle one).
    Without it every statement is its own round trip, as before pipelines were used: slower, never wrong."""
    from psycopg import Pipeline

    return bool(Pipeline.is_supported())


@contextmanager
def pipeline(driver: Any) -> Iterator[None]:
    """psycopg's pipeline mode on the driver connection ``driver`` for the block: statements are sent without
    waiting, and the first error among them is raised at the next sync (a fetch, a commit, or the block's end).

    An error raised inside the block reads the pipeline's remaining answers before it closes: the statements
    queued after a failed one were skipped by the server and answer "pipeline aborted", and closing the pipeline
    with them unread makes psycopg log a warning for a failure that is already being raised (and handled: a
    serialization failure is retried) — noise in the user's log for every retried conflict."""
    with driver.pipeline() as pipe:
        try:
            yield
        except BaseException as exc:
            _drain(pipe, exc)
            raise


def _drain(pipe: Any, primary: BaseException) -> None:
    from psycopg.errors import PipelineAborted

    try:
        pipe.sync()
    except PipelineAborted:
        pass  # a statement skipped after the failure: what failed first is ``primary``
    except Exception as exc:  # noqa: BLE001 - kept on the error being raised, which stays the one that counts
        primary.add_note(f"reading the rest of the pipeline then failed too: {type(exc).__name__}: {exc}")
