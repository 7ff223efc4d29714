"""Mapping of driver failures to typed store errors, shared by the database and the migrator.

Invariant: a driver exception never escapes the store raw; it becomes a :class:`StoreError` whose code says what
the user can do (``read_only``, ``unreachable``, ``store_failed``) and whose ``cause`` is the original exception.
"""

from __future__ import annotations

from typing import Protocol

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, make_url

from ..errors import StoreError

__all__ = ["connect", "sqlstate", "store_error", "RETRY_SQLSTATES", "NamedDatabase"]


class NamedDatabase(Protocol):
    """What an error message needs of a database: its URL and dialect. A protocol, not ``Database``, so this
    module sits below ``_database.py`` instead of closing an import circle with it."""

    @property
    def url(self) -> str: ...

    @property
    def dialect(self) -> str: ...


#: PostgreSQL serialization failure and deadlock: the whole transaction may be retried.
RETRY_SQLSTATES = frozenset({"40001", "40P01"})


def connect(db: NamedDatabase, engine: Engine) -> Connection:
    try:
        return engine.connect()
    except sa_exc.SQLAlchemyError as exc:
        raise store_error(db, exc, "connect", connecting=True) from exc


def sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def store_error(
    db: NamedDatabase, exc: BaseException, op: str, *, connecting: bool = False, attempts: int | None = None
) -> StoreError:
    shown = make_url(db.url).render_as_string(hide_password=True)
    text = str(getattr(exc, "orig", exc) or exc).lower()
    if "readonly" in text or "read-only" in text or "read only" in text:
        return StoreError(
            "read_only",
            f"the database {shown} is read-only ({exc}); give this process write access to the file and its "
            "directory, or point SMTHRS_DB_URL at a writable database",
            cause=exc,
        )
    if "database is locked" in text or "database is busy" in text:
        return StoreError(
            "store_failed",
            f"{op} on {shown} waited too long for SQLite's write lock ({exc}); another process holds it: retry, "
            "or find the process stuck inside a transaction",
            cause=exc,
        )
    if connecting or getattr(exc, "connection_invalidated", False):
        return StoreError(
            "unreachable",
            f"cannot reach the database {shown} ({exc}); check that the server is running and the URL is right",
            cause=exc,
        )
    if sqlstate(exc) in RETRY_SQLSTATES:
        return StoreError(
            "store_failed",
            f"{op} on {shown} kept failing with serialization conflicts after {attempts} attempts; the database is "
            "heavily contended: retry later or reduce concurrent writers",
            cause=exc,
        )
    return StoreError("store_failed", f"{op} on {shown} failed: {exc}", cause=exc)
