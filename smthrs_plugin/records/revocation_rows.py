"""The remembered cache revocations' owner: every statement on ``cache_revocations`` and the only decoder of its rows.

Invariants:

- **One owner.** Every statement on ``cache_revocations`` is in this module; the cache's revocation view
  (``cache/revocation.py``) holds the rules (which markers are remembered, how they revoke) and calls these.
- **First sighting wins.** A marker name is recorded once (insert-if-absent): a later sighting — by this process,
  another process on the same database, or a body swapped at the same name in the bucket — never changes a row,
  so the cap of the first sighting stands.
- **Capped at write.** The stored ``revoked_at_ms`` is ``min(claimed, seen_at_ms)``: a row can never revoke an
  entry created after its reader first saw the marker by time (only by the entry ids it names).
- **A row that does not decode still revokes.** Its ``entries_json`` not being a list of strings (an edited or
  damaged database) comes back with ``problem`` set; the caller treats it as revoking its whole key digest — the
  database is never silently "repaired" and a revocation is never silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from .._untrusted import decode_json
from ..errors import InvalidInput
from ..stores.database import Database
from ..stores.schema import cache_revocations

__all__ = ["SeenRevocation", "RememberedRevocation", "remember", "remembered"]

_T = cache_revocations
_ALL = sa.select(_T).order_by(_T.c.marker)


@dataclass(frozen=True)
class SeenRevocation:
    """A well-formed marker as a reader saw it: ``claimed_at_ms`` as written in it, ``seen_at_ms`` the reader's
    clock at this sighting, ``source`` the revocation store it was listed in (for operators)."""

    marker: str
    key_digest: str
    key: str
    claimed_at_ms: int
    entries: tuple[str, ...]
    revoked_by: str
    reason: str
    source: str
    seen_at_ms: int


@dataclass(frozen=True)
class RememberedRevocation:
    """One stored row. ``problem`` is set when ``entries_json`` does not decode (``entries`` is then empty)."""

    marker: str
    key_digest: str
    key: str
    revoked_at_ms: int
    entries: tuple[str, ...]
    revoked_by: str
    reason: str
    source: str
    seen_at_ms: int
    problem: str | None = None


def remember(db: Database, seen: Sequence[SeenRevocation]) -> int:
    """Record every marker of ``seen`` not recorded yet (one transaction); returns how many rows were added."""
    if not seen:
        return 0

    def tx(conn: Any) -> int:
        added = 0
        for s in seen:
            res = conn.execute(
                db.insert_ignore(_T).values(
                    marker=s.marker,
                    key_digest=s.key_digest,
                    key=s.key,
                    revoked_at_ms=min(s.claimed_at_ms, s.seen_at_ms),
                    entries_json=json.dumps(list(s.entries), separators=(",", ":")),
                    revoked_by=s.revoked_by,
                    reason=s.reason,
                    source=s.source,
                    seen_at_ms=s.seen_at_ms,
                )
            )
            added += max(res.rowcount, 0)
        return added

    return db.write(tx)


def remembered(db: Database) -> list[RememberedRevocation]:
    """Every remembered marker, by name."""
    return [_row(r) for r in db.read(lambda c: c.execute(_ALL).all())]


def _row(r: Any) -> RememberedRevocation:
    entries: tuple[str, ...] = ()
    problem: str | None = None
    try:
        doc = decode_json(r.entries_json, f"remembered revocation {r.marker}")
    except InvalidInput as exc:
        problem = str(exc)
    else:
        if isinstance(doc, list) and all(isinstance(e, str) for e in doc):
            entries = tuple(doc)
        else:
            problem = f"remembered revocation {r.marker}: entries_json is not a list of entry ids"
    return RememberedRevocation(
        marker=r.marker,
        key_digest=r.key_digest,
        key=r.key,
        revoked_at_ms=int(r.revoked_at_ms),
        entries=entries,
        revoked_by=r.revoked_by,
        reason=r.reason,
        source=r.source,
        seen_at_ms=int(r.seen_at_ms),
        problem=problem,
    )
