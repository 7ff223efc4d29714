"""The local cache tier: one ``step_cache`` row per entry in the runtime database.

Invariants
- Row key: a ``shared``-scope row (admissible evidence, servable to any run using this database) is keyed by
  ``key_digest(dispatch key)``; a ``run-local`` row (evidence that failed admission, or a non-sealed tier) by
  ``key_digest(run_local_row_key(key, run_id))``, so a lookup of the dispatch key from any run never finds it.
  Run-local rows exist so their spilled blobs stay referenced (``gc``) while their run's attempt rows may replay
  them, and so ``explain`` can compare against them; the seam never serves them.
- Writes happen in the caller's transaction (``*_in(conn, ...)``): the dispatch seam records the row in the SAME
  transaction as the caller's attempt row and journal record (SEMANTICS.md §4 publication order). A shared row is
  first-writer-wins: an existing valid row is never overwritten — a different result is reported to the caller
  (:class:`DifferentResult`, the strict/nondeterministic decision is the seam's). An invalidated or undecodable
  row is replaced: it is no longer anybody's result.
- An invalidated row (``invalidated_at_ms`` set: stale read set, corrupt blob) is never served; it stays until a
  new result replaces it or ``gc`` removes it, so its blobs stay referenced meanwhile.
- Reads decode and verify (``decode_entry``): an undecodable row is reported, never served, with a warning naming
  its key digest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import key_digest
from ..stores.database import Database
from ..stores.schema import step_cache
from .entry import CacheEntry, Decoded, Undecodable, decode_entry, run_local_row_key

__all__ = [
    "LocalTier",
    "LocalRow",
    "LocalHit",
    "LocalUndecodable",
    "LocalLookup",
    "Inserted",
    "Replaced",
    "SameResult",
    "DifferentResult",
    "RecordOutcome",
    "row_key_of",
]

log = logging.getLogger(__name__)
_T = step_cache
# The lookup of every hit, built once: SQLAlchemy then reuses its memoized cache key and compiled form instead of
# re-coercing a fresh select per call.
_LOOKUP = sa.select(_T.c.entry_json, _T.c.last_used_at_ms).where(
    _T.c.key_digest == sa.bindparam("name"), _T.c.invalidated_at_ms.is_(None), _T.c.scope == "shared"
)
_PAGE = 200


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
class LocalHit:
    entry: CacheEntry
    last_used_at_ms: int


@dataclass(frozen=True)
class LocalUndecodable:
    key_digest: str
    reason: str
    corrupt: bool


LocalLookup = Union[LocalHit, LocalUndecodable, None]


@dataclass(frozen=True)
class Inserted:
    """A new row was written."""


@dataclass(frozen=True)
class Replaced:
    """An invalidated or undecodable row (or this run's previous run-local row) was replaced."""


@dataclass(frozen=True)
class SameResult:
    """A valid row with the same result already existed; it was kept (its ``last_used_at_ms`` refreshed)."""


@dataclass(frozen=True)
class DifferentResult:
    """A valid row with a DIFFERENT result already existed; it was kept (first writer wins)."""

    existing: CacheEntry


RecordOutcome = Union[Inserted, Replaced, SameResult, DifferentResult]


def row_key_of(entry: CacheEntry) -> str:
    """The primary key of ``entry``'s row (see the module invariants)."""
    if entry.scope == "shared":
        return entry.name
    return key_digest(run_local_row_key(entry.key, str(entry.provenance.get("run_id"))))


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


class LocalTier:
    """The ``step_cache`` table of one database."""

    def __init__(self, db: Database, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.db = db
        self.clock = clock

    # -- serving ---------------------------------------------------------------------------------------------

    def lookup(self, key: str) -> LocalLookup:
        """The valid shared-scope row of ``key``: decoded and verified, undecodable, or None (absent/invalidated)."""
        name = key_digest(key)
        row = self.db.read(lambda c: c.execute(_LOOKUP, {"name": name}).first())
        if row is None:
            return None
        decoded = decode_entry(row.entry_json, name=name)
        if isinstance(decoded, Undecodable):
            log.warning("local cache row %s is not served: %s", name, decoded.reason)
            return LocalUndecodable(name, decoded.reason, decoded.corrupt)
        if decoded.scope != "shared":
            log.warning("local cache row %s is not served: its entry says scope %r", name, decoded.scope)
            return LocalUndecodable(name, f"its entry has scope {decoded.scope!r}", True)
        return LocalHit(decoded, int(row.last_used_at_ms))

    # -- writing (in the caller's transaction) ---------------------------------------------------------------

    def record_in(self, conn: Connection, entry: CacheEntry) -> RecordOutcome:
        """Record ``entry`` (see the module invariants for first-writer-wins and replacement)."""
        now = self.clock.now_ms()
        rk = row_key_of(entry)
        values = {
            "key": entry.key,
            "entry_json": entry.encode().decode("utf-8"),
            "components_json": _json(entry.components),
            "run_id": entry.provenance.get("run_id"),
            "created_at_ms": now,
            "last_used_at_ms": now,
            "invalidated_at_ms": None,
            "provenance_json": _json(entry.provenance),
            "subject": entry.subject,
            "scope": entry.scope,
        }
        existing = conn.execute(
            sa.select(_T.c.entry_json, _T.c.invalidated_at_ms).where(_T.c.key_digest == rk)
        ).first()
        if existing is None:
            conn.execute(sa.insert(_T).values(key_digest=rk, **values))
            return Inserted()
        if entry.scope == "shared" and existing.invalidated_at_ms is None:
            old = decode_entry(existing.entry_json, name=rk)
            if isinstance(old, CacheEntry) and old.scope == "shared":
                if old.result == entry.result:
                    self.touch_in(conn, rk)
                    return SameResult()
                return DifferentResult(old)
            log.warning("replacing undecodable local cache row %s", rk)
        conn.execute(sa.update(_T).where(_T.c.key_digest == rk).values(**values))
        return Replaced()

    def touch_in(self, conn: Connection, row_key: str) -> None:
        """Refresh ``last_used_at_ms`` (what ``gc`` and ``ls`` read)."""
        conn.execute(
            sa.update(_T).where(_T.c.key_digest == row_key).values(last_used_at_ms=self.clock.now_ms())
        )

    def invalidate_in(self, conn: Connection, row_key: str) -> bool:
        """Mark a row invalid (never served again); True when a valid row was invalidated."""
        res = conn.execute(
            sa.update(_T)
            .where(_T.c.key_digest == row_key, _T.c.invalidated_at_ms.is_(None))
            .values(invalidated_at_ms=self.clock.now_ms())
        )
        return bool(res.rowcount)

    def delete_in(self, conn: Connection, row_key: str) -> bool:
        return bool(conn.execute(sa.delete(_T).where(_T.c.key_digest == row_key)).rowcount)

    # -- reading for ls / explain / verify / gc --------------------------------------------------------------

    def rows(
        self,
        *,
        subject: str | None = None,
        key: str | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[LocalRow]:
        """Row metadata, newest first by default, optionally filtered by subject or dispatch key."""
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
        return [_row(r) for r in self.db.read(lambda c: c.execute(q).all())]

    def subjects_ending_with(self, suffix: str) -> list[str]:
        """Distinct subjects equal to ``suffix`` or ending with ``/<suffix>`` (a node id inside a plan subject)."""
        q = (
            sa.select(_T.c.subject)
            .where(
                sa.or_(_T.c.subject == suffix, _T.c.subject.like("%/" + _escape_like(suffix), escape="\\"))
            )
            .distinct()
        )
        return sorted(s for s in self.db.read(lambda c: c.execute(q).scalars().all()) if s is not None)

    def load(self, row_key: str) -> Decoded | None:
        """The decoded entry of one row (any scope, invalidated included), or None when absent."""
        text = self.db.read(
            lambda c: c.execute(sa.select(_T.c.entry_json).where(_T.c.key_digest == row_key)).scalar()
        )
        return None if text is None else decode_entry(text, name=None)

    def iter_entries(self) -> Iterator[tuple[LocalRow, Decoded]]:
        """Every row with its decoded entry, paged by key digest (bounded memory for gc/verify)."""
        after = ""
        while True:
            page = self.db.read(
                lambda c, a=after: c.execute(  # type: ignore[misc]
                    sa.select(*_META, _T.c.entry_json)
                    .where(_T.c.key_digest > a)
                    .order_by(_T.c.key_digest)
                    .limit(_PAGE)
                ).all()
            )
            if not page:
                return
            for r in page:
                yield _row(r), decode_entry(r.entry_json, name=None)
            after = page[-1].key_digest

    def invalidate(self, row_key: str) -> bool:
        return self.db.write(lambda c: self.invalidate_in(c, row_key))


def _escape_like(s: str) -> str:
    return s.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
