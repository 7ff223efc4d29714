"""The cache index's owner: every statement on ``step_cache`` and the only decoder of its row metadata.

Invariants:

- **One owner.** Every statement on ``step_cache`` is in this module; the local cache tier (``cache/local.py``)
  holds the tier's rules (which row key, first writer wins, what may be served) and calls these functions. The
  entry document itself (``entry_json``) is opaque here: the cache's entry codec decodes and verifies it, so a
  row is never judged servable on its metadata alone.
- **Caller's transaction.** Writes are ``*_in(conn, ...)`` on the caller's connection: the dispatch seam records
  a row in the SAME transaction as its attempt row and journal record. Every
  timestamp is the caller's ``now_ms``, so one clock decides a tier's times.
- **Metadata is advisory.** ``provenance_json`` and ``components_json`` that do not parse read as ``None``
  (``ls``/``explain`` then show less); they never decide what is served — the entry does.
- **Bounded reads.** Whole-index walks (``gc``, ``verify``) page by key digest (:func:`page`), never loading every
  ``entry_json`` (each may be megabytes of inline outputs) at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..stores.database import Database
from ..stores.schema import step_cache
from ..stores.statements import DriverStatement

__all__ = [
    "LocalRow",
    "ServedRow",
    "StoredRow",
    "NewRow",
    "served",
    "stored_in",
    "insert_in",
    "replace_in",
    "touch_in",
    "invalidate_in",
    "delete_in",
    "rows",
    "subjects_ending_with",
    "subjects_named",
    "entry_json",
    "page",
    "invalidated_before_in",
    "run_local_before_in",
]

_T = step_cache
# The lookup of every hit: compiled once, sent on the driver (``Database.read_statement``).
_LOOKUP = DriverStatement(
    sa.select(_T.c.entry_json, _T.c.last_used_at_ms).where(
        _T.c.key_digest == sa.bindparam("b_name", type_=sa.Text),
        _T.c.invalidated_at_ms.is_(None),
        _T.c.scope == "shared",
    )
)
_META = (
    _T.c.key_digest,
    _T.c.key,
    _T.c.subject,
    _T.c.scope,
    _T.c.run_id,
    _T.c.created_at_ms,
    _T.c.last_used_at_ms,
    _T.c.invalidated_at_ms,
    _T.c.provenance_json,
    _T.c.components_json,
)


@dataclass(frozen=True)
class LocalRow:
    """A row's metadata (``entry_json`` is read separately: it may be megabytes of inline outputs)."""

    key_digest: str
    key: str
    subject: str | None
    scope: str
    run_id: str | None
    created_at_ms: int
    last_used_at_ms: int
    invalidated_at_ms: int | None
    provenance: Mapping[str, Any] | None
    components: Mapping[str, Any] | None


@dataclass(frozen=True)
class ServedRow:
    """The valid shared-scope row of a key: its undecoded entry and when it was last used."""

    entry_json: str
    last_used_at_ms: int


@dataclass(frozen=True)
class StoredRow:
    """Whatever row holds a row key (any scope, invalidated included), as a writer judges it."""

    entry_json: str
    invalidated_at_ms: int | None


@dataclass(frozen=True)
class NewRow:
    """The columns a writer records for one entry; ``components`` and ``provenance`` are plain JSON data."""

    key: str
    entry_json: str
    components: Any
    run_id: str | None
    provenance: Any
    subject: str | None
    scope: str


