"""Mapping of driver failures to typed store errors, shared by the database and the migrator.

Invariants:

- A driver exception never escapes the store raw; it becomes a :class:`StoreError` whose code names what the fault
  IS, and whose message says what to do about it:

  ==================  =========================================  =============================================
  code                SQLite (error name, else message text)      PostgreSQL (SQLSTATE, else how it failed)
  ==================  =========================================  =============================================
  ``not_a_database``  ``SQLITE_NOTADB``: the file is not SQLite   —
  ``corrupt``         ``SQLITE_CORRUPT``: a malformed image       ``XX001``/``XX002``: data or index corrupted
  ``disk_full``       ``SQLITE_FULL``                             ``53100``
  ``locked``          ``SQLITE_BUSY``/``SQLITE_LOCKED``           ``55P03`` (lock not available)
  ``read_only``       ``SQLITE_READONLY``                         ``25006`` (a standby / read-only transaction)
  ``unreachable``     ``SQLITE_CANTOPEN``: the file cannot open   class ``08``, ``57P01-03``, ``53300``, or any
                                                                  failure to connect / a dropped connection
  ``contended``       —                                           ``40001``/``40P01`` still failing after the
                                                                  retries (``Database.write``'s budget)
  ``store_failed``    anything else
  ==================  =========================================  =============================================

  ``unreachable``, ``disk_full``, ``locked``, ``read_only`` and ``contended`` are passing faults
  (``errors.passing_fault``): a run they stop is left resumable and the CLI exits 75. Contention is the
  environment's (how many writers share the database), never a node's failure: it must not burn a run.
- **No SQL in a message.** A SQLAlchemy exception's text carries the statement and its parameters; a message quotes
  only the first line of the DRIVER's own error. The exception itself is kept on ``cause`` (and ``__cause__``: the
  callers raise ``... from exc``) for a traceback; ``StoreError.to_dict`` (what ``--json`` prints) shows only its
  first line.
"""

from __future__ import annotations

from typing import Protocol

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, make_url

from ..errors import StoreError

__all__ = ["connect", "sqlstate", "store_error", "fault_kind", "RETRY_SQLSTATES", "NamedDatabase"]


class NamedDatabase(Protocol):
    """What an error message needs of a database: its URL and dialect. A protocol, not ``Database``, so this
    module sits below ``database.py`` instead of closing an import circle with it."""

    @property
    def url(self) -> str: ...

    @property
    def dialect(self) -> str: ...


#: PostgreSQL serialization failure and deadlock: the whole transaction may be retried.
RETRY_SQLSTATES = frozenset({"40001", "40P01"})

# SQLite primary result codes by name (Python 3.11+ sets ``sqlite_errorname``; extended names such as
# SQLITE_BUSY_SNAPSHOT or SQLITE_READONLY_DBMOVED start with their primary name).
_SQLITE_NAMES = (
    ("SQLITE_NOTADB", "not_a_database"),
    ("SQLITE_CORRUPT", "corrupt"),
    ("SQLITE_FULL", "disk_full"),
    ("SQLITE_BUSY", "locked"),
    ("SQLITE_LOCKED", "locked"),
    ("SQLITE_READONLY", "read_only"),
    ("SQLITE_CANTOPEN", "unreachable"),
)
# The same faults by SQLite's message, for errors that carry no name (raised by hand, or by an older driver).
_SQLITE_TEXTS = (
    ("file is not a database", "not_a_database"),
    ("malformed", "corrupt"),
    ("disk is full", "disk_full"),
    ("no space left", "disk_full"),
    ("database is locked", "locked"),
    ("database is busy", "locked"),
    ("database table is locked", "locked"),
    ("readonly", "read_only"),
    ("read-only", "read_only"),
    ("read only", "read_only"),
    ("unable to open database file", "unreachable"),
)
_PG_STATES = {
    "53100": "disk_full",
    "55P03": "locked",
    "25006": "read_only",
    "XX001": "corrupt",
    "XX002": "corrupt",
    "57P01": "unreachable",  # admin shutdown
    "57P02": "unreachable",  # crash shutdown
    "57P03": "unreachable",  # cannot connect now (starting up, in recovery)
    "53300": "unreachable",  # too many connections
}


def connect(db: NamedDatabase, engine: Engine) -> Connection:
    try:
        return engine.connect()
    except sa_exc.SQLAlchemyError as exc:
        raise store_error(db, exc, "connect", connecting=True) from exc


def sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def _driver(exc: BaseException) -> BaseException:
    """The driver's own exception inside a SQLAlchemy wrapper (``exc`` itself when it is one)."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def _reason(exc: BaseException) -> str:
    """The first line of the driver's own message: what it said, never the statement (see the invariants)."""
    text = str(_driver(exc)).strip()
    line = text.splitlines()[0].strip() if text else type(_driver(exc)).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def fault_kind(db: NamedDatabase, exc: BaseException, *, connecting: bool = False) -> str:
    """The :class:`StoreError` code of a driver failure (the module table)."""
    orig = _driver(exc)
    if db.dialect == "sqlite":
        name = getattr(orig, "sqlite_errorname", None)
        if isinstance(name, str):
            for prefix, kind in _SQLITE_NAMES:
                if name.startswith(prefix):
                    return kind
        text = str(orig).lower()
        for needle, kind in _SQLITE_TEXTS:
            if needle in text:
                return kind
    else:
        state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if state in _PG_STATES:
            return _PG_STATES[state]
        if isinstance(state, str) and state.startswith("08"):
            return "unreachable"
        if state in RETRY_SQLSTATES:
            return "contended"
        # A server that refused or dropped the connection; a SQLite file that cannot be opened is CANTOPEN above.
        if connecting or getattr(exc, "connection_invalidated", False):
            return "unreachable"
    return "store_failed"


def store_error(
    db: NamedDatabase, exc: BaseException, op: str, *, connecting: bool = False, attempts: int | None = None
) -> StoreError:
    """The typed error of driver failure ``exc`` during ``op`` on ``db`` (see the module invariants)."""
    shown = make_url(db.url).render_as_string(hide_password=True)
    kind = fault_kind(db, exc, connecting=connecting)
    sqlite = db.dialect == "sqlite"
    where = (make_url(db.url).database or shown) if sqlite else shown
    reason = _reason(exc)
    if kind == "not_a_database":
        message = (
            f"{where} exists but is not a SQLite database ({reason}); point SMTHRS_DB_URL (or --db) at the smthrs "
            "state database, or move that file away so a fresh database is created in its place"
        )
    elif kind == "corrupt":
        message = (
            f"the SQLite database {where} is damaged ({reason}); restore it from a backup (`smthrs recover restore "
            "DIR --force`), or move it away to start a fresh one"
            if sqlite
            else f"the PostgreSQL database {where} reports corrupted data ({reason}); repair it or restore it "
            "from a backup (pg_restore, then `smthrs recover fence --db URL`)"
        )
    elif kind == "disk_full":
        message = (
            f"{op} on {where} failed: the disk holding the database is full ({reason}); free space on that "
            "volume (or move the database with SMTHRS_DB_URL), then run the same command again — the failed "
            "transaction wrote nothing"
            if sqlite
            else f"{op} on {where} failed: the PostgreSQL server is out of disk space ({reason}); free space on "
            "the server's volume, then run the same command again — the failed transaction wrote nothing"
        )
    elif kind == "locked":
        message = (
            f"{op} on {where} waited too long for SQLite's write lock ({reason}); another process holds it: "
            "run the same command again later, or find the process stuck inside a transaction"
            if sqlite
            else f"{op} on {where} could not take a lock ({reason}); another session holds it: run the same "
            "command again later, or find the session stuck inside a transaction (pg_stat_activity)"
        )
    elif kind == "read_only":
        message = (
            f"the database {where} is read-only ({reason}); give this process write access to the file and its "
            "directory (or remount the volume read-write), or point SMTHRS_DB_URL at a writable database"
            if sqlite
            else f"the PostgreSQL server of {where} accepts only reads ({reason}: a standby, or a read-only "
            "transaction default); point SMTHRS_DB_URL at the primary, or wait for the failover to finish"
        )
    elif kind == "unreachable":
        message = (
            f"cannot open the SQLite database file {where} ({reason}); check that its directory exists and this "
            "process may read and write it, or point SMTHRS_DB_URL at another path"
            if sqlite
            else f"cannot reach the PostgreSQL server of {where} ({reason}); check that the server is running and "
            "accepts connections and that the URL's host, port, database and credentials are right, then run the "
            "same command again"
        )
    elif kind == "contended":
        message = (
            f"{op} on {where} kept failing with serialization conflicts after {attempts} attempts; the database "
            "is heavily contended by concurrent writers: run the same command again later (nothing was written), "
            "or run fewer coordinators against this database at once"
        )
    else:
        message = (
            f"{op} on {where} failed ({type(_driver(exc)).__name__}: {reason}); run the same command again, and "
            "if it keeps failing, check the database (its log, its disk)"
        )
    return StoreError(kind, message, cause=exc, database=shown)
