"""The local cache tier: one ``step_cache`` row per entry in the runtime database (rows owned by
``records._cache_index``, which holds their SQL; this module holds the tier's rules).

Invariants
- Row key: a ``shared``-scope row (admissible evidence, servable to any run using this database) is keyed by
  ``key_digest(dispatch key)``; a ``run-local`` row (evidence that failed admission, or a non-sealed tier) by
  ``key_digest(run_local_row_key(key, run_id))``, so a lookup of the dispatch key from any run never finds it.
  Run-local rows exist so their spilled blobs stay referenced (``gc``) while their run's attempt rows may replay
  them, and so ``explain`` can compare against them; the seam never serves them.
- Writes happen in the caller's transaction (``*_in(conn, ...)``): the dispatch seam records the row in the SAME
  transaction as the caller's attempt row and journal record. A shared row is
  first-writer-wins: an existing valid row is never overwritten — a different result is reported to the caller
  (:class:`DifferentResult`, the strict/nondeterministic decision is the seam's). An invalidated or undecodable
  row is replaced: it is no longer anybody's result.
- An invalidated row (``invalidated_at_ms`` set: stale read set, corrupt blob) is never served; it stays until a
  new result replaces it or ``gc`` removes it, so its blobs stay referenced meanwhile.
- Reads decode and verify (``decode_entry``): an undecodable row is reported, never served, with a warning naming
  its key digest.
- **The verified-hit memo trusts nothing the database may have changed.** :meth:`LocalTier.remember` keeps, per
  dispatch key, the entry this process last served from its row and the verification it passed, under the
  database's change token taken BEFORE that row was read (:class:`ChangeProbe`: SQLite's ``PRAGMA
  data_version`` on a dedicated connection that never writes, which changes on every commit of any other
  connection — this process's own pool, another process, a restore). :meth:`LocalTier.recall` returns it only while the token is still the same:
  no commit anywhere since the row was read, so the row is still exactly what was served (not invalidated,
  replaced, deleted or touched). PostgreSQL has no such token: nothing is remembered and every lookup reads.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Union

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import key_digest
from ..records import cache_index as cache_index
from ..records.cache_index import LocalRow, NewRow
from ..stores.database import Database
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
    "ChangeProbe",
    "ChangeToken",
    "Remembered",
    "MEMO_CAPACITY",
]

log = logging.getLogger(__name__)
_PAGE = 200
#: Verified hits remembered per local tier (oldest dropped first): a bound on memory, not on correctness.
MEMO_CAPACITY = 512

#: An opaque database change token: equal tokens mean no commit happened in between (see :class:`ChangeProbe`).
ChangeToken = tuple[int, int, int]


class ChangeProbe:
    """Whether anything was committed to a SQLite database since a token was taken, without querying any table.

    ``PRAGMA data_version`` of one connection changes whenever another connection commits (SQLite documents it
    for exactly this: detecting changes made by others). This probe's connection is dedicated, ``query_only``
    and never writes, so EVERY commit — of this process's pooled connections, of another process, of a restore
    (``smthrs recover restore`` writes through SQLite's backup API into the live file) — is "another
    connection's". The token carries the process id so a forked child never uses its parent's connection. Any
    failure to probe is "unknown" (None): the caller then reads the row, it never trusts a memo. One probe costs
    one pragma and no system call of its own: a hit's every release of the GIL is a chance to wait for another
    thread (Prefect's event and API threads) for a whole switch interval."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._generation = 0  # bumped per connection: versions of two connections are not comparable
        self._warned = False

    def token(self) -> ChangeToken | None:
        """The current token, or None when it cannot be known."""
        pid = os.getpid()
        with self._lock:
            try:
                conn = self._conn
                if conn is None or self._pid != pid:
                    # A forked child opens its own connection (a parent's is left alone, never closed here).
                    conn = self._conn = sqlite3.connect(
                        f"file:{self.path}?mode=rw", uri=True, isolation_level=None, check_same_thread=False
                    )
                    conn.execute("PRAGMA query_only = 1")
                    self._pid = pid
                    self._generation += 1
                version = conn.execute("PRAGMA data_version").fetchone()[0]
            except sqlite3.Error as exc:
                self._conn = None
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "cannot probe %s for changes (%s): every cache hit reads its row", self.path, exc
                    )
                return None
            generation = self._generation
        return (pid, generation, int(version))

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and self._pid == os.getpid():
                conn.close()


@dataclass(frozen=True)
class Remembered:
    """A local entry served and verified by this process under ``token`` (see the module invariants).
    ``verified``: what the verification established, for the caller to re-check (:mod:`._serve`)."""

    token: ChangeToken
    entry: CacheEntry
    last_used_at_ms: int
    verified: Any


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
        path = db.sqlite_path
        usable = path is not None and str(path) not in ("", ":memory:")
        self._probe: ChangeProbe | None = ChangeProbe(str(path)) if usable else None
        self._memo: dict[str, Remembered] = {}
        self._memo_lock = threading.Lock()

    # -- the verified-hit memo -------------------------------------------------------------------------------

    def change_token(self) -> ChangeToken | None:
        """The database's change token now (None: unknown, or not SQLite). Take it BEFORE reading a row."""
        return None if self._probe is None else self._probe.token()

    def remember(self, key: str, remembered: Remembered) -> None:
        """Remember a verified local hit of ``key`` (its token taken before its row was read)."""
        with self._memo_lock:
            self._memo.pop(key, None)
            if len(self._memo) >= MEMO_CAPACITY:
                self._memo.pop(next(iter(self._memo)))
            self._memo[key] = remembered

    def recall(self, key: str, token: ChangeToken | None) -> Remembered | None:
        """The remembered hit of ``key`` if nothing was committed since it was read (same ``token``)."""
        if token is None:
            return None
        found = self._memo.get(key)
        if found is None:
            return None
        if found.token != token:
            self.forget(key)
            return None
        return found

    def forget(self, key: str) -> None:
        with self._memo_lock:
            self._memo.pop(key, None)

    def close(self) -> None:
        """Release the change probe's connection (reopened lazily if used again)."""
        with self._memo_lock:
            self._memo.clear()
        if self._probe is not None:
            self._probe.close()

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
