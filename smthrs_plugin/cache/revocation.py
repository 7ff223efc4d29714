"""Revocation of cache keys in the shared tier: ``smthrs cache revoke KEY_OR_NODE``, seen by every reader.

A revocation is an unsigned marker document in the shared tier's ``revoked/`` area naming the key, its time
(``revoked_at_ms``) and the entry ids (:func:`~.entry.entry_id`) of the copies the revoker saw. The exact rules are
in docs/rules.md ("Revocation markers").

- An entry of a revoked key created at or before the revocation, or named by the marker, is treated as absent by
  readers and by the publisher (never served, never compared against); the re-executed result is served again.
- A marker never breaks a reader: a bad one is a :class:`Revocation` with ``problem`` set (revoking every entry of
  its key digest while it is in the bucket), never an exception out of :meth:`Revocations.refresh`.
- With a ``memory`` (the reader's database), well-formed markers are remembered and keep revoking after deletion.
- A shared lookup always re-lists the markers; a local hit consults a snapshot re-listed at most every
  ``refresh_ms`` of the injected clock.
- Listing failures propagate as ``ArtifactError``, local database failures as ``StoreError``; the caller decides.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._clock import SYSTEM_CLOCK, Clock
from .._untrusted import decode_json
from ..canonical import canonical_bytes, is_key, key_digest, sha256_hex
from ..errors import ArtifactError, InvalidInput
from ..records import revocation_rows as revocation_rows
from ..records.revocation_rows import RememberedRevocation, SeenRevocation
from ..stores.artifacts import UNREADABLE_ENTRY, ArtifactStore, Created
from ..stores.database import Database
from .entry import CacheEntry, entry_id

__all__ = [
    "REVOCATION_FORMAT",
    "MAX_MARKER_BYTES",
    "Revocation",
    "Revocations",
    "revocation_store",
    "DEFAULT_REFRESH_MS",
]

log = logging.getLogger(__name__)

REVOCATION_FORMAT = "smthrs-cache-revocation/1"
DEFAULT_REFRESH_MS = 60_000
#: A marker body larger than this is a marker with a problem, never read further (an honest marker holds one key
#: and one 64-hex entry id per publisher: a few KiB).
MAX_MARKER_BYTES = 1024 * 1024
_FOREVER = 2**62
_ENTRY_ID = re.compile(r"[0-9a-f]{64}")


def revocation_store(shared: ArtifactStore) -> ArtifactStore:
    """The artifact store holding the markers of the shared tier ``shared`` (``<url>/revoked``)."""
    return ArtifactStore(shared.url.rstrip("/") + "/revoked", shared.storage_options)


@dataclass(frozen=True)
class Revocation:
    """One marker. ``problem`` is set for a marker that is unreadable or malformed (it then revokes its whole
    digest); ``remembered``: this is the local database's record of a marker (capped), not the bucket's body."""

    name: str
    key_digest: str
    key: str | None
    revoked_at_ms: int
    entries: tuple[str, ...] = ()
    by: str = ""
    reason: str = ""
    problem: str | None = None
    remembered: bool = False

    def covers(self, entry: CacheEntry, eid: Callable[[], str]) -> bool:
        """Whether this marker revokes ``entry`` (``eid`` computes its entry id only when needed)."""
        if self.problem is not None:
            return True
        created = entry.provenance.get("created_at_ms")
        if type(created) is not int or created <= self.revoked_at_ms:
            return True
        return bool(self.entries) and eid() in self.entries

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "key_digest": self.key_digest,
            "revoked_at_ms": None if self.problem is not None else self.revoked_at_ms,
            "entries": list(self.entries),
            "by": self.by,
            "reason": self.reason,
            "problem": self.problem,
            "remembered": self.remembered,
        }


def _problem(name: str, why: str) -> Revocation:
    return Revocation(name, name.split(".", 1)[0], None, _FOREVER, problem=why)


def _malformed(doc: Any, digest: str) -> str | None:
    """Why ``doc`` is not a well-formed marker of ``digest`` (None: it is)."""
    if not isinstance(doc, Mapping) or doc.get("format") != REVOCATION_FORMAT:
        return f"not a {REVOCATION_FORMAT} document"
    if not is_key(doc.get("key")) or key_digest(doc["key"]) != digest:
        return "its key is not a key1_ key of the key digest its name carries"
    at = doc.get("revoked_at_ms")
    if type(at) is not int or at < 0:
        return "revoked_at_ms is not a non-negative integer"
    entries = doc.get("entries")
    if not isinstance(entries, list) or not all(type(e) is str and _ENTRY_ID.fullmatch(e) for e in entries):
        return "entries is not a list of entry ids (64 lowercase hex)"
    if type(doc.get("by", "")) is not str or type(doc.get("reason", "")) is not str:
        return "by / reason are not strings"
    return None


def _decode(name: str, data: bytes) -> Revocation:
    digest = name.split(".", 1)[0]
    try:
        doc = decode_json(data, f"revocation marker {name}", max_bytes=MAX_MARKER_BYTES)
    except InvalidInput as exc:
        return _problem(name, str(exc))
    why = _malformed(doc, digest)
    if why is not None:
        return _problem(name, why)
    return Revocation(
        name,
        digest,
        doc["key"],
        doc["revoked_at_ms"],
        tuple(doc["entries"]),
        doc.get("by", ""),
        doc.get("reason", ""),
    )


def _from_row(row: RememberedRevocation) -> Revocation:
    return Revocation(
        row.marker,
        row.key_digest,
        row.key,
        _FOREVER if row.problem is not None else row.revoked_at_ms,
        row.entries,
        row.revoked_by,
        row.reason,
        row.problem,
        remembered=True,
    )


class Revocations:
    """The revocation markers of one shared tier, with a bounded-staleness snapshot (module invariants).

    ``memory``: the reader's local database; markers seen are remembered there and honoured after they are
    deleted from the bucket. None: only the bucket's markers count (maintenance without a database)."""

    def __init__(
        self,
        store: ArtifactStore,
        *,
        clock: Clock = SYSTEM_CLOCK,
        refresh_ms: int = DEFAULT_REFRESH_MS,
        memory: Database | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.refresh_ms = refresh_ms
        self.memory = memory
        self._lock = threading.Lock()
        self._bodies: dict[str, Revocation] = {}  # markers are immutable: read each once
        self._remembered: tuple[Revocation, ...] = ()
        self._by_digest: dict[str, tuple[Revocation, ...]] = {}
        self._listed_at_ms: int | None = None
        self._warned_rows: set[str] = set()

    def refresh(self) -> None:
        """List the markers now (reads the bodies of new ones, remembers the well-formed ones), then re-read what
        the local database remembers. Raises ``ArtifactError`` (the store) or ``StoreError`` (the database)."""
        names = self.store.list_entries()
        known = self._bodies
        fresh: dict[str, Revocation] = {}
        new: list[Revocation] = []
        for name in names:
            marker = known.get(name)
            if marker is None:
                marker = self._read(name)
                if marker is None:
                    continue  # deleted between listing and reading: an operator withdrew it
                new.append(marker)
            fresh[name] = marker
        remembered = self._recall(new)
        by_digest: dict[str, list[Revocation]] = {}
        for r in (
            *fresh.values(),
            *remembered,
        ):  # the bucket's markers first: they name themselves in refusals
            by_digest.setdefault(r.key_digest, []).append(r)
        with self._lock:
            self._bodies = fresh
            self._remembered = remembered
            self._by_digest = {d: tuple(rs) for d, rs in by_digest.items()}
            self._listed_at_ms = self.clock.now_ms()

    def _read(self, name: str) -> Revocation | None:
        """The marker at ``name`` (None: gone); a body that is too large, not a file or malformed is a marker
        with a problem, logged — never an exception."""
        try:
            data = self.store.get_entry(name, max_bytes=MAX_MARKER_BYTES)
        except ArtifactError as exc:
            if exc.code not in UNREADABLE_ENTRY:
                raise
            marker = _problem(name, str(exc))
        else:
            if data is None:
                return None
            marker = _decode(name, data)
        if marker.problem is not None:
            log.warning(
                "revocation marker %s in %s is refused (%s): every entry of its key is treated as revoked while"
                " it is there; remove it if nobody revoked that key",
                name,
                self.store.url,
                marker.problem,
            )
        return marker

    def _recall(self, new: Iterable[Revocation]) -> tuple[Revocation, ...]:
        """Remember the well-formed markers among ``new`` (first sighting wins) and return every remembered one."""
        if self.memory is None:
            return ()
        rows = revocation_rows.remembered(self.memory)
        have = {r.marker for r in rows}
        now = self.clock.now_ms()
        # Invariant 1: a marker with a problem is never remembered.
        seen = [self._seen(m, now) for m in new if m.problem is None and m.name not in have]
        if seen and revocation_rows.remember(self.memory, seen):
            rows = revocation_rows.remembered(self.memory)
        for row in rows:
            if row.problem is not None and row.marker not in self._warned_rows:
                self._warned_rows.add(row.marker)
                log.warning(
                    "remembered revocation %s in %s does not decode (%s): every entry of its key stays revoked;"
                    " delete the row from cache_revocations if nobody revoked that key",
                    row.marker,
                    self.memory,
                    row.problem,
                )
        return tuple(_from_row(r) for r in rows)

    def _seen(self, marker: Revocation, now_ms: int) -> SeenRevocation:
        assert marker.key is not None  # a marker without a problem decoded its key
        return SeenRevocation(
            marker=marker.name,
            key_digest=marker.key_digest,
            key=marker.key,
            claimed_at_ms=marker.revoked_at_ms,
            entries=marker.entries,
            revoked_by=marker.by,
            reason=marker.reason,
            source=self.store.url,
            seen_at_ms=now_ms,
        )

    def stale(self) -> bool:
        """Whether the snapshot is older than ``refresh_ms`` (or was never taken)."""
        at = self._listed_at_ms
        return at is None or self.clock.now_ms() - at >= self.refresh_ms

    def mark_listed(self) -> None:
        """Count a failed listing as an attempt: the next one waits ``refresh_ms`` (a local hit must not pay a
        failing round trip every time)."""
        with self._lock:
            self._listed_at_ms = self.clock.now_ms()

    def revoking(self, entry: CacheEntry, *, fresh: bool) -> Revocation | None:
        """The marker revoking ``entry``, or None. ``fresh``: list the markers now (shared lookups); otherwise the
        snapshot is used, re-listed only when :meth:`stale` (local hits). Raises ``ArtifactError``."""
        if fresh or self.stale():
            self.refresh()
        markers = self._by_digest.get(entry.name)
        if not markers:
            return None
        cached: list[str] = []

        def eid() -> str:
            if not cached:
                cached.append(entry_id(entry))
            return cached[0]

        return next((r for r in markers if r.covers(entry, eid)), None)

    def revoke(self, key: str, entries: Iterable[str], *, by: str, reason: str = "") -> Revocation:
        """Write a marker revoking ``key`` now (plus the named entry ids), and remember it in the local database at
        once. Raises ``ArtifactError``."""
        now = self.clock.now_ms()
        doc = {
            "format": REVOCATION_FORMAT,
            "key": key,
            "revoked_at_ms": now,
            "entries": sorted(set(entries)),
            "by": by,
            "reason": reason,
        }
        data = canonical_bytes(doc)
        name = f"{key_digest(key)}.{sha256_hex(data)[:16]}"
        outcome = self.store.put_entry(name, data)
        body = data if isinstance(outcome, Created) else outcome.data
        marker = _decode(name, body)
        remembered = self._recall([marker])  # invariant 5 (a problem body at our name is not remembered: 1)
        with self._lock:
            self._bodies[name] = marker
            self._remembered = remembered
            self._by_digest[marker.key_digest] = (
                *(r for r in self._by_digest.get(marker.key_digest, ()) if not r.remembered),
                marker,
                *(r for r in remembered if r.key_digest == marker.key_digest),
            )
        return marker

    def all(self) -> list[Revocation]:
        """Every marker, listed now, sorted by name: the bucket's, then the remembered ones no longer in it."""
        self.refresh()
        live = [self._bodies[n] for n in sorted(self._bodies)]
        return live + [r for r in self._remembered if r.name not in self._bodies]
