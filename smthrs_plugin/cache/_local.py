"""The local cache tier: one ``step_cache`` row per entry in the runtime database (rows owned by
``records._cache_index``, which holds their SQL; this module holds the tier's rules).

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

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Union

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import key_digest
from ..records import _cache_index as cache_index
from ..records._cache_index import LocalRow, NewRow
from ..stores._database import Database
from ._entry import CacheEntry, Decoded, Undecodable, decode_entry, run_local_row_key

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
_PAGE = 200


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


class LocalTier:
    """The local cache tier of one database (its rows are the cache index, ``records._cache_index``)."""

    def __init__(self, db: Database, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.db = db
        self.clock = clock

    # -- serving ---------------------------------------------------------------------------------------------

    def lookup(self, key: str) -> LocalLookup:
        """The valid shared-scope row of ``key``: decoded and verified, undecodable, or None (absent/invalidated)."""
        name = key_digest(key)
        row = cache_index.served(self.db, name)
        if row is None:
            return None
        decoded = decode_entry(row.entry_json, name=name)
        if isinstance(decoded, Undecodable):
            log.warning("local cache row %s is not served: %s", name, decoded.reason)
            return LocalUndecodable(name, decoded.reason, decoded.corrupt)
        if decoded.scope != "shared":
            log.warning("local cache row %s is not served: its entry says scope %r", name, decoded.scope)
            return LocalUndecodable(name, f"its entry has scope {decoded.scope!r}", True)
        return LocalHit(decoded, row.last_used_at_ms)

    # -- writing (in the caller's transaction) ---------------------------------------------------------------

    def record_in(self, conn: Connection, entry: CacheEntry) -> RecordOutcome:
        """Record ``entry`` (see the module invariants for first-writer-wins and replacement)."""
        now = self.clock.now_ms()
        rk = row_key_of(entry)
        row = NewRow(
            key=entry.key,
            entry_json=entry.encode().decode("utf-8"),
            components=entry.components,
            run_id=entry.provenance.get("run_id"),
            provenance=entry.provenance,
            subject=entry.subject,
            scope=entry.scope,
        )
        existing = cache_index.stored_in(conn, rk)
        if existing is None:
            cache_index.insert_in(conn, rk, row, now)
            return Inserted()
        if entry.scope == "shared" and existing.invalidated_at_ms is None:
            old = decode_entry(existing.entry_json, name=rk)
            if isinstance(old, CacheEntry) and old.scope == "shared":
                if old.result == entry.result:
                    self.touch_in(conn, rk)
                    return SameResult()
                return DifferentResult(old)
            log.warning("replacing undecodable local cache row %s", rk)
        cache_index.replace_in(conn, rk, row, now)
        return Replaced()

    def touch_in(self, conn: Connection, row_key: str) -> None:
        """Refresh ``last_used_at_ms`` (what ``gc`` and ``ls`` read)."""
        cache_index.touch_in(conn, row_key, self.clock.now_ms())

    def invalidate_in(self, conn: Connection, row_key: str) -> bool:
        """Mark a row invalid (never served again); True when a valid row was invalidated."""
        return cache_index.invalidate_in(conn, row_key, self.clock.now_ms())

    def delete_in(self, conn: Connection, row_key: str) -> bool:
        return cache_index.delete_in(conn, row_key)

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
        return cache_index.rows(self.db, subject=subject, key=key, limit=limit, newest_first=newest_first)

    def subjects_ending_with(self, suffix: str) -> list[str]:
        """Distinct subjects equal to ``suffix`` or ending with ``/<suffix>`` (a node id inside a plan subject)."""
        return cache_index.subjects_ending_with(self.db, suffix)

    def load(self, row_key: str) -> Decoded | None:
        """The decoded entry of one row (any scope, invalidated included), or None when absent."""
        text = cache_index.entry_json(self.db, row_key)
        return None if text is None else decode_entry(text, name=None)

    def iter_entries(self) -> Iterator[tuple[LocalRow, Decoded]]:
        """Every row with its decoded entry, paged by key digest (bounded memory for gc/verify)."""
        after = ""
        while True:
            found = cache_index.page(self.db, after, _PAGE)
            if not found:
                return
            for row, text in found:
                yield row, decode_entry(text, name=None)
            after = found[-1][0].key_digest

    def invalidate(self, row_key: str) -> bool:
        return self.db.write(lambda c: self.invalidate_in(c, row_key))