def _json(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _maybe_json(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _row(r: Any) -> LocalRow:
    return LocalRow(
        key_digest=r.key_digest,
        key=r.key,
        subject=r.subject,
        scope=r.scope,
        run_id=r.run_id,
        created_at_ms=int(r.created_at_ms),
        last_used_at_ms=int(r.last_used_at_ms),
        invalidated_at_ms=None if r.invalidated_at_ms is None else int(r.invalidated_at_ms),
        provenance=_maybe_json(r.provenance_json),
        components=_maybe_json(r.components_json),
    )


def _values(row: NewRow, now_ms: int) -> dict[str, Any]:
    return {
        "key": row.key,
        "entry_json": row.entry_json,
        "components_json": _json(row.components),
        "run_id": row.run_id,
        "created_at_ms": now_ms,
        "last_used_at_ms": now_ms,
        "invalidated_at_ms": None,
        "provenance_json": _json(row.provenance),
        "subject": row.subject,
        "scope": row.scope,
    }


# -- serving ---------------------------------------------------------------------------------------------------


def served(db: Database, name: str) -> ServedRow | None:
    """The valid (not invalidated) shared-scope row named ``name``, undecoded; None when there is none."""
    row = db.read_statement(_LOOKUP, {"b_name": name})
    return None if row is None else ServedRow(row.entry_json, int(row.last_used_at_ms))


# -- writing (in the caller's transaction) -----------------------------------------------------------------------


# Every built node reads and inserts its row inside its settlement (the coordinator's commit): prepared once.
_STORED = DriverStatement(
    sa.select(_T.c.entry_json, _T.c.invalidated_at_ms).where(
        _T.c.key_digest == sa.bindparam("b_row_key", type_=sa.Text)
    )
)
_INSERT = DriverStatement(
    sa.insert(_T).values(
        key_digest=sa.bindparam("v_key_digest", type_=sa.Text),
        **{
            c: sa.bindparam(f"v_{c}", type_=_T.c[c].type)
            for c in (
                "key",
                "entry_json",
                "components_json",
                "run_id",
                "created_at_ms",
                "last_used_at_ms",
                "invalidated_at_ms",
                "provenance_json",
                "subject",
                "scope",
            )
        },
    )
)


def stored_in(conn: Connection, row_key: str) -> StoredRow | None:
    """The row at ``row_key`` whatever its scope or validity, or None."""
    existing = _STORED.first(conn, {"b_row_key": row_key})
    if existing is None:
        return None
    inv = existing.invalidated_at_ms
    return StoredRow(existing.entry_json, None if inv is None else int(inv))


def insert_in(conn: Connection, row_key: str, row: NewRow, now_ms: int) -> None:
    """Insert a new row at ``row_key`` (the caller saw none there)."""
    values = {f"v_{k}": v for k, v in _values(row, now_ms).items()}
    _INSERT.rowcount(conn, {"v_key_digest": row_key, **values})


def replace_in(conn: Connection, row_key: str, row: NewRow, now_ms: int) -> None:
    """Overwrite every column of the row at ``row_key`` (valid again, created now)."""
    conn.execute(sa.update(_T).where(_T.c.key_digest == row_key).values(**_values(row, now_ms)))


def touch_in(conn: Connection, row_key: str, now_ms: int) -> None:
    """Refresh ``last_used_at_ms`` (what ``gc`` and ``ls`` read)."""
    conn.execute(sa.update(_T).where(_T.c.key_digest == row_key).values(last_used_at_ms=now_ms))


def invalidate_in(conn: Connection, row_key: str, now_ms: int) -> bool:
    """Mark a valid row invalid; True when a valid row was invalidated (an invalidated row keeps its time)."""
    res = conn.execute(
        sa.update(_T)
        .where(_T.c.key_digest == row_key, _T.c.invalidated_at_ms.is_(None))
        .values(invalidated_at_ms=now_ms)
    )
    return bool(res.rowcount)


def delete_in(conn: Connection, row_key: str) -> bool:
    """Delete the row at ``row_key``; True when there was one."""
    return bool(conn.execute(sa.delete(_T).where(_T.c.key_digest == row_key)).rowcount)


# -- reading for ls / explain / verify / gc ------------------------------------------------------------------------


def rows(
    db: Database,
    *,
    subject: str | None = None,
    key: str | None = None,
    limit: int | None = None,
    newest_first: bool = True,
) -> list[LocalRow]:
    """Row metadata ordered by (created_at_ms, key_digest), newest first by default, optionally filtered by
    subject or dispatch key."""
    q = sa.select(*_META)
    if subject is not None:
        q = q.where(_T.c.subject == subject)
    if key is not None:
        q = q.where(_T.c.key == key)
    order = (
        (_T.c.created_at_ms.desc(), _T.c.key_digest.desc())
        if newest_first
        else (_T.c.created_at_ms, _T.c.key_digest)
    )
    q = q.order_by(*order)
    if limit is not None:
        q = q.limit(limit)
    return [_row(r) for r in db.read(lambda c: c.execute(q).all())]


def subjects_ending_with(db: Database, suffix: str) -> list[str]:
    """Distinct subjects equal to ``suffix`` or ending with ``/<suffix>`` (a node id inside a plan subject)."""
    q = (
        sa.select(_T.c.subject)
        .where(sa.or_(_T.c.subject == suffix, _T.c.subject.like("%/" + _escape_like(suffix), escape="\\")))
        .distinct()
    )
    return sorted(s for s in db.read(lambda c: c.execute(q).scalars().all()) if s is not None)


def subjects_named(db: Database, name: str) -> list[str]:
    """Distinct subjects a bare ``name`` may mean: equal to it, ending with ``/<name>`` (a node id inside a plan
    subject) or ``:<name>`` (a step's qualname after its module), or whose entries were built by node ``name``
    (``provenance.node_id``: a step's node name)."""
    escaped = _escape_like(name)
    # provenance_json is written compact with sorted keys (_json): the member reads exactly `"node_id":"<name>"`,
    # and a quote inside any JSON string is escaped, so the pattern cannot match inside another value.
    node_member = _escape_like(f'"node_id":{json.dumps(name)}')
    q = (
        sa.select(_T.c.subject)
        .where(
            sa.or_(
                _T.c.subject == name,
                _T.c.subject.like("%/" + escaped, escape="\\"),
                _T.c.subject.like("%:" + escaped, escape="\\"),
                _T.c.provenance_json.like("%" + node_member + "%", escape="\\"),
            )
        )
        .distinct()
    )
    return sorted(s for s in db.read(lambda c: c.execute(q).scalars().all()) if s is not None)


def entry_json(db: Database, row_key: str) -> str | None:
    """The undecoded entry of one row (any scope, invalidated included), or None when absent."""
    return db.read(lambda c: c.execute(sa.select(_T.c.entry_json).where(_T.c.key_digest == row_key)).scalar())


def page(db: Database, after: str, limit: int) -> list[tuple[LocalRow, str]]:
    """At most ``limit`` rows with key digest greater than ``after``, by key digest, each with its undecoded
    entry; an empty page ends a walk."""
    found = db.read(
        lambda c: c.execute(
            sa.select(*_META, _T.c.entry_json)
            .where(_T.c.key_digest > after)
            .order_by(_T.c.key_digest)
            .limit(limit)
        ).all()
    )
    return [(_row(r), r.entry_json) for r in found]


def invalidated_before_in(conn: Connection, cutoff_ms: int) -> list[str]:
    """Key digests of rows invalidated before ``cutoff_ms``."""
    q = sa.select(_T.c.key_digest).where(
        _T.c.invalidated_at_ms.is_not(None), _T.c.invalidated_at_ms < cutoff_ms
    )
    return list(conn.execute(q).scalars())


def run_local_before_in(conn: Connection, cutoff_ms: int) -> list[tuple[str, str | None]]:
    """``(key_digest, run_id)`` of the run-local rows created before ``cutoff_ms``."""
    q = sa.select(_T.c.key_digest, _T.c.run_id).where(
        _T.c.scope == "run-local", _T.c.created_at_ms < cutoff_ms
    )
    return [(r.key_digest, r.run_id) for r in conn.execute(q)]


def _escape_like(s: str) -> str:
    return s.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
