"""Revocation of cache keys in the shared tier: ``smthrs cache revoke KEY_OR_NODE``, seen by every reader.

A revocation is a marker document in the shared tier's ``revoked/`` area (an artifact store rooted at
``<shared url>/revoked``, entries ``revoked/ac/<key digest>.<marker id>.json``, created if absent, never
overwritten). It names the key, the time it was made (``revoked_at_ms``, the revoker's clock) and the entry ids
(:func:`~.entry.entry_id`) of every copy of the key the revoker could see.

Invariants
- An entry of a revoked key is revoked when it was created at or before the revocation (``provenance.created_at_ms``
  — signed by its publisher) OR its entry id is named by the marker. Both readers and the shared tier's
  publisher treat a revoked entry as absent: it is never served and never compared against, the work
  re-executes, and the re-executed result (created later) is published and served again. An entry whose
  ``created_at_ms`` is missing or malformed counts as revoked (the conservative side).
- Markers are not signed and any marker is honoured: a revocation can only make a reader re-execute, which a
  writer of the bucket could cause anyway by deleting entries. A marker that does not decode revokes every entry
  of the key digest its name carries (and ``verify`` lists it).
- **Bounded staleness, documented**: a shared lookup always re-lists the markers (one listing per lookup that
  found a verified entry). A LOCAL hit — which must not pay a round trip to the shared tier — consults this
  process's snapshot, re-listed at most every ``refresh_ms`` of the injected clock (``SMTHRS_CACHE_REVOCATION_
  REFRESH_S``, default 60 s). A revocation therefore reaches a machine's local copies within that interval; the
  revoking machine invalidates its own local row at once.
- Listing failures propagate as ``ArtifactError``; the caller decides (the dispatcher warns and keeps the
  previous snapshot for a local hit, treats the shared tier as unavailable for a shared lookup).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import canonical_bytes, is_key, key_digest, sha256_hex
from ..stores._artifacts import ArtifactStore, Created
from ._entry import CacheEntry, entry_id

__all__ = [
    "REVOCATION_FORMAT",
    "Revocation",
    "Revocations",
    "revocation_store",
    "DEFAULT_REFRESH_MS",
]

log = logging.getLogger(__name__)

REVOCATION_FORMAT = "smthrs-cache-revocation/1"
DEFAULT_REFRESH_MS = 60_000
_FOREVER = 2**62


def revocation_store(shared: ArtifactStore) -> ArtifactStore:
    """The artifact store holding the markers of the shared tier ``shared`` (``<url>/revoked``)."""
    return ArtifactStore(shared.url.rstrip("/") + "/revoked", shared.storage_options)


@dataclass(frozen=True)
class Revocation:
    """One marker. ``problem`` is set for a marker that does not decode (it then revokes its whole digest)."""

    name: str
    key_digest: str
    key: str | None
    revoked_at_ms: int
    entries: tuple[str, ...] = ()
    by: str = ""
    reason: str = ""
    problem: str | None = None

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
        }


def _decode(name: str, data: bytes) -> Revocation:
    digest = name.split(".", 1)[0]
    try:
        doc = json.loads(data)
        if (
            not isinstance(doc, Mapping)
            or doc.get("format") != REVOCATION_FORMAT
            or not is_key(doc.get("key"))
            or key_digest(doc["key"]) != digest
            or type(doc.get("revoked_at_ms")) is not int
            or not isinstance(doc.get("entries"), list)
            or not all(isinstance(e, str) for e in doc["entries"])
        ):
            raise ValueError("not a revocation marker of the key digest its name carries")
    except (ValueError, UnicodeDecodeError) as exc:
        return Revocation(name, digest, None, _FOREVER, problem=str(exc))
    return Revocation(
        name,
        digest,
        doc["key"],
        doc["revoked_at_ms"],
        tuple(doc["entries"]),
        str(doc.get("by", "")),
        str(doc.get("reason", "")),
    )


class Revocations:
    """The revocation markers of one shared tier, with a bounded-staleness snapshot (module invariants)."""

    def __init__(
        self, store: ArtifactStore, *, clock: Clock = SYSTEM_CLOCK, refresh_ms: int = DEFAULT_REFRESH_MS
    ) -> None:
        self.store = store
        self.clock = clock
        self.refresh_ms = refresh_ms
        self._lock = threading.Lock()
        self._bodies: dict[str, Revocation] = {}  # markers are immutable: read each once
        self._by_digest: dict[str, tuple[Revocation, ...]] = {}
        self._listed_at_ms: int | None = None

    def refresh(self) -> None:
        """List the markers now (reads the bodies of new ones). Raises ``ArtifactError``."""
        names = self.store.list_entries()
        fresh: dict[str, Revocation] = {}
        for name in names:
            known = self._bodies.get(name)
            if known is None:
                data = self.store.get_entry(name)
                if data is None:
                    continue  # deleted between listing and reading: an operator withdrew it
                known = _decode(name, data)
                if known.problem is not None:
                    log.warning(
                        "revocation marker %s in %s does not decode (%s): every entry of its key is treated"
                        " as revoked",
                        name,
                        self.store.url,
                        known.problem,
                    )
            fresh[name] = known
        by_digest: dict[str, list[Revocation]] = {}
        for r in fresh.values():
            by_digest.setdefault(r.key_digest, []).append(r)
        with self._lock:
            self._bodies = fresh
            self._by_digest = {d: tuple(rs) for d, rs in by_digest.items()}
            self._listed_at_ms = self.clock.now_ms()

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
        """Write a marker revoking ``key`` now (plus the named entry ids). Raises ``ArtifactError``."""
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
        with self._lock:
            self._bodies[name] = marker
            self._by_digest[marker.key_digest] = (*self._by_digest.get(marker.key_digest, ()), marker)
        return marker

    def all(self) -> list[Revocation]:
        """Every marker, listed now, sorted by name."""
        self.refresh()
        return [self._bodies[n] for n in sorted(self._bodies)]
