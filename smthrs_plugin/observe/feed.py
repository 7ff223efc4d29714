"""The run change feed: a coalesced, revision-ordered catch-up of run rows and their deletions.

Invariants:

- **Revisions are the clock.** Every run-row mutation takes the next global per-database revision in its own
  transaction (``records/runs.py``, which also holds this feed's statements), and writes are serialized, so revision order is commit order: in any read
  snapshot whose watermark is W, every mutation with a revision <= W is visible. :func:`changes_since` therefore
  returns, in ONE read transaction, the runs and tombstones with ``revision > r`` in revision order, and a
  consumer that continues from ``next_revision`` misses nothing and never goes back.
- **Coalesced state, not an event log.** One entry per run id carrying its LATEST revision: several writes may
  collapse into one entry, revisions of one run are not contiguous, and a run recreated after deletion appears
  once, live (its tombstone is older than the new row).
- **Tombstones forever.** A deletion stays visible to any consumer at any checkpoint; nothing here compacts them.
- **One source.** A checkpoint from another database, or one AHEAD of this database's revision (a restored or
  rewound source), is refused with ``source_changed``: the consumer must rebuild its projection explicitly.
- Page boundaries never split one revision: a page ends after the last entry of a revision (two entries share a
  revision only when one transaction changed several runs).

A consumer starting at revision 0 rebuilds the current set exactly: apply each change whose ``is_newer`` holds,
delete on ``deleted``, and store ``next_revision`` in the same local transaction as the projection.

Prior art: the reference's ``RunChangeFeed`` (catch up without losing deletions); Kubernetes'
list+watch from a resourceVersion; CouchDB's ``_changes`` feed with deletion stubs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ..errors import ControlError
from ..records.runs import changes_after_in, changes_at_in
from ..stores.database import Database
from ._cursor import check_limit, check_text
from .snapshot import is_newer, watermark_of

__all__ = ["FeedPosition", "Change", "ChangePage", "current", "changes_since", "is_newer", "MAX_LIMIT"]

MAX_LIMIT = 1000
_MAX_SAFE_INT = 2**53 - 1


@dataclass(frozen=True)
class FeedPosition:
    """A database's identity and its current revision (the watermark to catch up to)."""

    source: str
    revision: int


@dataclass(frozen=True)
class Change:
    """The latest state of one run id at ``revision``: live (``deleted=False``; read it with ``snapshot.read``)
    or deleted (a tombstone)."""

    run_id: str
    source: str
    revision: int
    deleted: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "source": self.source,
            "revision": self.revision,
            "deleted": self.deleted,
        }


@dataclass(frozen=True)
class ChangePage:
    """Changes after the requested revision, in revision order. Continue from ``next_revision`` while
    ``has_more``; ``revision`` is the source watermark observed by the same transaction."""

    changes: tuple[Change, ...]
    source: str
    revision: int
    next_revision: int
    has_more: bool


def current(db: Database) -> FeedPosition:
    """The source identity and the current revision, read together."""
    return FeedPosition(*db.read(watermark_of))


def changes_since(db: Database, source: str, revision: int, *, limit: int = 100) -> ChangePage:
    """Changes with ``revision`` strictly greater than ``revision`` (0 = from the beginning); limit 1..1000."""
    check_text("source", source)
    if not isinstance(revision, int) or isinstance(revision, bool) or not 0 <= revision <= _MAX_SAFE_INT:
        raise ControlError(
            "invalid_options", f"revision must be a non-negative int, got {revision!r}", option="revision"
        )
    check_limit(limit, maximum=MAX_LIMIT)

    def fn(conn: Connection) -> ChangePage:
        src, watermark = watermark_of(conn)
        if source != src:
            raise ControlError(
                "source_changed",
                f"this checkpoint belongs to database source {source!r}, but this database is {src!r}; rebuild the "
                "projection from revision 0 of the new source",
                cursor_source=source,
                source=src,
            )
        if revision > watermark:
            raise ControlError(
                "source_changed",
                f"checkpoint revision {revision} is ahead of this database's revision {watermark} (a restored or "
                "rewound copy); rebuild the projection from revision 0",
                source=src,
                revision=revision,
                watermark=watermark,
            )
        rows = changes_after_in(conn, revision, limit + 1)
        page, more = _cut(conn, rows, limit)
        changes = tuple(Change(rid, src, rev, deleted) for rev, rid, deleted in page)
        nxt = page[-1][0] if more else watermark
        return ChangePage(changes, src, watermark, nxt, more)

    return db.read(fn)


def _cut(
    conn: Connection, rows: list[tuple[int, str, bool]], limit: int
) -> tuple[list[tuple[int, str, bool]], bool]:
    if len(rows) <= limit:
        return rows, False
    page = rows[:limit]
    boundary = rows[limit][0]
    if page[-1][0] != boundary:
        return page, True
    # The lookahead shares the page's last revision: end the page before that revision; if the page holds
    # nothing else, return that whole revision instead (a page must make progress, and must not split it).
    trimmed = [row for row in page if row[0] != boundary]
    return (trimmed or changes_at_in(conn, boundary)), True
