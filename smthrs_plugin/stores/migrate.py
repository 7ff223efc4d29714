"""Apply the alembic migrations in ``stores/migrations/`` when a database is opened.

Invariants:

- Two processes opening a brand-new database at once both succeed and the migrations run exactly once: the
  check-and-upgrade runs in ONE transaction that first takes an exclusive lock (SQLite: ``BEGIN IMMEDIATE``, the
  file's write lock; PostgreSQL: ``pg_advisory_xact_lock`` in a READ COMMITTED transaction, so the version read
  after the lock sees the winner's commit). DDL is transactional on both, so a crash mid-migration leaves the
  previous schema.
- A database whose recorded revision this code does not know is NEWER than the code: it is refused with
  ``schema_too_new`` before anything is written (an old binary must never write into a newer schema).
- The common case (already at head) costs one small query and never imports alembic: the known revisions are
  read from the version files' ``revision``/``down_revision`` lines (a test pins this against alembic's own
  ScriptDirectory).
"""

from __future__ import annotations

import re
import sqlite3
from functools import lru_cache
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from ..errors import SmthrsError, StoreError
from .dberrors import NamedDatabase, connect, store_error

__all__ = ["ensure_schema", "MIGRATIONS_DIR", "VERSION_TABLE", "known_revisions", "script_heads"]

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
#: Our own version table, so a database shared with another alembic user (e.g. Prefect's) never collides.
VERSION_TABLE = "smthrs_alembic_version"
#: pg_advisory_xact_lock key for migrations: int64 of the ASCII of "smthrsMG".
_PG_MIGRATION_LOCK = 0x736D746872734D47

_REV_RE = re.compile(r"^revision(?:\s*:\s*[\w\[\], |]+)?\s*=\s*['\"]([^'\"]+)['\"]", re.M)
_DOWN_RE = re.compile(r"^down_revision(?:\s*:\s*[^=]+)?\s*=\s*(.+)$", re.M)
_QUOTED_RE = re.compile(r"['\"]([^'\"]+)['\"]")


@lru_cache(maxsize=1)
def _scan() -> tuple[frozenset[str], frozenset[str]]:
    revisions: set[str] = set()
    downs: set[str] = set()
    for f in sorted((MIGRATIONS_DIR / "versions").glob("*.py")):
        if f.name.startswith("_"):
            continue
        text = f.read_text(encoding="utf-8")
        rev = _REV_RE.search(text)
        if rev is None:
            continue
        revisions.add(rev.group(1))
        down = _DOWN_RE.search(text)
        if down is not None:
            downs.update(_QUOTED_RE.findall(down.group(1)))
    return frozenset(revisions), frozenset(revisions - downs)


def known_revisions() -> frozenset[str]:
    """Every migration revision shipped with this code."""
    return _scan()[0]


def script_heads() -> frozenset[str]:
    """The head revision(s) of the shipped migrations."""
    return _scan()[1]


def ensure_schema(db: NamedDatabase, engine: Engine) -> None:
    """Bring the database at ``engine`` to the shipped head revision (see module invariants)."""
    try:
        with connect(db, engine) as conn:
            if db.dialect == "postgresql":
                conn = conn.execution_options(isolation_level="READ COMMITTED")
            with conn.begin():
                if db.dialect == "postgresql":
                    conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_MIGRATION_LOCK)))
                current = _current_revisions(conn, db.dialect)
                unknown = current - known_revisions()
                if unknown:
                    raise StoreError(
                        "schema_too_new",
                        f"the database {db!r} has schema revision {sorted(unknown)}, newer than this smthrs_plugin "
                        f"knows (latest {sorted(script_heads())}); upgrade smthrs_plugin before using this "
                        "database (an older version must never write into a newer schema)",
                        found=sorted(unknown),
                        known_head=sorted(script_heads()),
                    )
                if current != script_heads():
                    _upgrade(conn)
    except SmthrsError:
        raise
    except (sa_exc.SQLAlchemyError, sqlite3.Error) as exc:
        # sqlite3.Error: raised unwrapped by the BEGIN IMMEDIATE our begin listener sends on the driver itself
        # (e.g. "database is locked" when another process holds the write lock past the busy timeout).
        raise store_error(db, exc, "migrate") from exc


def _current_revisions(conn: Connection, dialect: str) -> frozenset[str]:
    if dialect == "sqlite":
        exists = conn.exec_driver_sql(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (VERSION_TABLE,)
        ).first()
    else:
        exists = conn.execute(sa.text("SELECT to_regclass(:t)"), {"t": VERSION_TABLE}).scalar()
    if not exists:
        return frozenset()
    rows = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    return frozenset(rows)


def _upgrade(conn: Connection) -> None:
    # alembic is imported only here: most opens find the schema at head and never pay for it.
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # env.py runs on this connection; since a transaction is already open there, alembic joins it instead of
    # committing on its own, so the lock taken above covers the whole upgrade.
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, "heads")
